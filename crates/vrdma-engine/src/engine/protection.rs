//! Protection domains, memory regions and memory windows: their verbs,
//! and the key lookups behind the protection checks of local and remote
//! accesses.

use vrdma_wire::{Lkey, Qpn};

use super::{Engine, count};
use crate::{
    budget,
    error::{Kind, Result, VerbsError, within},
    handle::PdHandle,
    mr::{Access, AccessError, Mr, MrRequest, Translation},
    objects::Pd,
};

/// Page sizes a registration may use: 4 KiB to 1 GiB.
const PAGE_SHIFTS: core::ops::RangeInclusive<u8> = 12..=30;

impl Engine {
    // ---- protection domains -------------------------------------------

    /// `ibv_alloc_pd`.
    pub fn alloc_pd(&mut self) -> Result<PdHandle> {
        let max = self.pds.max();
        self.pds
            .insert(Pd)
            .map(|(h, _)| PdHandle(h))
            .ok_or(VerbsError::Exhausted {
                kind: Kind::Pd,
                max,
            })
    }

    /// `ibv_dealloc_pd`: EBUSY while MRs, QPs, SRQs or AHs use it.
    pub fn dealloc_pd(&mut self, pd: PdHandle) -> Result<()> {
        self.pd(pd)?;
        let users = self.cx.keys.count_in_pd(pd)
            + count(&self.qps, |q| q.init.pd == pd)
            + count(&self.cx.srqs, |s| s.pd == pd)
            + count(&self.ahs, |a| a.pd == pd);
        if users > 0 {
            return Err(VerbsError::Busy {
                kind: Kind::Pd,
                handle: pd.0,
                users,
            });
        }
        self.pds.remove(pd.0);
        Ok(())
    }

    // ---- memory regions -----------------------------------------------

    /// `ibv_reg_mr` (and a guest's REG_USER_MR with its page list).
    pub fn reg_mr(&mut self, req: MrRequest) -> Result<(Lkey, vrdma_wire::Rkey)> {
        self.pd(req.pd)?;
        req.access.validate_for_mr()?;
        if req.length == 0 {
            return Err(VerbsError::Invalid {
                what: "MR length 0",
            });
        }
        within("MR size", req.length, self.attr.max_mr_size)?;
        if req.iova.checked_add(req.length - 1).is_none() {
            return Err(VerbsError::Invalid {
                what: "MR range (wraps the address space)",
            });
        }
        if req.access.contains(Access::ZERO_BASED) && req.iova != 0 {
            return Err(VerbsError::Invalid {
                what: "zero-based MR with a non-zero start",
            });
        }
        match &req.translation {
            Translation::Identity => {}
            Translation::Pages {
                page_shift,
                offset,
                pages,
            } => {
                if !PAGE_SHIFTS.contains(page_shift) {
                    return Err(VerbsError::Invalid { what: "page size" });
                }
                let page = 1u64 << page_shift;
                if *offset >= page {
                    return Err(VerbsError::Invalid {
                        what: "offset into the first page",
                    });
                }
                if pages.iter().any(|p| p & (page - 1) != 0) {
                    return Err(VerbsError::Invalid {
                        what: "page address (not page-aligned)",
                    });
                }
                let needed = (offset + req.length).div_ceil(page);
                if (pages.len() as u64) < needed {
                    return Err(VerbsError::Invalid {
                        what: "page list (shorter than the MR)",
                    });
                }
            }
        }
        self.register(req)
    }

    /// Whether an MR of `pages` pages fits the memory limit now (a face
    /// asks before it reads a page list of that length from its guest);
    /// a refusal is counted as a refused registration.
    pub fn check_mr_pages(&mut self, pages: usize) -> Result<()> {
        let cost = budget::mr_pages(pages);
        self.budget.charge(Kind::Mr, cost)?;
        self.budget.release(cost);
        Ok(())
    }

    /// Registers a checked MR request, its page list charged to the
    /// budget.
    fn register(&mut self, req: MrRequest) -> Result<(Lkey, vrdma_wire::Rkey)> {
        let pages = match &req.translation {
            Translation::Identity => 0,
            Translation::Pages { pages, .. } => pages.len(),
        };
        let cost = budget::mr_pages(pages);
        self.budget.charge(Kind::Mr, cost)?;
        self.cx
            .keys
            .register(req)
            .inspect_err(|_| self.budget.release(cost))
    }

    /// `ibv_dereg_mr`.
    pub fn dereg_mr(&mut self, lkey: Lkey) -> Result<()> {
        let mr = self.cx.keys.deregister(lkey)?;
        self.budget.release(budget::mr(&mr));
        Ok(())
    }

    /// The MR an lkey names (for inspection and tests).
    pub fn mr(&self, lkey: Lkey) -> Option<&Mr> {
        self.cx.keys.by_lkey(lkey)
    }

