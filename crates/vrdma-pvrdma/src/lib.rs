//! vrdma's PVRDMA face: VMware's paravirtual RDMA PCI function (15ad:0820),
//! served to a virtual machine over vfio-user, for the unmodified Linux
//! `vmw_pvrdma` driver and rdma-core's `vmw_pvrdma` provider. A thin
//! translation of that device ABI onto a vrdma device (`vrdma-device`):
//! commands become verbs on the engine, guest rings become work queues and
//! completion queues, doorbells become the engine's progress. What is not
//! PVRDMA's — guest memory copies, page lists, ring cursors, work queues
//! taken into the engine, the CQ sink, command refusals, the object
//! budget — is the face core's (`vrdma-face`), which the virtio-rdma face
//! shares.
//!
//! From the top down (each module imports only those below it):
//!
//! | module | what |
//! |---|---|
//! | [`server`] | one device served over vfio-user: its socket, its client, its thread's loop |
//! | [`function`] | the PCI function: config space, BARs, registers, the shared-region handshake, the command slot, doorbell writes, the device rings and interrupts |
//! | `cmd` | the commands: each decoded from its copy, checked and run on the face's state |
//! | `state` | the face's state: the device, the guest's objects by handle, their rings, doorbells |
//! | [`qp`], [`srq`], [`cq`] | PVRDMA's WQE, CQE and device-ring entry formats, decoded and encoded for the face core's work queues, CQ sink and ring producers |
//! | [`ring`] | page directories and the `pvrdma_ring` layout, on the face core's page lists and rings |
//! | [`doorbells`] | doorbell pages shared with the guest (no exit per post) |
//! | [`caps`] | the device's limits and the capabilities it announces |
//! | [`abi`] | the device ABI's registers, shared region, commands, ring entries and enums, laid out as in guest memory |

#![forbid(unsafe_code)]

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
mod state;

pub use function::Pvrdma;
pub use server::Server;
pub use state::FaceStats;
