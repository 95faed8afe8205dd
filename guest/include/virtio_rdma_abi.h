/* SPDX-License-Identifier: ((GPL-2.0 WITH Linux-syscall-note) OR BSD-3-Clause) */
/*
 * virtio-rdma: the device ABI (docs/virtio-rdma.md, v1), shared by the
 * Linux driver (guest/linux/virtio_rdma) and its rdma-core provider.
 *
 * Every structure is little-endian and laid out as the specification
 * gives it; the driver checks each size at build time against the
 * specification's (virtio_rdma_main.c), as the device does
 * (crates/vrdma-virtio/src/abi.rs).
 */
#ifndef _VIRTIO_RDMA_ABI_H
#define _VIRTIO_RDMA_ABI_H

#include <linux/types.h>

/* The device ID (0x1040 + 42 as a virtio-pci function). */
#define VIRTIO_ID_RDMA_DEVICE 42

/* The ABI's version: a provider and a driver agree on it (uverbs). */
#define VIRTIO_RDMA_ABI_VERSION 1

#define VIRTIO_RDMA_PAGE_SIZE 4096
#define VIRTIO_RDMA_RING_HEADER_SIZE 64

/* Feature bits (spec §2.2); VERSION_1 and the ring bits are VIRTIO's. */
#define VIRTIO_RDMA_F_DOORBELL_POLL 0
#define VIRTIO_RDMA_F_INDIRECT_PAGES 1
#define VIRTIO_RDMA_F_MIGRATION 2
#define VIRTIO_RDMA_F_STATS 3

/* Virtqueues (§4). */
#define VIRTIO_RDMA_VQ_CONTROL 0
#define VIRTIO_RDMA_VQ_EVENT 1
#define VIRTIO_RDMA_VQ_NOTIFY 2
#define VIRTIO_RDMA_VQ_DOORBELL 3
#define VIRTIO_RDMA_VQ_COUNT 4

/* Control commands (§6.6). */
#define VIRTIO_RDMA_CMD_QUERY_DEVICE 1
#define VIRTIO_RDMA_CMD_QUERY_PORT 2
#define VIRTIO_RDMA_CMD_CREATE_CONTEXT 3
#define VIRTIO_RDMA_CMD_DESTROY_CONTEXT 4
#define VIRTIO_RDMA_CMD_ALLOC_PD 5
#define VIRTIO_RDMA_CMD_DEALLOC_PD 6
#define VIRTIO_RDMA_CMD_CREATE_CQ 7
#define VIRTIO_RDMA_CMD_DESTROY_CQ 8
#define VIRTIO_RDMA_CMD_RESIZE_CQ 9
#define VIRTIO_RDMA_CMD_REG_MR 10
#define VIRTIO_RDMA_CMD_REG_DMA_MR 11
#define VIRTIO_RDMA_CMD_ALLOC_MR 12
#define VIRTIO_RDMA_CMD_DEREG_MR 13
#define VIRTIO_RDMA_CMD_ALLOC_MW 14
#define VIRTIO_RDMA_CMD_DEALLOC_MW 15
#define VIRTIO_RDMA_CMD_CREATE_SRQ 16
#define VIRTIO_RDMA_CMD_MODIFY_SRQ 17
#define VIRTIO_RDMA_CMD_QUERY_SRQ 18
#define VIRTIO_RDMA_CMD_DESTROY_SRQ 19
#define VIRTIO_RDMA_CMD_CREATE_QP 20
#define VIRTIO_RDMA_CMD_MODIFY_QP 21
#define VIRTIO_RDMA_CMD_QUERY_QP 22
#define VIRTIO_RDMA_CMD_DESTROY_QP 23
#define VIRTIO_RDMA_CMD_SET_GID 24
#define VIRTIO_RDMA_CMD_QUERY_STATS 25 /* with VIRTIO_RDMA_F_STATS */

/* Response statuses (§6.2). */
#define VIRTIO_RDMA_OK 0
#define VIRTIO_RDMA_ERR_INVALID 1
#define VIRTIO_RDMA_ERR_NOENT 2
#define VIRTIO_RDMA_ERR_NOMEM 3
#define VIRTIO_RDMA_ERR_BUSY 4
#define VIRTIO_RDMA_ERR_UNSUPPORTED 5
#define VIRTIO_RDMA_ERR_FAULT 6
#define VIRTIO_RDMA_ERR_LENGTH 7
#define VIRTIO_RDMA_ERR_DEVICE 8

