//! The virtio-rdma device ABI (`docs/virtio-rdma.md`): feature bits, the
//! configuration layout, the virtqueues, control commands and their
//! responses, ring headers and entries, doorbell areas, events and
//! notifications. Every structure is little-endian and laid out exactly as
//! in guest memory or on a virtqueue; the device reads each one whole into
//! a copy the guest cannot change, and only then looks at it. Sizes and
//! offsets are asserted at compile time: the guest's C header must agree.
//!
//! Enum values are rdma-core's (`ibv_wr_opcode`, `ibv_wc_status`,
//! `ibv_wc_opcode`, `ibv_qp_attr_mask`, `ibv_access_flags`, …) so that a
//! provider passes a verbs consumer's values through unchanged.

use zerocopy::{
    FromBytes, Immutable, IntoBytes, KnownLayout,
    little_endian::{U16, U32, U64},
};

/// VIRTIO device ID of an RDMA device.
pub const DEVICE_ID: u32 = 42;
/// The modern virtio-pci device ID: 0x1040 + 42.
pub const PCI_DEVICE_ID: u16 = 0x106a;
/// The page size of rings, doorbell areas and ring page lists.
pub const PAGE_SIZE: u64 = 4096;

/// Feature bits.
pub mod feature {
    /// The device polls doorbell areas and keeps each context's `poll`
    /// word; the driver kicks the doorbell queue only when it reads 0.
    pub const DOORBELL_POLL: u64 = 1 << 0;
    /// Reserved: two-level page lists (v1 devices do not offer it).
    pub const INDIRECT_PAGES: u64 = 1 << 1;
    /// Reserved: device state save and restore (v1 devices do not offer it).
    pub const MIGRATION: u64 = 1 << 2;
    /// The device answers QUERY_STATS: its counters, for the driver's
    /// hardware counters (`rdma statistic`).
    pub const STATS: u64 = 1 << 3;
    /// Standard bits the device offers.
    pub const RING_INDIRECT_DESC: u64 = 1 << 28;
    pub const RING_EVENT_IDX: u64 = 1 << 29;
    pub const VERSION_1: u64 = 1 << 32;
    /// Not offered in v1: addresses would be IOVAs (vhost-user IOTLB).
    pub const ACCESS_PLATFORM: u64 = 1 << 33;
}

/// The virtqueues, by index.
pub mod vq {
    pub const CONTROL: u16 = 0;
    pub const EVENT: u16 = 1;
    pub const NOTIFY: u16 = 2;
    pub const DOORBELL: u16 = 3;
    /// How many the device has.
    pub const COUNT: usize = 4;
}

/// The device configuration (read-only, static for the device's life).
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct Config {
    /// The sibling NIC's MAC: the netdev whose addresses give this device
    /// its GIDs (all zero: none).
    pub mac: [u8; 6],
    pub reserved0: U16,
    pub max_contexts: U32,
    pub max_doorbell_bits: U32,
    pub max_qp: U32,
    pub max_cq: U32,
    /// The largest request the control queue takes (header, body and
    /// trailing array), in bytes.
    pub max_request: U32,
    pub reserved1: U32,
    pub reserved2: [U64; 4],
}

/// Control command opcodes.
pub mod op {
    pub const QUERY_DEVICE: u16 = 1;
    pub const QUERY_PORT: u16 = 2;
    pub const CREATE_CONTEXT: u16 = 3;
    pub const DESTROY_CONTEXT: u16 = 4;
    pub const ALLOC_PD: u16 = 5;
    pub const DEALLOC_PD: u16 = 6;
    pub const CREATE_CQ: u16 = 7;
    pub const DESTROY_CQ: u16 = 8;
    pub const RESIZE_CQ: u16 = 9;
    pub const REG_MR: u16 = 10;
    pub const REG_DMA_MR: u16 = 11;
    pub const ALLOC_MR: u16 = 12;
    pub const DEREG_MR: u16 = 13;
    pub const ALLOC_MW: u16 = 14;
    pub const DEALLOC_MW: u16 = 15;
    pub const CREATE_SRQ: u16 = 16;
    pub const MODIFY_SRQ: u16 = 17;
    pub const QUERY_SRQ: u16 = 18;
    pub const DESTROY_SRQ: u16 = 19;
    pub const CREATE_QP: u16 = 20;
    pub const MODIFY_QP: u16 = 21;
    pub const QUERY_QP: u16 = 22;
    pub const DESTROY_QP: u16 = 23;
    pub const SET_GID: u16 = 24;
    /// With VIRTIO_RDMA_F_STATS only.
    pub const QUERY_STATS: u16 = 25;
}

