// SPDX-License-Identifier: GPL-2.0 OR Linux-OpenIB
/*
 * virtio-rdma: completion queues. The device writes CQEs (spec §7.8) into
 * a ring in this process's memory and publishes its producer index; poll
 * reads them and publishes the consumer index. Arming (spec §9.1) is a
 * store of the arm word and the CQ's doorbell; the notification reaches
 * the completion channel through the kernel.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "virtio_rdma.h"

struct ibv_cq *vrdma_create_cq(struct ibv_context *ibctx, int cqe,
			       struct ibv_comp_channel *channel,
			       int comp_vector)
{
	struct vrdma_context *ctx = to_vctx(ibctx);
	struct vrdma_create_cq cmd = {};
	struct vrdma_create_cq_resp resp = {};
	struct vrdma_ring *r;
	struct vrdma_cq *cq;
	size_t ring_len;
	uint32_t entries;
	int ret;

	if (cqe < 1 || (uint32_t)cqe > ctx->max_cqe) {
		errno = EINVAL;
		return NULL;
	}
	/* One slot more than asked: the kernel driver keeps one free. */
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

	vrdma_uring(r, &cmd.ring);
	ret = ibv_cmd_create_cq(ibctx, cqe, channel, comp_vector, &cq->vcq.cq,
				&cmd.ibv_cmd, sizeof(cmd), &resp.ibv_resp,
				sizeof(resp));
	if (ret)
		goto destroy_lock;
	cq->handle = resp.cq;
	cq->doorbell = resp.doorbell;
	if (cq->doorbell >= ctx->db_bits) {
		verbs_err(verbs_get_ctx(ibctx),
			  "virtio_rdma: CQ %u has doorbell %u of %u\n",
			  cq->handle, cq->doorbell, ctx->db_bits);
		ibv_cmd_destroy_cq(&cq->vcq.cq);
		ret = EPROTO;
		goto destroy_lock;
	}
	return &cq->vcq.cq;

destroy_lock:
	pthread_spin_destroy(&r->lock);
free_mem:
	vrdma_buf_free(&cq->mem);
free_cq:
	free(cq);
	errno = ret;
	return NULL;
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
	pthread_spin_destroy(&cq->ring.lock);
	vrdma_buf_free(&cq->mem);
	free(cq);
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
	wc->src_qp = le32toh(c->src_qp);
	wc->wc_flags = 0;
	wc->imm_data = 0;
	wc->pkey_index = le16toh(c->pkey_index);
	wc->slid = 0;
	wc->sl = c->sl;
	wc->dlid_path_bits = 0;
	if (flags & VIRTIO_RDMA_WC_F_GRH)
		wc->wc_flags |= IBV_WC_GRH;
	if (flags & VIRTIO_RDMA_WC_F_WITH_IMM) {
		wc->wc_flags |= IBV_WC_WITH_IMM;
		/* The immediate's bytes as sent: verbs keeps them big-endian. */
		memcpy(&wc->imm_data, &c->ex, sizeof(wc->imm_data));
	} else if (flags & VIRTIO_RDMA_WC_F_WITH_INV) {
		wc->wc_flags |= IBV_WC_WITH_INV;
		wc->invalidated_rkey = le32toh(c->ex);
	}
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
