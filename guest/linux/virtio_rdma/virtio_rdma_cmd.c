// SPDX-License-Identifier: GPL-2.0
/*
 * virtio-rdma: control commands on the controlq (docs/virtio-rdma.md §6).
 *
 * A command is one chain: the request (header, body, trailing page
 * addresses) in one driver-readable buffer, the response (header, body)
 * in one device-writable buffer. Commands go one at a time; the controlq's
 * interrupt wakes the caller.
 */
#include <linux/mm.h>
#include <linux/overflow.h>
#include <linux/scatterlist.h>
#include <linux/slab.h>
#include <linux/vmalloc.h>
#include <rdma/ib_umem.h>

#include "virtio_rdma.h"

/* The device stopped answering: IB_EVENT_DEVICE_FATAL for its consumers. */
void vrdma_device_fatal(struct vrdma_dev *dev)
{
	struct ib_event e = {
		.device = &dev->ib,
		.event = IB_EVENT_DEVICE_FATAL,
	};

	if (dev->registered)
		ib_dispatch_event(&e);
}

/* Verbs' access flags in the device's encoding (spec §6.16). */
u32 vrdma_access(int flags)
{
	u32 a = 0;

	if (flags & IB_ACCESS_LOCAL_WRITE)
		a |= VIRTIO_RDMA_ACCESS_LOCAL_WRITE;
	if (flags & IB_ACCESS_REMOTE_WRITE)
		a |= VIRTIO_RDMA_ACCESS_REMOTE_WRITE;
	if (flags & IB_ACCESS_REMOTE_READ)
		a |= VIRTIO_RDMA_ACCESS_REMOTE_READ;
	if (flags & IB_ACCESS_REMOTE_ATOMIC)
		a |= VIRTIO_RDMA_ACCESS_REMOTE_ATOMIC;
	return a;
}

/* The errno of a response status (spec §6.2). */
int vrdma_status_errno(u16 status)
{
	switch (status) {
	case VIRTIO_RDMA_OK:
		return 0;
	case VIRTIO_RDMA_ERR_INVALID:
		return -EINVAL;
	case VIRTIO_RDMA_ERR_NOENT:
		return -ENOENT;
	case VIRTIO_RDMA_ERR_NOMEM:
		return -ENOMEM;
	case VIRTIO_RDMA_ERR_BUSY:
		return -EBUSY;
	case VIRTIO_RDMA_ERR_UNSUPPORTED:
		return -EOPNOTSUPP;
	case VIRTIO_RDMA_ERR_FAULT:
		return -EFAULT;
	case VIRTIO_RDMA_ERR_LENGTH:
		return -EMSGSIZE;
	default:
		return -EIO;
	}
}

/*
 * The scatterlist of request @req of @len bytes: @one for kmalloc'ed
 * memory, else one entry per page of the vmalloc'ed request (a long page
 * list, e.g. a large MR's), allocated. NULL: no memory.
 */
static struct scatterlist *vrdma_req_sg(void *req, size_t len,
					struct scatterlist *one)
{
	struct scatterlist *sg;
	size_t n, i, off;

	if (!is_vmalloc_addr(req)) {
		sg_init_one(one, req, len);
		return one;
	}
	n = DIV_ROUND_UP(len, PAGE_SIZE);
	sg = kmalloc_array(n, sizeof(*sg), GFP_KERNEL);
	if (!sg)
		return NULL;
	sg_init_table(sg, n);
	for (i = 0, off = 0; i < n; i++, off += PAGE_SIZE)
		sg_set_page(&sg[i], vmalloc_to_page((u8 *)req + off),
			    min_t(size_t, len - off, PAGE_SIZE), 0);
	return sg;
}

/*
 * Runs command @opcode in @context with @body and @npages page addresses,
 * and copies the response's body (exactly @resp_len bytes) into @resp.
 * Returns 0, the command's errno, or -ETIMEDOUT (the device stopped
 * answering: every later command fails until the device is reset).
 */
