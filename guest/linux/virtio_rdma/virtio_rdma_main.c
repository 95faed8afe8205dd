// SPDX-License-Identifier: GPL-2.0
/*
 * virtio-rdma: a driver for the virtio RDMA device (device ID 42) that
 * docs/virtio-rdma.md specifies.
 *
 * This part brings the device up as the specification's §5 says: the
 * features, the configuration, the four virtqueues (the doorbellq used
 * only for its kicks), the eventq and the notifyq kept stocked, the
 * device's and its port's attributes, the kernel's own context with its
 * doorbell area, and the sibling netdev, found by its MAC and followed
 * through the netdevice notifier (spec §3); then it registers the RDMA
 * device (virtio_rdma_ib.c). Removing the driver unregisters it and resets
 * the device, which destroys everything made on it (spec §11.1).
 */
#include <linux/build_bug.h>
#include <linux/etherdevice.h>
#include <linux/if_arp.h>
#include <linux/module.h>
#include <linux/rtnetlink.h>
#include <linux/slab.h>
#include <linux/virtio_config.h>

#include "virtio_rdma.h"

/* The ABI's sizes, as the specification gives them. */
static void __maybe_unused vrdma_abi_sizes(void)
{
	BUILD_BUG_ON(sizeof(struct virtio_rdma_config) != 64);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_cmd_hdr) != 8);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_resp_hdr) != 8);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_ring) != 24);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_device_attr) != 128);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_port_attr) != 32);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_stats) != 256);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_create_context) != 8);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_create_cq) != 24);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_create_cq_resp) != 16);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_resize_cq) != 32);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_reg_mr) != 40);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_create_srq) != 40);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_create_qp) != 80);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_create_qp_resp) != 32);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_av) != 32);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_qp_attr) != 76);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_modify_qp) != 84);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_query_qp_resp) != 100);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_set_gid) != 24);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_send_wqe) != 64);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_sge) != 16);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_recv_wqe) != 16);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_cqe) != 32);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_event) != 16);
	BUILD_BUG_ON(sizeof(struct virtio_rdma_notification) != 8);
}

static void vrdma_ctrl_done(struct virtqueue *vq)
{
	struct vrdma_dev *dev = vq->vdev->priv;

	complete(&dev->cmd_done);
}

static void vrdma_items_done(struct virtqueue *vq)
{
	struct vrdma_dev *dev = vq->vdev->priv;

	schedule_work(&dev->item_work);
}

/* Posts one device-writable buffer on the eventq or the notifyq. */
static int vrdma_post_item(struct virtqueue *vq, void *buf, unsigned int len,
			   gfp_t gfp)
{
	struct scatterlist sg;

	sg_init_one(&sg, buf, len);
	return virtqueue_add_inbuf(vq, &sg, 1, buf, gfp);
}

static void vrdma_event(struct vrdma_dev *dev,
			const struct virtio_rdma_event *ev)
{
	struct device *d = &dev->vdev->dev;
	u32 object = le32_to_cpu(ev->object);

	switch (le32_to_cpu(ev->type)) {
	case VIRTIO_RDMA_EVENT_PORT_ACTIVE:
		dev_info(d, "port %u active\n", object);
		break;
	case VIRTIO_RDMA_EVENT_PORT_ERR:
		dev_info(d, "port %u down\n", object);
		break;
	case VIRTIO_RDMA_EVENT_DEVICE_FATAL:
		dev_err(d, "the device failed (DEVICE_FATAL); it needs a reset\n");
		break;
	case VIRTIO_RDMA_EVENT_EVENTS_LOST:
		dev_warn(d, "%u events lost\n", object);
		break;
	default:
		dev_dbg(d, "event %u for object %u of context %u\n",
			le32_to_cpu(ev->type), object,
			le32_to_cpu(ev->context));
		break;
	}
	vrdma_dispatch_event(dev, ev);
}

/*
 * Takes what the device put in the eventq and the notifyq, reposting each
 * buffer as soon as its item is copied out (DRV-6).
 */
