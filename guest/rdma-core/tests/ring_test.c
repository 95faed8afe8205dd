// SPDX-License-Identifier: GPL-2.0 OR Linux-OpenIB
/*
 * virtio-rdma provider: its data path without a device or a kernel. The
 * provider's own post, poll and arm functions run on rings and a doorbell
 * area made here, and every byte they write is read back at the offsets the
 * specification gives (docs/virtio-rdma.md §7.1, §7.3, §7.5, §7.7, §7.8,
 * §8.1, §8.3, §9.1) — by number, not through the ABI header's structures —
 * while this program plays the device: it consumes WQEs, writes CQEs and
 * publishes its indices. Built against the rdma-core tree the provider was
 * built in (scripts/virtio-guest/provider-check.sh); prints
 * "N passed, M failed".
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "virtio_rdma.h"

static int passed, failed;

#define CHECK(cond, ...)                                                       \
	do {                                                                   \
		if (cond) {                                                    \
			passed++;                                              \
		} else {                                                       \
			failed++;                                              \
			printf("FAILED %s:%d: %s: ", __func__, __LINE__,       \
			       #cond);                                         \
			printf(__VA_ARGS__);                                   \
			printf("\n");                                          \
		}                                                              \
	} while (0)

static uint64_t rd(const void *base, size_t off, int bytes)
{
	const uint8_t *p = (const uint8_t *)base + off;
	uint64_t v = 0;
	int i;

	/* Little-endian, as the device reads it. */
	for (i = bytes - 1; i >= 0; i--)
		v = v << 8 | p[i];
	return v;
}

static void wr(void *base, size_t off, int bytes, uint64_t v)
{
	uint8_t *p = (uint8_t *)base + off;
	int i;

	for (i = 0; i < bytes; i++, v >>= 8)
		p[i] = v & 0xff;
}

static struct vrdma_context *ctx;

/* A context whose doorbell area says the device polls: no kick is made. */
static void make_context(void)
{
	ctx = calloc(1, sizeof(*ctx));
	if (!ctx || posix_memalign((void **)&ctx->db, 4096, 8192))
		exit(2);
	memset(ctx->db, 0, 8192);
	ctx->db_bits = 4096;
	ctx->db_size = 8192;
	ctx->flags = VIRTIO_RDMA_UCTX_DOORBELL_POLL;
	ctx->max_inline = 256;
	wr(ctx->db, 0, 4, 1); /* poll = 1 */
}

/* Takes the doorbell bits as the device's scan does, returning bitmap word @w. */
static uint64_t take_bitmap(uint32_t w, uint64_t *summary0)
{
	uint64_t v = rd(ctx->db, 1024 + 8 * w, 8);

	*summary0 = rd(ctx->db, 64, 8);
	wr(ctx->db, 1024 + 8 * w, 8, 0);
	wr(ctx->db, 64, 8, 0);
	return v;
}

/* Every doorbell bit clear, the poll word left as it is. */
static void clear_doorbells(void)
{
	memset(ctx->db + 64, 0, ctx->db_size - 64);
}

static void ring_init(struct vrdma_ring *r, uint8_t *buf, uint8_t *hdr,
		      uint32_t entries, uint32_t stride)
{
	r->buf = buf;
	r->hdr = hdr;
	r->entries = entries;
	r->stride = stride;
	pthread_spin_init(&r->lock, PTHREAD_PROCESS_PRIVATE);
}

static struct vrdma_qp *make_qp(enum ibv_qp_type type, uint32_t doorbell)
{
	struct vrdma_qp *qp = calloc(1, sizeof(*qp));
	uint8_t *m;

	/* Send ring 16 × 256 B (one page), receive ring 64 × 64 B, headers. */
	if (!qp || vrdma_buf_alloc(&qp->mem, 3 * 4096))
		exit(2);
	clear_doorbells();
	m = qp->mem.addr;
	ring_init(&qp->sq, m, m + 8192, 16, 256);
	ring_init(&qp->rq, m + 4096, m + 8192 + 64, 64, 64);
	qp->vqp.qp.context = &ctx->ibv_ctx.context;
	qp->vqp.qp.qp_type = type;
	qp->vqp.qp.state = IBV_QPS_RTS;
	qp->doorbell = doorbell;
	/* As the device answers CREATE_QP: a work request per slot. */
	qp->max_send_wr = 16;
	qp->max_recv_wr = 64;
	qp->max_send_sge = 4;
	qp->max_recv_sge = 3;
	qp->max_inline = 192;
	return qp;
}

