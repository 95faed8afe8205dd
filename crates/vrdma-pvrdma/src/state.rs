//! The face's state: the device behind the PCI function and what the
//! guest made on it — user contexts, PDs, CQs, QPs and SRQs by the handles
//! the guest names them with, the pages their rings hold, and the rings
//! the device takes work from. Commands (`cmd`) and doorbells act on it;
//! the PCI function (`function`) owns it, beside its registers.

use std::collections::BTreeMap;

use vrdma_device::Transport;
use vrdma_engine::{CqHandle, attr::PortAttr};
use vrdma_face::{FaceDevice, Rings, TakeStats};

use crate::{
    abi::{eqe, uar},
    caps::Limits,
    doorbells::{SharedDoorbells, Watch},
    qp::QpFace,
    srq::SrqFace,
};

/// The device's name in the log when its thread has none.
pub(crate) const FACE: &str = "pvrdma";

/// Counters of the face.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct FaceStats {
    pub commands: u64,
    pub command_errors: u64,
    pub doorbells: u64,
    /// Doorbells rung for an object that does not exist or is not the
    /// page's (another context's).
    pub doorbells_refused: u64,
    /// What was taken from the guest's rings (the face core's count):
    /// WQEs, malformed ones, QPs and SRQs whose rings the guest broke.
    pub rings: TakeStats,
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
    /// With shared doorbells: QPs whose work the sweep found — their
    /// doorbell overwritten, never written, or not yet written (a driver
    /// between its producer index and its doorbell store).
    pub sweep_found: u64,
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
    /// The device, its QPs and SRQs with their rings, claimed pages,
    /// refusals: the face core's, as every face's.
    pub dev: FaceDevice<T, QpFace, SrqFace>,
    /// User contexts: handle → doorbell page.
    pub ucs: BTreeMap<u32, u32>,
    pub next_uc: u32,
    /// PDs: handle → context handle (0: the kernel's).
    pub pds: BTreeMap<u32, u32>,
    pub cqs: BTreeMap<u32, CqInfo>,
    pub stats: FaceStats,
    /// With shared doorbells: the QPs looked at beside those rung.
    pub watch: Watch,
}

impl<T: Transport> State<T> {
    /// A device with `limits`, whose engine has node GUID `node_guid` and
    /// port `port`, reaching the network through `transport`; nothing made
    /// yet, the object budget derived from the (no) memory mapped.
    pub fn new(limits: Limits, node_guid: u64, port: PortAttr, transport: T) -> Self {
        let attr = limits.device_attr(node_guid);
        State {
            limits,
            dev: FaceDevice::new(attr, port, transport, FACE),
            ucs: BTreeMap::new(),
            next_uc: 1,
            pds: BTreeMap::new(),
            cqs: BTreeMap::new(),
            stats: FaceStats::default(),
            watch: Watch::default(),
        }
    }

    /// The face's counters, with what the face core counted of the rings.
    pub fn stats(&self) -> FaceStats {
        FaceStats {
            rings: self.dev.taken,
            gids_refused: self.dev.gids_refused,
            sweep_found: self.watch.sweep_found,
            ..self.stats
        }
    }

