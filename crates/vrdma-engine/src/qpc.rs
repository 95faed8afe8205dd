//! The QP context: one queue pair as the data path keeps it — its
//! attributes, its send and receive queues, and the state of its
//! requester and responder. The engine lends one of these at a time to a
//! data-path role, beside the shared context ([`crate::context`]).

use vrdma_wire::{Psn, Qpn};

use crate::{
    attr::PortAttr,
    deadlines::TimerKind,
    qp::{AhAttr, QpAttr, QpInitAttr},
    transmit::Transmit,
    wr::{RecvWqe, SendWqe, WorkQueue},
};

/// Room for the SGEs of one receive WQE held by the responder (the largest
/// SGE count a QP or SRQ may have).
pub(crate) const MAX_RECV_SGE: usize = 32;

/// A queue pair: its attributes and its work queues.
#[derive(Clone, Debug)]
pub(crate) struct Qp {
    pub qpn: Qpn,
    pub init: QpInitAttr,
    pub attr: QpAttr,
    pub(crate) sq: WorkQueue<SendWqe>,
    /// Empty (depth 0) when the QP receives from an SRQ.
    pub(crate) rq: WorkQueue<RecvWqe>,
    pub(crate) req: Requester,
    pub(crate) resp: Responder,
    /// In the engine's transmit queue.
    pub(crate) scheduled: bool,
    /// Request packets sent in a row while responses waited.
    pub(crate) requests_in_a_row: u32,
    /// Where the QP's own packets go (from its address vector), kept up
    /// to date by modify.
    pub(crate) path: Option<crate::transmit::Transmit>,
    /// The earliest timer-heap entry of each of its timers (indexed by
    /// [`TimerKind`]; see [`crate::deadlines`]).
    pub(crate) queued: [Option<u64>; 2],
}

/// A responder resource: a READ or atomic request accepted.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub(crate) enum Resource {
    Read {
        psn: Psn,
        rkey: vrdma_wire::Rkey,
        va: u64,
        len: u64,
    },
    Atomic {
        psn: Psn,
        orig: u64,
    },
}

/// One thing the RC responder has to send.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub(crate) enum RespOut {
    Ack {
        psn: Psn,
        syndrome: vrdma_wire::aeth::Syndrome,
    },
    /// RDMA READ response packets: `len` bytes at `va` under `rkey`, the
    /// first at `psn`; `sent` bytes so far.
    Read {
        rkey: vrdma_wire::Rkey,
        va: u64,
        len: u64,
        psn: Psn,
        sent: u64,
    },
    /// An atomic's acknowledgement with the value found.
    Atomic { psn: Psn, orig: u64 },
}

impl Responder {
    /// Queues an ACK or NAK, replacing a queued one it supersedes.
    ///
    /// Only a plain ACK is merged into a queued plain ACK; a NAK is never
    /// dropped, and once an RNR or error NAK is queued the responder says
    /// nothing more until the requester resends (`nak_sent`).
    pub(crate) fn push_ack(&mut self, psn: Psn, syndrome: vrdma_wire::aeth::Syndrome) {
        use vrdma_wire::aeth::Syndrome;
        let is_ack = matches!(syndrome, Syndrome::Ack(_));
        if let Some(RespOut::Ack {
            syndrome: Syndrome::Ack(_),
            ..
        }) = self.out.back()
            && is_ack
        {
            self.out.pop_back();
        }
        if !is_ack {
            self.nak_sent = true;
        }
        self.out.push_back(RespOut::Ack { psn, syndrome });
    }

    /// READ and atomic responses queued (what max_dest_rd_atomic bounds).
    pub(crate) fn queued_responses(&self) -> usize {
        self.out
            .iter()
            .filter(|o| !matches!(o, RespOut::Ack { .. }))
            .count()
    }

    /// Back to the state of a new QP, keeping the preallocated buffers.
    pub(crate) fn reset(&mut self) {
        self.epsn = Psn::default();
        self.msn = vrdma_wire::Msn::default();
        self.msg = InMsg::Idle;
        self.has_recv = false;
        self.out.clear();
        self.resources.clear();
        self.nak_sent = false;
        self.failed = false;
        self.failure_reported = false;
    }
}

/// Requester progress through the send queue.
#[derive(Clone, Debug, Default)]
pub(crate) struct Requester {
    /// Index (from the oldest queued WQE) of the WQE being sent; WQEs
    /// before it are sent and, on RC, wait for their ACK.
    pub cursor: usize,
    /// Bytes of that WQE already sent.
    pub offset: u64,
    /// PSN of the next packet.
    pub psn: Psn,
    /// RC: the oldest PSN not yet acknowledged (every earlier request is
    /// acknowledged, by an ACK, a NAK or a response). Its advance is the
    /// forward progress that restarts the retry budgets and the timer.
    pub unacked: Psn,
    /// The PSN after the last one ever sent: a packet before it is a
    /// retransmission.
    pub high: Psn,
    /// RC: retries left after a timeout or sequence error (from retry_cnt).
    pub retry_left: u8,
    /// RC: retries left after an RNR NAK (from rnr_retry; 7 = infinite).
    pub rnr_left: u8,
    /// RC: the packet with this PSN, if it is the next one, is sent twice
    /// (the first of a resend after a timeout).
    pub send_twice: Option<Psn>,
    /// RC, rnr_retry 7: RNR NAKs in a row with no progress (the back-off).
    pub rnr_streak: u32,
    /// RC: send nothing before this time (an RNR NAK's delay), ns.
    pub rnr_until: Option<u64>,
    /// RC: when the oldest unacknowledged request times out, ns.
    pub timer: Option<u64>,
    /// RC: a retry (after a timeout, a sequence-error NAK or an implied
    /// NAK) is under way and nothing new has been acknowledged since:
    /// further NAKs, stale or caused by the resent packets, are part of
    /// it and cost no more retries.
    pub retrying: bool,
    /// WQEs (from the oldest) whose first packet has gone out at least
    /// once: in SQD these may still be (re)sent, no others.
    pub started: usize,
    /// Send WQEs retired since the QP was last in RESET, completed or not
    /// (wrapping): each send completion carries it ([`crate::wc::Wc::sq_retired`]).
    pub retired: u32,
}