/// Command status codes (the response header's `status`).
pub mod status {
    pub const OK: u16 = 0;
    /// A field out of range, a reserved field not zero, a forbidden
    /// transition (EINVAL).
    pub const INVALID: u16 = 1;
    /// A handle names no object of the command's context (ENOENT).
    pub const NOENT: u16 = 2;
    /// A table is full or the device's budget is spent (ENOMEM).
    pub const NOMEM: u16 = 3;
    /// The object is still in use (EBUSY).
    pub const BUSY: u16 = 4;
    /// Unknown opcode or an unsupported request (EOPNOTSUPP).
    pub const UNSUPPORTED: u16 = 5;
    /// A guest address outside guest memory or misaligned (EFAULT).
    pub const FAULT: u16 = 6;
    /// The request is shorter than its body or trailing array, or the
    /// response room is too small (EMSGSIZE).
    pub const LENGTH: u16 = 7;
    /// The device failed and needs a reset (EIO).
    pub const DEVICE: u16 = 8;
}

/// Every request begins with this.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct CmdHdr {
    pub opcode: U16,
    pub flags: U16,
    /// The context the command acts in (ignored by QUERY_*, CREATE_CONTEXT).
    pub context: U32,
}

/// Every response begins with this.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct RespHdr {
    pub status: U16,
    pub reserved: U16,
    /// For diagnostics: the errno the device's check produced (0 on OK).
    pub detail: U32,
}

/// A ring in guest memory, as a create command describes it. Its pages
/// follow in the command's trailing array.
#[derive(
    Clone, Copy, Debug, Default, Eq, PartialEq, FromBytes, Immutable, IntoBytes, KnownLayout,
)]
#[repr(C)]
pub struct RingDesc {
    /// Guest address of the ring's 64-byte header (64-byte aligned).
    pub header: U64,
    /// Entries: a power of two.
    pub entries: U32,
    /// Bytes per entry: a power of two, at least the entry's minimum.
    pub stride: U32,
    /// Pages in the trailing array: exactly entries × stride / 4096.
    pub npages: U32,
    pub reserved: U32,
}

/// The header of a send, receive or SRQ ring (64 bytes in guest memory).
pub mod wq_header {
    /// le32 written by the driver: the next entry it will fill.
    pub const PRODUCER: u64 = 0;
    /// le32 written by the device: the next entry it will take.
    pub const CONSUMER: u64 = 4;
}

/// The header of a completion ring (64 bytes in guest memory).
pub mod cq_header {
    /// le32 written by the device.
    pub const PRODUCER: u64 = 0;
    /// le32 written by the driver.
    pub const CONSUMER: u64 = 4;
    /// le64 written by the driver to arm: bits 0..32 the consumer index
    /// when armed, bits 32..34 the mode, bits 34..64 a sequence number that
    /// changes with every arm.
    pub const ARM: u64 = 8;
    pub const ARM_NEXT: u64 = 1;
    pub const ARM_SOLICITED: u64 = 2;
}

/// Size of a ring header.
pub const RING_HEADER_SIZE: u64 = 64;

// --- command bodies -------------------------------------------------------

/// QUERY_STATS response: the device's counters, `value[i]` named by
/// [`STATS_NAMES`]`[i]`; the slots past those names are reserved (0).
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct StatsResp {
    pub value: [U64; 32],
}

