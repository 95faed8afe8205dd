//! The virtio-rdma device end to end, through the real vhost-user
//! protocol: two devices served on UDP ports, a front-end playing QEMU and
//! the guest driver on each (`vrdma_testkit::virtio`), every operation of
//! every QP type, data checked byte for byte.

use vrdma_testkit::virtio::{Device, Net};

static NET: Net = Net::new(25);

/// The devices this binary's cases run on.
type Dev<T = vrdma_fabric::udp::UdpPort> = Device<T>;

#[path = "operations/cases.rs"]
mod cases;