/* Send, receive and SRQ ring headers: byte offsets (§7.1). */
#define VIRTIO_RDMA_WQ_HDR_PRODUCER 0
#define VIRTIO_RDMA_WQ_HDR_CONSUMER 4

/* CQ ring headers: byte offsets, and the arm modes (§7.1, §9.1). */
#define VIRTIO_RDMA_CQ_PRODUCER 0
#define VIRTIO_RDMA_CQ_CONSUMER 4
#define VIRTIO_RDMA_CQ_ARM 8
#define VIRTIO_RDMA_CQ_ARM_NEXT 1
#define VIRTIO_RDMA_CQ_ARM_SOLICITED 2

/* QUERY_DEVICE device_cap_flags bits. */
#define VIRTIO_RDMA_DEVICE_RESIZE_MAX_WR 0x1ULL
#define VIRTIO_RDMA_DEVICE_CURR_QP_STATE_MOD 0x80ULL
#define VIRTIO_RDMA_DEVICE_PORT_ACTIVE_EVENT 0x400ULL
#define VIRTIO_RDMA_DEVICE_SYS_IMAGE_GUID 0x800ULL
#define VIRTIO_RDMA_DEVICE_RC_RNR_NAK_GEN 0x1000ULL
#define VIRTIO_RDMA_DEVICE_SRQ_RESIZE 0x2000ULL
#define VIRTIO_RDMA_DEVICE_MEM_WINDOW 0x20000ULL
#define VIRTIO_RDMA_DEVICE_MEM_WINDOW_TYPE_2B 0x1000000ULL
#define VIRTIO_RDMA_DEVICE_MEM_MGT_EXTENSIONS 0x200000ULL

/* Access flags of MRs and windows. */
#define VIRTIO_RDMA_ACCESS_LOCAL_WRITE 0x1U
#define VIRTIO_RDMA_ACCESS_REMOTE_WRITE 0x2U
#define VIRTIO_RDMA_ACCESS_REMOTE_READ 0x4U
#define VIRTIO_RDMA_ACCESS_REMOTE_ATOMIC 0x8U
#define VIRTIO_RDMA_ACCESS_MW_BIND 0x10U
#define VIRTIO_RDMA_ACCESS_ZERO_BASED 0x20U
#define VIRTIO_RDMA_ACCESS_MR_BITS 0x3f

/* QP types. */
#define VIRTIO_RDMA_QPT_GSI 1
#define VIRTIO_RDMA_QPT_RC 2
#define VIRTIO_RDMA_QPT_UC 3
#define VIRTIO_RDMA_QPT_UD 4

/* GID types (SET_GID). */
#define VIRTIO_RDMA_GID_TYPE_NONE 0
#define VIRTIO_RDMA_GID_TYPE_ROCE_V2 2

/* Send WQE opcodes and flags (§7.3). */
#define VIRTIO_RDMA_WR_RDMA_WRITE 0
#define VIRTIO_RDMA_WR_RDMA_WRITE_WITH_IMM 1
#define VIRTIO_RDMA_WR_SEND 2
#define VIRTIO_RDMA_WR_SEND_WITH_IMM 3
#define VIRTIO_RDMA_WR_RDMA_READ 4
#define VIRTIO_RDMA_WR_ATOMIC_CMP_AND_SWP 5
#define VIRTIO_RDMA_WR_ATOMIC_FETCH_AND_ADD 6
#define VIRTIO_RDMA_WR_LOCAL_INV 7
#define VIRTIO_RDMA_WR_BIND_MW 8
#define VIRTIO_RDMA_WR_SEND_WITH_INV 9
#define VIRTIO_RDMA_WR_REG_MR 10
#define VIRTIO_RDMA_WR_F_FENCE 0x1U
#define VIRTIO_RDMA_WR_F_SIGNALED 0x2U
#define VIRTIO_RDMA_WR_F_SOLICITED 0x4U
#define VIRTIO_RDMA_WR_F_INLINE 0x8U

