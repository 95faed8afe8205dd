//! One device: its engine, the memory it serves, its transport and its
//! clock, moved by one progress step ([`Device::progress`]) that does all
//! pending work and returns the next deadline. Whatever event loop drives
//! the device — the tools' own, a vfio-user or vhost-user server's, a
//! test's — waits on [`Device::fd`] until that deadline, or busy-polls.

use std::{
    io,
    net::IpAddr,
    os::fd::BorrowedFd,
    time::{Duration, Instant},
};

use vrdma_engine::{
    Engine, Memory,
    attr::{DeviceAttr, Mtu, PortAttr},
    fence::Fence,
};
use vrdma_fabric::{
    Lender, Piece,
    udp::{self, UdpPort},
};
use vrdma_wire::Gid;

use crate::{
    loan,
    memory::Leased,
    transport::{LEND_ON_MIN, Lent, Transport},
};

/// What one [`Device::progress`] did, and when it wants to run next.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct Progress {
    /// Datagrams (or frames) received.
    pub received: usize,
    /// Packets sent.
    pub sent: usize,
    /// The engine's next deadline on the device clock (ns), if a timer
    /// is armed.
    pub deadline: Option<u64>,
}

impl Progress {
    pub fn is_idle(&self) -> bool {
        self.received == 0 && self.sent == 0
    }
}

/// A round that received this many bytes sends its answers at once
/// instead of in the next round: a stream's ACKs, which the sender's
/// window waits for, are not held behind the receiver's next turn.
const SEND_NOW_BYTES: u64 = 16 << 10;

/// Receive calls per round at most, so that sending is never starved.
const RECEIVES_PER_ROUND: usize = 4;

/// Packets one send takes from the engine at most: a long message (a UC
/// WRITE of gigabytes, the responses to a large READ) leaves over many
/// rounds, with the receive side and the device's face served between
/// them, instead of in one round that holds the thread for the whole
/// message. Larger than the requester's window (128 PSNs), so RC requests
/// are never held back by it.
const TX_BUDGET: usize = 256;

/// What the engine may hold for the consumer's objects (work queues, page
/// lists, CQs kept in the engine): past it, creates fail with ENOMEM.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub enum ObjectBudget {
    /// No limit (a device of the process's own).
    #[default]
    Unlimited,
    /// This many bytes.
    Fixed(u64),
    /// Derived from the guest's memory ([`derived_budget`]): a guest with
    /// more memory may register more of it and run more work. The memory
    /// is the guest's configured size where one is given, and never more
    /// than the device maps: never what a VMM chose to map alone (a VMM
    /// can map a sparse file of any size), so without a configured size it
    /// is at most [`DEFAULT_GUEST_SIZE`].
    Derived,
}

/// The guest size a [`ObjectBudget::Derived`] budget assumes at most when
/// none is configured: 64 GiB, a budget of at most 320 MiB. A larger guest
/// that registers more than its page lists fit is given its size.
pub const DEFAULT_GUEST_SIZE: u64 = 64 << 30;

impl ObjectBudget {
    /// The engine's limit for a device mapping `mapped` bytes of a guest
    /// configured with `guest` bytes of RAM, if known (a face sets it with
    /// [`Engine::set_memory_limit`] whenever its memory or its engine
    /// changes).
    pub fn limit(self, mapped: u64, guest: Option<u64>) -> Option<u64> {
        match self {
            ObjectBudget::Unlimited => None,
            ObjectBudget::Fixed(n) => Some(n),
            ObjectBudget::Derived => Some(derived_budget(
                mapped.min(guest.unwrap_or(DEFAULT_GUEST_SIZE)),
            )),
        }
    }
}

/// The object budget of a device serving `mem` bytes: 64 MiB (a few
/// hundred deep QPs, their CQs and SRQs) plus room for page lists naming
/// all of the memory twice (8 bytes per 4 KiB page, twice: `mem / 256`).
pub fn derived_budget(mem: u64) -> u64 {
    (64 << 20) + mem / 256
}

/// An RDMA device: the engine, its memory and its transport.
#[derive(Debug)]
pub struct Device<M: Memory + Lender + Leased, T: Transport> {
    engine: Engine,
    mem: M,
    transport: T,
    epoch: Instant,
    /// [`Device::clock`].
    clock: u64,
    /// The lent pieces of the packet being queued (kept for its
    /// allocation).
    pieces: Vec<Piece>,
    /// The fences of a payload to be lent on (kept for its allocation).
    fences: Vec<Fence>,
    /// Packets whose payload another device lent on and revoked before
    /// this one copied it (dropped: `loan.refused`).
    refused: u64,
}