/// The counters of QUERY_STATS, by index (§6.31 of the specification):
/// the data path's sixteen, then the device's refusals.
pub const STATS_NAMES: [&str; 20] = [
    "rx_packets",
    "tx_packets",
    "rx_malformed",
    "rx_no_qp",
    "rx_bad_state",
    "rx_bad_addr",
    "rx_bad_key",
    "rx_no_recv",
    "rx_duplicate",
    "rx_out_of_sequence",
    "rx_too_long",
    "tx_retransmitted",
    "retry_timeout",
    "retry_seq_nak",
    "retry_implied_nak",
    "rnr_naks",
    "refused_commands",
    "refused_send_wqes",
    "refused_recv_wqes",
    "broken_rings",
];

/// QUERY_DEVICE response (`struct ibv_device_attr`, the fields a RoCE
/// device has).
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct DeviceAttrResp {
    pub node_guid: U64,
    pub sys_image_guid: U64,
    pub max_mr_size: U64,
    pub page_size_cap: U64,
    /// Device capability flags (`ibv_device_cap_flags` bits, see
    /// [`cap`]).
    pub device_cap_flags: U64,
    pub vendor_id: U32,
    pub vendor_part_id: U32,
    pub hw_ver: U32,
    pub max_qp: U32,
    pub max_qp_wr: U32,
    pub max_sge: U32,
    pub max_sge_rd: U32,
    pub max_cq: U32,
    pub max_cqe: U32,
    pub max_mr: U32,
    pub max_pd: U32,
    pub max_qp_rd_atom: U32,
    pub max_qp_init_rd_atom: U32,
    pub max_res_rd_atom: U32,
    pub max_mw: U32,
    pub max_srq: U32,
    pub max_srq_wr: U32,
    pub max_srq_sge: U32,
    pub max_inline_data: U32,
    pub max_fast_reg_page_list_len: U32,
    pub max_pkeys: U16,
    /// `ibv_atomic_cap`: 0 none, 1 HCA, 2 global.
    pub atomic_cap: u8,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
    pub reserved: [u8; 3],
}

/// Device capability flags (`IBV_DEVICE_*` / the kernel's `IB_DEVICE_*`).
pub mod cap {
    pub const RESIZE_MAX_WR: u64 = 1 << 0;
    pub const CURR_QP_STATE_MOD: u64 = 1 << 7;
    pub const PORT_ACTIVE_EVENT: u64 = 1 << 10;
    pub const SYS_IMAGE_GUID: u64 = 1 << 11;
    pub const RC_RNR_NAK_GEN: u64 = 1 << 12;
    pub const SRQ_RESIZE: u64 = 1 << 13;
    pub const MEM_WINDOW: u64 = 1 << 17;
    pub const MEM_WINDOW_TYPE_2B: u64 = 1 << 24;
    pub const MEM_MGT_EXTENSIONS: u64 = 1 << 21;
}

/// QUERY_PORT request.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct PortReq {
    pub port: U32,
    pub reserved: U32,
}

/// QUERY_PORT response (`struct ibv_port_attr`, a RoCE port's fields).
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct PortAttrResp {
    /// `ibv_port_state`.
    pub state: U32,
    /// `ibv_mtu` codes.
    pub max_mtu: U32,
    pub active_mtu: U32,
    pub gid_tbl_len: U32,
    pub port_cap_flags: U32,
    pub max_msg_sz: U32,
    pub pkey_tbl_len: U16,
    pub active_width: u8,
    pub active_speed: u8,
    /// `ibv_port_phys_state`: 5 LinkUp, 3 Disabled.
    pub phys_state: u8,
    pub reserved: [u8; 3],
}

/// CREATE_CONTEXT request; `npages` page addresses follow.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct CreateContextReq {
    /// Bits in the doorbell bitmap: a power of two, 64 ..= max_doorbell_bits.
    pub doorbell_bits: U32,
    /// Pages of the doorbell area: ceil((1024 + doorbell_bits / 8) / 4096).
    pub npages: U32,
}

/// A response that names one object (CREATE_CONTEXT, ALLOC_PD, ALLOC_MW).
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct HandleResp {
    pub handle: U32,
    pub reserved: U32,
}

/// A request that names one object (DEALLOC_PD, DESTROY_CQ, DEREG_MR,
/// DEALLOC_MW, QUERY_SRQ, DESTROY_SRQ, QUERY_QP, DESTROY_QP).
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct HandleReq {
    pub handle: U32,
    pub reserved: U32,
}

