/* SPDX-License-Identifier: GPL-2.0 OR Linux-OpenIB */
/*
 * virtio-rdma: the rdma-core provider's private state.
 *
 * The device (docs/virtio-rdma.md) reads work from rings in this process's
 * memory and writes completions into rings here too; the kernel driver
 * (guest/linux/virtio_rdma) only pins them and names them to the device.
 * Posting and polling are loads and stores on those rings, and a doorbell
 * is a few atomic ORs on the context's doorbell area, mapped from the
 * driver (spec §8.7): no system call, except the kick when the device is
 * not polling.
 */
#ifndef __VIRTIO_RDMA_H__
#define __VIRTIO_RDMA_H__

#include <endian.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <ccan/list.h>
#include <infiniband/driver.h>
#include <infiniband/kern-abi.h>
#include <rdma/virtio_rdma_abi.h>
#include <rdma/virtio_rdma_user.h>
#include <kernel-abi/virtio_rdma_user.h>
#include <util/udma_barrier.h>

DECLARE_DRV_CMD(vrdma_alloc_ucontext, IB_USER_VERBS_CMD_GET_CONTEXT,
		empty, virtio_rdma_alloc_ucontext_resp);
DECLARE_DRV_CMD(vrdma_create_cq, IB_USER_VERBS_CMD_CREATE_CQ,
		virtio_rdma_create_cq_ureq, virtio_rdma_create_cq_uresp);
DECLARE_DRV_CMD(vrdma_create_cq_ex, IB_USER_VERBS_EX_CMD_CREATE_CQ,
		virtio_rdma_create_cq_ureq, virtio_rdma_create_cq_uresp);
DECLARE_DRV_CMD(vrdma_resize_cq, IB_USER_VERBS_CMD_RESIZE_CQ,
		virtio_rdma_resize_cq_ureq, empty);
DECLARE_DRV_CMD(vrdma_create_qp, IB_USER_VERBS_CMD_CREATE_QP,
		virtio_rdma_create_qp_ureq, virtio_rdma_create_qp_uresp);
DECLARE_DRV_CMD(vrdma_create_srq, IB_USER_VERBS_CMD_CREATE_SRQ,
		virtio_rdma_create_srq_ureq, virtio_rdma_create_srq_uresp);
DECLARE_DRV_CMD(vrdma_create_ah, IB_USER_VERBS_CMD_CREATE_AH,
		empty, virtio_rdma_create_ah_uresp);

/* Buckets of a CQ's table of receiving QPs (QPNs are handed out in turn). */
#define VRDMA_CQ_QP_BUCKETS 64

/* A slot of a CQ ring: one CQE (spec §6.5). */
#define VRDMA_CQE_STRIDE 32

struct vrdma_device {
	struct verbs_device ibv_dev;
};

struct vrdma_context {
	struct verbs_context ibv_ctx;
	/* The doorbell area (spec §8.1), shared with the device. */
	uint8_t *db;
	size_t db_size;
	uint32_t db_bits;
	uint32_t flags; /* VIRTIO_RDMA_UCTX_* */
	/* The device's limits, for sizing rings. */
	uint32_t max_inline;
	uint32_t max_qp_wr;
	uint32_t max_sge;
	uint32_t max_cqe;
	uint32_t max_srq_wr;
	uint32_t max_srq_sge;
	/* A kick failed once: said once. */
	atomic_bool kick_failed;
};

/*
 * Page-aligned, zeroed memory holding an object's rings and, on a page of
 * its own after them, their 64-byte headers (spec §6.5: a header never
 * lies in a ring's pages).
 */
struct vrdma_buf {
	void *addr;
	size_t len;
};

struct vrdma_ring {
	uint8_t *buf;
	uint8_t *hdr;
	uint32_t entries; /* a power of two */
	uint32_t stride; /* a power of two */
	/* The provider's index: producer (work rings) or consumer (CQ). */
	uint32_t index;
	/* Work rings: the device's consumer index as last read. */
	uint32_t seen;
	pthread_spinlock_t lock;
};