    /// Everything the guest made goes: a new engine (nothing of the old
    /// one reaches guest memory again), empty tables, no GID steered to
    /// the engine.
    pub fn reset(&mut self) {
        self.dev.reset();
        self.cqs.clear();
        self.pds.clear();
        self.ucs.clear();
        self.next_uc = 1;
        self.watch.clear();
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

    /// The async events of the face's own: SRQs whose ring broke (the
    /// engine knows no SRQ errors), delivered after the engine's.
    #[must_use = "the events taken must be raised"]
    pub fn take_face_events(&mut self) -> Vec<(u32, u32)> {
        self.dev
            .take_broken_srqs()
            .into_iter()
            .map(|srq| (eqe::SRQ_ERR, srq))
            .collect()
    }

    /// A doorbell: `v` written at `offset` of doorbell page `page`.
    pub fn doorbell(&mut self, page: u32, offset: u64, v: u32) {
        let handle = v & uar::HANDLE_MASK;
        match offset {
            uar::QP_OFFSET => {
                self.take_rung_qp(page, v);
            }
            uar::CQ_OFFSET => {
                if self.cqs.get(&handle).is_none_or(|c| c.uar != page) {
                    self.stats.doorbells_refused += 1;
                    return;
                }
                let cq = CqHandle(handle);
                let engine = self.dev.device.engine_mut();
                if v & uar::CQ_ARM != 0 {
                    let _ = engine.req_notify_cq(cq, false);
                } else if v & uar::CQ_ARM_SOL != 0 {
                    let _ = engine.req_notify_cq(cq, true);
                }
                // POLL: completions are written as they happen; nothing
                // waits to be flushed.
            }
            uar::SRQ_OFFSET => {
                if self.dev.srqs.get(&handle).is_none_or(|s| s.uar != page) {
                    self.stats.doorbells_refused += 1;
                    return;
                }
                if v & uar::SRQ_RECV != 0 {
                    self.dev.take_srq(handle);
                }
            }
            _ => self.stats.doorbells_refused += 1,
        }
    }

    /// A look at the guest's memory with shared doorbells: the doorbell
    /// pages of the contexts in use (the kernel's, page 0, and each user
    /// context's) — the QPs they name taken from; a store to a page's CQ
    /// word arms every CQ of that page (see `doorbells`) — then the QPs
    /// that gave work lately, the sweep's share of every QP, and every
    /// SRQ.
    pub fn shared_look(&mut self, d: &SharedDoorbells) {
        // The last round's clock: a look needs no reading of its own.
        let now = self.dev.device.clock();
        // Page 0 is the kernel's; a user context's page is never 0 and
        // never another's (CREATE_UC checks both): no page twice.
        let mut pages = std::mem::take(&mut self.watch.pages);
        pages.clear();
        pages.push(0);
        pages.extend(self.ucs.values().copied());
        for &page in &pages {
            let v = d.take(page, uar::QP_OFFSET);
            if v != 0 {
                self.stats.doorbells += 1;
                self.rung_qp(page, v, now);
            }
            if d.take(page, uar::SRQ_OFFSET) != 0 {
                self.stats.doorbells += 1;
            }
            if d.take(page, uar::CQ_OFFSET) == 0 {
                continue;
            }
            self.stats.doorbells += 1;
            let engine = self.dev.device.engine_mut();
            for (&cq, info) in &self.cqs {
                if info.uar == page {
                    let _ = engine.req_notify_cq(CqHandle(cq), false);
                }
            }
        }
        self.watch.pages = pages;
        let recent = self.watch.recent(now);
        for &qpn in &recent {
            self.take_watched(qpn, now);
        }
        self.watch.give_back(recent);
        let share = self.watch.sweep(now, &self.dev.qps);
        for &qpn in &share {
            if self.take_watched(qpn, now) {
                self.watch.sweep_found += 1;
            }
        }
        self.watch.give_back(share);
        self.dev.take_all_srqs();
    }

    /// A QP doorbell `v` read from page `page`: the rings it names taken
    /// from, if the QP is the page's.
    fn rung_qp(&mut self, page: u32, v: u32, now: u64) {
        if let Some(handle) = self.take_rung_qp(page, v) {
            self.watch.note(handle, now);
        }
    }

    /// A QP doorbell `v` on page `page` (trapped or read): the rings it
    /// names taken from, if the QP is the page's (counted as refused if
    /// not); the QP's handle if a ring was taken from.
    fn take_rung_qp(&mut self, page: u32, v: u32) -> Option<u32> {
        let handle = v & uar::HANDLE_MASK;
        if self.dev.qps.get(&handle).is_none_or(|q| q.uar != page) {
            self.stats.doorbells_refused += 1;
            return None;
        }
        let rings = Rings {
            sends: v & uar::QP_SEND != 0,
            recvs: v & uar::QP_RECV != 0,
        };
        if !(rings.sends || rings.recvs) {
            return None;
        }
        self.dev.take_qp(handle, rings);
        Some(handle)
    }

    /// Takes from both rings of QP `qpn` (one the device watches); whether
    /// they gave WQEs (the QP is then recent).
    fn take_watched(&mut self, qpn: u32, now: u64) -> bool {
        if !self.dev.qp_pending(qpn) {
            return false;
        }
        let before = self.dev.taken.wqes;
        self.dev.take_qp(qpn, Rings::BOTH);
        let gave = self.dev.taken.wqes != before;
        if gave {
            self.watch.note(qpn, now);
        }
        gave
    }
}