/// CREATE_CQ request; the ring's pages follow.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct CreateCqReq {
    pub ring: RingDesc,
}

/// CREATE_CQ response.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct CreateCqResp {
    pub cq: U32,
    /// Completions the CQ holds (the ring's entries).
    pub entries: U32,
    /// The CQ's doorbell index in its context's bitmap.
    pub doorbell: U32,
    pub reserved: U32,
}

/// RESIZE_CQ request; the new ring's pages follow.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct ResizeCqReq {
    pub cq: U32,
    pub reserved: U32,
    pub ring: RingDesc,
}

/// Memory access flags (`ibv_access_flags`).
pub mod access {
    pub const LOCAL_WRITE: u32 = 1 << 0;
    pub const REMOTE_WRITE: u32 = 1 << 1;
    pub const REMOTE_READ: u32 = 1 << 2;
    pub const REMOTE_ATOMIC: u32 = 1 << 3;
    pub const MW_BIND: u32 = 1 << 4;
    pub const ZERO_BASED: u32 = 1 << 5;
    /// What an MR may carry.
    pub const MR_BITS: u32 = 0x3f;
}

/// REG_MR request; `npages` page addresses follow.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct RegMrReq {
    pub pd: U32,
    pub access: U32,
    /// The MR's first virtual address (ignored with ZERO_BASED: 0).
    pub iova: U64,
    pub length: U64,
    /// log2 of the MR's page size: 12 ..= 30.
    pub page_shift: U32,
    /// Offset of the MR's first byte in its first page.
    pub offset: U32,
    /// Exactly ceil((offset + length) / page size) pages.
    pub npages: U32,
    pub reserved: U32,
}

/// REG_MR, REG_DMA_MR and ALLOC_MR response.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct MrResp {
    pub lkey: U32,
    pub rkey: U32,
}

/// REG_DMA_MR request.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct RegDmaMrReq {
    pub pd: U32,
    pub access: U32,
}

/// ALLOC_MR request (an MR for fast registration).
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct AllocMrReq {
    pub pd: U32,
    pub max_pages: U32,
}

/// ALLOC_MW request.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct AllocMwReq {
    pub pd: U32,
    /// 1 or 2 (`ibv_mw_type`).
    pub mw_type: U32,
}

/// CREATE_SRQ request; the ring's pages follow.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct CreateSrqReq {
    pub pd: U32,
    pub max_sge: U32,
    pub srq_limit: U32,
    pub reserved: U32,
    pub ring: RingDesc,
}

/// CREATE_SRQ response.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct CreateSrqResp {
    pub srq: U32,
    pub max_wr: U32,
    pub max_sge: U32,
    pub doorbell: U32,
}

/// MODIFY_SRQ request.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct ModifySrqReq {
    pub srq: U32,
    /// `ibv_srq_attr_mask`: 1 MAX_WR (unsupported: the ring is the
    /// guest's), 2 LIMIT.
    pub mask: U32,
    pub max_wr: U32,
    pub srq_limit: U32,
}

/// QUERY_SRQ response.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct SrqAttrResp {
    pub max_wr: U32,
    pub max_sge: U32,
    pub srq_limit: U32,
    pub reserved: U32,
}

/// QP types (`ib_qp_type` values).
pub mod qp_type {
    pub const GSI: u8 = 1;
    pub const RC: u8 = 2;
    pub const UC: u8 = 3;
    pub const UD: u8 = 4;
}

/// CREATE_QP request; the send ring's pages follow, then the receive
/// ring's.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct CreateQpReq {
    pub pd: U32,
    pub qp_type: u8,
    /// Every send WR completes signaled.
    pub sq_sig_all: u8,
    pub reserved0: U16,
    pub send_cq: U32,
    pub recv_cq: U32,
    /// 0: the QP has its own receive ring; else the SRQ it takes from (the
    /// receive ring is then all zero).
    pub srq: U32,
    pub max_send_sge: U32,
    pub max_recv_sge: U32,
    pub max_inline_data: U32,
    pub sq: RingDesc,
    pub rq: RingDesc,
}

