//! VMware's PVRDMA device ABI, as the Linux `vmw_pvrdma` driver and
//! rdma-core's `vmw_pvrdma` provider use it: registers, the device shared
//! region, commands and their responses, ring entries (WQEs, CQEs, async
//! events, CQ notifications), doorbells and the enums they carry. Every
//! structure is little-endian and laid out exactly as in guest memory;
//! each is read out of guest memory whole (a copy the guest cannot change)
//! and only then looked at. The sizes are asserted against the driver's.
//!
//! Field names follow the driver's so that a reader can hold the two side
//! by side; what each field means to vrdma is said where it is used.

use zerocopy::{
    FromBytes, Immutable, IntoBytes, KnownLayout,
    little_endian::{U16, U32, U64},
};

/// PCI identity: VMware's PVRDMA function.
pub const VENDOR_ID: u16 = 0x15ad;
pub const DEVICE_ID: u16 = 0x0820;
/// The Ethernet function it pairs with at function 0 of the same slot.
pub const VMXNET3_DEVICE_ID: u16 = 0x07b0;

/// The device ABI version vrdma reports (QP handles apart from QPNs,
/// 64-bit page numbers, RoCEv2).
pub const VERSION: u32 = 20;
/// The driver's page size (PVRDMA exists on x86 only).
pub const PAGE_SIZE: u64 = 4096;
/// 64-bit addresses in a page of a page directory.
pub const PDIR_ENTRIES: u64 = PAGE_SIZE / 8;
/// The most pages an object may have: one directory page of tables.
pub const MAX_PDIR_PAGES: u64 = PDIR_ENTRIES * PDIR_ENTRIES;

/// BAR1 registers (32-bit).
pub mod reg {
    pub const VERSION: u64 = 0x00;
    pub const DSRLOW: u64 = 0x04;
    pub const DSRHIGH: u64 = 0x08;
    pub const CTL: u64 = 0x0c;
    pub const REQUEST: u64 = 0x10;
    pub const ERR: u64 = 0x14;
    pub const ICR: u64 = 0x18;
    pub const IMR: u64 = 0x1c;
    pub const MACL: u64 = 0x20;
    pub const MACH: u64 = 0x24;

    /// CTL values.
    pub const CTL_ACTIVATE: u32 = 0;
    pub const CTL_UNQUIESCE: u32 = 1;
    pub const CTL_RESET: u32 = 2;
}

/// Values of the ERR register: the device's own (the driver only tests
/// for non-zero).
pub mod err {
    pub const INVALID: u32 = 1;
    pub const NO_DSR: u32 = 2;
    pub const BAD_COMMAND: u32 = 0xffff;
}

/// Interrupt causes and their MSI-X vectors.
pub mod intr {
    pub const RESPONSE: u32 = 0;
    pub const ASYNC: u32 = 1;
    pub const CQ: u32 = 2;
    /// Vectors the device has.
    pub const VECTORS: u32 = 3;
}

/// Doorbells: offsets in a UAR page and the bits of the value written.
pub mod uar {
    pub const QP_OFFSET: u64 = 0;
    pub const CQ_OFFSET: u64 = 4;
    pub const SRQ_OFFSET: u64 = 8;
    pub const HANDLE_MASK: u32 = 0x00ff_ffff;
    pub const QP_SEND: u32 = 1 << 30;
    pub const QP_RECV: u32 = 1 << 31;
    pub const CQ_ARM_SOL: u32 = 1 << 29;
    pub const CQ_ARM: u32 = 1 << 30;
    pub const CQ_POLL: u32 = 1 << 31;
    pub const SRQ_RECV: u32 = 1 << 30;
}

/// A page directory reference in the DSR.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct RingPages {
    pub num_pages: U32,
    pub reserved: U32,
    pub pdir_dma: U64,
}

