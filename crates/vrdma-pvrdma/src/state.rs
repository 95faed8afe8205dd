//! The face's state: the device behind the PCI function and what the
//! guest made on it — user contexts, PDs, CQs, QPs and SRQs by the handles
//! the guest names them with, the pages their rings hold, and the rings
//! the device takes work from. Commands (`cmd`) and doorbells act on it;
//! the PCI function (`function`) owns it, beside its registers.

use std::collections::{BTreeMap, BTreeSet};

use vm_memory::GuestMemoryMmap;
use vrdma_device::{Device, GuestMem, ObjectBudget, Transport};
use vrdma_engine::{CqHandle, Engine, attr::PortAttr};
use vrdma_face::{Budget, Claims, Refusals, Taken, cq::SharedMem};
use vrdma_wire::{Gid, Qpn};

use crate::{
    abi::{eqe, uar},
    caps::Limits,
    doorbells::SharedDoorbells,
    qp::QpFace,
    srq::SrqFace,
};

/// Counters of the face.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct FaceStats {
    pub commands: u64,
    pub command_errors: u64,
    pub doorbells: u64,
    /// Doorbells rung for an object that does not exist or is not the
    /// page's (another context's).
    pub doorbells_refused: u64,
    pub wqes: u64,
    pub malformed_wqes: u64,
    /// QPs and SRQs whose rings the guest broke (taken to ERR).
    pub broken_rings: u64,
    pub events: u64,
    pub notifications: u64,
    /// Device-ring entries dropped (the guest did not consume them).
    pub ring_drops: u64,
    pub resets: u64,
    /// GIDs the guest tried to bind that are not its port's addresses.
    pub gids_refused: u64,
    /// Device threads that panicked while serving this device (each
    /// reported, the device reset).
    pub panics: u64,
}

/// A CQ's owner, for its doorbells.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CqInfo {
    pub uar: u32,
}

/// The device and the guest's objects on it.
#[derive(Debug)]
pub(crate) struct State<T: Transport> {
    pub limits: Limits,
    /// What a new engine is made with (after each reset).
    pub node_guid: u64,
    port: PortAttr,
    pub device: Device<GuestMem, T>,
    /// Guest memory as the CQ sinks see it.
    pub shared: SharedMem,
    /// What the guest's objects may make the engine hold.
    budget: Budget,
    /// User contexts: handle → doorbell page.
    pub ucs: BTreeMap<u32, u32>,
    pub next_uc: u32,
    /// PDs: handle → context handle (0: the kernel's).
    pub pds: BTreeMap<u32, u32>,
    pub cqs: BTreeMap<u32, CqInfo>,
    pub qps: BTreeMap<u32, QpFace>,
    pub srqs: BTreeMap<u32, SrqFace>,
    /// The pages of every ring (the device's and the guest's objects').
    pub ring_pages: Claims,
    /// QPs and SRQs with WQEs the engine holds or the guest posted and the
    /// device did not take yet: their indices are published each round.
    pub busy_qps: BTreeSet<u32>,
    pub busy_srqs: BTreeSet<u32>,
    /// Async events of the face's own (an SRQ whose ring broke: the engine
    /// knows no SRQ errors), delivered after the engine's.
    face_events: Vec<(u32, u32)>,
    pub stats: FaceStats,
    /// Refused commands and WQEs, by reason, and their log.
    pub refusals: vrdma_face::Refusals,
}

impl<T: Transport> State<T> {
    /// A device with `limits`, whose engine has node GUID `node_guid` and
    /// port `port`, reaching the network through `transport`; nothing made
    /// yet, the object budget derived from the (no) memory mapped.
    pub fn new(limits: Limits, node_guid: u64, port: PortAttr, transport: T) -> Self {
        let engine = Engine::new(limits.device_attr(node_guid), port.clone());
        let mut device = Device::new(engine, GuestMem::default(), transport);
        let budget = Budget::new(ObjectBudget::Derived);
        budget.apply(&mut device);
        State {
            limits,
            node_guid,
            port,
            device,
            shared: SharedMem::new(GuestMemoryMmap::default()),
            budget,
            ucs: BTreeMap::new(),
            next_uc: 1,
            pds: BTreeMap::new(),
            cqs: BTreeMap::new(),
            qps: BTreeMap::new(),
            srqs: BTreeMap::new(),
            ring_pages: Claims::default(),
            busy_qps: BTreeSet::new(),
            busy_srqs: BTreeSet::new(),
            face_events: Vec::new(),
            stats: FaceStats::default(),
            refusals: vrdma_face::Refusals::default(),
        }
    }

    /// What the guest's objects may make the engine hold, from now on.
    pub fn set_budget(&mut self, budget: ObjectBudget) {
        self.budget.set(budget, &mut self.device);
    }

