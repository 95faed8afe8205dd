// SPDX-License-Identifier: GPL-2.0 OR Linux-OpenIB
/*
 * virtio-rdma: completion queues. The device writes CQEs (spec §7.8) into
 * a ring in this process's memory and publishes its producer index; poll
 * reads them and publishes the consumer index. Arming (spec §9.1) is a
 * store of the arm word and the CQ's doorbell; the notification reaches
 * the completion channel through the kernel. Extended CQs (ibv_cq_ex) poll
 * the same ring through start_poll/next_poll/end_poll.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "virtio_rdma.h"

/* A CQE's flags as verbs' (spec §7.8): WITH_IMM and WITH_INV never both. */
static unsigned int vrdma_wc_flags(uint16_t flags)
{
	unsigned int f = 0;

	if (flags & VIRTIO_RDMA_WC_F_GRH)
		f |= IBV_WC_GRH;
	if (flags & VIRTIO_RDMA_WC_F_WITH_IMM)
		f |= IBV_WC_WITH_IMM;
	else if (flags & VIRTIO_RDMA_WC_F_WITH_INV)
		f |= IBV_WC_WITH_INV;
	return f;
}

/* @qp completes its receive queue (or, with @send, its send queue) here. */
void vrdma_cq_add_qp(struct vrdma_cq *cq, struct vrdma_qp *qp, bool send)
{
	uint32_t b = qp->vqp.qp.qp_num % VRDMA_CQ_QP_BUCKETS;

	pthread_spin_lock(&cq->ring.lock);
	if (send)
		list_add_tail(&cq->sqps[b], &qp->scq_entry);
	else
		list_add_tail(&cq->rqps[b], &qp->rcq_entry);
	pthread_spin_unlock(&cq->ring.lock);
}

void vrdma_cq_del_qp(struct vrdma_cq *cq, struct vrdma_qp *qp, bool send)
{
	pthread_spin_lock(&cq->ring.lock);
	list_del(send ? &qp->scq_entry : &qp->rcq_entry);
	pthread_spin_unlock(&cq->ring.lock);
}

/*
 * A CQE polled (under the ring's lock) retires its QP's WQEs: a
 * receive's completion, success or error (the device writes RECV or
 * RECV_RDMA_WITH_IMM for every receive WQE's completion, spec §7.8), one
 * outstanding receive; a send queue's, every send WQE up to the count it
 * carries.
 */
static void vrdma_cq_retire(struct vrdma_cq *cq,
			    const struct virtio_rdma_cqe *c)
{
	uint32_t qpn = le32toh(c->qpn);
	uint32_t b = qpn % VRDMA_CQ_QP_BUCKETS;
	struct vrdma_qp *qp;

	if (!(c->opcode & VIRTIO_RDMA_CQE_OPCODE_RECV)) {
		list_for_each(&cq->sqps[b], qp, scq_entry) {
			if (qp->vqp.qp.qp_num != qpn)
				continue;
			atomic_store_explicit(&qp->sq_seen,
					      le32toh(c->src_qp),
					      memory_order_relaxed);
			return;
		}
		return;
	}
	list_for_each(&cq->rqps[b], qp, rcq_entry) {
		if (qp->vqp.qp.qp_num != qpn)
			continue;
		if (atomic_load_explicit(&qp->rq_out, memory_order_relaxed))
			atomic_fetch_sub_explicit(&qp->rq_out, 1,
						  memory_order_relaxed);
		return;
	}
}

/*
 * A CQ's memory for @cqe completions (one slot more than asked: the
 * kernel driver keeps one free), its ring and lock; errno on failure.
 */
static struct vrdma_cq *vrdma_cq_alloc(struct vrdma_context *ctx, int cqe)
{
	struct vrdma_ring *r;
	struct vrdma_cq *cq;
	size_t ring_len;
	uint32_t entries;
	unsigned int i;
	int ret;