int vrdma_cmd(struct vrdma_dev *dev, u16 opcode, u32 context,
	      const void *body, size_t body_len,
	      const u64 *pages, size_t npages,
	      void *resp, size_t resp_len)
{
	struct virtqueue *vq = dev->vqs[VIRTIO_RDMA_VQ_CONTROL];
	struct virtio_rdma_cmd_hdr *hdr;
	struct virtio_rdma_resp_hdr *rhdr;
	struct scatterlist one, in, *out = NULL, *sgs[2];
	size_t req_len, rsp_len, i;
	__le64 *trailing;
	unsigned int len;
	void *req, *rsp, *token;
	int ret;

	if (check_mul_overflow(npages, sizeof(__le64), &req_len) ||
	    check_add_overflow(req_len, sizeof(*hdr) + body_len, &req_len))
		return -EMSGSIZE;
	if (req_len > le32_to_cpu(dev->config.max_request))
		return -EMSGSIZE;
	rsp_len = sizeof(*rhdr) + resp_len;

	req = kvzalloc(req_len, GFP_KERNEL);
	rsp = kzalloc(rsp_len, GFP_KERNEL);
	if (!req || !rsp) {
		ret = -ENOMEM;
		goto free;
	}
	hdr = req;
	hdr->opcode = cpu_to_le16(opcode);
	hdr->context = cpu_to_le32(context);
	if (body_len)
		memcpy(hdr + 1, body, body_len);
	trailing = (__le64 *)((u8 *)(hdr + 1) + body_len);
	for (i = 0; i < npages; i++)
		trailing[i] = cpu_to_le64(pages[i]);

	out = vrdma_req_sg(req, req_len, &one);
	if (!out) {
		ret = -ENOMEM;
		goto free;
	}
	sg_init_one(&in, rsp, rsp_len);
	sgs[0] = out;
	sgs[1] = &in;

	mutex_lock(&dev->cmd_lock);
	if (dev->broken) {
		ret = -EIO;
		goto unlock;
	}
	reinit_completion(&dev->cmd_done);
	spin_lock_irq(&dev->ctrl_lock);
	ret = virtqueue_add_sgs(vq, sgs, 1, 1, req, GFP_ATOMIC);
	if (!ret)
		virtqueue_kick(vq);
	spin_unlock_irq(&dev->ctrl_lock);
	if (ret)
		goto unlock;

	wait_for_completion_timeout(&dev->cmd_done,
				    msecs_to_jiffies(VRDMA_CMD_TIMEOUT_MS));
	spin_lock_irq(&dev->ctrl_lock);
	token = virtqueue_get_buf(vq, &len);
	spin_unlock_irq(&dev->ctrl_lock);
	if (token != req) {
		/*
		 * No answer: the device may still use the request and write
		 * the response, so their buffers stay allocated for good.
		 */
		dev->broken = true;
		mutex_unlock(&dev->cmd_lock);
		dev_err(&dev->vdev->dev,
			"command %u: no response in %u ms; the device needs a reset\n",
			opcode, VRDMA_CMD_TIMEOUT_MS);
		/* Its consumers learn it as they would of a device failure. */
		vrdma_device_fatal(dev);
		return -ETIMEDOUT;
	}
	mutex_unlock(&dev->cmd_lock);

	rhdr = rsp;
	if (len < sizeof(*rhdr)) {
		/* A chain that could carry no status (spec DEV-12). */
		ret = -EIO;
		goto free;
	}
	ret = vrdma_status_errno(le16_to_cpu(rhdr->status));
	if (ret) {
		dev_dbg(&dev->vdev->dev, "command %u: status %u, detail %u\n",
			opcode, le16_to_cpu(rhdr->status),
			le32_to_cpu(rhdr->detail));
		goto free;
	}
	if (len != rsp_len) {
		dev_err(&dev->vdev->dev,
			"command %u: a response of %u bytes, not %zu\n",
			opcode, len, rsp_len);
		ret = -EPROTO;
		goto free;
	}
	if (resp_len)
		memcpy(resp, rhdr + 1, resp_len);
	goto free;

unlock:
	mutex_unlock(&dev->cmd_lock);
free:
	if (out != &one)
		kfree(out);
	kvfree(req);
	kfree(rsp);
	return ret;
}

/* --- memory the device may still use ---------------------------------------- */

enum vrdma_held_kind { VRDMA_HELD_PAGES, VRDMA_HELD_KMEM, VRDMA_HELD_UMEM };

struct vrdma_held {
	struct list_head list;
	enum vrdma_held_kind kind;
	void *p;
	size_t size;
};

static void vrdma_held_free(enum vrdma_held_kind kind, void *p, size_t size)
{
	switch (kind) {
	case VRDMA_HELD_PAGES:
		free_pages_exact(p, size);
		break;
	case VRDMA_HELD_KMEM:
		kfree(p);
		break;
	case VRDMA_HELD_UMEM:
		ib_umem_release(p);
		break;
	}
}

/*
 * Frees @p now, or — the device stopped answering, so it may still hold the
 * object @p belongs to and write or read it — keeps it until the device is
 * reset. Without room to note it, it is never freed.
 */
static void vrdma_free_or_hold(struct vrdma_dev *dev, enum vrdma_held_kind kind,
			       void *p, size_t size)
{
	struct vrdma_held *h;

	if (!p)
		return;
	if (!READ_ONCE(dev->broken)) {
		vrdma_held_free(kind, p, size);
		return;
	}
	h = kmalloc(sizeof(*h), GFP_KERNEL);
	if (!h)
		return;
	h->kind = kind;
	h->p = p;
	h->size = size;
	spin_lock(&dev->held_lock);
	list_add_tail(&h->list, &dev->held);
	spin_unlock(&dev->held_lock);
}

void vrdma_free_pages(struct vrdma_dev *dev, void *buf, size_t size)
{
	vrdma_free_or_hold(dev, VRDMA_HELD_PAGES, buf, size);
}

void vrdma_kfree(struct vrdma_dev *dev, void *p)
{
	vrdma_free_or_hold(dev, VRDMA_HELD_KMEM, p, 0);
}

void vrdma_umem_release(struct vrdma_dev *dev, struct ib_umem *umem)
{
	vrdma_free_or_hold(dev, VRDMA_HELD_UMEM, umem, 0);
}

/* The device was reset: it touches none of this memory any more. */
void vrdma_release_held(struct vrdma_dev *dev)
{
	struct vrdma_held *h, *next;
	LIST_HEAD(held);

	spin_lock(&dev->held_lock);
	list_splice_init(&dev->held, &held);
	spin_unlock(&dev->held_lock);
	list_for_each_entry_safe(h, next, &held, list) {
		vrdma_held_free(h->kind, h->p, h->size);
		kfree(h);
	}
}
