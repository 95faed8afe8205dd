// SPDX-License-Identifier: GPL-2.0
/*
 * virtio-rdma: what user space needs beyond the kernel's verbs (spec §8.7)
 * — a device context per process with its doorbell area mapped into that
 * process, rings and memory regions pinned from the process's memory, and
 * the doorbellq's kick as a uverbs method. The ABI is virtio_rdma_user.h.
 */
#include <linux/mm.h>
#include <linux/slab.h>
#include <rdma/ib_umem.h>
#include <rdma/iter.h>
#include <rdma/uverbs_ioctl.h>

#define UVERBS_MODULE_NAME virtio_rdma_ib
#include <rdma/uverbs_named_ioctl.h>

#include "virtio_rdma.h"

/* Doorbells of a user context: one page of area (spec §8.1). */
#define VRDMA_USER_DOORBELL_BITS 16384

/* A context's doorbell area, mapped into its process (pages refcounted). */
struct vrdma_db_entry {
	struct rdma_user_mmap_entry rdma;
	void *area;
	size_t size;
	/*
	 * The device may still write the area's poll word: its context was
	 * not destroyed, or a device that stopped answering was asked to.
	 */
	bool device_holds;
};

static struct vrdma_pd *to_vpd(struct ib_pd *pd)
{
	return container_of(pd, struct vrdma_pd, ibpd);
}

static struct vrdma_ucontext *to_vuc(struct ib_ucontext *uc)
{
	return container_of(uc, struct vrdma_ucontext, ibuc);
}

/* The device context a verb acts in: the process's, or the kernel's. */
u32 vrdma_udata_ctx(struct vrdma_dev *dev, struct ib_udata *udata)
{
	struct vrdma_ucontext *uc;

	if (!udata)
		return dev->kctx;
	uc = rdma_udata_to_drv_context(udata, struct vrdma_ucontext, ibuc);
	return uc ? uc->handle : dev->kctx;
}

/*
 * Destroys context @handle; the device then writes its doorbell area no
 * more — unless it stopped answering, when the area is never freed.
 */
static void vrdma_destroy_context(struct vrdma_dev *dev, u32 handle,
				  struct vrdma_db_entry *e)
{
	int ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_DESTROY_CONTEXT, handle, NULL,
			    0, NULL, 0, NULL, 0);

	e->device_holds = ret && READ_ONCE(dev->broken);
}

static void vrdma_db_free(struct vrdma_db_entry *e)
{
	if (!e->device_holds)
		free_pages_exact(e->area, e->size);
	kfree(e);
}

int vrdma_alloc_ucontext(struct ib_ucontext *ibuc, struct ib_udata *udata)
{
	struct vrdma_dev *dev = to_vdev(ibuc->device);
	struct vrdma_ucontext *uc = to_vuc(ibuc);
	struct virtio_rdma_alloc_ucontext_resp resp = {};
	struct virtio_rdma_create_context req = {};
	struct virtio_rdma_handle_resp cresp;
	struct vrdma_db_entry *e;
	u32 bits = min_t(u32, VRDMA_USER_DOORBELL_BITS,
			 le32_to_cpu(dev->config.max_doorbell_bits));
	size_t npages, i;
	u64 *pages;
	int ret;

	if (udata->inlen)
		return -EINVAL;
	e = kzalloc(sizeof(*e), GFP_KERNEL);
	if (!e)
		return -ENOMEM;
	npages = DIV_ROUND_UP(VIRTIO_RDMA_DB_BITMAP + bits / 8,
			      VIRTIO_RDMA_PAGE_SIZE);
	e->size = PAGE_ALIGN(npages * VIRTIO_RDMA_PAGE_SIZE);
	/* Zeroed (DRV-10), and split into pages the process may map. */
	e->area = alloc_pages_exact(e->size, GFP_KERNEL | __GFP_ZERO);
	pages = kcalloc(npages, sizeof(*pages), GFP_KERNEL);
	if (!e->area || !pages) {
		ret = -ENOMEM;
		goto free;
	}
	for (i = 0; i < npages; i++)
		pages[i] = virt_to_phys(e->area) + i * VIRTIO_RDMA_PAGE_SIZE;
	req.doorbell_bits = cpu_to_le32(bits);
	req.npages = cpu_to_le32(npages);
	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_CREATE_CONTEXT, 0, &req,
			sizeof(req), pages, npages, &cresp, sizeof(cresp));
	kfree(pages);
	pages = NULL;
	if (ret && READ_ONCE(dev->broken)) {
		/* No answer: the device may yet write the area; it stays. */
		kfree(e);
		return ret;
	}
	if (ret)
		goto free;
	uc->handle = le32_to_cpu(cresp.handle);
	e->device_holds = true;
	resp.context = uc->handle;
	resp.doorbell_bits = bits;
	resp.doorbell_size = e->size;
	if (dev->doorbell_poll)
		resp.flags |= VIRTIO_RDMA_UCTX_DOORBELL_POLL;
	resp.max_inline_data = le32_to_cpu(dev->attr.max_inline_data);
	ret = rdma_user_mmap_entry_insert(ibuc, &e->rdma, e->size);
	if (ret) {
		vrdma_destroy_context(dev, uc->handle, e);
		vrdma_db_free(e);
		return ret;
	}
	resp.doorbell_offset = rdma_user_mmap_get_offset(&e->rdma);
	ret = ib_copy_to_udata(udata, &resp, min(sizeof(resp), udata->outlen));
	if (ret) {
		vrdma_destroy_context(dev, uc->handle, e);
		/* The entry's last reference frees the area. */
		rdma_user_mmap_entry_remove(&e->rdma);
		return ret;
	}
	uc->db = e;
	return 0;