	if (cqe < 1 || (uint32_t)cqe > ctx->max_cqe) {
		errno = EINVAL;
		return NULL;
	}
	entries = vrdma_ring_entries((uint32_t)cqe + 1, VRDMA_CQE_STRIDE);
	if (!entries || entries > (uint64_t)ctx->max_cqe + 1) {
		errno = EINVAL;
		return NULL;
	}
	cq = calloc(1, sizeof(*cq));
	if (!cq) {
		errno = ENOMEM;
		return NULL;
	}
	r = &cq->ring;
	r->entries = entries;
	r->stride = VRDMA_CQE_STRIDE;
	ring_len = vrdma_page_align((size_t)entries * VRDMA_CQE_STRIDE);
	/* The ring's pages, then a page for its header. */
	ret = vrdma_buf_alloc(&cq->mem, ring_len +
			      vrdma_page_align(VIRTIO_RDMA_RING_HEADER_SIZE));
	if (ret)
		goto free_cq;
	r->buf = cq->mem.addr;
	r->hdr = r->buf + ring_len;
	ret = pthread_spin_init(&r->lock, PTHREAD_PROCESS_PRIVATE);
	if (ret)
		goto free_mem;
	for (i = 0; i < VRDMA_CQ_QP_BUCKETS; i++) {
		list_head_init(&cq->rqps[i]);
		list_head_init(&cq->sqps[i]);
	}
	return cq;

free_mem:
	vrdma_buf_free(&cq->mem);
free_cq:
	free(cq);
	errno = ret;
	return NULL;
}

static void vrdma_cq_free(struct vrdma_cq *cq)
{
	pthread_spin_destroy(&cq->ring.lock);
	vrdma_buf_free(&cq->mem);
	free(cq);
}

/*
 * The driver's answer to a create: the CQ's handle and a doorbell index
 * inside the context's area, or the CQ is destroyed again.
 */
static int vrdma_cq_answer(struct vrdma_context *ctx, struct vrdma_cq *cq,
			   const struct virtio_rdma_create_cq_uresp *r)
{
	cq->handle = r->cq;
	cq->doorbell = r->doorbell;
	if (cq->doorbell < ctx->db_bits)
		return 0;
	verbs_err(&ctx->ibv_ctx, "virtio_rdma: CQ %u has doorbell %u of %u\n",
		  cq->handle, cq->doorbell, ctx->db_bits);
	ibv_cmd_destroy_cq(&cq->vcq.cq);
	return EPROTO;
}

struct ibv_cq *vrdma_create_cq(struct ibv_context *ibctx, int cqe,
			       struct ibv_comp_channel *channel,
			       int comp_vector)
{
	struct vrdma_context *ctx = to_vctx(ibctx);
	struct vrdma_create_cq cmd = {};
	struct vrdma_create_cq_resp resp = {};
	struct vrdma_cq *cq;
	int ret;

	cq = vrdma_cq_alloc(ctx, cqe);
	if (!cq)
		return NULL;
	vrdma_uring(&cq->ring, &cmd.ring);
	ret = ibv_cmd_create_cq(ibctx, cqe, channel, comp_vector, &cq->vcq.cq,
				&cmd.ibv_cmd, sizeof(cmd), &resp.ibv_resp,
				sizeof(resp));
	if (!ret)
		ret = vrdma_cq_answer(ctx, cq, &resp.drv_payload);
	if (ret) {
		vrdma_cq_free(cq);
		errno = ret;
		return NULL;
	}
	return &cq->vcq.cq;
}

/* --- extended CQs: the ibv_cq_ex polling interface ----------------------- */

/* The CQE at the consumer index, copied; the index moves past it. */
static void vrdma_cq_take(struct vrdma_cq *cq)
{
	struct vrdma_ring *r = &cq->ring;

	memcpy(&cq->cur, vrdma_slot(r, r->index), sizeof(cq->cur));
	r->index++;
	vrdma_cq_retire(cq, &cq->cur);
	cq->vcq.cq_ex.wr_id = le64toh(cq->cur.wr_id);
	cq->vcq.cq_ex.status = cq->cur.status <= IBV_WC_GENERAL_ERR ?
			       (enum ibv_wc_status)cq->cur.status :
			       IBV_WC_GENERAL_ERR;
}

/*
 * The ring's lock is held from a successful start_poll to end_poll, as
 * the interface allows; the consumer index is published at end_poll, the
 * CQEs read having been copied out.
 */
static int vrdma_start_poll(struct ibv_cq_ex *ibcq,
			    struct ibv_poll_cq_attr *attr)
{
	struct vrdma_cq *cq = to_vcq(ibv_cq_ex_to_cq(ibcq));
	struct vrdma_ring *r = &cq->ring;

