//! vrdma's test kit (a dev-only crate): what the engine's, the device's and
//! the tools' tests share.
//!
//! | module | what |
//! |---|---|
//! | [`addrs`] | each test binary's block of loopback addresses, and a device's MAC from its address (both faces' kits) |
//! | [`direct`] | two engines joined with no network, for benchmarks of the engine alone |
//! | [`errno`] | the engine's errno table as the faces' refusals carry it (u32): the tests' one table |
//! | [`net`] | engines on a deterministic in-order network that loses exactly the packets a test names |
//! | [`sim`] | a seeded simulated network with every fault a real one has, on a virtual clock; [`sim::workload`], an RC workload whose checker proves exactly-once, in-order delivery |
//! | [`setup`] | builders for the set-ups tests repeat: an engine with a PD, CQ and MR, QPs brought up and connected |
//! | `tripwire` (either face's feature) | a transport that panics on demand: a bug in a device's round, for the tests of panic isolation |
//! | `virtio` (feature `virtio`) | the virtio-rdma face's: a vhost-user front-end playing QEMU and the guest's driver (memfd memory, split virtqueues, commands, rings, doorbells, arming), devices served on UDP ports |
//! | `pvrdma` (feature `pvrdma`) | the PVRDMA face's: a guest (vfio-user client and driver model), devices served on UDP or Ethernet ports with addresses handed out per test binary, an in-test switch, the set-up and exchange the suites share, `/proc/self` measurements |
#![forbid(unsafe_code)]

pub mod addrs;
pub mod direct;
pub mod errno;
pub mod net;
#[cfg(feature = "pvrdma")]
pub mod pvrdma;
pub mod setup;
pub mod sim;
#[cfg(any(feature = "pvrdma", feature = "virtio"))]
pub mod tripwire;
#[cfg(feature = "virtio")]
pub mod virtio;