impl<M: Memory + Lender + Leased, T: Transport> Device<M, T> {
    /// A device of `engine` over `mem`, reached through `transport`. Its
    /// clock starts now.
    pub fn new(engine: Engine, mem: M, transport: T) -> Self {
        Device {
            engine,
            mem,
            transport,
            epoch: Instant::now(),
            clock: 0,
            pieces: Vec::with_capacity(8),
            fences: Vec::with_capacity(2),
            refused: 0,
        }
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }

    pub fn mem(&self) -> &M {
        &self.mem
    }

    pub fn mem_mut(&mut self) -> &mut M {
        &mut self.mem
    }

    /// The engine and the memory together (to post work that names memory
    /// the engine reads, for example).
    pub fn parts(&mut self) -> (&mut Engine, &mut M) {
        (&mut self.engine, &mut self.mem)
    }

    pub fn transport(&self) -> &T {
        &self.transport
    }

    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    /// Sends what the transport has queued (before the memory its queued
    /// packets lend from goes away, for instance); the packets sent.
    pub fn flush(&mut self) -> usize {
        self.transport.flush(&self.mem)
    }

    /// The device clock: nanoseconds since the device was made.
    pub fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The device clock as the last progress step read it (a caller that
    /// polls often can pace itself without reading the clock again).
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// One round without blocking, at the clock's time: see
    /// [`Device::progress_at`].
    pub fn progress(&mut self) -> io::Result<Progress> {
        let now = self.now();
        self.progress_at(now)
    }

    /// One round without blocking at time `now` (ns, never going back):
    /// sends everything the engine has (what was posted since the last
    /// round, and the answers to what arrived in it), receives what is
    /// queued (a few batches at most, so that sending is never starved),
    /// runs due timers, and says when the next one is due.
    ///
    /// Answers to what arrives wait for the next round, after the
    /// application had its turn: a peer that replies to a message (a
    /// ping-pong, a write_lat) then sends the ACK and its reply together,
    /// its reply not behind a system call of its own. A caller that polls
    /// keeps the delay to one turn of its loop; [`Device::wait`] sends
    /// before it sleeps. A round that received a stream's worth of bytes
    /// answers at once.
    pub fn progress_at(&mut self, now: u64) -> io::Result<Progress> {
        self.clock = now;
        // Once a round (the switch's directory rarely changes; a round
        // late is a few packets sent MTU by MTU).
        self.refresh_jumbo();
        let mut p = Progress {
            sent: self.transmit(now),
            ..Progress::default()
        };
        let before = self.transport.rx_bytes();
        for _ in 0..RECEIVES_PER_ROUND {
            let (engine, mem, refused) = (&mut self.engine, &mut self.mem, &mut self.refused);
            let n = self.transport.receive(|ip, roce, loan| match loan {
                None => engine.handle_packet(now, ip, roce, mem),
                Some(l) => {
                    if loan::receive(engine, now, ip, roce, l, mem).is_err() {
                        *refused += 1;
                    }
                }
            })?;
            p.received += n;
            if n < self.transport.batch() {
                break;
            }
        }
        if self.transport.rx_bytes() - before >= SEND_NOW_BYTES {
            p.sent += self.transmit(now);
        }
        if self.engine.poll_timeout().is_some_and(|t| t <= now) {
            self.engine.handle_timeout(now);
        }
        p.deadline = self.engine.poll_timeout();
        Ok(p)
    }

    /// Sends what the engine has now (answers included, which
    /// [`Device::progress`] otherwise sends in its next round); the number
    /// of packets sent.
    pub fn send_pending(&mut self) -> usize {
        let now = self.now();
        self.transmit(now)
    }

    /// The engine's next deadline on the device clock.
    pub fn deadline(&mut self) -> Option<u64> {
        self.engine.poll_timeout()
    }

    /// What to wait on for input.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.transport.fd()
    }

    /// Sends what the engine has; if there was nothing, sleeps until
    /// something arrives, the engine's next deadline, or `limit`,
    /// whichever is first (event mode; busy-polling callers never call
    /// it).
    pub fn wait(&mut self, limit: Duration) -> io::Result<()> {
        let now = self.now();
        // Nothing may wait to be sent while the device sleeps.
        if self.transmit(now) > 0 {
            return Ok(());
        }
        let mut wait = limit;
        if let Some(t) = self.engine.poll_timeout() {
            wait = wait.min(Duration::from_nanos(t.saturating_sub(now)));
        }
        // poll(2) counts milliseconds: round up so that a deadline is not
        // missed by a busy loop of zero-length waits.
        let ms = wait.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        if ms > 0 {
            self.transport.arm();
        }
        wait_readable(self.transport.fd(), ms)?;
        Ok(())
    }