	if (attr->comp_mask)
		return EINVAL;
	pthread_spin_lock(&r->lock);
	cq->prod = vrdma_load_acquire32(r->hdr + VIRTIO_RDMA_CQ_PRODUCER);
	if (cq->prod == r->index) {
		pthread_spin_unlock(&r->lock);
		return ENOENT;
	}
	vrdma_cq_take(cq);
	return 0;
}

static int vrdma_next_poll(struct ibv_cq_ex *ibcq)
{
	struct vrdma_cq *cq = to_vcq(ibv_cq_ex_to_cq(ibcq));
	struct vrdma_ring *r = &cq->ring;

	if (cq->prod == r->index) {
		cq->prod = vrdma_load_acquire32(r->hdr + VIRTIO_RDMA_CQ_PRODUCER);
		if (cq->prod == r->index)
			return ENOENT;
	}
	vrdma_cq_take(cq);
	return 0;
}

static void vrdma_end_poll(struct ibv_cq_ex *ibcq)
{
	struct vrdma_ring *r = &to_vcq(ibv_cq_ex_to_cq(ibcq))->ring;

	vrdma_store_release32(r->hdr + VIRTIO_RDMA_CQ_CONSUMER, r->index);
	pthread_spin_unlock(&r->lock);
}

static inline const struct virtio_rdma_cqe *vrdma_cur(struct ibv_cq_ex *ibcq)
{
	return &to_vcq(ibv_cq_ex_to_cq(ibcq))->cur;
}

static enum ibv_wc_opcode vrdma_read_opcode(struct ibv_cq_ex *ibcq)
{
	/* Spec §7.8: the device's opcodes are verbs'. */
	return (enum ibv_wc_opcode)vrdma_cur(ibcq)->opcode;
}

static uint32_t vrdma_read_vendor_err(struct ibv_cq_ex *ibcq)
{
	return 0;
}

static uint32_t vrdma_read_byte_len(struct ibv_cq_ex *ibcq)
{
	return le32toh(vrdma_cur(ibcq)->byte_len);
}

/*
 * The immediate's bytes as sent (verbs keeps them big-endian), or the
 * invalidated rkey, which ibv_wc_read_invalidated_rkey reads from here
 * in big-endian order.
 */
static __be32 vrdma_read_imm_data(struct ibv_cq_ex *ibcq)
{
	const struct virtio_rdma_cqe *c = vrdma_cur(ibcq);
	__be32 imm;

	if (le16toh(c->wc_flags) & VIRTIO_RDMA_WC_F_WITH_INV)
		return htobe32(le32toh(c->ex));
	memcpy(&imm, &c->ex, sizeof(imm));
	return imm;
}

static uint32_t vrdma_read_qp_num(struct ibv_cq_ex *ibcq)
{
	return le32toh(vrdma_cur(ibcq)->qpn);
}

static uint32_t vrdma_read_src_qp(struct ibv_cq_ex *ibcq)
{
	const struct virtio_rdma_cqe *c = vrdma_cur(ibcq);

	/* A send queue's CQE has its count of retired WQEs there. */
	return c->opcode & VIRTIO_RDMA_CQE_OPCODE_RECV ? le32toh(c->src_qp) : 0;
}

static unsigned int vrdma_read_wc_flags(struct ibv_cq_ex *ibcq)
{
	return vrdma_wc_flags(le16toh(vrdma_cur(ibcq)->wc_flags));
}

static uint32_t vrdma_read_slid(struct ibv_cq_ex *ibcq)
{
	return 0;
}

static uint8_t vrdma_read_sl(struct ibv_cq_ex *ibcq)
{
	return vrdma_cur(ibcq)->sl;
}

static uint8_t vrdma_read_dlid_path_bits(struct ibv_cq_ex *ibcq)
{
	return 0;
}

/* What a CQE holds; timestamps, flow tags and the rest it does not. */
#define VRDMA_CQ_EX_WC_FLAGS IBV_WC_STANDARD_FLAGS

struct ibv_cq_ex *vrdma_create_cq_ex(struct ibv_context *ibctx,
				     struct ibv_cq_init_attr_ex *attr)
{
	struct vrdma_context *ctx = to_vctx(ibctx);
	struct vrdma_create_cq_ex cmd = {};
	struct vrdma_create_cq_ex_resp resp = {};
	struct ibv_cq_ex *ex;
	struct vrdma_cq *cq;
	int ret;