/* CQE flags (§7.8). */
#define VIRTIO_RDMA_WC_F_GRH 0x1U
#define VIRTIO_RDMA_WC_F_WITH_IMM 0x2U
#define VIRTIO_RDMA_WC_F_WITH_INV 0x8U

/* Doorbell area: byte offsets, and the sizes a bitmap may have (§8.1). */
#define VIRTIO_RDMA_DB_POLL 0
#define VIRTIO_RDMA_DB_SUMMARY 64
#define VIRTIO_RDMA_DB_BITMAP 1024
#define VIRTIO_RDMA_DB_MIN_BITS 64
#define VIRTIO_RDMA_DB_MAX_BITS 0x40000U

/* Event types (§10.1). */
#define VIRTIO_RDMA_EVENT_CQ_ERR 1
#define VIRTIO_RDMA_EVENT_QP_FATAL 2
#define VIRTIO_RDMA_EVENT_QP_REQ_ERR 3
#define VIRTIO_RDMA_EVENT_QP_ACCESS_ERR 4
#define VIRTIO_RDMA_EVENT_QP_LAST_WQE_REACHED 5
#define VIRTIO_RDMA_EVENT_SQ_DRAINED 6
#define VIRTIO_RDMA_EVENT_SRQ_LIMIT_REACHED 7
#define VIRTIO_RDMA_EVENT_SRQ_ERR 8
#define VIRTIO_RDMA_EVENT_PORT_ACTIVE 9
#define VIRTIO_RDMA_EVENT_PORT_ERR 10
#define VIRTIO_RDMA_EVENT_DEVICE_FATAL 11
#define VIRTIO_RDMA_EVENT_EVENTS_LOST 12

struct virtio_rdma_config { /* offset */
	__u8 mac[6]; /*  0: the sibling NIC's MAC; all zero: none */
	__le16 reserved0; /*  6 */
	__le32 max_contexts; /*  8: contexts the device can hold */
	__le32 max_doorbell_bits; /* 12: most doorbell bits per context */
	__le32 max_qp; /* 16: informative; QUERY_DEVICE is authoritative */
	__le32 max_cq; /* 20: informative; QUERY_DEVICE is authoritative */
	__le32 max_request; /* 24: largest controlq request, bytes */
	__le32 reserved1; /* 28 */
	__le64 reserved2[4]; /* 32 */
}; /* 64 bytes */

struct virtio_rdma_cmd_hdr { /* request, offset */
	__le16 opcode; /* 0: VIRTIO_RDMA_CMD_* (§6.6) */
	__le16 flags; /* 2: 0 in v1 (bit 0: VIRTIO_RDMA_CMD_F_INDIRECT, §2.4) */
	__le32 context; /* 4: the context the command acts in (§6.3) */
}; /* 8 bytes; the body and the trailing array follow */

struct virtio_rdma_resp_hdr { /* response, offset */
	__le16 status; /* 0: VIRTIO_RDMA_OK or VIRTIO_RDMA_ERR_* (§6.2) */
	__le16 reserved; /* 2: 0 */
	__le32 detail; /* 4: diagnostic errno (positive), 0 on OK */
}; /* 8 bytes; the response body follows on OK */

struct virtio_rdma_ring { /* offset */
	__le64 header; /*  0: GPA of the ring's 64-byte header */
	__le32 entries; /*  8: a power of two */
	__le32 stride; /* 12: bytes per entry, a power of two */
	__le32 npages; /* 16: pages in the trailing array for this ring */
	__le32 reserved; /* 20 */
}; /* 24 bytes */

/* DEALLOC_PD, DESTROY_CQ, DEREG_MR, DEALLOC_MW, QUERY_SRQ, DESTROY_SRQ, QUERY_QP, DESTROY_QP */
struct virtio_rdma_handle_req { /* offset */
	__le32 handle; /* 0 */
	__le32 reserved; /* 4 */
};

struct virtio_rdma_handle_resp { /* CREATE_CONTEXT, ALLOC_PD, ALLOC_MW */
	__le32 handle; /* 0 */
	__le32 reserved; /* 4: 0 */
};