static void test_send(void)
{
	struct vrdma_qp *qp = make_qp(IBV_QPT_RC, 70);
	struct ibv_sge sge[2] = {
		{ .addr = 0x1122334455667788ULL, .length = 100, .lkey = 0xabcd01 },
		{ .addr = 0x10000, .length = 28, .lkey = 0xabcd02 },
	};
	struct ibv_send_wr w = {
		.wr_id = 0xfeedfacecafebeefULL,
		.sg_list = sge,
		.num_sge = 2,
		.opcode = IBV_WR_SEND,
		.send_flags = IBV_SEND_SIGNALED | IBV_SEND_SOLICITED,
	};
	struct ibv_send_wr *bad = NULL;
	uint8_t *s = qp->sq.buf;
	uint64_t summary;

	CHECK(vrdma_post_send(&qp->vqp.qp, &w, &bad) == 0, "post failed");
	CHECK(rd(s, 0, 8) == 0xfeedfacecafebeefULL, "wr_id %#llx",
	      (unsigned long long)rd(s, 0, 8));
	CHECK(rd(s, 8, 1) == 2, "opcode SEND is 2, got %llu",
	      (unsigned long long)rd(s, 8, 1));
	CHECK(rd(s, 9, 1) == (2 | 4), "flags SIGNALED|SOLICITED, got %#llx",
	      (unsigned long long)rd(s, 9, 1));
	CHECK(rd(s, 10, 2) == 2, "count");
	CHECK(rd(s, 12, 4) == 0, "ex");
	CHECK(rd(s, 16, 8) == 0 && rd(s, 24, 8) == 0 && rd(s, 32, 8) == 0 &&
	      rd(s, 40, 8) == 0 && rd(s, 48, 8) == 0 && rd(s, 56, 8) == 0,
	      "the union is zero on an RC SEND");
	CHECK(rd(s, 64, 8) == 0x1122334455667788ULL && rd(s, 72, 4) == 100 &&
	      rd(s, 76, 4) == 0xabcd01, "SGE 0");
	CHECK(rd(s, 80, 8) == 0x10000 && rd(s, 88, 4) == 28 &&
	      rd(s, 92, 4) == 0xabcd02, "SGE 1");
	CHECK(rd(qp->sq.hdr, 0, 4) == 1, "producer index 1");
	CHECK(rd(qp->rq.hdr, 0, 4) == 0, "the receive ring untouched");
	/* Doorbell 70: bit 6 of bitmap word 1, summarized by bit 1 of summary[0]. */
	CHECK(take_bitmap(1, &summary) == 1ULL << 6, "bitmap word 1");
	CHECK(summary == 1ULL << 1, "summary word 0: %#llx",
	      (unsigned long long)summary);
	CHECK(rd(ctx->db, 1024, 8) == 0, "bitmap word 0 untouched");

	/* WRITE with immediate, inline; the immediate's bytes as given. */
	{
		static const char data[] = "inline payload of forty bytes, exactly!";
		struct ibv_sge isge = { .addr = (uintptr_t)data, .length = 40 };
		struct ibv_send_wr iw = {
			.wr_id = 7, .sg_list = &isge, .num_sge = 1,
			.opcode = IBV_WR_RDMA_WRITE_WITH_IMM,
			.send_flags = IBV_SEND_INLINE | IBV_SEND_FENCE,
			.imm_data = htobe32(0x01020304),
		};
		uint8_t *t = s + 256;

		iw.wr.rdma.remote_addr = 0xdeadbeef000ULL;
		iw.wr.rdma.rkey = 0x55aa;
		CHECK(vrdma_post_send(&qp->vqp.qp, &iw, &bad) == 0, "post");
		CHECK(rd(t, 8, 1) == 1, "opcode RDMA_WRITE_WITH_IMM is 1");
		CHECK(rd(t, 9, 1) == (1 | 8), "flags FENCE|INLINE (unsignaled)");
		CHECK(rd(t, 10, 2) == 40, "count = inline bytes");
		CHECK(t[12] == 1 && t[13] == 2 && t[14] == 3 && t[15] == 4,
		      "immediate bytes in wire order");
		CHECK(rd(t, 16, 8) == 0xdeadbeef000ULL && rd(t, 24, 4) == 0x55aa,
		      "rdma.remote_addr, rdma.rkey");
		CHECK(!memcmp(t + 64, data, 40), "inline data at 64");
		CHECK(rd(qp->sq.hdr, 0, 4) == 2, "producer 2");
	}

	/* Atomics: the atomic union; a READ of two SGEs. */
	{
		struct ibv_sge asge = { .addr = 0x2000, .length = 8, .lkey = 9 };
		struct ibv_send_wr aw = {
			.wr_id = 8, .sg_list = &asge, .num_sge = 1,
			.opcode = IBV_WR_ATOMIC_CMP_AND_SWP,
		};
		struct ibv_send_wr rw = {
			.wr_id = 9, .sg_list = sge, .num_sge = 2,
			.opcode = IBV_WR_RDMA_READ,
			.send_flags = IBV_SEND_INLINE, /* ignored for READ */
		};
		uint8_t *t = s + 2 * 256, *u = s + 3 * 256;

		aw.wr.atomic.remote_addr = 0x7000;
		aw.wr.atomic.compare_add = 0x1111222233334444ULL;
		aw.wr.atomic.swap = 0x5555666677778888ULL;
		aw.wr.atomic.rkey = 0x4242;
		aw.next = &rw;
		rw.wr.rdma.remote_addr = 0x9000;
		rw.wr.rdma.rkey = 0x77;
		CHECK(vrdma_post_send(&qp->vqp.qp, &aw, &bad) == 0, "post");
		CHECK(rd(t, 8, 1) == 5 && rd(t, 10, 2) == 1, "CMP_AND_SWP, 1 SGE");
		CHECK(rd(t, 16, 8) == 0x7000 && rd(t, 24, 8) == 0x1111222233334444ULL &&
		      rd(t, 32, 8) == 0x5555666677778888ULL && rd(t, 40, 4) == 0x4242,
		      "atomic union at 16/24/32/40");
		CHECK(rd(t, 64, 8) == 0x2000 && rd(t, 72, 4) == 8 && rd(t, 76, 4) == 9,
		      "the result's SGE");
		CHECK(rd(u, 8, 1) == 4 && rd(u, 9, 1) == 0 && rd(u, 10, 2) == 2,
		      "READ: opcode 4, no INLINE, 2 SGEs");
		CHECK(rd(qp->sq.hdr, 0, 4) == 4, "producer 4 after a list of two");
	}

	/*
	 * Refused at post time: an opcode the device has not (TSO, a raw
	 * packet QP's), too many SGEs.
	 */
	{
		struct ibv_send_wr lw = { .wr_id = 10, .opcode = IBV_WR_TSO };
		struct ibv_sge many[5] = {};
		struct ibv_send_wr mw = {
			.wr_id = 11, .sg_list = many, .num_sge = 5,
			.opcode = IBV_WR_SEND,
		};

		bad = NULL;
		CHECK(vrdma_post_send(&qp->vqp.qp, &lw, &bad) == EINVAL && bad == &lw,
		      "TSO refused");
		bad = NULL;
		CHECK(vrdma_post_send(&qp->vqp.qp, &mw, &bad) == EINVAL && bad == &mw,
		      "5 SGEs on a QP of 4 refused");
		CHECK(rd(qp->sq.hdr, 0, 4) == 4, "nothing posted by refusals");
	}

	/* A full ring: 16 slots; 4 used, 12 more fit, the 17th waits for the device. */
	{
		struct ibv_send_wr fw = { .opcode = IBV_WR_SEND };
		int i, ret = 0;

		for (i = 0; i < 12 && !ret; i++)
			ret = vrdma_post_send(&qp->vqp.qp, &fw, &bad);
		CHECK(ret == 0 && rd(qp->sq.hdr, 0, 4) == 16, "16 posted");
		CHECK(vrdma_post_send(&qp->vqp.qp, &fw, &bad) == ENOMEM,
		      "the 17th finds the ring full");
		/*
		 * The device takes 5 (its consumer index) and completes them:
		 * a send completion that says 5 retired was polled
		 * (test_counts polls them).
		 */
		wr(qp->sq.hdr, 4, 4, 5);
		CHECK(vrdma_post_send(&qp->vqp.qp, &fw, &bad) == ENOMEM,
		      "slots free, but 16 work requests outstanding");
		atomic_store(&qp->sq_seen, 5);
		for (i = 0, ret = 0; i < 5 && !ret; i++)
			ret = vrdma_post_send(&qp->vqp.qp, &fw, &bad);
		CHECK(ret == 0 && rd(qp->sq.hdr, 0, 4) == 21, "5 more once taken");
		CHECK(vrdma_post_send(&qp->vqp.qp, &fw, &bad) == ENOMEM, "full again");
		/* Slot of index 16 is slot 0 again: the newest WQE's wr_id. */
		CHECK(rd(s, 8, 1) == 2 && rd(s, 0, 8) == 0, "slot 0 rewritten");
	}
}

