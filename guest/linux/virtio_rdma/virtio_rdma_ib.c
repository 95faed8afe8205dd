// SPDX-License-Identifier: GPL-2.0
/*
 * virtio-rdma: the RDMA device registered with ib_core — the kernel's
 * verbs on the device's commands (spec §6), rings (§7), doorbells (§8)
 * and completion notification (§9).
 *
 * Every object lives in the kernel's own context. Rings are kernel pages,
 * physically contiguous, given to the device by their guest-physical
 * addresses (the device does not offer ACCESS_PLATFORM); ring headers are
 * 64-byte allocations of their own. The device writes a CQ's producer
 * index and CQEs, and a work ring's consumer index; the driver writes the
 * rest, publishing each index with release semantics after the entries it
 * covers.
 */
#include <linux/log2.h>
#include <linux/slab.h>
#include <rdma/ib_addr.h>
#include <rdma/ib_mad.h>
#include <rdma/ib_umem.h>
#include <rdma/uverbs_ioctl.h>

#include "virtio_rdma.h"

#define VRDMA_WQ_PRODUCER(r) ((__le32 *)((r)->header))
#define VRDMA_WQ_CONSUMER(r) ((__le32 *)((r)->header) + 1)
#define VRDMA_CQ_PRODUCER(r) ((__le32 *)((r)->header))
#define VRDMA_CQ_CONSUMER(r) ((__le32 *)((r)->header) + 1)
#define VRDMA_CQ_ARM(r) ((__le64 *)((r)->header) + 1)

/*
 * A ring's index words as the device shares them (spec §7.1), ordered for
 * any device, not only for this host's CPUs: the entries an index covers
 * are read only after it is read, and written (or read out) before it is
 * written.
 */
static inline u32 vrdma_index_read(__le32 *p)
{
	u32 v;

	/* Acquire: ordered before what this CPU reads next. */
	v = le32_to_cpu(smp_load_acquire(p));
	/* The entries before the index, as the device wrote them. */
	dma_rmb();
	return v;
}

static inline void vrdma_index_write(__le32 *p, u32 v)
{
	/* The entries before the index are the device's to read or reuse. */
	dma_wmb();
	/* Release: after what this CPU wrote or read of them. */
	smp_store_release(p, cpu_to_le32(v));
}

/* What the driver does of the device's capabilities (kernel verbs). */
#define VRDMA_CAP_FLAGS (IB_DEVICE_CURR_QP_STATE_MOD | IB_DEVICE_RC_RNR_NAK_GEN | \
			 IB_DEVICE_PORT_ACTIVE_EVENT | IB_DEVICE_SYS_IMAGE_GUID | \
			 IB_DEVICE_MEM_MGT_EXTENSIONS | IB_DEVICE_MEM_WINDOW | \
			 IB_DEVICE_MEM_WINDOW_TYPE_2B)

static inline struct vrdma_pd *to_vpd(struct ib_pd *pd)
{
	return container_of(pd, struct vrdma_pd, ibpd);
}

static inline struct vrdma_cq *to_vcq(struct ib_cq *cq)
{
	return container_of(cq, struct vrdma_cq, ibcq);
}

static inline struct vrdma_qp *to_vqp(struct ib_qp *qp)
{
	return container_of(qp, struct vrdma_qp, ibqp);
}

static inline struct vrdma_srq *to_vsrq(struct ib_srq *srq)
{
	return container_of(srq, struct vrdma_srq, ibsrq);
}

static inline struct vrdma_mw *to_vmw(struct ib_mw *mw)
{
	return container_of(mw, struct vrdma_mw, ibmw);
}

static inline struct vrdma_ah *to_vah(struct ib_ah *ah)
{
	return container_of(ah, struct vrdma_ah, ibah);
}

/* --- doorbells (spec §8.3) ---------------------------------------------- */

/*
 * Rings doorbell @index of the kernel's context: its bitmap bit, then its
 * summary bit, a full barrier, and a kick of the doorbellq unless the
 * device says it polls the area.
 */
void vrdma_ring_doorbell(struct vrdma_dev *dev, u32 index)
{
	u8 *area = dev->doorbell_area;
	__le32 *poll = (__le32 *)(area + VIRTIO_RDMA_DB_POLL);

	set_bit_le(index, area + VIRTIO_RDMA_DB_BITMAP);
	set_bit_le(index / 64, area + VIRTIO_RDMA_DB_SUMMARY);
	/*
	 * Both bits before the poll word is read: a device that stops polling
	 * writes 0 there, then scans once more (spec §8.5), so either it sees
	 * the bits or this sees 0 and kicks. A full barrier, for a device that
	 * is not one of this host's CPUs too.
	 */
	mb();
	if (!dev->doorbell_poll || !le32_to_cpu(READ_ONCE(*poll)))
		virtqueue_notify(dev->vqs[VIRTIO_RDMA_VQ_DOORBELL]);
}

/* --- rings --------------------------------------------------------------- */

static int vrdma_ring_alloc(struct vrdma_ring *r, u32 entries, u32 stride)
{
	r->entries = entries;
	r->stride = stride;
	r->size = (size_t)entries * stride;
	r->index = 0;
	r->buf = alloc_pages_exact(r->size, GFP_KERNEL | __GFP_ZERO);
	/* kmalloc aligns a power-of-two size to itself: 64 bytes. */
	r->header = kzalloc(VIRTIO_RDMA_RING_HEADER_SIZE, GFP_KERNEL);
	if (!r->buf || !r->header) {
		if (r->buf)
			free_pages_exact(r->buf, r->size);
		kfree(r->header);
		r->buf = NULL;
		r->header = NULL;
		return -ENOMEM;
	}
	return 0;
}

static void vrdma_ring_free(struct vrdma_dev *dev, struct vrdma_ring *r)
{
	vrdma_free_pages(dev, r->buf, r->size);
	vrdma_kfree(dev, r->header);
	r->buf = NULL;
	r->header = NULL;
}

static u32 vrdma_ring_pages(const struct vrdma_ring *r)
{
	return r->buf ? r->size / VIRTIO_RDMA_PAGE_SIZE : 0;
}

static void vrdma_ring_desc(const struct vrdma_ring *r,
			    struct virtio_rdma_ring *d, u64 *pages)
{
	u32 i, n = vrdma_ring_pages(r);

	memset(d, 0, sizeof(*d));
	if (!r->buf)
		return;
	d->header = cpu_to_le64(virt_to_phys(r->header));
	d->entries = cpu_to_le32(r->entries);
	d->stride = cpu_to_le32(r->stride);
	d->npages = cpu_to_le32(n);
	for (i = 0; i < n; i++)
		pages[i] = virt_to_phys(r->buf) + (u64)i * VIRTIO_RDMA_PAGE_SIZE;
}

static void *vrdma_ring_slot(const struct vrdma_ring *r, u32 index)
{
	return (u8 *)r->buf + (size_t)(index & (r->entries - 1)) * r->stride;
}

/*
 * Entries for a ring of @stride-byte slots holding at least @want: a power
 * of two that fills at least a page (spec §6.5).
 */
static u32 vrdma_ring_entries(u32 want, u32 stride)
{
	return roundup_pow_of_two(max3(want, 2U, VIRTIO_RDMA_PAGE_SIZE / stride));
}

/* --- device and port ----------------------------------------------------- */

static int vrdma_query_device(struct ib_device *ib, struct ib_device_attr *a,
			      struct ib_udata *udata)
{
	struct vrdma_dev *dev = to_vdev(ib);
	const struct virtio_rdma_device_attr *d = &dev->attr;

	if (udata && (udata->inlen || udata->outlen))
		return -EINVAL;
	memset(a, 0, sizeof(*a));
	a->sys_image_guid = cpu_to_be64(le64_to_cpu(d->sys_image_guid));
	a->max_mr_size = le64_to_cpu(d->max_mr_size);
	a->page_size_cap = le64_to_cpu(d->page_size_cap);
	a->vendor_id = le32_to_cpu(d->vendor_id);
	a->vendor_part_id = le32_to_cpu(d->vendor_part_id);
	a->hw_ver = le32_to_cpu(d->hw_ver);
	a->max_qp = le32_to_cpu(d->max_qp);
	a->max_qp_wr = le32_to_cpu(d->max_qp_wr);
	a->device_cap_flags = le64_to_cpu(d->device_cap_flags) & VRDMA_CAP_FLAGS;
	a->max_send_sge = le32_to_cpu(d->max_sge);
	a->max_recv_sge = le32_to_cpu(d->max_sge);
	a->max_sge_rd = le32_to_cpu(d->max_sge_rd);
	a->max_cq = le32_to_cpu(d->max_cq);
	a->max_cqe = le32_to_cpu(d->max_cqe);
	a->max_mr = le32_to_cpu(d->max_mr);
	a->max_mw = le32_to_cpu(d->max_mw);
	a->max_pd = le32_to_cpu(d->max_pd);
	a->max_qp_rd_atom = le32_to_cpu(d->max_qp_rd_atom);
	a->max_qp_init_rd_atom = le32_to_cpu(d->max_qp_init_rd_atom);
	a->max_res_rd_atom = le32_to_cpu(d->max_res_rd_atom);
	a->max_srq = le32_to_cpu(d->max_srq);
	a->max_srq_wr = le32_to_cpu(d->max_srq_wr);
	a->max_srq_sge = le32_to_cpu(d->max_srq_sge);
	a->max_pkeys = 1;
	a->atomic_cap = d->atomic_cap == 1 ? IB_ATOMIC_HCA :
			d->atomic_cap == 2 ? IB_ATOMIC_GLOB : IB_ATOMIC_NONE;
	a->local_ca_ack_delay = d->local_ca_ack_delay;
	a->max_ah = le32_to_cpu(d->max_qp);
	a->max_fast_reg_page_list_len = le32_to_cpu(d->max_fast_reg_page_list_len);
	return 0;
}

static int vrdma_query_port(struct ib_device *ib, u32 port,
			    struct ib_port_attr *a)
{
	struct vrdma_dev *dev = to_vdev(ib);
	struct virtio_rdma_port_req req = { .port = cpu_to_le32(port) };
	struct virtio_rdma_port_attr now;
	const struct virtio_rdma_port_attr *p = &now;
	struct net_device *nd;
	int ret;

	/* The port's state now: it follows the device's link. */
	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_QUERY_PORT, 0, &req, sizeof(req),
			NULL, 0, &now, sizeof(now));
	if (ret)
		return ret;
	a->state = le32_to_cpu(p->state);
	a->phys_state = p->phys_state;
	a->max_mtu = le32_to_cpu(p->max_mtu);
	a->active_mtu = le32_to_cpu(p->active_mtu);
	a->gid_tbl_len = le32_to_cpu(p->gid_tbl_len);
	a->port_cap_flags = le32_to_cpu(p->port_cap_flags) | IB_PORT_CM_SUP;
	a->max_msg_sz = le32_to_cpu(p->max_msg_sz);
	a->pkey_tbl_len = 1;
	a->bad_pkey_cntr = 0;
	a->qkey_viol_cntr = 0;
	a->lid = 0;
	a->sm_lid = 0;
	a->lmc = 0;
	a->max_vl_num = 1;
	a->ip_gids = true;
	spin_lock(&dev->netdev_lock);
	nd = dev->netdev;
	if (nd)
		a->active_mtu = min_t(u32, a->active_mtu,
				      iboe_get_mtu(READ_ONCE(nd->mtu)));
	spin_unlock(&dev->netdev_lock);
	/* The sibling's link speed; a port with no netdev yet reports 1X SDR. */
	if (ib_get_eth_speed(ib, port, &a->active_speed, &a->active_width)) {
		a->active_speed = IB_SPEED_SDR;
		a->active_width = IB_WIDTH_1X;
	}
	return 0;
}