free:
	kfree(pages);
	if (e->area)
		free_pages_exact(e->area, e->size);
	kfree(e);
	return ret;
}

/*
 * The process is gone (or ib_core took the device from it): the device
 * destroys what is left of the context (§6.10) and reads its doorbell area
 * no more; the area goes with the mmap entry's last reference.
 */
void vrdma_dealloc_ucontext(struct ib_ucontext *ibuc)
{
	struct vrdma_dev *dev = to_vdev(ibuc->device);
	struct vrdma_ucontext *uc = to_vuc(ibuc);

	vrdma_destroy_context(dev, uc->handle, uc->db);
	rdma_user_mmap_entry_remove(&uc->db->rdma);
}

/*
 * ib_core takes the device from a process that still holds it (the
 * driver unbinds): its objects are destroyed through the driver, and the
 * doorbell area it mapped stays plain memory it holds a reference to, so
 * nothing here needs revoking.
 */
void vrdma_disassociate_ucontext(struct ib_ucontext *ibuc)
{
}

int vrdma_mmap(struct ib_ucontext *ibuc, struct vm_area_struct *vma)
{
	struct rdma_user_mmap_entry *rdma;
	struct vrdma_db_entry *e;
	unsigned long addr;
	size_t off;
	int ret = 0;

	/*
	 * Shared, writable, never executable (§8.7); inherited by a child as a
	 * NIC's doorbell page is: librdmacm opens its contexts once, and a
	 * child of fork() posts on them (rdma-core's own tests do).
	 */
	if (vma->vm_flags & VM_EXEC)
		return -EPERM;
	rdma = rdma_user_mmap_entry_get(ibuc, vma);
	if (!rdma)
		return -EINVAL;
	e = container_of(rdma, struct vrdma_db_entry, rdma);
#ifdef VRDMA_HAVE_VM_FLAGS_SET
	vm_flags_set(vma, VM_DONTEXPAND | VM_DONTDUMP);
	vm_flags_clear(vma, VM_MAYEXEC);
#else
	vma->vm_flags |= VM_DONTEXPAND | VM_DONTDUMP;
	vma->vm_flags &= ~VM_MAYEXEC;
#endif
	for (off = 0, addr = vma->vm_start; off < e->size && !ret;
	     off += PAGE_SIZE, addr += PAGE_SIZE)
		ret = vm_insert_page(vma, addr, virt_to_page((u8 *)e->area + off));
	rdma_user_mmap_entry_put(rdma);
	return ret;
}

void vrdma_mmap_free(struct rdma_user_mmap_entry *rdma)
{
	vrdma_db_free(container_of(rdma, struct vrdma_db_entry, rdma));
}

/* --- rings and regions in a process's memory ------------------------------ */

