//! The engine: one per device, driven by one thread, no locks inside.
//! This file holds the control path (the verbs that create, modify, query
//! and destroy objects); every call validates its input and fails with the
//! error rdma-core would return.

use vrdma_wire::{Lkey, Qpn};

use crate::{
    attr::{DeviceAttr, GidEntry, PortAttr},
    budget::{self, Budget},
    completion,
    context::Ctx,
    cq::{Arm, Cq, CqSink},
    error::{Kind, Result, VerbsError, within},
    event::AsyncEvent,
    handle::{AhHandle, CqHandle, PdHandle, SrqHandle},
    mr::{Access, AccessError, Keys, Mr, MrRequest, Translation},
    objects::{Ah, Pd, Srq, SrqAttr, SrqAttrMask},
    qp::{AhAttr, AttrMask, QpAttr, QpCap, QpInitAttr, QpState, QpType, state},
    qpc::Qp,
    table::Table,
};

/// The first QPN handed out: 0 and 1 are the special QPs, and rxe starts
/// its numbers at 17 too.
const FIRST_QPN: u32 = 17;
/// The only port.
const PORT: u8 = 1;
/// Page sizes a registration may use: 4 KiB to 1 GiB.
const PAGE_SHIFTS: core::ops::RangeInclusive<u8> = 12..=30;

/// The RDMA device model.
#[derive(Debug)]
pub struct Engine {
    pub(crate) attr: DeviceAttr,
    pub(crate) pds: Table<Pd>,
    pub(crate) ahs: Table<Ah>,
    /// Boxed: the table cycles ([`Table::cycling`]), so its slots grow to
    /// `max_qp` over a device's life.
    pub(crate) qps: Table<Box<Qp>>,
    /// Everything else, which the data path's roles share
    /// ([`crate::context`]).
    pub(crate) cx: Ctx,
    /// The memory the consumer's objects hold ([`crate::budget`]).
    pub(crate) budget: Budget,
}

/// The memory a consumer's objects hold in the engine, against its limit
/// ([`Engine::set_memory_limit`]).
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub struct MemoryUse {
    /// Bytes held for work queues, page lists, engine-kept CQs, AHs.
    pub held: u64,
    /// `None`: no limit.
    pub limit: Option<u64>,
    /// Creates refused with ENOMEM for passing the limit.
    pub refused: u64,
}

impl Engine {
    /// A device with these limits and this port. Raises the port-active
    /// event when the port starts active.
    pub fn new(attr: DeviceAttr, port: PortAttr) -> Self {
        let active = port.state == crate::attr::PortState::Active;
        let mut cx = Ctx::new(
            port,
            Keys::new(attr.max_mr, attr.max_mw),
            Table::new(1, attr.max_cq),
            Table::new(1, attr.max_srq),
        );
        if active {
            cx.events.push_back(AsyncEvent::PortActive { port: PORT });
        }
        Engine {
            pds: Table::new(1, attr.max_pd),
            // QPNs 1 to 16 are kept for the special QPs (1: GSI).
            // QPNs are handed out in turn (Table::cycling says why).
            qps: Table::with_reserved(1, FIRST_QPN - 1, attr.max_qp).cycling(),
            ahs: Table::new(1, attr.max_ah),
            cx,
            attr,
            budget: Budget::default(),
        }
    }

    /// Limits the memory the consumer's objects may make the engine hold
    /// (`None`: no limit). A create that would pass it fails with ENOMEM;
    /// objects already made stay, even above a lowered limit.
    pub fn set_memory_limit(&mut self, limit: Option<u64>) {
        self.budget.limit = limit;
    }

    /// What the consumer's objects hold, the limit, the refusals.
    pub fn memory_use(&self) -> MemoryUse {
        MemoryUse {
            held: self.budget.held,
            limit: self.budget.limit,
            refused: self.budget.refused,
        }
    }

    /// `ibv_query_device`.
    pub fn query_device(&self) -> &DeviceAttr {
        &self.attr
    }

    /// `ibv_query_port`, with the GID and P_Key tables.
    pub fn query_port(&self, port: u8) -> Result<&PortAttr> {
        check_port(port)?;
        Ok(&self.cx.port)
    }

    /// The next asynchronous event, if any.
    #[must_use = "an event taken and dropped is lost"]
    pub fn poll_event(&mut self) -> Option<AsyncEvent> {
        self.cx.events.pop_front()
    }

    /// The next CQ whose armed notification fired (one per arming).
    #[must_use = "a notification taken and dropped is lost"]
    pub fn poll_notification(&mut self) -> Option<CqHandle> {
        self.cx.notifications.pop_front()
    }

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