static enum rdma_link_layer vrdma_link_layer(struct ib_device *ib, u32 port)
{
	return IB_LINK_LAYER_ETHERNET;
}

static int vrdma_port_immutable(struct ib_device *ib, u32 port,
				struct ib_port_immutable *im)
{
	struct vrdma_dev *dev = to_vdev(ib);

	im->core_cap_flags = RDMA_CORE_PORT_IBA_ROCE_UDP_ENCAP;
	im->gid_tbl_len = le32_to_cpu(dev->port.gid_tbl_len);
	im->pkey_tbl_len = 1;
	im->max_mad_size = IB_MGMT_MAD_SIZE;
	return 0;
}

static int vrdma_query_pkey(struct ib_device *ib, u32 port, u16 index,
			    u16 *pkey)
{
	if (index)
		return -EINVAL;
	*pkey = IB_DEFAULT_PKEY_FULL;
	return 0;
}

/* ib_core's RoCE GID management: SET_GID (spec §6.30). */
static int vrdma_set_gid(struct vrdma_dev *dev, u32 index, u32 type,
			 const union ib_gid *gid)
{
	struct virtio_rdma_set_gid req = {
		.index = cpu_to_le32(index),
		.gid_type = cpu_to_le32(type),
	};

	if (gid)
		memcpy(req.gid, gid->raw, sizeof(req.gid));
	return vrdma_cmd(dev, VIRTIO_RDMA_CMD_SET_GID, dev->kctx, &req,
			 sizeof(req), NULL, 0, NULL, 0);
}

static int vrdma_add_gid(const struct ib_gid_attr *attr, void **context)
{
	if (attr->gid_type != IB_GID_TYPE_ROCE_UDP_ENCAP)
		return -EINVAL;
	return vrdma_set_gid(to_vdev(attr->device), attr->index,
			     VIRTIO_RDMA_GID_TYPE_ROCE_V2, &attr->gid);
}

static int vrdma_del_gid(const struct ib_gid_attr *attr, void **context)
{
	return vrdma_set_gid(to_vdev(attr->device), attr->index,
			     VIRTIO_RDMA_GID_TYPE_NONE, NULL);
}

/* --- PDs, MRs, AHs ------------------------------------------------------- */

static int vrdma_alloc_pd(struct ib_pd *ibpd, struct ib_udata *udata)
{
	struct vrdma_dev *dev = to_vdev(ibpd->device);
	struct vrdma_pd *pd = to_vpd(ibpd);
	struct virtio_rdma_handle_resp resp;
	int ret;

	pd->ctx = vrdma_udata_ctx(dev, udata);
	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_ALLOC_PD, pd->ctx, NULL, 0, NULL,
			0, &resp, sizeof(resp));
	if (ret)
		return ret;
	pd->handle = le32_to_cpu(resp.handle);
	return 0;
}

/*
 * Destroys object @h of context @ctx. A device that failed (ERR_DEVICE: it destroyed
 * everything, spec §10.4) or stopped answering holds the object no more:
 * the driver's side goes all the same, so that its consumers can let go.
 */
static int vrdma_destroy_handle(struct vrdma_dev *dev, u32 ctx, u16 opcode,
				u32 h)
{
	struct virtio_rdma_handle_req req = { .handle = cpu_to_le32(h) };
	int ret;

	ret = vrdma_cmd(dev, opcode, ctx, &req, sizeof(req), NULL, 0, NULL, 0);
	if (ret == -EIO || ret == -ETIMEDOUT)
		return 0;
	return ret;
}

static int vrdma_dealloc_pd(struct ib_pd *ibpd, struct ib_udata *udata)
{
	return vrdma_destroy_handle(to_vdev(ibpd->device), to_vpd(ibpd)->ctx,
				    VIRTIO_RDMA_CMD_DEALLOC_PD,
				    to_vpd(ibpd)->handle);
}

/* The DMA MR: guest-physical addresses, the dma_device's mapping. */
static struct ib_mr *vrdma_get_dma_mr(struct ib_pd *ibpd, int flags)
{
	struct vrdma_dev *dev = to_vdev(ibpd->device);
	struct virtio_rdma_reg_dma_mr req = {
		.pd = cpu_to_le32(to_vpd(ibpd)->handle),
		.access = cpu_to_le32(vrdma_access(flags)),
	};
	struct virtio_rdma_mr_resp resp;
	struct vrdma_mr *mr;
	int ret;

	mr = kzalloc(sizeof(*mr), GFP_KERNEL);
	if (!mr)
		return ERR_PTR(-ENOMEM);
	mr->ctx = to_vpd(ibpd)->ctx;
	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_REG_DMA_MR, mr->ctx, &req,
			sizeof(req), NULL, 0, &resp, sizeof(resp));
	if (ret) {
		kfree(mr);
		return ERR_PTR(ret);
	}
	mr->ibmr.lkey = le32_to_cpu(resp.lkey);
	mr->ibmr.rkey = le32_to_cpu(resp.rkey);
	return &mr->ibmr;
}

static int vrdma_dereg_mr(struct ib_mr *ibmr, struct ib_udata *udata)
{
	struct vrdma_mr *mr = container_of(ibmr, struct vrdma_mr, ibmr);
	int ret;

	ret = vrdma_destroy_handle(to_vdev(ibmr->device), mr->ctx,
				   VIRTIO_RDMA_CMD_DEREG_MR, ibmr->lkey);
	if (ret)
		return ret;
	/* The device reads the pages no more: they may go. */
	vrdma_umem_release(to_vdev(ibmr->device), mr->umem);
	vrdma_kfree(to_vdev(ibmr->device), mr->pages);
	kfree(mr);
	return 0;
}

/* A fast-registration MR (spec §6.18): invalid until a REG_MR request. */
static struct ib_mr *vrdma_alloc_mr(struct ib_pd *ibpd, enum ib_mr_type type,
				    u32 max_num_sg)
{
	struct vrdma_dev *dev = to_vdev(ibpd->device);
	struct virtio_rdma_alloc_mr req = {
		.pd = cpu_to_le32(to_vpd(ibpd)->handle),
		.max_pages = cpu_to_le32(max_num_sg),
	};
	struct virtio_rdma_mr_resp resp;
	struct vrdma_mr *mr;
	int ret;

	if (type != IB_MR_TYPE_MEM_REG)
		return ERR_PTR(-EOPNOTSUPP);
	if (!max_num_sg ||
	    max_num_sg > le32_to_cpu(dev->attr.max_fast_reg_page_list_len))
		return ERR_PTR(-EINVAL);
	mr = kzalloc(sizeof(*mr), GFP_KERNEL);
	if (!mr)
		return ERR_PTR(-ENOMEM);
	/* kmalloc's memory is physically contiguous: one GPA names it. */
	mr->pages = kcalloc(max_num_sg, sizeof(*mr->pages), GFP_KERNEL);
	if (!mr->pages) {
		ret = -ENOMEM;
		goto free;
	}
	mr->max_pages = max_num_sg;
	mr->ctx = to_vpd(ibpd)->ctx;
	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_ALLOC_MR, mr->ctx, &req,
			sizeof(req), NULL, 0, &resp, sizeof(resp));
	if (ret)
		goto free;
	mr->ibmr.lkey = le32_to_cpu(resp.lkey);
	mr->ibmr.rkey = le32_to_cpu(resp.rkey);
	return &mr->ibmr;
free:
	/* An ALLOC_MR left unanswered may yet have named the list. */
	vrdma_kfree(dev, mr->pages);
	kfree(mr);
	return ERR_PTR(ret);
}

static int vrdma_set_page(struct ib_mr *ibmr, u64 addr)
{
	struct vrdma_mr *mr = container_of(ibmr, struct vrdma_mr, ibmr);

	if (mr->npages == mr->max_pages)
		return -ENOMEM;
	mr->pages[mr->npages++] = cpu_to_le64(addr);
	return 0;
}

static int vrdma_map_mr_sg(struct ib_mr *ibmr, struct scatterlist *sg,
			   int nents, unsigned int *offset)
{
	struct vrdma_mr *mr = container_of(ibmr, struct vrdma_mr, ibmr);

	mr->npages = 0;
	return ib_sg_to_pages(ibmr, sg, nents, offset, vrdma_set_page);
}

/*
 * A memory window (spec §6.20), for a process: ib_core has no kernel
 * verb that binds one. Its process binds it by a BIND_MW work request.
 */
static int vrdma_alloc_mw(struct ib_mw *ibmw, struct ib_udata *udata)
{
	struct vrdma_dev *dev = to_vdev(ibmw->device);
	struct vrdma_pd *pd = to_vpd(ibmw->pd);
	struct vrdma_mw *mw = to_vmw(ibmw);
	struct virtio_rdma_alloc_mw req = {
		.pd = cpu_to_le32(pd->handle),
		.mw_type = cpu_to_le32(ibmw->type == IB_MW_TYPE_1 ? 1 : 2),
	};
	struct virtio_rdma_handle_resp resp;
	int ret;

	mw->ctx = pd->ctx;
	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_ALLOC_MW, mw->ctx, &req,
			sizeof(req), NULL, 0, &resp, sizeof(resp));
	if (ret)
		return ret;
	ibmw->rkey = le32_to_cpu(resp.handle);
	return 0;
}

static int vrdma_dealloc_mw(struct ib_mw *ibmw)
{
	/* The window's index names it, whatever key its binds gave it. */
	return vrdma_destroy_handle(to_vdev(ibmw->device), to_vmw(ibmw)->ctx,
				    VIRTIO_RDMA_CMD_DEALLOC_MW, ibmw->rkey);
}

static void vrdma_av_of(struct virtio_rdma_av *av,
			const struct rdma_ah_attr *ah)
{
	const struct ib_global_route *grh = rdma_ah_read_grh(ah);

	memset(av, 0, sizeof(*av));
	memcpy(av->dgid, grh->dgid.raw, sizeof(av->dgid));
	/* Consumers pass wider values (UCX: ~path index) for the device to cut. */
	av->flow_label = cpu_to_le32(grh->flow_label &
				     VIRTIO_RDMA_FLOW_LABEL_MASK);
	av->sgid_index = grh->sgid_index;
	av->hop_limit = grh->hop_limit;
	av->traffic_class = grh->traffic_class;
	av->sl = rdma_ah_get_sl(ah);
	memcpy(av->dmac, ah->roce.dmac, ETH_ALEN);
}

static int vrdma_create_ah(struct ib_ah *ibah, struct rdma_ah_init_attr *init,
			   struct ib_udata *udata)
{
	struct vrdma_ah *ah = to_vah(ibah);
	struct virtio_rdma_create_ah_uresp resp;

