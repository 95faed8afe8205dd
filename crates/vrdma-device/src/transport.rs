//! How a device reaches its peers: a [`Transport`] carries the engine's
//! packets out and hands back what arrives. The UDP port of
//! `vrdma-fabric` is one; the Ethernet port a VM's NIC shares is another
//! (`vrdma_fabric::eth`).
//! A transport knows the wire format and its medium; the device turns the
//! engine's [`Transmit`] into what the transport takes. [`SameHost`] puts
//! a same-host medium (`vrdma_fabric::shm`) in front of either: a packet
//! for a device on the same switch goes there, any other to the port.

use std::{io, os::fd::BorrowedFd};

use vrdma_engine::{fence::Fence, transmit::Transmit};
use vrdma_fabric::{
    Lender, Piece,
    eth::EthPort,
    shm,
    udp::{Outgoing, UdpPort},
};
use vrdma_wire::{Gid, frame::IpRepr};

use crate::{loan::Token, memory::Lease};

/// A device's way to its peers.
pub trait Transport {
    /// One receive call without blocking: each RoCE packet that arrived
    /// with a good ICRC goes to `deliver` with the IP header it came in.
    /// Returns the datagrams (or frames) taken, 0 when none was waiting.
    ///
    /// A packet whose payload another device of the process lent on comes
    /// with its loan (the bytes are then those around the payload): the
    /// device copies the payload ([`crate::loan`]).
    fn receive(
        &mut self,
        deliver: impl FnMut(&IpRepr, &[u8], Option<&shm::Loan>),
    ) -> io::Result<usize>;

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
    /// make room for it. Until [`Transport::queue`] takes it, another call
    /// returns the same buffer, with what was written in it, and sends
    /// nothing ([`SameHost`] reads a packet it keeps off the uplink so).
    fn slot(&mut self, mem: &impl Lender) -> (&mut [u8], usize);

    /// Queues the packet the engine wrote into the slot: `t` says where it
    /// goes; `lent` its payload's pieces left in memory (the slot then
    /// holds the bytes before the payload followed by those after it).
    /// Returns the packets sent on the way.
    fn queue(&mut self, t: &Transmit, lent: &Lent<'_>, mem: &impl Lender) -> usize;

    /// The addresses a packet may carry a run of segments to (the engine's
    /// [`vrdma_engine::Engine::set_jumbo`]), when they changed since the
    /// last call; `None` if they did not (or the medium has none).
    fn jumbo_peers(&mut self) -> Option<Vec<Gid>> {
        None
    }

    /// Sends what is queued; the number of packets sent.
    fn flush(&mut self, mem: &impl Lender) -> usize;

    /// The file descriptor that becomes readable when something arrives.
    fn fd(&self) -> BorrowedFd<'_>;

    /// Must be called before sleeping on [`Transport::fd`] (not before a
    /// poll that does not wait): a transport whose senders spare a polling
    /// receiver its wake-ups (same-host shared memory) asks for them
    /// again, and makes the descriptor readable at once if something came
    /// meanwhile. Without it, a sleeper could miss such a packet until
    /// something else wakes it.
    fn arm(&mut self) {}

    /// Appends the transport's counters, by name (its prefix first:
    /// `udp.tx_packets`), for `vrdma stat`.
    fn counters(&self, out: &mut Vec<(String, u64)>);

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

/// A packet's payload the engine lent (left in memory): its pieces, the
/// fences of the MRs they lie in, and the memory's lease — what a
/// transport needs to read it as it sends (a gather send), or to lend it
/// on to another device of the process ([`crate::loan`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct Lent<'a> {
    pub pieces: &'a [Piece],
    pub fences: &'a [Fence],
    pub lease: Option<&'a Lease>,
}

/// Payloads at least this long are lent on to a device of the process
/// (one copy, by the receiver); shorter ones are copied into the medium
/// as they are sent (cheaper than a loan and its fences).
pub const LEND_ON_MIN: usize = 4096;

impl Transport for UdpPort {
    fn receive(
        &mut self,
        mut deliver: impl FnMut(&IpRepr, &[u8], Option<&shm::Loan>),
    ) -> io::Result<usize> {
        UdpPort::receive(self, |ip, roce| deliver(ip, roce, None))
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

    fn queue(&mut self, t: &Transmit, lent: &Lent<'_>, mem: &impl Lender) -> usize {
        let out = Outgoing {
            route: t.route(),
            src_port: t.udp_src_port,
            len: t.len,
            payload_at: t.payload_at,
            lent: lent.pieces,
        };
        UdpPort::queue(self, &out, mem)
    }

    fn flush(&mut self, mem: &impl Lender) -> usize {
        UdpPort::flush(self, mem)
    }

    fn fd(&self) -> BorrowedFd<'_> {
        UdpPort::fd(self)
    }