struct virtio_rdma_device_attr { /* offset */
	__le64 node_guid; /*   0 */
	__le64 sys_image_guid; /*   8 */
	__le64 max_mr_size; /*  16 */
	__le64 page_size_cap; /*  24 */
	__le64 device_cap_flags; /*  32: IBV_DEVICE_* bits */
	__le32 vendor_id; /*  40 */
	__le32 vendor_part_id; /*  44 */
	__le32 hw_ver; /*  48 */
	__le32 max_qp; /*  52 */
	__le32 max_qp_wr; /*  56 */
	__le32 max_sge; /*  60 */
	__le32 max_sge_rd; /*  64 */
	__le32 max_cq; /*  68 */
	__le32 max_cqe; /*  72 */
	__le32 max_mr; /*  76 */
	__le32 max_pd; /*  80 */
	__le32 max_qp_rd_atom; /*  84 */
	__le32 max_qp_init_rd_atom; /*  88 */
	__le32 max_res_rd_atom; /*  92 */
	__le32 max_mw; /*  96 */
	__le32 max_srq; /* 100 */
	__le32 max_srq_wr; /* 104 */
	__le32 max_srq_sge; /* 108 */
	__le32 max_inline_data; /* 112 */
	__le32 max_fast_reg_page_list_len; /* 116 */
	__le16 max_pkeys; /* 120 */
	__u8 atomic_cap; /* 122: ibv_atomic_cap */
	__u8 local_ca_ack_delay; /* 123 */
	__u8 phys_port_cnt; /* 124 */
	__u8 reserved[3]; /* 125 */
}; /* 128 bytes */

struct virtio_rdma_port_req { /* offset */
	__le32 port; /* 0: 1 */
	__le32 reserved; /* 4 */
};

struct virtio_rdma_port_attr { /* offset */
	__le32 state; /*  0: ibv_port_state: 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE */
	__le32 max_mtu; /*  4: ibv_mtu: 1 256 … 5 4096 */
	__le32 active_mtu; /*  8: ibv_mtu */
	__le32 gid_tbl_len; /* 12 */
	__le32 port_cap_flags; /* 16: IBV_PORT_* capability bits */
	__le32 max_msg_sz; /* 20 */
	__le16 pkey_tbl_len; /* 24 */
	__u8 active_width; /* 26 */
	__u8 active_speed; /* 27 */
	__u8 phys_state; /* 28: 5 LinkUp, 3 Disabled */
	__u8 reserved[3]; /* 29 */
}; /* 32 bytes */

/* QUERY_STATS (§6.31): value[i] is counter i; 20..31 reserved. */
#define VIRTIO_RDMA_STATS_SLOTS 32
#define VIRTIO_RDMA_STATS_NAMED 20

struct virtio_rdma_stats { /* offset */
	__le64 value[VIRTIO_RDMA_STATS_SLOTS]; /* 0 */
}; /* 256 bytes */

struct virtio_rdma_create_context { /* offset; __le64 pages[npages] follow */
	__le32 doorbell_bits; /* 0: a power of two, 64 ..= max_doorbell_bits */
	__le32 npages; /* 4: ceil((1024 + doorbell_bits / 8) / 4096) */
};

struct virtio_rdma_create_cq { /* offset; __le64 pages[ring.npages] follow */
	struct virtio_rdma_ring ring; /* 0 */
};

struct virtio_rdma_create_cq_resp { /* offset */
	__le32 cq; /*  0 */
	__le32 entries; /*  4: completions the CQ holds = ring.entries */
	__le32 doorbell; /*  8: the CQ's doorbell index (§8.2) */
	__le32 reserved; /* 12: 0 */
};

struct virtio_rdma_resize_cq { /* offset; __le64 pages[ring.npages] follow */
	__le32 cq; /* 0 */
	__le32 reserved; /* 4 */
	struct virtio_rdma_ring ring; /* 8: the new ring */
};

struct virtio_rdma_resize_cq_resp { /* offset */
	__le32 entries; /* 0: = ring.entries */
	__le32 reserved; /* 4: 0 */
};