/// CREATE_QP response.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct CreateQpResp {
    pub qpn: U32,
    pub max_send_wr: U32,
    pub max_recv_wr: U32,
    pub max_send_sge: U32,
    pub max_recv_sge: U32,
    pub max_inline_data: U32,
    pub doorbell: U32,
    pub reserved: U32,
}

/// An address vector: where a UD WQE goes, or a connected QP's path. RoCE
/// always has a GRH; the destination MAC is resolved by the driver.
#[derive(
    Clone, Copy, Debug, Default, Eq, PartialEq, FromBytes, Immutable, IntoBytes, KnownLayout,
)]
#[repr(C)]
pub struct Av {
    pub dgid: [u8; 16],
    pub flow_label: U32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub sl: u8,
    pub dmac: [u8; 6],
    pub reserved: U16,
}

/// QP attributes (`struct ibv_qp_attr`, a RoCE QP's fields), in MODIFY_QP
/// and QUERY_QP.
#[derive(
    Clone, Copy, Debug, Default, Eq, PartialEq, FromBytes, Immutable, IntoBytes, KnownLayout,
)]
#[repr(C)]
pub struct QpAttrs {
    /// `ibv_qp_state`: 0 RESET, 1 INIT, 2 RTR, 3 RTS, 4 SQD, 5 SQE, 6 ERR.
    pub qp_state: U32,
    pub cur_qp_state: U32,
    /// `ibv_mtu`.
    pub path_mtu: U32,
    pub qkey: U32,
    pub rq_psn: U32,
    pub sq_psn: U32,
    pub dest_qp_num: U32,
    pub qp_access_flags: U32,
    pub pkey_index: U16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub reserved: u8,
    pub ah: Av,
}

/// MODIFY_QP request.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct ModifyQpReq {
    pub qpn: U32,
    /// `ibv_qp_attr_mask` bits; the ones a RoCE QP has.
    pub attr_mask: U32,
    pub attrs: QpAttrs,
}

/// QUERY_QP response.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct QueryQpResp {
    pub attrs: QpAttrs,
    pub max_send_wr: U32,
    pub max_recv_wr: U32,
    pub max_send_sge: U32,
    pub max_recv_sge: U32,
    pub max_inline_data: U32,
    pub qp_type: u8,
    pub sq_sig_all: u8,
    pub reserved: U16,
}

/// SET_GID request.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct SetGidReq {
    pub index: U32,
    /// 0: delete the entry; 2: a RoCEv2 GID.
    pub gid_type: U32,
    pub gid: [u8; 16],
}

/// SET_GID types.
pub mod gid_type {
    pub const NONE: u32 = 0;
    pub const ROCE_V2: u32 = 2;
}

// --- ring entries ---------------------------------------------------------

/// Send work request opcodes (`ibv_wr_opcode`; REG_MR is the kernel's).
pub mod wr {
    pub const RDMA_WRITE: u8 = 0;
    pub const RDMA_WRITE_WITH_IMM: u8 = 1;
    pub const SEND: u8 = 2;
    pub const SEND_WITH_IMM: u8 = 3;
    pub const RDMA_READ: u8 = 4;
    pub const ATOMIC_CMP_AND_SWP: u8 = 5;
    pub const ATOMIC_FETCH_AND_ADD: u8 = 6;
    pub const LOCAL_INV: u8 = 7;
    pub const BIND_MW: u8 = 8;
    pub const SEND_WITH_INV: u8 = 9;
    pub const REG_MR: u8 = 10;

    /// Send flags (`ibv_send_flags`).
    pub const FENCE: u8 = 1 << 0;
    pub const SIGNALED: u8 = 1 << 1;
    pub const SOLICITED: u8 = 1 << 2;
    pub const INLINE: u8 = 1 << 3;
}