static void test_ud(void)
{
	struct vrdma_qp *qp = make_qp(IBV_QPT_UD, 5);
	struct vrdma_ah ah = {};
	struct ibv_sge sge = { .addr = 0x3000, .length = 60, .lkey = 3 };
	struct ibv_send_wr w = {
		.wr_id = 1, .sg_list = &sge, .num_sge = 1,
		.opcode = IBV_WR_SEND_WITH_IMM, .imm_data = htobe32(0xa0b0c0d0),
	};
	struct ibv_send_wr *bad;
	uint8_t *s = qp->sq.buf;
	uint64_t summary;
	int i;

	for (i = 0; i < 32; i++)
		((uint8_t *)&ah.av)[i] = 0x40 + i;
	w.wr.ud.ah = &ah.ibv_ah;
	w.wr.ud.remote_qpn = 0x123456;
	w.wr.ud.remote_qkey = 0x11111111;
	CHECK(vrdma_post_send(&qp->vqp.qp, &w, &bad) == 0, "UD post");
	CHECK(rd(s, 8, 1) == 3, "SEND_WITH_IMM is 3");
	for (i = 0; i < 32; i++)
		if (s[16 + i] != 0x40 + i)
			break;
	CHECK(i == 32, "the AH's 32-byte AV at 16, byte %d differs", i);
	CHECK(rd(s, 48, 4) == 0x123456 && rd(s, 52, 4) == 0x11111111,
	      "remote_qpn at 48, remote_qkey at 52");
	CHECK(rd(s, 56, 8) == 0, "ud.reserved zero");
	/* UD takes no RDMA. */
	w.opcode = IBV_WR_RDMA_WRITE;
	CHECK(vrdma_post_send(&qp->vqp.qp, &w, &bad) == EINVAL, "WRITE on UD refused");
	/* Doorbell 5: bit 5 of bitmap word 0, bit 0 of summary[0]. */
	CHECK(take_bitmap(0, &summary) == 1ULL << 5 && summary == 1,
	      "doorbell 5's bits");
}

