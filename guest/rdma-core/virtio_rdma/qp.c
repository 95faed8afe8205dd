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
				_Atomic(uint32_t) *out, uint32_t max,
				struct ibv_recv_wr *wr,
				struct ibv_recv_wr **bad_wr)
{
	uint32_t start, i, held = 0;
	bool posted;
	int ret = 0;

	pthread_spin_lock(&r->lock);
	start = r->index;
	if (out)
		held = atomic_load_explicit(out, memory_order_relaxed);
	for (; wr; wr = wr->next) {
		struct virtio_rdma_recv_wqe *w;
		struct virtio_rdma_sge *sge;

		if (wr->num_sge < 0 || (uint32_t)wr->num_sge > max_sge) {
			ret = EINVAL;
			break;
		}
		if ((out && held + (r->index - start) >= max) ||
		    !vrdma_ring_room(r)) {
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
	if (posted) {
		if (out)
			atomic_fetch_add_explicit(out, r->index - start,
						  memory_order_relaxed);
		vrdma_ring_publish(r);
	}
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

static void vrdma_qp_ex_init(struct vrdma_qp *qp);

/* The operations a QP of @type takes (spec §7.3's table). */
static uint64_t vrdma_send_ops(enum ibv_qp_type type)
{
	uint64_t ops = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM;

	if (type == IBV_QPT_UD)
		return ops;
	ops |= IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM |
	       IBV_QP_EX_WITH_LOCAL_INV | IBV_QP_EX_WITH_BIND_MW;
	if (type == IBV_QPT_UC)
		return ops;
	return ops | IBV_QP_EX_WITH_RDMA_READ |
	       IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP |
	       IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD |
	       IBV_QP_EX_WITH_SEND_WITH_INV;
}

struct ibv_qp *vrdma_create_qp(struct ibv_pd *pd,
			       struct ibv_qp_init_attr *attr)
{
	struct ibv_qp_init_attr_ex ex = {};
	struct ibv_qp *qp;

	/* The legacy attributes are the extended ones' first fields. */
	memcpy(&ex, attr, sizeof(*attr));
	ex.comp_mask = IBV_QP_INIT_ATTR_PD;
	ex.pd = pd;
	qp = vrdma_create_qp_ex(pd->context, &ex);
	if (qp)
		memcpy(attr, &ex, sizeof(*attr));
	return qp;
}

struct ibv_qp *vrdma_create_qp_ex(struct ibv_context *ibctx,
				  struct ibv_qp_init_attr_ex *attr)
{
	struct vrdma_context *ctx = to_vctx(ibctx);
	struct ibv_qp_cap *cap = &attr->cap;
	struct ibv_pd *pd = attr->pd;
	struct vrdma_create_qp cmd = {};
	uint32_t mask;
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
	/* No XRC, RSS, TSO or creation flags; the ibv_wr_* interface. */
	if ((attr->comp_mask & ~(uint64_t)(IBV_QP_INIT_ATTR_PD |
					   IBV_QP_INIT_ATTR_CREATE_FLAGS |
					   IBV_QP_INIT_ATTR_SEND_OPS_FLAGS)) ||
	    ((attr->comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS) &&
	     attr->create_flags) ||
	    ((attr->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) &&
	     (attr->send_ops_flags & ~vrdma_send_ops(attr->qp_type)))) {
		errno = EOPNOTSUPP;
		return NULL;
	}
	if (!(attr->comp_mask & IBV_QP_INIT_ATTR_PD) || !pd) {
		errno = EINVAL;
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
	atomic_init(&qp->rq_out, 0);
	atomic_init(&qp->sq_seen, 0);
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
	/*
	 * No creation flag was asked (above): the command that carries none
	 * takes the attributes without their mask bit.
	 */
	mask = attr->comp_mask;
	attr->comp_mask &= ~(uint64_t)IBV_QP_INIT_ATTR_CREATE_FLAGS;
	ret = ibv_cmd_create_qp_ex(ibctx, &qp->vqp, attr, &cmd.ibv_cmd,
				   sizeof(cmd), &resp.ibv_resp, sizeof(resp));
	attr->comp_mask = mask;
	if (ret)
		goto destroy_rq_lock;
	qp->doorbell = resp.doorbell;
	if (qp->doorbell >= ctx->db_bits) {
		verbs_err(&ctx->ibv_ctx,
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
	if (attr->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS)
		vrdma_qp_ex_init(qp);
	/* The device's answers (ibv_cmd_create_qp_ex wrote them back). */
	qp->max_send_wr = cap->max_send_wr;
	qp->scq = to_vcq(attr->send_cq);
	vrdma_cq_add_qp(qp->scq, qp, true);
	if (!attr->srq) {
		qp->max_recv_wr = cap->max_recv_wr;
		qp->rcq = to_vcq(attr->recv_cq);
		vrdma_cq_add_qp(qp->rcq, qp, false);
	}
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
		pthread_spin_lock(&qp->sq.lock);
		/* Counted again from 0, as the device counts (spec §7.8). */
		qp->sq_done = 0;
		atomic_store_explicit(&qp->sq_seen, 0, memory_order_relaxed);
		pthread_spin_unlock(&qp->sq.lock);
		vrdma_ring_reset(&qp->rq);
		/*
		 * Its receives are gone, with no completion. (A completion
		 * still unpolled from before retires one of the next posts':
		 * the count is low by at most that many, and the ring's own
		 * room still bounds the posts.)
		 */
		atomic_store_explicit(&qp->rq_out, 0, memory_order_relaxed);
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
	vrdma_cq_del_qp(qp->scq, qp, true);
	if (qp->rcq)
		vrdma_cq_del_qp(qp->rcq, qp, false);
	pthread_spin_destroy(&qp->rq.lock);
	pthread_spin_destroy(&qp->sq.lock);
	vrdma_buf_free(&qp->mem);
	free(qp);
	return 0;
}

/*
 * Whether the QP takes sends: verbs makes a post in RESET, INIT or RTR an
 * immediate error (the state as this process last set it: one the device
 * moved to ERR on its own takes them, and flushes them).
 */
static bool vrdma_sq_open(struct ibv_qp *ibqp)
{
	return ibqp->state != IBV_QPS_RESET && ibqp->state != IBV_QPS_INIT &&
	       ibqp->state != IBV_QPS_RTR;
}

/*
 * Whether the send queue takes another WQE (under sq.lock): a slot in the
 * ring, and fewer than max_send_wr outstanding — posted since RESET less
 * retired, by the count the latest send completion carried (spec §7.2).
 * A count past what was posted (a completion polled after a RESET that
 * was written before it) is not taken.
 */
static bool vrdma_sq_room(struct vrdma_qp *qp)
{
	uint32_t seen = atomic_load_explicit(&qp->sq_seen, memory_order_relaxed);
	uint32_t posted = qp->sq.index - qp->sq_done;

	if (seen - qp->sq_done <= posted)
		qp->sq_done = seen;
	return qp->sq.index - qp->sq_done < qp->max_send_wr &&
	       vrdma_ring_room(&qp->sq);
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

/*
 * A BIND_MW WQE's fields (spec §7.6): the window's new key, the MR it goes
 * on (none to unbind a type 1 window), its range and rights — verbs'
 * access bits (§6.16), which the device judges.
 */
static void vrdma_bind_fields(struct virtio_rdma_send_wqe *w, uint32_t rkey,
			      const struct ibv_mw_bind_info *b)
{
	w->bind_mw.addr = htole64(b->addr);
	w->bind_mw.length = htole64(b->length);
	w->bind_mw.mw = htole32(rkey);
	w->bind_mw.mr = htole32(b->mr ? b->mr->lkey : 0);
	w->bind_mw.access = htole32(b->mw_access_flags &
				    ~IBV_ACCESS_OPTIONAL_RANGE);
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
	case IBV_WR_BIND_MW:
		if (wr->bind_mw.bind_info.length && !wr->bind_mw.bind_info.mr)
			return EINVAL;
		vrdma_bind_fields(w, wr->bind_mw.rkey, &wr->bind_mw.bind_info);
		w->flags = flags;
		return 0;
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

	if (!vrdma_sq_open(ibqp)) {
		*bad_wr = wr;
		return EINVAL;
	}
	pthread_spin_lock(&r->lock);
	start = r->index;
	for (; wr; wr = wr->next) {
		if (!vrdma_sq_room(qp)) {
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

/* --- the ibv_wr_* interface (ibv_qp_ex) --------------------------------------- */

/*
 * A batch (wr_start to wr_complete or wr_abort) holds the send ring's lock
 * and writes WQEs into its free slots; wr_complete publishes them and
 * rings the doorbell, or, if one of them was refused, gives them all up
 * and says why (the interface reports errors only there).
 */
static inline struct vrdma_qp *to_vqp_ex(struct ibv_qp_ex *ibqp)
{
	return container_of(ibqp, struct vrdma_qp, vqp.qp_ex);
}

static void vrdma_wr_start(struct ibv_qp_ex *ibqp)
{
	struct vrdma_qp *qp = to_vqp_ex(ibqp);

	pthread_spin_lock(&qp->sq.lock);
	qp->wr_first = qp->sq.index;
	qp->wr_err = vrdma_sq_open(&ibqp->qp_base) ? 0 : EINVAL;
	qp->wr_cur = NULL;
}

static int vrdma_wr_complete(struct ibv_qp_ex *ibqp)
{
	struct vrdma_qp *qp = to_vqp_ex(ibqp);
	struct vrdma_ring *r = &qp->sq;
	int err = qp->wr_err;
	bool posted;

	if (err)
		r->index = qp->wr_first;
	posted = r->index != qp->wr_first;
	if (posted)
		vrdma_ring_publish(r);
	qp->wr_cur = NULL;
	pthread_spin_unlock(&r->lock);
	if (posted)
		vrdma_ring_doorbell(to_vctx(ibqp->qp_base.context), qp->doorbell);
	return err;
}

static void vrdma_wr_abort(struct ibv_qp_ex *ibqp)
{
	struct vrdma_qp *qp = to_vqp_ex(ibqp);

	qp->sq.index = qp->wr_first;
	qp->wr_cur = NULL;
	pthread_spin_unlock(&qp->sq.lock);
}

/*
 * The next slot's WQE with its fixed part (reserved bytes zero), the
 * batch's wr_id and flags; NULL (the batch's error recorded) when the
 * ring is full.
 */
static struct virtio_rdma_send_wqe *vrdma_wr_new(struct ibv_qp_ex *ibqp,
						 uint8_t op)
{
	struct vrdma_qp *qp = to_vqp_ex(ibqp);
	struct virtio_rdma_send_wqe *w;
	uint8_t flags = 0;

	qp->wr_cur = NULL;
	if (qp->wr_err)
		return NULL;
	if (!vrdma_sq_room(qp)) {
		qp->wr_err = ENOMEM;
		return NULL;
	}
	if (ibqp->wr_flags & IBV_SEND_FENCE)
		flags |= VIRTIO_RDMA_WR_F_FENCE;
	if ((ibqp->wr_flags & IBV_SEND_SIGNALED) || qp->sig_all)
		flags |= VIRTIO_RDMA_WR_F_SIGNALED;
	if (ibqp->wr_flags & IBV_SEND_SOLICITED)
		flags |= VIRTIO_RDMA_WR_F_SOLICITED;
	w = vrdma_slot(&qp->sq, qp->sq.index++);
	memset(w, 0, sizeof(*w));
	w->wr_id = htole64(ibqp->wr_id);
	w->opcode = op;
	w->flags = flags;
	qp->wr_cur = w;
	return w;
}

static void vrdma_wr_send(struct ibv_qp_ex *ibqp)
{
	vrdma_wr_new(ibqp, VIRTIO_RDMA_WR_SEND);
}

static void vrdma_wr_send_imm(struct ibv_qp_ex *ibqp, __be32 imm)
{
	struct virtio_rdma_send_wqe *w;

	w = vrdma_wr_new(ibqp, VIRTIO_RDMA_WR_SEND_WITH_IMM);
	if (w)
		memcpy(&w->ex, &imm, sizeof(w->ex));
}

static void vrdma_wr_send_inv(struct ibv_qp_ex *ibqp, uint32_t rkey)
{
	struct virtio_rdma_send_wqe *w;

	w = vrdma_wr_new(ibqp, VIRTIO_RDMA_WR_SEND_WITH_INV);
	if (w)
		w->ex = htole32(rkey);
}

static void vrdma_wr_rdma(struct ibv_qp_ex *ibqp, uint8_t op, uint32_t rkey,
			  uint64_t addr)
{
	struct virtio_rdma_send_wqe *w = vrdma_wr_new(ibqp, op);

	if (!w)
		return;
	w->rdma.remote_addr = htole64(addr);
	w->rdma.rkey = htole32(rkey);
}

static void vrdma_wr_rdma_write(struct ibv_qp_ex *ibqp, uint32_t rkey,
				uint64_t addr)
{
	vrdma_wr_rdma(ibqp, VIRTIO_RDMA_WR_RDMA_WRITE, rkey, addr);
}

static void vrdma_wr_rdma_write_imm(struct ibv_qp_ex *ibqp, uint32_t rkey,
				    uint64_t addr, __be32 imm)
{
	struct vrdma_qp *qp = to_vqp_ex(ibqp);

	vrdma_wr_rdma(ibqp, VIRTIO_RDMA_WR_RDMA_WRITE_WITH_IMM, rkey, addr);
	if (qp->wr_cur)
		memcpy(&qp->wr_cur->ex, &imm, sizeof(qp->wr_cur->ex));
}

static void vrdma_wr_rdma_read(struct ibv_qp_ex *ibqp, uint32_t rkey,
			       uint64_t addr)
{
	vrdma_wr_rdma(ibqp, VIRTIO_RDMA_WR_RDMA_READ, rkey, addr);
}

static void vrdma_wr_atomic(struct ibv_qp_ex *ibqp, uint8_t op, uint32_t rkey,
			    uint64_t addr, uint64_t compare_add, uint64_t swap)
{
	struct virtio_rdma_send_wqe *w = vrdma_wr_new(ibqp, op);

	if (!w)
		return;
	w->atomic.remote_addr = htole64(addr);
	w->atomic.compare_add = htole64(compare_add);
	w->atomic.swap = htole64(swap);
	w->atomic.rkey = htole32(rkey);
}

static void vrdma_wr_atomic_cmp_swp(struct ibv_qp_ex *ibqp, uint32_t rkey,
				    uint64_t addr, uint64_t compare,
				    uint64_t swap)
{
	vrdma_wr_atomic(ibqp, VIRTIO_RDMA_WR_ATOMIC_CMP_AND_SWP, rkey, addr,
			compare, swap);
}

static void vrdma_wr_atomic_fetch_add(struct ibv_qp_ex *ibqp, uint32_t rkey,
				      uint64_t addr, uint64_t add)
{
	vrdma_wr_atomic(ibqp, VIRTIO_RDMA_WR_ATOMIC_FETCH_AND_ADD, rkey, addr,
			add, 0);
}

static void vrdma_wr_local_inv(struct ibv_qp_ex *ibqp, uint32_t rkey)
{
	struct virtio_rdma_send_wqe *w;

	w = vrdma_wr_new(ibqp, VIRTIO_RDMA_WR_LOCAL_INV);
	if (w)
		w->ex = htole32(rkey);
	to_vqp_ex(ibqp)->wr_cur = NULL; /* no data follows */
}

static void vrdma_wr_bind_mw(struct ibv_qp_ex *ibqp, struct ibv_mw *mw,
			     uint32_t rkey, const struct ibv_mw_bind_info *b)
{
	struct vrdma_qp *qp = to_vqp_ex(ibqp);
	struct virtio_rdma_send_wqe *w;

	if (b->length && !b->mr) {
		if (!qp->wr_err)
			qp->wr_err = EINVAL;
		return;
	}
	w = vrdma_wr_new(ibqp, VIRTIO_RDMA_WR_BIND_MW);
	if (!w)
		return;
	vrdma_bind_fields(w, rkey, b);
	qp->wr_cur = NULL; /* no data follows */
}

/* The current WQE's data: SGEs, or inline bytes. */
static void vrdma_wr_set_sge_list(struct ibv_qp_ex *ibqp, size_t n,
				  const struct ibv_sge *sg)
{
	struct vrdma_qp *qp = to_vqp_ex(ibqp);
	struct virtio_rdma_send_wqe *w = qp->wr_cur;
	struct virtio_rdma_sge *sge;
	size_t i;

	if (!w)
		return;
	if (n > qp->max_send_sge) {
		qp->wr_err = EINVAL;
		return;
	}
	sge = (struct virtio_rdma_sge *)(w + 1);
	for (i = 0; i < n; i++) {
		sge[i].addr = htole64(sg[i].addr);
		sge[i].length = htole32(sg[i].length);
		sge[i].lkey = htole32(sg[i].lkey);
	}
	w->count = htole16(n);
}

static void vrdma_wr_set_sge(struct ibv_qp_ex *ibqp, uint32_t lkey,
			     uint64_t addr, uint32_t length)
{
	struct ibv_sge sge = { .addr = addr, .length = length, .lkey = lkey };

	vrdma_wr_set_sge_list(ibqp, 1, &sge);
}

static void vrdma_wr_set_inline_data_list(struct ibv_qp_ex *ibqp, size_t n,
					  const struct ibv_data_buf *buf)
{
	struct vrdma_qp *qp = to_vqp_ex(ibqp);
	struct virtio_rdma_send_wqe *w = qp->wr_cur;
	uint8_t *dst;
	size_t i, len = 0;

	if (!w)
		return;
	/* Inline data goes with SEND* and RDMA_WRITE* (spec §7.4). */
	if (w->opcode == VIRTIO_RDMA_WR_RDMA_READ ||
	    w->opcode == VIRTIO_RDMA_WR_ATOMIC_CMP_AND_SWP ||
	    w->opcode == VIRTIO_RDMA_WR_ATOMIC_FETCH_AND_ADD) {
		qp->wr_err = EINVAL;
		return;
	}
	dst = (uint8_t *)(w + 1);
	for (i = 0; i < n; i++) {
		if (buf[i].length > qp->max_inline - len) {
			qp->wr_err = EINVAL;
			return;
		}
		memcpy(dst + len, buf[i].addr, buf[i].length);
		len += buf[i].length;
	}
	w->flags |= VIRTIO_RDMA_WR_F_INLINE;
	w->count = htole16(len);
}

static void vrdma_wr_set_inline_data(struct ibv_qp_ex *ibqp, void *addr,
				     size_t length)
{
	struct ibv_data_buf buf = { .addr = addr, .length = length };

	vrdma_wr_set_inline_data_list(ibqp, 1, &buf);
}

static void vrdma_wr_set_ud_addr(struct ibv_qp_ex *ibqp, struct ibv_ah *ah,
				 uint32_t remote_qpn, uint32_t remote_qkey)
{
	struct vrdma_qp *qp = to_vqp_ex(ibqp);
	struct virtio_rdma_send_wqe *w = qp->wr_cur;

	if (!w)
		return;
	if (!ah) {
		qp->wr_err = EINVAL;
		return;
	}
	w->ud.av = to_vah(ah)->av;
	w->ud.remote_qpn = htole32(remote_qpn);
	w->ud.remote_qkey = htole32(remote_qkey);
}

/* The QP's ibv_qp_ex: the operations its type takes. */
static void vrdma_qp_ex_init(struct vrdma_qp *qp)
{
	struct ibv_qp_ex *ex = &qp->vqp.qp_ex;
	enum ibv_qp_type type = qp->vqp.qp.qp_type;

	ex->wr_start = vrdma_wr_start;
	ex->wr_complete = vrdma_wr_complete;
	ex->wr_abort = vrdma_wr_abort;
	ex->wr_send = vrdma_wr_send;
	ex->wr_send_imm = vrdma_wr_send_imm;
	ex->wr_set_sge = vrdma_wr_set_sge;
	ex->wr_set_sge_list = vrdma_wr_set_sge_list;
	ex->wr_set_inline_data = vrdma_wr_set_inline_data;
	ex->wr_set_inline_data_list = vrdma_wr_set_inline_data_list;
	if (type == IBV_QPT_UD) {
		ex->wr_set_ud_addr = vrdma_wr_set_ud_addr;
	} else {
		ex->wr_rdma_write = vrdma_wr_rdma_write;
		ex->wr_rdma_write_imm = vrdma_wr_rdma_write_imm;
		ex->wr_local_inv = vrdma_wr_local_inv;
		ex->wr_bind_mw = vrdma_wr_bind_mw;
	}
	if (type == IBV_QPT_RC) {
		ex->wr_rdma_read = vrdma_wr_rdma_read;
		ex->wr_atomic_cmp_swp = vrdma_wr_atomic_cmp_swp;
		ex->wr_atomic_fetch_add = vrdma_wr_atomic_fetch_add;
		ex->wr_send_inv = vrdma_wr_send_inv;
	}
	qp->vqp.comp_mask |= VERBS_QP_EX;
}

int vrdma_post_recv(struct ibv_qp *ibqp, struct ibv_recv_wr *wr,
		    struct ibv_recv_wr **bad_wr)
{
	struct vrdma_qp *qp = to_vqp(ibqp);

	/*
	 * A QP on an SRQ takes its receives from the SRQ; one in RESET takes
	 * none (verbs: an immediate error).
	 */
	if (!qp->rq.buf || ibqp->state == IBV_QPS_RESET) {
		*bad_wr = wr;
		return EINVAL;
	}
	return vrdma_post_recv_ring(to_vctx(ibqp->context), &qp->rq,
				    qp->max_recv_sge, qp->doorbell, &qp->rq_out,
				    qp->max_recv_wr, wr, bad_wr);
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
				    srq->max_sge, srq->doorbell, NULL, 0, wr,
				    bad_wr);
}