/// The device's capabilities, which it writes into the DSR.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct Caps {
    pub fw_ver: U64,
    /// Big-endian, copied raw by the driver.
    pub node_guid: [u8; 8],
    pub sys_image_guid: [u8; 8],
    pub max_mr_size: U64,
    pub page_size_cap: U64,
    pub atomic_arg_sizes: U64,
    pub ex_comp_mask: U32,
    pub device_cap_flags2: U32,
    pub max_fa_bit_boundary: U32,
    pub log_max_atomic_inline_arg: U32,
    pub vendor_id: U32,
    pub vendor_part_id: U32,
    pub hw_ver: U32,
    pub max_qp: U32,
    pub max_qp_wr: U32,
    pub device_cap_flags: U32,
    pub max_sge: U32,
    pub max_sge_rd: U32,
    pub max_cq: U32,
    pub max_cqe: U32,
    pub max_mr: U32,
    pub max_pd: U32,
    pub max_qp_rd_atom: U32,
    pub max_ee_rd_atom: U32,
    pub max_res_rd_atom: U32,
    pub max_qp_init_rd_atom: U32,
    pub max_ee_init_rd_atom: U32,
    pub max_ee: U32,
    pub max_rdd: U32,
    pub max_mw: U32,
    pub max_raw_ipv6_qp: U32,
    pub max_raw_ethy_qp: U32,
    pub max_mcast_grp: U32,
    pub max_mcast_qp_attach: U32,
    pub max_total_mcast_qp_attach: U32,
    pub max_ah: U32,
    pub max_fmr: U32,
    pub max_map_per_fmr: U32,
    pub max_srq: U32,
    pub max_srq_wr: U32,
    pub max_srq_sge: U32,
    pub max_uar: U32,
    pub gid_tbl_len: U32,
    pub max_pkeys: U16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
    /// 0: RoCE.
    pub mode: u8,
    pub atomic_ops: u8,
    pub bmme_flags: u8,
    pub gid_types: u8,
    pub max_fast_reg_page_list_len: U32,
}

/// Caps::atomic_ops bits.
pub const ATOMIC_OP_COMP_SWAP: u8 = 1 << 0;
pub const ATOMIC_OP_FETCH_ADD: u8 = 1 << 1;
/// Caps::bmme_flags bits.
pub const BMME_LOCAL_INV: u8 = 1 << 0;
pub const BMME_REMOTE_INV: u8 = 1 << 1;
pub const BMME_FAST_REG_WR: u8 = 1 << 2;
/// Caps::gid_types / CREATE_BIND gid_type.
pub const GID_TYPE_ROCE_V1: u8 = 1 << 0;
pub const GID_TYPE_ROCE_V2: u8 = 1 << 1;
/// The most pages a fast-registration MR may map (the driver's limit).
pub const MAX_FAST_REG_PAGES: u32 = 128;

/// The device shared region the driver hands the device at DSRHIGH.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct Dsr {
    pub driver_version: U32,
    pub pad: U32,
    pub gos_info: U64,
    pub cmd_slot_dma: U64,
    pub resp_slot_dma: U64,
    pub async_ring_pages: RingPages,
    pub cq_ring_pages: RingPages,
    /// The UAR page 0's frame number (32-bit below version 19).
    pub uar_pfn64: U64,
    pub caps: Caps,
}

/// Where `caps` sits in the DSR (the only part the device writes).
pub const DSR_CAPS_OFFSET: u64 = 72;

/// Command request header.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct CmdHdr {
    pub response: U64,
    pub cmd: U32,
    pub reserved: U32,
}

/// Command response header.
#[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes, KnownLayout)]
#[repr(C)]
pub struct RespHdr {
    pub response: U64,
    pub ack: U32,
    pub err: u8,
    pub reserved: [u8; 3],
}

/// Command codes; a response's ack is `ACK | code`.
pub mod cmd {
    pub const QUERY_PORT: u32 = 0;
    pub const QUERY_PKEY: u32 = 1;
    pub const CREATE_PD: u32 = 2;
    pub const DESTROY_PD: u32 = 3;
    pub const CREATE_MR: u32 = 4;
    pub const DESTROY_MR: u32 = 5;
    pub const CREATE_CQ: u32 = 6;
    pub const RESIZE_CQ: u32 = 7;
    pub const DESTROY_CQ: u32 = 8;
    pub const CREATE_QP: u32 = 9;
    pub const MODIFY_QP: u32 = 10;
    pub const QUERY_QP: u32 = 11;
    pub const DESTROY_QP: u32 = 12;
    pub const CREATE_UC: u32 = 13;
    pub const DESTROY_UC: u32 = 14;
    pub const CREATE_BIND: u32 = 15;
    pub const DESTROY_BIND: u32 = 16;
    pub const CREATE_SRQ: u32 = 17;
    pub const MODIFY_SRQ: u32 = 18;
    pub const QUERY_SRQ: u32 = 19;
    pub const DESTROY_SRQ: u32 = 20;
    pub const ACK: u32 = 0x8000_0000;
}

/// The command slot holds the largest request (MODIFY_QP); the response
/// slot the largest response (QUERY_QP).
pub const MAX_REQUEST: usize = 184;
pub const MAX_RESPONSE: usize = 176;