	if (!(rdma_ah_get_ah_flags(init->ah_attr) & IB_AH_GRH))
		return -EINVAL;
	vrdma_av_of(&ah->av, init->ah_attr);
	if (!udata)
		return 0;
	/* The process puts the AV, its MAC resolved here, in its WQEs. */
	BUILD_BUG_ON(sizeof(resp.av) != sizeof(ah->av));
	memcpy(resp.av, &ah->av, sizeof(resp.av));
	return ib_copy_to_udata(udata, &resp, min(sizeof(resp), udata->outlen));
}

static int vrdma_destroy_ah(struct ib_ah *ibah, u32 flags)
{
	return 0;
}

/* --- CQs ----------------------------------------------------------------- */

/*
 * A user CQ's ring from a create's or resize's driver data (both are the
 * ring alone): more entries than @cqe, and its page array allocated for
 * vrdma_uring_get (kvfree'd by the caller).
 */
static int vrdma_cq_uring_req(struct ib_udata *udata, int cqe,
			      struct virtio_rdma_uring *u, u64 **pages,
			      u32 *npages)
{
	int ret;

	BUILD_BUG_ON(sizeof(struct virtio_rdma_create_cq_ureq) != sizeof(*u));
	BUILD_BUG_ON(sizeof(struct virtio_rdma_resize_cq_ureq) != sizeof(*u));
	if (udata->inlen < sizeof(*u))
		return -EINVAL;
	ret = ib_copy_from_udata(u, udata, sizeof(*u));
	if (ret)
		return ret;
	if (u->entries <= cqe)
		return -EINVAL;
	*npages = vrdma_uring_npages(u);
	if (!*npages)
		return -EINVAL;
	*pages = kvcalloc(*npages, sizeof(**pages), GFP_KERNEL);
	return *pages ? 0 : -ENOMEM;
}

/*
 * A CQ whose ring is in its process's memory (spec §8.7): the process
 * polls and arms it; the kernel only relays its notifications and events.
 */
static int vrdma_create_user_cq(struct ib_cq *ibcq,
				const struct ib_cq_init_attr *attr,
				struct ib_udata *udata)
{
	struct vrdma_dev *dev = to_vdev(ibcq->device);
	struct vrdma_cq *cq = to_vcq(ibcq);
	struct virtio_rdma_create_cq_uresp uresp = {};
	struct virtio_rdma_create_cq req;
	struct virtio_rdma_create_cq_resp resp;
	struct virtio_rdma_uring ring;
	u32 npages;
	u64 *pages;
	int ret;

	if (udata->outlen < sizeof(uresp) || attr->flags || attr->cqe < 1 ||
	    attr->cqe > le32_to_cpu(dev->attr.max_cqe))
		return -EINVAL;
	ret = vrdma_cq_uring_req(udata, attr->cqe, &ring, &pages, &npages);
	if (ret)
		return ret;
	spin_lock_init(&cq->lock);
	mutex_init(&cq->resize_lock);
	ret = vrdma_uring_get(ibcq->device, &ring, &cq->uring, &req.ring,
			      pages);
	if (ret)
		goto free;
	cq->ctx = vrdma_udata_ctx(dev, udata);
	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_CREATE_CQ, cq->ctx, &req,
			sizeof(req), pages, npages, &resp, sizeof(resp));
	if (ret)
		goto put;
	cq->handle = le32_to_cpu(resp.cq);
	cq->doorbell = le32_to_cpu(resp.doorbell);
	ibcq->cqe = le32_to_cpu(resp.entries) - 1;
	uresp.cq = cq->handle;
	uresp.doorbell = cq->doorbell;
	ret = ib_copy_to_udata(udata, &uresp, sizeof(uresp));
	if (!ret)
		ret = xa_insert_irq(&dev->cqs, cq->handle, cq, GFP_KERNEL);
	if (ret) {
		vrdma_destroy_handle(dev, cq->ctx, VIRTIO_RDMA_CMD_DESTROY_CQ,
				     cq->handle);
		goto put;
	}
	kvfree(pages);
	return 0;
put:
	vrdma_uring_put(dev, &cq->uring);
free:
	kvfree(pages);
	return ret;
}

static int vrdma_create_cq_udata(struct ib_cq *ibcq,
				 const struct ib_cq_init_attr *attr,
				 struct ib_udata *udata)
{
	struct vrdma_dev *dev = to_vdev(ibcq->device);
	struct vrdma_cq *cq = to_vcq(ibcq);
	struct virtio_rdma_create_cq req;
	struct virtio_rdma_create_cq_resp resp;
	u32 max = le32_to_cpu(dev->attr.max_cqe);
	u32 entries;
	u64 *pages;
	int ret;

	if (udata)
		return vrdma_create_user_cq(ibcq, attr, udata);
	if (attr->flags || attr->cqe < 1 || attr->cqe > max)
		return -EINVAL;
	entries = vrdma_ring_entries(attr->cqe + 1, sizeof(struct virtio_rdma_cqe));
	if (entries > max + 1)
		return -EINVAL;
	spin_lock_init(&cq->lock);
	mutex_init(&cq->resize_lock);
	ret = vrdma_ring_alloc(&cq->ring, entries, sizeof(struct virtio_rdma_cqe));
	if (ret)
		return ret;
	pages = kcalloc(vrdma_ring_pages(&cq->ring), sizeof(*pages), GFP_KERNEL);
	if (!pages) {
		ret = -ENOMEM;
		goto free;
	}
	vrdma_ring_desc(&cq->ring, &req.ring, pages);
	cq->ctx = dev->kctx;
	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_CREATE_CQ, cq->ctx, &req,
			sizeof(req), pages, vrdma_ring_pages(&cq->ring), &resp,
			sizeof(resp));
	kfree(pages);
	if (ret)
		goto free;
	cq->handle = le32_to_cpu(resp.cq);
	cq->doorbell = le32_to_cpu(resp.doorbell);
	/* The ring's entries, one slot always free (spec §6.13). */
	ibcq->cqe = entries - 1;
	ret = xa_insert_irq(&dev->cqs, cq->handle, cq, GFP_KERNEL);
	if (ret) {
		vrdma_destroy_handle(dev, cq->ctx, VIRTIO_RDMA_CMD_DESTROY_CQ,
				     cq->handle);
		goto free;
	}
	return 0;
free:
	vrdma_ring_free(dev, &cq->ring);
	return ret;
}

/* Linux 6.10 passes create_cq the uverbs attributes (NULL for the kernel's). */
#ifdef VRDMA_CREATE_CQ_ATTRS
static int vrdma_create_cq(struct ib_cq *ibcq, const struct ib_cq_init_attr *attr,
			   struct uverbs_attr_bundle *attrs)
{
	return vrdma_create_cq_udata(ibcq, attr,
				     attrs ? &attrs->driver_udata : NULL);
}
#else
static int vrdma_create_cq(struct ib_cq *ibcq, const struct ib_cq_init_attr *attr,
			   struct ib_udata *udata)
{
	return vrdma_create_cq_udata(ibcq, attr, udata);
}
#endif

static int vrdma_destroy_cq(struct ib_cq *ibcq, struct ib_udata *udata)
{
	struct vrdma_dev *dev = to_vdev(ibcq->device);
	struct vrdma_cq *cq = to_vcq(ibcq);
	int ret;

	ret = vrdma_destroy_handle(dev, cq->ctx, VIRTIO_RDMA_CMD_DESTROY_CQ,
				   cq->handle);
	if (ret)
		return ret;
	xa_erase_irq(&dev->cqs, cq->handle);
	vrdma_ring_free(dev, &cq->ring);
	vrdma_uring_put(dev, &cq->uring);
	mutex_destroy(&cq->resize_lock);
	return 0;
}

/*
 * RESIZE_CQ (spec §6.15) with the new ring described in @req and @pages:
 * the device moves the completions the old ring holds into the new one.
 * The CQ's new size is set on success.
 */
static int vrdma_resize_cmd(struct vrdma_dev *dev, struct vrdma_cq *cq,
			    struct virtio_rdma_resize_cq *req, const u64 *pages)
{
	struct virtio_rdma_resize_cq_resp resp;
	int ret;

	req->cq = cpu_to_le32(cq->handle);
	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_RESIZE_CQ, cq->ctx, req,
			sizeof(*req), pages, le32_to_cpu(req->ring.npages),
			&resp, sizeof(resp));
	if (ret)
		return ret;
	/* The ring's entries, one slot always free. */
	cq->ibcq.cqe = le32_to_cpu(req->ring.entries) - 1;
	return 0;
}

/*
 * A user CQ: the process gives a new ring in its memory and holds off its
 * own polling and arming meanwhile (its provider's lock); the old ring is
 * unpinned once the device has let it go.
 */
static int vrdma_resize_user_cq(struct vrdma_dev *dev, struct vrdma_cq *cq,
				int cqe, struct ib_udata *udata)
{
	struct virtio_rdma_resize_cq req = {};
	struct vrdma_uring ring = {}, old;
	struct virtio_rdma_uring u;
	u32 npages;
	u64 *pages;
	int ret;

	ret = vrdma_cq_uring_req(udata, cqe, &u, &pages, &npages);
	if (ret)
		return ret;
	ret = vrdma_uring_get(cq->ibcq.device, &u, &ring, &req.ring, pages);
	if (ret)
		goto free;
	ret = vrdma_resize_cmd(dev, cq, &req, pages);
	if (!ret) {
		old = cq->uring;
		cq->uring = ring;
		ring = old;
	}
	vrdma_uring_put(dev, &ring);
free:
	kvfree(pages);
	return ret;
}

/*
 * A kernel CQ: a new ring of kernel pages. While the device moves the
 * completions, polls find none (the device reads the old consumer index
 * once, when it takes the command: a poll meanwhile would take
 * completions it copies too) and an arm is kept for the new ring.
 */
static int vrdma_resize_kernel_cq(struct vrdma_dev *dev, struct vrdma_cq *cq,
				  int cqe)
{
	u32 max = le32_to_cpu(dev->attr.max_cqe);
	struct virtio_rdma_resize_cq req = {};
	enum ib_cq_notify_flags arm;
	struct vrdma_ring ring, old;
	unsigned long flags;
	bool armed;
	u64 *pages;
	u32 entries;
	int ret;

	entries = vrdma_ring_entries(cqe + 1, sizeof(struct virtio_rdma_cqe));
	if (entries > max + 1)
		return -EINVAL;
	ret = vrdma_ring_alloc(&ring, entries, sizeof(struct virtio_rdma_cqe));
	if (ret)
		return ret;
	pages = kcalloc(vrdma_ring_pages(&ring), sizeof(*pages), GFP_KERNEL);
	if (!pages) {
		vrdma_ring_free(dev, &ring);
		return -ENOMEM;
	}
	vrdma_ring_desc(&ring, &req.ring, pages);

	spin_lock_irqsave(&cq->lock, flags);
	cq->resizing = true;
	spin_unlock_irqrestore(&cq->lock, flags);
	ret = vrdma_resize_cmd(dev, cq, &req, pages);
	kfree(pages);
	spin_lock_irqsave(&cq->lock, flags);
	cq->resizing = false;
	if (!ret) {
		old = cq->ring;
		cq->ring = ring;
		ring = old;
	}
	armed = cq->arm_pending;
	arm = cq->arm_flags;
	cq->arm_pending = false;
	spin_unlock_irqrestore(&cq->lock, flags);

	/*
	 * The ring the device no longer uses goes; after a timeout the device
	 * may still write either: it is held until the device's reset.
	 */
	vrdma_ring_free(dev, &ring);
	if (armed)
		ib_req_notify_cq(&cq->ibcq, arm);
	return ret;
}

