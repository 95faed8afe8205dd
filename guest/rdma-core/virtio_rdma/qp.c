// SPDX-License-Identifier: GPL-2.0 OR Linux-OpenIB
/*
 * virtio-rdma: queue pairs and shared receive queues. Their rings live in
 * this process's memory: a post writes WQEs (spec §7.3, §7.7) into free
 * slots, stores the producer index with release ordering and rings the
 * object's doorbell (spec §8.3). The device copies each WQE when it takes
 * it and publishes its consumer index, which says when a slot is free.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <ccan/minmax.h>
#include <util/util.h>

#include "virtio_rdma.h"

/* --- rings ---------------------------------------------------------------- */

static int vrdma_ring_lock_init(struct vrdma_ring *r)
{
	return pthread_spin_init(&r->lock, PTHREAD_PROCESS_PRIVATE);
}

/*
 * Room for one more WQE: slots before the device's consumer index are the
 * provider's again (spec §7.2). The consumer index is read (acquire) only
 * when the ring looks full by the last value read.
 */
static bool vrdma_ring_room(struct vrdma_ring *r)
{
	if (r->index - r->seen < r->entries)
		return true;
	r->seen = vrdma_load_acquire32(r->hdr + VIRTIO_RDMA_WQ_HDR_CONSUMER);
	return r->index - r->seen < r->entries;
}

/* Publishes the WQEs written: they are whole before the index moves. */
static void vrdma_ring_publish(struct vrdma_ring *r)
{
	vrdma_store_release32(r->hdr + VIRTIO_RDMA_WQ_HDR_PRODUCER, r->index);
}

/*
 * After a QP's MODIFY_QP to RESET (spec §6.27, DRV-10): the device's place
 * in the ring went back to 0, and so do both index words and ours.
 */
static void vrdma_ring_reset(struct vrdma_ring *r)
{
	if (!r->buf)
		return;
	pthread_spin_lock(&r->lock);
	vrdma_store_release32(r->hdr + VIRTIO_RDMA_WQ_HDR_CONSUMER, 0);
	vrdma_store_release32(r->hdr + VIRTIO_RDMA_WQ_HDR_PRODUCER, 0);
	r->index = 0;
	r->seen = 0;
	pthread_spin_unlock(&r->lock);
}

/*
 * Posts receive WQEs (spec §7.7) into @r, a QP's receive ring or an SRQ's,
 * with at most @max_sge SGEs each, then rings doorbell @doorbell.
 */
static int vrdma_post_recv_ring(struct vrdma_context *ctx, struct vrdma_ring *r,
				uint32_t max_sge, uint32_t doorbell,
				struct ibv_recv_wr *wr,
				struct ibv_recv_wr **bad_wr)
{
	bool posted;
	uint32_t start, i;
	int ret = 0;

	pthread_spin_lock(&r->lock);
	start = r->index;
	for (; wr; wr = wr->next) {
		struct virtio_rdma_recv_wqe *w;
		struct virtio_rdma_sge *sge;

		if (wr->num_sge < 0 || (uint32_t)wr->num_sge > max_sge) {
			ret = EINVAL;
			break;
		}
		if (!vrdma_ring_room(r)) {
			ret = ENOMEM;
			break;
		}
		w = vrdma_slot(r, r->index);
		memset(w, 0, sizeof(*w));
		w->wr_id = htole64(wr->wr_id);
		w->count = htole16(wr->num_sge);
		sge = (struct virtio_rdma_sge *)(w + 1);
		for (i = 0; i < (uint32_t)wr->num_sge; i++) {
			sge[i].addr = htole64(wr->sg_list[i].addr);
			sge[i].length = htole32(wr->sg_list[i].length);
			sge[i].lkey = htole32(wr->sg_list[i].lkey);
		}
		r->index++;
	}
	posted = r->index != start;
	if (posted)
		vrdma_ring_publish(r);
	pthread_spin_unlock(&r->lock);
	if (ret)
		*bad_wr = wr;
	if (posted)
		vrdma_ring_doorbell(ctx, doorbell);
	return ret;
}

/* --- QPs ------------------------------------------------------------------ */

/*
 * Bytes a slot needs, a power of two: the fixed part, then SGEs or inline
 * data (spec §6.5). 0 past a page, the largest stride there is.
 */
