//! vrdma's socket system calls, in one place for every socket of the
//! daemon ([`sock`]): a message received with the descriptors it carries
//! (room for the kernel's maximum, every one owned at once, also when the
//! kernel cut the control data short), and a listener's accepts, which
//! wait out a shortage of descriptors or memory instead of ending what
//! listens, without spinning meanwhile.
//!
//! A crate of its own because the sockets that need it sit in crates that
//! must not depend on each other: `vrdma-fabric` (the Ethernet port's
//! guest socket, the same-host rendezvous) knows nothing of vfio-user, and
//! `vrdma-vfio-user` (the vfio-user socket) depends on vm-memory alone;
//! the faces (`vrdma-face`'s server loop, `vrdma-virtio`'s vhost-user
//! server) use it through either or directly. It depends on `libc`, `nix`
//! and `tracing` only, so it sits below all of them.
//!
//! Its only unsafe code is in `sys`: the `recvmsg` call and taking
//! ownership of the descriptors the kernel installed.
#![deny(unsafe_code)]

pub mod sock;
mod sys;
