//! The verbs' numbers the tests use: `ibv_qp_attr_mask` bits, QP states,
//! completion statuses and opcodes, the access the kit's MRs have, and
//! the kit's Q_Key and first PSN.

use vrdma_virtio::abi::access;

/// `ibv_qp_attr_mask` bits.
pub mod mask {
    pub const STATE: u32 = 1 << 0;
    pub const CUR_STATE: u32 = 1 << 1;
    pub const EN_SQD_ASYNC_NOTIFY: u32 = 1 << 2;
    pub const ACCESS_FLAGS: u32 = 1 << 3;
    pub const PKEY_INDEX: u32 = 1 << 4;
    pub const PORT: u32 = 1 << 5;
    pub const QKEY: u32 = 1 << 6;
    pub const AV: u32 = 1 << 7;
    pub const PATH_MTU: u32 = 1 << 8;
    pub const TIMEOUT: u32 = 1 << 9;
    pub const RETRY_CNT: u32 = 1 << 10;
    pub const RNR_RETRY: u32 = 1 << 11;
    pub const RQ_PSN: u32 = 1 << 12;
    pub const MAX_QP_RD_ATOMIC: u32 = 1 << 13;
    pub const ALT_PATH: u32 = 1 << 14;
    pub const MIN_RNR_TIMER: u32 = 1 << 15;
    pub const SQ_PSN: u32 = 1 << 16;
    pub const MAX_DEST_RD_ATOMIC: u32 = 1 << 17;
    pub const CAP: u32 = 1 << 19;
    pub const DEST_QPN: u32 = 1 << 20;
}

/// `ibv_qp_state`.
pub mod state {
    pub const RESET: u32 = 0;
    pub const INIT: u32 = 1;
    pub const RTR: u32 = 2;
    pub const RTS: u32 = 3;
    pub const ERR: u32 = 6;
}

/// `ibv_wc_status` values the tests meet.
pub mod wc {
    pub const SUCCESS: u8 = 0;
    pub const LOC_LEN_ERR: u8 = 1;
    pub const LOC_QP_OP_ERR: u8 = 2;
    pub const LOC_PROT_ERR: u8 = 4;
    pub const WR_FLUSH_ERR: u8 = 5;
    pub const MW_BIND_ERR: u8 = 6;
    pub const REM_INV_REQ_ERR: u8 = 9;
    pub const REM_ACCESS_ERR: u8 = 10;
    pub const REM_OP_ERR: u8 = 11;

    /// Completion opcodes.
    pub const SEND: u8 = 0;
    pub const RDMA_WRITE: u8 = 1;
    pub const RDMA_READ: u8 = 2;
    pub const COMP_SWAP: u8 = 3;
    pub const FETCH_ADD: u8 = 4;
    pub const BIND_MW: u8 = 5;
    pub const LOCAL_INV: u8 = 6;
    pub const REG_MR: u8 = 8;
    pub const RECV: u8 = 128;
    pub const RECV_RDMA_WITH_IMM: u8 = 129;
}

/// Every remote access and local write.
pub const ALL_ACCESS: u32 =
    access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

/// The Q_Key of the tests' UD QPs, and the PSN every QP starts at.
pub const QKEY: u32 = 0x1111_1111;
pub const PSN: u32 = 0x00ab_cd00;