static uint32_t vrdma_stride(uint64_t bytes)
{
	bytes = roundup_pow_of_two(bytes);
	return bytes > VIRTIO_RDMA_PAGE_SIZE ? 0 : (uint32_t)bytes;
}

static uint32_t vrdma_send_stride(uint32_t max_sge, uint32_t max_inline)
{
	uint64_t sges = 16 * (uint64_t)max_t(uint32_t, max_sge, 1);

	return vrdma_stride(sizeof(struct virtio_rdma_send_wqe) +
			    max_t(uint64_t, sges, max_inline));
}

static uint32_t vrdma_recv_stride(uint32_t max_sge)
{
	return vrdma_stride(sizeof(struct virtio_rdma_recv_wqe) +
			    16 * (uint64_t)max_t(uint32_t, max_sge, 1));
}

struct ibv_qp *vrdma_create_qp(struct ibv_pd *pd,
			       struct ibv_qp_init_attr *attr)
{
	struct vrdma_context *ctx = to_vctx(pd->context);
	struct ibv_qp_cap *cap = &attr->cap;
	struct vrdma_create_qp cmd = {};
	struct vrdma_create_qp_resp resp = {};
	uint32_t sstride, rstride = 0, sentries, rentries = 0;
	size_t slen, rlen = 0;
	struct vrdma_qp *qp;
	int ret;

	switch (attr->qp_type) {
	case IBV_QPT_RC:
	case IBV_QPT_UC:
	case IBV_QPT_UD:
		break;
	default:
		errno = EOPNOTSUPP;
		return NULL;
	}
	if (cap->max_send_wr > ctx->max_qp_wr ||
	    cap->max_send_sge > ctx->max_sge ||
	    cap->max_inline_data > ctx->max_inline ||
	    (!attr->srq && (cap->max_recv_wr > ctx->max_qp_wr ||
			    cap->max_recv_sge > ctx->max_sge))) {
		errno = EINVAL;
		return NULL;
	}
	sstride = vrdma_send_stride(cap->max_send_sge, cap->max_inline_data);
	sentries = vrdma_ring_entries(cap->max_send_wr, sstride);
	if (!sstride || !sentries || sentries > ctx->max_qp_wr) {
		errno = EINVAL;
		return NULL;
	}
	slen = vrdma_page_align((size_t)sentries * sstride);
	/* A QP on an SRQ has no receive ring of its own (spec §6.26). */
	if (!attr->srq) {
		rstride = vrdma_recv_stride(cap->max_recv_sge);
		rentries = vrdma_ring_entries(cap->max_recv_wr, rstride);
		if (!rstride || !rentries || rentries > ctx->max_qp_wr) {
			errno = EINVAL;
			return NULL;
		}
		rlen = vrdma_page_align((size_t)rentries * rstride);
	}

	qp = calloc(1, sizeof(*qp));
	if (!qp) {
		errno = ENOMEM;
		return NULL;
	}
	/* The send ring's pages, the receive ring's, then the headers' page. */
	ret = vrdma_buf_alloc(&qp->mem, slen + rlen +
			      vrdma_page_align(2 * VIRTIO_RDMA_RING_HEADER_SIZE));
	if (ret)
		goto free_qp;
	qp->sq.buf = qp->mem.addr;
	qp->sq.entries = sentries;
	qp->sq.stride = sstride;
	qp->sq.hdr = (uint8_t *)qp->mem.addr + slen + rlen;
	if (!attr->srq) {
		qp->rq.buf = (uint8_t *)qp->mem.addr + slen;
		qp->rq.entries = rentries;
		qp->rq.stride = rstride;
		qp->rq.hdr = qp->sq.hdr + VIRTIO_RDMA_RING_HEADER_SIZE;
	}
	ret = vrdma_ring_lock_init(&qp->sq);
	if (ret)
		goto free_mem;
	ret = vrdma_ring_lock_init(&qp->rq);
	if (ret)
		goto destroy_sq_lock;

