//! Memory regions: registration, address translation, and the protection
//! checks every local and remote access goes through.
//!
//! An lkey or rkey is a 24-bit index into the key table and an 8-bit key
//! (IBTA Vol1 §10.6.3.1). A new registration in a reused slot gets a new
//! key byte (the table's generation), so a key that outlived its MR names
//! nothing. For MRs the lkey and the rkey are the same number, as in rxe.

use vrdma_wire::{Lkey, Rkey};

use crate::{
    error::{Kind, Result, VerbsError},
    memory::{Memory, MemoryError},
    table::Table,
};

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
    const MR_BITS: u32 = 0x3f;

    pub const fn with(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// IBTA Vol1 §10.6.3.1 / C10-11: remote write or atomic rights need
    /// local write; unknown bits are refused.
    pub fn validate_for_mr(self) -> Result<Self> {
        if self.0 & !Self::MR_BITS != 0 {
            return Err(VerbsError::Invalid {
                what: "MR access flags (unknown bits)",
            });
        }
        let remote_write = Self::REMOTE_WRITE.with(Self::REMOTE_ATOMIC);
        if self.0 & remote_write.0 != 0 && !self.contains(Self::LOCAL_WRITE) {
            return Err(VerbsError::Invalid {
                what: "MR access flags (remote write or atomic without local write)",
            });
        }
        Ok(self)
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

/// How an MR's virtual addresses map to device addresses.
#[derive(Clone, Debug, Eq, PartialEq)]
pub enum Translation {
    /// Device address = virtual address (a DMA MR, or a process's own
    /// memory when the device runs inside it).
    Identity,
    /// Pages of `1 << page_shift` bytes; the MR's first byte is `offset`
    /// bytes into `pages[0]`. A guest registers user memory this way.
    Pages {
        page_shift: u8,
        offset: u64,
        pages: Vec<u64>,
    },
}

/// A registered memory region.
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct Mr {
    pub pd: u32,
    /// First virtual address (0 for zero-based MRs).
    pub iova: u64,
    pub length: u64,
    pub access: Access,
    pub translation: Translation,
    pub lkey: Lkey,
    pub rkey: Rkey,
}

/// How an access failed (each maps to a completion status or NAK by the
/// data path: local protection, remote access, length errors).
#[derive(Clone, Copy, Debug, Eq, PartialEq, thiserror::Error)]
pub enum AccessError {
    /// No MR (or a stale one) behind the key.
    #[error("invalid key {0:#010x}")]
    InvalidKey(u32),
    /// The MR belongs to another protection domain.
    #[error("key {key:#010x} belongs to PD {mr_pd}, not PD {pd}")]
    WrongPd { key: u32, mr_pd: u32, pd: u32 },
    /// The range falls outside the MR.
    #[error("{va:#x}+{len} is outside the MR [{start:#x}, +{length})")]
    OutOfBounds {
        va: u64,
        len: u64,
        start: u64,
        length: u64,
    },
    /// The MR does not grant the access.
    #[error("key {key:#010x} does not grant {needed:?}")]
    Denied { key: u32, needed: Access },
    /// The device memory behind a valid MR is not there (a guest that
    /// registered memory it then unplugged).
    #[error(transparent)]
    Memory(#[from] MemoryError),
}

impl Mr {
    /// Checks that `va..va + len` lies in the MR.
    pub fn check_bounds(&self, va: u64, len: u64) -> core::result::Result<(), AccessError> {
        let oob = AccessError::OutOfBounds {
            va,
            len,
            start: self.iova,
            length: self.length,
        };
        let off = va.checked_sub(self.iova).ok_or(oob)?;
        let end = off.checked_add(len).ok_or(oob)?;
        if end > self.length {
            return Err(oob);
        }
        Ok(())
    }

    /// Calls `f(device_address, length)` for each physically contiguous
    /// piece of `va..va + len` (bounds already checked).
    fn for_each_chunk(
        &self,
        va: u64,
        len: u64,
        mut f: impl FnMut(u64, u64) -> core::result::Result<(), AccessError>,
    ) -> core::result::Result<(), AccessError> {
        self.check_bounds(va, len)?;
        match &self.translation {
            Translation::Identity => f(va, len),
            Translation::Pages {
                page_shift,
                offset,
                pages,
            } => {
                let page = 1u64 << page_shift;
                // Offset into the page list of the first byte.
                let mut at = va - self.iova + offset;
                let mut left = len;
                while left > 0 {
                    let index = usize::try_from(at >> page_shift)
                        .map_err(|_| AccessError::InvalidKey(self.lkey.0))?;
                    let Some(&base) = pages.get(index) else {
                        // Registration checked that the pages cover the
                        // length; this guards the invariant, not input.
                        return Err(AccessError::InvalidKey(self.lkey.0));
                    };
                    let in_page = at & (page - 1);
                    let n = (page - in_page).min(left);
                    f(base + in_page, n)?;
                    at += n;
                    left -= n;
                }
                Ok(())
            }
        }
    }

    /// Reads `buf.len()` bytes at virtual address `va`.
    pub fn read(
        &self,
        mem: &impl Memory,
        va: u64,
        buf: &mut [u8],
    ) -> core::result::Result<(), AccessError> {
        let mut done = 0usize;
        self.for_each_chunk(va, buf.len() as u64, |addr, n| {
            // n <= buf.len() - done, which fits a usize.
            let n = n as usize;
            mem.read(addr, &mut buf[done..done + n])?;
            done += n;
            Ok(())
        })
    }

    /// Writes `data` at virtual address `va`.
    pub fn write(
        &self,
        mem: &mut impl Memory,
        va: u64,
        data: &[u8],
    ) -> core::result::Result<(), AccessError> {
        let mut done = 0usize;
        self.for_each_chunk(va, data.len() as u64, |addr, n| {
            let n = n as usize;
            mem.write(addr, &data[done..done + n])?;
            done += n;
            Ok(())
        })
    }

    /// The device address of the 8 bytes at `va` for an atomic, which must
    /// not straddle a page (it cannot, when 8-byte aligned).
    pub fn atomic_addr(&self, va: u64) -> core::result::Result<u64, AccessError> {
        let mut addr = None;
        self.for_each_chunk(va, 8, |a, n| {
            if n == 8 {
                addr = Some(a);
            }
            Ok(())
        })?;
        addr.ok_or(AccessError::OutOfBounds {
            va,
            len: 8,
            start: self.iova,
            length: self.length,
        })
    }
}

/// What a registration asks for (`ibv_reg_mr` and the page list a guest
/// passes with REG_USER_MR).
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct MrRequest {
    pub pd: u32,
    pub iova: u64,
    pub length: u64,
    pub access: Access,
    pub translation: Translation,
}

/// The key table: every MR (and, with memory windows, every MW) by index.
#[derive(Debug)]
pub(crate) struct Keys {
    table: Table<Mr>,
}

impl Keys {
    pub(crate) fn new(max_mr: u32) -> Self {
        // Index 0 is never handed out: a zeroed key names nothing.
        Keys {
            table: Table::new(1, max_mr),
        }
    }

    pub(crate) fn len(&self) -> u32 {
        self.table.len()
    }

    /// Registers an MR (request already validated against device limits).
    pub(crate) fn register(&mut self, req: MrRequest) -> Result<(Lkey, Rkey)> {
        let mr = Mr {
            pd: req.pd,
            iova: req.iova,
            length: req.length,
            access: req.access,
            translation: req.translation,
            lkey: Lkey(0),
            rkey: Rkey(0),
        };
        let max = self.table.max();
        let (index, generation) = self.table.insert(mr).ok_or(VerbsError::Exhausted {
            kind: Kind::Mr,
            max,
        })?;
        let lkey = Lkey::new(index, generation);
        let rkey = Rkey(lkey.0);
        if let Some(mr) = self.table.get_mut(index) {
            mr.lkey = lkey;
            mr.rkey = rkey;
        }
        Ok((lkey, rkey))
    }

    /// The MR an lkey names (key byte checked).
    pub(crate) fn by_lkey(&self, lkey: Lkey) -> Option<&Mr> {
        self.table
            .get_keyed(lkey.index(), lkey.key())
            .filter(|mr| mr.lkey == lkey)
    }

    /// The MR an rkey names (key byte checked).
    pub(crate) fn by_rkey(&self, rkey: Rkey) -> Option<&Mr> {
        self.table
            .get_keyed(rkey.index(), rkey.key())
            .filter(|mr| mr.rkey == rkey)
    }

    /// Deregisters the MR `lkey` names.
    pub(crate) fn deregister(&mut self, lkey: Lkey) -> Result<Mr> {
        if self.by_lkey(lkey).is_none() {
            return Err(VerbsError::NotFound {
                kind: Kind::Mr,
                handle: lkey.0,
            });
        }
        self.table.remove(lkey.index()).ok_or(VerbsError::NotFound {
            kind: Kind::Mr,
            handle: lkey.0,
        })
    }

    /// Number of MRs registered in `pd`.
    pub(crate) fn count_in_pd(&self, pd: u32) -> u32 {
        self.table.iter().filter(|(_, mr)| mr.pd == pd).count() as u32
    }

    /// Local access: the lkey names a live MR of `pd` covering the range
    /// with the rights `needed` (LOCAL_WRITE where the device writes).
    /// IBTA Vol1 §10.6.3.3 / C10-24.
    pub(crate) fn check_local(
        &self,
        lkey: Lkey,
        pd: u32,
        va: u64,
        len: u64,
        needed: Access,
    ) -> core::result::Result<&Mr, AccessError> {
        let mr = self.by_lkey(lkey).ok_or(AccessError::InvalidKey(lkey.0))?;
        check(mr, lkey.0, pd, va, len, needed)
    }

    /// Remote access: the rkey names a live MR of the QP's `pd` covering
    /// the range with the remote rights `needed`. IBTA Vol1 §9.7.4.1.2 /
    /// C9-89.
    pub(crate) fn check_remote(
        &self,
        rkey: Rkey,
        pd: u32,
        va: u64,
        len: u64,
        needed: Access,
    ) -> core::result::Result<&Mr, AccessError> {
        let mr = self.by_rkey(rkey).ok_or(AccessError::InvalidKey(rkey.0))?;
        check(mr, rkey.0, pd, va, len, needed)
    }
}

fn check(
    mr: &Mr,
    key: u32,
    pd: u32,
    va: u64,
    len: u64,
    needed: Access,
) -> core::result::Result<&Mr, AccessError> {
    if mr.pd != pd {
        return Err(AccessError::WrongPd {
            key,
            mr_pd: mr.pd,
            pd,
        });
    }
    if !mr.access.contains(needed) {
        return Err(AccessError::Denied { key, needed });
    }
    mr.check_bounds(va, len)?;
    Ok(mr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::VecMemory;

    fn paged(pd: u32, access: Access) -> MrRequest {
        // 3 pages of 4 KiB, scattered, the MR starting 0x100 into the first.
        MrRequest {
            pd,
            iova: 0x7000_0100,
            length: 3 * 4096 - 0x100,
            access,
            translation: Translation::Pages {
                page_shift: 12,
                offset: 0x100,
                pages: vec![0x3000, 0x1000, 0x5000],
            },
        }
    }

    #[test]
    fn access_flag_rules() {
        assert!(Access::REMOTE_READ.validate_for_mr().is_ok());
        assert!(
            (Access::LOCAL_WRITE | Access::REMOTE_WRITE)
                .validate_for_mr()
                .is_ok()
        );
        assert_eq!(
            Access::REMOTE_WRITE.validate_for_mr(),
            Err(VerbsError::Invalid {
                what: "MR access flags (remote write or atomic without local write)"
            })
        );
        assert!(Access::REMOTE_ATOMIC.validate_for_mr().is_err());
        assert!(Access(1 << 10).validate_for_mr().is_err());
    }

    #[test]
    fn keys_are_index_and_key_byte_and_stale_keys_die() {
        let mut k = Keys::new(4);
        let (l, r) = k.register(paged(1, Access::LOCAL_WRITE)).unwrap();
        assert_eq!(l.0, r.0);
        assert_eq!(l.index(), 1);
        k.deregister(l).unwrap();
        let (l2, _) = k.register(paged(1, Access::LOCAL_WRITE)).unwrap();
        assert_eq!(l2.index(), l.index());
        assert_ne!(l2.key(), l.key(), "new key byte on re-registration");
        assert!(k.by_lkey(l).is_none());
        assert_eq!(
            k.deregister(l),
            Err(VerbsError::NotFound {
                kind: Kind::Mr,
                handle: l.0
            })
        );
        assert!(k.by_lkey(l2).is_some());
    }

    #[test]
    fn the_table_limit_is_enomem() {
        let mut k = Keys::new(1);
        k.register(paged(1, Access::NONE)).unwrap();
        let e = k.register(paged(1, Access::NONE)).unwrap_err();
        assert_eq!(
            e,
            VerbsError::Exhausted {
                kind: Kind::Mr,
                max: 1
            }
        );
        assert_eq!(e.errno(), crate::error::errno::ENOMEM);
    }

    #[test]
    fn local_and_remote_checks() {
        let mut k = Keys::new(4);
        let (l, r) = k
            .register(paged(7, Access::LOCAL_WRITE | Access::REMOTE_READ))
            .unwrap();
        let va = 0x7000_0100;
        assert!(k.check_local(l, 7, va, 16, Access::LOCAL_WRITE).is_ok());
        assert_eq!(
            k.check_local(l, 8, va, 16, Access::NONE).unwrap_err(),
            AccessError::WrongPd {
                key: l.0,
                mr_pd: 7,
                pd: 8
            }
        );
        assert!(k.check_remote(r, 7, va, 16, Access::REMOTE_READ).is_ok());
        assert_eq!(
            k.check_remote(r, 7, va, 16, Access::REMOTE_WRITE)
                .unwrap_err(),
            AccessError::Denied {
                key: r.0,
                needed: Access::REMOTE_WRITE
            }
        );
        let end = va + 3 * 4096 - 0x100;
        assert!(
            k.check_remote(r, 7, end - 8, 8, Access::REMOTE_READ)
                .is_ok()
        );
        assert!(matches!(
            k.check_remote(r, 7, end - 8, 9, Access::REMOTE_READ),
            Err(AccessError::OutOfBounds { .. })
        ));
        assert!(matches!(
            k.check_remote(r, 7, va - 1, 1, Access::REMOTE_READ),
            Err(AccessError::OutOfBounds { .. })
        ));
        assert!(matches!(
            k.check_remote(r, 7, u64::MAX, 2, Access::REMOTE_READ),
            Err(AccessError::OutOfBounds { .. })
        ));
        assert_eq!(
            k.check_remote(Rkey(r.0 ^ 1), 7, va, 1, Access::REMOTE_READ)
                .unwrap_err(),
            AccessError::InvalidKey(r.0 ^ 1)
        );
    }

    #[test]
    fn reads_and_writes_follow_the_page_list() {
        let mut k = Keys::new(4);
        let (l, _) = k.register(paged(1, Access::LOCAL_WRITE)).unwrap();
        let mr = k.by_lkey(l).unwrap().clone();
        let mut mem = VecMemory::new(0, 0x6000);
        // Bytes 0xf00..0x1100 of the MR straddle pages 0 and 1.
        let data: Vec<u8> = (0..0x200u32).map(|i| i as u8).collect();
        mr.write(&mut mem, 0x7000_0100 + 0xe00, &data).unwrap();
        // Page 0 is at 0x3000 (MR offset 0x100): MR byte 0xe00 is at 0x3f00.
        assert_eq!(&mem.bytes()[0x3f00..0x4000], &data[..0x100]);
        // Page 1 is at 0x1000.
        assert_eq!(&mem.bytes()[0x1000..0x1100], &data[0x100..]);
        let mut back = vec![0; 0x200];
        mr.read(&mem, 0x7000_0100 + 0xe00, &mut back).unwrap();
        assert_eq!(back, data);
        assert_eq!(mr.atomic_addr(0x7000_0100 + 0xef8), Ok(0x3ff8));
    }
}
