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
    fence::Fence,
    handle::PdHandle,
    memory::{Memory, MemoryError, Payload},
    table::Table,
};

pub use crate::access::Access;

impl Access {
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
    pub pd: PdHandle,
    /// First virtual address (0 for zero-based MRs).
    pub iova: u64,
    pub length: u64,
    pub access: Access,
    pub translation: Translation,
    pub lkey: Lkey,
    pub rkey: Rkey,
    pub kind: MrKind,
    /// False for a fast-registration MR between invalidation (or
    /// allocation) and its next REG_MR work request.
    pub valid: bool,
    /// Memory windows bound to this MR (it cannot be deregistered while
    /// any is).
    pub bound_mws: u32,
    /// The fence its lent payloads carry: revoked when the MR is
    /// deregistered or invalidated (a new one comes with the next
    /// registration), so no copy reads it after ([`crate::fence`]).
    pub fence: Fence,
}

/// How an MR came to be.
#[derive(Clone, Debug, Eq, PartialEq)]
pub enum MrKind {
    /// `ibv_reg_mr`: valid from registration to deregistration; cannot be
    /// invalidated by LOCAL_INV or SEND_WITH_INV.
    Regular,
    /// Allocated for fast registration (`ib_alloc_mr`): made valid by a
    /// REG_MR work request over the page list mapped beforehand,
    /// invalidated by LOCAL_INV or by a peer's SEND_WITH_INV.
    FastReg {
        max_pages: u32,
        /// The page list the next REG_MR will use.
        mapped: Option<Translation>,
    },
}

/// Memory window type (IBTA Vol1 §10.6.7).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum MwType {
    /// Bound by the bind verb, usable from any QP of its PD; rebinding
    /// replaces the binding; never invalidated remotely.
    One,
    /// Bound by a BIND_MW work request to one QP, usable only through that
    /// QP; invalidated by LOCAL_INV or the bound QP's peer (SEND_WITH_INV).
    Two,
}

/// What a window grants.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct MwBinding {
    pub mr: Lkey,
    pub va: u64,
    pub length: u64,
    /// Remote rights granted through the window.
    pub access: Access,
    /// Type 2: the QP it is bound to.
    pub qp: Option<vrdma_wire::Qpn>,
}

/// A memory window.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Mw {
    pub pd: PdHandle,
    pub ty: MwType,
    pub rkey: Rkey,
    pub binding: Option<MwBinding>,
}

/// One entry of the key table.
#[derive(Clone, Debug, Eq, PartialEq)]
enum KeyObj {
    Mr(Mr),
    Mw(Mw),
}

/// Why a bind, fast registration or invalidation failed.
#[derive(Clone, Copy, Debug, Eq, PartialEq, thiserror::Error)]
pub enum KeyOpError {
    #[error("no such memory window or region")]
    NoObject,
    #[error("protection domain mismatch")]
    WrongPd,
    #[error("the MR does not allow binding windows")]
    NoBindRight,
    #[error("the window lies outside the MR")]
    OutOfBounds,
    #[error("access rights not allowed")]
    BadAccess,
    #[error("the object is in the wrong state for this operation")]
    WrongState,
    #[error("this key may not be invalidated this way")]
    NotInvalidatable,
}