	vrdma_uring(&qp->sq, &cmd.sq);
	vrdma_uring(&qp->rq, &cmd.rq);
	ret = ibv_cmd_create_qp(pd, &qp->vqp.qp, attr, &cmd.ibv_cmd,
				sizeof(cmd), &resp.ibv_resp, sizeof(resp));
	if (ret)
		goto destroy_rq_lock;
	qp->doorbell = resp.doorbell;
	if (qp->doorbell >= ctx->db_bits) {
		verbs_err(verbs_get_ctx(pd->context),
			  "virtio_rdma: QP %u has doorbell %u of %u\n",
			  resp.qpn, qp->doorbell, ctx->db_bits);
		ibv_cmd_destroy_qp(&qp->vqp.qp);
		ret = EPROTO;
		goto destroy_rq_lock;
	}
	/* The capacities the device took, never past what a slot holds. */
	qp->sig_all = attr->sq_sig_all;
	qp->max_send_sge = min_t(uint32_t, cap->max_send_sge,
				 (sstride - sizeof(struct virtio_rdma_send_wqe)) / 16);
	qp->max_inline = min_t(uint32_t, cap->max_inline_data,
			       sstride - sizeof(struct virtio_rdma_send_wqe));
	if (!attr->srq)
		qp->max_recv_sge =
			min_t(uint32_t, cap->max_recv_sge,
			      (rstride - sizeof(struct virtio_rdma_recv_wqe)) / 16);
	return &qp->vqp.qp;

destroy_rq_lock:
	pthread_spin_destroy(&qp->rq.lock);
destroy_sq_lock:
	pthread_spin_destroy(&qp->sq.lock);
free_mem:
	vrdma_buf_free(&qp->mem);
free_qp:
	free(qp);
	errno = ret;
	return NULL;
}

int vrdma_modify_qp(struct ibv_qp *ibqp, struct ibv_qp_attr *attr,
		    int attr_mask)
{
	struct vrdma_qp *qp = to_vqp(ibqp);
	struct ibv_modify_qp cmd = {};
	int ret;

	ret = ibv_cmd_modify_qp(ibqp, attr, attr_mask, &cmd, sizeof(cmd));
	if (ret)
		return ret;
	if ((attr_mask & IBV_QP_STATE) && attr->qp_state == IBV_QPS_RESET) {
		vrdma_ring_reset(&qp->sq);
		vrdma_ring_reset(&qp->rq);
	}
	return 0;
}

int vrdma_query_qp(struct ibv_qp *ibqp, struct ibv_qp_attr *attr,
		   int attr_mask, struct ibv_qp_init_attr *init_attr)
{
	struct ibv_query_qp cmd = {};

	return ibv_cmd_query_qp(ibqp, attr, attr_mask, init_attr, &cmd,
				sizeof(cmd));
}

int vrdma_destroy_qp(struct ibv_qp *ibqp)
{
	struct vrdma_qp *qp = to_vqp(ibqp);
	int ret;

	/* The device reads and writes the rings no more once this returns. */
	ret = ibv_cmd_destroy_qp(ibqp);
	if (ret)
		return ret;
	pthread_spin_destroy(&qp->rq.lock);
	pthread_spin_destroy(&qp->sq.lock);
	vrdma_buf_free(&qp->mem);
	free(qp);
	return 0;
}

/* The device's opcode for @op on a QP of @type, or -1 (spec §7.3's table). */
static int vrdma_wr_opcode(enum ibv_wr_opcode op, enum ibv_qp_type type)
{
	switch (op) {
	case IBV_WR_SEND:
		return VIRTIO_RDMA_WR_SEND;
	case IBV_WR_SEND_WITH_IMM:
		return VIRTIO_RDMA_WR_SEND_WITH_IMM;
	case IBV_WR_RDMA_WRITE:
		return type == IBV_QPT_UD ? -1 : VIRTIO_RDMA_WR_RDMA_WRITE;
	case IBV_WR_RDMA_WRITE_WITH_IMM:
		return type == IBV_QPT_UD ? -1 :
		       VIRTIO_RDMA_WR_RDMA_WRITE_WITH_IMM;
	case IBV_WR_RDMA_READ:
		return type == IBV_QPT_RC ? VIRTIO_RDMA_WR_RDMA_READ : -1;
	case IBV_WR_ATOMIC_CMP_AND_SWP:
		return type == IBV_QPT_RC ? VIRTIO_RDMA_WR_ATOMIC_CMP_AND_SWP : -1;
	case IBV_WR_ATOMIC_FETCH_AND_ADD:
		return type == IBV_QPT_RC ? VIRTIO_RDMA_WR_ATOMIC_FETCH_AND_ADD : -1;
	case IBV_WR_SEND_WITH_INV:
		return type == IBV_QPT_RC ? VIRTIO_RDMA_WR_SEND_WITH_INV : -1;
	case IBV_WR_LOCAL_INV:
		/* A process has no fast-registration MR: a type 2 window. */
		return type == IBV_QPT_UD ? -1 : VIRTIO_RDMA_WR_LOCAL_INV;
	case IBV_WR_BIND_MW:
		return type == IBV_QPT_UD ? -1 : VIRTIO_RDMA_WR_BIND_MW;
	default:
		/* TSO and the rest the device does not know. */
		return -1;
	}
}

