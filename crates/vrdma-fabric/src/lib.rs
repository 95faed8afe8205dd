//! vrdma's fabrics: the I/O around the engine.
//!
//! | module | what |
//! |---|---|
//! | [`udp`] | RoCEv2 over UDP: a device bound to an IPv4 or IPv6 address, port 4791, batched system calls, busy-poll and event modes |
//! | [`sim`] | a seeded simulated network with loss, duplication, reordering, delay, corruption and partitions, on a virtual clock |
// Unsafe code lives only in `udp::sys` (the system calls), which allows it.
#![deny(unsafe_code)]

pub mod sim;
pub mod udp;