static void test_recv(void)
{
	struct vrdma_qp *qp = make_qp(IBV_QPT_RC, 4095);
	struct ibv_sge sge[3] = {
		{ .addr = 0xa000, .length = 4096, .lkey = 0x100 },
		{ .addr = 0xb000, .length = 1, .lkey = 0x101 },
		{ .addr = 0xc000, .length = 0, .lkey = 0x102 },
	};
	struct ibv_recv_wr rw[3] = {
		{ .wr_id = 0x100, .sg_list = sge, .num_sge = 3, .next = &rw[1] },
		{ .wr_id = 0x101, .sg_list = NULL, .num_sge = 0, .next = &rw[2] },
		{ .wr_id = 0x102, .sg_list = sge, .num_sge = 4 },
	};
	struct ibv_recv_wr *bad = NULL;
	uint8_t *r = qp->rq.buf;
	uint64_t summary;

	CHECK(vrdma_post_recv(&qp->vqp.qp, rw, &bad) == EINVAL && bad == &rw[2],
	      "4 SGEs on a QP of 3 refused, after 2 posted");
	CHECK(rd(qp->rq.hdr, 0, 4) == 2, "receive producer 2");
	CHECK(rd(qp->sq.hdr, 0, 4) == 0, "send producer untouched");
	CHECK(rd(r, 0, 8) == 0x100 && rd(r, 8, 2) == 3, "wr_id at 0, count at 8");
	CHECK(rd(r, 10, 2) == 0 && rd(r, 12, 4) == 0, "reserved 10..15 zero");
	CHECK(rd(r, 16, 8) == 0xa000 && rd(r, 24, 4) == 4096 && rd(r, 28, 4) == 0x100 &&
	      rd(r, 32, 8) == 0xb000 && rd(r, 48, 8) == 0xc000 && rd(r, 60, 4) == 0x102,
	      "SGEs at 16, 32, 48");
	CHECK(rd(r, 64, 8) == 0x101 && rd(r, 72, 2) == 0, "the second, no SGE");
	/* Doorbell 4095: bitmap word 63 bit 63, summary[0] bit 63. */
	CHECK(take_bitmap(63, &summary) == 1ULL << 63 && summary == 1ULL << 63,
	      "doorbell 4095's bits");

	/* A QP on an SRQ has no receive ring. */
	qp->rq.buf = NULL;
	bad = NULL;
	CHECK(vrdma_post_recv(&qp->vqp.qp, rw, &bad) == EINVAL && bad == rw,
	      "post_recv on an SRQ's QP refused");
}