struct virtio_rdma_reg_mr { /* offset; __le64 pages[npages] follow */
	__le32 pd; /*  0 */
	__le32 access; /*  4: ibv_access_flags */
	__le64 iova; /*  8: the MR's first address (ignored with ZERO_BASED) */
	__le64 length; /* 16: bytes */
	__le32 page_shift; /* 24: log2 of the MR's page size, 12 ..= 30 */
	__le32 offset; /* 28: the MR's first byte in its first page */
	__le32 npages; /* 32: ceil((offset + length) / 2^page_shift) */
	__le32 reserved; /* 36 */
}; /* 40 bytes */

struct virtio_rdma_mr_resp { /* offset; REG_MR, REG_DMA_MR, ALLOC_MR */
	__le32 lkey; /* 0 */
	__le32 rkey; /* 4 */
};

struct virtio_rdma_reg_dma_mr { /* offset */
	__le32 pd; /* 0 */
	__le32 access; /* 4: LOCAL_WRITE, REMOTE_WRITE, REMOTE_READ, REMOTE_ATOMIC */
};

struct virtio_rdma_alloc_mr { /* offset */
	__le32 pd; /* 0 */
	__le32 max_pages; /* 4: 1 ..= max_fast_reg_page_list_len */
};

struct virtio_rdma_alloc_mw { /* offset */
	__le32 pd; /* 0 */
	__le32 mw_type; /* 4: 1 or 2 (ibv_mw_type; 2 is type 2B) */
};

struct virtio_rdma_create_srq { /* offset; __le64 pages[ring.npages] follow */
	__le32 pd; /*  0 */
	__le32 max_sge; /*  4: SGEs per receive WQE, ≤ max_srq_sge */
	__le32 srq_limit; /*  8: ignored; MODIFY_SRQ sets the limit */
	__le32 reserved; /* 12 */
	struct virtio_rdma_ring ring; /* 16 */
}; /* 40 bytes */

struct virtio_rdma_create_srq_resp { /* offset */
	__le32 srq; /*  0 */
	__le32 max_wr; /*  4: = ring.entries */
	__le32 max_sge; /*  8: = max(1, max_sge) */
	__le32 doorbell; /* 12 */
};

struct virtio_rdma_modify_srq { /* offset */
	__le32 srq; /*  0 */
	__le32 mask; /*  4: ibv_srq_attr_mask: 1 MAX_WR, 2 LIMIT */
	__le32 max_wr; /*  8: ignored (MAX_WR is not supported) */
	__le32 srq_limit; /* 12: used with LIMIT */
};

struct virtio_rdma_srq_attr { /* offset */
	__le32 max_wr; /*  0: the ring's entries */
	__le32 max_sge; /*  4 */
	__le32 srq_limit; /*  8: current; 0 once the limit event fired */
	__le32 reserved; /* 12: 0 */
};

struct virtio_rdma_create_qp { /* offset; __le64 pages[sq.npages + rq.npages] follow */
	__le32 pd; /*  0 */
	__u8 qp_type; /*  4: ib_qp_type: 1 GSI, 2 RC, 3 UC, 4 UD */
	__u8 sq_sig_all; /*  5: 1 = every send WR completes signaled */
	__le16 reserved0; /*  6 */
	__le32 send_cq; /*  8 */
	__le32 recv_cq; /* 12 */
	__le32 srq; /* 16: 0 = the QP has its own receive ring */
	__le32 max_send_sge; /* 20 */
	__le32 max_recv_sge; /* 24: 0 when srq ≠ 0 */
	__le32 max_inline_data; /* 28 */
	struct virtio_rdma_ring sq; /* 32 */
	struct virtio_rdma_ring rq; /* 56: all zero when srq ≠ 0 */
}; /* 80 bytes */

struct virtio_rdma_create_qp_resp { /* offset */
	__le32 qpn; /*  0 */
	__le32 max_send_wr; /*  4: = sq.entries */
	__le32 max_recv_wr; /*  8: = rq.entries; 0 with an SRQ */
	__le32 max_send_sge; /* 12: as requested */
	__le32 max_recv_sge; /* 16: as requested */
	__le32 max_inline_data; /* 20: as requested */
	__le32 doorbell; /* 24: the QP's doorbell index, for both its rings */
	__le32 reserved; /* 28: 0 */
};