static void vrdma_item_work(struct work_struct *work)
{
	struct vrdma_dev *dev = container_of(work, struct vrdma_dev, item_work);
	struct virtqueue *evq = dev->vqs[VIRTIO_RDMA_VQ_EVENT];
	struct virtqueue *ntq = dev->vqs[VIRTIO_RDMA_VQ_NOTIFY];
	struct virtio_rdma_notification nt, *ntbuf;
	struct virtio_rdma_event ev, *evbuf;
	unsigned int len;

	for (;;) {
		spin_lock_irq(&dev->item_lock);
		evbuf = dev->stopping ? NULL : virtqueue_get_buf(evq, &len);
		if (evbuf) {
			ev = *evbuf;
			if (vrdma_post_item(evq, evbuf, sizeof(*evbuf), GFP_ATOMIC))
				dev_warn_ratelimited(&dev->vdev->dev,
						     "cannot repost an eventq buffer\n");
			virtqueue_kick(evq);
		}
		spin_unlock_irq(&dev->item_lock);
		if (!evbuf)
			break;
		if (len == sizeof(ev))
			vrdma_event(dev, &ev);
		else
			dev_warn_ratelimited(&dev->vdev->dev,
					     "an eventq buffer used with %u bytes\n", len);
	}
	for (;;) {
		spin_lock_irq(&dev->item_lock);
		ntbuf = dev->stopping ? NULL : virtqueue_get_buf(ntq, &len);
		if (ntbuf) {
			nt = *ntbuf;
			if (vrdma_post_item(ntq, ntbuf, sizeof(*ntbuf), GFP_ATOMIC))
				dev_warn_ratelimited(&dev->vdev->dev,
						     "cannot repost a notifyq buffer\n");
			virtqueue_kick(ntq);
		}
		spin_unlock_irq(&dev->item_lock);
		if (!ntbuf)
			break;
		vrdma_notify_cq(dev, le32_to_cpu(nt.cq));
	}
}

/* Whether @nd is the sibling NIC the configuration names (spec §3). */
static bool vrdma_netdev_matches(struct vrdma_dev *dev, struct net_device *nd)
{
	if (nd->type != ARPHRD_ETHER || is_zero_ether_addr(dev->config.mac))
		return false;
	if (!is_zero_ether_addr(nd->perm_addr))
		return ether_addr_equal(nd->perm_addr, dev->config.mac);
	return ether_addr_equal(nd->dev_addr, dev->config.mac);
}

/* Under RTNL. */
static void vrdma_bind_netdev(struct vrdma_dev *dev, struct net_device *nd)
{
	int ret = ib_device_set_netdev(&dev->ib, nd, 1);

	if (ret) {
		dev_err(&dev->vdev->dev, "cannot bind %s: %d\n", nd->name, ret);
		return;
	}
	netdev_hold(nd, &dev->netdev_tracker, GFP_KERNEL);
	spin_lock(&dev->netdev_lock);
	dev->netdev = nd;
	spin_unlock(&dev->netdev_lock);
	dev_info(&dev->vdev->dev, "bound to %s (%pM)\n", nd->name,
		 dev->config.mac);
}

/* Under RTNL. */
static void vrdma_unbind_netdev(struct vrdma_dev *dev)
{
	struct net_device *nd = dev->netdev;

	dev_info(&dev->vdev->dev, "unbound from %s\n", nd->name);
	ib_device_set_netdev(&dev->ib, NULL, 1);
	spin_lock(&dev->netdev_lock);
	dev->netdev = NULL;
	spin_unlock(&dev->netdev_lock);
	netdev_put(nd, &dev->netdev_tracker);
}

/* The sibling NIC comes, changes its address or goes (under RTNL). */
static int vrdma_netdev_event(struct notifier_block *nb, unsigned long event,
			      void *ptr)
{
	struct vrdma_dev *dev = container_of(nb, struct vrdma_dev, netdev_nb);
	struct net_device *nd = netdev_notifier_info_to_dev(ptr);

	switch (event) {
	case NETDEV_REGISTER:
	case NETDEV_CHANGEADDR:
		if (!dev->netdev && vrdma_netdev_matches(dev, nd))
			vrdma_bind_netdev(dev, nd);
		else if (dev->netdev == nd && !vrdma_netdev_matches(dev, nd))
			vrdma_unbind_netdev(dev);
		break;
	case NETDEV_UNREGISTER:
		if (dev->netdev == nd)
			vrdma_unbind_netdev(dev);
		break;
	default:
		break;
	}
	return NOTIFY_DONE;
}

