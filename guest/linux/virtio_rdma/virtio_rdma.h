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

#include "virtio_rdma_abi.h"

/* Buffers kept posted on the eventq and on the notifyq (DRV-8). */
#define VRDMA_EVENT_BUFS 64
#define VRDMA_NOTIFY_BUFS 64

/* Doorbells of the kernel's own context: its QPs, SRQs and CQs. */
#define VRDMA_KERNEL_DOORBELL_BITS 4096

/* How long a command may take before the device is given up on. */
#define VRDMA_CMD_TIMEOUT_MS 30000

struct vrdma_dev {
	struct virtio_device *vdev;
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
	struct net_device *netdev;
	netdevice_tracker netdev_tracker;
};

int vrdma_cmd(struct vrdma_dev *dev, u16 opcode, u32 context,
	      const void *body, size_t body_len,
	      const u64 *pages, size_t npages,
	      void *resp, size_t resp_len);
int vrdma_status_errno(u16 status);

#endif /* _VIRTIO_RDMA_H */
