// SPDX-License-Identifier: GPL-2.0 OR Linux-OpenIB
/*
 * virtio-rdma: the provider's device and context, the doorbell area and its
 * kick (spec §8), ring memory, and the verbs that are the kernel's alone:
 * queries, PDs, MRs and address handles.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <ccan/minmax.h>
#include <infiniband/cmd_ioctl.h>
#include <rdma/ib_user_ioctl_cmds.h>
#include <util/util.h>

#include "virtio_rdma.h"

/* --- doorbells (spec §8.3) ------------------------------------------------ */

/*
 * The kick (spec §8.7): a method of the device object, with no attribute.
 * The driver kicks the doorbellq of this context's device.
 */
static void vrdma_kick(struct vrdma_context *ctx)
{
	DECLARE_COMMAND_BUFFER(cmd, UVERBS_OBJECT_DEVICE,
			       VIRTIO_RDMA_IB_METHOD_KICK, 0);
	int ret;

	ret = execute_ioctl(&ctx->ibv_ctx.context, cmd);
	if (ret && !atomic_exchange(&ctx->kick_failed, true))
		verbs_err(&ctx->ibv_ctx,
			  "virtio_rdma: the kick failed (%d): the device may take posted work late\n",
			  ret);
}

/*
 * Rings doorbell @index of the context: the caller has stored the ring's
 * producer index (or a CQ's arm word) with release ordering. The bitmap
 * bit, then its summary bit, a full barrier, and a kick unless the device
 * says it polls the area (its poll word, read after the barrier: either
 * the device's last scan sees the bits or this sees 0, spec §8.5).
 */
void vrdma_ring_doorbell(struct vrdma_context *ctx, uint32_t index)
{
	_Atomic(uint64_t) *bitmap = (void *)(ctx->db + VIRTIO_RDMA_DB_BITMAP);
	_Atomic(uint64_t) *summary = (void *)(ctx->db + VIRTIO_RDMA_DB_SUMMARY);
	_Atomic(uint32_t) *poll = (void *)(ctx->db + VIRTIO_RDMA_DB_POLL);

	atomic_fetch_or_explicit(&bitmap[index / 64],
				 htole64(1ULL << (index % 64)),
				 memory_order_release);
	atomic_fetch_or_explicit(&summary[index / 4096],
				 htole64(1ULL << ((index / 64) % 64)),
				 memory_order_release);
	atomic_thread_fence(memory_order_seq_cst);
	if (!(ctx->flags & VIRTIO_RDMA_UCTX_DOORBELL_POLL) ||
	    !atomic_load_explicit(poll, memory_order_relaxed))
		vrdma_kick(ctx);
}

/* --- ring memory ------------------------------------------------------------ */

/* The system's page size, and never less than the device's 4096 bytes. */
static size_t vrdma_page_size(void)
{
	long pg = sysconf(_SC_PAGESIZE);

	return pg > VIRTIO_RDMA_PAGE_SIZE ? (size_t)pg : VIRTIO_RDMA_PAGE_SIZE;
}

size_t vrdma_page_align(size_t len)
{
	return align(len, vrdma_page_size());
}

/*
 * Zeroed anonymous pages that a child process does not inherit once fork
 * support is on (ibv_fork_init): the driver pins them for the device.
 */