    fn counters(&self, out: &mut Vec<(String, u64)>) {
        named(out, "udp", &self.stats().fields());
    }
}

impl Transport for EthPort {
    fn receive(
        &mut self,
        mut deliver: impl FnMut(&IpRepr, &[u8], Option<&shm::Loan>),
    ) -> io::Result<usize> {
        EthPort::receive(self, |ip, roce| deliver(ip, roce, None))
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

    fn queue(&mut self, t: &Transmit, lent: &Lent<'_>, mem: &impl Lender) -> usize {
        match EthPort::queue(
            self,
            &t.route(),
            t.udp_src_port,
            t.dmac,
            t.len,
            t.payload_at,
            lent.pieces,
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

    fn counters(&self, out: &mut Vec<(String, u64)>) {
        named(out, "eth", &self.stats().fields());
    }

    fn set_local(&mut self, gids: &[Gid]) {
        EthPort::set_local(self, gids);
    }

    fn admits_gid(&self, gid: &Gid) -> bool {
        self.filter().allows_addr(self.mac(), gid.ip())
    }
}

/// Appends `fields` named `prefix.field`.
fn named(out: &mut Vec<(String, u64)>, prefix: &str, fields: &[(&'static str, u64)]) {
    out.extend(fields.iter().map(|(k, n)| (format!("{prefix}.{k}"), *n)));
}

/// A transport chosen per destination: a packet whose destination GID a
/// device on the same [`shm::Switch`] holds goes there (no network, no
/// checksum, its payload copied once); every other one goes through the
/// uplink — the UDP or Ethernet port the device would use alone. The
/// device's software cannot tell the two apart except by speed; `vrdma
/// stat` counts both (`shm.*` beside the uplink's). Without a switch
/// ([`SameHost::uplink_only`]) it is the uplink alone.
#[derive(Debug)]
pub struct SameHost<T> {
    shm: Option<shm::Port>,
    uplink: T,
    /// The addresses the device may take (its GIDs, and its claims on the
    /// switch): what its operator gave it.
    owned: shm::Owned,
    /// Receive calls since shm last delivered a packet.
    shm_quiet: u32,
    /// Whether the uplink's last receive took something.
    uplink_hot: bool,
    /// Receive calls that left the uplink alone since it was last read.
    skipped: u32,
    /// Runs of segments (longer than any wire packet) whose peer left the
    /// switch between the engine's poll and the send: dropped, not sent
    /// to the uplink; RC resends them MTU by MTU.
    runs_dropped: u64,
}

/// While shm is busy (it delivered within the last `SHM_BUSY` receive
/// calls) and the uplink is quiet, the uplink is read every
/// `UPLINK_EVERY`-th call only: reading a socket is a system call (about
/// half a microsecond here), which would otherwise be most of a shm round
/// trip. A packet from the network then waits a few rounds at most.
const SHM_BUSY: u32 = 1024;
const UPLINK_EVERY: u32 = 8;

impl<T: Transport> SameHost<T> {
    /// `uplink` behind a port on `switch`'s default network, which may
    /// take any address (a device of the process's own); the device's
    /// descriptor then stands for both.
    pub fn new(switch: &shm::Switch, uplink: T) -> io::Result<Self> {
        SameHost::on(
            Some((switch, &switch.default_network())),
            shm::Owned::Any,
            uplink,
        )
    }

    /// `uplink` behind a port on network `net` of a switch (or alone when
    /// `None`), the device taking only the addresses `owned` allows — as
    /// its GIDs ([`Transport::admits_gid`]) and on the switch.
    pub fn on(
        switch: Option<(&shm::Switch, &shm::Network)>,
        owned: shm::Owned,
        uplink: T,
    ) -> io::Result<Self> {
        let shm = match switch {
            Some((sw, net)) => {
                let p = sw.attach_to(net, owned.clone())?;
                p.watch(uplink.fd())?;
                Some(p)
            }
            None => None,
        };
        Ok(SameHost {
            shm,
            owned,
            ..SameHost::uplink_only(uplink)
        })
    }

    /// `uplink` alone (same-host shared memory turned off).
    pub fn uplink_only(uplink: T) -> Self {
        SameHost {
            shm: None,
            uplink,
            owned: shm::Owned::Any,
            shm_quiet: SHM_BUSY,
            uplink_hot: false,
            skipped: 0,
            runs_dropped: 0,
        }
    }

    /// `uplink`, behind a port on `switch` if there is one.
    pub fn with(switch: Option<&shm::Switch>, uplink: T) -> io::Result<Self> {
        match switch {
            Some(s) => SameHost::new(s, uplink),
            None => Ok(SameHost::uplink_only(uplink)),
        }
    }

    /// The device's network on the switch, if it has one.
    pub fn network(&self) -> Option<&shm::Network> {
        self.shm.as_ref().map(shm::Port::network)
    }

    /// The port on the switch, if there is one.
    pub fn shm(&self) -> Option<&shm::Port> {
        self.shm.as_ref()
    }

    pub fn uplink(&self) -> &T {
        &self.uplink
    }

    pub fn uplink_mut(&mut self) -> &mut T {
        &mut self.uplink
    }
}

impl<T: Transport> Transport for SameHost<T> {
    fn receive(
        &mut self,
        mut deliver: impl FnMut(&IpRepr, &[u8], Option<&shm::Loan>),
    ) -> io::Result<usize> {
        let n = match &mut self.shm {
            Some(shm) => shm.receive(|route, roce, loan| {
                // The IP header the wire would have carried (the engine
                // checks its addresses; a UD receive's GRH is it).
                let len = roce.len() + loan.map_or(0, |l| l.len);
                if let Ok(ip) = route.ip(len, 0) {
                    deliver(&ip, roce, loan);
                }
            }),
            None => 0,
        };
        self.shm_quiet = if n > 0 {
            0
        } else {
            self.shm_quiet.saturating_add(1)
        };
        if self.shm_quiet < SHM_BUSY && !self.uplink_hot && self.skipped + 1 < UPLINK_EVERY {
            self.skipped += 1;
            return Ok(n);
        }
        self.skipped = 0;
        let m = self.uplink.receive(&mut deliver)?;
        self.uplink_hot = m > 0;
        Ok(n + m)
    }

    fn batch(&self) -> usize {
        let shm = if self.shm.is_some() { shm::BATCH } else { 0 };
        shm + self.uplink.batch()
    }

    fn rx_bytes(&self) -> u64 {
        self.shm.as_ref().map_or(0, |s| s.rx_bytes()) + self.uplink.rx_bytes()
    }

    fn has_room(&mut self) -> bool {
        self.uplink.has_room()
    }

    fn slot(&mut self, mem: &impl Lender) -> (&mut [u8], usize) {
        self.uplink.slot(mem)
    }

    fn queue(&mut self, t: &Transmit, lent: &Lent<'_>, mem: &impl Lender) -> usize {
        let Some(shm) = self.shm.as_mut() else {
            return self.uplink.queue(t, lent, mem);
        };
        if !shm.reaches(&t.dgid) {
            if t.referenced > vrdma_wire::MAX_PAYLOAD {
                self.runs_dropped += 1;
                return 0;
            }
            return self.uplink.queue(t, lent, mem);
        }
        // The engine wrote the packet into the uplink's slot: read it back
        // from there and leave the slot for the next one.
        let head_len = t.len - t.referenced;
        let (slot, _) = self.uplink.slot(mem);
        let Some(head) = slot.get(..head_len) else {
            return 0;
        };
        let route = t.route();
        // A long payload to a device of this process is lent on: its
        // receiver copies it from this device's memory, once.
        if t.referenced >= LEND_ON_MIN
            && let Some(lease) = lent.lease
            && shm.lends_to(&t.dgid)
        {
            let loan = shm::Loan {
                payload_at: t.payload_at,
                len: t.referenced,
                token: Box::new(Token {
                    lease: lease.clone(),
                    fences: lent.fences.to_vec(),
                    pieces: lent.pieces.to_vec(),
                }),
            };
            if shm.send_loan(&route, head, loan).is_ok() {
                return 0;
            }
        }
        // Refusals are counted by the port: a medium that cannot carry a
        // packet loses it, and RC recovers. Packets sent: at the flush.
        let _ = shm.send(&route, head, t.payload_at, lent.pieces, mem);
        0
    }

    fn jumbo_peers(&mut self) -> Option<Vec<Gid>> {
        self.shm.as_mut()?.local_peers()
    }

    fn flush(&mut self, mem: &impl Lender) -> usize {
        let shm = self.shm.as_mut().map_or(0, |s| s.flush());
        shm + self.uplink.flush(mem)
    }

    fn fd(&self) -> BorrowedFd<'_> {
        match &self.shm {
            Some(s) => s.fd(),
            None => self.uplink.fd(),
        }
    }

    fn arm(&mut self) {
        if let Some(s) = &mut self.shm {
            s.arm();
        }
        self.uplink.arm();
    }

    fn counters(&self, out: &mut Vec<(String, u64)>) {
        if let Some(s) = &self.shm {
            named(out, "shm", &s.stats().fields());
            out.push(("shm.tx_runs_off_switch".into(), self.runs_dropped));
            if let Some(r) = s.rendezvous() {
                named(out, "rendezvous", &r.fields());
            }
        }
        self.uplink.counters(out);
    }

    fn set_local(&mut self, gids: &[Gid]) {
        if let Some(s) = &mut self.shm {
            s.set_local(gids);
        }
        self.uplink.set_local(gids);
    }

    fn admits_gid(&self, gid: &Gid) -> bool {
        self.owned.allows(gid) && self.uplink.admits_gid(gid)
    }
}