static int vrdma_resize_cq(struct ib_cq *ibcq, int cqe, struct ib_udata *udata)
{
	struct vrdma_dev *dev = to_vdev(ibcq->device);
	struct vrdma_cq *cq = to_vcq(ibcq);
	int ret;

	if (cqe < 1 || cqe > le32_to_cpu(dev->attr.max_cqe))
		return -EINVAL;
	mutex_lock(&cq->resize_lock);
	if (cq->uring.buf)
		ret = udata ? vrdma_resize_user_cq(dev, cq, cqe, udata) : -EINVAL;
	else
		ret = vrdma_resize_kernel_cq(dev, cq, cqe);
	mutex_unlock(&cq->resize_lock);
	return ret;
}

static enum ib_wc_opcode vrdma_wc_opcode(u8 op)
{
	switch (op) {
	case 1:
		return IB_WC_RDMA_WRITE;
	case 2:
		return IB_WC_RDMA_READ;
	case 3:
		return IB_WC_COMP_SWAP;
	case 4:
		return IB_WC_FETCH_ADD;
	case 5:
		return IB_WC_BIND_MW;
	case 6:
		return IB_WC_LOCAL_INV;
	case 8:
		return IB_WC_REG_MR;
	case 128:
		return IB_WC_RECV;
	case 129:
		return IB_WC_RECV_RDMA_WITH_IMM;
	default:
		return IB_WC_SEND;
	}
}

static void vrdma_wc(struct vrdma_dev *dev, const struct virtio_rdma_cqe *c,
		     struct ib_wc *wc)
{
	u16 flags = le16_to_cpu(c->wc_flags);
	struct vrdma_qp *qp;

	memset(wc, 0, sizeof(*wc));
	wc->wr_id = le64_to_cpu(c->wr_id);
	wc->status = c->status <= IB_WC_GENERAL_ERR ? c->status : IB_WC_GENERAL_ERR;
	wc->opcode = vrdma_wc_opcode(c->opcode);
	wc->byte_len = le32_to_cpu(c->byte_len);
	xa_lock(&dev->qps);
	qp = xa_load(&dev->qps, le32_to_cpu(c->qpn));
	/* The QP is not freed while it is in the table: its WQEs retire. */
	if (qp && (c->opcode & VIRTIO_RDMA_CQE_OPCODE_RECV))
		atomic_dec_if_positive(&qp->rq_out);
	else if (qp)
		WRITE_ONCE(qp->sq_seen, le32_to_cpu(c->src_qp));
	xa_unlock(&dev->qps);
	wc->qp = qp ? &qp->ibqp : NULL;
	/* A send queue's CQE has its count of retired WQEs there. */
	if (c->opcode & VIRTIO_RDMA_CQE_OPCODE_RECV)
		wc->src_qp = le32_to_cpu(c->src_qp);
	wc->pkey_index = le16_to_cpu(c->pkey_index);
	wc->sl = c->sl;
	wc->port_num = 1;
	if (flags & VIRTIO_RDMA_WC_F_GRH)
		wc->wc_flags |= IB_WC_GRH;
	if (flags & VIRTIO_RDMA_WC_F_WITH_IMM) {
		wc->wc_flags |= IB_WC_WITH_IMM;
		/* The immediate's wire bytes, as verbs keeps them. */
		wc->ex.imm_data = (__force __be32)c->ex;
	} else if (flags & VIRTIO_RDMA_WC_F_WITH_INV) {
		wc->wc_flags |= IB_WC_WITH_INVALIDATE;
		wc->ex.invalidate_rkey = le32_to_cpu(c->ex);
	}
	if (c->network_hdr_type) {
		wc->wc_flags |= IB_WC_WITH_NETWORK_HDR_TYPE;
		wc->network_hdr_type = c->network_hdr_type;
	}
}

static int vrdma_poll_cq(struct ib_cq *ibcq, int n, struct ib_wc *wc)
{
	struct vrdma_dev *dev = to_vdev(ibcq->device);
	struct vrdma_cq *cq = to_vcq(ibcq);
	struct vrdma_ring *r = &cq->ring;
	struct virtio_rdma_cqe c;
	unsigned long flags;
	int done = 0;
	u32 prod;

	/* A user CQ is its process's to poll (uverbs' POLL_CQ reaches here). */
	if (!r->buf)
		return -EOPNOTSUPP;
	spin_lock_irqsave(&cq->lock, flags);
	if (cq->resizing) {
		/* The completions come from the new ring once it is in place. */
		spin_unlock_irqrestore(&cq->lock, flags);
		return 0;
	}
	/* The CQEs before the producer index are whole once it is read. */
	prod = vrdma_index_read(VRDMA_CQ_PRODUCER(r));
	while (done < n && prod != r->index) {
		memcpy(&c, vrdma_ring_slot(r, r->index), sizeof(c));
		vrdma_wc(dev, &c, &wc[done++]);
		r->index++;
	}
	if (done) {
		/* The slots are copied out before the device may reuse them. */
		vrdma_index_write(VRDMA_CQ_CONSUMER(r), r->index);
	}
	spin_unlock_irqrestore(&cq->lock, flags);
	return done;
}

/*
 * Arms the CQ (spec §9.1): the consumer index seen, the mode and a new
 * sequence number in the arm word, then the CQ's doorbell. The device
 * notifies at once when a wanted completion is already past that index.
 */
static int vrdma_req_notify_cq(struct ib_cq *ibcq, enum ib_cq_notify_flags f)
{
	struct vrdma_dev *dev = to_vdev(ibcq->device);
	struct vrdma_cq *cq = to_vcq(ibcq);
	struct vrdma_ring *r = &cq->ring;
	u64 mode = (f & IB_CQ_SOLICITED_MASK) == IB_CQ_SOLICITED ?
		   VIRTIO_RDMA_CQ_ARM_SOLICITED : VIRTIO_RDMA_CQ_ARM_NEXT;
	unsigned long flags;
	int missed = 0;
	u32 prod;
	u64 word;

	if (!r->buf)
		return -EOPNOTSUPP;
	spin_lock_irqsave(&cq->lock, flags);
	if (cq->resizing) {
		/*
		 * Made on the new ring when it is in place: a NEXT arm wants
		 * more than a SOLICITED one and is kept over it.
		 */
		if (!cq->arm_pending ||
		    (f & IB_CQ_SOLICITED_MASK) == IB_CQ_NEXT_COMP)
			cq->arm_flags = f & IB_CQ_SOLICITED_MASK;
		cq->arm_pending = true;
		spin_unlock_irqrestore(&cq->lock, flags);
		return 0;
	}
	cq->arm_seq = (cq->arm_seq + 1) & ((1ULL << 30) - 1);
	word = r->index | mode << 32 | cq->arm_seq << 34;
	WRITE_ONCE(*VRDMA_CQ_ARM(r), cpu_to_le64(word));
	/*
	 * The arm word is stored before the producer index is loaded (a store
	 * then a load: only a full barrier orders them), so a completion the
	 * arm's snapshot did not see is either seen here or seen by the
	 * device when it reads the arm word.
	 */
	mb();
	/* A completion the arm's snapshot did not see is reported missed. */
	prod = vrdma_index_read(VRDMA_CQ_PRODUCER(r));
	if ((f & IB_CQ_REPORT_MISSED_EVENTS) && prod != r->index)
		missed = 1;
	spin_unlock_irqrestore(&cq->lock, flags);
	vrdma_ring_doorbell(dev, cq->doorbell);
	return missed;
}

/* --- QPs ----------------------------------------------------------------- */

static u8 vrdma_qp_type(enum ib_qp_type t)
{
	switch (t) {
	case IB_QPT_GSI:
		return VIRTIO_RDMA_QPT_GSI;
	case IB_QPT_RC:
		return VIRTIO_RDMA_QPT_RC;
	case IB_QPT_UC:
		return VIRTIO_RDMA_QPT_UC;
	case IB_QPT_UD:
		return VIRTIO_RDMA_QPT_UD;
	default:
		return 0;
	}
}

/* Fills the create command's fields that both kinds of QP share, but the PD. */
static void vrdma_qp_req(struct virtio_rdma_create_qp *req,
			 const struct ib_qp_init_attr *init, u8 type)
{
	const struct ib_qp_cap *cap = &init->cap;

	req->qp_type = type;
	req->sq_sig_all = init->sq_sig_type == IB_SIGNAL_ALL_WR;
	req->send_cq = cpu_to_le32(to_vcq(init->send_cq)->handle);
	req->recv_cq = cpu_to_le32(to_vcq(init->recv_cq)->handle);
	req->max_send_sge = cpu_to_le32(max(cap->max_send_sge, 1U));
	if (init->srq)
		req->srq = cpu_to_le32(to_vsrq(init->srq)->handle);
	else
		req->max_recv_sge = cpu_to_le32(max(cap->max_recv_sge, 1U));
	req->max_inline_data = cpu_to_le32(cap->max_inline_data);
}

/* The device's answer into the QP and the consumer's capabilities. */
static void vrdma_qp_resp(struct vrdma_qp *qp, struct ib_qp_init_attr *init,
			  const struct virtio_rdma_create_qp_resp *resp)
{
	struct ib_qp_cap *cap = &init->cap;

	qp->ibqp.qp_num = le32_to_cpu(resp->qpn);
	qp->doorbell = le32_to_cpu(resp->doorbell);
	qp->sig_all = init->sq_sig_type == IB_SIGNAL_ALL_WR;
	qp->max_send_sge = le32_to_cpu(resp->max_send_sge);
	qp->max_recv_sge = le32_to_cpu(resp->max_recv_sge);
	qp->max_inline = le32_to_cpu(resp->max_inline_data);
	qp->max_send_wr = le32_to_cpu(resp->max_send_wr);
	qp->max_recv_wr = le32_to_cpu(resp->max_recv_wr);
	cap->max_send_wr = qp->max_send_wr;
	cap->max_recv_wr = qp->max_recv_wr;
	cap->max_send_sge = qp->max_send_sge;
	cap->max_recv_sge = qp->max_recv_sge;
	cap->max_inline_data = qp->max_inline;
	qp->attr.qp_state = IB_QPS_RESET;
}

/*
 * A QP whose rings are in its process's memory (spec §8.7): the process
 * posts to them and rings their doorbell itself.
 */
static int vrdma_create_user_qp(struct ib_qp *ibqp,
				struct ib_qp_init_attr *init,
				struct ib_udata *udata)
{
	struct vrdma_dev *dev = to_vdev(ibqp->device);
	struct vrdma_qp *qp = to_vqp(ibqp);
	struct virtio_rdma_create_qp_ureq ureq;
	struct virtio_rdma_create_qp_uresp uresp = {};
	struct virtio_rdma_create_qp req = {};
	struct virtio_rdma_create_qp_resp resp;
	u32 sp, rp = 0;
	u64 *pages;
	int ret;