/* Writes @wr into @w, a send ring's slot of @qp's stride (spec §7.3, §7.4). */
static int vrdma_send_wqe(struct vrdma_qp *qp, const struct ibv_send_wr *wr,
			  struct virtio_rdma_send_wqe *w)
{
	enum ibv_qp_type type = qp->vqp.qp.qp_type;
	int op = vrdma_wr_opcode(wr->opcode, type);
	uint8_t flags = 0;
	uint32_t i, len;

	if (op < 0 || wr->num_sge < 0)
		return EINVAL;
	if (wr->send_flags & IBV_SEND_FENCE)
		flags |= VIRTIO_RDMA_WR_F_FENCE;
	if ((wr->send_flags & IBV_SEND_SIGNALED) || qp->sig_all)
		flags |= VIRTIO_RDMA_WR_F_SIGNALED;
	if (wr->send_flags & IBV_SEND_SOLICITED)
		flags |= VIRTIO_RDMA_WR_F_SOLICITED;
	/* The fixed part, reserved bytes zero (DRV-19); the data after it. */
	memset(w, 0, sizeof(*w));
	w->wr_id = htole64(wr->wr_id);
	w->opcode = op;
	switch (wr->opcode) {
	case IBV_WR_SEND_WITH_IMM:
	case IBV_WR_RDMA_WRITE_WITH_IMM:
		/* The immediate's bytes in memory order (verbs': big-endian). */
		memcpy(&w->ex, &wr->imm_data, sizeof(w->ex));
		break;
	case IBV_WR_SEND_WITH_INV:
	case IBV_WR_LOCAL_INV:
		w->ex = htole32(wr->invalidate_rkey);
		break;
	default:
		break;
	}
	switch (wr->opcode) {
	case IBV_WR_RDMA_WRITE:
	case IBV_WR_RDMA_WRITE_WITH_IMM:
	case IBV_WR_RDMA_READ:
		w->rdma.remote_addr = htole64(wr->wr.rdma.remote_addr);
		w->rdma.rkey = htole32(wr->wr.rdma.rkey);
		break;
	case IBV_WR_ATOMIC_CMP_AND_SWP:
	case IBV_WR_ATOMIC_FETCH_AND_ADD:
		w->atomic.remote_addr = htole64(wr->wr.atomic.remote_addr);
		w->atomic.compare_add = htole64(wr->wr.atomic.compare_add);
		w->atomic.swap = htole64(wr->wr.atomic.swap);
		w->atomic.rkey = htole32(wr->wr.atomic.rkey);
		break;
	case IBV_WR_BIND_MW: {
		const struct ibv_mw_bind_info *b = &wr->bind_mw.bind_info;

		/* No data: the window, its new key, and the MR it goes on. */
		if (b->length && !b->mr)
			return EINVAL;
		w->bind_mw.addr = htole64(b->addr);
		w->bind_mw.length = htole64(b->length);
		w->bind_mw.mw = htole32(wr->bind_mw.rkey);
		w->bind_mw.mr = htole32(b->mr ? b->mr->lkey : 0);
		/* Access bits are verbs' (spec §6.16); the device judges them. */
		w->bind_mw.access = htole32(b->mw_access_flags &
					    ~IBV_ACCESS_OPTIONAL_RANGE);
		w->flags = flags;
		return 0;
	}
	case IBV_WR_LOCAL_INV:
		w->flags = flags;
		return 0;
	case IBV_WR_SEND:
	case IBV_WR_SEND_WITH_IMM:
		if (type == IBV_QPT_UD) {
			if (!wr->wr.ud.ah)
				return EINVAL;
			w->ud.av = to_vah(wr->wr.ud.ah)->av;
			w->ud.remote_qpn = htole32(wr->wr.ud.remote_qpn);
			w->ud.remote_qkey = htole32(wr->wr.ud.remote_qkey);
		}
		break;
	default:
		break;
	}