static void test_srq(void)
{
	struct vrdma_srq *srq = calloc(1, sizeof(*srq));
	struct ibv_sge sge = { .addr = 0xd000, .length = 256, .lkey = 0x200 };
	struct ibv_recv_wr rw = { .wr_id = 0x300, .sg_list = &sge, .num_sge = 1 };
	struct ibv_recv_wr *bad = NULL;
	uint8_t *m;
	int i, ret = 0;

	if (!srq || vrdma_buf_alloc(&srq->mem, 2 * 4096))
		exit(2);
	clear_doorbells();
	m = srq->mem.addr;
	ring_init(&srq->ring, m, m + 4096, 128, 32);
	srq->vsrq.srq.context = &ctx->ibv_ctx.context;
	srq->doorbell = 64 * 64; /* summary word 1 */
	ctx->db_bits = 8192;
	srq->max_sge = 1;
	for (i = 0; i < 128 && !ret; i++)
		ret = vrdma_post_srq_recv(&srq->vsrq.srq, &rw, &bad);
	CHECK(ret == 0 && rd(srq->ring.hdr, 0, 4) == 128, "128 posted");
	CHECK(vrdma_post_srq_recv(&srq->vsrq.srq, &rw, &bad) == ENOMEM && bad == &rw,
	      "the 129th waits");
	CHECK(rd(m + 127 * 32, 0, 8) == 0x300 && rd(m + 127 * 32, 16, 8) == 0xd000,
	      "the last slot");
	/* Doorbell 4096: bitmap word 64 bit 0, summary[1] bit 0. */
	CHECK(rd(ctx->db, 1024 + 8 * 64, 8) == 1 && rd(ctx->db, 64 + 8, 8) == 1,
	      "doorbell 4096's bits");
	wr(ctx->db, 1024 + 8 * 64, 8, 0);
	wr(ctx->db, 64 + 8, 8, 0);
}

static struct vrdma_cq *make_cq(uint32_t doorbell)
{
	struct vrdma_cq *cq = calloc(1, sizeof(*cq));
	uint8_t *m;