	if (udata->inlen < sizeof(ureq) || udata->outlen < sizeof(uresp))
		return -EINVAL;
	ret = ib_copy_from_udata(&ureq, udata, sizeof(ureq));
	if (ret)
		return ret;
	qp->type = vrdma_qp_type(init->qp_type);
	/* The GSI QP is the kernel's (its MAD layer's). */
	if (!qp->type || qp->type == VIRTIO_RDMA_QPT_GSI || init->create_flags)
		return -EOPNOTSUPP;
	sp = vrdma_uring_npages(&ureq.sq);
	if (!init->srq)
		rp = vrdma_uring_npages(&ureq.rq);
	else if (ureq.rq.buf || ureq.rq.header || ureq.rq.entries)
		return -EINVAL;
	if (!sp || (!init->srq && !rp))
		return -EINVAL;
	pages = kvcalloc(sp + rp, sizeof(*pages), GFP_KERNEL);
	if (!pages)
		return -ENOMEM;
	ret = vrdma_uring_get(ibqp->device, &ureq.sq, &qp->usq, &req.sq, pages);
	if (ret)
		goto free;
	if (!init->srq) {
		ret = vrdma_uring_get(ibqp->device, &ureq.rq, &qp->urq, &req.rq,
				      pages + sp);
		if (ret)
			goto put;
	}
	vrdma_qp_req(&req, init, qp->type);
	req.pd = cpu_to_le32(to_vpd(ibqp->pd)->handle);
	qp->ctx = vrdma_udata_ctx(dev, udata);
	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_CREATE_QP, qp->ctx, &req,
			sizeof(req), pages, sp + rp, &resp, sizeof(resp));
	if (ret)
		goto put;
	vrdma_qp_resp(qp, init, &resp);
	uresp.qpn = ibqp->qp_num;
	uresp.doorbell = qp->doorbell;
	ret = ib_copy_to_udata(udata, &uresp, sizeof(uresp));
	if (!ret)
		ret = xa_insert_irq(&dev->qps, ibqp->qp_num, qp, GFP_KERNEL);
	if (ret) {
		vrdma_destroy_handle(dev, qp->ctx, VIRTIO_RDMA_CMD_DESTROY_QP,
				     ibqp->qp_num);
		goto put;
	}
	kvfree(pages);
	return 0;
put:
	vrdma_uring_put(dev, &qp->urq);
	vrdma_uring_put(dev, &qp->usq);
free:
	kvfree(pages);
	return ret;
}

static int vrdma_create_qp(struct ib_qp *ibqp, struct ib_qp_init_attr *init,
			   struct ib_udata *udata)
{
	struct vrdma_dev *dev = to_vdev(ibqp->device);
	struct vrdma_qp *qp = to_vqp(ibqp);
	struct ib_qp_cap *cap = &init->cap;
	struct virtio_rdma_create_qp req = {};
	struct virtio_rdma_create_qp_resp resp;
	u32 max_wr = le32_to_cpu(dev->attr.max_qp_wr);
	u32 max_sge = le32_to_cpu(dev->attr.max_sge);
	u32 sstride, rstride, npages;
	u64 *pages;
	int ret;

	if (udata)
		return vrdma_create_user_qp(ibqp, init, udata);
	qp->type = vrdma_qp_type(init->qp_type);
	if (!qp->type || init->create_flags)
		return -EOPNOTSUPP;
	if (cap->max_send_wr > max_wr || cap->max_recv_wr > max_wr ||
	    cap->max_send_sge > max_sge || cap->max_recv_sge > max_sge ||
	    cap->max_inline_data > le32_to_cpu(dev->attr.max_inline_data))
		return -EINVAL;
	sstride = roundup_pow_of_two(sizeof(struct virtio_rdma_send_wqe) +
				     max_t(u32, 16 * max(cap->max_send_sge, 1U),
					   cap->max_inline_data));
	rstride = roundup_pow_of_two(sizeof(struct virtio_rdma_recv_wqe) +
				     16 * max(cap->max_recv_sge, 1U));
	if (sstride > VIRTIO_RDMA_PAGE_SIZE || rstride > VIRTIO_RDMA_PAGE_SIZE)
		return -EINVAL;
	spin_lock_init(&qp->sq_lock);
	spin_lock_init(&qp->rq_lock);
	ret = vrdma_ring_alloc(&qp->sq, vrdma_ring_entries(cap->max_send_wr, sstride),
			       sstride);
	if (ret)
		return ret;
	/* A QP on an SRQ has no receive ring of its own (spec §6.26). */
	if (!init->srq) {
		ret = vrdma_ring_alloc(&qp->rq,
				       vrdma_ring_entries(cap->max_recv_wr, rstride),
				       rstride);
		if (ret)
			goto free_sq;
	}
	npages = vrdma_ring_pages(&qp->sq) + vrdma_ring_pages(&qp->rq);
	pages = kcalloc(npages, sizeof(*pages), GFP_KERNEL);
	if (!pages) {
		ret = -ENOMEM;
		goto free_rq;
	}
	vrdma_qp_req(&req, init, qp->type);
	req.pd = cpu_to_le32(to_vpd(ibqp->pd)->handle);
	vrdma_ring_desc(&qp->sq, &req.sq, pages);
	vrdma_ring_desc(&qp->rq, &req.rq, pages + vrdma_ring_pages(&qp->sq));
	qp->ctx = dev->kctx;
	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_CREATE_QP, qp->ctx, &req,
			sizeof(req), pages, npages, &resp, sizeof(resp));
	kfree(pages);
	if (ret)
		goto free_rq;
	vrdma_qp_resp(qp, init, &resp);
	ret = xa_insert_irq(&dev->qps, ibqp->qp_num, qp, GFP_KERNEL);
	if (ret) {
		vrdma_destroy_handle(dev, qp->ctx, VIRTIO_RDMA_CMD_DESTROY_QP,
				     ibqp->qp_num);
		goto free_rq;
	}
	return 0;
free_rq:
	vrdma_ring_free(dev, &qp->rq);
free_sq:
	vrdma_ring_free(dev, &qp->sq);
	return ret;
}

static int vrdma_destroy_qp(struct ib_qp *ibqp, struct ib_udata *udata)
{
	struct vrdma_dev *dev = to_vdev(ibqp->device);
	struct vrdma_qp *qp = to_vqp(ibqp);
	int ret;

	ret = vrdma_destroy_handle(dev, qp->ctx, VIRTIO_RDMA_CMD_DESTROY_QP,
				   ibqp->qp_num);
	if (ret)
		return ret;
	xa_erase_irq(&dev->qps, ibqp->qp_num);
	vrdma_ring_free(dev, &qp->rq);
	vrdma_ring_free(dev, &qp->sq);
	vrdma_uring_put(dev, &qp->urq);
	vrdma_uring_put(dev, &qp->usq);
	return 0;
}

/*
 * A kernel QP back in RESET: the device discarded its WQEs and takes each
 * ring from index 0 again, so both index words go back to 0 (spec §6.27,
 * DRV-10), and the counts of outstanding WQEs with them. (A completion
 * written before the RESET and polled after it may still retire one of
 * the next receives: the count is low by at most that many, and the
 * ring's room still bounds the posts.) A user QP's rings are its
 * process's to rewind.
 */
static void vrdma_ring_rewind(struct vrdma_ring *r)
{
	/* The device reads the words only once the QP leaves RESET. */
	vrdma_index_write(VRDMA_WQ_CONSUMER(r), 0);
	/* Ordered after the consumer word, as the device reads them. */
	vrdma_index_write(VRDMA_WQ_PRODUCER(r), 0);
	r->index = 0;
}

static void vrdma_qp_rewind(struct vrdma_qp *qp)
{
	unsigned long flags;

	if (qp->sq.buf) {
		spin_lock_irqsave(&qp->sq_lock, flags);
		vrdma_ring_rewind(&qp->sq);
		qp->sq_done = 0;
		WRITE_ONCE(qp->sq_seen, 0);
		spin_unlock_irqrestore(&qp->sq_lock, flags);
	}
	if (qp->rq.buf) {
		spin_lock_irqsave(&qp->rq_lock, flags);
		vrdma_ring_rewind(&qp->rq);
		atomic_set(&qp->rq_out, 0);
		spin_unlock_irqrestore(&qp->rq_lock, flags);
	}
}

static int vrdma_modify_qp(struct ib_qp *ibqp, struct ib_qp_attr *a, int mask,
			   struct ib_udata *udata)
{
	struct vrdma_dev *dev = to_vdev(ibqp->device);
	struct vrdma_qp *qp = to_vqp(ibqp);
	struct virtio_rdma_modify_qp req = {};
	struct virtio_rdma_qp_attr *q = &req.attrs;
	int ret;

	if (udata && (udata->inlen || udata->outlen))
		return -EINVAL;
	/* The masks and states are verbs' values (spec §6.27). */
	req.qpn = cpu_to_le32(ibqp->qp_num);
	req.attr_mask = cpu_to_le32(mask);
	q->qp_state = cpu_to_le32(a->qp_state);
	q->cur_qp_state = cpu_to_le32(a->cur_qp_state);
	q->path_mtu = cpu_to_le32(a->path_mtu);
	q->qkey = cpu_to_le32(a->qkey);
	q->rq_psn = cpu_to_le32(a->rq_psn);
	q->sq_psn = cpu_to_le32(a->sq_psn);
	q->dest_qp_num = cpu_to_le32(a->dest_qp_num);
	q->qp_access_flags = cpu_to_le32(vrdma_access(a->qp_access_flags));
	q->pkey_index = cpu_to_le16(a->pkey_index);
	q->en_sqd_async_notify = a->en_sqd_async_notify;
	q->max_rd_atomic = a->max_rd_atomic;
	q->max_dest_rd_atomic = a->max_dest_rd_atomic;
	q->min_rnr_timer = a->min_rnr_timer;
	q->port_num = a->port_num;
	q->timeout = a->timeout;
	q->retry_cnt = a->retry_cnt;
	q->rnr_retry = a->rnr_retry;
	if (mask & IB_QP_AV)
		vrdma_av_of(&q->ah, &a->ah_attr);
	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_MODIFY_QP, qp->ctx, &req,
			sizeof(req), NULL, 0, NULL, 0);
	if (ret)
		return ret;
	if ((mask & IB_QP_STATE) && a->qp_state == IB_QPS_RESET)
		vrdma_qp_rewind(qp);
	if (mask & IB_QP_STATE)
		qp->attr.qp_state = a->qp_state;
	if (mask & IB_QP_QKEY)
		qp->attr.qkey = a->qkey;
	if (mask & IB_QP_PORT)
		qp->attr.port_num = a->port_num;
	if (mask & IB_QP_PKEY_INDEX)
		qp->attr.pkey_index = a->pkey_index;
	if (mask & IB_QP_ACCESS_FLAGS)
		qp->attr.qp_access_flags = a->qp_access_flags;
	if (mask & IB_QP_PATH_MTU)
		qp->attr.path_mtu = a->path_mtu;
	if (mask & IB_QP_DEST_QPN)
		qp->attr.dest_qp_num = a->dest_qp_num;
	if (mask & IB_QP_RQ_PSN)
		qp->attr.rq_psn = a->rq_psn;
	if (mask & IB_QP_SQ_PSN)
		qp->attr.sq_psn = a->sq_psn;
	if (mask & IB_QP_TIMEOUT)
		qp->attr.timeout = a->timeout;
	if (mask & IB_QP_RETRY_CNT)
		qp->attr.retry_cnt = a->retry_cnt;
	if (mask & IB_QP_RNR_RETRY)
		qp->attr.rnr_retry = a->rnr_retry;
	if (mask & IB_QP_MIN_RNR_TIMER)
		qp->attr.min_rnr_timer = a->min_rnr_timer;
	if (mask & IB_QP_MAX_QP_RD_ATOMIC)
		qp->attr.max_rd_atomic = a->max_rd_atomic;
	if (mask & IB_QP_MAX_DEST_RD_ATOMIC)
		qp->attr.max_dest_rd_atomic = a->max_dest_rd_atomic;
	if (mask & IB_QP_AV) {
		struct ib_global_route *grh;

		qp->attr.ah_attr = a->ah_attr;
		/* As the device keeps it: the label's 20 bits (spec §6.27). */
		grh = rdma_ah_retrieve_grh(&qp->attr.ah_attr);
		if (grh)
			grh->flow_label &= VIRTIO_RDMA_FLOW_LABEL_MASK;
	}
	return 0;
}

