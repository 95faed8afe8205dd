//! Access rights of memory regions and windows (`enum ibv_access_flags`,
//! same bits), and of QPs for remote operations.

/// Access rights of an MR or MW (`enum ibv_access_flags`, same bits).
#[derive(Clone, Copy, Default, Eq, Hash, PartialEq)]
pub struct Access(pub u32);

impl Access {
    pub const LOCAL_WRITE: Self = Self(1 << 0);
    pub const REMOTE_WRITE: Self = Self(1 << 1);
    pub const REMOTE_READ: Self = Self(1 << 2);
    pub const REMOTE_ATOMIC: Self = Self(1 << 3);
    pub const MW_BIND: Self = Self(1 << 4);
    pub const ZERO_BASED: Self = Self(1 << 5);
    pub const NONE: Self = Self(0);

    /// The bits an MR registration may carry.
    pub(crate) const MR_BITS: u32 = 0x3f;

    pub const fn with(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }
}

impl core::ops::BitOr for Access {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        self.with(rhs)
    }
}

impl core::fmt::Debug for Access {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "Access({:#x})", self.0)
    }
}
