//! vrdma's virtio-rdma face: the virtio RDMA device (device ID 42) that
//! `docs/virtio-rdma.md` specifies, served to a virtual machine over
//! vhost-user, or as a whole virtio-pci function over vfio-user. A thin translation of that ABI onto a vrdma device.
//!
//! | module | what |
//! |---|---|
//! | [`abi`] | the device ABI: features, configuration, virtqueues, commands, ring entries, doorbell areas, events |
//! | [`doorbell`] | doorbell areas: which rings moved, and whether the device is polling |
//! | [`face`] | the device's state: commands carried out on a vrdma device, contexts, objects, doorbells, arming, events |
//! | [`server`] | a device's vhost-user socket: one connection after another, the device outliving them |
//! | [`pci`] | the device as a virtio-pci function served over vfio-user (§13.3): config space and capabilities, common configuration, notifications, MSI-X |
//! | `queues` | the virtqueues' work for either transport: controlq requests, eventq and notifyq deliveries, used-buffer notifications |
//! | [`vhost`] | the vhost-user backend: virtqueues to the face, the device's turns in the worker, pause and resume |
//! | [`decode`] | requests and ring entries decoded from copies into typed values, and completions encoded |
#![forbid(unsafe_code)]

pub mod abi;
pub mod decode;
pub mod doorbell;
pub mod face;
pub mod pci;
mod queues;
pub mod server;
pub mod vhost;