static int vrdma_query_qp(struct ib_qp *ibqp, struct ib_qp_attr *a, int mask,
			  struct ib_qp_init_attr *init)
{
	struct vrdma_dev *dev = to_vdev(ibqp->device);
	struct vrdma_qp *qp = to_vqp(ibqp);
	struct virtio_rdma_handle_req req = {
		.handle = cpu_to_le32(ibqp->qp_num),
	};
	struct virtio_rdma_query_qp_resp resp;
	int ret;

	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_QUERY_QP, qp->ctx, &req,
			sizeof(req), NULL, 0, &resp, sizeof(resp));
	if (ret)
		return ret;
	*a = qp->attr;
	/* The device's state: it moves to ERR on its own. */
	a->qp_state = le32_to_cpu(resp.attrs.qp_state);
	a->cur_qp_state = a->qp_state;
	a->sq_draining = resp.attrs.sq_draining;
	/* A user QP's rings are its process's: the device's answer counts. */
	a->cap.max_send_wr = qp->max_send_wr;
	a->cap.max_recv_wr = qp->max_recv_wr;
	a->cap.max_send_sge = qp->max_send_sge;
	a->cap.max_recv_sge = qp->max_recv_sge;
	a->cap.max_inline_data = qp->max_inline;
	memset(init, 0, sizeof(*init));
	init->qp_type = ibqp->qp_type;
	init->send_cq = ibqp->send_cq;
	init->recv_cq = ibqp->recv_cq;
	init->cap = a->cap;
	init->sq_sig_type = qp->sig_all ? IB_SIGNAL_ALL_WR : IB_SIGNAL_REQ_WR;
	return 0;
}

static int vrdma_wr_opcode(enum ib_wr_opcode op)
{
	switch (op) {
	case IB_WR_RDMA_WRITE:
		return VIRTIO_RDMA_WR_RDMA_WRITE;
	case IB_WR_RDMA_WRITE_WITH_IMM:
		return VIRTIO_RDMA_WR_RDMA_WRITE_WITH_IMM;
	case IB_WR_SEND:
		return VIRTIO_RDMA_WR_SEND;
	case IB_WR_SEND_WITH_IMM:
		return VIRTIO_RDMA_WR_SEND_WITH_IMM;
	case IB_WR_RDMA_READ:
		return VIRTIO_RDMA_WR_RDMA_READ;
	case IB_WR_ATOMIC_CMP_AND_SWP:
		return VIRTIO_RDMA_WR_ATOMIC_CMP_AND_SWP;
	case IB_WR_ATOMIC_FETCH_AND_ADD:
		return VIRTIO_RDMA_WR_ATOMIC_FETCH_AND_ADD;
	case IB_WR_LOCAL_INV:
		return VIRTIO_RDMA_WR_LOCAL_INV;
	case IB_WR_SEND_WITH_INV:
		return VIRTIO_RDMA_WR_SEND_WITH_INV;
	case IB_WR_REG_MR:
		return VIRTIO_RDMA_WR_REG_MR;
	default:
		return -EINVAL;
	}
}

/* Writes @wr into @slot (a send ring's slot, @qp's stride). */
static int vrdma_send_wqe(struct vrdma_qp *qp, const struct ib_send_wr *wr,
			  void *slot)
{
	struct virtio_rdma_send_wqe *w = slot;
	struct virtio_rdma_sge *sge = (void *)(w + 1);
	int op = vrdma_wr_opcode(wr->opcode);
	u32 i, len = 0;
	u8 flags = 0;

	if (op < 0)
		return op;
	if (wr->send_flags & IB_SEND_FENCE)
		flags |= VIRTIO_RDMA_WR_F_FENCE;
	if ((wr->send_flags & IB_SEND_SIGNALED) || qp->sig_all)
		flags |= VIRTIO_RDMA_WR_F_SIGNALED;
	if (wr->send_flags & IB_SEND_SOLICITED)
		flags |= VIRTIO_RDMA_WR_F_SOLICITED;
	memset(w, 0, qp->sq.stride);
	w->wr_id = cpu_to_le64(wr->wr_id);
	w->opcode = op;
	if (wr->opcode == IB_WR_SEND_WITH_IMM ||
	    wr->opcode == IB_WR_RDMA_WRITE_WITH_IMM)
		w->ex = (__force __le32)wr->ex.imm_data;
	else if (wr->opcode == IB_WR_SEND_WITH_INV ||
		 wr->opcode == IB_WR_LOCAL_INV)
		w->ex = cpu_to_le32(wr->ex.invalidate_rkey);
	switch (wr->opcode) {
	case IB_WR_RDMA_WRITE:
	case IB_WR_RDMA_WRITE_WITH_IMM:
	case IB_WR_RDMA_READ:
		w->rdma.remote_addr = cpu_to_le64(rdma_wr(wr)->remote_addr);
		w->rdma.rkey = cpu_to_le32(rdma_wr(wr)->rkey);
		break;
	case IB_WR_ATOMIC_CMP_AND_SWP:
	case IB_WR_ATOMIC_FETCH_AND_ADD:
		w->atomic.remote_addr = cpu_to_le64(atomic_wr(wr)->remote_addr);
		w->atomic.compare_add = cpu_to_le64(atomic_wr(wr)->compare_add);
		w->atomic.swap = cpu_to_le64(atomic_wr(wr)->swap);
		w->atomic.rkey = cpu_to_le32(atomic_wr(wr)->rkey);
		break;
	case IB_WR_REG_MR: {
		struct vrdma_mr *mr = container_of(reg_wr(wr)->mr, struct vrdma_mr,
						   ibmr);

		/* The device copies the page list when it takes the WQE. */
		w->reg_mr.iova = cpu_to_le64(mr->ibmr.iova);
		w->reg_mr.length = cpu_to_le64(mr->ibmr.length);
		w->reg_mr.page_list = cpu_to_le64(virt_to_phys(mr->pages));
		w->reg_mr.key = cpu_to_le32(reg_wr(wr)->key);
		w->reg_mr.access = cpu_to_le32(vrdma_access(reg_wr(wr)->access));
		w->reg_mr.npages = cpu_to_le32(mr->npages);
		w->reg_mr.page_shift = ilog2(mr->ibmr.page_size);
		w->flags = flags;
		return 0;
	}
	case IB_WR_SEND:
	case IB_WR_SEND_WITH_IMM:
		if (qp->type == VIRTIO_RDMA_QPT_UD || qp->type == VIRTIO_RDMA_QPT_GSI) {
			w->ud.av = to_vah(ud_wr(wr)->ah)->av;
			w->ud.remote_qpn = cpu_to_le32(ud_wr(wr)->remote_qpn);
			w->ud.remote_qkey = cpu_to_le32(ud_wr(wr)->remote_qkey);
		}
		break;
	default:
		break;
	}
	if (wr->send_flags & IB_SEND_INLINE) {
		u8 *dst = (u8 *)(w + 1);

		for (i = 0; i < wr->num_sge; i++) {
			if (len + wr->sg_list[i].length > qp->max_inline)
				return -EINVAL;
			memcpy(dst + len, (void *)(uintptr_t)wr->sg_list[i].addr,
			       wr->sg_list[i].length);
			len += wr->sg_list[i].length;
		}
		flags |= VIRTIO_RDMA_WR_F_INLINE;
		w->count = cpu_to_le16(len);
	} else {
		if (wr->num_sge > qp->max_send_sge)
			return -EINVAL;
		for (i = 0; i < wr->num_sge; i++) {
			sge[i].addr = cpu_to_le64(wr->sg_list[i].addr);
			sge[i].length = cpu_to_le32(wr->sg_list[i].length);
			sge[i].lkey = cpu_to_le32(wr->sg_list[i].lkey);
		}
		w->count = cpu_to_le16(wr->num_sge);
	}
	w->flags = flags;
	return 0;
}

/*
 * Whether a kernel QP's send queue takes another WQE (under sq_lock): a
 * slot in the ring, and fewer than max_send_wr outstanding by the count
 * the latest send completion carried — unless that count is past what was
 * posted (a completion written before a RESET, polled after it).
 */
static bool vrdma_sq_room(struct vrdma_qp *qp)
{
	struct vrdma_ring *r = &qp->sq;
	u32 seen = READ_ONCE(qp->sq_seen);
	/* Slots before the consumer index are the driver's again. */
	u32 cons = vrdma_index_read(VRDMA_WQ_CONSUMER(r));

	if (seen - qp->sq_done <= r->index - qp->sq_done)
		qp->sq_done = seen;
	return r->index - qp->sq_done < qp->max_send_wr &&
	       r->index - cons < r->entries;
}

static int vrdma_post_send(struct ib_qp *ibqp, const struct ib_send_wr *wr,
			   const struct ib_send_wr **bad)
{
	struct vrdma_dev *dev = to_vdev(ibqp->device);
	struct vrdma_qp *qp = to_vqp(ibqp);
	struct vrdma_ring *r = &qp->sq;
	unsigned long flags;
	int ret = 0;
	u32 start;

	/* A user QP's rings are its process's (uverbs' POST_SEND reaches here). */
	if (!r->buf) {
		*bad = wr;
		return -EOPNOTSUPP;
	}
	spin_lock_irqsave(&qp->sq_lock, flags);
	start = r->index;
	for (; wr; wr = wr->next) {
		if (!vrdma_sq_room(qp)) {
			ret = -ENOMEM;
			break;
		}
		ret = vrdma_send_wqe(qp, wr, vrdma_ring_slot(r, r->index));
		if (ret)
			break;
		r->index++;
	}
	if (r->index != start) {
		/* The WQEs are whole before the device may see the index move. */
		vrdma_index_write(VRDMA_WQ_PRODUCER(r), r->index);
	}
	spin_unlock_irqrestore(&qp->sq_lock, flags);
	if (ret)
		*bad = wr;
	if (r->index != start)
		vrdma_ring_doorbell(dev, qp->doorbell);
	return ret;
}

/*
 * Posts receive WQEs into @r (a QP's receive ring or an SRQ's), taking SGEs
 * up to @max_sge, then rings doorbell @doorbell. Under the ring's lock. A
 * QP's receives are counted in @out, at most @max outstanding (an SRQ's,
 * @out NULL, are bounded by its ring).
 */