struct vrdma_cq {
	struct verbs_cq vcq;
	struct vrdma_buf mem;
	struct vrdma_ring ring;
	uint32_t handle;
	uint32_t doorbell;
	/* The last arm's sequence number (spec §9.1), under ring.lock. */
	uint32_t arm_seq;
	/*
	 * Extended polling (start_poll to end_poll, under ring.lock): the
	 * CQE being read, copied, and the producer index last read.
	 */
	struct virtio_rdma_cqe cur;
	uint32_t prod;
	/*
	 * The QPs whose own receive ring completes here, and those whose send
	 * ring does, hashed by QPN (under ring.lock): a completion retires
	 * its QP's outstanding WQEs, found without walking every QP of a busy
	 * CQ.
	 */
	struct list_head rqps[VRDMA_CQ_QP_BUCKETS];
	struct list_head sqps[VRDMA_CQ_QP_BUCKETS];
};

struct vrdma_qp {
	struct verbs_qp vqp;
	struct vrdma_buf mem;
	struct vrdma_ring sq;
	struct vrdma_ring rq; /* no buf on an SRQ */
	uint32_t doorbell;
	uint32_t max_send_sge;
	uint32_t max_recv_sge;
	uint32_t max_inline;
	bool sig_all;
	/*
	 * Verbs' rule for the receive queue: at most max_recv_wr receives
	 * outstanding (posted, not completed). The device gives a slot back
	 * when it copies the WQE (spec §7.2), so they are counted here: up by
	 * post_recv, down by the receive completions polled from rcq.
	 */
	struct vrdma_cq *rcq; /* NULL on an SRQ */
	struct list_node rcq_entry;
	uint32_t max_recv_wr;
	_Atomic(uint32_t) rq_out;
	/*
	 * And for the send queue, at most max_send_wr outstanding: posted
	 * since RESET (sq.index) less those retired. Each send completion
	 * says how many have retired (spec §7.8); the poller leaves the
	 * latest in sq_seen and a post takes it into sq_done, under sq.lock,
	 * if it is no more than was posted (a completion from before a RESET
	 * can say more).
	 */
	struct vrdma_cq *scq;
	struct list_node scq_entry;
	uint32_t max_send_wr;
	_Atomic(uint32_t) sq_seen;
	uint32_t sq_done;
	/* A batch of the ibv_wr_* interface, under sq.lock. */
	uint32_t wr_first; /* the producer index at wr_start */
	int wr_err; /* the first refusal, reported by wr_complete */
	struct virtio_rdma_send_wqe *wr_cur; /* the WQE data goes into */
};

struct vrdma_srq {
	struct verbs_srq vsrq;
	struct vrdma_buf mem;
	struct vrdma_ring ring;
	uint32_t handle;
	uint32_t doorbell;
	uint32_t max_sge;
};

struct vrdma_ah {
	struct ibv_ah ibv_ah;
	struct virtio_rdma_av av;
};

static inline struct vrdma_context *to_vctx(struct ibv_context *ibctx)
{
	return container_of(ibctx, struct vrdma_context, ibv_ctx.context);
}

static inline struct vrdma_cq *to_vcq(struct ibv_cq *ibcq)
{
	return container_of(ibcq, struct vrdma_cq, vcq.cq);
}

static inline struct vrdma_qp *to_vqp(struct ibv_qp *ibqp)
{
	return container_of(ibqp, struct vrdma_qp, vqp.qp);
}

static inline struct vrdma_srq *to_vsrq(struct ibv_srq *ibsrq)
{
	return container_of(ibsrq, struct vrdma_srq, vsrq.srq);
}

static inline struct vrdma_ah *to_vah(struct ibv_ah *ibah)
{
	return container_of(ibah, struct vrdma_ah, ibv_ah);
}

/*
 * Index words are single aligned 32-bit loads and stores, the arm word a
 * single 64-bit store, with the orderings of spec §7.1; all little-endian.
 * Ordered for any device, not only for this host's CPUs: rdma-core's
 * barriers for memory a device reads and writes (util/udma_barrier.h)
 * beside the C11 orderings between threads.
 */