/* Appends the 4 KiB pieces of @umem's pages, in order, to @pages. */
static size_t vrdma_umem_pages(struct ib_umem *umem, u64 *pages)
{
	struct ib_block_iter biter;
	size_t n = 0;

	rdma_umem_for_each_dma_block(umem, &biter, VIRTIO_RDMA_PAGE_SIZE)
		pages[n++] = rdma_block_iter_dma_address(&biter);
	return n;
}

/*
 * Pins the ring @u describes (spec §6.5) and fills its command descriptor
 * @d and its page addresses into @pages (room for @u's pages). Addresses
 * are the umem's DMA addresses: guest-physical, the device not being
 * behind an IOMMU (no ACCESS_PLATFORM). The device checks what the ring
 * may be; this checks only what pinning needs.
 */
int vrdma_uring_get(struct ib_device *ib, const struct virtio_rdma_uring *u,
		    struct vrdma_uring *r, struct virtio_rdma_ring *d,
		    u64 *pages)
{
	struct ib_block_iter biter;
	size_t size;
	u64 header = 0;

	memset(d, 0, sizeof(*d));
	if (!is_power_of_2(u->entries) || !is_power_of_2(u->stride) ||
	    u->stride > VIRTIO_RDMA_PAGE_SIZE ||
	    !IS_ALIGNED(u->buf, VIRTIO_RDMA_PAGE_SIZE) ||
	    !IS_ALIGNED(u->header, VIRTIO_RDMA_RING_HEADER_SIZE))
		return -EINVAL;
	size = (size_t)u->entries * u->stride;
	if (size % VIRTIO_RDMA_PAGE_SIZE ||
	    size > VRDMA_URING_MAX_PAGES * VIRTIO_RDMA_PAGE_SIZE)
		return -EINVAL;
	r->buf = ib_umem_get(ib, u->buf, size, IB_ACCESS_LOCAL_WRITE);
	if (IS_ERR(r->buf)) {
		int ret = PTR_ERR(r->buf);

		r->buf = NULL;
		return ret;
	}
	r->header = ib_umem_get(ib, u->header, VIRTIO_RDMA_RING_HEADER_SIZE,
				IB_ACCESS_LOCAL_WRITE);
	if (IS_ERR(r->header)) {
		int ret = PTR_ERR(r->header);

		r->header = NULL;
		ib_umem_release(r->buf);
		r->buf = NULL;
		return ret;
	}
	rdma_umem_for_each_dma_block(r->header, &biter, VIRTIO_RDMA_PAGE_SIZE) {
		header = rdma_block_iter_dma_address(&biter);
		break;
	}
	d->header = cpu_to_le64(header + (u->header & (VIRTIO_RDMA_PAGE_SIZE - 1)));
	d->entries = cpu_to_le32(u->entries);
	d->stride = cpu_to_le32(u->stride);
	d->npages = cpu_to_le32(vrdma_umem_pages(r->buf, pages));
	return 0;
}

void vrdma_uring_put(struct vrdma_dev *dev, struct vrdma_uring *r)
{
	vrdma_umem_release(dev, r->header);
	vrdma_umem_release(dev, r->buf);
	r->header = NULL;
	r->buf = NULL;
}

/* The pages a ring @u asks for (0: none or too many, left to get's check). */
u32 vrdma_uring_npages(const struct virtio_rdma_uring *u)
{
	u64 size = (u64)u->entries * u->stride;

	if (size > (u64)VRDMA_URING_MAX_PAGES * VIRTIO_RDMA_PAGE_SIZE)
		return 0;
	return size / VIRTIO_RDMA_PAGE_SIZE;
}

/*
 * A memory region of the process's memory (spec §6.16): pinned, in the
 * largest page size the device takes in which the pinned memory is
 * contiguous and aligned, so that huge pages make short lists.
 */