int vrdma_buf_alloc(struct vrdma_buf *b, size_t len)
{
	int ret;

	b->len = vrdma_page_align(len);
	b->addr = mmap(NULL, b->len, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (b->addr == MAP_FAILED) {
		b->addr = NULL;
		return errno;
	}
	ret = ibv_dontfork_range(b->addr, b->len);
	if (ret) {
		munmap(b->addr, b->len);
		b->addr = NULL;
		return ret;
	}
	return 0;
}

void vrdma_buf_free(struct vrdma_buf *b)
{
	if (!b->addr)
		return;
	ibv_dofork_range(b->addr, b->len);
	munmap(b->addr, b->len);
	b->addr = NULL;
}

/*
 * Entries of a ring of @stride-byte slots holding at least @want: a power
 * of two that fills at least a page, as the kernel driver sizes its rings
 * (spec §6.5). 0 when @stride is 0 (no stride fits) or no such ring fits
 * in 32 bits.
 */
uint32_t vrdma_ring_entries(uint32_t want, uint32_t stride)
{
	uint64_t n = max_t(uint64_t, want, 2);

	if (!stride)
		return 0;
	n = max_t(uint64_t, n, VIRTIO_RDMA_PAGE_SIZE / stride);
	n = roundup_pow_of_two(n);
	return n > UINT32_MAX ? 0 : (uint32_t)n;
}

/* The ring as the driver takes it in a create verb's driver data. */
void vrdma_uring(const struct vrdma_ring *r, struct virtio_rdma_uring *u)
{
	memset(u, 0, sizeof(*u));
	if (!r->buf)
		return;
	u->buf = (uintptr_t)r->buf;
	u->header = (uintptr_t)r->hdr;
	u->entries = r->entries;
	u->stride = r->stride;
}

/* --- device, port, PDs, MRs -------------------------------------------------- */

static int vrdma_query_device(struct ibv_context *ibctx,
			      const struct ibv_query_device_ex_input *input,
			      struct ibv_device_attr_ex *attr, size_t attr_size)
{
	struct ib_uverbs_ex_query_device_resp resp;
	size_t resp_size = sizeof(resp);
	uint64_t fw;
	int ret;

	ret = ibv_cmd_query_device_any(ibctx, input, attr, attr_size, &resp,
				       &resp_size);
	if (ret)
		return ret;
	fw = resp.base.fw_ver;
	snprintf(attr->orig_attr.fw_ver, sizeof(attr->orig_attr.fw_ver),
		 "%u.%u.%u", (unsigned int)(fw >> 32) & 0xffff,
		 (unsigned int)(fw >> 16) & 0xffff, (unsigned int)fw & 0xffff);
	return 0;
}

static int vrdma_query_port(struct ibv_context *ibctx, uint8_t port,
			    struct ibv_port_attr *attr)
{
	struct ibv_query_port cmd = {};

	return ibv_cmd_query_port(ibctx, port, attr, &cmd, sizeof(cmd));
}

static struct ibv_pd *vrdma_alloc_pd(struct ibv_context *ibctx)
{
	struct ibv_alloc_pd cmd = {};
	struct ib_uverbs_alloc_pd_resp resp = {};
	struct ibv_pd *pd;
	int ret;

	pd = calloc(1, sizeof(*pd));
	if (!pd) {
		errno = ENOMEM;
		return NULL;
	}
	ret = ibv_cmd_alloc_pd(ibctx, pd, &cmd, sizeof(cmd), &resp,
			       sizeof(resp));
	if (ret) {
		free(pd);
		errno = ret;
		return NULL;
	}
	return pd;
}

static int vrdma_dealloc_pd(struct ibv_pd *pd)
{
	int ret;

	ret = ibv_cmd_dealloc_pd(pd);
	if (ret)
		return ret;
	free(pd);
	return 0;
}

static struct ibv_mr *vrdma_reg_mr(struct ibv_pd *pd, void *addr,
				   size_t length, uint64_t hca_va, int access)
{
	struct ibv_reg_mr cmd = {};
	struct ib_uverbs_reg_mr_resp resp = {};
	struct verbs_mr *vmr;
	int ret;

	vmr = calloc(1, sizeof(*vmr));
	if (!vmr) {
		errno = ENOMEM;
		return NULL;
	}
	ret = ibv_cmd_reg_mr(pd, addr, length, hca_va, access, vmr, &cmd,
			     sizeof(cmd), &resp, sizeof(resp));
	if (ret) {
		free(vmr);
		errno = ret;
		return NULL;
	}
	return &vmr->ibv_mr;
}

static int vrdma_dereg_mr(struct verbs_mr *vmr)
{
	int ret;

	ret = ibv_cmd_dereg_mr(vmr);
	if (ret)
		return ret;
	free(vmr);
	return 0;
}

/* --- memory windows (spec §6.20, §7.6) ------------------------------------- */

static struct ibv_mw *vrdma_alloc_mw(struct ibv_pd *pd, enum ibv_mw_type type)
{
	struct ibv_alloc_mw cmd = {};
	struct ib_uverbs_alloc_mw_resp resp = {};
	struct ibv_mw *mw;
	int ret;

	if (type != IBV_MW_TYPE_1 && type != IBV_MW_TYPE_2) {
		errno = EINVAL;
		return NULL;
	}
	mw = calloc(1, sizeof(*mw));
	if (!mw) {
		errno = ENOMEM;
		return NULL;
	}
	ret = ibv_cmd_alloc_mw(pd, type, mw, &cmd, sizeof(cmd), &resp,
			       sizeof(resp));
	if (ret) {
		free(mw);
		errno = ret;
		return NULL;
	}
	return mw;
}

static int vrdma_dealloc_mw(struct ibv_mw *mw)
{
	int ret;

	ret = ibv_cmd_dealloc_mw(mw);
	if (ret)
		return ret;
	free(mw);
	return 0;
}

/* --- address handles (spec §7.5) --------------------------------------------- */

/*
 * The kernel resolves the destination MAC and answers with the AV that UD
 * send WQEs carry; the device holds nothing per AH. RoCE needs a GRH.
 */
static struct ibv_ah *vrdma_create_ah(struct ibv_pd *pd,
				      struct ibv_ah_attr *attr)
{
	struct vrdma_create_ah_resp resp = {};
	struct vrdma_ah *ah;
	int ret;

	if (!attr->is_global) {
		errno = EINVAL;
		return NULL;
	}
	ah = calloc(1, sizeof(*ah));
	if (!ah) {
		errno = ENOMEM;
		return NULL;
	}
	ret = ibv_cmd_create_ah(pd, &ah->ibv_ah, attr, &resp.ibv_resp,
				sizeof(resp));
	if (ret) {
		free(ah);
		errno = ret;
		return NULL;
	}
	static_assert(sizeof(resp.av) == sizeof(ah->av), "AV size");
	memcpy(&ah->av, resp.av, sizeof(ah->av));
	return &ah->ibv_ah;
}

static int vrdma_destroy_ah(struct ibv_ah *ibah)
{
	int ret;

	ret = ibv_cmd_destroy_ah(ibah);
	if (ret)
		return ret;
	free(to_vah(ibah));
	return 0;
}

/* --- context ------------------------------------------------------------------ */

static void vrdma_free_context(struct ibv_context *ibctx);

static const struct verbs_context_ops vrdma_ctx_ops = {
	.alloc_mw = vrdma_alloc_mw,
	.alloc_pd = vrdma_alloc_pd,
	.bind_mw = vrdma_bind_mw,
	.create_ah = vrdma_create_ah,
	.create_cq = vrdma_create_cq,
	.create_cq_ex = vrdma_create_cq_ex,
	.create_qp = vrdma_create_qp,
	.create_qp_ex = vrdma_create_qp_ex,
	.create_srq = vrdma_create_srq,
	.dealloc_mw = vrdma_dealloc_mw,
	.dealloc_pd = vrdma_dealloc_pd,
	.dereg_mr = vrdma_dereg_mr,
	.destroy_ah = vrdma_destroy_ah,
	.destroy_cq = vrdma_destroy_cq,
	.destroy_qp = vrdma_destroy_qp,
	.destroy_srq = vrdma_destroy_srq,
	.free_context = vrdma_free_context,
	.modify_qp = vrdma_modify_qp,
	.modify_srq = vrdma_modify_srq,
	.poll_cq = vrdma_poll_cq,
	.post_recv = vrdma_post_recv,
	.post_send = vrdma_post_send,
	.post_srq_recv = vrdma_post_srq_recv,
	.query_device_ex = vrdma_query_device,
	.query_port = vrdma_query_port,
	.query_qp = vrdma_query_qp,
	.query_srq = vrdma_query_srq,
	.reg_mr = vrdma_reg_mr,
	.req_notify_cq = vrdma_req_notify_cq,
	.resize_cq = vrdma_resize_cq,
};

/* The doorbell area the driver answered with must be one of spec §8.1's. */
static bool vrdma_doorbell_ok(const struct virtio_rdma_alloc_ucontext_resp *r)
{
	uint32_t bits = r->doorbell_bits;

	if (bits < VIRTIO_RDMA_DB_MIN_BITS || bits > VIRTIO_RDMA_DB_MAX_BITS ||
	    (bits & (bits - 1)))
		return false;
	return r->doorbell_size >= VIRTIO_RDMA_DB_BITMAP + bits / 8 &&
	       r->doorbell_size % VIRTIO_RDMA_PAGE_SIZE == 0;
}

static struct verbs_context *vrdma_alloc_context(struct ibv_device *ibdev,
						 int cmd_fd,
						 void *private_data)
{
	struct ibv_get_context cmd = {};
	struct vrdma_alloc_ucontext_resp resp = {};
	struct ibv_device_attr_ex dattr;
	struct vrdma_context *ctx;
	int ret;

	ctx = verbs_init_and_alloc_context(ibdev, cmd_fd, ctx, ibv_ctx,
					   RDMA_DRIVER_UNKNOWN);
	if (!ctx)
		return NULL;
	atomic_init(&ctx->kick_failed, false);
	ret = ibv_cmd_get_context(&ctx->ibv_ctx, &cmd, sizeof(cmd),
				  &resp.ibv_resp, sizeof(resp));
	if (ret)
		goto uninit;
	if (!vrdma_doorbell_ok(&resp.drv_payload)) {
		verbs_err(&ctx->ibv_ctx,
			  "virtio_rdma: the driver gave a doorbell area of %u bits in %u bytes\n",
			  resp.doorbell_bits, resp.doorbell_size);
		ret = EPROTO;
		goto uninit;
	}
	ctx->db_bits = resp.doorbell_bits;
	ctx->db_size = resp.doorbell_size;
	ctx->flags = resp.flags;
	ctx->max_inline = resp.max_inline_data;
	ctx->db = mmap(NULL, ctx->db_size, PROT_READ | PROT_WRITE, MAP_SHARED,
		       cmd_fd, resp.doorbell_offset);
	if (ctx->db == MAP_FAILED) {
		ret = errno;
		verbs_err(&ctx->ibv_ctx,
			  "virtio_rdma: mapping the doorbell area failed (%d)\n",
			  ret);
		goto uninit;
	}

	/* The limits rings are sized against. */
	ret = ibv_cmd_query_device_any(&ctx->ibv_ctx.context, NULL, &dattr,
				       sizeof(dattr.orig_attr), NULL, NULL);
	if (ret)
		goto unmap;
	ctx->max_qp_wr = dattr.orig_attr.max_qp_wr;
	ctx->max_sge = dattr.orig_attr.max_sge;
	ctx->max_cqe = dattr.orig_attr.max_cqe;
	ctx->max_srq_wr = dattr.orig_attr.max_srq_wr;
	ctx->max_srq_sge = dattr.orig_attr.max_srq_sge;

	verbs_set_ops(&ctx->ibv_ctx, &vrdma_ctx_ops);
	return &ctx->ibv_ctx;

unmap:
	munmap(ctx->db, ctx->db_size);
uninit:
	verbs_uninit_context(&ctx->ibv_ctx);
	free(ctx);
	errno = ret;
	return NULL;
}

static void vrdma_free_context(struct ibv_context *ibctx)
{
	struct vrdma_context *ctx = to_vctx(ibctx);

	munmap(ctx->db, ctx->db_size);
	verbs_uninit_context(&ctx->ibv_ctx);
	free(ctx);
}

/* --- device ------------------------------------------------------------------- */

static struct verbs_device *vrdma_alloc_device(struct verbs_sysfs_dev *sdev)
{
	struct vrdma_device *dev;

	dev = calloc(1, sizeof(*dev));
	if (!dev)
		return NULL;
	return &dev->ibv_dev;
}

static void vrdma_uninit_device(struct verbs_device *vdev)
{
	free(container_of(vdev, struct vrdma_device, ibv_dev));
}

/*
 * The ib_device's parent is the virtio device (ID 42), whose modalias the
 * uverbs device shows; the kernel driver registers no driver ID of its own.
 */
static const struct verbs_match_ent vrdma_match_table[] = {
	VERBS_MODALIAS_MATCH("virtio:d0000002Av*", NULL),
	{}
};

static const struct verbs_device_ops vrdma_dev_ops = {
	.name = "virtio_rdma",
	.match_min_abi_version = VIRTIO_RDMA_ABI_VERSION,
	.match_max_abi_version = VIRTIO_RDMA_ABI_VERSION,
	.match_table = vrdma_match_table,
	.alloc_device = vrdma_alloc_device,
	.uninit_device = vrdma_uninit_device,
	.alloc_context = vrdma_alloc_context,
};
PROVIDER_DRIVER(virtio_rdma, vrdma_dev_ops);
