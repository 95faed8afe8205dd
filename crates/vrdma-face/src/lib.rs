//! vrdma's face core: what any device face needs to translate a device
//! ABI with rings in guest memory onto a vrdma device
//! (`vrdma_device::Device`). A face — PVRDMA over vfio-user,
//! virtio-rdma over vhost-user — decodes its ABI's commands and entries;
//! the face core holds what is the same for every face: guest memory
//! reached from copies, page lists, ring cursors under either index
//! scheme, work queues taken into the engine, completions written into a
//! guest's CQ ring, command refusals with their errno, and the object
//! budget — and the one transport to the VMM both faces are served over,
//! vfio-user's server loop. It knows no device ABI.
//!
//! | module | what |
//! |---|---|
//! | [`guest`] | copies in and out of guest memory through vm-memory; [`GuestError`] |
//! | [`pages`] | [`PageList`]: an object's guest pages, copied and checked; [`Claims`]: which object holds which ring page, area and header (both faces') |
//! | [`ring`] | rings in guest memory ([`GuestRing`]) under an index scheme ([`ring::WrapBit`], [`ring::FreeRunning`]); the device's cursors: [`Consumer`] (entries copied out once, decoded, slots given back) and [`Producer`] |
//! | [`wq`] | a QP's send and receive rings and an SRQ's ring, taken into the engine's queues as they have room |
//! | [`cq`] | [`cq::GuestCq`]: the engine's CQ sink for a CQ ring in guest memory |
//! | [`status`] | [`Refused`]: a refused command's errno and what was wrong |
//! | [`refusals`] | [`Refusals`]: every refusal counted by reason and logged, rate-limited |
//! | [`device`] | [`FaceDevice`]: the device behind a face, its QPs' and SRQs' rings taken and accounted, reset, remap, rebind, claims, refusals — the same for every face |
//! | [`budget`] | [`Budget`]: the object budget, applied again when the memory or the engine changes |
//! | [`spin`] | when a device's thread polls the guest and when it sleeps: [`spin::Spinner`], one policy (adaptive window, yield, preemption guard) for every face's loop |
//! | [`vfio`] | a PCI function with a vrdma device behind it ([`vfio::Served`]: PVRDMA, virtio-rdma as virtio-pci) served over vfio-user: socket, client, the device's event loop |
#![forbid(unsafe_code)]

pub mod budget;
pub mod cq;
pub mod device;
pub mod guest;
pub mod pages;
pub mod refusals;
pub mod ring;
pub mod spin;
pub mod status;
pub mod vfio;
pub mod wq;

pub use budget::Budget;
pub use device::{FaceDevice, RingQp, RingSrq, Rings, TakeStats};
pub use guest::GuestError;
pub use pages::{Claims, Owner, PAGE_SIZE, PageList};
pub use refusals::{Malformed, Refusal, Refusals, WqeIdentity};
pub use ring::{Consumer, Decoded, Decoder, GuestRing, Indices, Producer, Taken};
pub use status::{OrRefuse, Refused};
