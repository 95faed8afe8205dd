//! vrdma's device: one RDMA device — the engine with the attributes it is
//! given, the memory it serves, the transport that carries its packets,
//! and its clock — moved by one progress step that does all pending work
//! and returns the next deadline, with the file descriptor to wait on.
//! The tools' own loop, a vfio-user or vhost-user server's event loop and
//! tests all drive a device the same way, busy-polling or in event mode.
//!
//! A packet's way, top-down: transport ([`transport::Transport`]: a
//! `vrdma-fabric` port) → device ([`Device::progress`]) → the engine's
//! roles → memory ([`GuestMem`], through the MR checks) → completions
//! (the engine's CQs, or a face's ring through a CQ sink).
//!
//! | module | what |
//! |---|---|
//! | [`device`] | [`Device`]: engine + memory + transport + clock; a device on a UDP port |
//! | [`memory`] | [`GuestMem`]: memory mapped with vm-memory, volatile access, atomics that stay atomic across processes |
//! | [`transport`] | [`transport::Transport`]; the UDP and Ethernet ports as ones; [`transport::SameHost`], same-host shared memory in front of either |
//! | [`verbs`] | the in-process verbs front end the tools use: a device with a PD, CQ and MR, QP bring-up, a completion loop |
//! | [`publish`] | counters published to the run directory for `vrdma stat` |
#![deny(unsafe_code)]

pub mod device;
pub mod loan;
pub mod memory;
pub mod publish;
pub mod transport;
pub mod verbs;

pub use device::{
    DEFAULT_GUEST_SIZE, Device, ObjectBudget, Progress, UdpDevice, active_mtu, derived_budget,
    udp_device, udp_device_behind,
};
pub use memory::GuestMem;
pub use transport::Transport;
