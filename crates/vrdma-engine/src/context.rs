//! What every role of the data path works with beside the one QP it is
//! handling: the port, the key table, CQs and SRQs, the transmit queue,
//! the timers, the event and notification queues, the counters and the
//! clock. The engine lends a role one QP (`&mut Qp`) and this context
//! (`&mut Ctx`) side by side, so a role never looks its QP up again.
//!
//! What reaches across QPs is deferred to the engine: a CQ that overflows
//! is recorded here and the engine takes the CQ's other QPs to ERR once
//! the role returns ([`Ctx::overflowed`]).

use std::collections::VecDeque;

use vrdma_wire::{Gid, Lkey, PKey, Qpn, frame::IpRepr};

use crate::{
    attr::PortAttr,
    cq::{Cq, Pushed},
    deadlines::{Deadlines, TimerKind},
    event::AsyncEvent,
    handle::CqHandle,
    mr::Keys,
    objects::Srq,
    qpc::Qp,
    stats::Stats,
    table::Table,
    transmit::PayloadRef,
    wc::Wc,
    window::JUMBO_PSNS,
};

/// The engine's state apart from its QPs (and the PD and AH tables, which
/// only the control path reads).
#[derive(Debug)]
pub(crate) struct Ctx {
    pub port: PortAttr,
    pub keys: Keys,
    pub cqs: Table<Cq>,
    pub srqs: Table<Srq>,
    pub events: VecDeque<AsyncEvent>,
    /// CQs with a notification due (armed CQs that got a completion).
    pub notifications: VecDeque<CqHandle>,
    /// QPs with a packet to send (requester work or a response), each
    /// once ([`Qp::scheduled`]).
    pub ready: VecDeque<Qpn>,
    pub deadlines: Deadlines,
    pub stats: Stats,
    /// The latest time the caller gave, in nanoseconds.
    pub now: u64,
    /// Payload pieces of the packet the last gather poll lent, and whether
    /// the poll running lends.
    pub lent: Vec<PayloadRef>,
    pub lend: bool,
    /// The MRs the lent pieces lie in, each once, by lkey (their fences
    /// are cloned only for a caller that asks:
    /// [`crate::Engine::gathered_fences`]).
    pub lent_mrs: Vec<Lkey>,
    /// Addresses of peers whose medium takes a run of up to
    /// [`JUMBO_PSNS`] segments in one packet ([`crate::Engine::set_jumbo`]).
    pub jumbo: Vec<Gid>,
    /// CQs that overflowed since the engine last looked: their QPs go to
    /// ERR.
    pub overflowed: Vec<CqHandle>,
}

impl Ctx {
    pub(crate) fn new(port: PortAttr, keys: Keys, cqs: Table<Cq>, srqs: Table<Srq>) -> Self {
        Ctx {
            port,
            keys,
            cqs,
            srqs,
            events: VecDeque::new(),
            notifications: VecDeque::new(),
            ready: VecDeque::new(),
            deadlines: Deadlines::default(),
            stats: Stats::default(),
            now: 0,
            lent: Vec::new(),
            lend: false,
            lent_mrs: Vec::new(),
            jumbo: Vec::new(),
            overflowed: Vec::new(),
        }
    }

    /// The payload bytes one packet of `q` carries at most: its path MTU,
    /// or — in a gather poll, to a peer on a medium that takes a run of
    /// segments at once — [`JUMBO_PSNS`] MTUs. Such a packet still takes
    /// one PSN per MTU, so every sequence rule holds as on the wire; only
    /// a payload lent by reference may be that long (one copied into the
    /// caller's buffer is an MTU at most).
    pub(crate) fn segment(&self, q: &Qp) -> u64 {
        let mtu = u64::from(q.attr.path_mtu.bytes());
        if self.lend && q.path.is_some_and(|p| self.jumbo.contains(&p.dgid)) {
            mtu * u64::from(JUMBO_PSNS)
        } else {
            mtu
        }
    }

    /// Whether a packet that came with `ip` may carry a run of segments.
    pub(crate) fn jumbo_from(&self, ip: &IpRepr) -> bool {
        !self.jumbo.is_empty() && self.jumbo.contains(&Gid::from(ip.src()))
    }

    /// Puts `q` in the transmit queue (once).
    pub(crate) fn schedule(&mut self, q: &mut Qp) {
        if !q.scheduled {
            q.scheduled = true;
            self.ready.push_back(q.qpn);
        }
    }

    /// Adds a completion to `cq`; an armed CQ's notification becomes due;
    /// a CQ's first overflow is recorded for the engine (CQ error event,
    /// its QPs to ERR).
    pub(crate) fn post_cqe(&mut self, cq: CqHandle, wc: Wc, solicited: bool) {
        let Some(c) = self.cqs.get_mut(cq.0) else {
            return;
        };
        let was = c.overflowed();
        match c.push(wc, solicited) {
            Pushed::Stored => {}
            Pushed::Notify => self.notifications.push_back(cq),
            Pushed::Overflow => {
                if !was {
                    self.overflowed.push(cq);
                }
            }
        }
    }

    /// The P_Key at `index` (the default one if the table has none there).
    pub(crate) fn pkey_of(&self, index: u16) -> PKey {
        self.port.pkey(index).unwrap_or(PKey::DEFAULT)
    }

    /// Sets `q`'s retransmit timer (`None`: stopped).
    pub(crate) fn set_retransmit_timer(&mut self, q: &mut Qp, at: Option<u64>) {
        q.req.timer = at;
        self.arm(q, TimerKind::Retransmit, at);
    }

    /// Sets the end of `q`'s RNR wait (`None`: not waiting).
    pub(crate) fn set_rnr_until(&mut self, q: &mut Qp, at: Option<u64>) {
        q.req.rnr_until = at;
        self.arm(q, TimerKind::Rnr, at);
    }

    fn arm(&mut self, q: &mut Qp, kind: TimerKind, at: Option<u64>) {
        if let Some(at) = at {
            self.deadlines
                .arm(q.qpn, kind, &mut q.queued[kind.index()], at);
        }
    }
}