    /// The guest's configured RAM, which a derived budget comes from.
    pub fn set_guest_size(&mut self, guest: Option<u64>) {
        self.budget.set_guest_size(guest, &mut self.device);
    }

    /// Everything the guest made goes: a new engine (nothing of the old
    /// one reaches guest memory again), empty tables, no GID steered to
    /// the engine.
    pub fn reset(&mut self) {
        let fresh = Engine::new(self.limits.device_attr(self.node_guid), self.port.clone());
        self.budget.replace_engine(&mut self.device, fresh);
        self.qps.clear();
        self.srqs.clear();
        self.cqs.clear();
        self.pds.clear();
        self.ucs.clear();
        self.ring_pages.clear();
        self.next_uc = 1;
        self.busy_qps.clear();
        self.busy_srqs.clear();
        self.face_events.clear();
        self.device.transport_mut().set_local(&[]);
    }

    /// The guest's memory maps changed: the engine, the CQ sinks and the
    /// transport's lent pieces move to the new memory at once.
    pub fn remap(&mut self, mem: &GuestMemoryMmap<()>) {
        self.budget.remap(&mut self.device, &self.shared, mem);
    }

    /// The port steers to the engine what is addressed to the GIDs bound
    /// now.
    pub fn rebind(&mut self) {
        let gids: Vec<Gid> = self
            .device
            .engine()
            .query_port(1)
            .map(|p| p.gids.iter().flatten().map(|e| e.gid).collect())
            .unwrap_or_default();
        self.device.transport_mut().set_local(&gids);
    }

    /// The doorbell page of the context that owns PD `pd` (0: the
    /// kernel's).
    pub fn pd_page(&self, pd: u32) -> Option<u32> {
        let ctx = *self.pds.get(&pd)?;
        if ctx == 0 {
            return Some(0);
        }
        self.ucs.get(&ctx).copied()
    }

    /// The async events of the face's own, taken.
    #[must_use = "the events taken must be raised"]
    pub fn take_face_events(&mut self) -> Vec<(u32, u32)> {
        std::mem::take(&mut self.face_events)
    }

    /// A doorbell: `v` written at `offset` of doorbell page `page`.
    pub fn doorbell(&mut self, mem: &GuestMemoryMmap<()>, page: u32, offset: u64, v: u32) {
        let handle = v & uar::HANDLE_MASK;
        match offset {
            uar::QP_OFFSET => {
                if self.qps.get(&handle).is_none_or(|q| q.uar != page) {
                    self.stats.doorbells_refused += 1;
                    return;
                }
                if v & uar::QP_SEND != 0 {
                    self.take_sends(mem, handle);
                }
                if v & uar::QP_RECV != 0 {
                    self.take_recvs(mem, handle);
                }
            }
            uar::CQ_OFFSET => {
                if self.cqs.get(&handle).is_none_or(|c| c.uar != page) {
                    self.stats.doorbells_refused += 1;
                    return;
                }
                let cq = CqHandle(handle);
                let engine = self.device.engine_mut();
                if v & uar::CQ_ARM != 0 {
                    let _ = engine.req_notify_cq(cq, false);
                } else if v & uar::CQ_ARM_SOL != 0 {
                    let _ = engine.req_notify_cq(cq, true);
                }
                // POLL: completions are written as they happen; nothing
                // waits to be flushed.
            }
            uar::SRQ_OFFSET => {
                if self.srqs.get(&handle).is_none_or(|s| s.uar != page) {
                    self.stats.doorbells_refused += 1;
                    return;
                }
                if v & uar::SRQ_RECV != 0 {
                    self.take_srq(mem, handle);
                }
            }
            _ => self.stats.doorbells_refused += 1,
        }
    }

    /// Reads the shared doorbell pages of the contexts in use (the
    /// kernel's, page 0, and each user context's): QP and SRQ doorbells
    /// are counted (every ring is taken from anyway); a store to a page's
    /// CQ word arms every CQ of that page (see `doorbells`).
    pub fn shared_doorbells(&mut self, d: &SharedDoorbells) {
        // Page 0 is the kernel's; a user context's page is never 0 and
        // never another's (CREATE_UC checks both): no page twice.
        for page in std::iter::once(0).chain(self.ucs.values().copied()) {
            for offset in [uar::QP_OFFSET, uar::SRQ_OFFSET] {
                if d.take(page, offset) != 0 {
                    self.stats.doorbells += 1;
                }
            }
            if d.take(page, uar::CQ_OFFSET) == 0 {
                continue;
            }
            self.stats.doorbells += 1;
            let engine = self.device.engine_mut();
            for (&cq, info) in &self.cqs {
                if info.uar == page {
                    let _ = engine.req_notify_cq(CqHandle(cq), false);
                }
            }
        }
    }

