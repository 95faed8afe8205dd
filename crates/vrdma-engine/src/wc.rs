//! Work completions: exactly the fields of rdma-core's `struct ibv_wc`,
//! with its enum values, so the virtio device can copy them through.

/// Completion status (`enum ibv_wc_status`).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum WcStatus {
    Success = 0,
    LocLenErr = 1,
    LocQpOpErr = 2,
    LocEecOpErr = 3,
    LocProtErr = 4,
    WrFlushErr = 5,
    MwBindErr = 6,
    BadRespErr = 7,
    LocAccessErr = 8,
    RemInvReqErr = 9,
    RemAccessErr = 10,
    RemOpErr = 11,
    RetryExcErr = 12,
    RnrRetryExcErr = 13,
    LocRddViolErr = 14,
    RemInvRdReqErr = 15,
    RemAbortErr = 16,
    InvEecnErr = 17,
    InvEecStateErr = 18,
    FatalErr = 19,
    RespTimeoutErr = 20,
    GeneralErr = 21,
}

/// Completion opcode (`enum ibv_wc_opcode`).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum WcOpcode {
    Send = 0,
    RdmaWrite = 1,
    RdmaRead = 2,
    CompSwap = 3,
    FetchAdd = 4,
    BindMw = 5,
    LocalInv = 6,
    /// The kernel's IB_WC_REG_MR (after IB_WC_LSO = 7).
    RegMr = 8,
    Recv = 128,
    RecvRdmaWithImm = 129,
}

/// Completion flags (`enum ibv_wc_flags`, same bits).
#[derive(Clone, Copy, Default, Eq, Hash, PartialEq)]
pub struct WcFlags(pub u32);

impl WcFlags {
    pub const GRH: Self = Self(1 << 0);
    pub const WITH_IMM: Self = Self(1 << 1);
    pub const IP_CSUM_OK: Self = Self(1 << 2);
    pub const WITH_INV: Self = Self(1 << 3);

    pub const fn with(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }
}

impl core::fmt::Debug for WcFlags {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "WcFlags({:#x})", self.0)
    }
}

/// One work completion (`struct ibv_wc`).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Wc {
    pub wr_id: u64,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// Immediate data (network byte order, as on the wire) when `WITH_IMM`,
    /// or the invalidated rkey when `WITH_INV`.
    pub imm_data: u32,
    pub qp_num: u32,
    /// UD: the sender's QPN.
    pub src_qp: u32,
    pub wc_flags: WcFlags,
    pub pkey_index: u16,
    /// Always 0 on RoCE (no LIDs).
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
    /// UD: the network header the datagram came with (which tells a
    /// consumer how to read the 40 bytes of GRH before the payload: an
    /// IPv4 header sits in their last 20).
    pub network_hdr: Option<NetworkHdr>,
    /// A send queue's completion: how many of the QP's send WQEs are
    /// retired, this one included, since the QP was last in RESET (a
    /// wrapping count; 0 in a receive completion). Send WQEs retire in the
    /// order they were posted, and an unsignaled one that succeeds retires
    /// without a completion; with this a driver knows how many a
    /// completion retires — and so how many are outstanding — even when
    /// the WQE it reports was unsignaled and failed. A device ABI that
    /// counts its work requests as verbs do passes it on (virtio-rdma's
    /// CQE does, spec §7.8).
    pub sq_retired: u32,
}

/// A received datagram's network header (`enum rdma_network_type`).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum NetworkHdr {
    Ipv4,
    Ipv6,
}

impl Wc {
    /// A completion with only the fields every completion has.
    pub const fn new(wr_id: u64, status: WcStatus, opcode: WcOpcode, qp_num: u32) -> Self {
        Wc {
            wr_id,
            status,
            opcode,
            vendor_err: 0,
            byte_len: 0,
            imm_data: 0,
            qp_num,
            src_qp: 0,
            wc_flags: WcFlags(0),
            pkey_index: 0,
            network_hdr: None,
            slid: 0,
            sl: 0,
            dlid_path_bits: 0,
            sq_retired: 0,
        }
    }
}
