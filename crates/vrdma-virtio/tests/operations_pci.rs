//! The operations suite (`operations/cases.rs`) with the device served as a
//! virtio-pci function over vfio-user (docs/virtio-rdma.md §13.3): a
//! vfio-user client playing QEMU's `vfio-user-pci` and the guest's
//! `virtio_pci_modern` transport (`vrdma_testkit::virtio::pci`), the same
//! driver above it, every operation of every QP type, data checked byte
//! for byte — the specification unchanged above the transport.

use vrdma_testkit::virtio::{PciDevice, PciNet};

static NET: PciNet = PciNet::new(29);

/// The devices this binary's cases run on.
type Dev<T = vrdma_fabric::udp::UdpPort> = PciDevice<T>;

#[path = "operations/cases.rs"]
mod cases;
