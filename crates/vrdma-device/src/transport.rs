//! How a device reaches its peers: a [`Transport`] carries the engine's
//! packets out and hands back what arrives. The UDP port of
//! `vrdma-fabric` is one; the Ethernet port a VM's NIC shares is another.
//! A transport knows the wire format and its medium; the device turns the
//! engine's [`Transmit`] into what the transport takes.

use std::{io, os::fd::BorrowedFd};

use vrdma_engine::transmit::Transmit;
use vrdma_fabric::{
    Lender, Piece,
    udp::{Outgoing, UdpPort},
};
use vrdma_wire::frame::IpRepr;

/// A device's way to its peers.
pub trait Transport {
    /// One receive call without blocking: each RoCE packet that arrived
    /// with a good ICRC goes to `deliver` with the IP header it came in.
    /// Returns the datagrams (or frames) taken, 0 when none was waiting.
    fn receive(&mut self, deliver: impl FnMut(&IpRepr, &[u8])) -> io::Result<usize>;

    /// Datagrams one [`Transport::receive`] takes at most: a call that
    /// took fewer emptied the queue.
    fn batch(&self) -> usize;

    /// Bytes received since the transport was made.
    fn rx_bytes(&self) -> u64;

    /// The buffer the engine writes the next packet into (at least
    /// [`vrdma_engine::transmit::MAX_PACKET`] bytes); the packets sent to
    /// make room for it.
    fn slot(&mut self, mem: &impl Lender) -> (&mut [u8], usize);

    /// Queues the packet the engine wrote into the slot: `t` says where it
    /// goes; `lent` are its payload's pieces left in memory (the slot then
    /// holds the bytes before the payload followed by those after it).
    /// Returns the packets sent on the way.
    fn queue(&mut self, t: &Transmit, lent: &[Piece], mem: &impl Lender) -> usize;

    /// Sends what is queued; the number of packets sent.
    fn flush(&mut self, mem: &impl Lender) -> usize;

    /// The file descriptor that becomes readable when something arrives.
    fn fd(&self) -> BorrowedFd<'_>;

    /// The transport's counters, by name, for `vrdma stat` (its prefix
    /// first).
    fn counters(&self) -> (&'static str, Vec<(&'static str, u64)>);
}

impl Transport for UdpPort {
    fn receive(&mut self, deliver: impl FnMut(&IpRepr, &[u8])) -> io::Result<usize> {
        UdpPort::receive(self, deliver)
    }

    fn batch(&self) -> usize {
        UdpPort::batch(self)
    }

    fn rx_bytes(&self) -> u64 {
        self.stats().rx_bytes
    }

    fn slot(&mut self, mem: &impl Lender) -> (&mut [u8], usize) {
        let sent = if self.is_full() { self.flush(mem) } else { 0 };
        (UdpPort::slot(self), sent)
    }

    fn queue(&mut self, t: &Transmit, lent: &[Piece], mem: &impl Lender) -> usize {
        let out = Outgoing {
            route: t.route(),
            src_port: t.udp_src_port,
            len: t.len,
            payload_at: t.payload_at,
            lent,
        };
        UdpPort::queue(self, &out, mem)
    }

    fn flush(&mut self, mem: &impl Lender) -> usize {
        UdpPort::flush(self, mem)
    }

    fn fd(&self) -> BorrowedFd<'_> {
        UdpPort::fd(self)
    }

    fn counters(&self) -> (&'static str, Vec<(&'static str, u64)>) {
        ("udp", self.stats().fields().to_vec())
    }
}
