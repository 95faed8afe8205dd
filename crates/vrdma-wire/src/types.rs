//! Newtypes for the numbers the transport carries, so that a QPN cannot be
//! passed where a PSN is expected and a 24-bit field cannot hold 25 bits.
//!
//! Every newtype is built through `TryFrom` (checked) or a masking
//! constructor whose name says it masks; the inner value always satisfies
//! the field's width.

use core::{cmp::Ordering, fmt, net::Ipv6Addr};

use crate::{Error, Result};

const MASK_24: u32 = 0x00ff_ffff;

macro_rules! u24_newtype {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Default, Eq, Hash, PartialEq)]
        pub struct $name(u32);

        impl $name {
            /// The largest value the 24-bit field holds.
            pub const MAX: Self = Self(MASK_24);

            /// Keeps the low 24 bits of `v` (for values read from a 24-bit
            /// field, or deliberate wrap-around).
            pub const fn from_masked(v: u32) -> Self {
                Self(v & MASK_24)
            }

            /// The value as a `u32` below 2^24.
            pub const fn value(self) -> u32 {
                self.0
            }
        }

        impl TryFrom<u32> for $name {
            type Error = Error;
            fn try_from(v: u32) -> Result<Self> {
                if v > MASK_24 {
                    Err(Error::OutOfRange { what: $what, value: u64::from(v) })
                } else {
                    Ok(Self(v))
                }
            }
        }

        impl From<$name> for u32 {
            fn from(v: $name) -> u32 {
                v.0
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:#08x})", stringify!($name), self.0)
            }
        }
    };
}

u24_newtype!(
    /// Packet sequence number: 24 bits, compared and advanced modulo 2^24.
    ///
    /// Order is serial-number arithmetic (IBTA Vol1 §9.7.1): `a` precedes
    /// `b` when `b` is less than 2^23 steps ahead of `a`. That relation is
    /// not transitive around the whole circle, so `Psn` deliberately does
    /// not implement `PartialOrd`/`Ord` (sorting or a `BTreeMap` would
    /// misbehave): compare with [`Psn::precedes`], [`Psn::compare`] or
    /// [`Psn::distance`], which are meaningful within a window of 2^23.
    Psn,
    "a 24-bit PSN"
);
u24_newtype!(
    /// Queue pair number (24 bits). QP0 and QP1 are the special QPs.
    Qpn,
    "a 24-bit QPN"
);
u24_newtype!(
    /// Message sequence number carried in the AETH (24 bits, wrapping).
    Msn,
    "a 24-bit MSN"
);
u24_newtype!(
    /// VXLAN Network Identifier: the 24-bit segment a VXLAN header names
    /// (RFC 7348 §5).
    Vni,
    "a 24-bit VNI"
);

impl Psn {
    /// Half of the PSN space: the window within which order is defined.
    pub const HALF: u32 = 1 << 23;

    /// `self + n` modulo 2^24.
    pub const fn wrapping_add(self, n: u32) -> Self {
        Self(self.0.wrapping_add(n) & MASK_24)
    }

    /// `self - n` modulo 2^24.
    pub const fn wrapping_sub(self, n: u32) -> Self {
        Self(self.0.wrapping_sub(n) & MASK_24)
    }

    /// The next PSN.
    pub const fn next(self) -> Self {
        self.wrapping_add(1)
    }

    /// Steps forward from `self` to `other`, modulo 2^24 (in `0..2^24`).
    pub const fn forward_distance(self, other: Self) -> u32 {
        other.0.wrapping_sub(self.0) & MASK_24
    }

    /// Signed distance from `self` to `other` in `-2^23..2^23`, or `None`
    /// when they are exactly 2^23 apart.
    pub const fn distance(self, other: Self) -> Option<i32> {
        let d = self.forward_distance(other);
        if d == Self::HALF {
            None
        } else if d < Self::HALF {
            // d < 2^23 fits an i32.
            Some(d.cast_signed())
        } else {
            // d in (2^23, 2^24): the negative distance 2^24 - d fits an i32.
            Some(-(MASK_24 + 1 - d).cast_signed())
        }
    }
}

impl Psn {
    /// Serial-number comparison: `Less` when `self` precedes `other`,
    /// `Greater` when it follows, `None` when they are exactly 2^23 apart.
    pub const fn compare(self, other: Self) -> Option<Ordering> {
        match self.distance(other) {
            None => None,
            Some(0) => Some(Ordering::Equal),
            Some(d) if d > 0 => Some(Ordering::Less),
            Some(_) => Some(Ordering::Greater),
        }
    }

    /// True when `other` is 1..2^23 steps ahead of `self`.
    pub const fn precedes(self, other: Self) -> bool {
        matches!(self.compare(other), Some(Ordering::Less))
    }
}

impl Msn {
    /// `self + n` modulo 2^24.
    pub const fn wrapping_add(self, n: u32) -> Self {
        Self(self.0.wrapping_add(n) & MASK_24)
    }
}

