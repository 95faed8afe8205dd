//! vrdma's fabrics: transports that carry RoCEv2 packets for a device.
//! They know the wire format (`vrdma-wire`) and their own medium, nothing
//! of the engine: a device hands them packets described by a route and
//! lent payload pieces, and takes what they receive.
//!
//! | module | what |
//! |---|---|
//! | [`udp`] | RoCEv2 over UDP sockets: port 4791, batched system calls, GSO/GRO, per-QP source ports, TOS/TTL, the ICRC of the headers the kernel writes |
//! | [`shm`] | same-host shared memory: devices of one process put packets straight into each other's mailboxes, no network, no checksums, the payload copied once |
//! | [`eth`] | RoCEv2 on an Ethernet port a VM's NIC shares: QEMU's stream netdev on one side, a TAP or stream uplink on the other, RoCEv2 for the device's addresses steered to it |
//!
//! A gather send names payload bytes by device address ([`Piece`]); the
//! fabric reads them in place when it sends, through [`Lender`] — the
//! device's memory as volatile slices, never as a Rust reference to bytes
//! a guest may be writing.
// Unsafe code lives only in `udp::sys` and `eth::sys` (the system calls),
// which allow it.
#![deny(unsafe_code)]

pub mod eth;
pub mod shm;
pub mod udp;

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, VolatileSlice};

/// A piece of a packet's payload that stays in the device's memory: `len`
/// bytes at device address `addr`, checked by the engine against the MR's
/// key, PD, rights and bounds.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Piece {
    pub addr: u64,
    pub len: usize,
}

/// Memory that lends a gather send its payload pieces: a volatile view of
/// `len` bytes at `addr`, or `None` when the memory no longer holds them
/// in one piece (the datagram is then dropped, as a network would drop
/// it).
pub trait Lender {
    fn lend(&self, addr: u64, len: usize) -> Option<VolatileSlice<'_>>;
}

impl Lender for GuestMemoryMmap<()> {
    fn lend(&self, addr: u64, len: usize) -> Option<VolatileSlice<'_>> {
        self.get_slice(GuestAddress(addr), len)
            .ok()
            .filter(|s| s.len() == len)
    }
}

/// A memory that lends nothing (a device whose packets are all copied).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoLender;

impl Lender for NoLender {
    fn lend(&self, _: u64, _: usize) -> Option<VolatileSlice<'_>> {
        None
    }
}