/// The fixed part of a send WQE (64 bytes); SGEs or inline data follow.
#[derive(Clone, Copy, Debug, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct SendWqeHdr {
    pub wr_id: U64,
    pub opcode: u8,
    pub flags: u8,
    /// SGEs, or inline bytes when INLINE.
    pub count: U16,
    /// The immediate (its four wire bytes as the guest wrote them), or the
    /// rkey a SEND_WITH_INV or LOCAL_INV invalidates.
    pub ex: U32,
    /// Operation-specific: one of the `Wqe*` layouts below.
    pub op: [u8; 48],
}

/// RDMA WRITE / READ part of a send WQE.
#[derive(Clone, Copy, Debug, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct WqeRdma {
    pub remote_addr: U64,
    pub rkey: U32,
    pub reserved: [u8; 36],
}

/// Atomic part of a send WQE.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct WqeAtomic {
    pub remote_addr: U64,
    pub compare_add: U64,
    pub swap: U64,
    pub rkey: U32,
    pub reserved: [u8; 20],
}

/// UD part of a send WQE.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct WqeUd {
    pub av: Av,
    pub remote_qpn: U32,
    pub remote_qkey: U32,
    pub reserved: [u8; 8],
}

/// Fast registration part of a send WQE (REG_MR).
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct WqeRegMr {
    pub iova: U64,
    pub length: U64,
    /// Guest address of `npages` le64 page addresses (8-byte aligned).
    pub page_list: U64,
    /// The MR's lkey with the key byte it takes.
    pub key: U32,
    pub access: U32,
    pub npages: U32,
    pub page_shift: u8,
    pub reserved: [u8; 11],
}

/// Window binding part of a send WQE (BIND_MW).
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct WqeBindMw {
    pub addr: U64,
    pub length: U64,
    /// The window's rkey with the key byte it takes.
    pub mw: U32,
    /// The lkey of the MR it binds to.
    pub mr: U32,
    pub access: U32,
    pub reserved: [u8; 20],
}

/// A scatter/gather element.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct Sge {
    pub addr: U64,
    pub length: U32,
    pub lkey: U32,
}

/// The fixed part of a receive WQE (RQ and SRQ; 16 bytes); SGEs follow.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct RecvWqeHdr {
    pub wr_id: U64,
    pub count: U16,
    pub reserved: [u8; 6],
}

/// A completion (32 bytes).
#[derive(
    Clone, Copy, Debug, Default, Eq, PartialEq, FromBytes, Immutable, IntoBytes, KnownLayout,
)]
#[repr(C)]
pub struct Cqe {
    pub wr_id: U64,
    /// `ibv_wc_status`.
    pub status: u8,
    /// `ibv_wc_opcode` (RECV 128, RECV_RDMA_WITH_IMM 129).
    pub opcode: u8,
    /// `ibv_wc_flags`: GRH 1, WITH_IMM 2, WITH_INV 8.
    pub wc_flags: U16,
    pub qpn: U32,
    pub byte_len: U32,
    /// The immediate's wire bytes, or the invalidated rkey.
    pub ex: U32,
    /// A receive's: UD/GSI, the sender's QPN. A send queue's (`opcode`
    /// without [`OPCODE_RECV_BIT`]): the QP's send WQEs retired through
    /// this one since RESET, wrapping (spec §7.8).
    pub src_qp: U32,
    pub pkey_index: U16,
    pub sl: u8,
    /// UD receives: 2 RoCEv2 over IPv4, 3 RoCEv2 over IPv6 (`ib_gid_type`
    /// network header types of the kernel: RDMA_NETWORK_IPV4/IPV6).
    pub network_hdr_type: u8,
}

/// A CQE's `opcode` bit that says its WQE was a receive queue's (RECV
/// 128, RECV_RDMA_WITH_IMM 129, and every receive's error completion).
pub const OPCODE_RECV_BIT: u8 = 0x80;

/// Completion flags.
pub mod wc_flags {
    pub const GRH: u16 = 1 << 0;
    pub const WITH_IMM: u16 = 1 << 1;
    pub const WITH_INV: u16 = 1 << 3;
}

