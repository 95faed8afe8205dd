/* SPDX-License-Identifier: GPL-2.0 */
/*
 * virtio-rdma: the driver's state of one device.
 */
#ifndef _VIRTIO_RDMA_H
#define _VIRTIO_RDMA_H

#include <linux/completion.h>
#include <linux/list.h>
#include <linux/mutex.h>
#include <linux/netdevice.h>
#include <linux/spinlock.h>
#include <linux/virtio.h>
#include <linux/workqueue.h>
#include <linux/xarray.h>
#include <rdma/ib_verbs.h>
#include <rdma/uverbs_ioctl.h>

#include "virtio_rdma_abi.h"
#include "virtio_rdma_user.h"

/* Buffers kept posted on the eventq and on the notifyq (DRV-8). */
#define VRDMA_EVENT_BUFS 64
#define VRDMA_NOTIFY_BUFS 64

/* Doorbells of the kernel's own context: its QPs, SRQs and CQs. */
#define VRDMA_KERNEL_DOORBELL_BITS 4096

/* The most pages a ring in a process's memory may have (256 MiB). */
#define VRDMA_URING_MAX_PAGES 65536
/* The most pages a REG_MR's list may have (spec §6.16: a 4 MiB list). */
#define VRDMA_MR_MAX_PAGES BIT(19)

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
	/* VIRTIO_RDMA_F_STATS: the port's hardware counters (QUERY_STATS). */
	bool stats;

	/* The controlq: one request at a time. */
	struct mutex cmd_lock;
	struct completion cmd_done;
	/* Serializes the controlq's ring: adding, kicking, taking. */
	spinlock_t ctrl_lock;
	/* A command timed out: its buffers may still be written. */
	bool broken;
	/*
	 * Memory of objects the device may still use once it stopped
	 * answering (rings, pinned pages, page lists): kept until the device
	 * is reset (vrdma_release_held()), never handed back to the allocator
	 * while the device could write or read it.
	 */
	spinlock_t held_lock;
	struct list_head held;

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

/* A ring in a process's memory, pinned while the device may use it. */
struct vrdma_uring {
	struct ib_umem *buf;
	struct ib_umem *header;
};

struct vrdma_db_entry;

/* A process's device context and its doorbell area (spec §6.9, §8.7). */
struct vrdma_ucontext {
	struct ib_ucontext ibuc;
	u32 handle;
	struct vrdma_db_entry *db;
};

/*
 * Each object records the device context it was made in (the kernel's, or
 * its process's): every command about it names that context (spec §6.3).
 */
struct vrdma_pd {
	struct ib_pd ibpd;
	u32 handle;
	u32 ctx;
};

struct vrdma_mr {
	struct ib_mr ibmr;
	u32 ctx;
	/* A user MR's pinned memory. */
	struct ib_umem *umem;
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
	u32 ctx;
	u32 doorbell;
	/* Serializes polling and arming, and swapping rings on a resize. */
	spinlock_t lock;
	/* A kernel CQ's ring, or a user CQ's (its process polls it). */
	struct vrdma_ring ring;
	struct vrdma_uring uring;
	u64 arm_seq;
	/* One resize at a time (RESIZE_CQ sleeps). */
	struct mutex resize_lock;
	/*
	 * A kernel CQ's RESIZE_CQ is with the device: polls find nothing and
	 * an arm waits (arm_pending, its flags in arm_flags) for the new ring.
	 */
	bool resizing;
	bool arm_pending;
	enum ib_cq_notify_flags arm_flags;
};

/* A memory window (spec §6.20): the device names it by its rkey's index. */
struct vrdma_mw {
	struct ib_mw ibmw;
	u32 ctx;
};

struct vrdma_srq {
	struct ib_srq ibsrq;
	u32 handle;
	u32 ctx;
	u32 doorbell;
	u32 max_sge;
	/* Serializes posting to the ring. */
	spinlock_t lock;
	struct vrdma_ring ring;
	struct vrdma_uring uring;
};

struct vrdma_qp {
	struct ib_qp ibqp;
	u32 ctx;
	u32 doorbell;
	u8 type;
	bool sig_all;
	/* The capacities the device answered CREATE_QP with. */
	u32 max_send_wr;
	u32 max_recv_wr;
	u32 max_send_sge;
	u32 max_recv_sge;
	u32 max_inline;
	/* Serializes posting to the send ring. */
	spinlock_t sq_lock;
	/* Serializes posting to the receive ring. */
	spinlock_t rq_lock;
	/*
	 * A kernel QP's outstanding work requests, for verbs' max_send_wr and
	 * max_recv_wr (spec §7.2: the device frees a slot when it copies the
	 * WQE, before it completes): receives posted less those completed;
	 * sends posted since RESET (sq.index) less the count of retired ones
	 * the latest send completion carried (§7.8), which the poller leaves
	 * in sq_seen and a post takes into sq_done under sq_lock.
	 */
	atomic_t rq_out;
	u32 sq_seen;
	u32 sq_done;
	struct vrdma_ring sq;
	struct vrdma_ring rq;
	struct vrdma_uring usq;
	struct vrdma_uring urq;
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

/* virtio_rdma_user.c: user contexts, user rings and MRs, the kick. */
extern const struct uapi_definition vrdma_uapi_defs[];
u32 vrdma_udata_ctx(struct vrdma_dev *dev, struct ib_udata *udata);
int vrdma_alloc_ucontext(struct ib_ucontext *ibuc, struct ib_udata *udata);
void vrdma_dealloc_ucontext(struct ib_ucontext *ibuc);
void vrdma_disassociate_ucontext(struct ib_ucontext *ibuc);
int vrdma_mmap(struct ib_ucontext *ibuc, struct vm_area_struct *vma);
void vrdma_mmap_free(struct rdma_user_mmap_entry *rdma);
u32 vrdma_uring_npages(const struct virtio_rdma_uring *u);
int vrdma_uring_get(struct ib_device *ib, const struct virtio_rdma_uring *u,
		    struct vrdma_uring *r, struct virtio_rdma_ring *d,
		    u64 *pages);
void vrdma_uring_put(struct vrdma_dev *dev, struct vrdma_uring *r);

/* Frees, or once the device is broken holds until its reset. */
void vrdma_free_pages(struct vrdma_dev *dev, void *buf, size_t size);
void vrdma_kfree(struct vrdma_dev *dev, void *p);
void vrdma_umem_release(struct vrdma_dev *dev, struct ib_umem *umem);
void vrdma_release_held(struct vrdma_dev *dev);
struct ib_mr *vrdma_reg_user_mr(struct ib_pd *ibpd, u64 start, u64 length,
				u64 virt, int flags, struct ib_udata *udata);

int vrdma_cmd(struct vrdma_dev *dev, u16 opcode, u32 context,
	      const void *body, size_t body_len,
	      const u64 *pages, size_t npages,
	      void *resp, size_t resp_len);
int vrdma_status_errno(u16 status);
void vrdma_device_fatal(struct vrdma_dev *dev);
u32 vrdma_access(int flags);

#endif /* _VIRTIO_RDMA_H */