    /// A DMA MR (`ib_get_dma_mr`): every device address, as is, with
    /// `access` (a face's kernel consumers put bus addresses in their
    /// SGEs). Not bounded by `max_mr_size`.
    pub fn reg_dma_mr(&mut self, pd: PdHandle, access: Access) -> Result<(Lkey, vrdma_wire::Rkey)> {
        self.pd(pd)?;
        access.validate_for_mr()?;
        if access.contains(Access::ZERO_BASED) {
            return Err(VerbsError::Invalid {
                what: "zero-based DMA MR",
            });
        }
        self.register(MrRequest {
            pd,
            iova: 0,
            length: u64::MAX,
            access,
            translation: Translation::Identity,
        })
    }

    /// `ib_alloc_mr` (IB_MR_TYPE_MEM_REG): an MR for fast registration,
    /// invalid until a REG_MR work request, for at most `max_pages` pages.
    pub fn alloc_mr(&mut self, pd: PdHandle, max_pages: u32) -> Result<Lkey> {
        self.pd(pd)?;
        if max_pages == 0 {
            return Err(VerbsError::Invalid {
                what: "fast-registration page count 0",
            });
        }
        within(
            "fast-registration page count",
            max_pages.into(),
            self.attr.max_fast_reg_page_list_len.into(),
        )?;
        let cost = budget::frmr(max_pages);
        self.budget.charge(Kind::Mr, cost)?;
        self.cx
            .keys
            .alloc_fast_reg(pd, max_pages)
            .inspect_err(|_| self.budget.release(cost))
    }

    /// `ib_map_mr_sg`: the page list the MR's next REG_MR work request
    /// will register (the MR must be allocated for fast registration).
    pub fn map_mr_pages(&mut self, lkey: Lkey, translation: Translation) -> Result<()> {
        check_pages(&translation)?;
        self.cx.keys.map_pages(lkey, translation)
    }

    // ---- memory windows -----------------------------------------------

    /// `ibv_alloc_mw`.
    pub fn alloc_mw(&mut self, pd: PdHandle, ty: crate::mr::MwType) -> Result<vrdma_wire::Rkey> {
        self.pd(pd)?;
        self.cx.keys.alloc_mw(pd, ty)
    }

    /// `ibv_dealloc_mw` (a bound window is unbound first).
    pub fn dealloc_mw(&mut self, rkey: vrdma_wire::Rkey) -> Result<()> {
        self.cx.keys.dealloc_mw(rkey)
    }

    /// The window an rkey names (for inspection and tests).
    pub fn mw(&self, rkey: vrdma_wire::Rkey) -> Option<&crate::mr::Mw> {
        self.cx.keys.mw(rkey)
    }

    // ---- key lookups --------------------------------------------------

    /// The protection check of a local access (an SGE): the lkey names a
    /// live MR of `pd` that covers `va..va + len` and grants `needed`
    /// (LOCAL_WRITE wherever the device writes). IBTA Vol1 §10.6.3.3.
    pub fn check_local(
        &self,
        lkey: Lkey,
        pd: PdHandle,
        va: u64,
        len: u64,
        needed: Access,
    ) -> core::result::Result<&Mr, AccessError> {
        self.cx.keys.check_local(lkey, pd, va, len, needed)
    }

    /// The protection check of a remote access (RETH or AtomicETH) on QP
    /// `qp` of PD `pd`: the rkey names a valid MR of that PD, or a bound
    /// window of it (type 2: bound to `qp`), covering the range with the
    /// remote right `needed`. IBTA Vol1 §9.7.4.1.2 (C9-89).
    pub fn check_remote(
        &self,
        rkey: vrdma_wire::Rkey,
        pd: PdHandle,
        va: u64,
        len: u64,
        needed: Access,
        qp: Qpn,
    ) -> core::result::Result<&Mr, AccessError> {
        self.cx.keys.check_remote(rkey, pd, va, len, needed, qp)
    }

    /// The current key of the MR at key index `index` (the key byte
    /// changes with each fast registration; a face names the MR by its
    /// index).
    pub fn current_lkey(&self, index: u32) -> Option<Lkey> {
        self.cx.keys.lkey_at(index)
    }

    /// The current rkey of a memory window by index (a face's guest
    /// names a window by its index; binds change its key byte).
    pub fn current_rkey(&self, index: u32) -> Option<vrdma_wire::Rkey> {
        self.cx.keys.rkey_at(index)
    }
}

/// A page list's page size, first-page offset and page alignment.
pub(super) fn check_pages(translation: &Translation) -> Result<()> {
    if let Translation::Pages {
        page_shift,
        offset,
        pages,
    } = translation
    {
        if !PAGE_SHIFTS.contains(page_shift) || *offset >= 1u64 << page_shift {
            return Err(VerbsError::Invalid {
                what: "page size or offset",
            });
        }
        if pages.iter().any(|p| p & ((1u64 << page_shift) - 1) != 0) {
            return Err(VerbsError::Invalid {
                what: "page address (not page-aligned)",
            });
        }
    }
    Ok(())
}