impl Qpn {
    /// QP0, the subnet management QP (unused on RoCE).
    pub const SMI: Self = Self(0);
    /// QP1, the general services QP (CM MADs on RoCE).
    pub const GSI: Self = Self(1);
}

macro_rules! key_newtype {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        ///
        /// The 32 bits are a 24-bit index into the device's table and an
        /// 8-bit key that changes each time the index is re-used.
        #[derive(Clone, Copy, Default, Eq, Hash, PartialEq)]
        pub struct $name(pub u32);

        impl $name {
            /// Builds a key from its table index (24 bits, masked) and key byte.
            pub const fn new(index: u32, key: u8) -> Self {
                Self(((index & MASK_24) << 8) | key as u32)
            }

            /// The 24-bit table index.
            pub const fn index(self) -> u32 {
                self.0 >> 8
            }

            /// The 8-bit key.
            pub const fn key(self) -> u8 {
                // Truncation to the low byte is the point.
                (self.0 & 0xff) as u8
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:#010x})", stringify!($name), self.0)
            }
        }
    };
}

key_newtype!(
    /// Local key: names a memory region to the device for local access.
    Lkey
);
key_newtype!(
    /// Remote key: names a memory region or window to a remote peer.
    Rkey
);

/// Partition key (16 bits): bit 15 is full membership, bits 0..15 the base.
#[derive(Clone, Copy, Eq, Hash, PartialEq)]
pub struct PKey(pub u16);

impl PKey {
    /// The default partition, full member: what rxe and RoCE NICs send.
    pub const DEFAULT: Self = Self(0xffff);
    /// The invalid partition key.
    pub const INVALID: Self = Self(0);

    /// Bit 15: full (1) or limited (0) membership.
    pub const fn full_member(self) -> bool {
        self.0 & 0x8000 != 0
    }

    /// The partition, without the membership bit.
    pub const fn base(self) -> u16 {
        self.0 & 0x7fff
    }

    /// IBTA Vol1 §10.9.3: keys match when bases are equal, neither is
    /// invalid, and at least one side is a full member.
    pub const fn matches(self, other: Self) -> bool {
        self.base() == other.base()
            && self.base() != 0
            && (self.full_member() || other.full_member())
    }
}

impl fmt::Debug for PKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PKey({:#06x})", self.0)
    }
}

/// Queue key of a UD QP (32 bits). Bit 31 marks a controlled Q_Key, which
/// an unprivileged consumer may not send (IBTA Vol1 §10.2.5).
#[derive(Clone, Copy, Default, Eq, Hash, PartialEq)]
pub struct QKey(pub u32);

impl QKey {
    /// True for controlled Q_Keys (high bit set).
    pub const fn is_controlled(self) -> bool {
        self.0 & 0x8000_0000 != 0
    }
}

impl fmt::Debug for QKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "QKey({:#010x})", self.0)
    }
}

/// A 128-bit global identifier. For RoCEv2 it is the IPv6 address, or the
/// IPv4-mapped IPv6 address (`::ffff:a.b.c.d`) of an IPv4 interface.
#[derive(Clone, Copy, Default, Eq, Hash, PartialEq)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The IPv4 address when the GID is IPv4-mapped (`::ffff:a.b.c.d`,
    /// as `Ipv6Addr::to_ipv4_mapped`, matched on the bytes: the fabrics
    /// ask this for every packet they send).
    #[inline]
    pub fn to_ipv4(self) -> Option<core::net::Ipv4Addr> {
        match self.0 {
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a, b, c, d] => {
                Some(core::net::Ipv4Addr::new(a, b, c, d))
            }
            _ => None,
        }
    }
}

impl Gid {
    /// The IP address it stands for: IPv4 for an IPv4-mapped GID, else
    /// IPv6.
    pub fn ip(self) -> core::net::IpAddr {
        match self.to_ipv4() {
            Some(a) => a.into(),
            None => Ipv6Addr::from(self.0).into(),
        }
    }
}

impl From<Ipv6Addr> for Gid {
    fn from(a: Ipv6Addr) -> Self {
        Gid(a.octets())
    }
}

impl From<core::net::Ipv4Addr> for Gid {
    fn from(a: core::net::Ipv4Addr) -> Self {
        Gid(a.to_ipv6_mapped().octets())
    }
}

impl From<core::net::IpAddr> for Gid {
    /// IPv4 addresses become IPv4-mapped GIDs, as RoCEv2 writes them.
    fn from(a: core::net::IpAddr) -> Self {
        match a {
            core::net::IpAddr::V4(a) => a.into(),
            core::net::IpAddr::V6(a) => a.into(),
        }
    }
}

impl From<Gid> for Ipv6Addr {
    fn from(g: Gid) -> Self {
        Ipv6Addr::from(g.0)
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({})", Ipv6Addr::from(self.0))
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&Ipv6Addr::from(self.0), f)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn psn() -> impl Strategy<Value = Psn> {
        (0..=MASK_24).prop_map(Psn::from_masked)
    }