static inline uint32_t vrdma_load_acquire32(void *p)
{
	uint32_t v = le32toh(atomic_load_explicit((_Atomic(uint32_t) *)p,
						  memory_order_acquire));

	/* The entries before the index, as the device wrote them. */
	udma_from_device_barrier();
	return v;
}

static inline void vrdma_store_release32(void *p, uint32_t v)
{
	/* The entries before the index are the device's to read or reuse. */
	udma_to_device_barrier();
	atomic_store_explicit((_Atomic(uint32_t) *)p, htole32(v),
			      memory_order_release);
}

static inline void vrdma_store_release64(void *p, uint64_t v)
{
	udma_to_device_barrier();
	atomic_store_explicit((_Atomic(uint64_t) *)p, htole64(v),
			      memory_order_release);
}

static inline void *vrdma_slot(const struct vrdma_ring *r, uint32_t index)
{
	return r->buf + (size_t)(index & (r->entries - 1)) * r->stride;
}

/* virtio_rdma.c */
void vrdma_ring_doorbell(struct vrdma_context *ctx, uint32_t index);
int vrdma_buf_alloc(struct vrdma_buf *b, size_t len);
void vrdma_buf_free(struct vrdma_buf *b);
size_t vrdma_page_align(size_t len);
uint32_t vrdma_ring_entries(uint32_t want, uint32_t stride);
void vrdma_uring(const struct vrdma_ring *r, struct virtio_rdma_uring *u);

/* cq.c */
void vrdma_cq_add_qp(struct vrdma_cq *cq, struct vrdma_qp *qp, bool send);
void vrdma_cq_del_qp(struct vrdma_cq *cq, struct vrdma_qp *qp, bool send);
struct ibv_cq *vrdma_create_cq(struct ibv_context *ibctx, int cqe,
			       struct ibv_comp_channel *channel,
			       int comp_vector);
int vrdma_poll_cq(struct ibv_cq *ibcq, int ne, struct ibv_wc *wc);
int vrdma_req_notify_cq(struct ibv_cq *ibcq, int solicited_only);
struct ibv_cq_ex *vrdma_create_cq_ex(struct ibv_context *ibctx,
				     struct ibv_cq_init_attr_ex *attr);
int vrdma_resize_cq(struct ibv_cq *ibcq, int cqe);
int vrdma_destroy_cq(struct ibv_cq *ibcq);

/* qp.c */
struct ibv_qp *vrdma_create_qp(struct ibv_pd *pd,
			       struct ibv_qp_init_attr *attr);
struct ibv_qp *vrdma_create_qp_ex(struct ibv_context *ibctx,
				  struct ibv_qp_init_attr_ex *attr);
int vrdma_modify_qp(struct ibv_qp *ibqp, struct ibv_qp_attr *attr,
		    int attr_mask);
int vrdma_query_qp(struct ibv_qp *ibqp, struct ibv_qp_attr *attr,
		   int attr_mask, struct ibv_qp_init_attr *init_attr);
int vrdma_destroy_qp(struct ibv_qp *ibqp);
int vrdma_post_send(struct ibv_qp *ibqp, struct ibv_send_wr *wr,
		    struct ibv_send_wr **bad_wr);
int vrdma_post_recv(struct ibv_qp *ibqp, struct ibv_recv_wr *wr,
		    struct ibv_recv_wr **bad_wr);
int vrdma_bind_mw(struct ibv_qp *ibqp, struct ibv_mw *mw,
		  struct ibv_mw_bind *mw_bind);
struct ibv_srq *vrdma_create_srq(struct ibv_pd *pd,
				 struct ibv_srq_init_attr *attr);
int vrdma_modify_srq(struct ibv_srq *ibsrq, struct ibv_srq_attr *attr,
		     int attr_mask);
int vrdma_query_srq(struct ibv_srq *ibsrq, struct ibv_srq_attr *attr);
int vrdma_destroy_srq(struct ibv_srq *ibsrq);
int vrdma_post_srq_recv(struct ibv_srq *ibsrq, struct ibv_recv_wr *wr,
			struct ibv_recv_wr **bad_wr);

#endif /* __VIRTIO_RDMA_H__ */