	/* No parent domain, no CQ creation flag (timestamps, single thread). */
	if ((attr->wc_flags & ~(uint64_t)VRDMA_CQ_EX_WC_FLAGS) ||
	    (attr->comp_mask & ~IBV_CQ_INIT_ATTR_MASK_FLAGS) ||
	    ((attr->comp_mask & IBV_CQ_INIT_ATTR_MASK_FLAGS) && attr->flags)) {
		errno = EOPNOTSUPP;
		return NULL;
	}
	if (attr->cqe > INT32_MAX) {
		errno = EINVAL;
		return NULL;
	}
	cq = vrdma_cq_alloc(ctx, (int)attr->cqe);
	if (!cq)
		return NULL;
	vrdma_uring(&cq->ring, &cmd.ring);
	ret = ibv_cmd_create_cq_ex(ibctx, attr, &cq->vcq, &cmd.ibv_cmd,
				   sizeof(cmd), &resp.ibv_resp, sizeof(resp), 0);
	if (!ret)
		ret = vrdma_cq_answer(ctx, cq, &resp.drv_payload);
	if (ret) {
		vrdma_cq_free(cq);
		errno = ret;
		return NULL;
	}
	ex = &cq->vcq.cq_ex;
	ex->start_poll = vrdma_start_poll;
	ex->next_poll = vrdma_next_poll;
	ex->end_poll = vrdma_end_poll;
	ex->read_opcode = vrdma_read_opcode;
	ex->read_vendor_err = vrdma_read_vendor_err;
	ex->read_wc_flags = vrdma_read_wc_flags;
	if (attr->wc_flags & IBV_WC_EX_WITH_BYTE_LEN)
		ex->read_byte_len = vrdma_read_byte_len;
	if (attr->wc_flags & IBV_WC_EX_WITH_IMM)
		ex->read_imm_data = vrdma_read_imm_data;
	if (attr->wc_flags & IBV_WC_EX_WITH_QP_NUM)
		ex->read_qp_num = vrdma_read_qp_num;
	if (attr->wc_flags & IBV_WC_EX_WITH_SRC_QP)
		ex->read_src_qp = vrdma_read_src_qp;
	if (attr->wc_flags & IBV_WC_EX_WITH_SLID)
		ex->read_slid = vrdma_read_slid;
	if (attr->wc_flags & IBV_WC_EX_WITH_SL)
		ex->read_sl = vrdma_read_sl;
	if (attr->wc_flags & IBV_WC_EX_WITH_DLID_PATH_BITS)
		ex->read_dlid_path_bits = vrdma_read_dlid_path_bits;
	return ex;
}

/*
 * Resizes the CQ (spec §6.15) onto a new ring in new memory: the device
 * moves the completions the old ring holds into the new one's first
 * entries. Polling and arming wait on the ring's lock meanwhile; after,
 * the consumer index starts again at 0 and the old memory goes.
 */
int vrdma_resize_cq(struct ibv_cq *ibcq, int cqe)
{
	struct vrdma_context *ctx = to_vctx(ibcq->context);
	struct vrdma_cq *cq = to_vcq(ibcq);
	struct vrdma_resize_cq cmd = {};
	struct vrdma_resize_cq_resp resp = {};
	struct vrdma_ring *r = &cq->ring;
	struct vrdma_ring next = {};
	struct vrdma_buf mem, old;
	size_t ring_len;
	uint32_t entries;
	int ret;

	if (cqe < 1 || (uint32_t)cqe > ctx->max_cqe)
		return EINVAL;
	entries = vrdma_ring_entries((uint32_t)cqe + 1, VRDMA_CQE_STRIDE);
	if (!entries || entries > (uint64_t)ctx->max_cqe + 1)
		return EINVAL;
	ring_len = vrdma_page_align((size_t)entries * VRDMA_CQE_STRIDE);
	ret = vrdma_buf_alloc(&mem, ring_len +
			      vrdma_page_align(VIRTIO_RDMA_RING_HEADER_SIZE));
	if (ret)
		return ret;
	next.buf = mem.addr;
	next.hdr = next.buf + ring_len;
	next.entries = entries;
	next.stride = VRDMA_CQE_STRIDE;
	vrdma_uring(&next, &cmd.ring);

	pthread_spin_lock(&r->lock);
	ret = ibv_cmd_resize_cq(ibcq, cqe, &cmd.ibv_cmd, sizeof(cmd),
				&resp.ibv_resp, sizeof(resp));
	if (!ret) {
		old = cq->mem;
		cq->mem = mem;
		mem = old;
		r->buf = next.buf;
		r->hdr = next.hdr;
		r->entries = next.entries;
		r->index = 0;
	}
	pthread_spin_unlock(&r->lock);
	vrdma_buf_free(&mem);
	return ret;
}