    /// The device's counters by name: the transport's, the engine's data
    /// path's and its objects (for `vrdma stat` and logs).
    pub fn counters(&self) -> Vec<(String, u64)> {
        let mut v = Vec::new();
        self.transport.counters(&mut v);
        v.push(("loan.refused".into(), self.refused));
        v.extend(
            self.engine
                .stats()
                .fields()
                .into_iter()
                .map(|(k, n)| (format!("engine.{k}"), n)),
        );
        let c = self.engine.counts();
        for (k, n) in [
            ("pds", c.pds),
            ("mrs", c.mrs),
            ("cqs", c.cqs),
            ("qps", c.qps),
            ("srqs", c.srqs),
            ("ahs", c.ahs),
        ] {
            v.push((format!("objects.{k}"), u64::from(n)));
        }
        // What the objects hold, then the budget they are held to (not
        // objects: a device with none shows only these).
        let m = self.engine.memory_use();
        v.push(("objects.bytes".into(), m.held));
        v.push(("budget.limit".into(), m.limit.unwrap_or(0)));
        v.push(("budget.refused".into(), m.refused));
        v
    }

    /// Tells the engine which peers take a run of segments in one packet,
    /// when the transport says they changed.
    fn refresh_jumbo(&mut self) {
        if let Some(peers) = self.transport.jumbo_peers() {
            self.engine.set_jumbo(&peers);
        }
    }

    /// Sends what the engine has, [`TX_BUDGET`] packets at most and while
    /// the transport has room; the number sent. The engine writes each
    /// packet straight into the transport's send buffer; a payload it
    /// lends stays in memory.
    fn transmit(&mut self, now: u64) -> usize {
        let mut sent = 0;
        for _ in 0..TX_BUDGET {
            if !self.transport.has_room() {
                break;
            }
            let (slot, flushed) = self.transport.slot(&self.mem);
            sent += flushed;
            let Some(t) = self.engine.poll_transmit_gather(now, &self.mem, slot) else {
                break;
            };
            self.pieces.clear();
            let mut lent = Lent::default();
            if t.referenced > 0 {
                self.pieces
                    .extend(self.engine.gathered().iter().map(|r| Piece {
                        addr: r.addr,
                        len: r.len,
                    }));
                // A payload long enough to be lent on carries its MRs'
                // fences (cloning them costs a short packet too much);
                // without all of them it is not lent on (no lease).
                self.fences.clear();
                let fenced =
                    t.referenced >= LEND_ON_MIN && self.engine.gathered_fences(&mut self.fences);
                lent = Lent {
                    pieces: &self.pieces,
                    fences: &self.fences,
                    lease: self.mem.lease().filter(|_| fenced),
                };
            }
            sent += self.transport.queue(&t, &lent, &self.mem);
        }
        sent + self.transport.flush(&self.mem)
    }
}

impl<M: Memory + Lender + Leased, T: Transport> Drop for Device<M, T> {
    /// Sends what is queued: the answers to the last packets received wait
    /// for a next round that a closing device does not have (a peer's last
    /// message would go unacknowledged, and its sender retry into the
    /// void).
    fn drop(&mut self) {
        self.send_pending();
    }
}

/// A device on a UDP port.
pub type UdpDevice<M> = Device<M, UdpPort>;

/// A device on a UDP port bound to `config.addr`, serving `mem`: its GID 0
/// is the address (IPv4-mapped for IPv4), its GUIDs are derived from the
/// address (so that devices on one host differ, as rxe derives them from
/// the MAC address), its limits are `attr`'s, and its port's active MTU is
/// `mtu` or, by default, the largest that fits the interface holding the
/// address ([`active_mtu`]).
pub fn udp_device<M: Memory + Lender + Leased>(
    config: udp::Config,
    attr: DeviceAttr,
    mtu: Option<Mtu>,
    mem: M,
) -> io::Result<UdpDevice<M>> {
    udp_device_behind(config, attr, mtu, mem, Ok)
}