static int vrdma_find_vqs(struct vrdma_dev *dev)
{
#ifdef VRDMA_HAVE_VIRTQUEUE_INFO
	struct virtqueue_info info[VIRTIO_RDMA_VQ_COUNT] = {
		[VIRTIO_RDMA_VQ_CONTROL] = { "control", vrdma_ctrl_done },
		[VIRTIO_RDMA_VQ_EVENT] = { "event", vrdma_items_done },
		[VIRTIO_RDMA_VQ_NOTIFY] = { "notify", vrdma_items_done },
		/* The doorbellq: kicks only, never a buffer (DRV-5). */
		[VIRTIO_RDMA_VQ_DOORBELL] = { "doorbell", NULL },
	};

	return virtio_find_vqs(dev->vdev, VIRTIO_RDMA_VQ_COUNT, dev->vqs, info,
			       NULL);
#else
	vq_callback_t *callbacks[VIRTIO_RDMA_VQ_COUNT] = {
		[VIRTIO_RDMA_VQ_CONTROL] = vrdma_ctrl_done,
		[VIRTIO_RDMA_VQ_EVENT] = vrdma_items_done,
		[VIRTIO_RDMA_VQ_NOTIFY] = vrdma_items_done,
		/* The doorbellq: kicks only, never a buffer (DRV-5). */
		[VIRTIO_RDMA_VQ_DOORBELL] = NULL,
	};
	static const char * const names[VIRTIO_RDMA_VQ_COUNT] = {
		"control", "event", "notify", "doorbell",
	};

	return virtio_find_vqs(dev->vdev, VIRTIO_RDMA_VQ_COUNT, dev->vqs,
			       callbacks, names, NULL);
#endif
}

/* Stocks the eventq and the notifyq (spec §5 step 4; DRV-8). */
static int vrdma_stock(struct vrdma_dev *dev)
{
	unsigned int i;
	int ret;

	dev->events = kcalloc(VRDMA_EVENT_BUFS, sizeof(*dev->events),
			      GFP_KERNEL);
	dev->notifications = kcalloc(VRDMA_NOTIFY_BUFS,
				     sizeof(*dev->notifications), GFP_KERNEL);
	if (!dev->events || !dev->notifications)
		return -ENOMEM;
	for (i = 0; i < VRDMA_EVENT_BUFS; i++) {
		ret = vrdma_post_item(dev->vqs[VIRTIO_RDMA_VQ_EVENT],
				      &dev->events[i], sizeof(dev->events[i]),
				      GFP_KERNEL);
		if (ret)
			return ret;
	}
	for (i = 0; i < VRDMA_NOTIFY_BUFS; i++) {
		ret = vrdma_post_item(dev->vqs[VIRTIO_RDMA_VQ_NOTIFY],
				      &dev->notifications[i],
				      sizeof(dev->notifications[i]), GFP_KERNEL);
		if (ret)
			return ret;
	}
	return 0;
}

/*
 * The kernel's own context (spec §5 step 6): a doorbell area of kernel
 * pages for its consumers' QPs, SRQs and CQs.
 */