	if (!cq || vrdma_buf_alloc(&cq->mem, 2 * 4096))
		exit(2);
	clear_doorbells();
	m = cq->mem.addr;
	ring_init(&cq->ring, m, m + 4096, 128, 32);
	for (int i = 0; i < VRDMA_CQ_QP_BUCKETS; i++) {
		list_head_init(&cq->rqps[i]);
		list_head_init(&cq->sqps[i]);
	}
	cq->vcq.cq.context = &ctx->ibv_ctx.context;
	cq->doorbell = doorbell;
	return cq;
}

/* The device's side: a CQE at the producer index, then the index. */
static void device_cqe(struct vrdma_cq *cq, uint64_t wr_id, uint8_t status,
		       uint8_t opcode, uint16_t flags, uint32_t qpn,
		       uint32_t len, const uint8_t ex[4], uint32_t src_qp)
{
	uint32_t p = rd(cq->ring.hdr, 0, 4);
	uint8_t *c = cq->ring.buf + (p & 127) * 32;

	memset(c, 0xee, 32);
	wr(c, 0, 8, wr_id);
	wr(c, 8, 1, status);
	wr(c, 9, 1, opcode);
	wr(c, 10, 2, flags);
	wr(c, 12, 4, qpn);
	wr(c, 16, 4, len);
	memcpy(c + 20, ex, 4);
	wr(c, 24, 4, src_qp);
	wr(c, 28, 2, 0);
	wr(c, 30, 1, 0);
	wr(c, 31, 1, 2);
	wr(cq->ring.hdr, 0, 4, p + 1);
}

static void test_cq(void)
{
	struct vrdma_cq *cq = make_cq(3);
	static const uint8_t imm[4] = { 0xa0, 0xb0, 0xc0, 0xd0 };
	static const uint8_t rkey[4] = { 0x78, 0x56, 0x34, 0x12 };
	static const uint8_t none[4];
	struct ibv_wc wc[4];
	uint64_t summary, arm;
	int n;

	CHECK(vrdma_poll_cq(&cq->vcq.cq, 4, wc) == 0, "empty");
	device_cqe(cq, 0x10, 0, 128, 1 | 2, 0x123, 100, imm, 0x654321);
	device_cqe(cq, 0x11, 0, 129, 2, 0x123, 4096, imm, 0);
	device_cqe(cq, 0x12, 0, 128, 8, 0x124, 8, rkey, 0);
	n = vrdma_poll_cq(&cq->vcq.cq, 2, wc);
	CHECK(n == 2, "2 of 3 polled: %d", n);
	CHECK(wc[0].wr_id == 0x10 && wc[0].status == IBV_WC_SUCCESS &&
	      wc[0].opcode == IBV_WC_RECV && wc[0].byte_len == 100 &&
	      wc[0].qp_num == 0x123 && wc[0].src_qp == 0x654321 &&
	      wc[0].wc_flags == (IBV_WC_GRH | IBV_WC_WITH_IMM) &&
	      wc[0].imm_data == htobe32(0xa0b0c0d0) && wc[0].sl == 0 &&
	      wc[0].pkey_index == 0, "a UD receive with immediate");
	CHECK(wc[1].opcode == IBV_WC_RECV_RDMA_WITH_IMM &&
	      wc[1].wc_flags == IBV_WC_WITH_IMM && wc[1].byte_len == 4096,
	      "RECV_RDMA_WITH_IMM");
	CHECK(rd(cq->ring.hdr, 4, 4) == 2, "consumer index 2 published");
	n = vrdma_poll_cq(&cq->vcq.cq, 4, wc);
	CHECK(n == 1 && wc[0].wc_flags == IBV_WC_WITH_INV &&
	      wc[0].invalidated_rkey == 0x12345678, "WITH_INV's rkey (le32)");
	CHECK(rd(cq->ring.hdr, 4, 4) == 3, "consumer index 3");

	/* An error completion; statuses past GENERAL_ERR become it. */
	device_cqe(cq, 0x13, 12, 0, 0, 0x125, 0, none, 0);
	device_cqe(cq, 0x14, 200, 0, 0, 0x125, 0, none, 0);
	n = vrdma_poll_cq(&cq->vcq.cq, 4, wc);
	CHECK(n == 2 && wc[0].status == IBV_WC_RETRY_EXC_ERR &&
	      wc[1].status == IBV_WC_GENERAL_ERR && wc[1].qp_num == 0x125,
	      "error statuses");

	/* Around the ring: 200 more, polled as they come. */
	{
		int i, got = 0;

		for (i = 0; i < 200; i++) {
			device_cqe(cq, 0x1000 + i, 0, 1, 0, 1, 0, none, 0);
			if (i % 3 == 2)
				got += vrdma_poll_cq(&cq->vcq.cq, 4, wc);
		}
		while ((n = vrdma_poll_cq(&cq->vcq.cq, 4, wc)) > 0)
			got += n;
		CHECK(got == 200 && rd(cq->ring.hdr, 4, 4) == 205 &&
		      wc[0].opcode == IBV_WC_RDMA_WRITE, "200 across the wrap: %d", got);
	}

	/* Arming: snapshot = consumer index, mode, a new sequence, the doorbell. */
	CHECK(vrdma_req_notify_cq(&cq->vcq.cq, 0) == 0, "arm");
	arm = rd(cq->ring.hdr, 8, 8);
	CHECK((arm & 0xffffffff) == 205 && (arm >> 32 & 3) == 1 && arm >> 34 == 1,
	      "NEXT arm: %#llx", (unsigned long long)arm);
	CHECK(take_bitmap(0, &summary) == 1ULL << 3 && summary == 1,
	      "the CQ's doorbell 3");
	CHECK(vrdma_req_notify_cq(&cq->vcq.cq, 1) == 0, "arm solicited");
	arm = rd(cq->ring.hdr, 8, 8);
	CHECK((arm & 0xffffffff) == 205 && (arm >> 32 & 3) == 2 && arm >> 34 == 2,
	      "SOLICITED arm, sequence 2: %#llx", (unsigned long long)arm);
	take_bitmap(0, &summary);
	/* The sequence is 30 bits: after 2^30 - 1 comes 0, still a new one. */
	cq->arm_seq = (1U << 30) - 1;
	vrdma_req_notify_cq(&cq->vcq.cq, 0);
	arm = rd(cq->ring.hdr, 8, 8);
	CHECK(arm >> 34 == 0 && (arm >> 32 & 3) == 1, "sequence wraps to 0");
	take_bitmap(0, &summary);
	CHECK(rd(cq->ring.hdr, 0, 4) == 205 && rd(cq->ring.hdr, 16, 8) == 0,
	      "the producer word and reserved bytes untouched");
}

