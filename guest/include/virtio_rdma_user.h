/* SPDX-License-Identifier: ((GPL-2.0 WITH Linux-syscall-note) OR BSD-3-Clause) */
/*
 * virtio-rdma: the user-verbs ABI between the Linux driver
 * (guest/linux/virtio_rdma) and its rdma-core provider
 * (guest/rdma-core/virtio_rdma): the driver data of the uverbs commands,
 * the mmap of a context's doorbell area, and the kick method
 * (docs/virtio-rdma.md §8.7). Versioned by VIRTIO_RDMA_ABI_VERSION
 * (virtio_rdma_abi.h), the device's uverbs ABI version.
 *
 * Native byte order, as every uverbs driver ABI: these structures pass
 * between a process and its own kernel. Sizes are multiples of 8.
 */
#ifndef _VIRTIO_RDMA_USER_H
#define _VIRTIO_RDMA_USER_H

#include <linux/types.h>

/*
 * The kick: a method of the uverbs device object in the driver's
 * namespace (UVERBS_ID_DRIVER_NS, 1 << 12), with no attributes (an enum:
 * the kernel's method macros paste its name). It kicks
 * the doorbellq for the calling context's device; a provider makes it
 * when VIRTIO_RDMA_UCTX_DOORBELL_POLL is clear or the doorbell area's
 * poll word reads 0 after ringing a doorbell (§8.3 step 5).
 */
enum virtio_rdma_ib_methods {
	VIRTIO_RDMA_IB_METHOD_KICK = 0x1000, /* UVERBS_ID_DRIVER_NS */
};

/* alloc_ucontext: no request data. */
struct virtio_rdma_alloc_ucontext_resp {
	__u32 context; /* the device's handle of this context (§6.9) */
	__u32 doorbell_bits; /* its doorbell indices: 0 .. doorbell_bits - 1 */
	__aligned_u64 doorbell_offset; /* mmap offset of the doorbell area */
	__u32 doorbell_size; /* bytes to map there: whole pages */
	__u32 flags; /* VIRTIO_RDMA_UCTX_* */
	__u32 max_inline_data; /* the device's, per send WQE */
	__u32 reserved;
};

/* DOORBELL_POLL was negotiated: kick only when the poll word reads 0. */
#define VIRTIO_RDMA_UCTX_DOORBELL_POLL 0x1

/*
 * A ring in the process's memory (§6.5, §8.7): entries × stride bytes at
 * a page-aligned address, whole pages, and its 64-byte header at a
 * 64-byte-aligned address outside every ring's pages (headers may share
 * a page with each other). The driver pins both and hands the device
 * their guest-physical pages. A ring not wanted (a QP on an SRQ has no
 * receive ring) is all zero.
 */
struct virtio_rdma_uring {
	__aligned_u64 buf;
	__aligned_u64 header;
	__u32 entries; /* a power of two */
	__u32 stride; /* bytes per entry, a power of two, at most 4096 */
};

struct virtio_rdma_create_cq_ureq {
	struct virtio_rdma_uring ring;
};

struct virtio_rdma_create_cq_uresp {
	__u32 cq; /* the CQ's handle: notifications name it */
	__u32 doorbell; /* its doorbell index in the context (§8.2) */
};

/*
 * resize_cq: the new ring (spec §6.15), in new memory: the device moves
 * the completions the old ring holds into its first entries, and the
 * process's consumer index starts again at 0. The new size comes back in
 * the uverbs response (cqe = entries - 1).
 */
struct virtio_rdma_resize_cq_ureq {
	struct virtio_rdma_uring ring;
};

struct virtio_rdma_create_srq_ureq {
	struct virtio_rdma_uring ring;
};

struct virtio_rdma_create_srq_uresp {
	__u32 srq;
	__u32 doorbell;
};

/*
 * create_qp: the send ring, and the receive ring (zero on an SRQ). The
 * QP's capabilities travel in the uverbs command itself; the device's
 * answer (max_send_wr etc.) comes back in the uverbs response.
 */
struct virtio_rdma_create_qp_ureq {
	struct virtio_rdma_uring sq;
	struct virtio_rdma_uring rq;
};

struct virtio_rdma_create_qp_uresp {
	__u32 qpn;
	__u32 doorbell; /* serves both rings */
};

/*
 * create_ah: the address vector to put in UD send WQEs (§7.5), with the
 * destination MAC the kernel resolved.
 */
struct virtio_rdma_create_ah_uresp {
	__u8 av[32]; /* struct virtio_rdma_av, little-endian as the device reads it */
};

#endif /* _VIRTIO_RDMA_USER_H */
