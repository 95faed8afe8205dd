//! Queue pairs: types, attributes and the state machine.

pub mod state;

/// Transport service of a QP.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum QpType {
    Rc,
    Uc,
    Ud,
    /// The general services QP (QP1, which carries management datagrams:
    /// a guest kernel's connection manager): UD on the wire, always QPN 1,
    /// at most one per device, no port attribute in its transitions.
    Gsi,
}

impl QpType {
    /// UD or GSI: datagrams, one packet per message, a DETH on each.
    pub const fn is_datagram(self) -> bool {
        matches!(self, QpType::Ud | QpType::Gsi)
    }
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

impl QpState {
    /// From the verbs numbering (`ibv_qp_state`, the kernel's
    /// `ib_qp_state`), which every device ABI carries.
    pub const fn from_code(v: u32) -> Option<Self> {
        Some(match v {
            0 => QpState::Reset,
            1 => QpState::Init,
            2 => QpState::Rtr,
            3 => QpState::Rts,
            4 => QpState::Sqd,
            5 => QpState::Sqe,
            6 => QpState::Err,
            _ => return None,
        })
    }

    /// The verbs numbering.
    pub const fn code(self) -> u32 {
        match self {
            QpState::Reset => 0,
            QpState::Init => 1,
            QpState::Rtr => 2,
            QpState::Rts => 3,
            QpState::Sqd => 4,
            QpState::Sqe => 5,
            QpState::Err => 6,
        }
    }
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
    access::Access,
    attr::Mtu,
    handle::{CqHandle, PdHandle, SrqHandle},
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
    /// The destination's Ethernet address, as the consumer resolved it
    /// (a RoCE device on a shared Ethernet port frames with it; over UDP
    /// it is not needed).
    pub dmac: Option<[u8; 6]>,
}

impl AhAttr {
    /// The bits of a flow label (IBTA Vol1 §8.2.1, RFC 6437).
    pub const FLOW_LABEL_MASK: u32 = 0xf_ffff;

    /// The vector as a device keeps it: the flow label cut to its 20 bits.
    /// Consumers pass wider values on purpose (UCX 1.13 sets
    /// `0xffffffff` and complemented path indices and leaves the cut to
    /// the device), and rxe and hardware, whose field is 20 bits, take
    /// them: so does the engine, rather than refuse them.
    #[must_use]
    pub fn masked(self) -> AhAttr {
        AhAttr {
            flow_label: self.flow_label & Self::FLOW_LABEL_MASK,
            ..self
        }
    }
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