static int vrdma_post_recv_ring(struct vrdma_dev *dev, struct vrdma_ring *r,
				u32 max_sge, u32 doorbell, spinlock_t *lock,
				atomic_t *out, u32 max,
				const struct ib_recv_wr *wr,
				const struct ib_recv_wr **bad)
{
	unsigned long flags;
	u32 start, i, held = 0;
	int ret = 0;

	/* A user QP's or SRQ's ring is its process's. */
	if (!r->buf) {
		*bad = wr;
		return -EOPNOTSUPP;
	}
	spin_lock_irqsave(lock, flags);
	start = r->index;
	if (out)
		held = atomic_read(out);
	for (; wr; wr = wr->next) {
		/* Slots before the consumer index are the driver's again. */
		u32 cons = vrdma_index_read(VRDMA_WQ_CONSUMER(r));
		struct virtio_rdma_recv_wqe *w;
		struct virtio_rdma_sge *sge;

		if (r->index - cons >= r->entries ||
		    (out && held + (r->index - start) >= max)) {
			ret = -ENOMEM;
			break;
		}
		if (wr->num_sge > max_sge) {
			ret = -EINVAL;
			break;
		}
		w = vrdma_ring_slot(r, r->index);
		memset(w, 0, r->stride);
		sge = (void *)(w + 1);
		w->wr_id = cpu_to_le64(wr->wr_id);
		w->count = cpu_to_le16(wr->num_sge);
		for (i = 0; i < wr->num_sge; i++) {
			sge[i].addr = cpu_to_le64(wr->sg_list[i].addr);
			sge[i].length = cpu_to_le32(wr->sg_list[i].length);
			sge[i].lkey = cpu_to_le32(wr->sg_list[i].lkey);
		}
		r->index++;
	}
	if (r->index != start) {
		if (out)
			atomic_add(r->index - start, out);
		/* The WQEs are whole before the device may see the index move. */
		vrdma_index_write(VRDMA_WQ_PRODUCER(r), r->index);
	}
	spin_unlock_irqrestore(lock, flags);
	if (ret)
		*bad = wr;
	if (r->index != start)
		vrdma_ring_doorbell(dev, doorbell);
	return ret;
}

static int vrdma_post_recv(struct ib_qp *ibqp, const struct ib_recv_wr *wr,
			   const struct ib_recv_wr **bad)
{
	struct vrdma_qp *qp = to_vqp(ibqp);

	if (ibqp->srq) {
		*bad = wr;
		return -EINVAL;
	}
	return vrdma_post_recv_ring(to_vdev(ibqp->device), &qp->rq,
				    qp->max_recv_sge, qp->doorbell, &qp->rq_lock,
				    &qp->rq_out, qp->max_recv_wr, wr, bad);
}

/* --- SRQs ---------------------------------------------------------------- */

/* Sets a new SRQ's limit, which is MODIFY_SRQ's to set (spec §6.22). */
static int vrdma_srq_limit(struct vrdma_dev *dev, struct vrdma_srq *srq,
			   u32 limit)
{
	struct virtio_rdma_modify_srq m = {
		.srq = cpu_to_le32(srq->handle),
		.mask = cpu_to_le32(IB_SRQ_LIMIT),
		.srq_limit = cpu_to_le32(limit),
	};

	if (!limit)
		return 0;
	return vrdma_cmd(dev, VIRTIO_RDMA_CMD_MODIFY_SRQ, srq->ctx, &m,
			 sizeof(m), NULL, 0, NULL, 0);
}

/* An SRQ whose ring is in its process's memory (spec §8.7). */
static int vrdma_create_user_srq(struct ib_srq *ibsrq,
				 struct ib_srq_init_attr *init,
				 struct ib_udata *udata)
{
	struct vrdma_dev *dev = to_vdev(ibsrq->device);
	struct vrdma_srq *srq = to_vsrq(ibsrq);
	struct ib_srq_attr *a = &init->attr;
	struct virtio_rdma_create_srq_ureq ureq;
	struct virtio_rdma_create_srq_uresp uresp = {};
	struct virtio_rdma_create_srq req = {};
	struct virtio_rdma_create_srq_resp resp;
	u32 npages;
	u64 *pages;
	int ret;

	if (udata->inlen < sizeof(ureq) || udata->outlen < sizeof(uresp))
		return -EINVAL;
	ret = ib_copy_from_udata(&ureq, udata, sizeof(ureq));
	if (ret)
		return ret;
	npages = vrdma_uring_npages(&ureq.ring);
	if (!npages)
		return -EINVAL;
	pages = kvcalloc(npages, sizeof(*pages), GFP_KERNEL);
	if (!pages)
		return -ENOMEM;
	spin_lock_init(&srq->lock);
	ret = vrdma_uring_get(ibsrq->device, &ureq.ring, &srq->uring, &req.ring,
			      pages);
	if (ret)
		goto free;
	req.pd = cpu_to_le32(to_vpd(ibsrq->pd)->handle);
	req.max_sge = cpu_to_le32(max(a->max_sge, 1U));
	srq->ctx = vrdma_udata_ctx(dev, udata);
	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_CREATE_SRQ, srq->ctx, &req,
			sizeof(req), pages, npages, &resp, sizeof(resp));
	if (ret)
		goto put;
	srq->handle = le32_to_cpu(resp.srq);
	srq->doorbell = le32_to_cpu(resp.doorbell);
	srq->max_sge = le32_to_cpu(resp.max_sge);
	a->max_wr = le32_to_cpu(resp.max_wr);
	a->max_sge = srq->max_sge;
	uresp.srq = srq->handle;
	uresp.doorbell = srq->doorbell;
	ret = vrdma_srq_limit(dev, srq, a->srq_limit);
	if (!ret)
		ret = ib_copy_to_udata(udata, &uresp, sizeof(uresp));
	if (!ret)
		ret = xa_insert_irq(&dev->srqs, srq->handle, srq, GFP_KERNEL);
	if (ret) {
		vrdma_destroy_handle(dev, srq->ctx, VIRTIO_RDMA_CMD_DESTROY_SRQ,
				     srq->handle);
		goto put;
	}
	kvfree(pages);
	return 0;
put:
	vrdma_uring_put(dev, &srq->uring);
free:
	kvfree(pages);
	return ret;
}

static int vrdma_create_srq(struct ib_srq *ibsrq, struct ib_srq_init_attr *init,
			    struct ib_udata *udata)
{
	struct vrdma_dev *dev = to_vdev(ibsrq->device);
	struct vrdma_srq *srq = to_vsrq(ibsrq);
	struct ib_srq_attr *a = &init->attr;
	struct virtio_rdma_create_srq req = {};
	struct virtio_rdma_create_srq_resp resp;
	u32 stride;
	u64 *pages;
	int ret;

	if (init->srq_type != IB_SRQT_BASIC)
		return -EOPNOTSUPP;
	if (udata)
		return vrdma_create_user_srq(ibsrq, init, udata);
	if (a->max_wr > le32_to_cpu(dev->attr.max_srq_wr) ||
	    a->max_sge > le32_to_cpu(dev->attr.max_srq_sge))
		return -EINVAL;
	stride = roundup_pow_of_two(sizeof(struct virtio_rdma_recv_wqe) +
				    16 * max(a->max_sge, 1U));
	if (stride > VIRTIO_RDMA_PAGE_SIZE)
		return -EINVAL;
	spin_lock_init(&srq->lock);
	ret = vrdma_ring_alloc(&srq->ring, vrdma_ring_entries(a->max_wr, stride),
			       stride);
	if (ret)
		return ret;
	pages = kcalloc(vrdma_ring_pages(&srq->ring), sizeof(*pages), GFP_KERNEL);
	if (!pages) {
		ret = -ENOMEM;
		goto free;
	}
	req.pd = cpu_to_le32(to_vpd(ibsrq->pd)->handle);
	req.max_sge = cpu_to_le32(max(a->max_sge, 1U));
	vrdma_ring_desc(&srq->ring, &req.ring, pages);
	srq->ctx = dev->kctx;
	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_CREATE_SRQ, srq->ctx, &req,
			sizeof(req), pages, vrdma_ring_pages(&srq->ring), &resp,
			sizeof(resp));
	kfree(pages);
	if (ret)
		goto free;
	srq->handle = le32_to_cpu(resp.srq);
	srq->doorbell = le32_to_cpu(resp.doorbell);
	srq->max_sge = le32_to_cpu(resp.max_sge);
	a->max_wr = le32_to_cpu(resp.max_wr);
	a->max_sge = srq->max_sge;
	ret = vrdma_srq_limit(dev, srq, a->srq_limit);
	if (!ret)
		ret = xa_insert_irq(&dev->srqs, srq->handle, srq, GFP_KERNEL);
	if (ret)
		goto destroy;
	return 0;
destroy:
	vrdma_destroy_handle(dev, srq->ctx, VIRTIO_RDMA_CMD_DESTROY_SRQ,
			     srq->handle);
free:
	vrdma_ring_free(dev, &srq->ring);
	return ret;
}

static int vrdma_modify_srq(struct ib_srq *ibsrq, struct ib_srq_attr *a,
			    enum ib_srq_attr_mask mask, struct ib_udata *udata)
{
	struct vrdma_srq *srq = to_vsrq(ibsrq);
	struct virtio_rdma_modify_srq req = {
		.srq = cpu_to_le32(srq->handle),
		.mask = cpu_to_le32(mask),
		.srq_limit = cpu_to_le32(a->srq_limit),
	};

	/* The ring is the driver's: a larger SRQ is a new one. */
	if (mask & IB_SRQ_MAX_WR)
		return -EOPNOTSUPP;
	return vrdma_cmd(to_vdev(ibsrq->device), VIRTIO_RDMA_CMD_MODIFY_SRQ,
			 srq->ctx, &req, sizeof(req), NULL, 0, NULL, 0);
}

static int vrdma_query_srq(struct ib_srq *ibsrq, struct ib_srq_attr *a)
{
	struct vrdma_dev *dev = to_vdev(ibsrq->device);
	struct vrdma_srq *srq = to_vsrq(ibsrq);
	struct virtio_rdma_handle_req req = {
		.handle = cpu_to_le32(srq->handle),
	};
	struct virtio_rdma_srq_attr resp;
	int ret;

	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_QUERY_SRQ, srq->ctx, &req,
			sizeof(req), NULL, 0, &resp, sizeof(resp));
	if (ret)
		return ret;
	a->max_wr = le32_to_cpu(resp.max_wr);
	a->max_sge = le32_to_cpu(resp.max_sge);
	a->srq_limit = le32_to_cpu(resp.srq_limit);
	return 0;
}

static int vrdma_destroy_srq(struct ib_srq *ibsrq, struct ib_udata *udata)
{
	struct vrdma_dev *dev = to_vdev(ibsrq->device);
	struct vrdma_srq *srq = to_vsrq(ibsrq);
	int ret;

	ret = vrdma_destroy_handle(dev, srq->ctx, VIRTIO_RDMA_CMD_DESTROY_SRQ,
				   srq->handle);
	if (ret)
		return ret;
	xa_erase_irq(&dev->srqs, srq->handle);
	vrdma_ring_free(dev, &srq->ring);
	vrdma_uring_put(dev, &srq->uring);
	return 0;
}

static int vrdma_post_srq_recv(struct ib_srq *ibsrq, const struct ib_recv_wr *wr,
			       const struct ib_recv_wr **bad)
{
	struct vrdma_srq *srq = to_vsrq(ibsrq);

	return vrdma_post_recv_ring(to_vdev(ibsrq->device), &srq->ring,
				    srq->max_sge, srq->doorbell, &srq->lock, NULL,
				    0, wr, bad);
}