/* A flow label's bits (§7.9); a driver masks the value it is given. */
#define VIRTIO_RDMA_FLOW_LABEL_MASK 0xfffff

struct virtio_rdma_av { /* offset; an address vector (also in UD WQEs, §7.5) */
	__u8 dgid[16]; /*  0: destination GID */
	__le32 flow_label; /* 16: the low 20 bits (the device ignores the rest) */
	__u8 sgid_index; /* 20: source GID table index */
	__u8 hop_limit; /* 21 */
	__u8 traffic_class; /* 22 */
	__u8 sl; /* 23 */
	__u8 dmac[6]; /* 24: destination MAC, resolved by the driver */
	__le16 reserved; /* 30 */
}; /* 32 bytes */

struct virtio_rdma_qp_attr { /* offset; ibv_qp_attr, the fields a RoCE QP has */
	/* 0: ibv_qp_state: 0 RESET, 1 INIT, 2 RTR, 3 RTS, 4 SQD, 5 SQE, 6 ERR */
	__le32 qp_state;
	__le32 cur_qp_state; /*  4 */
	__le32 path_mtu; /*  8: ibv_mtu */
	__le32 qkey; /* 12 */
	__le32 rq_psn; /* 16 */
	__le32 sq_psn; /* 20 */
	__le32 dest_qp_num; /* 24 */
	__le32 qp_access_flags; /* 28 */
	__le16 pkey_index; /* 32 */
	__u8 en_sqd_async_notify; /* 34 */
	__u8 sq_draining; /* 35: output only (QUERY_QP); 0 in MODIFY_QP */
	__u8 max_rd_atomic; /* 36 */
	__u8 max_dest_rd_atomic; /* 37 */
	__u8 min_rnr_timer; /* 38 */
	__u8 port_num; /* 39 */
	__u8 timeout; /* 40 */
	__u8 retry_cnt; /* 41 */
	__u8 rnr_retry; /* 42 */
	__u8 reserved; /* 43 */
	struct virtio_rdma_av ah; /* 44: the path of a connected QP */
}; /* 76 bytes */

struct virtio_rdma_modify_qp { /* offset */
	__le32 qpn; /* 0 */
	__le32 attr_mask; /* 4: ibv_qp_attr_mask */
	struct virtio_rdma_qp_attr attrs; /* 8 */
}; /* 84 bytes */

struct virtio_rdma_query_qp_resp { /* offset */
	struct virtio_rdma_qp_attr attrs; /*  0: current; cur_qp_state = qp_state */
	__le32 max_send_wr; /* 76 */
	__le32 max_recv_wr; /* 80 */
	__le32 max_send_sge; /* 84 */
	__le32 max_recv_sge; /* 88 */
	__le32 max_inline_data; /* 92 */
	__u8 qp_type; /* 96 */
	__u8 sq_sig_all; /* 97 */
	__le16 reserved; /* 98: 0 */
}; /* 100 bytes */

struct virtio_rdma_set_gid { /* offset */
	__le32 index; /*  0: < gid_tbl_len */
	__le32 gid_type; /*  4: 0 delete the entry, 2 RoCEv2 */
	__u8 gid[16]; /*  8: ignored when deleting */
};

struct virtio_rdma_wq_header { /* send, receive and SRQ rings; offset */
	__le32 producer; /*  0: written by the driver */
	__le32 consumer; /*  4: written by the device */
	__u8 reserved[56]; /*  8 */
};

struct virtio_rdma_cq_header { /* completion rings; offset */
	__le32 producer; /*  0: written by the device */
	__le32 consumer; /*  4: written by the driver */
	__le64 arm; /*  8: written by the driver (§9.1) */
	__u8 reserved[48]; /* 16 */
};

struct virtio_rdma_sge { /* offset */
	__le64 addr; /*  0: an address in the MR's address space */
	__le32 length; /*  8: bytes, may be 0 */
	__le32 lkey; /* 12 */
}; /* 16 bytes */