/// How an access failed (each maps to a completion status or NAK by the
/// data path: local protection, remote access, length errors).
#[derive(Clone, Copy, Debug, Eq, PartialEq, thiserror::Error)]
pub enum AccessError {
    /// No MR (or a stale one) behind the key.
    #[error("invalid key {0:#010x}")]
    InvalidKey(u32),
    /// The MR belongs to another protection domain.
    #[error("key {key:#010x} belongs to {mr_pd}, not {pd}")]
    WrongPd {
        key: u32,
        mr_pd: PdHandle,
        pd: PdHandle,
    },
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
    pub(crate) fn for_each_chunk(
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

    /// Writes a received payload (its bytes, or lent) at `va`.
    pub(crate) fn write_payload(
        &self,
        mem: &mut impl Memory,
        va: u64,
        data: Payload<'_>,
    ) -> core::result::Result<(), AccessError> {
        // One match, then the loop of each kind: the bytes' is the hot
        // path of every packet, and stays as plain as `write`.
        match data {
            Payload::Bytes(b) => self.write(mem, va, b),
            Payload::Lent { at, len } => {
                let mut done = 0usize;
                self.for_each_chunk(va, len as u64, |addr, n| {
                    let n = n as usize;
                    mem.write_lent(addr, at + done, n)?;
                    done += n;
                    Ok(())
                })
            }
        }
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
    pub pd: PdHandle,
    pub iova: u64,
    pub length: u64,
    pub access: Access,
    pub translation: Translation,
}

/// The key table: every MR and MW by its 24-bit index. An MR's lkey and
/// rkey are the same number; a window has only an rkey. The key byte of a
/// new object is its slot's generation; fast registration and binding
/// replace it with the consumer's choice.
#[derive(Debug)]
pub(crate) struct Keys {
    table: Table<KeyObj>,
    /// Fences closed by a remote invalidation and not yet waited for
    /// ([`Keys::wait_closed`]).
    closed: Vec<Fence>,
}

fn not_found(key: u32) -> VerbsError {
    VerbsError::NotFound {
        kind: Kind::Mr,
        handle: key,
    }
}

impl Drop for Keys {
    /// The engine is gone (destroyed or reset): no payload it lent is read
    /// again.
    fn drop(&mut self) {
        for (_, obj) in self.table.iter() {
            if let KeyObj::Mr(mr) = obj {
                mr.fence.revoke();
            }
        }
    }
}

impl Keys {
    /// The fence of the MR `lkey` names, valid or not.
    pub(crate) fn fence_of(&self, lkey: Lkey) -> Option<&Fence> {
        self.mr_any(lkey.0).map(|mr| &mr.fence)
    }

    /// Waits for the copies under way from MRs a remote invalidation
    /// closed (the second half of their revocation).
    #[inline]
    pub(crate) fn wait_closed(&mut self) {
        if self.closed.is_empty() {
            return;
        }
        for f in self.closed.drain(..) {
            f.wait();
        }
    }

    pub(crate) fn new(max_mr: u32, max_mw: u32) -> Self {
        // Index 0 is never handed out: a zeroed key names nothing.
        Keys {
            table: Table::new(1, max_mr.saturating_add(max_mw)),
            closed: Vec::new(),
        }
    }

    pub(crate) fn len(&self) -> u32 {
        self.table.len()
    }

    fn insert(&mut self, obj: KeyObj, kind: Kind) -> Result<u32> {
        let max = self.table.max();
        let (index, generation) = self
            .table
            .insert(obj)
            .ok_or(VerbsError::Exhausted { kind, max })?;
        let key = Lkey::new(index, generation).0;
        match self.table.get_mut(index) {
            Some(KeyObj::Mr(mr)) => {
                mr.lkey = Lkey(key);
                mr.rkey = Rkey(key);
            }
            Some(KeyObj::Mw(mw)) => mw.rkey = Rkey(key),
            None => {}
        }
        Ok(key)
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
            kind: MrKind::Regular,
            valid: true,
            bound_mws: 0,
            fence: Fence::new(),
        };
        let key = self.insert(KeyObj::Mr(mr), Kind::Mr)?;
        Ok((Lkey(key), Rkey(key)))
    }

    /// Allocates an MR for fast registration, invalid until a REG_MR WR.
    pub(crate) fn alloc_fast_reg(&mut self, pd: PdHandle, max_pages: u32) -> Result<Lkey> {
        let mr = Mr {
            pd,
            iova: 0,
            length: 0,
            access: Access::NONE,
            translation: Translation::Pages {
                page_shift: 12,
                offset: 0,
                pages: Vec::new(),
            },
            lkey: Lkey(0),
            rkey: Rkey(0),
            kind: MrKind::FastReg {
                max_pages,
                mapped: None,
            },
            valid: false,
            bound_mws: 0,
            fence: Fence::new(),
        };
        self.insert(KeyObj::Mr(mr), Kind::Mr).map(Lkey)
    }

    /// Allocates an unbound memory window.
    pub(crate) fn alloc_mw(&mut self, pd: PdHandle, ty: MwType) -> Result<Rkey> {
        let mw = Mw {
            pd,
            ty,
            rkey: Rkey(0),
            binding: None,
        };
        self.insert(KeyObj::Mw(mw), Kind::Mw).map(Rkey)
    }

    /// The MR whose lkey (or rkey: the same number) is `key`, valid or
    /// not.
    fn mr_any(&self, key: u32) -> Option<&Mr> {
        match self.table.get(key >> 8)? {
            KeyObj::Mr(mr) if mr.lkey.0 == key => Some(mr),
            _ => None,
        }
    }

    fn mr_any_mut(&mut self, key: u32) -> Option<&mut Mr> {
        match self.table.get_mut(key >> 8)? {
            KeyObj::Mr(mr) if mr.lkey.0 == key => Some(mr),
            _ => None,
        }
    }

    /// The current lkey of the MR at `index`, valid or not.
    pub(crate) fn lkey_at(&self, index: u32) -> Option<Lkey> {
        match self.table.get(index)? {
            KeyObj::Mr(mr) => Some(mr.lkey),
            KeyObj::Mw(_) => None,
        }
    }

    /// The current rkey of the window at `index`.
    pub(crate) fn rkey_at(&self, index: u32) -> Option<Rkey> {
        match self.table.get(index)? {
            KeyObj::Mw(mw) => Some(mw.rkey),
            KeyObj::Mr(_) => None,
        }
    }

    /// The valid MR an lkey names (key byte checked).
    pub(crate) fn by_lkey(&self, lkey: Lkey) -> Option<&Mr> {
        self.mr_any(lkey.0).filter(|mr| mr.valid)
    }

    /// The window an rkey names (key byte checked).
    pub(crate) fn mw(&self, rkey: Rkey) -> Option<&Mw> {
        match self.table.get(rkey.index())? {
            KeyObj::Mw(mw) if mw.rkey == rkey => Some(mw),
            _ => None,
        }
    }

    /// Deregisters the MR `lkey` names (EBUSY while windows are bound to
    /// it).
    pub(crate) fn deregister(&mut self, lkey: Lkey) -> Result<Mr> {
        let mr = self.mr_any(lkey.0).ok_or(not_found(lkey.0))?;
        if mr.bound_mws > 0 {
            return Err(VerbsError::Busy {
                kind: Kind::Mr,
                handle: lkey.0,
                users: mr.bound_mws,
            });
        }
        match self.table.remove_keyed(lkey.index(), lkey.key()) {
            Some(KeyObj::Mr(mr)) => {
                mr.fence.revoke();
                Ok(mr)
            }
            _ => Err(not_found(lkey.0)),
        }
    }

    /// Deallocates a window, unbinding it first.
    pub(crate) fn dealloc_mw(&mut self, rkey: Rkey) -> Result<()> {
        let mw = *self.mw(rkey).ok_or(VerbsError::NotFound {
            kind: Kind::Mw,
            handle: rkey.0,
        })?;
        if let Some(b) = mw.binding
            && let Some(mr) = self.mr_any_mut(b.mr.0)
        {
            mr.bound_mws = mr.bound_mws.saturating_sub(1);
        }
        self.table.remove_keyed(rkey.index(), rkey.key());
        Ok(())
    }

    /// Unbinds every type 2 window bound to `qp` (the QP is being
    /// destroyed or reset: its QPN may name another QP next).
    pub(crate) fn unbind_qp(&mut self, qp: vrdma_wire::Qpn) {
        let mut released = Vec::new();
        for (_, o) in self.table.iter_mut() {
            if let KeyObj::Mw(mw) = o
                && let Some(b) = mw.binding
                && b.qp == Some(qp)
            {
                mw.binding = None;
                released.push(b.mr);
            }
        }
        for mr in released {
            if let Some(mr) = self.mr_any_mut(mr.0) {
                mr.bound_mws = mr.bound_mws.saturating_sub(1);
            }
        }
    }

    /// MRs and MWs in `pd`.
    pub(crate) fn count_in_pd(&self, pd: PdHandle) -> u32 {
        self.table
            .iter()
            .filter(|(_, o)| match o {
                KeyObj::Mr(mr) => mr.pd == pd,
                KeyObj::Mw(mw) => mw.pd == pd,
            })
            .count() as u32
    }

    /// Stores the page list a fast-registration MR's next REG_MR uses
    /// (`ib_map_mr_sg`).
    pub(crate) fn map_pages(&mut self, lkey: Lkey, translation: Translation) -> Result<()> {
        let mr = self.mr_any_mut(lkey.0).ok_or(not_found(lkey.0))?;
        let MrKind::FastReg { max_pages, mapped } = &mut mr.kind else {
            return Err(VerbsError::Invalid {
                what: "page mapping of an MR not allocated for fast registration",
            });
        };
        let Translation::Pages { pages, .. } = &translation else {
            return Err(VerbsError::Invalid {
                what: "fast-registration mapping (a page list is required)",
            });
        };
        if pages.len() as u64 > u64::from(*max_pages) {
            return Err(VerbsError::ExceedsLimit {
                what: "fast-registration page list",
                requested: pages.len() as u64,
                max: u64::from(*max_pages),
            });
        }
        *mapped = Some(translation);
        Ok(())
    }

    /// REG_MR work request: makes a free fast-registration MR valid over
    /// its mapped pages — or over `pages`, the page list the work request
    /// carried, mapped now that the MR is known to be free — with a new
    /// key byte (IBTA Vol1 §10.6.3.6).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn fast_register(
        &mut self,
        lkey: Lkey,
        pd: PdHandle,
        key: u8,
        iova: u64,
        length: u64,
        access: Access,
        pages: Option<Translation>,
    ) -> core::result::Result<(), KeyOpError> {
        let mr = self.mr_any_mut(lkey.0).ok_or(KeyOpError::NoObject)?;
        if mr.pd != pd {
            return Err(KeyOpError::WrongPd);
        }
        if mr.valid {
            return Err(KeyOpError::WrongState);
        }
        access
            .validate_for_mr()
            .map_err(|_| KeyOpError::BadAccess)?;
        if access.contains(Access::ZERO_BASED) && iova != 0 {
            return Err(KeyOpError::BadAccess);
        }
        let MrKind::FastReg { mapped, max_pages } = &mut mr.kind else {
            return Err(KeyOpError::WrongState);
        };
        if let Some(t) = pages {
            match &t {
                Translation::Pages { pages, .. } if pages.len() as u64 <= u64::from(*max_pages) => {
                    *mapped = Some(t);
                }
                _ => return Err(KeyOpError::OutOfBounds),
            }
        }
        let Some(translation) = mapped.clone() else {
            return Err(KeyOpError::WrongState);
        };
        if let Translation::Pages {
            page_shift,
            offset,
            pages,
        } = &translation
        {
            let page = 1u64 << page_shift;
            let needed = offset.saturating_add(length).div_ceil(page);
            if (pages.len() as u64) < needed || iova.checked_add(length).is_none() {
                return Err(KeyOpError::OutOfBounds);
            }
        }
        let new = Lkey::new(lkey.index(), key);
        mr.iova = iova;
        mr.length = length;
        mr.access = access;
        mr.translation = translation;
        mr.lkey = new;
        mr.rkey = Rkey(new.0);
        mr.valid = true;
        Ok(())
    }

