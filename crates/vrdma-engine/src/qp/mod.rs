//! Queue pairs: types, attributes and the state machine.

pub mod state;

/// Transport service of a QP.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum QpType {
    Rc,
    Uc,
    Ud,
}

/// QP states (IBTA Vol1 §10.3.1; `enum ibv_qp_state`).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    Sqd,
    Sqe,
    Err,
}

/// Which attributes a modify or query names (`enum ibv_qp_attr_mask`; the
/// bit values are rdma-core's, so a guest's mask passes through unchanged).
#[derive(Clone, Copy, Default, Eq, Hash, PartialEq)]
pub struct AttrMask(pub u32);

impl AttrMask {
    pub const STATE: Self = Self(1 << 0);
    pub const CUR_STATE: Self = Self(1 << 1);
    pub const EN_SQD_ASYNC_NOTIFY: Self = Self(1 << 2);
    pub const ACCESS_FLAGS: Self = Self(1 << 3);
    pub const PKEY_INDEX: Self = Self(1 << 4);
    pub const PORT: Self = Self(1 << 5);
    pub const QKEY: Self = Self(1 << 6);
    pub const AV: Self = Self(1 << 7);
    pub const PATH_MTU: Self = Self(1 << 8);
    pub const TIMEOUT: Self = Self(1 << 9);
    pub const RETRY_CNT: Self = Self(1 << 10);
    pub const RNR_RETRY: Self = Self(1 << 11);
    pub const RQ_PSN: Self = Self(1 << 12);
    pub const MAX_QP_RD_ATOMIC: Self = Self(1 << 13);
    pub const ALT_PATH: Self = Self(1 << 14);
    pub const MIN_RNR_TIMER: Self = Self(1 << 15);
    pub const SQ_PSN: Self = Self(1 << 16);
    pub const MAX_DEST_RD_ATOMIC: Self = Self(1 << 17);
    pub const PATH_MIG_STATE: Self = Self(1 << 18);
    pub const CAP: Self = Self(1 << 19);
    pub const DEST_QPN: Self = Self(1 << 20);
    pub const RATE_LIMIT: Self = Self(1 << 25);

    pub const NONE: Self = Self(0);

    /// Union.
    pub const fn with(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// True when every bit of `other` is set.
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// True when any bit of `other` is set.
    pub const fn intersects(self, other: Self) -> bool {
        self.0 & other.0 != 0
    }

    /// Bits of `self` that are not in `other`.
    pub const fn without(self, other: Self) -> Self {
        Self(self.0 & !other.0)
    }

    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl core::ops::BitOr for AttrMask {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        self.with(rhs)
    }
}

impl core::fmt::Debug for AttrMask {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "AttrMask({:#x})", self.0)
    }
}

use vrdma_wire::{Gid, Psn, QKey, Qpn};

use crate::{
    attr::Mtu,
    handle::{CqHandle, PdHandle, SrqHandle},
    mr::Access,
    wr::{RecvWqe, SendWqe, WorkQueue},
};

/// Sizes of a QP's queues (`struct ibv_qp_cap`).
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub struct QpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// What `ibv_create_qp` asks for (`struct ibv_qp_init_attr`).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct QpInitAttr {
    pub pd: PdHandle,
    pub send_cq: CqHandle,
    pub recv_cq: CqHandle,
    /// Receives come from this SRQ instead of the QP's own receive queue.
    pub srq: Option<SrqHandle>,
    pub cap: QpCap,
    pub qp_type: QpType,
    /// Every send WR completes signaled, whatever its flags.
    pub sq_sig_all: bool,
}

/// An address vector (`struct ibv_ah_attr` with its GRH, which RoCE
/// always uses).
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub struct AhAttr {
    pub dgid: Gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub sl: u8,
    pub port_num: u8,
}

/// QP attributes (`struct ibv_qp_attr`, the fields RoCE uses). Which are
/// meaningful in a modify is said by the [`AttrMask`].
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct QpAttr {
    pub qp_state: QpState,
    pub cur_qp_state: QpState,
    pub path_mtu: Mtu,
    pub qkey: QKey,
    pub rq_psn: Psn,
    pub sq_psn: Psn,
    pub dest_qp_num: Qpn,
    pub qp_access_flags: Access,
    pub cap: QpCap,
    pub ah_attr: AhAttr,
    pub pkey_index: u16,
    pub en_sqd_async_notify: bool,
    /// Query only: the send queue is still draining in SQD.
    pub sq_draining: bool,
    /// Outstanding RDMA READ / atomic requests this QP may initiate.
    pub max_rd_atomic: u8,
    /// Outstanding RDMA READ / atomic requests this QP accepts.
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer code (0..=31) this QP's responder advertises.
    pub min_rnr_timer: u8,
    pub port_num: u8,
    /// Local ACK timeout: 4.096 µs × 2^timeout (0 = infinite), 0..=31.
    pub timeout: u8,
    /// Retries on timeout or sequence error, 0..=7.
    pub retry_cnt: u8,
    /// Retries on RNR NAK, 0..=7 (7 = infinite).
    pub rnr_retry: u8,
}

impl Default for QpAttr {
    fn default() -> Self {
        QpAttr {
            qp_state: QpState::Reset,
            cur_qp_state: QpState::Reset,
            path_mtu: Mtu::Mtu1024,
            qkey: QKey(0),
            rq_psn: Psn::default(),
            sq_psn: Psn::default(),
            dest_qp_num: Qpn::default(),
            qp_access_flags: Access::NONE,
            cap: QpCap::default(),
            ah_attr: AhAttr::default(),
            pkey_index: 0,
            en_sqd_async_notify: false,
            sq_draining: false,
            max_rd_atomic: 0,
            max_dest_rd_atomic: 0,
            min_rnr_timer: 0,
            port_num: 1,
            timeout: 0,
            retry_cnt: 0,
            rnr_retry: 0,
        }
    }
}

/// Room for the SGEs of one receive WQE held by the responder (the largest
/// SGE count a QP or SRQ may have).
pub(crate) const MAX_RECV_SGE: usize = 32;

/// A queue pair: its attributes and its work queues.
#[derive(Clone, Debug)]
pub struct Qp {
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
    pub(crate) path: Option<crate::datapath::Transmit>,
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
        }
    }

    /// Send WRs waiting (posted, not yet completed).
    pub fn send_queue_len(&self) -> usize {
        self.sq.len()
    }

    /// Receive WRs waiting on the QP's own receive queue.
    pub fn recv_queue_len(&self) -> usize {
        self.rq.len()
    }
}