/// What the responder is in the middle of.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub(crate) enum InMsg {
    /// Between messages.
    #[default]
    Idle,
    /// A SEND, `offset` bytes into the receive WQE held in `Responder::recv`.
    Send { offset: u64 },
    /// An RDMA WRITE to `va` (next byte) with `left` bytes to come; `total`
    /// is the RETH DMA length; `recv` says a receive WQE is held (WRITE
    /// with immediate consumes one at its end).
    Write {
        rkey: vrdma_wire::Rkey,
        va: u64,
        left: u64,
        total: u64,
    },
    /// UC: the rest of a message that cannot be delivered is dropped.
    Dropping,
}

/// Responder state.
#[derive(Clone, Debug, Default)]
pub(crate) struct Responder {
    /// Expected PSN of the next new packet.
    pub epsn: Psn,
    /// Messages completed (sent back in every AETH).
    pub msn: vrdma_wire::Msn,
    pub msg: InMsg,
    /// The receive WQE the current message fills, taken from the RQ or SRQ
    /// at the message's first packet (buffers preallocated).
    pub recv: RecvWqe,
    pub has_recv: bool,
    /// RC: what the responder has to send, in PSN order: ACKs / NAKs
    /// (coalesced), RDMA READ responses, atomic acknowledgements.
    pub out: std::collections::VecDeque<RespOut>,
    /// RC: the last max_dest_rd_atomic READ and atomic requests accepted
    /// (responder resources), to answer a duplicate without executing an
    /// atomic twice and to serve only duplicates of real requests (IBTA
    /// Vol1 §9.7.5.1.2).
    pub resources: std::collections::VecDeque<Resource>,
    /// RC: a sequence-error NAK went out; no other until back in order
    /// (IBTA Vol1 §9.7.5.2.2: one NAK per sequence error).
    pub nak_sent: bool,
    /// RC: a class B–D error NAK is queued and the QP is about to enter
    /// ERR; no further request may execute (a resent packet would
    /// otherwise run against a receive WQE already completed in error).
    pub failed: bool,
    /// The failure was reported by a receive completion in error, so no
    /// affiliated asynchronous event is raised for it.
    pub failure_reported: bool,
}

impl Qp {
    /// A QP in RESET with queues sized by `init.cap`.
    pub(crate) fn new(init: QpInitAttr) -> Self {
        let c = init.cap;
        Qp {
            qpn: Qpn::default(),
            init,
            attr: QpAttr {
                cap: c,
                ..QpAttr::default()
            },
            sq: WorkQueue::new(c.max_send_wr, || SendWqe {
                sges: Vec::with_capacity(c.max_send_sge as usize),
                inline: Vec::with_capacity(c.max_inline_data as usize),
                ..SendWqe::default()
            }),
            rq: WorkQueue::new(c.max_recv_wr, || RecvWqe {
                sges: Vec::with_capacity(c.max_recv_sge as usize),
                ..RecvWqe::default()
            }),
            req: Requester::default(),
            resp: Responder {
                recv: RecvWqe {
                    sges: Vec::with_capacity(MAX_RECV_SGE),
                    ..RecvWqe::default()
                },
                ..Responder::default()
            },
            scheduled: false,
            requests_in_a_row: 0,
            path: None,
            queued: [None; 2],
        }
    }

    /// The deadline of one of its timers.
    pub(crate) fn timer(&self, kind: TimerKind) -> Option<u64> {
        match kind {
            TimerKind::Retransmit => self.req.timer,
            TimerKind::Rnr => self.req.rnr_until,
        }
    }

    /// The local ACK timeout: 4.096 µs × 2^timeout, or none for 0.
    pub(crate) fn ack_timeout(&self) -> Option<u64> {
        let t = self.attr.timeout;
        (t != 0).then(|| 4096u64 << t.min(31))
    }

    /// Where packets sent with address vector `av` go from this QP: the
    /// port's GID at the vector's index to its destination GID, from the
    /// QP's UDP source port (0xC000 and up, per QP, as rxe).
    pub(crate) fn route(&self, port: &PortAttr, av: AhAttr) -> Option<Transmit> {
        Some(Transmit {
            len: 0,
            sgid: port.gid(av.sgid_index)?.gid,
            dgid: av.dgid,
            udp_src_port: 0xc000 | (self.qpn.value() & 0x3fff) as u16,
            traffic_class: av.traffic_class,
            hop_limit: if av.hop_limit == 0 { 64 } else { av.hop_limit },
            flow_label: av.flow_label,
            dmac: av.dmac,
            payload_at: 0,
            referenced: 0,
        })
    }
}