struct ib_mr *vrdma_reg_user_mr(struct ib_pd *ibpd, u64 start, u64 length,
				u64 virt, int flags, struct ib_udata *udata)
{
	struct vrdma_dev *dev = to_vdev(ibpd->device);
	struct virtio_rdma_reg_mr req = {};
	struct virtio_rdma_mr_resp resp;
	struct ib_block_iter biter;
	unsigned long pgsz;
	struct vrdma_mr *mr;
	size_t npages, n = 0;
	u64 *pages;
	int ret;

	if (flags & ~(IB_ACCESS_LOCAL_WRITE | IB_ACCESS_REMOTE_WRITE |
		      IB_ACCESS_REMOTE_READ | IB_ACCESS_REMOTE_ATOMIC |
		      IB_ACCESS_MW_BIND | IB_ACCESS_OPTIONAL))
		return ERR_PTR(-EOPNOTSUPP);
	if (!length || length > le64_to_cpu(dev->attr.max_mr_size))
		return ERR_PTR(-EINVAL);
	mr = kzalloc(sizeof(*mr), GFP_KERNEL);
	if (!mr)
		return ERR_PTR(-ENOMEM);
	mr->umem = ib_umem_get(ibpd->device, start, length, flags);
	if (IS_ERR(mr->umem)) {
		ret = PTR_ERR(mr->umem);
		mr->umem = NULL;
		goto free;
	}
	pgsz = ib_umem_find_best_pgsz(mr->umem,
				      le64_to_cpu(dev->attr.page_size_cap) &
				      GENMASK_ULL(30, 12),
				      virt);
	npages = pgsz ? ib_umem_num_dma_blocks(mr->umem, pgsz) : 0;
	if (!npages || npages > VRDMA_MR_MAX_PAGES) {
		ret = -EINVAL;
		goto release;
	}
	pages = kvcalloc(npages, sizeof(*pages), GFP_KERNEL);
	if (!pages) {
		ret = -ENOMEM;
		goto release;
	}
	rdma_umem_for_each_dma_block(mr->umem, &biter, pgsz)
		pages[n++] = rdma_block_iter_dma_address(&biter);
	req.pd = cpu_to_le32(to_vpd(ibpd)->handle);
	req.access = cpu_to_le32(vrdma_access(flags) |
				 (flags & IB_ACCESS_MW_BIND ?
				  VIRTIO_RDMA_ACCESS_MW_BIND : 0));
	req.iova = cpu_to_le64(virt);
	req.length = cpu_to_le64(length);
	req.page_shift = cpu_to_le32(__ffs(pgsz));
	req.offset = cpu_to_le32(ib_umem_dma_offset(mr->umem, pgsz));
	req.npages = cpu_to_le32(n);
	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_REG_MR, to_vpd(ibpd)->ctx, &req,
			sizeof(req), pages, n, &resp, sizeof(resp));
	kvfree(pages);
	if (ret)
		goto release;
	mr->ctx = to_vpd(ibpd)->ctx;
	mr->ibmr.lkey = le32_to_cpu(resp.lkey);
	mr->ibmr.rkey = le32_to_cpu(resp.rkey);
	mr->ibmr.length = length;
	return &mr->ibmr;
release:
	/* A REG_MR left unanswered may yet map the pages: they stay pinned. */
	vrdma_umem_release(dev, mr->umem);
free:
	kfree(mr);
	return ERR_PTR(ret);
}

/* --- the kick (spec §8.7) ---------------------------------------------------- */

static int UVERBS_HANDLER(VIRTIO_RDMA_IB_METHOD_KICK)(struct uverbs_attr_bundle *attrs)
{
	struct ib_ucontext *ibuc = ib_uverbs_get_ucontext(attrs);
	struct vrdma_dev *dev;

	if (IS_ERR(ibuc))
		return PTR_ERR(ibuc);
	dev = to_vdev(ibuc->device);
	if (READ_ONCE(dev->broken))
		return -EIO;
	virtqueue_notify(dev->vqs[VIRTIO_RDMA_VQ_DOORBELL]);
	return 0;
}

DECLARE_UVERBS_NAMED_METHOD(VIRTIO_RDMA_IB_METHOD_KICK, UVERBS_ATTR_UHW());

ADD_UVERBS_METHODS(vrdma_device_methods, UVERBS_OBJECT_DEVICE,
		   &UVERBS_METHOD(VIRTIO_RDMA_IB_METHOD_KICK));

const struct uapi_definition vrdma_uapi_defs[] = {
	UAPI_DEF_CHAIN_OBJ_TREE(UVERBS_OBJECT_DEVICE, &vrdma_device_methods),
	{},
};
