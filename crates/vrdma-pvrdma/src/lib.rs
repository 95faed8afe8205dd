//! vrdma's PVRDMA face: VMware's paravirtual RDMA PCI function (15ad:0820),
//! served to a virtual machine over vfio-user, for the unmodified Linux
//! `vmw_pvrdma` driver and rdma-core's `vmw_pvrdma` provider. A thin
//! translation of that device ABI onto a vrdma device (`vrdma-device`):
//! commands become verbs on the engine, guest rings become work queues and
//! completion queues, doorbells become the engine's progress.
//!
//! - [`abi`]: the device ABI's registers, shared region, commands, ring
//!   entries and enums, laid out as in guest memory.
//! - [`caps`]: the device's limits and the capabilities it announces.
//! - [`ring`]: page directories and the PVRDMA ring layout, on the face
//!   core's page lists and rings (`vrdma-face`).
//! - [`function`]: the PCI function — config space, BARs, registers, the
//!   shared-region handshake, doorbells, the device rings.
//! - `cmd`: the command channel.
//! - [`qp`], [`srq`], [`cq`]: PVRDMA's WQE, CQE and device-ring entry
//!   formats, decoded and encoded for the face core's work queues, CQ sink
//!   and ring producers.
//! - [`doorbells`]: doorbell pages shared with the guest (no exit per
//!   post).

pub mod abi;
pub mod caps;
mod cmd;
pub mod cq;
pub mod doorbells;
pub mod function;
pub mod qp;
pub mod ring;
pub mod server;
pub mod srq;

pub use function::{FaceStats, Pvrdma};
pub use server::Server;