	/* Inline data: SEND* and RDMA_WRITE* only; the others use their SGEs. */
	if ((wr->send_flags & IBV_SEND_INLINE) &&
	    (op == VIRTIO_RDMA_WR_SEND || op == VIRTIO_RDMA_WR_SEND_WITH_IMM ||
	     op == VIRTIO_RDMA_WR_SEND_WITH_INV ||
	     op == VIRTIO_RDMA_WR_RDMA_WRITE ||
	     op == VIRTIO_RDMA_WR_RDMA_WRITE_WITH_IMM)) {
		uint8_t *dst = (uint8_t *)(w + 1);

		for (i = 0, len = 0; i < (uint32_t)wr->num_sge; i++) {
			uint32_t n = wr->sg_list[i].length;

			if (n > qp->max_inline - len)
				return EINVAL;
			if (!n)
				continue;
			memcpy(dst + len, (void *)(uintptr_t)wr->sg_list[i].addr, n);
			len += n;
		}
		flags |= VIRTIO_RDMA_WR_F_INLINE;
		w->count = htole16(len);
	} else {
		struct virtio_rdma_sge *sge = (struct virtio_rdma_sge *)(w + 1);

		if ((uint32_t)wr->num_sge > qp->max_send_sge)
			return EINVAL;
		for (i = 0; i < (uint32_t)wr->num_sge; i++) {
			sge[i].addr = htole64(wr->sg_list[i].addr);
			sge[i].length = htole32(wr->sg_list[i].length);
			sge[i].lkey = htole32(wr->sg_list[i].lkey);
		}
		w->count = htole16(wr->num_sge);
	}
	w->flags = flags;
	return 0;
}

int vrdma_post_send(struct ibv_qp *ibqp, struct ibv_send_wr *wr,
		    struct ibv_send_wr **bad_wr)
{
	struct vrdma_qp *qp = to_vqp(ibqp);
	struct vrdma_ring *r = &qp->sq;
	uint32_t start;
	bool posted;
	int ret = 0;

	pthread_spin_lock(&r->lock);
	start = r->index;
	for (; wr; wr = wr->next) {
		if (!vrdma_ring_room(r)) {
			ret = ENOMEM;
			break;
		}
		ret = vrdma_send_wqe(qp, wr, vrdma_slot(r, r->index));
		if (ret)
			break;
		r->index++;
	}
	posted = r->index != start;
	if (posted)
		vrdma_ring_publish(r);
	pthread_spin_unlock(&r->lock);
	if (ret)
		*bad_wr = wr;
	if (posted)
		vrdma_ring_doorbell(to_vctx(ibqp->context), qp->doorbell);
	return ret;
}

/*
 * Binds a type 1 window (ibv_bind_mw): a BIND_MW work request on @ibqp
 * with the window's key byte moved on, so that the old key stops
 * resolving (spec §7.6); the window takes the new key once it is posted.
 * A bind of length 0 unbinds it.
 */
int vrdma_bind_mw(struct ibv_qp *ibqp, struct ibv_mw *mw,
		  struct ibv_mw_bind *mw_bind)
{
	struct ibv_send_wr wr = {}, *bad;
	int ret;

	if (mw->type != IBV_MW_TYPE_1)
		return EINVAL;
	wr.wr_id = mw_bind->wr_id;
	wr.opcode = IBV_WR_BIND_MW;
	wr.send_flags = mw_bind->send_flags;
	wr.bind_mw.mw = mw;
	wr.bind_mw.rkey = ibv_inc_rkey(mw->rkey);
	wr.bind_mw.bind_info = mw_bind->bind_info;
	ret = vrdma_post_send(ibqp, &wr, &bad);
	if (ret)
		return ret;
	mw->rkey = wr.bind_mw.rkey;
	return 0;
}

int vrdma_post_recv(struct ibv_qp *ibqp, struct ibv_recv_wr *wr,
		    struct ibv_recv_wr **bad_wr)
{
	struct vrdma_qp *qp = to_vqp(ibqp);

	/* A QP on an SRQ takes its receives from the SRQ. */
	if (!qp->rq.buf) {
		*bad_wr = wr;
		return EINVAL;
	}
	return vrdma_post_recv_ring(to_vctx(ibqp->context), &qp->rq,
				    qp->max_recv_sge, qp->doorbell, wr, bad_wr);
}