struct virtio_rdma_send_wqe { /* a slot of `stride` bytes; offset */
	__le64 wr_id; /*  0: returned in the completion */
	__u8 opcode; /*  8: VIRTIO_RDMA_WR_* (table below) */
	__u8 flags; /*  9: FENCE 1, SIGNALED 2, SOLICITED 4, INLINE 8 */
	__le16 count; /* 10: SGEs, or inline bytes with INLINE */
	__le32 ex; /* 12: immediate data, or a key to invalidate */
	union { /* 16: 48 bytes */
		struct { /* RDMA_WRITE*, RDMA_READ */
			__le64 remote_addr; /* 16 */
			__le32 rkey; /* 24 */
			__u8 reserved[36]; /* 28 */
		} rdma;
		struct { /* ATOMIC_* */
			__le64 remote_addr; /* 16: 8-byte aligned */
			__le64 compare_add; /* 24: compare (CMP_AND_SWP) or add (FETCH_AND_ADD) */
			__le64 swap; /* 32: CMP_AND_SWP only */
			__le32 rkey; /* 40 */
			__u8 reserved[20]; /* 44 */
		} atomic;
		struct { /* SEND* on UD and GSI QPs */
			struct virtio_rdma_av av; /* 16 (§7.5) */
			__le32 remote_qpn; /* 48 */
			__le32 remote_qkey; /* 52 */
			__u8 reserved[8]; /* 56 */
		} ud;
		struct { /* REG_MR (§7.6) */
			__le64 iova; /* 16 */
			__le64 length; /* 24 */
			__le64 page_list; /* 32: GPA of __le64 pages[npages], 8-byte aligned */
			__le32 key; /* 40: the MR's lkey with its new key byte */
			__le32 access; /* 44 */
			__le32 npages; /* 48 */
			__u8 page_shift; /* 52 */
			__u8 reserved[11]; /* 53 */
		} reg_mr;
		struct { /* BIND_MW (§7.6) */
			__le64 addr; /* 16 */
			__le64 length; /* 24 */
			__le32 mw; /* 32: the window's rkey with its new key byte */
			__le32 mr; /* 36: the lkey of the MR bound to */
			__le32 access; /* 40 */
			__u8 reserved[20]; /* 44 */
		} bind_mw;
	};
	/* 64: struct virtio_rdma_sge sge[count], or count inline bytes */
};

struct virtio_rdma_recv_wqe { /* RQ and SRQ slots of `stride` bytes; offset */
	__le64 wr_id; /*  0 */
	__le16 count; /*  8: SGEs, ≤ max_recv_sge (SRQ: max_sge) */
	__u8 reserved[6]; /* 10 */
	/* 16: struct virtio_rdma_sge sge[count] */
};

/* A CQE's opcode bit 7: its WQE was a receive queue's (spec §7.8). */
#define VIRTIO_RDMA_CQE_OPCODE_RECV 0x80

struct virtio_rdma_cqe { /* 32 bytes; offset */
	__le64 wr_id; /*  0 */
	__u8 status; /*  8: ibv_wc_status */
	__u8 opcode; /*  9: ibv_wc_opcode (table) */
	__le16 wc_flags; /* 10: GRH 1, WITH_IMM 2, WITH_INV 8 */
	__le32 qpn; /* 12: the QP the WQE belongs to */
	__le32 byte_len; /* 16 */
	__le32 ex; /* 20: immediate data (as sent) or the invalidated rkey */
	__le32 src_qp; /* 24: UD receive: the sender's QPN; send queue: WQEs retired */
	__le16 pkey_index; /* 28 */
	__u8 sl; /* 30 */
	__u8 network_hdr_type; /* 31: rdma_network_type: 2 IPv4, 3 IPv6 */
};

struct virtio_rdma_notification { /* one per notifyq buffer; offset */
	__le32 cq; /* 0: the CQ's handle */
	__le32 context; /* 4: the CQ's context */
}; /* 8 bytes */

struct virtio_rdma_event { /* one per eventq buffer; offset */
	__le32 type; /*  0: VIRTIO_RDMA_EVENT_* */
	__le32 object; /*  4: the QPN, CQ, SRQ or port; EVENTS_LOST: how many */
	__le32 context; /*  8: the object's context; 0 for port and device events */
	__le32 reserved; /* 12: 0 */
}; /* 16 bytes */

#endif /* _VIRTIO_RDMA_ABI_H */