static int vrdma_kernel_context(struct vrdma_dev *dev)
{
	struct virtio_rdma_create_context req = {};
	struct virtio_rdma_handle_resp resp;
	u32 bits = min_t(u32, VRDMA_KERNEL_DOORBELL_BITS,
			 le32_to_cpu(dev->config.max_doorbell_bits));
	size_t npages, i;
	u64 *pages;
	int ret;

	dev->doorbell_size = VIRTIO_RDMA_DB_BITMAP + bits / 8;
	npages = DIV_ROUND_UP(dev->doorbell_size, VIRTIO_RDMA_PAGE_SIZE);
	dev->doorbell_area = alloc_pages_exact(npages * VIRTIO_RDMA_PAGE_SIZE,
					       GFP_KERNEL | __GFP_ZERO);
	pages = kcalloc(npages, sizeof(*pages), GFP_KERNEL);
	if (!dev->doorbell_area || !pages) {
		kfree(pages);
		return -ENOMEM;
	}
	/* The device reads guest-physical addresses (no ACCESS_PLATFORM). */
	for (i = 0; i < npages; i++)
		pages[i] = virt_to_phys(dev->doorbell_area) +
			   i * VIRTIO_RDMA_PAGE_SIZE;
	req.doorbell_bits = cpu_to_le32(bits);
	req.npages = cpu_to_le32(npages);
	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_CREATE_CONTEXT, 0, &req,
			sizeof(req), pages, npages, &resp, sizeof(resp));
	kfree(pages);
	if (ret)
		return ret;
	dev->kctx = le32_to_cpu(resp.handle);
	return 0;
}

static int vrdma_query(struct vrdma_dev *dev)
{
	struct virtio_rdma_port_req port = { .port = cpu_to_le32(1) };
	int ret;

	ret = vrdma_cmd(dev, VIRTIO_RDMA_CMD_QUERY_DEVICE, 0, NULL, 0, NULL, 0,
			&dev->attr, sizeof(dev->attr));
	if (ret)
		return ret;
	if (dev->attr.phys_port_cnt != 1)
		return -EPROTO;
	return vrdma_cmd(dev, VIRTIO_RDMA_CMD_QUERY_PORT, 0, &port,
			 sizeof(port), NULL, 0, &dev->port, sizeof(dev->port));
}

static void vrdma_free(struct vrdma_dev *dev)
{
	if (dev->doorbell_area)
		free_pages_exact(dev->doorbell_area,
				 DIV_ROUND_UP(dev->doorbell_size,
					      VIRTIO_RDMA_PAGE_SIZE) *
				 VIRTIO_RDMA_PAGE_SIZE);
	kfree(dev->events);
	kfree(dev->notifications);
	xa_destroy(&dev->cqs);
	xa_destroy(&dev->srqs);
	xa_destroy(&dev->qps);
	ib_dealloc_device(&dev->ib);
}

/*
 * Resets the device — from then on it touches no memory of ours and raises
 * no interrupt (spec §11.1; the reset waits for the callbacks under way) —
 * then waits for the item work and drops the queues.
 */
static void vrdma_stop(struct vrdma_dev *dev)
{
	spin_lock_irq(&dev->item_lock);
	dev->stopping = true;
	spin_unlock_irq(&dev->item_lock);
	virtio_reset_device(dev->vdev);
	cancel_work_sync(&dev->item_work);
	dev->vdev->config->del_vqs(dev->vdev);
	/* Reset: what a device that stopped answering might have used may go. */
	vrdma_release_held(dev);
}

/* Stops following the sibling netdev and lets it go. */
static void vrdma_forget_netdev(struct vrdma_dev *dev)
{
	unregister_netdevice_notifier(&dev->netdev_nb);
	rtnl_lock();
	if (dev->netdev)
		vrdma_unbind_netdev(dev);
	rtnl_unlock();
}

