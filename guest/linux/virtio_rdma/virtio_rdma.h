/* SPDX-License-Identifier: GPL-2.0 */
/*
 * virtio-rdma: the driver's state of one device.
 */
#ifndef _VIRTIO_RDMA_H
#define _VIRTIO_RDMA_H

#include <linux/completion.h>
#include <linux/mutex.h>
#include <linux/netdevice.h>
#include <linux/spinlock.h>
#include <linux/virtio.h>
#include <linux/workqueue.h>
#include <linux/xarray.h>
#include <rdma/ib_verbs.h>

#include "virtio_rdma_abi.h"

/* Buffers kept posted on the eventq and on the notifyq (DRV-8). */
#define VRDMA_EVENT_BUFS 64
#define VRDMA_NOTIFY_BUFS 64

/* Doorbells of the kernel's own context: its QPs, SRQs and CQs. */
#define VRDMA_KERNEL_DOORBELL_BITS 4096

/* How long a command may take before the device is given up on. */
#define VRDMA_CMD_TIMEOUT_MS 30000

struct vrdma_dev {
	/* First: ib_alloc_device() allocates the whole. */
	struct ib_device ib;
	struct virtio_device *vdev;
	bool registered;
	struct virtqueue *vqs[VIRTIO_RDMA_VQ_COUNT];
	struct virtio_rdma_config config;
	bool doorbell_poll;

	/* The controlq: one request at a time. */
	struct mutex cmd_lock;
	struct completion cmd_done;
	/* Serializes the controlq's ring: adding, kicking, taking. */
	spinlock_t ctrl_lock;
	/* A command timed out: its buffers may still be written. */
	bool broken;

	/* The eventq's and the notifyq's buffers, reposted as read. */
	struct virtio_rdma_event *events;
	struct virtio_rdma_notification *notifications;
	/* Serializes the eventq's and notifyq's rings, and stopping. */
	spinlock_t item_lock;
	struct work_struct item_work;
	bool stopping;

	struct virtio_rdma_device_attr attr;
	struct virtio_rdma_port_attr port;

	/* The kernel's context and its doorbell area. */
	u32 kctx;
	void *doorbell_area;
	size_t doorbell_size;

	/* The sibling netdev, found by MAC (spec §3). */
	struct notifier_block netdev_nb;
	/* Changes under RTNL too; read under this alone. */
	spinlock_t netdev_lock;
	struct net_device *netdev;
	netdevice_tracker netdev_tracker;

	/* Live CQs, SRQs by handle and QPs by QPN, for completions and events. */
	struct xarray cqs;
	struct xarray srqs;
	struct xarray qps;
};

/* A ring in kernel memory: its pages, contiguous, and its header. */
struct vrdma_ring {
	void *buf;
	size_t size;
	u32 entries;
	u32 stride;
	void *header;
	/* The driver's producer (WQ rings) or consumer (CQ rings) index. */
	u32 index;
};

struct vrdma_pd {
	struct ib_pd ibpd;
	u32 handle;
};

struct vrdma_mr {
	struct ib_mr ibmr;
	/* A fast-registration MR's page list (REG_MR work requests). */
	__le64 *pages;
	u32 npages;
	u32 max_pages;
};

struct vrdma_ah {
	struct ib_ah ibah;
	struct virtio_rdma_av av;
};

struct vrdma_cq {
	struct ib_cq ibcq;
	u32 handle;
	u32 doorbell;
	/* Serializes polling and arming. */
	spinlock_t lock;
	struct vrdma_ring ring;
	u64 arm_seq;
};

struct vrdma_srq {
	struct ib_srq ibsrq;
	u32 handle;
	u32 doorbell;
	u32 max_sge;
	/* Serializes posting to the ring. */
	spinlock_t lock;
	struct vrdma_ring ring;
};

struct vrdma_qp {
	struct ib_qp ibqp;
	u32 doorbell;
	u8 type;
	bool sig_all;
	u32 max_send_sge;
	u32 max_recv_sge;
	u32 max_inline;
	/* Serializes posting to the send ring. */
	spinlock_t sq_lock;
	/* Serializes posting to the receive ring. */
	spinlock_t rq_lock;
	struct vrdma_ring sq;
	struct vrdma_ring rq;
	/* The attributes last set, for query_qp's answer. */
	struct ib_qp_attr attr;
};

static inline struct vrdma_dev *to_vdev(struct ib_device *ib)
{
	return container_of(ib, struct vrdma_dev, ib);
}

void vrdma_ib_init(struct vrdma_dev *dev);
int vrdma_register(struct vrdma_dev *dev);
void vrdma_unregister(struct vrdma_dev *dev);
void vrdma_ring_doorbell(struct vrdma_dev *dev, u32 index);
void vrdma_dispatch_event(struct vrdma_dev *dev,
			  const struct virtio_rdma_event *ev);
void vrdma_notify_cq(struct vrdma_dev *dev, u32 cq);
void vrdma_device_fatal(struct vrdma_dev *dev);

int vrdma_cmd(struct vrdma_dev *dev, u16 opcode, u32 context,
	      const void *body, size_t body_len,
	      const u64 *pages, size_t npages,
	      void *resp, size_t resp_len);
int vrdma_status_errno(u16 status);

#endif /* _VIRTIO_RDMA_H */