/*
 * Verbs' limits on outstanding work requests (spec §7.2, §7.8): the device
 * frees a slot when it copies the WQE, so the provider counts receives
 * by their completions and sends by the count of retired WQEs each send
 * completion carries.
 */
static void test_counts(void)
{
	struct vrdma_cq *cq = make_cq(5);
	struct vrdma_qp *qp = make_qp(IBV_QPT_RC, 6);
	struct ibv_send_wr sw = { .opcode = IBV_WR_SEND }, *sbad;
	struct ibv_recv_wr rw = { .wr_id = 1 }, *rbad;
	static const uint8_t none[4];
	struct ibv_wc wc[8];
	int i, ret = 0;

	qp->vqp.qp.qp_num = 0x77;
	vrdma_cq_add_qp(cq, qp, true);
	vrdma_cq_add_qp(cq, qp, false);
	for (i = 0; i < 16 && !ret; i++)
		ret = vrdma_post_send(&qp->vqp.qp, &sw, &sbad);
	CHECK(ret == 0, "16 sends posted");
	/* The device takes all 16: every slot is free again. */
	wr(qp->sq.hdr, 4, 4, 16);
	CHECK(vrdma_post_send(&qp->vqp.qp, &sw, &sbad) == ENOMEM,
	      "max_send_wr outstanding: the 17th refused");
	/* WQE 3 was signaled; 1 and 2 retired silently before it. */
	device_cqe(cq, 3, 0, 0, 0, 0x77, 0, none, 3);
	CHECK(vrdma_poll_cq(&cq->vcq.cq, 8, wc) == 1 && wc[0].src_qp == 0,
	      "a send's count is not its src_qp");
	for (i = 0, ret = 0; i < 3 && !ret; i++)
		ret = vrdma_post_send(&qp->vqp.qp, &sw, &sbad);
	CHECK(ret == 0 && vrdma_post_send(&qp->vqp.qp, &sw, &sbad) == ENOMEM,
	      "three retired, three more, then refused");
	/* An unsignaled WQE failed (its own count, 9), then a flush. */
	wr(qp->sq.hdr, 4, 4, 19);
	device_cqe(cq, 9, 12, 1, 0, 0x77, 0, none, 9);
	device_cqe(cq, 10, 5, 0, 0, 0x77, 0, none, 10);
	CHECK(vrdma_poll_cq(&cq->vcq.cq, 8, wc) == 2, "error and flush polled");
	for (i = 0, ret = 0; i < 7 && !ret; i++)
		ret = vrdma_post_send(&qp->vqp.qp, &sw, &sbad);
	CHECK(ret == 0 && vrdma_post_send(&qp->vqp.qp, &sw, &sbad) == ENOMEM,
	      "seven more after ten retired");
	/* A count past what was posted (from before a RESET) is not taken. */
	wr(qp->sq.hdr, 4, 4, 26);
	device_cqe(cq, 99, 0, 0, 0, 0x77, 0, none, 1000);
	vrdma_poll_cq(&cq->vcq.cq, 8, wc);
	CHECK(vrdma_post_send(&qp->vqp.qp, &sw, &sbad) == ENOMEM,
	      "a count from nowhere retires nothing");
	/* Another QP's completion on the CQ retires none of these. */
	device_cqe(cq, 11, 0, 0, 0, 0x78, 0, none, 26);
	vrdma_poll_cq(&cq->vcq.cq, 8, wc);
	CHECK(vrdma_post_send(&qp->vqp.qp, &sw, &sbad) == ENOMEM,
	      "another QP's count");

	/* Receives: 64 posted and taken, the 65th refused until one completes. */
	for (i = 0, ret = 0; i < 64 && !ret; i++)
		ret = vrdma_post_recv(&qp->vqp.qp, &rw, &rbad);
	wr(qp->rq.hdr, 4, 4, 64);
	CHECK(ret == 0 && vrdma_post_recv(&qp->vqp.qp, &rw, &rbad) == ENOMEM,
	      "max_recv_wr outstanding: the 65th refused");
	/* A flushed receive counts (its opcode's RECV bit), a send's does not. */
	device_cqe(cq, 1, 5, 128, 0, 0x77, 0, none, 0);
	device_cqe(cq, 12, 0, 0, 0, 0x77, 0, none, 27);
	vrdma_poll_cq(&cq->vcq.cq, 8, wc);
	CHECK(vrdma_post_recv(&qp->vqp.qp, &rw, &rbad) == 0 &&
	      vrdma_post_recv(&qp->vqp.qp, &rw, &rbad) == ENOMEM,
	      "one receive retired, one more posted");
	vrdma_cq_del_qp(cq, qp, true);
	vrdma_cq_del_qp(cq, qp, false);
}

static void test_sizes(void)
{
	CHECK(vrdma_ring_entries(1, 32) == 128, "a CQ ring fills a page");
	CHECK(vrdma_ring_entries(129, 32) == 256, "rounded to a power of two");
	CHECK(vrdma_ring_entries(0, 4096) == 2, "at least 2");
	CHECK(vrdma_ring_entries(100, 128) == 128, "send ring of 128-byte slots");
	CHECK(vrdma_ring_entries(0x80000001U, 64) == 0, "past 32 bits: none");
	CHECK(vrdma_ring_entries(5, 0) == 0, "no stride: none");
}

int main(void)
{
	make_context();
	test_sizes();
	test_send();
	test_ud();
	test_recv();
	test_srq();
	test_cq();
	test_counts();
	printf("%d passed, %d failed\n", passed, failed);
	return failed ? 1 : 0;
}