    /// Binds (or, type 1 with length 0, unbinds) a window over part of an
    /// MR, with a new key byte (IBTA Vol1 §10.6.7.2). `qp_pd` is the PD of
    /// the QP the bind is posted on; `qp` is that QP (type 2 windows are
    /// bound to it).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn bind(
        &mut self,
        mw_rkey: Rkey,
        key: u8,
        mr_lkey: Lkey,
        va: u64,
        length: u64,
        access: Access,
        qp_pd: PdHandle,
        qp: vrdma_wire::Qpn,
    ) -> core::result::Result<Rkey, KeyOpError> {
        let mw = *self.mw(mw_rkey).ok_or(KeyOpError::NoObject)?;
        if mw.pd != qp_pd {
            return Err(KeyOpError::WrongPd);
        }
        if mw.ty == MwType::Two && (mw.binding.is_some() || length == 0) {
            // A type 2 window is invalidated before it is bound again, and
            // is never bound to nothing (IBTA o10-37.2.40).
            return Err(KeyOpError::WrongState);
        }
        // A window's rights are remote ones (IBTA Vol1 §10.6.7.2); a local
        // write right in a bind names nothing a window grants, and is
        // ignored as rxe and mlx5 ignore it (rdma-core's own MW tests bind
        // with it). Anything else is refused.
        let access = Access(access.0 & !Access::LOCAL_WRITE.0);
        let remote = Access::REMOTE_WRITE
            .with(Access::REMOTE_READ)
            .with(Access::REMOTE_ATOMIC);
        if access.0 & !remote.0 != 0 {
            return Err(KeyOpError::BadAccess);
        }
        let unbind = mw.ty == MwType::One && length == 0;
        if !unbind {
            let mr = self.by_lkey(mr_lkey).ok_or(KeyOpError::NoObject)?;
            if mr.pd != mw.pd {
                return Err(KeyOpError::WrongPd);
            }
            if !mr.access.contains(Access::MW_BIND) {
                return Err(KeyOpError::NoBindRight);
            }
            // Remote write or atomic through a window needs local write on
            // the MR (IBTA Vol1 §10.6.7.2.1).
            let writes = Access::REMOTE_WRITE.with(Access::REMOTE_ATOMIC);
            if access.0 & writes.0 != 0 && !mr.access.contains(Access::LOCAL_WRITE) {
                return Err(KeyOpError::BadAccess);
            }
            mr.check_bounds(va, length)
                .map_err(|_| KeyOpError::OutOfBounds)?;
        }
        // Release the old binding, take the new one.
        if let Some(old) = mw.binding
            && let Some(mr) = self.mr_any_mut(old.mr.0)
        {
            mr.bound_mws = mr.bound_mws.saturating_sub(1);
        }
        if !unbind && let Some(mr) = self.mr_any_mut(mr_lkey.0) {
            mr.bound_mws += 1;
        }
        let new = Rkey::new(mw_rkey.index(), key);
        if let Some(KeyObj::Mw(m)) = self.table.get_mut(mw_rkey.index()) {
            m.rkey = new;
            m.binding = (!unbind).then_some(MwBinding {
                mr: mr_lkey,
                va,
                length,
                access,
                qp: (mw.ty == MwType::Two).then_some(qp),
            });
        }
        Ok(new)
    }

    /// Invalidates a fast-registration MR or a type 2 window. `remote` is
    /// the QP a SEND_WITH_INV arrived on (which must be the window's), or
    /// `None` for LOCAL_INV. Regular MRs and type 1 windows cannot be
    /// invalidated (IBTA Vol1 §10.6.5, §10.6.7.2.6).
    pub(crate) fn invalidate(
        &mut self,
        key: u32,
        pd: PdHandle,
        remote: Option<vrdma_wire::Qpn>,
    ) -> core::result::Result<(), KeyOpError> {
        let binding = match self.table.get_mut(key >> 8).ok_or(KeyOpError::NoObject)? {
            KeyObj::Mr(mr) if mr.lkey.0 == key => {
                if mr.pd != pd {
                    return Err(KeyOpError::WrongPd);
                }
                if !matches!(mr.kind, MrKind::FastReg { .. }) {
                    return Err(KeyOpError::NotInvalidatable);
                }
                // Invalidating a fast-registration MR that is already free
                // succeeds (as rxe does): a consumer may not know whether
                // its peer invalidated it first.
                if mr.bound_mws > 0 {
                    return Err(KeyOpError::WrongState);
                }
                if mr.valid {
                    mr.valid = false;
                    // A SEND with invalidate arrives while its receiver
                    // may hold a sender's fences (a payload lent on):
                    // the wait comes once they are let go.
                    let old = std::mem::take(&mut mr.fence);
                    if remote.is_some() {
                        old.close();
                        self.closed.push(old);
                    } else {
                        old.revoke();
                    }
                }
                return Ok(());
            }
            KeyObj::Mw(mw) if mw.rkey.0 == key => {
                if mw.pd != pd {
                    return Err(KeyOpError::WrongPd);
                }
                let Some(b) = mw.binding else {
                    return Err(KeyOpError::WrongState);
                };
                if mw.ty != MwType::Two || (remote.is_some() && b.qp != remote) {
                    return Err(KeyOpError::NotInvalidatable);
                }
                mw.binding = None;
                b
            }
            _ => return Err(KeyOpError::NoObject),
        };
        if let Some(mr) = self.mr_any_mut(binding.mr.0) {
            mr.bound_mws = mr.bound_mws.saturating_sub(1);
        }
        Ok(())
    }

    /// Local access: the lkey names a valid MR of `pd` covering the range
    /// with the rights `needed` (LOCAL_WRITE where the device writes).
    /// IBTA Vol1 §10.6.3.3 / C10-24.
    pub(crate) fn check_local(
        &self,
        lkey: Lkey,
        pd: PdHandle,
        va: u64,
        len: u64,
        needed: Access,
    ) -> core::result::Result<&Mr, AccessError> {
        let mr = self.by_lkey(lkey).ok_or(AccessError::InvalidKey(lkey.0))?;
        check(mr, lkey.0, pd, va, len, needed)
    }

    /// Remote access through an rkey arriving on QP `qp` of PD `pd`: a
    /// valid MR of that PD, or a bound window of that PD (a type 2 window
    /// bound to this very QP) whose range and rights cover the access, over
    /// a valid MR. IBTA Vol1 §9.7.4.1.2 (C9-89), §10.6.7.
    pub(crate) fn check_remote(
        &self,
        rkey: Rkey,
        pd: PdHandle,
        va: u64,
        len: u64,
        needed: Access,
        qp: vrdma_wire::Qpn,
    ) -> core::result::Result<&Mr, AccessError> {
        let invalid = AccessError::InvalidKey(rkey.0);
        match self.table.get(rkey.index()).ok_or(invalid)? {
            KeyObj::Mr(mr) if mr.rkey == rkey && mr.valid => check(mr, rkey.0, pd, va, len, needed),
            KeyObj::Mw(mw) if mw.rkey == rkey => {
                let b = mw.binding.ok_or(invalid)?;
                if mw.pd != pd {
                    return Err(AccessError::WrongPd {
                        key: rkey.0,
                        mr_pd: mw.pd,
                        pd,
                    });
                }
                if b.qp.is_some_and(|q| q != qp) {
                    return Err(invalid);
                }
                if !b.access.contains(needed) {
                    return Err(AccessError::Denied {
                        key: rkey.0,
                        needed,
                    });
                }
                let oob = AccessError::OutOfBounds {
                    va,
                    len,
                    start: b.va,
                    length: b.length,
                };
                let off = va.checked_sub(b.va).ok_or(oob)?;
                if off.checked_add(len).ok_or(oob)? > b.length {
                    return Err(oob);
                }
                let mr = self.by_lkey(b.mr).ok_or(invalid)?;
                mr.check_bounds(va, len)?;
                Ok(mr)
            }
            _ => Err(invalid),
        }
    }
}