static int vrdma_probe(struct virtio_device *vdev)
{
	struct vrdma_dev *dev;
	int ret;

	dev = ib_alloc_device(vrdma_dev, ib);
	if (!dev)
		return -ENOMEM;
	xa_init_flags(&dev->cqs, XA_FLAGS_LOCK_IRQ);
	xa_init_flags(&dev->srqs, XA_FLAGS_LOCK_IRQ);
	xa_init_flags(&dev->qps, XA_FLAGS_LOCK_IRQ);
	dev->vdev = vdev;
	vdev->priv = dev;
	mutex_init(&dev->cmd_lock);
	init_completion(&dev->cmd_done);
	spin_lock_init(&dev->ctrl_lock);
	spin_lock_init(&dev->held_lock);
	INIT_LIST_HEAD(&dev->held);
	spin_lock_init(&dev->item_lock);
	spin_lock_init(&dev->netdev_lock);
	INIT_WORK(&dev->item_work, vrdma_item_work);

	virtio_cread_bytes(vdev, 0, &dev->config, sizeof(dev->config));
	dev->doorbell_poll = virtio_has_feature(vdev,
						VIRTIO_RDMA_F_DOORBELL_POLL);
	dev->stats = virtio_has_feature(vdev, VIRTIO_RDMA_F_STATS);
	if (le32_to_cpu(dev->config.max_request) < VIRTIO_RDMA_PAGE_SIZE) {
		dev_err(&vdev->dev, "max_request %u: less than a page\n",
			le32_to_cpu(dev->config.max_request));
		ret = -EINVAL;
		goto free;
	}

	ret = vrdma_find_vqs(dev);
	if (ret)
		goto free;
	ret = vrdma_stock(dev);
	if (ret)
		goto stop;
	virtio_device_ready(vdev);
	virtqueue_kick(dev->vqs[VIRTIO_RDMA_VQ_EVENT]);
	virtqueue_kick(dev->vqs[VIRTIO_RDMA_VQ_NOTIFY]);

	ret = vrdma_query(dev);
	if (ret) {
		dev_err(&vdev->dev, "QUERY_DEVICE or QUERY_PORT: %d\n", ret);
		goto stop;
	}
	ret = vrdma_kernel_context(dev);
	if (ret) {
		dev_err(&vdev->dev, "CREATE_CONTEXT: %d\n", ret);
		goto stop;
	}

	vrdma_ib_init(dev);
	dev->netdev_nb.notifier_call = vrdma_netdev_event;
	ret = register_netdevice_notifier(&dev->netdev_nb);
	if (ret)
		goto stop;
	ret = vrdma_register(dev);
	if (ret) {
		dev_err(&vdev->dev, "ib_register_device: %d\n", ret);
		goto notifier;
	}

	dev_info(&vdev->dev,
		 "virtio-rdma device %x:%x: %u QPs, %u CQs, %u MRs, port MTU code %u, doorbells %s, kernel context %u\n",
		 le32_to_cpu(dev->attr.vendor_id),
		 le32_to_cpu(dev->attr.vendor_part_id),
		 le32_to_cpu(dev->attr.max_qp), le32_to_cpu(dev->attr.max_cq),
		 le32_to_cpu(dev->attr.max_mr),
		 le32_to_cpu(dev->port.active_mtu),
		 dev->doorbell_poll ? "polled" : "kicked", dev->kctx);
	if (!dev->netdev)
		dev_info(&vdev->dev, "no netdev with %pM yet\n",
			 dev->config.mac);
	return 0;

notifier:
	vrdma_forget_netdev(dev);
stop:
	vrdma_stop(dev);
free:
	vrdma_free(dev);
	vdev->priv = NULL;
	return ret;
}

static void vrdma_remove(struct virtio_device *vdev)
{
	struct vrdma_dev *dev = vdev->priv;

	/* ib_core destroys what its consumers made, while the device answers. */
	vrdma_unregister(dev);
	vrdma_forget_netdev(dev);
	vrdma_stop(dev);
	vrdma_free(dev);
	vdev->priv = NULL;
}

static const struct virtio_device_id vrdma_id_table[] = {
	{ VIRTIO_ID_RDMA_DEVICE, VIRTIO_DEV_ANY_ID },
	{ 0 },
};
MODULE_DEVICE_TABLE(virtio, vrdma_id_table);

static unsigned int vrdma_features[] = {
	VIRTIO_RDMA_F_DOORBELL_POLL,
	VIRTIO_RDMA_F_STATS,
};

static struct virtio_driver vrdma_driver = {
	.driver.name = KBUILD_MODNAME,
#ifndef VRDMA_HAVE_VIRTIO_OWNER
	.driver.owner = THIS_MODULE,
#endif
	.feature_table = vrdma_features,
	.feature_table_size = ARRAY_SIZE(vrdma_features),
	.id_table = vrdma_id_table,
	.probe = vrdma_probe,
	.remove = vrdma_remove,
};
module_virtio_driver(vrdma_driver);

MODULE_DESCRIPTION("virtio RDMA device driver");
MODULE_LICENSE("GPL");
