//! How a device reaches its peers: a [`Transport`] carries the engine's
//! packets out and hands back what arrives. The UDP port of
//! `vrdma-fabric` is one; the Ethernet port a VM's NIC shares is another
//! (`vrdma_fabric::eth`).
//! A transport knows the wire format and its medium; the device turns the
//! engine's [`Transmit`] into what the transport takes.

use std::{io, os::fd::BorrowedFd};

use vrdma_engine::transmit::Transmit;
use vrdma_fabric::{
    Lender, Piece,
    eth::EthPort,
    udp::{Outgoing, UdpPort},
};
use vrdma_wire::{Gid, frame::IpRepr};

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

    /// Whether the transport takes another packet now. A transport that
    /// cannot (a queue it bounds is full) makes its descriptor readable
    /// once it can; meanwhile the packets wait in the engine (backpressure,
    /// not loss). A transport that blocks or drops, as a UDP socket does,
    /// always has room.
    fn has_room(&mut self) -> bool {
        true
    }

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

    /// The device's addresses now (its GID table changed): a transport
    /// that shares its medium with other traffic steers to the device what
    /// is addressed to these. A UDP port is bound to its one address and
    /// ignores this.
    fn set_local(&mut self, _gids: &[Gid]) {}

    /// Whether the device may take `gid` as one of its addresses (a face
    /// refuses a GID its guest binds otherwise): a port shared with a
    /// guest's NIC admits the addresses the guest was given.
    fn admits_gid(&self, _gid: &Gid) -> bool {
        true
    }
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

impl Transport for EthPort {
    fn receive(&mut self, deliver: impl FnMut(&IpRepr, &[u8])) -> io::Result<usize> {
        EthPort::receive(self, deliver)
    }

    fn batch(&self) -> usize {
        // A receive drains the streams and takes up to 64 TAP frames.
        64
    }

    fn rx_bytes(&self) -> u64 {
        self.stats().rx_bytes
    }

    fn has_room(&mut self) -> bool {
        EthPort::has_room(self)
    }

    fn slot(&mut self, _mem: &impl Lender) -> (&mut [u8], usize) {
        // Each packet is framed and written as it is queued.
        (EthPort::slot(self), 0)
    }

    fn queue(&mut self, t: &Transmit, lent: &[Piece], mem: &impl Lender) -> usize {
        match EthPort::queue(
            self,
            &t.route(),
            t.udp_src_port,
            t.dmac,
            t.len,
            t.payload_at,
            lent,
            mem,
        ) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "Ethernet port: a packet could not be sent");
                0
            }
        }
    }

    fn flush(&mut self, _mem: &impl Lender) -> usize {
        if let Err(e) = EthPort::flush(self) {
            tracing::warn!(error = %e, "Ethernet port: flush failed");
        }
        0
    }

    fn fd(&self) -> BorrowedFd<'_> {
        EthPort::fd(self)
    }

    fn counters(&self) -> (&'static str, Vec<(&'static str, u64)>) {
        ("eth", self.stats().fields().to_vec())
    }

    fn set_local(&mut self, gids: &[Gid]) {
        EthPort::set_local(self, gids);
    }

    fn admits_gid(&self, gid: &Gid) -> bool {
        self.filter().allows_addr(self.mac(), gid.ip())
    }
}