pub use layouts::*;

/// The commands' and rings' structures. In a module of their own: the
/// derives expand, inside `wire_struct!`, to helper items that the
/// missing-Debug lint would flag (the structures themselves derive Debug).
#[allow(missing_debug_implementations)]
mod layouts {
    use zerocopy::{
        FromBytes, Immutable, IntoBytes,
        little_endian::{U16, U32, U64},
    };

    use super::{CmdHdr, RespHdr};

    macro_rules! wire_struct {
        ($(#[$m:meta])* $name:ident, $size:expr, { $($field:ident : $ty:ty),* $(,)? }) => {
            $(#[$m])*
            #[derive(Clone, Copy, Debug, Default, FromBytes, Immutable, IntoBytes)]
            #[repr(C)]
            pub struct $name { $(pub $field: $ty),* }
            const _: () = assert!(core::mem::size_of::<$name>() == $size);
        };
    }

    wire_struct!(
        /// `struct pvrdma_port_attr`.
        PortAttr, 48, {
            state: U32, max_mtu: U32, active_mtu: U32, gid_tbl_len: U32, port_cap_flags: U32,
            max_msg_sz: U32, bad_pkey_cntr: U32, qkey_viol_cntr: U32, pkey_tbl_len: U16, lid: U16,
            sm_lid: U16, lmc: u8, max_vl_num: u8, sm_sl: u8, subnet_timeout: u8, init_type_reply: u8,
            active_width: u8, active_speed: u8, phys_state: u8, reserved: [u8; 2],
        }
    );
    wire_struct!(QueryPort, 24, { hdr: CmdHdr, port_num: u8, reserved: [u8; 7] });
    wire_struct!(QueryPortResp, 64, { hdr: RespHdr, attrs: PortAttr });
    wire_struct!(QueryPkey, 24, { hdr: CmdHdr, port_num: u8, index: u8, reserved: [u8; 6] });
    wire_struct!(QueryPkeyResp, 24, { hdr: RespHdr, pkey: U16, reserved: [u8; 6] });
    wire_struct!(CreateUc, 24, { hdr: CmdHdr, pfn64: U64 });
    wire_struct!(CreateUcResp, 24, { hdr: RespHdr, ctx_handle: U32, reserved: [u8; 4] });
    wire_struct!(Handle, 24, { hdr: CmdHdr, handle: U32, reserved: [u8; 4] });
    wire_struct!(HandleResp, 24, { hdr: RespHdr, handle: U32, reserved: [u8; 4] });
    wire_struct!(CreateMr, 56, {
        hdr: CmdHdr, start: U64, length: U64, pdir_dma: U64, pd_handle: U32, access_flags: U32,
        flags: U32, nchunks: U32,
    });
    wire_struct!(CreateMrResp, 32, {
        hdr: RespHdr, mr_handle: U32, lkey: U32, rkey: U32, reserved: [u8; 4],
    });
    /// CreateMr::flags.
    pub const MR_FLAG_DMA: u32 = 1;
    pub const MR_FLAG_FRMR: u32 = 2;
    wire_struct!(CreateCq, 40, {
        hdr: CmdHdr, pdir_dma: U64, ctx_handle: U32, cqe: U32, nchunks: U32, reserved: [u8; 4],
    });
    wire_struct!(CreateCqResp, 24, { hdr: RespHdr, cq_handle: U32, cqe: U32 });
    wire_struct!(ResizeCq, 24, { hdr: CmdHdr, cq_handle: U32, cqe: U32 });
    wire_struct!(ResizeCqResp, 24, { hdr: RespHdr, cqe: U32, reserved: [u8; 4] });
    wire_struct!(CreateQp, 80, {
        hdr: CmdHdr, pdir_dma: U64, pd_handle: U32, send_cq_handle: U32, recv_cq_handle: U32,
        srq_handle: U32, max_send_wr: U32, max_recv_wr: U32, max_send_sge: U32, max_recv_sge: U32,
        max_inline_data: U32, lkey: U32, access_flags: U32, total_chunks: U16, send_chunks: U16,
        max_atomic_arg: U16, sq_sig_all: u8, qp_type: u8, is_srq: u8, reserved: [u8; 3],
    });
    wire_struct!(CreateQpRespV2, 48, {
        hdr: RespHdr, qpn: U32, qp_handle: U32, max_send_wr: U32, max_recv_wr: U32,
        max_send_sge: U32, max_recv_sge: U32, max_inline_data: U32, reserved: [u8; 4],
    });
    wire_struct!(
        /// `struct pvrdma_qp_cap`.
        QpCap, 24, {
            max_send_wr: U32, max_recv_wr: U32, max_send_sge: U32, max_recv_sge: U32,
            max_inline_data: U32, reserved: U32,
        }
    );
    wire_struct!(
        /// `struct pvrdma_ah_attr` (its first 24 bytes are the global route).
        AhAttr, 40, {
            dgid: [u8; 16], flow_label: U32, sgid_index: u8, hop_limit: u8, traffic_class: u8,
            reserved: u8, dlid: U16, vlan_id: U16, sl: u8, src_path_bits: u8, static_rate: u8,
            ah_flags: u8, port_num: u8, dmac: [u8; 6], reserved2: u8,
        }
    );
    wire_struct!(
        /// `struct pvrdma_qp_attr`.
        QpAttr, 160, {
            qp_state: U32, cur_qp_state: U32, path_mtu: U32, path_mig_state: U32, qkey: U32,
            rq_psn: U32, sq_psn: U32, dest_qp_num: U32, qp_access_flags: U32, pkey_index: U16,
            alt_pkey_index: U16, en_sqd_async_notify: u8, sq_draining: u8, max_rd_atomic: u8,
            max_dest_rd_atomic: u8, min_rnr_timer: u8, port_num: u8, timeout: u8, retry_cnt: u8,
            rnr_retry: u8, alt_port_num: u8, alt_timeout: u8, reserved: [u8; 5], cap: QpCap,
            ah_attr: AhAttr, alt_ah_attr: AhAttr,
        }
    );
    wire_struct!(ModifyQp, 184, { hdr: CmdHdr, qp_handle: U32, attr_mask: U32, attrs: QpAttr });
    wire_struct!(QueryQp, 24, { hdr: CmdHdr, qp_handle: U32, attr_mask: U32 });
    wire_struct!(QueryQpResp, 176, { hdr: RespHdr, attrs: QpAttr });
    wire_struct!(CreateBind, 48, {
        hdr: CmdHdr, mtu: U32, vlan: U32, index: U32, new_gid: [u8; 16], gid_type: u8,
        reserved: [u8; 3],
    });
    wire_struct!(DestroyBind, 40, { hdr: CmdHdr, index: U32, dest_gid: [u8; 16], reserved: [u8; 4] });
    wire_struct!(
        /// `struct pvrdma_srq_attr`.
        SrqAttr, 16, { max_wr: U32, max_sge: U32, srq_limit: U32, reserved: U32 }
    );
    wire_struct!(CreateSrq, 56, {
        hdr: CmdHdr, pdir_dma: U64, pd_handle: U32, nchunks: U32, attrs: SrqAttr, srq_type: u8,
        reserved: [u8; 7],
    });
    wire_struct!(ModifySrq, 40, { hdr: CmdHdr, srq_handle: U32, attr_mask: U32, attrs: SrqAttr });
    wire_struct!(QuerySrqResp, 32, { hdr: RespHdr, attrs: SrqAttr });

    wire_struct!(
        /// A scatter/gather element.
        Sge, 16, { addr: U64, length: U32, lkey: U32 }
    );
    wire_struct!(
        /// A receive WQE's header; `num_sge` SGEs follow.
        RqWqeHdr, 16, { wr_id: U64, num_sge: U32, total_len: U32 }
    );
    wire_struct!(
        /// A send WQE's header; `num_sge` SGEs follow. `wr` is a union read
        /// by the opcode (see [`SqWqeHdr`]'s accessors).
        SqWqeHdr, 80, {
            wr_id: U64, num_sge: U32, total_len: U32, opcode: U32, send_flags: U32, ex: U32,
            reserved: U32, wr: [U64; 6],
        }
    );
    wire_struct!(
        /// A UD address vector, inside a send WQE.
        Av, 40, {
            port_pd: U32, sl_tclass_flowlabel: U32, dgid: [u8; 16], src_path_bits: u8, gid_index: u8,
            stat_rate: u8, hop_limit: u8, dmac: [u8; 6], reserved: [u8; 6],
        }
    );
    wire_struct!(
        /// A completion queue entry.
        Cqe, 64, {
            wr_id: U64, qp: U64, opcode: U32, status: U32, byte_len: U32, imm_data: U32, src_qp: U32,
            wc_flags: U32, vendor_err: U32, pkey_index: U16, slid: U16, sl: u8, dlid_path_bits: u8,
            port_num: u8, smac: [u8; 6], network_hdr_type: u8, reserved: [u8; 6],
        }
    );
    wire_struct!(
        /// An asynchronous event.
        Eqe, 8, { kind: U32, info: U32 }
    );
    wire_struct!(
        /// A CQ notification: the CQ's handle.
        Cqne, 4, { info: U32 }
    );
    wire_struct!(
        /// The producer and consumer index of one ring.
        Ring, 8, { prod_tail: U32, cons_head: U32 }
    );
}

const _: () = assert!(core::mem::size_of::<Dsr>() == 280);
const _: () = assert!(core::mem::size_of::<Caps>() == 208);
const _: () = assert!(core::mem::size_of::<CmdHdr>() == 16);
const _: () = assert!(core::mem::size_of::<RespHdr>() == 16);
const _: () = assert!(core::mem::size_of::<ModifyQp>() == MAX_REQUEST);
const _: () = assert!(core::mem::size_of::<QueryQpResp>() == MAX_RESPONSE);

/// Where each ring's indices sit in an object's first page.
pub mod ring_state {
    /// QP send queue (`tx`).
    pub const SQ: u64 = 0;
    /// QP receive queue, SRQ, CQ, async and CQ-notification rings (`rx`).
    pub const RX: u64 = 8;
}

/// Send WQE opcodes (`enum pvrdma_wr_opcode`).
pub mod wr_opcode {
    pub const RDMA_WRITE: u32 = 0;
    pub const RDMA_WRITE_WITH_IMM: u32 = 1;
    pub const SEND: u32 = 2;
    pub const SEND_WITH_IMM: u32 = 3;
    pub const RDMA_READ: u32 = 4;
    pub const ATOMIC_CMP_AND_SWP: u32 = 5;
    pub const ATOMIC_FETCH_AND_ADD: u32 = 6;
    pub const LSO: u32 = 7;
    pub const SEND_WITH_INV: u32 = 8;
    pub const RDMA_READ_WITH_INV: u32 = 9;
    pub const LOCAL_INV: u32 = 10;
    pub const FAST_REG_MR: u32 = 11;
}

/// Send WQE flags.
pub mod send_flags {
    pub const FENCE: u32 = 1 << 0;
    pub const SIGNALED: u32 = 1 << 1;
    pub const SOLICITED: u32 = 1 << 2;
    pub const INLINE: u32 = 1 << 3;
    pub const IP_CSUM: u32 = 1 << 4;
}

/// Completion opcodes (`enum pvrdma_wc_opcode`).
pub mod wc_opcode {
    pub const SEND: u32 = 0;
    pub const RDMA_WRITE: u32 = 1;
    pub const RDMA_READ: u32 = 2;
    pub const COMP_SWAP: u32 = 3;
    pub const FETCH_ADD: u32 = 4;
    pub const BIND_MW: u32 = 5;
    pub const LOCAL_INV: u32 = 7;
    pub const FAST_REG_MR: u32 = 8;
    pub const RECV: u32 = 128;
    pub const RECV_RDMA_WITH_IMM: u32 = 129;
}

/// Completion flags (`enum pvrdma_wc_flags`).
pub mod wc_flags {
    pub const GRH: u32 = 1 << 0;
    pub const WITH_IMM: u32 = 1 << 1;
    pub const WITH_INVALIDATE: u32 = 1 << 2;
    pub const WITH_NETWORK_HDR_TYPE: u32 = 1 << 6;
}

/// CQE network header types.
pub mod network_hdr {
    pub const IPV4: u8 = 1;
    pub const IPV6: u8 = 2;
}

/// QP types (`enum pvrdma_qp_type`).
pub mod qp_type {
    pub const GSI: u8 = 1;
    pub const RC: u8 = 2;
    pub const UC: u8 = 3;
    pub const UD: u8 = 4;
}

/// Async event types (`enum pvrdma_eqe_type`, the kernel's numbering).
pub mod eqe {
    pub const CQ_ERR: u32 = 0;
    pub const QP_FATAL: u32 = 1;
    pub const QP_REQ_ERR: u32 = 2;
    pub const QP_ACCESS_ERR: u32 = 3;
    pub const SQ_DRAINED: u32 = 5;
    pub const DEVICE_FATAL: u32 = 8;
    pub const PORT_ACTIVE: u32 = 9;
    pub const PORT_ERR: u32 = 10;
    pub const SRQ_ERR: u32 = 14;
    pub const SRQ_LIMIT_REACHED: u32 = 15;
    pub const QP_LAST_WQE_REACHED: u32 = 16;
}