    fn pd(&self, pd: PdHandle) -> Result<&Pd> {
        self.pds.get(pd.0).ok_or(VerbsError::NotFound {
            kind: Kind::Pd,
            handle: pd.0,
        })
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

    // ---- completion queues --------------------------------------------

    /// `ibv_create_cq`: returns the handle and the capacity granted. The
    /// engine keeps the completions until [`Engine::poll_cq`].
    pub fn create_cq(&mut self, cqe: u32, comp_vector: u32) -> Result<(CqHandle, u32)> {
        let max = u64::from(self.attr.max_cqe);
        self.insert_cq(cqe, max, |cqe| Cq::new(cqe, comp_vector))
    }

    /// A CQ whose completions are written straight into the consumer's
    /// ring through `sink` (a device face's CQ in guest memory); `cqe` is
    /// the ring's size. Returns the handle and the capacity granted.
    pub fn create_cq_with_sink(
        &mut self,
        cqe: u32,
        comp_vector: u32,
        sink: Box<dyn CqSink>,
    ) -> Result<(CqHandle, u32)> {
        let max = self.sink_cqe_max();
        self.insert_cq(cqe, max, |cqe| Cq::with_sink(cqe, comp_vector, sink))
    }

    /// The largest ring a sink CQ may have: a consumer's ring is a power
    /// of two holding its request, which may be `max_cqe` (65 535 CQEs ask
    /// for a ring of 65 536).
    fn sink_cqe_max(&self) -> u64 {
        u64::from(self.attr.max_cqe).next_power_of_two()
    }

    fn insert_cq(
        &mut self,
        cqe: u32,
        max_cqe: u64,
        make: impl FnOnce(u32) -> Cq,
    ) -> Result<(CqHandle, u32)> {
        if cqe == 0 {
            return Err(VerbsError::Invalid { what: "CQ size 0" });
        }
        within("CQ size", u64::from(cqe), max_cqe)?;
        let max = self.cx.cqs.max();
        let c = make(cqe);
        let cost = budget::cq(cqe, c.has_sink());
        self.budget.charge(Kind::Cq, cost)?;
        let Some((h, _)) = self.cx.cqs.insert(c) else {
            self.budget.release(cost);
            return Err(VerbsError::Exhausted {
                kind: Kind::Cq,
                max,
            });
        };
        Ok((CqHandle(h), cqe))
    }

    /// Resizes a CQ whose ring is the consumer's: its completions go to
    /// `sink` (a ring of `cqe` entries, into which the face moved what
    /// waited in the old one) from now on.
    pub fn resize_cq_sink(&mut self, cq: CqHandle, cqe: u32, sink: Box<dyn CqSink>) -> Result<u32> {
        if cqe == 0 {
            return Err(VerbsError::Invalid { what: "CQ size 0" });
        }
        within("CQ size", u64::from(cqe), self.sink_cqe_max())?;
        let c = self.cq_mut(cq)?;
        if !c.has_sink() {
            return Err(VerbsError::Invalid {
                what: "CQ (its ring is the engine's, not a sink)",
            });
        }
        c.replace_sink(cqe, sink);
        Ok(cqe)
    }

    /// `ibv_resize_cq`: EINVAL when more completions wait than fit.
    pub fn resize_cq(&mut self, cq: CqHandle, cqe: u32) -> Result<u32> {
        if cqe == 0 {
            return Err(VerbsError::Invalid { what: "CQ size 0" });
        }
        within("CQ size", u64::from(cqe), u64::from(self.attr.max_cqe))?;
        let c = self.cq_mut(cq)?;
        if c.has_sink() {
            return Err(VerbsError::Invalid {
                what: "CQ (its ring is the consumer's: resize_cq_sink)",
            });
        }
        let was = c.capacity();
        c.resize(cqe).map_err(|_| VerbsError::Invalid {
            what: "CQ size (below the completions waiting)",
        })?;
        let (old, new) = (budget::cq(was, false), budget::cq(cqe, false));
        if let Err(e) = self.budget.replace(Kind::Cq, old, new) {
            // Back to the size it had: its completions fitted there.
            let _ = self.cq_mut(cq)?.resize(was);
            return Err(e);
        }
        Ok(cqe)
    }

    /// `ibv_destroy_cq`: EBUSY while a QP uses it.
    pub fn destroy_cq(&mut self, cq: CqHandle) -> Result<()> {
        self.cq(cq)?;
        let users = count(&self.qps, |q| q.init.send_cq == cq || q.init.recv_cq == cq);
        if users > 0 {
            return Err(VerbsError::Busy {
                kind: Kind::Cq,
                handle: cq.0,
                users,
            });
        }
        if let Some(c) = self.cx.cqs.remove(cq.0) {
            self.budget.release(budget::cq(c.capacity(), c.has_sink()));
        }
        Ok(())
    }

    /// `ibv_req_notify_cq`.
    pub fn req_notify_cq(&mut self, cq: CqHandle, solicited_only: bool) -> Result<()> {
        let arm = if solicited_only {
            Arm::Solicited
        } else {
            Arm::Next
        };
        self.cq_mut(cq)?.arm(arm);
        Ok(())
    }

    /// Withdraws `cq`'s arming: a face that notified the consumer itself
    /// (a completion it wanted was already there when it armed) ends the
    /// request there, so that an earlier, merged arm fires no second
    /// notification for it.
    pub fn disarm_cq(&mut self, cq: CqHandle) -> Result<()> {
        self.cq_mut(cq)?.disarm();
        Ok(())
    }

    /// `ibv_poll_cq`: up to `max` completions into `out`; returns how many.
    pub fn poll_cq(
        &mut self,
        cq: CqHandle,
        max: usize,
        out: &mut Vec<crate::wc::Wc>,
    ) -> Result<usize> {
        Ok(self.cq_mut(cq)?.poll_into(max, out))
    }

    fn cq(&self, cq: CqHandle) -> Result<&Cq> {
        self.cx.cqs.get(cq.0).ok_or(VerbsError::NotFound {
            kind: Kind::Cq,
            handle: cq.0,
        })
    }

    fn cq_mut(&mut self, cq: CqHandle) -> Result<&mut Cq> {
        self.cx.cqs.get_mut(cq.0).ok_or(VerbsError::NotFound {
            kind: Kind::Cq,
            handle: cq.0,
        })
    }

    // ---- shared receive queues ----------------------------------------

    /// `ibv_create_srq`: returns the handle and the attributes granted.
    pub fn create_srq(&mut self, pd: PdHandle, attr: SrqAttr) -> Result<(SrqHandle, SrqAttr)> {
        self.pd(pd)?;
        if attr.max_wr == 0 {
            return Err(VerbsError::Invalid {
                what: "SRQ max_wr 0",
            });
        }
        within(
            "SRQ max_wr",
            attr.max_wr.into(),
            self.attr.max_srq_wr.into(),
        )?;
        within(
            "SRQ max_sge",
            attr.max_sge.into(),
            self.attr.max_srq_sge.into(),
        )?;
        // IBTA: the limit is armed later, with modify_srq.
        let granted = SrqAttr {
            srq_limit: 0,
            max_sge: attr.max_sge.max(1),
            ..attr
        };
        let max = self.cx.srqs.max();
        let cost = budget::srq(granted.max_wr, granted.max_sge);
        self.budget.charge(Kind::Srq, cost)?;
        let Some((h, _)) = self.cx.srqs.insert(Srq::new(pd, granted)) else {
            self.budget.release(cost);
            return Err(VerbsError::Exhausted {
                kind: Kind::Srq,
                max,
            });
        };
        Ok((SrqHandle(h), granted))
    }

    /// `ibv_modify_srq`: `MAX_WR` resizes the queue (never below the WRs
    /// waiting), `LIMIT` arms the limit event (at most the WRs waiting, as
    /// rxe checks; 0 disarms). Returns the attributes now in force.
    pub fn modify_srq(
        &mut self,
        srq: SrqHandle,
        attr: SrqAttr,
        mask: SrqAttrMask,
    ) -> Result<SrqAttr> {
        let max_wr = self.attr.max_srq_wr;
        let s = self.cx.srqs.get_mut(srq.0).ok_or(VerbsError::NotFound {
            kind: Kind::Srq,
            handle: srq.0,
        })?;
        if mask.0 & !(SrqAttrMask::MAX_WR.0 | SrqAttrMask::LIMIT.0) != 0 {
            return Err(VerbsError::Invalid {
                what: "SRQ attribute mask",
            });
        }
        let waiting = s.rq.len() as u64;
        if mask.contains(SrqAttrMask::MAX_WR) {
            within("SRQ max_wr", attr.max_wr.into(), max_wr.into())?;
            if u64::from(attr.max_wr) < waiting || attr.max_wr == 0 {
                return Err(VerbsError::Invalid {
                    what: "SRQ max_wr (below the WRs waiting)",
                });
            }
        }
        // A limit below the SRQ's size (after a resize in the same call):
        // as rxe, whatever is waiting now — one above the WRs waiting
        // fires at the next receive that consumes one (responder.rs).
        let size = if mask.contains(SrqAttrMask::MAX_WR) {
            attr.max_wr
        } else {
            s.attr.max_wr
        };
        if mask.contains(SrqAttrMask::LIMIT) && attr.srq_limit >= size {
            return Err(VerbsError::Invalid {
                what: "SRQ limit (not below the SRQ's size)",
            });
        }
        if mask.contains(SrqAttrMask::MAX_WR) {
            let old = budget::srq(s.attr.max_wr, s.attr.max_sge);
            let new = budget::srq(attr.max_wr, s.attr.max_sge);
            self.budget.replace(Kind::Srq, old, new)?;
            s.resize(attr.max_wr);
        }
        if mask.contains(SrqAttrMask::LIMIT) {
            s.attr.srq_limit = attr.srq_limit;
        }
        Ok(s.attr)
    }

    /// `ibv_query_srq`.
    pub fn query_srq(&self, srq: SrqHandle) -> Result<SrqAttr> {
        self.cx
            .srqs
            .get(srq.0)
            .map(|s| s.attr)
            .ok_or(VerbsError::NotFound {
                kind: Kind::Srq,
                handle: srq.0,
            })
    }

    /// `ibv_destroy_srq`: EBUSY while a QP uses it.
    pub fn destroy_srq(&mut self, srq: SrqHandle) -> Result<()> {
        self.cx.srqs.get(srq.0).ok_or(VerbsError::NotFound {
            kind: Kind::Srq,
            handle: srq.0,
        })?;
        let users = count(&self.qps, |q| q.init.srq == Some(srq));
        if users > 0 {
            return Err(VerbsError::Busy {
                kind: Kind::Srq,
                handle: srq.0,
                users,
            });
        }
        if let Some(s) = self.cx.srqs.remove(srq.0) {
            self.budget
                .release(budget::srq(s.attr.max_wr, s.attr.max_sge));
        }
        Ok(())
    }

    // ---- address handles ----------------------------------------------

    /// `ibv_create_ah`.
    pub fn create_ah(&mut self, pd: PdHandle, attr: AhAttr) -> Result<AhHandle> {
        self.pd(pd)?;
        self.check_av(&attr)?;
        let attr = attr.masked();
        let max = self.ahs.max();
        self.budget.charge(Kind::Ah, budget::ah())?;
        let Some((h, _)) = self.ahs.insert(Ah { pd, attr }) else {
            self.budget.release(budget::ah());
            return Err(VerbsError::Exhausted {
                kind: Kind::Ah,
                max,
            });
        };
        Ok(AhHandle(h))
    }

    /// `ibv_destroy_ah`.
    pub fn destroy_ah(&mut self, ah: AhHandle) -> Result<()> {
        self.ahs.remove(ah.0).ok_or(VerbsError::NotFound {
            kind: Kind::Ah,
            handle: ah.0,
        })?;
        self.budget.release(budget::ah());
        Ok(())
    }

    /// An address vector must name this port and a filled GID slot, and a
    /// destination GID (RoCE routes by GID). Its flow label is not checked:
    /// the field is 20 bits, and the bits above are dropped
    /// ([`AhAttr::masked`]) where the vector is kept.
    fn check_av(&self, av: &AhAttr) -> Result<()> {
        check_port(av.port_num)?;
        if self.cx.port.gid(av.sgid_index).is_none() {
            return Err(VerbsError::Invalid {
                what: "source GID index",
            });
        }
        if av.dgid.0 == [0; 16] {
            return Err(VerbsError::Invalid {
                what: "destination GID (zero)",
            });
        }
        Ok(())
    }

    // ---- queue pairs --------------------------------------------------

    /// `ibv_create_qp`: returns the QPN and the capabilities granted.
    pub fn create_qp(&mut self, init: QpInitAttr) -> Result<(Qpn, QpCap)> {
        self.pd(init.pd)?;
        self.cq(init.send_cq)?;
        self.cq(init.recv_cq)?;
        if let Some(srq) = init.srq {
            self.cx.srqs.get(srq.0).ok_or(VerbsError::NotFound {
                kind: Kind::Srq,
                handle: srq.0,
            })?;
        }
        let a = &self.attr;
        let c = init.cap;
        within("max_send_wr", c.max_send_wr.into(), a.max_qp_wr.into())?;
        within("max_send_sge", c.max_send_sge.into(), a.max_sge.into())?;
        within(
            "max_inline_data",
            c.max_inline_data.into(),
            a.max_inline_data.into(),
        )?;
        let cap = if init.srq.is_some() {
            // Receives come from the SRQ; the QP has no receive queue.
            QpCap {
                max_recv_wr: 0,
                max_recv_sge: 0,
                ..c
            }
        } else {
            within("max_recv_wr", c.max_recv_wr.into(), a.max_qp_wr.into())?;
            within("max_recv_sge", c.max_recv_sge.into(), a.max_sge.into())?;
            c
        };
        let max = self.qps.max();
        let cost = self.qp_cost(&cap);
        self.budget.charge(Kind::Qp, cost)?;
        let made = self.insert_qp(QpInitAttr { cap, ..init }, max);
        if made.is_err() {
            self.budget.release(cost);
        }
        made.map(|qpn| (qpn, cap))
    }

    /// What a QP with capabilities `cap` holds ([`crate::budget::qp`]; its
    /// responder may be given the device's most READ/atomic resources).
    fn qp_cost(&self, cap: &QpCap) -> u64 {
        budget::qp(cap, self.attr.max_qp_rd_atom)
    }

    /// Makes the QP `init` (already checked) describes.
    fn insert_qp(&mut self, init: QpInitAttr, max: u32) -> Result<Qpn> {
        let mut qp = Qp::new(init);
        if init.qp_type.is_datagram() {
            // A UD QP has no path MTU attribute: its messages are limited
            // by the port's active MTU (rxe: port->mtu_cap).
            qp.attr.path_mtu = self.cx.port.active_mtu;
        }
        if init.qp_type == QpType::Gsi {
            // QP1, once.
            qp.qpn = Qpn::GSI;
            qp.attr.port_num = PORT;
            self.qps
                .insert_at(Qpn::GSI.value(), Box::new(qp))
                .ok_or(VerbsError::Invalid {
                    what: "GSI QP (the device has one already)",
                })?;
            return Ok(Qpn::GSI);
        }
        let (h, _) = self.qps.insert(Box::new(qp)).ok_or(VerbsError::Exhausted {
            kind: Kind::Qp,
            max,
        })?;
        let Ok(qpn) = Qpn::try_from(h) else {
            // A configured max_qp beyond the 24-bit QPN space.
            self.qps.remove(h);
            return Err(VerbsError::Exhausted {
                kind: Kind::Qp,
                max,
            });
        };
        if let Some(q) = self.qps.get_mut(h) {
            q.qpn = qpn;
        }
        Ok(qpn)
    }

    /// `ibv_query_qp`: the attributes and the creation parameters.
    pub fn query_qp(&self, qpn: Qpn) -> Result<(&QpAttr, &QpInitAttr)> {
        let q = self.qp(qpn)?;
        Ok((&q.attr, &q.init))
    }

    /// `ibv_modify_qp`: the transition must be allowed with exactly the
    /// attributes `mask` names (IBTA Vol1 §10.3; the kernel's
    /// `ib_modify_qp_is_ok`), and every attribute must be in range.
    pub fn modify_qp(&mut self, qpn: Qpn, attr: &QpAttr, mask: AttrMask) -> Result<()> {
        let q = self.qp(qpn)?;
        let cur = q.attr.qp_state;
        let ty = q.init.qp_type;
        if mask.contains(AttrMask::CUR_STATE) && attr.cur_qp_state != cur {
            return Err(VerbsError::Invalid {
                what: "cur_qp_state (not the QP's state)",
            });
        }
        let next = if mask.contains(AttrMask::STATE) {
            attr.qp_state
        } else {
            cur
        };
        state::check_transition(cur, next, ty, mask)?;
        self.check_qp_attr(ty, attr, mask)?;

        let q = qp_mut(&mut self.qps, qpn)?;
        let m = |bit| mask.contains(bit);
        let a = &mut q.attr;
        if m(AttrMask::ACCESS_FLAGS) {
            a.qp_access_flags = attr.qp_access_flags;
        }
        if m(AttrMask::PKEY_INDEX) {
            a.pkey_index = attr.pkey_index;
        }
        if m(AttrMask::PORT) {
            a.port_num = attr.port_num;
        }
        if m(AttrMask::QKEY) {
            a.qkey = attr.qkey;
        }
        if m(AttrMask::AV) {
            a.ah_attr = attr.ah_attr.masked();
        }
        if m(AttrMask::PATH_MTU) {
            a.path_mtu = attr.path_mtu;
        }
        if m(AttrMask::TIMEOUT) {
            a.timeout = attr.timeout;
        }
        if m(AttrMask::RETRY_CNT) {
            a.retry_cnt = attr.retry_cnt;
        }
        if m(AttrMask::RNR_RETRY) {
            a.rnr_retry = attr.rnr_retry;
        }
        if m(AttrMask::RQ_PSN) {
            a.rq_psn = attr.rq_psn;
            q.resp.epsn = attr.rq_psn;
        }
        if m(AttrMask::SQ_PSN) {
            a.sq_psn = attr.sq_psn;
            q.req.psn = attr.sq_psn;
            q.req.unacked = attr.sq_psn;
            q.req.high = attr.sq_psn;
        }
        if m(AttrMask::MAX_QP_RD_ATOMIC) {
            a.max_rd_atomic = attr.max_rd_atomic;
        }
        if m(AttrMask::MAX_DEST_RD_ATOMIC) {
            a.max_dest_rd_atomic = attr.max_dest_rd_atomic;
        }
        if m(AttrMask::MIN_RNR_TIMER) {
            a.min_rnr_timer = attr.min_rnr_timer;
        }
        if m(AttrMask::DEST_QPN) {
            a.dest_qp_num = attr.dest_qp_num;
        }
        if m(AttrMask::EN_SQD_ASYNC_NOTIFY) {
            a.en_sqd_async_notify = attr.en_sqd_async_notify;
        }
        a.qp_state = next;
        a.cur_qp_state = next;
        if next == QpState::Reset {
            // Back to RESET the QP forgets its connection (IBTA Vol1
            // §10.3.1: attributes return to their initial values) and its
            // work queues, without completions.
            *a = QpAttr {
                cap: a.cap,
                ..QpAttr::default()
            };
            q.sq.clear();
            q.rq.clear();
            q.req = Default::default();
            q.resp.reset();
        }
        if next == QpState::Rts {
            q.req.retry_left = q.attr.retry_cnt;
            q.req.rnr_left = q.attr.rnr_retry;
            if q.sq.len() > q.req.cursor {
                self.cx.schedule(q);
            }
        }
        if next == QpState::Reset {
            // The QP's connection is gone: so are its type 2 windows.
            self.cx.keys.unbind_qp(qpn);
        }
        // A connected QP's path changes here, and when the GID table does
        // (Engine::set_gid).
        q.path = q.route(&self.cx.port, q.attr.ah_attr);
        if next == QpState::Err && cur != QpState::Err {
            completion::enter_error(q, &mut self.cx, true);
        }
        // IBTA Vol1 §10.3.1: entering SQD starts the drain; it ends once no
        // WR is in flight (at once if none is).
        q.attr.sq_draining = next == QpState::Sqd && (cur != QpState::Sqd || q.attr.sq_draining);
        if next == QpState::Sqd && cur != QpState::Sqd {
            completion::check_drained(q, &mut self.cx);
        }
        self.settle();
        Ok(())
    }

    /// RESET → INIT → RTR → RTS in three modifies, each naming exactly
    /// the attributes the transition requires for the QP's type (what
    /// `ibv_rc_pingpong` and most consumers do by hand); the values come
    /// from `attr`.
    pub fn bring_up_qp(&mut self, qpn: Qpn, attr: &QpAttr) -> Result<()> {
        let ty = self.qp(qpn)?.init.qp_type;
        let mut from = QpState::Reset;
        for to in [QpState::Init, QpState::Rtr, QpState::Rts] {
            let required = state::required(from, to, ty).ok_or(VerbsError::Invalid {
                what: "QP state for bring-up",
            })?;
            let step = QpAttr {
                qp_state: to,
                ..*attr
            };
            self.modify_qp(qpn, &step, AttrMask::STATE | required)?;
            from = to;
        }
        Ok(())
    }

    /// Range checks of each attribute a modify names.
    fn check_qp_attr(&self, ty: QpType, attr: &QpAttr, mask: AttrMask) -> Result<()> {
        let m = |bit| mask.contains(bit);
        if m(AttrMask::PORT) {
            check_port(attr.port_num)?;
        }
        if m(AttrMask::PKEY_INDEX) && self.cx.port.pkey(attr.pkey_index).is_none() {
            return Err(VerbsError::Invalid {
                what: "P_Key index",
            });
        }
        if m(AttrMask::ACCESS_FLAGS) {
            let allowed = Access::LOCAL_WRITE
                | Access::REMOTE_WRITE
                | Access::REMOTE_READ
                | Access::REMOTE_ATOMIC;
            if attr.qp_access_flags.0 & !allowed.0 != 0 {
                return Err(VerbsError::Invalid {
                    what: "QP access flags",
                });
            }
        }
        if m(AttrMask::AV) {
            self.check_av(&attr.ah_attr)?;
        }
        if m(AttrMask::PATH_MTU) && attr.path_mtu > self.cx.port.max_mtu {
            return Err(VerbsError::Invalid {
                what: "path MTU (above the port's)",
            });
        }
        if m(AttrMask::TIMEOUT) && attr.timeout > 31 {
            return Err(VerbsError::Invalid { what: "timeout" });
        }
        if m(AttrMask::RETRY_CNT) && attr.retry_cnt > 7 {
            return Err(VerbsError::Invalid { what: "retry_cnt" });
        }
        if m(AttrMask::RNR_RETRY) && attr.rnr_retry > 7 {
            return Err(VerbsError::Invalid { what: "rnr_retry" });
        }
        if m(AttrMask::MIN_RNR_TIMER) && attr.min_rnr_timer > 31 {
            return Err(VerbsError::Invalid {
                what: "min_rnr_timer",
            });
        }
        if m(AttrMask::MAX_QP_RD_ATOMIC) {
            within(
                "max_rd_atomic",
                attr.max_rd_atomic.into(),
                self.attr.max_qp_init_rd_atom.into(),
            )?;
        }
        if m(AttrMask::MAX_DEST_RD_ATOMIC) {
            within(
                "max_dest_rd_atomic",
                attr.max_dest_rd_atomic.into(),
                self.attr.max_qp_rd_atom.into(),
            )?;
        }
        if m(AttrMask::QKEY) && ty == QpType::Ud && attr.qkey.is_controlled() {
            // IBTA Vol1 §10.2.5 (C10-15): consumers may not set a
            // controlled Q_Key; only privileged ones (not supported here).
            return Err(VerbsError::Invalid {
                what: "Q_Key (controlled: high bit set)",
            });
        }
        if m(AttrMask::CAP) {
            return Err(VerbsError::NotSupported {
                what: "resizing a QP's queues",
            });
        }
        if m(AttrMask::ALT_PATH) {
            // A RoCE port has no alternate path: Linux refuses the bit with
            // EINVAL before a driver sees it ("ban them in roce mode").
            return Err(VerbsError::Invalid {
                what: "alternate path on a RoCE port",
            });
        }
        if m(AttrMask::PATH_MIG_STATE) {
            return Err(VerbsError::NotSupported {
                what: "automatic path migration",
            });
        }
        if m(AttrMask::RATE_LIMIT) {
            return Err(VerbsError::NotSupported {
                what: "rate limiting",
            });
        }
        Ok(())
    }

    // ---- work requests ------------------------------------------------

    /// `ibv_post_send`: validates the WR and queues it. The QP must be in
    /// RTS or SQD (or ERR, where the WR completes at once with
    /// WR_FLUSH_ERR); a full send queue is ENOMEM, anything malformed
    /// EINVAL, as rxe's post_send returns.
    pub fn post_send(&mut self, qpn: Qpn, wr: &crate::wr::SendWr<'_>) -> Result<()> {
        self.post_send_with(qpn, wr, None)
    }

    /// A REG_MR work request that carries its page list, as a device
    /// ABI's fast-register WQE does (PVRDMA's): the pages are mapped into
    /// the MR when the REG_MR runs, in its turn, and only if the MR is then
    /// free — not when it is posted, when the MR may still be in use or be
    /// what an earlier REG_MR in the queue registers.
    pub fn post_reg_mr(
        &mut self,
        qpn: Qpn,
        wr: &crate::wr::SendWr<'_>,
        pages: Translation,
    ) -> Result<()> {
        if !matches!(wr.op, crate::wr::SendOp::RegMr { .. }) {
            return Err(VerbsError::Invalid {
                what: "a page list for an operation other than REG_MR",
            });
        }
        if !matches!(pages, Translation::Pages { .. }) {
            return Err(VerbsError::Invalid {
                what: "fast-registration mapping (a page list is required)",
            });
        }
        check_pages(&pages)?;
        self.post_send_with(qpn, wr, Some(pages))
    }

    fn post_send_with(
        &mut self,
        qpn: Qpn,
        wr: &crate::wr::SendWr<'_>,
        reg_pages: Option<Translation>,
    ) -> Result<()> {
        use crate::wr::{Payload, SendFlags, SendOp};

        let q = self.qp(qpn)?;
        let state = q.attr.qp_state;
        if !matches!(state, QpState::Rts | QpState::Sqd | QpState::Err) {
            return Err(VerbsError::Invalid {
                what: "QP state for posting sends (not RTS, SQD or ERR)",
            });
        }
        if !wr.flags.known() {
            return Err(VerbsError::Invalid { what: "send flags" });
        }
        let ty = q.init.qp_type;
        let allowed = match (ty, wr.op) {
            // A malformed WQE completes in error on any QP.
            (_, SendOp::Malformed { .. }) => true,
            (
                QpType::Ud | QpType::Gsi,
                SendOp::Send
                | SendOp::SendWithImm { .. }
                | SendOp::LocalInv { .. }
                | SendOp::RegMr { .. },
            ) => true,
            (QpType::Ud | QpType::Gsi, _) => false,
            (
                QpType::Uc,
                SendOp::Send
                | SendOp::SendWithImm { .. }
                | SendOp::RdmaWrite { .. }
                | SendOp::RdmaWriteWithImm { .. }
                | SendOp::LocalInv { .. }
                | SendOp::BindMw { .. }
                | SendOp::RegMr { .. },
            ) => true,
            (QpType::Uc, _) => false,
            (QpType::Rc, _) => true,
        };
        // SEND with invalidate exists on RC only (IBTA Table 38 has no UC
        // or UD opcode for it); binding type 2 windows needs a connected
        // QP; local operations carry no payload.
        let bad = match wr.op {
            SendOp::SendWithInv { .. } => ty != QpType::Rc,
            SendOp::BindMw { .. } => ty.is_datagram(),
            _ => false,
        };
        if bad {
            return Err(VerbsError::Invalid {
                what: "operation for this QP type",
            });
        }
        if !allowed {
            return Err(VerbsError::Invalid {
                what: "operation for this QP type",
            });
        }
        let cap = q.attr.cap;
        let length: u64 = match wr.payload {
            Payload::Sges(sges) => {
                within("SGE count", sges.len() as u64, cap.max_send_sge.into())?;
                sges.iter().map(|s| u64::from(s.length)).sum()
            }
            Payload::Inline(data) => {
                if !wr.flags.contains(SendFlags::INLINE) {
                    return Err(VerbsError::Invalid {
                        what: "inline data without the INLINE flag",
                    });
                }
                if matches!(wr.op, SendOp::RdmaRead { .. }) || wr.op.is_atomic() {
                    return Err(VerbsError::Invalid {
                        what: "inline data for a READ or atomic",
                    });
                }
                within("inline data", data.len() as u64, cap.max_inline_data.into())?;
                data.len() as u64
            }
        };
        if wr.op.is_atomic() {
            // IBTA Vol1 §9.4.5: an atomic targets one naturally aligned
            // 8-byte word and returns it into an 8-byte local buffer.
            if length != 8 {
                return Err(VerbsError::Invalid {
                    what: "atomic local length (not 8 bytes)",
                });
            }
            if wr.op.remote_addr().is_some_and(|a| a % 8 != 0) {
                return Err(VerbsError::Invalid {
                    what: "atomic remote address (not 8-byte aligned)",
                });
            }
        }
        let mut ud_av = None;
        match ty {
            // Local operations go nowhere.
            _ if wr.op.is_local() => {}
            QpType::Ud | QpType::Gsi => {
                let Some(ud) = wr.ud else {
                    return Err(VerbsError::Invalid {
                        what: "UD send without a destination",
                    });
                };
                ud_av = Some(match ud.av {
                    crate::wr::Av::Handle(h) => {
                        let ah = self.ahs.get(h.0).ok_or(VerbsError::NotFound {
                            kind: Kind::Ah,
                            handle: h.0,
                        })?;
                        if ah.pd != q.init.pd {
                            return Err(VerbsError::Invalid {
                                what: "address handle of another PD",
                            });
                        }
                        ah.attr
                    }
                    crate::wr::Av::Inline(attr) => attr.masked(),
                });
                // A UD message is one packet.
                within("UD message", length, q.attr.path_mtu.bytes().into())?;
            }
            QpType::Rc | QpType::Uc => {
                // IBTA Vol1 §9.7.5: messages up to 2^31 bytes.
                within("message length", length, 1 << 31)?;
            }
        }
        // Local operations move no data.
        let length = if wr.op.is_local() { 0 } else { length };
        let signaled = q.init.sq_sig_all || wr.flags.contains(SendFlags::SIGNALED);

        let q = qp_mut(&mut self.qps, qpn)?;
        let Some(slot) = q.sq.next_free() else {
            return Err(VerbsError::QueueFull {
                what: "send queue",
                depth: cap.max_send_wr,
            });
        };
        slot.wr_id = wr.wr_id;
        slot.op = Some(wr.op);
        slot.flags = wr.flags;
        slot.ud = wr.ud;
        slot.length = length;
        slot.signaled = signaled;
        slot.read_done = 0;
        slot.av = ud_av;
        slot.executed = false;
        slot.status = None;
        slot.reg_pages = reg_pages;
        slot.sges.clear();
        slot.inline.clear();
        match wr.payload {
            Payload::Sges(sges) => {
                slot.sges.extend_from_slice(sges);
                slot.is_inline = false;
            }
            Payload::Inline(data) => {
                slot.inline.extend_from_slice(data);
                slot.is_inline = true;
            }
        }
        q.sq.commit();
        match state {
            QpState::Err => completion::enter_error(q, &mut self.cx, false),
            QpState::Rts => self.cx.schedule(q),
            // SQD: queued until the QP is back in RTS.
            _ => {}
        }
        self.settle();
        Ok(())
    }

    /// `ibv_post_recv`: the QP must be past RESET and have its own receive
    /// queue (EINVAL with an SRQ); in ERR the WR is flushed at once.
    pub fn post_recv(&mut self, qpn: Qpn, wr: &crate::wr::RecvWr<'_>) -> Result<()> {
        let q = self.qp(qpn)?;
        let state = q.attr.qp_state;
        if state == QpState::Reset {
            return Err(VerbsError::Invalid {
                what: "QP state for posting receives (RESET)",
            });
        }
        if q.init.srq.is_some() {
            return Err(VerbsError::Invalid {
                what: "receive on a QP that uses an SRQ",
            });
        }
        let cap = q.attr.cap;
        within(
            "SGE count",
            wr.sg_list.len() as u64,
            cap.max_recv_sge.into(),
        )?;
        let q = qp_mut(&mut self.qps, qpn)?;
        fill_recv(q.rq.next_free(), wr, cap.max_recv_wr)?;
        q.rq.commit();
        if state == QpState::Err {
            completion::enter_error(q, &mut self.cx, false);
        }
        self.settle();
        Ok(())
    }

    /// `ibv_post_srq_recv`.
    pub fn post_srq_recv(&mut self, srq: SrqHandle, wr: &crate::wr::RecvWr<'_>) -> Result<()> {
        let s = self.cx.srqs.get_mut(srq.0).ok_or(VerbsError::NotFound {
            kind: Kind::Srq,
            handle: srq.0,
        })?;
        within("SGE count", wr.sg_list.len() as u64, s.attr.max_sge.into())?;
        fill_recv(s.rq.next_free(), wr, s.attr.max_wr)?;
        s.rq.commit();
        Ok(())
    }

    /// `ibv_destroy_qp`. Type 2 windows bound to the QP are unbound (its
    /// QPN may name another QP next).
    pub fn destroy_qp(&mut self, qpn: Qpn) -> Result<()> {
        if self.qps.get(qpn.value()).is_some() {
            self.cx.keys.unbind_qp(qpn);
        }
        let q = self.qps.remove(qpn.value()).ok_or(VerbsError::NotFound {
            kind: Kind::Qp,
            handle: qpn.value(),
        })?;
        self.budget.release(self.qp_cost(&q.init.cap));
        Ok(())
    }

    // ---- what a device face needs ----------------------------------------

    /// Sets GID table entry `index` (a face binds its guest's addresses as
    /// they come and go). Connected QPs' paths follow; a QP whose source
    /// GID went away sends nothing until it is set again.
    pub fn set_gid(&mut self, index: u8, entry: Option<GidEntry>) -> Result<()> {
        let slot = self
            .cx
            .port
            .gids
            .get_mut(usize::from(index))
            .ok_or(VerbsError::Invalid { what: "GID index" })?;
        *slot = entry;
        let port = &self.cx.port;
        for (_, q) in self.qps.iter_mut() {
            q.path = q.route(port, q.attr.ah_attr);
        }
        Ok(())
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

    /// Send WQEs a QP holds (posted and not yet retired).
    pub fn sq_len(&self, qpn: Qpn) -> Option<u32> {
        self.qps.get(qpn.value()).map(|q| q.sq.len() as u32)
    }

    /// Receive WQEs a QP holds.
    pub fn rq_len(&self, qpn: Qpn) -> Option<u32> {
        self.qps.get(qpn.value()).map(|q| q.rq.len() as u32)
    }

    /// Receive WQEs an SRQ holds.
    pub fn srq_len(&self, srq: SrqHandle) -> Option<u32> {
        self.cx.srqs.get(srq.0).map(|s| s.rq.len() as u32)
    }

    /// The QP failed outside any completion (a face found its rings broken,
    /// or a WQE it could not take): it enters ERR, flushing its WRs, and a
    /// QP_FATAL event is raised (IBTA Vol1 §11.6.3, local work queue
    /// catastrophic error).
    pub fn qp_fatal(&mut self, qpn: Qpn) -> Result<()> {
        let q = qp_mut(&mut self.qps, qpn)?;
        if q.attr.qp_state == QpState::Reset {
            return Err(VerbsError::Invalid {
                what: "QP state (RESET)",
            });
        }
        if q.attr.qp_state != QpState::Err {
            completion::enter_error(q, &mut self.cx, true);
        }
        self.cx.events.push_back(AsyncEvent::QpFatal { qp: qpn });
        self.settle();
        Ok(())
    }

    fn qp(&self, qpn: Qpn) -> Result<&Qp> {
        self.qps
            .get(qpn.value())
            .map(|q| &**q)
            .ok_or(VerbsError::NotFound {
                kind: Kind::Qp,
                handle: qpn.value(),
            })
    }

    /// Live objects per kind, for `vrdma stat` and tests.
    pub fn counts(&self) -> Counts {
        Counts {
            pds: self.pds.len(),
            mrs: self.cx.keys.len(),
            cqs: self.cx.cqs.len(),
            qps: self.qps.len(),
            srqs: self.cx.srqs.len(),
            ahs: self.ahs.len(),
        }
    }
}

/// Live objects per kind.
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub struct Counts {
    pub pds: u32,
    pub mrs: u32,
    pub cqs: u32,
    pub qps: u32,
    pub srqs: u32,
    pub ahs: u32,
}

fn check_port(port: u8) -> Result<()> {
    if port == PORT {
        Ok(())
    } else {
        Err(VerbsError::Invalid {
            what: "port number",
        })
    }
}

/// The QP `qpn` names, from the table alone (so that the context stays
/// free to borrow beside it).
fn qp_mut(qps: &mut Table<Box<Qp>>, qpn: Qpn) -> Result<&mut Qp> {
    qps.get_mut(qpn.value())
        .map(|q| &mut **q)
        .ok_or(VerbsError::NotFound {
            kind: Kind::Qp,
            handle: qpn.value(),
        })
}

fn count<T>(t: &Table<T>, f: impl Fn(&T) -> bool) -> u32 {
    t.iter().filter(|(_, v)| f(v)).count() as u32
}

/// Copies a receive WR into a free slot (`None`: the queue is full).
fn fill_recv(
    slot: Option<&mut crate::wr::RecvWqe>,
    wr: &crate::wr::RecvWr<'_>,
    depth: u32,
) -> Result<()> {
    let Some(slot) = slot else {
        return Err(VerbsError::QueueFull {
            what: "receive queue",
            depth,
        });
    };
    slot.wr_id = wr.wr_id;
    slot.sges.clear();
    slot.sges.extend_from_slice(wr.sg_list);
    slot.length = wr.sg_list.iter().map(|s| u64::from(s.length)).sum();
    Ok(())
}

/// A page list's page size, first-page offset and page alignment.
fn check_pages(translation: &Translation) -> Result<()> {
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