fn check(
    mr: &Mr,
    key: u32,
    pd: PdHandle,
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

    const Q: vrdma_wire::Qpn = vrdma_wire::Qpn::from_masked(17);

    fn paged(pd: PdHandle, access: Access) -> MrRequest {
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
        let mut k = Keys::new(4, 0);
        let (l, r) = k.register(paged(PdHandle(1), Access::LOCAL_WRITE)).unwrap();
        assert_eq!(l.0, r.0);
        assert_eq!(l.index(), 1);
        k.deregister(l).unwrap();
        let (l2, _) = k.register(paged(PdHandle(1), Access::LOCAL_WRITE)).unwrap();
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
        let mut k = Keys::new(1, 0);
        k.register(paged(PdHandle(1), Access::NONE)).unwrap();
        let e = k.register(paged(PdHandle(1), Access::NONE)).unwrap_err();
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
        let mut k = Keys::new(4, 0);
        let (l, r) = k
            .register(paged(
                PdHandle(7),
                Access::LOCAL_WRITE | Access::REMOTE_READ,
            ))
            .unwrap();
        let va = 0x7000_0100;
        assert!(
            k.check_local(l, PdHandle(7), va, 16, Access::LOCAL_WRITE)
                .is_ok()
        );
        assert_eq!(
            k.check_local(l, PdHandle(8), va, 16, Access::NONE)
                .unwrap_err(),
            AccessError::WrongPd {
                key: l.0,
                mr_pd: PdHandle(7),
                pd: PdHandle(8)
            }
        );
        assert!(
            k.check_remote(r, PdHandle(7), va, 16, Access::REMOTE_READ, Q)
                .is_ok()
        );
        assert_eq!(
            k.check_remote(r, PdHandle(7), va, 16, Access::REMOTE_WRITE, Q)
                .unwrap_err(),
            AccessError::Denied {
                key: r.0,
                needed: Access::REMOTE_WRITE
            }
        );
        let end = va + 3 * 4096 - 0x100;
        assert!(
            k.check_remote(r, PdHandle(7), end - 8, 8, Access::REMOTE_READ, Q)
                .is_ok()
        );
        assert!(matches!(
            k.check_remote(r, PdHandle(7), end - 8, 9, Access::REMOTE_READ, Q),
            Err(AccessError::OutOfBounds { .. })
        ));
        assert!(matches!(
            k.check_remote(r, PdHandle(7), va - 1, 1, Access::REMOTE_READ, Q),
            Err(AccessError::OutOfBounds { .. })
        ));
        assert!(matches!(
            k.check_remote(r, PdHandle(7), u64::MAX, 2, Access::REMOTE_READ, Q),
            Err(AccessError::OutOfBounds { .. })
        ));
        assert_eq!(
            k.check_remote(Rkey(r.0 ^ 1), PdHandle(7), va, 1, Access::REMOTE_READ, Q)
                .unwrap_err(),
            AccessError::InvalidKey(r.0 ^ 1)
        );
    }

    #[test]
    fn reads_and_writes_follow_the_page_list() {
        let mut k = Keys::new(4, 0);
        let (l, _) = k.register(paged(PdHandle(1), Access::LOCAL_WRITE)).unwrap();
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