int vrdma_destroy_cq(struct ibv_cq *ibcq)
{
	struct vrdma_cq *cq = to_vcq(ibcq);
	int ret;

	/* The device touches the ring no more once this returns. */
	ret = ibv_cmd_destroy_cq(ibcq);
	if (ret)
		return ret;
	vrdma_cq_free(cq);
	return 0;
}

/* A CQE as verbs gives it (spec §7.8: the opcodes and statuses are verbs'). */
static void vrdma_wc(const struct virtio_rdma_cqe *c, struct ibv_wc *wc)
{
	uint16_t flags = le16toh(c->wc_flags);

	wc->wr_id = le64toh(c->wr_id);
	wc->status = c->status <= IBV_WC_GENERAL_ERR ?
		     (enum ibv_wc_status)c->status : IBV_WC_GENERAL_ERR;
	wc->opcode = (enum ibv_wc_opcode)c->opcode;
	wc->vendor_err = 0;
	wc->byte_len = le32toh(c->byte_len);
	wc->qp_num = le32toh(c->qpn);
	/* A send queue's CQE has its count of retired WQEs there. */
	wc->src_qp = c->opcode & VIRTIO_RDMA_CQE_OPCODE_RECV ?
		     le32toh(c->src_qp) : 0;
	wc->wc_flags = vrdma_wc_flags(flags);
	wc->imm_data = 0;
	wc->pkey_index = le16toh(c->pkey_index);
	wc->slid = 0;
	wc->sl = c->sl;
	wc->dlid_path_bits = 0;
	if (flags & VIRTIO_RDMA_WC_F_WITH_IMM)
		/* The immediate's bytes as sent: verbs keeps them big-endian. */
		memcpy(&wc->imm_data, &c->ex, sizeof(wc->imm_data));
	else if (flags & VIRTIO_RDMA_WC_F_WITH_INV)
		wc->invalidated_rkey = le32toh(c->ex);
}

int vrdma_poll_cq(struct ibv_cq *ibcq, int ne, struct ibv_wc *wc)
{
	struct vrdma_ring *r = &to_vcq(ibcq)->ring;
	struct virtio_rdma_cqe c;
	uint32_t prod;
	int n = 0;

	pthread_spin_lock(&r->lock);
	/* The CQEs before the producer index are whole once it is read. */
	prod = vrdma_load_acquire32(r->hdr + VIRTIO_RDMA_CQ_PRODUCER);
	while (n < ne && prod != r->index) {
		memcpy(&c, vrdma_slot(r, r->index), sizeof(c));
		vrdma_cq_retire(to_vcq(ibcq), &c);
		vrdma_wc(&c, &wc[n++]);
		r->index++;
	}
	/* The slots are read before the device may write them again. */
	if (n)
		vrdma_store_release32(r->hdr + VIRTIO_RDMA_CQ_CONSUMER, r->index);
	pthread_spin_unlock(&r->lock);
	return n;
}

/*
 * Arms the CQ (spec §9.1), as the kernel driver does: the consumer index
 * it has reached (the snapshot), the mode and a sequence number other than
 * the last arm's, stored with release ordering, then the CQ's doorbell.
 * The device notifies at once if a wanted completion is already past the
 * snapshot, so nothing written before the arm is missed.
 */
int vrdma_req_notify_cq(struct ibv_cq *ibcq, int solicited_only)
{
	struct vrdma_cq *cq = to_vcq(ibcq);
	struct vrdma_ring *r = &cq->ring;
	uint64_t mode = solicited_only ? VIRTIO_RDMA_CQ_ARM_SOLICITED :
					 VIRTIO_RDMA_CQ_ARM_NEXT;
	uint64_t word;

	pthread_spin_lock(&r->lock);
	cq->arm_seq = (cq->arm_seq + 1) & ((1U << 30) - 1);
	word = (uint64_t)r->index | mode << 32 | (uint64_t)cq->arm_seq << 34;
	vrdma_store_release64(r->hdr + VIRTIO_RDMA_CQ_ARM, word);
	pthread_spin_unlock(&r->lock);
	vrdma_ring_doorbell(to_vctx(ibcq->context), cq->doorbell);
	return 0;
}