/* --- events and notifications (spec §9.3, §10) --------------------------- */

void vrdma_notify_cq(struct vrdma_dev *dev, u32 handle)
{
	struct vrdma_cq *cq;
	unsigned long flags;

	xa_lock_irqsave(&dev->cqs, flags);
	cq = xa_load(&dev->cqs, handle);
	if (cq && cq->ibcq.comp_handler)
		cq->ibcq.comp_handler(&cq->ibcq, cq->ibcq.cq_context);
	xa_unlock_irqrestore(&dev->cqs, flags);
}

void vrdma_dispatch_event(struct vrdma_dev *dev,
			  const struct virtio_rdma_event *ev)
{
	u32 type = le32_to_cpu(ev->type), object = le32_to_cpu(ev->object);
	struct ib_event e = { .device = &dev->ib };
	struct vrdma_srq *srq;
	unsigned long flags;
	struct vrdma_qp *qp;
	struct vrdma_cq *cq;

	switch (type) {
	case VIRTIO_RDMA_EVENT_CQ_ERR:
		xa_lock_irqsave(&dev->cqs, flags);
		cq = xa_load(&dev->cqs, object);
		if (cq && cq->ibcq.event_handler) {
			e.event = IB_EVENT_CQ_ERR;
			e.element.cq = &cq->ibcq;
			cq->ibcq.event_handler(&e, cq->ibcq.cq_context);
		}
		xa_unlock_irqrestore(&dev->cqs, flags);
		return;
	case VIRTIO_RDMA_EVENT_QP_FATAL:
	case VIRTIO_RDMA_EVENT_QP_REQ_ERR:
	case VIRTIO_RDMA_EVENT_QP_ACCESS_ERR:
	case VIRTIO_RDMA_EVENT_QP_LAST_WQE_REACHED:
	case VIRTIO_RDMA_EVENT_SQ_DRAINED:
		e.event = type == VIRTIO_RDMA_EVENT_QP_FATAL ? IB_EVENT_QP_FATAL :
			  type == VIRTIO_RDMA_EVENT_QP_REQ_ERR ? IB_EVENT_QP_REQ_ERR :
			  type == VIRTIO_RDMA_EVENT_QP_ACCESS_ERR ?
			  IB_EVENT_QP_ACCESS_ERR :
			  type == VIRTIO_RDMA_EVENT_SQ_DRAINED ? IB_EVENT_SQ_DRAINED :
			  IB_EVENT_QP_LAST_WQE_REACHED;
		xa_lock_irqsave(&dev->qps, flags);
		qp = xa_load(&dev->qps, object);
		if (qp && qp->ibqp.event_handler) {
			e.element.qp = &qp->ibqp;
			qp->ibqp.event_handler(&e, qp->ibqp.qp_context);
		}
		xa_unlock_irqrestore(&dev->qps, flags);
		return;
	case VIRTIO_RDMA_EVENT_SRQ_LIMIT_REACHED:
	case VIRTIO_RDMA_EVENT_SRQ_ERR:
		e.event = type == VIRTIO_RDMA_EVENT_SRQ_ERR ? IB_EVENT_SRQ_ERR :
			  IB_EVENT_SRQ_LIMIT_REACHED;
		xa_lock_irqsave(&dev->srqs, flags);
		srq = xa_load(&dev->srqs, object);
		if (srq && srq->ibsrq.event_handler) {
			e.element.srq = &srq->ibsrq;
			srq->ibsrq.event_handler(&e, srq->ibsrq.srq_context);
		}
		xa_unlock_irqrestore(&dev->srqs, flags);
		return;
	case VIRTIO_RDMA_EVENT_PORT_ACTIVE:
	case VIRTIO_RDMA_EVENT_PORT_ERR:
		e.event = type == VIRTIO_RDMA_EVENT_PORT_ACTIVE ?
			  IB_EVENT_PORT_ACTIVE : IB_EVENT_PORT_ERR;
		e.element.port_num = object;
		break;
	case VIRTIO_RDMA_EVENT_DEVICE_FATAL:
		e.event = IB_EVENT_DEVICE_FATAL;
		break;
	default:
		return;
	}
	if (dev->registered)
		ib_dispatch_event(&e);
}

/* --- hardware counters (QUERY_STATS, spec §6.31) ------------------------- */

/* The device's counters, in the order of value[] (§6.31's table). */
static const struct rdma_stat_desc vrdma_stat_descs[] = {
	{ .name = "rx_packets" },
	{ .name = "tx_packets" },
	{ .name = "rx_malformed" },
	{ .name = "rx_no_qp" },
	{ .name = "rx_bad_state" },
	{ .name = "rx_bad_addr" },
	{ .name = "rx_bad_key" },
	{ .name = "rx_no_recv" },
	{ .name = "rx_duplicate" },
	{ .name = "rx_out_of_sequence" },
	{ .name = "rx_too_long" },
	{ .name = "tx_retransmitted" },
	{ .name = "retry_timeout" },
	{ .name = "retry_seq_nak" },
	{ .name = "retry_implied_nak" },
	{ .name = "rnr_naks" },
	{ .name = "refused_commands" },
	{ .name = "refused_send_wqes" },
	{ .name = "refused_recv_wqes" },
	{ .name = "broken_rings" },
};

static struct rdma_hw_stats *
vrdma_alloc_hw_port_stats(struct ib_device *ib, u32 port)
{
	BUILD_BUG_ON(ARRAY_SIZE(vrdma_stat_descs) != VIRTIO_RDMA_STATS_NAMED);
	return rdma_alloc_hw_stats_struct(vrdma_stat_descs,
					  ARRAY_SIZE(vrdma_stat_descs),
					  RDMA_HW_STATS_DEFAULT_LIFESPAN);
}

static int vrdma_get_hw_stats(struct ib_device *ib,
			      struct rdma_hw_stats *stats, u32 port, int index)
{
	struct vrdma_dev *dev = to_vdev(ib);
	struct virtio_rdma_stats *r;
	int i, n, ret;

	r = kzalloc(sizeof(*r), GFP_KERNEL);
	if (!r)
		return -ENOMEM;
	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_QUERY_STATS, 0, NULL, 0, NULL, 0,
			r, sizeof(*r));
	if (ret)
		goto out;
	n = min_t(int, stats->num_counters, VIRTIO_RDMA_STATS_NAMED);
	for (i = 0; i < n; i++)
		stats->value[i] = le64_to_cpu(r->value[i]);
	ret = n;
out:
	kfree(r);
	return ret;
}

static const struct ib_device_ops vrdma_stats_ops = {
	.alloc_hw_port_stats = vrdma_alloc_hw_port_stats,
	.get_hw_stats = vrdma_get_hw_stats,
};

/* --- registration -------------------------------------------------------- */

static const struct ib_device_ops vrdma_dev_ops = {
	.owner = THIS_MODULE,
	.driver_id = RDMA_DRIVER_UNKNOWN,
	.uverbs_abi_ver = VIRTIO_RDMA_ABI_VERSION,

	.add_gid = vrdma_add_gid,
	.alloc_mr = vrdma_alloc_mr,
	.alloc_ucontext = vrdma_alloc_ucontext,
	.create_ah = vrdma_create_ah,
	.create_cq = vrdma_create_cq,
	.create_qp = vrdma_create_qp,
	.create_srq = vrdma_create_srq,
	.create_user_ah = vrdma_create_ah,
	.dealloc_pd = vrdma_dealloc_pd,
	.dealloc_ucontext = vrdma_dealloc_ucontext,
	.del_gid = vrdma_del_gid,
	.dereg_mr = vrdma_dereg_mr,
	.destroy_ah = vrdma_destroy_ah,
	.destroy_cq = vrdma_destroy_cq,
	.destroy_qp = vrdma_destroy_qp,
	.destroy_srq = vrdma_destroy_srq,
	.disassociate_ucontext = vrdma_disassociate_ucontext,
	.get_dma_mr = vrdma_get_dma_mr,
	.get_link_layer = vrdma_link_layer,
	.get_port_immutable = vrdma_port_immutable,
	.map_mr_sg = vrdma_map_mr_sg,
	.mmap = vrdma_mmap,
	.mmap_free = vrdma_mmap_free,
	.modify_qp = vrdma_modify_qp,
	.modify_srq = vrdma_modify_srq,
	.poll_cq = vrdma_poll_cq,
	.post_recv = vrdma_post_recv,
	.post_send = vrdma_post_send,
	.post_srq_recv = vrdma_post_srq_recv,
	.query_device = vrdma_query_device,
	.query_pkey = vrdma_query_pkey,
	.query_port = vrdma_query_port,
	.query_qp = vrdma_query_qp,
	.query_srq = vrdma_query_srq,
	.reg_user_mr = vrdma_reg_user_mr,
	.req_notify_cq = vrdma_req_notify_cq,
	.resize_cq = vrdma_resize_cq,
	.alloc_pd = vrdma_alloc_pd,
	.alloc_mw = vrdma_alloc_mw,
	.dealloc_mw = vrdma_dealloc_mw,

	INIT_RDMA_OBJ_SIZE(ib_ah, vrdma_ah, ibah),
	INIT_RDMA_OBJ_SIZE(ib_cq, vrdma_cq, ibcq),
	INIT_RDMA_OBJ_SIZE(ib_mw, vrdma_mw, ibmw),
	INIT_RDMA_OBJ_SIZE(ib_pd, vrdma_pd, ibpd),
	INIT_RDMA_OBJ_SIZE(ib_qp, vrdma_qp, ibqp),
	INIT_RDMA_OBJ_SIZE(ib_srq, vrdma_srq, ibsrq),
	INIT_RDMA_OBJ_SIZE(ib_ucontext, vrdma_ucontext, ibuc),
};

/* What ib_core needs before the netdev is set and the device registered. */
void vrdma_ib_init(struct vrdma_dev *dev)
{
	struct ib_device *ib = &dev->ib;

	ib->node_type = RDMA_NODE_IB_CA;
	ib->phys_port_cnt = 1;
	ib->num_comp_vectors = 1;
	ib->node_guid = cpu_to_be64(le64_to_cpu(dev->attr.node_guid));
	ib->dev.parent = &dev->vdev->dev;
	strscpy(ib->node_desc, "virtio-rdma", sizeof(ib->node_desc));
	ib_set_device_ops(ib, &vrdma_dev_ops);
	/* Only a device that answers QUERY_STATS has counters (DRV-32). */
	if (dev->stats)
		ib_set_device_ops(ib, &vrdma_stats_ops);
	/* The kick method for processes (virtio_rdma_user.h). */
	ib->driver_def = vrdma_uapi_defs;
}

int vrdma_register(struct vrdma_dev *dev)
{
	struct ib_device *ib = &dev->ib;
	int ret;

	/* Addresses the device reads are guest-physical: no IOMMU between. */
	ret = ib_register_device(ib, "virtio_rdma%d", dev->vdev->dev.parent);
	if (ret)
		return ret;
	dev->registered = true;
	return 0;
}

void vrdma_unregister(struct vrdma_dev *dev)
{
	if (!dev->registered)
		return;
	dev->registered = false;
	ib_unregister_device(&dev->ib);
}