    /// Takes the send WQEs QP `qpn`'s guest posted.
    pub fn take_sends(&mut self, mem: &GuestMemoryMmap<()>, qpn: u32) {
        self.take_qp(qpn, |q, engine, refusals, now| {
            q.take_sends(mem, engine, refusals, now)
        });
    }

    /// Takes the receive WQEs QP `qpn`'s guest posted.
    pub fn take_recvs(&mut self, mem: &GuestMemoryMmap<()>, qpn: u32) {
        self.take_qp(qpn, |q, engine, refusals, now| {
            q.take_recvs(mem, engine, refusals, now)
        });
    }

    /// Takes from one of QP `qpn`'s rings with `take` (which gives the
    /// slots back at once), counts what it took, fails the QP whose ring
    /// broke, and keeps it in the busy set.
    fn take_qp(
        &mut self,
        qpn: u32,
        take: impl FnOnce(&mut QpFace, &mut Engine, &mut Refusals, u64) -> Taken,
    ) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let now = self.device.now();
        let engine = self.device.engine_mut();
        let t = take(q, engine, &mut self.refusals, now);
        qp_taken(&mut self.stats, engine, q.qpn(), t);
        self.busy_qps.insert(qpn);
    }

    /// Takes the WQEs SRQ `srq`'s guest posted.
    pub fn take_srq(&mut self, mem: &GuestMemoryMmap<()>, srq: u32) {
        let Some(s) = self.srqs.get_mut(&srq) else {
            return;
        };
        let now = self.device.now();
        let t = s.take(mem, self.device.engine_mut(), &mut self.refusals, now);
        self.srq_taken(srq, t);
        self.busy_srqs.insert(srq);
    }

    /// Counts what an SRQ's ring gave; a ring that broke (it happens once:
    /// nothing more is taken from it) raises SRQ_ERR for it.
    fn srq_taken(&mut self, srq: u32, t: Taken) {
        self.stats.wqes += u64::from(t.entries);
        self.stats.malformed_wqes += u64::from(t.malformed);
        if t.broken {
            self.stats.broken_rings += 1;
            self.face_events.push((eqe::SRQ_ERR, srq));
        }
    }

    /// Takes from every ring (the mode with no exit per post: nothing
    /// says which rings were posted to).
    pub fn take_all(&mut self, mem: &GuestMemoryMmap<()>) {
        let qps: Vec<u32> = self.qps.keys().copied().collect();
        for qpn in qps {
            self.take_sends(mem, qpn);
            self.take_recvs(mem, qpn);
        }
        let srqs: Vec<u32> = self.srqs.keys().copied().collect();
        for s in srqs {
            self.take_srq(mem, s);
        }
    }

    /// Room freed in the engine: takes what waited in the busy QPs' and
    /// SRQs' rings, publishes what was taken, and forgets those with
    /// nothing left in the engine or the ring.
    pub fn progress_rings(&mut self, mem: &GuestMemoryMmap<()>) {
        let busy: Vec<u32> = self.busy_qps.iter().copied().collect();
        for qpn in busy {
            let Some(q) = self.qps.get_mut(&qpn) else {
                self.busy_qps.remove(&qpn);
                continue;
            };
            let now = self.device.now();
            let engine = self.device.engine_mut();
            if q.queues.pending(mem) {
                let r = &mut self.refusals;
                let t = q
                    .take_sends(mem, engine, r, now)
                    .and(q.take_recvs(mem, engine, r, now));
                qp_taken(&mut self.stats, engine, q.qpn(), t);
            }
            if q.queues.settle(mem, engine) {
                self.busy_qps.remove(&qpn);
            }
        }
        let busy: Vec<u32> = self.busy_srqs.iter().copied().collect();
        for srq in busy {
            let Some(s) = self.srqs.get_mut(&srq) else {
                self.busy_srqs.remove(&srq);
                continue;
            };
            let now = self.device.now();
            let engine = self.device.engine_mut();
            let t = if s.queue.pending(mem) {
                s.take(mem, engine, &mut self.refusals, now)
            } else {
                Taken::default()
            };
            let idle = s.queue.settle(mem, engine);
            self.srq_taken(srq, t);
            if idle {
                self.busy_srqs.remove(&srq);
            }
        }
    }
}

/// Counts what a QP's rings gave; a ring that broke (it happens once:
/// nothing more is taken from the QP until it is reset) fails the QP.
fn qp_taken(stats: &mut FaceStats, engine: &mut Engine, qpn: Qpn, t: Taken) {
    stats.wqes += u64::from(t.entries);
    stats.malformed_wqes += u64::from(t.malformed);
    if t.broken {
        stats.broken_rings += 1;
        let _ = engine.qp_fatal(qpn);
    }
}