/// As [`udp_device`], the port put behind the transport `wrap` makes of it
/// (same-host shared memory in front of it, for instance).
pub fn udp_device_behind<M: Memory + Lender + Leased, T: Transport>(
    config: udp::Config,
    attr: DeviceAttr,
    mtu: Option<Mtu>,
    mem: M,
    wrap: impl FnOnce(UdpPort) -> io::Result<T>,
) -> io::Result<Device<M, T>> {
    let addr = config.addr;
    let port = UdpPort::bind(config)?;
    let attr = with_guid(attr, addr);
    let gid: Gid = port.gid();
    let mut port_attr = PortAttr::with_gids(&[gid]);
    // Unknown: what rxe reports on a 1500-byte Ethernet.
    port_attr.active_mtu =
        mtu.unwrap_or_else(|| active_mtu(udp::interface_mtu(addr).unwrap_or(1500)));
    let mut transport = wrap(port)?;
    transport.set_local(&[gid]);
    Ok(Device::new(Engine::new(attr, port_attr), mem, transport))
}

/// `attr` with the node and system image GUIDs a device on `addr` has:
/// its address under a locally administered prefix.
pub fn with_guid(attr: DeviceAttr, addr: IpAddr) -> DeviceAttr {
    let guid = match addr {
        IpAddr::V4(a) => 0x0200_0000_0000_0000 | u64::from(u32::from(a)),
        IpAddr::V6(a) => 0x0200_0000_0000_0000 | (u128::from(a) as u64 & 0x00ff_ffff_ffff_ffff),
    };
    DeviceAttr {
        node_guid: guid,
        sys_image_guid: guid,
        ..attr
    }
}

/// The largest IB MTU whose packets fit an interface MTU of `netdev`
/// bytes with the largest headers (GRH/IP, UDP, BTH, XRC and AtomicETH
/// extension, ICRC: 96 bytes) — the kernel's `eth_mtu_int_to_enum`, which
/// rxe uses — and at least 256.
pub fn active_mtu(netdev: u32) -> Mtu {
    match netdev.saturating_sub(40 + 8 + 12 + 4 + 28 + 4) {
        4096.. => Mtu::Mtu4096,
        2048.. => Mtu::Mtu2048,
        1024.. => Mtu::Mtu1024,
        512.. => Mtu::Mtu512,
        _ => Mtu::Mtu256,
    }
}

/// Waits until `fd` is readable, at most `timeout_ms`.
fn wait_readable(fd: BorrowedFd<'_>, timeout_ms: i32) -> io::Result<bool> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let timeout = PollTimeout::try_from(timeout_ms).unwrap_or(PollTimeout::MAX);
    loop {
        let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
        match poll(&mut fds, timeout) {
            Ok(n) => return Ok(n > 0),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn active_mtu_follows_the_interface() {
        assert_eq!(active_mtu(1500), Mtu::Mtu1024);
        assert_eq!(active_mtu(9000), Mtu::Mtu4096);
        assert_eq!(active_mtu(4096 + 95), Mtu::Mtu2048);
        assert_eq!(active_mtu(4096 + 96), Mtu::Mtu4096);
        assert_eq!(active_mtu(0), Mtu::Mtu256);
    }

    /// A derived budget is the configured guest size's, or what is mapped
    /// when that is less; without a size, at most the default's: a VMM
    /// that maps a sparse terabyte (4 GiB of budget, derived from it) gets
    /// no more than 320 MiB.
    #[test]
    fn a_derived_budget_comes_from_the_guests_size_not_what_its_vmm_maps() {
        const GIB: u64 = 1 << 30;
        let d = ObjectBudget::Derived;
        assert_eq!(
            d.limit(1 << 40, None),
            Some(derived_budget(DEFAULT_GUEST_SIZE))
        );
        assert_eq!(derived_budget(DEFAULT_GUEST_SIZE), 320 << 20);
        assert_eq!(d.limit(2 * GIB, None), Some(derived_budget(2 * GIB)));
        assert_eq!(
            d.limit(1 << 40, Some(8 * GIB)),
            Some(derived_budget(8 * GIB))
        );
        assert_eq!(d.limit(GIB, Some(8 * GIB)), Some(derived_budget(GIB)));
        assert_eq!(
            d.limit(1 << 40, Some(512 * GIB)),
            Some(derived_budget(512 * GIB)),
            "a configured size past the default"
        );
        assert_eq!(ObjectBudget::Fixed(7).limit(1 << 40, Some(GIB)), Some(7));
        assert_eq!(ObjectBudget::Unlimited.limit(1 << 40, Some(GIB)), None);
    }
}