/* --- SRQs ------------------------------------------------------------------ */

struct ibv_srq *vrdma_create_srq(struct ibv_pd *pd,
				 struct ibv_srq_init_attr *attr)
{
	struct vrdma_context *ctx = to_vctx(pd->context);
	struct vrdma_create_srq cmd = {};
	struct vrdma_create_srq_resp resp = {};
	uint32_t stride, entries;
	struct vrdma_srq *srq;
	size_t len;
	int ret;

	if (attr->attr.max_wr > ctx->max_srq_wr ||
	    attr->attr.max_sge > ctx->max_srq_sge) {
		errno = EINVAL;
		return NULL;
	}
	stride = vrdma_recv_stride(attr->attr.max_sge);
	entries = vrdma_ring_entries(attr->attr.max_wr, stride);
	if (!stride || !entries || entries > ctx->max_srq_wr) {
		errno = EINVAL;
		return NULL;
	}
	len = vrdma_page_align((size_t)entries * stride);
	srq = calloc(1, sizeof(*srq));
	if (!srq) {
		errno = ENOMEM;
		return NULL;
	}
	/* The ring's pages, then a page for its header. */
	ret = vrdma_buf_alloc(&srq->mem, len +
			      vrdma_page_align(VIRTIO_RDMA_RING_HEADER_SIZE));
	if (ret)
		goto free_srq;
	srq->ring.buf = srq->mem.addr;
	srq->ring.hdr = srq->ring.buf + len;
	srq->ring.entries = entries;
	srq->ring.stride = stride;
	ret = vrdma_ring_lock_init(&srq->ring);
	if (ret)
		goto free_mem;

	vrdma_uring(&srq->ring, &cmd.ring);
	ret = ibv_cmd_create_srq(pd, &srq->vsrq.srq, attr, &cmd.ibv_cmd,
				 sizeof(cmd), &resp.ibv_resp, sizeof(resp));
	if (ret)
		goto destroy_lock;
	srq->handle = resp.srq;
	srq->doorbell = resp.doorbell;
	if (srq->doorbell >= ctx->db_bits) {
		verbs_err(verbs_get_ctx(pd->context),
			  "virtio_rdma: SRQ %u has doorbell %u of %u\n",
			  srq->handle, srq->doorbell, ctx->db_bits);
		ibv_cmd_destroy_srq(&srq->vsrq.srq);
		ret = EPROTO;
		goto destroy_lock;
	}
	srq->max_sge = min_t(uint32_t, attr->attr.max_sge,
			     (stride - sizeof(struct virtio_rdma_recv_wqe)) / 16);
	return &srq->vsrq.srq;

destroy_lock:
	pthread_spin_destroy(&srq->ring.lock);
free_mem:
	vrdma_buf_free(&srq->mem);
free_srq:
	free(srq);
	errno = ret;
	return NULL;
}

int vrdma_modify_srq(struct ibv_srq *ibsrq, struct ibv_srq_attr *attr,
		     int attr_mask)
{
	struct ibv_modify_srq cmd = {};

	return ibv_cmd_modify_srq(ibsrq, attr, attr_mask, &cmd, sizeof(cmd));
}

int vrdma_query_srq(struct ibv_srq *ibsrq, struct ibv_srq_attr *attr)
{
	struct ibv_query_srq cmd = {};

	return ibv_cmd_query_srq(ibsrq, attr, &cmd, sizeof(cmd));
}

int vrdma_destroy_srq(struct ibv_srq *ibsrq)
{
	struct vrdma_srq *srq = to_vsrq(ibsrq);
	int ret;

	ret = ibv_cmd_destroy_srq(ibsrq);
	if (ret)
		return ret;
	pthread_spin_destroy(&srq->ring.lock);
	vrdma_buf_free(&srq->mem);
	free(srq);
	return 0;
}

int vrdma_post_srq_recv(struct ibv_srq *ibsrq, struct ibv_recv_wr *wr,
			struct ibv_recv_wr **bad_wr)
{
	struct vrdma_srq *srq = to_vsrq(ibsrq);

	return vrdma_post_recv_ring(to_vctx(ibsrq->context), &srq->ring,
				    srq->max_sge, srq->doorbell, wr, bad_wr);
}