    #[test]
    fn psn_rejects_25_bits() {
        assert_eq!(
            Psn::try_from(1 << 24),
            Err(Error::OutOfRange {
                what: "a 24-bit PSN",
                value: 1 << 24
            })
        );
        assert_eq!(Psn::try_from(MASK_24).map(Psn::value), Ok(MASK_24));
    }

    #[test]
    fn psn_wraps_at_2_24() {
        assert_eq!(Psn::MAX.next(), Psn::from_masked(0));
        assert!(Psn::MAX.precedes(Psn::from_masked(0)));
        assert!(!Psn::from_masked(0).precedes(Psn::MAX));
        assert_eq!(Psn::MAX.distance(Psn::from_masked(5)), Some(6));
        assert_eq!(Psn::from_masked(5).distance(Psn::MAX), Some(-6));
        assert_eq!(Psn::from_masked(3).wrapping_sub(4), Psn::MAX);
    }

    #[test]
    fn psn_half_apart_is_incomparable() {
        let a = Psn::from_masked(10);
        let b = a.wrapping_add(Psn::HALF);
        assert_eq!(a.compare(b), None);
        assert_eq!(b.compare(a), None);
        assert!(!a.precedes(b) && !b.precedes(a));
        assert!(a.precedes(a.wrapping_add(Psn::HALF - 1)));
        assert!(a.wrapping_add(Psn::HALF + 1).precedes(a));
    }

    #[test]
    fn keys_split_into_index_and_key() {
        let k = Rkey::new(0x12_3456, 0x78);
        assert_eq!(k.0, 0x1234_5678);
        assert_eq!((k.index(), k.key()), (0x12_3456, 0x78));
        assert_eq!(Lkey::new(0xffff_ffff, 1).index(), 0xff_ffff);
    }

    #[test]
    fn pkey_matching_follows_membership() {
        assert!(PKey::DEFAULT.matches(PKey::DEFAULT));
        assert!(PKey(0x7fff).matches(PKey(0xffff)));
        assert!(!PKey(0x7fff).matches(PKey(0x7fff)), "two limited members");
        assert!(!PKey(0x8000).matches(PKey(0x8000)), "invalid base");
        assert!(!PKey(0xffff).matches(PKey(0xfffe)));
    }

    #[test]
    fn gid_maps_ipv4() {
        let g = Gid::from(core::net::Ipv4Addr::new(10, 47, 91, 11));
        assert_eq!(g.to_string(), "::ffff:10.47.91.11");
        assert_eq!(g.to_ipv4(), Some(core::net::Ipv4Addr::new(10, 47, 91, 11)));
    }

    proptest! {
        #[test]
        fn gid_to_ipv4_is_the_standard_mapping(
            raw in any::<[u8; 16]>(),
            v4 in any::<[u8; 4]>(),
            mapped in any::<bool>(),
        ) {
            let mut bytes = raw;
            if mapped {
                bytes[..10].fill(0);
                bytes[10..12].fill(0xff);
                bytes[12..].copy_from_slice(&v4);
            }
            prop_assert_eq!(Gid(bytes).to_ipv4(), Ipv6Addr::from(bytes).to_ipv4_mapped());
        }

        #[test]
        fn psn_successor_is_greater(a in psn(), k in 1..Psn::HALF) {
            let b = a.wrapping_add(k);
            prop_assert!(a.precedes(b));
            prop_assert!(!b.precedes(a));
            prop_assert_eq!(b.compare(a), Some(Ordering::Greater));
            prop_assert_eq!(a.distance(b), Some(i32::try_from(k).unwrap()));
        }

        #[test]
        fn psn_order_is_antisymmetric_and_total_off_the_half(a in psn(), b in psn()) {
            let d = a.forward_distance(b);
            match (a.compare(b), b.compare(a)) {
                (Some(x), Some(y)) => prop_assert_eq!(x, y.reverse()),
                (None, None) => prop_assert_eq!(d, Psn::HALF),
                other => prop_assert!(false, "asymmetric comparability {other:?}"),
            }
            prop_assert_eq!(a == b, a.compare(b) == Some(Ordering::Equal));
        }

        #[test]
        fn psn_order_is_translation_invariant(a in psn(), b in psn(), k in 0..=MASK_24) {
            prop_assert_eq!(a.compare(b), a.wrapping_add(k).compare(b.wrapping_add(k)));
        }

        #[test]
        fn psn_order_is_transitive_within_a_window(
            a in psn(), x in 0..Psn::HALF / 2, y in 0..Psn::HALF / 2,
        ) {
            // Within a window narrower than 2^23 the order is a total order.
            let b = a.wrapping_add(x);
            let c = b.wrapping_add(y);
            let le = |p: Psn, q: Psn| p == q || p.precedes(q);
            prop_assert!(le(a, b) && le(b, c) && le(a, c));
        }

        #[test]
        fn psn_add_sub_round_trip(a in psn(), k in any::<u32>()) {
            prop_assert_eq!(a.wrapping_add(k).wrapping_sub(k), a);
            prop_assert!(a.wrapping_add(k).value() <= MASK_24);
        }
    }
}