/// The doorbell area of a context.
pub mod doorbell {
    /// le32 written by the device: 1 while it polls this area.
    pub const POLL: u64 = 0;
    /// le64 summary words: bit j of word k: bitmap word 64k + j has bits.
    pub const SUMMARY: u64 = 64;
    /// le64 bitmap words: bit i: the object with doorbell index i moved.
    pub const BITMAP: u64 = 1024;
    /// Fewest and most bits a context's bitmap may have.
    pub const MIN_BITS: u32 = 64;
    pub const MAX_BITS: u32 = 1 << 18;

    /// Bytes of an area with `bits` doorbells.
    pub const fn area_size(bits: u32) -> u64 {
        BITMAP + bits as u64 / 8
    }

    /// Pages of an area with `bits` doorbells.
    pub const fn area_pages(bits: u32) -> u64 {
        area_size(bits).div_ceil(super::PAGE_SIZE)
    }
}

/// An asynchronous event (16 bytes, one per eventq buffer).
#[derive(
    Clone, Copy, Debug, Default, Eq, PartialEq, FromBytes, Immutable, IntoBytes, KnownLayout,
)]
#[repr(C)]
pub struct Event {
    pub event_type: U32,
    /// The QPN, CQ, SRQ or port the event is about (EVENTS_LOST: how many).
    pub object: U32,
    /// The context that owns the object (0 for port and device events).
    pub context: U32,
    pub reserved: U32,
}

/// Event types.
pub mod event {
    pub const CQ_ERR: u32 = 1;
    pub const QP_FATAL: u32 = 2;
    pub const QP_REQ_ERR: u32 = 3;
    pub const QP_ACCESS_ERR: u32 = 4;
    pub const QP_LAST_WQE_REACHED: u32 = 5;
    pub const SQ_DRAINED: u32 = 6;
    pub const SRQ_LIMIT_REACHED: u32 = 7;
    pub const SRQ_ERR: u32 = 8;
    pub const PORT_ACTIVE: u32 = 9;
    pub const PORT_ERR: u32 = 10;
    pub const DEVICE_FATAL: u32 = 11;
    pub const EVENTS_LOST: u32 = 12;
}

/// A completion notification (8 bytes, one per notifyq buffer).
#[derive(
    Clone, Copy, Debug, Default, Eq, PartialEq, FromBytes, Immutable, IntoBytes, KnownLayout,
)]
#[repr(C)]
pub struct Notification {
    pub cq: U32,
    pub context: U32,
}

// --- sizes the guest's header must agree with -------------------------------

const _: () = {
    assert!(size_of::<Config>() == 64);
    assert!(size_of::<CmdHdr>() == 8);
    assert!(size_of::<RespHdr>() == 8);
    assert!(size_of::<RingDesc>() == 24);
    assert!(size_of::<DeviceAttrResp>() == 128);
    assert!(size_of::<PortAttrResp>() == 32);
    assert!(size_of::<CreateContextReq>() == 8);
    assert!(size_of::<CreateCqReq>() == 24);
    assert!(size_of::<CreateCqResp>() == 16);
    assert!(size_of::<ResizeCqReq>() == 32);
    assert!(size_of::<RegMrReq>() == 40);
    assert!(size_of::<CreateSrqReq>() == 40);
    assert!(size_of::<CreateQpReq>() == 80);
    assert!(size_of::<CreateQpResp>() == 32);
    assert!(size_of::<Av>() == 32);
    assert!(size_of::<QpAttrs>() == 76);
    assert!(size_of::<ModifyQpReq>() == 84);
    assert!(size_of::<QueryQpResp>() == 100);
    assert!(size_of::<SetGidReq>() == 24);
    assert!(size_of::<SendWqeHdr>() == 64);
    assert!(size_of::<WqeRdma>() == 48);
    assert!(size_of::<WqeAtomic>() == 48);
    assert!(size_of::<WqeUd>() == 48);
    assert!(size_of::<WqeRegMr>() == 48);
    assert!(size_of::<WqeBindMw>() == 48);
    assert!(size_of::<Sge>() == 16);
    assert!(size_of::<RecvWqeHdr>() == 16);
    assert!(size_of::<Cqe>() == 32);
    assert!(size_of::<Event>() == 16);
    assert!(size_of::<Notification>() == 8);
};
