//! RoCEv2 on an Ethernet port a virtual machine's NIC shares: the device
//! sits on the guest's network path, between the guest's Ethernet function
//! (QEMU's `-netdev stream`: a UNIX socket of frames, each after its
//! length, 4 bytes big-endian) and an uplink (a TAP device, or another
//! such socket).
//!
//! - Frames from the guest go to the uplink as they are.
//! - Frames from the uplink that are RoCEv2 (UDP port 4791) for one of the
//!   device's addresses — its bound GIDs, the guest's own IP addresses — go
//!   to the device, once their IP and UDP headers and ICRC check out; every
//!   other frame goes to the guest.
//! - The device's packets leave on the uplink framed with the guest's MAC
//!   as source and the address vector's destination MAC; one for the
//!   device's own address comes straight back to it.
//!
//! A side that cannot take a frame now (its socket buffer full) loses it,
//! counted, as a NIC loses frames it has no buffer for: the device thread
//! never blocks on a guest that does not drain its NIC. A stream's frame is
//! never cut: a frame that does not fit whole waits whole or is dropped
//! whole.
//!
//! A guest NIC that connects while the process has no descriptor (or
//! memory) to spare waits in the listener's queue: the port waits the
//! shortage out (`vrdma_sys::sock::Acceptor`, counted in
//! `accept_shortages`), not watching the listener meanwhile, and a timer
//! in its epoll instance wakes it to try again — the device goes on.

mod sys;
mod tap;

pub use tap::{Malformed, Partial, Tap, cut as cut_tap_read, cut_captured};

use std::{
    collections::{HashSet, VecDeque},
    io::{self, Read, Write},
    net::IpAddr,
    os::{
        fd::{AsFd, BorrowedFd},
        unix::net::{UnixListener, UnixStream},
    },
    path::Path,
    time::Instant,
};

use nix::sys::{
    time::TimeSpec,
    timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags},
};
use vm_memory::Bytes;
use vrdma_sys::sock::{Accepted, Acceptor};
use vrdma_wire::{
    Gid,
    ethernet::{self, MacAddr},
    frame::{self, IpRepr, Route},
};

use crate::{Lender, Piece};

/// The largest frame carried: a 9000-byte jumbo IP packet and its Ethernet
/// header (with a VLAN tag).
pub const MAX_FRAME: usize = 9000 + ethernet::HEADER_LEN + ethernet::VLAN_LEN;

/// Bytes of frames a stream may hold waiting for its peer to read (beyond
/// them, frames are dropped).
const STREAM_BACKLOG: usize = 1 << 20;

/// Bytes waiting on the uplink stream above which the device sends no more
/// until its peer has read some (backpressure on the engine, not drops).
const UPLINK_HIGH_WATER: usize = STREAM_BACKLOG / 2;

/// Bytes read from one stream in one [`EthPort::receive`]: a peer that
/// writes without pause cannot keep the device's thread reading, nor grow
/// the partial-frame buffer past one frame and one read.
const READ_PER_TURN: usize = 64 << 10;

/// Bytes of the device's packets to itself waiting to be received: beyond
/// them the device sends no more this round (the packets are received in
/// the next, so a long message looped back costs this much memory, not its
/// length).
const LOOPBACK_BYTES: usize = 1 << 20;

/// The RoCEv2 UDP port.
const ROCE_PORT: u16 = 4791;

/// Frames read from a TAP in one [`EthPort::receive`].
const TAP_READS: usize = 64;

/// The shortest wait the retry timer is set for.
const MIN_TIMER: std::time::Duration = std::time::Duration::from_micros(1);

/// One side of the port: a TAP device, or a stream of length-prefixed
/// frames.
#[derive(Debug)]
pub enum Link {
    Tap(Tap),
    Stream(Stream),
}

/// A stream of frames, each after its 4-byte big-endian length.
#[derive(Debug)]
pub struct Stream {
    sock: UnixStream,
    /// Bytes read but not yet a whole frame.
    rx: Vec<u8>,
    /// Bytes of frames not yet written.
    tx: VecDeque<u8>,
}

impl Stream {
    pub fn new(sock: UnixStream) -> io::Result<Self> {
        sock.set_nonblocking(true)?;
        Ok(Stream {
            sock,
            rx: Vec::with_capacity(2 * MAX_FRAME),
            tx: VecDeque::new(),
        })
    }

    /// Reads what is there; each whole frame goes to `f`. Ok(false) when
    /// the peer closed the stream (after the whole frames it sent before
    /// closing went to `f`) or sent a frame no Ethernet has.
    /// At most [`READ_PER_TURN`] bytes are read per call (what is left
    /// keeps the socket readable for the next).
    fn read_frames(&mut self, mut f: impl FnMut(&mut [u8])) -> io::Result<bool> {
        let mut buf = [0u8; 16384];
        let mut read = 0;
        let mut open = true;
        while read < READ_PER_TURN {
            match self.sock.read(&mut buf) {
                Ok(0) => {
                    open = false;
                    break;
                }
                Ok(n) => {
                    self.rx.extend_from_slice(&buf[..n]);
                    read += n;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let mut at = 0;
        while self.rx.len() - at >= 4 {
            let len =
                u32::from_be_bytes(self.rx[at..at + 4].try_into().unwrap_or_default()) as usize;
            if len > MAX_FRAME {
                // Not a frame: the stream has lost its framing.
                return Ok(false);
            }
            if self.rx.len() - at - 4 < len {
                break;
            }
            f(&mut self.rx[at + 4..at + 4 + len]);
            at += 4 + len;
        }
        self.rx.drain(..at);
        Ok(open)
    }

    /// Queues a frame; false (dropped) if the backlog is full.
    fn queue(&mut self, frame: &[u8]) -> bool {
        if self.tx.len() + 4 + frame.len() > STREAM_BACKLOG {
            return false;
        }
        self.tx.extend((frame.len() as u32).to_be_bytes());
        self.tx.extend(frame);
        true
    }

    /// Writes what is queued, as far as the socket takes it.
    fn flush(&mut self) -> io::Result<()> {
        while !self.tx.is_empty() {
            let (a, _) = self.tx.as_slices();
            match self.sock.write(a) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.tx.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl Link {
    /// A TAP device by name (it must exist or may be created), with
    /// virtio-net headers and, where the kernel has it, UDP segmentation
    /// offload both ways ([`Tap`]).
    pub fn tap(name: &str) -> io::Result<Self> {
        Tap::open(name, true).map(Link::Tap)
    }

    /// A TAP device whose frames come and go whole, one a system call
    /// (what a kernel without UDP segmentation offload gets; benches
    /// compare).
    pub fn tap_whole(name: &str) -> io::Result<Self> {
        Tap::open(name, false).map(Link::Tap)
    }

    /// A stream socket: a server at `path`'s peer (connects to it).
    pub fn connect(path: &Path) -> io::Result<Self> {
        Stream::new(UnixStream::connect(path)?).map(Link::Stream)
    }

    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Link::Tap(t) => t.file().as_fd(),
            Link::Stream(s) => s.sock.as_fd(),
        }
    }

    /// Sends one frame (a stream's is written by [`Link::flush`], or
    /// when the next frame finds no room).
    fn send(&mut self, frame: &[u8], stats: &mut EthStats) -> io::Result<()> {
        match self {
            Link::Tap(t) => t.send(frame, stats),
            Link::Stream(s) => {
                if !s.queue(frame) {
                    s.flush()?;
                    if !s.queue(frame) {
                        stats.uplink_full += 1;
                        return Ok(());
                    }
                }
                stats.uplink_tx += 1;
                Ok(())
            }
        }
    }

    /// Sends one of the device's RoCE frames: a TAP that segments takes
    /// it into a run ([`Tap`]).
    fn send_roce(&mut self, frame: &mut Vec<u8>, stats: &mut EthStats) -> io::Result<()> {
        match self {
            Link::Tap(t) => t.send_roce(frame, stats),
            Link::Stream(_) => self.send(frame, stats),
        }
    }

    /// Receives what is there: each frame to `f`, with where its checksum
    /// is still to be written. Ok(false) when the link closed.
    fn receive(
        &mut self,
        stats: &mut EthStats,
        mut f: impl FnMut(&mut EthStats, &mut [u8], Option<Partial>),
    ) -> io::Result<bool> {
        match self {
            Link::Tap(t) => t.receive(TAP_READS, stats, f),
            Link::Stream(s) => s.read_frames(|fr| f(stats, fr, None)),
        }
    }

    fn flush(&mut self, stats: &mut EthStats) -> io::Result<()> {
        match self {
            Link::Tap(t) => t.flush(stats),
            Link::Stream(s) => s.flush(),
        }
    }

    /// Bytes waiting to be written.
    fn backlog(&self) -> usize {
        match self {
            Link::Tap(_) => 0,
            Link::Stream(s) => s.tx.len(),
        }
    }
}

/// Counters of the port.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct EthStats {
    /// Frames from the guest, passed to the uplink.
    pub guest_rx: u64,
    /// Frames to the guest (from the uplink).
    pub guest_tx: u64,
    /// Frames from the uplink.
    pub uplink_rx: u64,
    /// Frames to the uplink (the guest's and the device's).
    pub uplink_tx: u64,
    /// RoCEv2 packets steered to the device (from the uplink, or looped
    /// back from itself).
    pub roce_rx: u64,
    /// RoCEv2 packets the device sent.
    pub roce_tx: u64,
    pub rx_bytes: u64,
    /// Dropped: RoCEv2 for the device with a bad ICRC, IP or UDP header.
    pub bad_roce: u64,
    /// Dropped: a device packet whose address vector had no destination
    /// MAC.
    pub no_dmac: u64,
    /// Dropped: no guest connected to take them.
    pub guest_absent: u64,
    /// Dropped: the guest's side was full.
    pub guest_full: u64,
    /// Dropped: the uplink was full (or refused the frame).
    pub uplink_full: u64,
    /// Guest connections accepted.
    pub guest_connects: u64,
    /// Connections to the guest socket refused: a guest was connected
    /// already, or the peer's credentials were not allowed.
    pub guest_refused: u64,
    /// Accepts on the guest socket that found no descriptor or memory to
    /// spare (the connection waited, and was tried again later).
    pub accept_shortages: u64,
    /// Dropped: a frame from the guest with another source MAC.
    pub spoofed_mac: u64,
    /// Dropped: a frame from the guest with a source address (IP, or ARP
    /// sender) it was not given, or of a protocol the filter does not
    /// pass.
    pub spoofed_ip: u64,
    /// Rounds in which the device sent no more because the loopback queue
    /// or the uplink was full (backpressure).
    pub tx_paused: u64,
    /// Frames written to a TAP that the kernel cut into several packets
    /// (UDP segmentation offload: each packet is counted in `uplink_tx`).
    pub uplink_gso_tx: u64,
    /// Frames read from a TAP that held several packets (a peer's UDP GSO
    /// datagram, cut here: each packet is counted in `uplink_rx`).
    pub uplink_gso_rx: u64,
    /// Dropped: frames from a TAP whose virtio-net header, or whose
    /// headers as segments, did not add up.
    pub bad_vnet: u64,
    /// Dropped: frames from the uplink longer than [`MAX_FRAME`].
    pub oversize: u64,
}

impl EthStats {
    pub fn fields(&self) -> [(&'static str, u64); 22] {
        [
            ("guest_rx", self.guest_rx),
            ("guest_tx", self.guest_tx),
            ("uplink_rx", self.uplink_rx),
            ("uplink_tx", self.uplink_tx),
            ("roce_rx", self.roce_rx),
            ("roce_tx", self.roce_tx),
            ("rx_bytes", self.rx_bytes),
            ("bad_roce", self.bad_roce),
            ("no_dmac", self.no_dmac),
            ("guest_absent", self.guest_absent),
            ("guest_full", self.guest_full),
            ("uplink_full", self.uplink_full),
            ("guest_connects", self.guest_connects),
            ("guest_refused", self.guest_refused),
            ("accept_shortages", self.accept_shortages),
            ("spoofed_mac", self.spoofed_mac),
            ("spoofed_ip", self.spoofed_ip),
            ("tx_paused", self.tx_paused),
            ("uplink_gso_tx", self.uplink_gso_tx),
            ("uplink_gso_rx", self.uplink_gso_rx),
            ("bad_vnet", self.bad_vnet),
            ("oversize", self.oversize),
        ]
    }
}

/// Decides whether a peer that connected to the guest socket may use it
/// (its credentials checked by whoever made the port).
pub type PeerCheck = Box<dyn Fn(&UnixStream) -> bool + Send>;

/// Where the guest's NIC connects: QEMU connects to the listener (and
/// reconnects after a restart); a test may give a connected stream.
struct Guest {
    listener: Option<UnixListener>,
    stream: Option<Stream>,
    /// Whether a peer may connect; everyone when absent.
    check: Option<PeerCheck>,
    /// The listener's accepts, shortages waited out.
    acceptor: Acceptor,
    /// With a listener: the timer that ends the wait of a shortage (in the
    /// port's epoll instance), and whether the listener is out of it
    /// meanwhile.
    retry: Option<TimerFd>,
    paused: bool,
}

impl std::fmt::Debug for Guest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guest")
            .field("listener", &self.listener)
            .field("stream", &self.stream)
            .field("check", &self.check.is_some())
            .field("acceptor", &self.acceptor)
            .field("paused", &self.paused)
            .finish_non_exhaustive()
    }
}

/// What the guest may send through the port (against spoofing: a tenant
/// that forges another's MAC or addresses on a shared uplink).
#[derive(Clone, Debug, Default, Eq, PartialEq)]
pub struct SourceFilter {
    /// Frames from the guest must carry its MAC as their source.
    pub mac: bool,
    /// When not empty, the addresses the guest was given: IPv4 and IPv6
    /// packets must come from one of them (or, IPv6, from its MAC's
    /// link-local address; IPv4 from 0.0.0.0 only for DHCP, IPv6 from
    /// `::` only for duplicate address detection), ARP must name the
    /// guest's MAC and one of them (or 0.0.0.0, a probe) as its sender,
    /// and no other protocol passes.
    pub addrs: Vec<IpAddr>,
}

impl SourceFilter {
    /// Whether `addr` is one the guest may use as its own (a GID it
    /// binds): one of the addresses it was given or its MAC's IPv6
    /// link-local address. Every address when none were given.
    pub fn allows_addr(&self, mac: [u8; 6], addr: IpAddr) -> bool {
        self.addrs.is_empty() || self.addrs.contains(&addr) || addr == link_local(mac)
    }
}

/// The IPv6 link-local address of a MAC (modified EUI-64, RFC 4291
/// appendix A), which the guest's kernel gives its interface by default.
pub fn link_local(mac: [u8; 6]) -> IpAddr {
    let mut a = [0u8; 16];
    a[0] = 0xfe;
    a[1] = 0x80;
    a[8] = mac[0] ^ 0x02;
    a[9] = mac[1];
    a[10] = mac[2];
    a[11] = 0xff;
    a[12] = 0xfe;
    a[13] = mac[3];
    a[14] = mac[4];
    a[15] = mac[5];
    IpAddr::from(a)
}

/// The port.
#[derive(Debug)]
pub struct EthPort {
    guest: Guest,
    uplink: Link,
    /// The guest's MAC: the source of the device's frames.
    mac: MacAddr,
    /// What the guest may send.
    filter: SourceFilter,
    /// The device's addresses.
    locals: HashSet<IpAddr>,
    /// The next packet the engine writes.
    slot: Vec<u8>,
    /// The frame of the packet being sent.
    frame_buf: Vec<u8>,
    /// Device packets for the device itself, as IP packets, and their
    /// bytes (at most about [`LOOPBACK_BYTES`]).
    looped: VecDeque<Vec<u8>>,
    looped_bytes: usize,
    /// Whether the epoll instance watches the uplink stream for room.
    watching_out: bool,
    /// IPv4 identification of the next packet.
    ident: u16,
    /// The fds the event loop waits on, as one epoll instance.
    epoll: sys::Epoll,
    stats: EthStats,
}

/// Epoll tokens.
const TOKEN_LISTENER: u64 = 1;
const TOKEN_GUEST: u64 = 2;
const TOKEN_UPLINK: u64 = 3;
const TOKEN_RETRY: u64 = 4;

impl EthPort {
    /// A port whose guest side listens on `listener` (QEMU's `-netdev
    /// stream,server=off,addr.path=…` connects there; whoever bound it
    /// chose who may: see [`EthPort::set_peer_check`]) and whose uplink is
    /// `uplink`; `mac` is the guest NIC's.
    pub fn with_listener(listener: UnixListener, uplink: Link, mac: [u8; 6]) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        // Made now: when it is needed, descriptors are short.
        let retry = TimerFd::new(
            ClockId::CLOCK_MONOTONIC,
            TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC,
        )?;
        Self::with_guest(
            Guest {
                listener: Some(listener),
                stream: None,
                check: None,
                acceptor: Acceptor::new(),
                retry: Some(retry),
                paused: false,
            },
            uplink,
            mac,
        )
    }

    /// A port whose guest side is an already connected stream.
    pub fn with_stream(guest: UnixStream, uplink: Link, mac: [u8; 6]) -> io::Result<Self> {
        Self::with_guest(
            Guest {
                listener: None,
                stream: Some(Stream::new(guest)?),
                check: None,
                acceptor: Acceptor::new(),
                retry: None,
                paused: false,
            },
            uplink,
            mac,
        )
    }

    fn with_guest(guest: Guest, uplink: Link, mac: [u8; 6]) -> io::Result<Self> {
        let epoll = sys::Epoll::new()?;
        let p = EthPort {
            guest,
            uplink,
            mac: MacAddr(mac),
            locals: HashSet::new(),
            slot: vec![0; vrdma_wire::packet::MAX_LEN],
            frame_buf: Vec::with_capacity(MAX_FRAME),
            looped: VecDeque::new(),
            looped_bytes: 0,
            watching_out: false,
            filter: SourceFilter::default(),
            ident: 0,
            epoll,
            stats: EthStats::default(),
        };
        p.epoll.add(p.uplink.fd(), TOKEN_UPLINK)?;
        if let Some(l) = &p.guest.listener {
            p.epoll.add(l.as_fd(), TOKEN_LISTENER)?;
        }
        if let Some(t) = &p.guest.retry {
            p.epoll.add(t.as_fd(), TOKEN_RETRY)?;
        }
        if let Some(s) = &p.guest.stream {
            p.epoll.add(s.sock.as_fd(), TOKEN_GUEST)?;
        }
        Ok(p)
    }

    pub fn stats(&self) -> EthStats {
        self.stats
    }

    pub fn mac(&self) -> [u8; 6] {
        self.mac.0
    }

    /// The device's addresses (its GIDs: IPv4-mapped ones as IPv4).
    pub fn set_local(&mut self, gids: &[Gid]) {
        self.locals = gids.iter().map(|g| g.ip()).collect();
    }

    /// Whether a guest is connected.
    pub fn guest_connected(&self) -> bool {
        self.guest.stream.is_some()
    }

    /// The file descriptor that becomes readable when anything arrives
    /// (an epoll instance over the guest, its listener and the uplink).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }

    /// Receives what is waiting on every side: the guest's frames go to
    /// the uplink, the uplink's to the guest or, RoCEv2 for the device, to
    /// `deliver` (the IP header and the RoCE packet, its ICRC verified).
    /// Returns the frames taken. Each side is read a bounded amount per
    /// call; what is left waits for the next.
    pub fn receive(&mut self, mut deliver: impl FnMut(&IpRepr, &[u8])) -> io::Result<usize> {
        self.epoll.drain();
        let mut n = 0;
        // The device's packets to itself.
        while let Some(p) = self.looped.pop_front() {
            n += 1;
            self.looped_bytes -= p.len();
            self.stats.roce_rx += 1;
            self.stats.rx_bytes += p.len() as u64;
            match frame::unframe_ip(&p) {
                Ok(u) => deliver(&u.ip, u.roce),
                Err(_) => self.stats.bad_roce += 1,
            }
        }
        // The guest's frames: out on the uplink. Read before a newcomer
        // is looked at: a guest that closed its connection (QEMU
        // restarting) is gone first, and its successor is not taken for a
        // second guest.
        let EthPort {
            guest,
            uplink,
            filter,
            mac,
            stats,
            ..
        } = self;
        let mut failed = None;
        let open = match &mut guest.stream {
            Some(s) => s.read_frames(|f| {
                n += 1;
                stats.guest_rx += 1;
                if failed.is_none() && admits(filter, mac.0, stats, f) {
                    failed = uplink.send(f, stats).err();
                }
            })?,
            None => true,
        };
        if let Some(e) = failed {
            return Err(e);
        }
        if !open {
            self.guest_gone();
        }
        self.accept_guest()?;
        // The uplink's frames: to the device or the guest.
        let EthPort {
            guest,
            uplink,
            locals,
            stats,
            ..
        } = self;
        let up = uplink.receive(stats, |stats, f, partial| {
            n += 1;
            stats.uplink_rx += 1;
            stats.rx_bytes += f.len() as u64;
            if f.len() > MAX_FRAME {
                // A TAP whose MTU is above what the port carries: no
                // guest NIC or RoCE packet takes it.
                stats.oversize += 1;
                return;
            }
            match steer(locals, f) {
                Steer::Device => match roce_of(f) {
                    Some(ip) => match frame::unframe_ip(ip) {
                        Ok(u) => {
                            stats.roce_rx += 1;
                            deliver(&u.ip, u.roce);
                        }
                        Err(_) => stats.bad_roce += 1,
                    },
                    None => stats.bad_roce += 1,
                },
                Steer::Guest => {
                    // The guest's NIC has no offloads: its frames come
                    // with their checksums.
                    if let Some(p) = partial {
                        p.complete(f);
                    }
                    to_guest(guest, stats, f);
                }
            }
        })?;
        // What the round queued for the guest and the uplink, written.
        self.flush()?;
        if !up {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the uplink closed",
            ));
        }
        Ok(n)
    }

    /// What the guest may send through the port (by default, anything).
    pub fn set_filter(&mut self, filter: SourceFilter) {
        self.filter = filter;
    }

    pub fn filter(&self) -> &SourceFilter {
        &self.filter
    }

    /// Who may connect to the guest socket (by default, anyone who can
    /// reach it).
    pub fn set_peer_check(&mut self, check: PeerCheck) {
        self.guest.check = Some(check);
    }

    /// Whether the device may send another packet now: its packets to
    /// itself and the uplink stream's backlog have room. When not, the
    /// port's descriptor becomes readable once they do (the loopback
    /// queue is received in the next round; the uplink is watched for
    /// room).
    pub fn has_room(&mut self) -> bool {
        if self.uplink.backlog() >= UPLINK_HIGH_WATER {
            // Queued this round and not yet written: written now, as far
            // as the socket takes it (what it does not, it is watched for).
            if let Err(e) = self.flush() {
                tracing::debug!(error = %e, "the uplink broke");
            }
        }
        let room = self.looped_bytes < LOOPBACK_BYTES && self.uplink.backlog() < UPLINK_HIGH_WATER;
        if !room {
            self.stats.tx_paused += 1;
        }
        room
    }

    /// Takes a connection waiting on the guest socket: the guest's NIC if
    /// none is connected and the peer is allowed; otherwise it is closed
    /// at once (a live guest is never replaced: QEMU's reconnection comes
    /// after its old connection closed). A shortage of descriptors or
    /// memory is waited out: the listener leaves the epoll instance's
    /// watch and the retry timer wakes the port when the next try is due.
    fn accept_guest(&mut self) -> io::Result<()> {
        let g = &mut self.guest;
        let (Some(l), Some(timer)) = (&g.listener, &g.retry) else {
            return Ok(());
        };
        let now = Instant::now();
        if !g.acceptor.watching(now) {
            return Ok(());
        }
        if g.paused {
            // The wait is over: the timer is spent, the listener watched
            // again.
            timer.unset()?;
            let _ = timer.wait();
            self.epoll.watch_input(l.as_fd(), TOKEN_LISTENER, true)?;
            g.paused = false;
        }
        let sock = match g.acceptor.accept(now, || l.accept())? {
            Accepted::Conn((sock, _)) => sock,
            Accepted::Nothing => return Ok(()),
            Accepted::Later(at) => {
                self.stats.accept_shortages += 1;
                self.epoll.watch_input(l.as_fd(), TOKEN_LISTENER, false)?;
                g.paused = true;
                // Never zero: a zero expiration disarms the timer.
                let wait = at.saturating_duration_since(now).max(MIN_TIMER);
                timer.set(
                    Expiration::OneShot(TimeSpec::from_duration(wait)),
                    TimerSetTimeFlags::empty(),
                )?;
                return Ok(());
            }
        };
        if self.guest.stream.is_some() {
            self.stats.guest_refused += 1;
            tracing::warn!("a second connection to a connected guest socket was turned away");
            return Ok(());
        }
        if let Some(check) = &self.guest.check
            && !check(&sock)
        {
            self.stats.guest_refused += 1;
            tracing::warn!("a peer not allowed connected to the guest socket: turned away");
            return Ok(());
        }
        let stream = Stream::new(sock)?;
        self.epoll.add(stream.sock.as_fd(), TOKEN_GUEST)?;
        self.guest.stream = Some(stream);
        self.stats.guest_connects += 1;
        Ok(())
    }

    fn guest_gone(&mut self) {
        if let Some(s) = self.guest.stream.take() {
            self.epoll.remove(s.sock.as_fd());
        }
    }

    /// The buffer the engine writes its next packet into.
    pub fn slot(&mut self) -> &mut [u8] {
        &mut self.slot
    }

    /// Sends the packet the engine wrote into the slot: `route` and
    /// `src_port` frame it, `dmac` addresses it; `lent` pieces of its
    /// payload (at `payload_at`, read from `mem` by volatile copy) complete
    /// it; `len` counts all its bytes. Returns the packets sent.
    #[allow(clippy::too_many_arguments)]
    pub fn queue(
        &mut self,
        route: &Route,
        src_port: u16,
        dmac: Option<[u8; 6]>,
        len: usize,
        payload_at: usize,
        lent: &[Piece],
        mem: &impl Lender,
    ) -> io::Result<usize> {
        // The frame, built in one buffer: Ethernet header, room for the
        // IP and UDP headers, the RoCE packet (its headers, the lent
        // payload, pad and ICRC field), then the headers and ICRC sealed
        // in place.
        let referenced: usize = lent.iter().map(|p| p.len).sum();
        self.ident = self.ident.wrapping_add(1);
        let ip = match route.ip(len, self.ident) {
            Ok(ip) => ip,
            Err(_) => return Ok(0),
        };
        let ethertype: u16 = match route.dst.ip() {
            IpAddr::V4(_) => 0x0800,
            IpAddr::V6(_) => 0x86dd,
        };
        let mut f = std::mem::take(&mut self.frame_buf);
        f.clear();
        f.extend_from_slice(&dmac.unwrap_or_default());
        f.extend_from_slice(&self.mac.0);
        f.extend_from_slice(&ethertype.to_be_bytes());
        let ip_at = f.len();
        f.resize(ip_at + ip.buffer_len() + vrdma_wire::udp::HEADER_LEN, 0);
        f.extend_from_slice(&self.slot[..payload_at]);
        for p in lent {
            let at = f.len();
            f.resize(at + p.len, 0);
            let copied = mem
                .lend(p.addr, p.len)
                .is_some_and(|v| v.read_slice(&mut f[at..], 0).is_ok());
            if !copied {
                // The memory went away under the packet: lost, as on a
                // network.
                self.frame_buf = f;
                return Ok(0);
            }
        }
        f.extend_from_slice(&self.slot[payload_at..len - referenced]);
        if frame::seal_ip_packet(&ip, src_port, &mut f[ip_at..]).is_err() {
            self.frame_buf = f;
            return Ok(0);
        }
        self.stats.roce_tx += 1;
        let r = if self.locals.contains(&route.dst.ip()) {
            // For the device itself.
            let packet = f[ip_at..].to_vec();
            self.looped_bytes += packet.len();
            self.looped.push_back(packet);
            self.epoll.wake()
        } else if dmac.is_none() {
            self.stats.no_dmac += 1;
            self.frame_buf = f;
            return Ok(0);
        } else {
            self.uplink.send_roce(&mut f, &mut self.stats)
        };
        self.frame_buf = f;
        r.map(|()| 1)
    }

    /// Writes what the streams hold; while the uplink stream holds bytes
    /// it could not write, the port's descriptor wakes when it has room.
    pub fn flush(&mut self) -> io::Result<()> {
        self.uplink.flush(&mut self.stats)?;
        let waiting = self.uplink.backlog() > 0;
        if waiting != self.watching_out {
            self.epoll.watch(self.uplink.fd(), TOKEN_UPLINK, waiting)?;
            self.watching_out = waiting;
        }
        if let Some(s) = &mut self.guest.stream
            && s.flush().is_err()
        {
            self.guest_gone();
        }
        Ok(())
    }

    /// Bytes waiting on the streams.
    pub fn backlog(&self) -> usize {
        let g = self.guest.stream.as_ref().map_or(0, |s| s.tx.len());
        g + self.uplink.backlog()
    }
}

enum Steer {
    Device,
    Guest,
}

/// Where a frame from the uplink goes, `locals` the device's addresses:
/// RoCEv2 (UDP port 4791) for one of them is the device's — even if it
/// does not parse (to be counted: the device's receive checks every
/// header and the ICRC, once) — and everything else the guest's. Only
/// the destination port and address are read here.
fn steer(locals: &HashSet<IpAddr>, f: &[u8]) -> Steer {
    if frame::peek_udp_dst_port(f, true) == Some(ROCE_PORT)
        && dst_ip(f).is_some_and(|a| locals.contains(&a))
    {
        Steer::Device
    } else {
        Steer::Guest
    }
}

/// Whether the guest (its NIC's MAC `mac`) may send `f` (counted when
/// not).
fn admits(filter: &SourceFilter, mac: [u8; 6], stats: &mut EthStats, f: &[u8]) -> bool {
    match check_source(filter, mac, f) {
        Ok(()) => true,
        Err(Spoof::Mac) => {
            stats.spoofed_mac += 1;
            false
        }
        Err(Spoof::Addr) => {
            stats.spoofed_ip += 1;
            false
        }
    }
}

/// Queues a frame for the guest (written by [`EthPort::flush`], or now
/// when its stream's backlog is full).
fn to_guest(guest: &mut Guest, stats: &mut EthStats, f: &[u8]) {
    let Some(s) = &mut guest.stream else {
        stats.guest_absent += 1;
        return;
    };
    // A broken stream is found by the flush that ends the round.
    if s.queue(f) || (s.flush().is_ok() && s.queue(f)) {
        stats.guest_tx += 1;
    } else {
        stats.guest_full += 1;
    }
}

/// Why a guest's frame was refused.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
enum Spoof {
    Mac,
    Addr,
}

const ETHERTYPE_IPV4: u16 = 0x0800;
const ETHERTYPE_ARP: u16 = 0x0806;
const ETHERTYPE_IPV6: u16 = 0x86dd;
const ETHERTYPE_VLAN: u16 = 0x8100;

/// Checks a frame from the guest against `filter` (`mac` the guest's).
fn check_source(filter: &SourceFilter, mac: [u8; 6], f: &[u8]) -> Result<(), Spoof> {
    if filter.mac && f.get(6..12) != Some(&mac[..]) {
        return Err(Spoof::Mac);
    }
    if filter.addrs.is_empty() {
        return Ok(());
    }
    let (ethertype, at) = match be16(f, 12) {
        Some(ETHERTYPE_VLAN) => (be16(f, 16).ok_or(Spoof::Addr)?, 18),
        Some(t) => (t, 14),
        None => return Err(Spoof::Addr),
    };
    let payload = &f[at.min(f.len())..];
    let given = |a: IpAddr| filter.addrs.contains(&a);
    let ok = match ethertype {
        ETHERTYPE_IPV4 => match ipv4_at(payload, 12) {
            Some(src) if given(IpAddr::V4(src)) => true,
            // DHCP (a client asking for its address): UDP to port 67.
            Some(src) if src.is_unspecified() => {
                let ihl = usize::from(payload[0] & 0x0f) * 4;
                payload.get(9) == Some(&17) && be16(payload, ihl + 2) == Some(67)
            }
            _ => false,
        },
        ETHERTYPE_IPV6 => match payload
            .get(8..24)
            .and_then(|b| <[u8; 16]>::try_from(b).ok())
        {
            Some(b) => {
                let src = std::net::Ipv6Addr::from(b);
                // `::` is the source of duplicate address detection.
                given(IpAddr::V6(src)) || src.is_unspecified() || IpAddr::V6(src) == link_local(mac)
            }
            None => false,
        },
        // ARP over Ethernet/IPv4: the sender's MAC and address (0.0.0.0
        // in a probe) are the guest's.
        ETHERTYPE_ARP => {
            payload.get(8..14) == Some(&mac[..])
                && ipv4_at(payload, 14).is_some_and(|a| a.is_unspecified() || given(IpAddr::V4(a)))
        }
        _ => false,
    };
    if ok { Ok(()) } else { Err(Spoof::Addr) }
}

fn be16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn ipv4_at(b: &[u8], at: usize) -> Option<std::net::Ipv4Addr> {
    let a: [u8; 4] = b.get(at..at + 4)?.try_into().ok()?;
    Some(std::net::Ipv4Addr::from(a))
}

/// The IP packet inside an Ethernet frame (after its header, with or
/// without a VLAN tag).
fn roce_of(f: &[u8]) -> Option<&[u8]> {
    let eth = ethernet::Frame::new_checked(f).ok()?;
    f.get(eth.header_len()..)
}

/// The destination IP of an Ethernet frame, read without other checks.
fn dst_ip(f: &[u8]) -> Option<IpAddr> {
    let ip = roce_of(f)?;
    match ip.first()? >> 4 {
        4 => {
            let b: [u8; 4] = ip.get(16..20)?.try_into().ok()?;
            Some(IpAddr::from(b))
        }
        6 => {
            let b: [u8; 16] = ip.get(24..40)?.try_into().ok()?;
            Some(IpAddr::from(b))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    const MAC: [u8; 6] = [0x52, 0x54, 0, 0x4c, 0, 1];

    /// An Ethernet frame from `src` of `ethertype` with `payload`.
    fn eth(src: [u8; 6], ethertype: u16, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![0xff; 6];
        f.extend_from_slice(&src);
        f.extend_from_slice(&ethertype.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// The first bytes of an IPv4 packet from `src` carrying `proto` to
    /// UDP port `dport`.
    fn ipv4(src: Ipv4Addr, proto: u8, dport: u16) -> Vec<u8> {
        let mut p = vec![0u8; 28];
        p[0] = 0x45;
        p[9] = proto;
        p[12..16].copy_from_slice(&src.octets());
        p[16..20].copy_from_slice(&[10, 0, 0, 9]);
        p[22..24].copy_from_slice(&dport.to_be_bytes());
        p
    }

    fn ipv6(src: Ipv6Addr) -> Vec<u8> {
        let mut p = vec![0u8; 40];
        p[0] = 0x60;
        p[8..24].copy_from_slice(&src.octets());
        p
    }

    fn arp(sender_mac: [u8; 6], sender: Ipv4Addr) -> Vec<u8> {
        let mut p = vec![0u8; 28];
        p[..8].copy_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
        p[8..14].copy_from_slice(&sender_mac);
        p[14..18].copy_from_slice(&sender.octets());
        p
    }

    #[test]
    fn the_filter_passes_the_guests_own_addresses_only() {
        let given = Ipv4Addr::new(10, 0, 0, 5);
        let other = Ipv4Addr::new(10, 0, 0, 6);
        let v6: Ipv6Addr = "fd00::5".parse().unwrap();
        let off = SourceFilter::default();
        let mac_only = SourceFilter {
            mac: true,
            addrs: vec![],
        };
        let full = SourceFilter {
            mac: true,
            addrs: vec![IpAddr::V4(given), IpAddr::V6(v6)],
        };
        let stranger = [0x52, 0x54, 0, 0x4c, 0, 2];
        let ll = match link_local(MAC) {
            IpAddr::V6(a) => a,
            IpAddr::V4(_) => unreachable!(),
        };
        assert_eq!(ll, "fe80::5054:ff:fe4c:1".parse::<Ipv6Addr>().unwrap());
        // Each frame's verdict with no filter, the MAC alone, and both.
        type Verdicts = [Result<(), Spoof>; 3];
        let cases: Vec<(Vec<u8>, Verdicts)> = vec![
            (
                eth(MAC, 0x0800, &ipv4(given, 6, 0)),
                [Ok(()), Ok(()), Ok(())],
            ),
            (
                eth(stranger, 0x0800, &ipv4(given, 6, 0)),
                [Ok(()), Err(Spoof::Mac), Err(Spoof::Mac)],
            ),
            (
                eth(MAC, 0x0800, &ipv4(other, 6, 0)),
                [Ok(()), Ok(()), Err(Spoof::Addr)],
            ),
            // DHCP from 0.0.0.0, and nothing else from it.
            (
                eth(MAC, 0x0800, &ipv4(Ipv4Addr::UNSPECIFIED, 17, 67)),
                [Ok(()), Ok(()), Ok(())],
            ),
            (
                eth(MAC, 0x0800, &ipv4(Ipv4Addr::UNSPECIFIED, 17, 4791)),
                [Ok(()), Ok(()), Err(Spoof::Addr)],
            ),
            (eth(MAC, 0x86dd, &ipv6(v6)), [Ok(()), Ok(()), Ok(())]),
            (eth(MAC, 0x86dd, &ipv6(ll)), [Ok(()), Ok(()), Ok(())]),
            (
                eth(MAC, 0x86dd, &ipv6(Ipv6Addr::UNSPECIFIED)),
                [Ok(()), Ok(()), Ok(())],
            ),
            (
                eth(MAC, 0x86dd, &ipv6("fd00::6".parse().unwrap())),
                [Ok(()), Ok(()), Err(Spoof::Addr)],
            ),
            (eth(MAC, 0x0806, &arp(MAC, given)), [Ok(()), Ok(()), Ok(())]),
            (
                eth(MAC, 0x0806, &arp(MAC, Ipv4Addr::UNSPECIFIED)),
                [Ok(()), Ok(()), Ok(())],
            ),
            (
                eth(MAC, 0x0806, &arp(MAC, other)),
                [Ok(()), Ok(()), Err(Spoof::Addr)],
            ),
            (
                eth(MAC, 0x0806, &arp(stranger, given)),
                [Ok(()), Ok(()), Err(Spoof::Addr)],
            ),
            // A VLAN tag is looked through.
            (
                eth(
                    MAC,
                    0x8100,
                    &[&[0, 5, 8, 0][..], &ipv4(other, 6, 0)].concat(),
                ),
                [Ok(()), Ok(()), Err(Spoof::Addr)],
            ),
            (
                eth(
                    MAC,
                    0x8100,
                    &[&[0, 5, 8, 0][..], &ipv4(given, 6, 0)].concat(),
                ),
                [Ok(()), Ok(()), Ok(())],
            ),
            // Another protocol, and frames too short to tell.
            (
                eth(MAC, 0x88cc, &[0; 40]),
                [Ok(()), Ok(()), Err(Spoof::Addr)],
            ),
            (
                eth(MAC, 0x0800, &[0x45; 10]),
                [Ok(()), Ok(()), Err(Spoof::Addr)],
            ),
            (
                MAC[..4].to_vec(),
                [Ok(()), Err(Spoof::Mac), Err(Spoof::Mac)],
            ),
        ];
        for (i, (f, want)) in cases.iter().enumerate() {
            for (filter, want) in [&off, &mac_only, &full].into_iter().zip(want) {
                assert_eq!(check_source(filter, MAC, f), *want, "case {i}, {filter:?}");
            }
        }
        assert!(full.allows_addr(MAC, IpAddr::V4(given)));
        assert!(full.allows_addr(MAC, IpAddr::V6(ll)));
        assert!(!full.allows_addr(MAC, IpAddr::V4(other)));
        assert!(mac_only.allows_addr(MAC, IpAddr::V4(other)));
    }

    /// A port whose guest and uplink are the far ends of socket pairs.
    fn port() -> (EthPort, UnixStream, UnixStream) {
        let (g, guest) = UnixStream::pair().unwrap();
        let (u, uplink) = UnixStream::pair().unwrap();
        let p = EthPort::with_stream(g, Link::Stream(Stream::new(u).unwrap()), MAC).unwrap();
        (p, guest, uplink)
    }

    #[test]
    fn a_stream_is_read_a_bounded_amount_per_turn() {
        let (mut p, guest, mut uplink) = port();
        guest.set_nonblocking(true).unwrap();
        let frame = eth(MAC, 0x0800, &[0u8; 1000]);
        let mut one = (frame.len() as u32).to_be_bytes().to_vec();
        one.extend_from_slice(&frame);
        // As much as the socket takes: more than one turn reads.
        let mut written = 0;
        let mut g = &guest;
        while let Ok(n) = g.write(&one) {
            assert_eq!(n, one.len());
            written += 1;
            if written == 1000 {
                break;
            }
        }
        assert!(written * one.len() > READ_PER_TURN, "{written} frames");
        let n = p.receive(|_, _| {}).unwrap();
        let per_turn = READ_PER_TURN.div_ceil(one.len());
        assert!(n <= per_turn, "{n} frames in one turn");
        let s = p.guest.stream.as_ref().unwrap();
        assert!(s.rx.len() < MAX_FRAME + 4, "{} bytes buffered", s.rx.len());
        // Every frame arrives in the end, over several turns.
        let mut turns = 1;
        let mut taken = n;
        while taken < written {
            taken += p.receive(|_, _| {}).unwrap();
            turns += 1;
        }
        assert_eq!(taken, written);
        assert!(turns >= 2);
        assert_eq!(p.stats().guest_rx, written as u64);
        uplink.set_nonblocking(true).unwrap();
        let mut got = vec![0u8; 4 << 20];
        let mut bytes = 0;
        while let Ok(k) = uplink.read(&mut got[bytes..]) {
            if k == 0 {
                break;
            }
            bytes += k;
        }
        assert_eq!(bytes + p.uplink.backlog(), written * one.len());
    }

    #[test]
    fn frames_sent_before_the_guest_closed_its_stream_are_taken() {
        let (mut p, mut guest, mut uplink) = port();
        let frame = eth(MAC, 0x0800, &[0u8; 1000]);
        for _ in 0..10 {
            guest
                .write_all(&(frame.len() as u32).to_be_bytes())
                .unwrap();
            guest.write_all(&frame).unwrap();
        }
        // QEMU stopping: its last frames, then the end of the stream, read
        // in one turn.
        drop(guest);
        p.receive(|_, _| {}).unwrap();
        assert!(!p.guest_connected());
        assert_eq!((p.stats().guest_rx, p.stats().uplink_tx), (10, 10));
        uplink.set_nonblocking(true).unwrap();
        let mut got = vec![0u8; 64 << 10];
        let n = uplink.read(&mut got).unwrap();
        assert_eq!(n, 10 * (4 + frame.len()));
    }

    #[test]
    fn a_second_connection_never_replaces_a_live_guest() {
        let dir = std::env::temp_dir().join(format!("vrdma-eth-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("second.net");
        let (u, _uplink) = UnixStream::pair().unwrap();
        let l = UnixListener::bind(&path).unwrap();
        let mut p = EthPort::with_listener(l, Link::Stream(Stream::new(u).unwrap()), MAC).unwrap();
        let mut first = UnixStream::connect(&path).unwrap();
        p.receive(|_, _| {}).unwrap();
        assert!(p.guest_connected());
        let mut second = UnixStream::connect(&path).unwrap();
        p.receive(|_, _| {}).unwrap();
        assert_eq!((p.stats().guest_connects, p.stats().guest_refused), (1, 1));
        // The newcomer was closed; the first guest is still the port's.
        let mut b = [0u8; 1];
        assert_eq!(second.read(&mut b).unwrap(), 0);
        let frame = eth(MAC, 0x0800, &[0u8; 60]);
        first
            .write_all(&(frame.len() as u32).to_be_bytes())
            .unwrap();
        first.write_all(&frame).unwrap();
        p.receive(|_, _| {}).unwrap();
        assert_eq!(p.stats().guest_rx, 1);
        // Once the first has gone, a reconnection is taken (QEMU
        // restarted), even in the turn that finds the old one closed.
        drop(first);
        let _third = UnixStream::connect(&path).unwrap();
        p.receive(|_, _| {}).unwrap();
        assert!(p.guest_connected());
        assert_eq!((p.stats().guest_connects, p.stats().guest_refused), (2, 1));
        // A peer the check refuses is turned away.
        let (u, _uplink2) = UnixStream::pair().unwrap();
        let l = UnixListener::bind(dir.join("checked.net")).unwrap();
        let mut p2 = EthPort::with_listener(l, Link::Stream(Stream::new(u).unwrap()), MAC).unwrap();
        p2.set_peer_check(Box::new(|_| false));
        let _c = UnixStream::connect(dir.join("checked.net")).unwrap();
        p2.receive(|_, _| {}).unwrap();
        assert!(!p2.guest_connected());
        assert_eq!(p2.stats().guest_refused, 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn spoofed_frames_from_the_guest_are_dropped_and_counted() {
        let (mut p, mut guest, mut uplink) = port();
        p.set_filter(SourceFilter {
            mac: true,
            addrs: vec![IpAddr::V4(Ipv4Addr::new(10, 0, 0, 5))],
        });
        for f in [
            eth(MAC, 0x0800, &ipv4(Ipv4Addr::new(10, 0, 0, 5), 6, 0)),
            eth(
                [2, 0, 0, 0, 0, 9],
                0x0800,
                &ipv4(Ipv4Addr::new(10, 0, 0, 5), 6, 0),
            ),
            eth(MAC, 0x0800, &ipv4(Ipv4Addr::new(10, 0, 0, 6), 6, 0)),
        ] {
            guest.write_all(&(f.len() as u32).to_be_bytes()).unwrap();
            guest.write_all(&f).unwrap();
        }
        p.receive(|_, _| {}).unwrap();
        let s = p.stats();
        assert_eq!((s.guest_rx, s.uplink_tx), (3, 1));
        assert_eq!((s.spoofed_mac, s.spoofed_ip), (1, 1));
        uplink.set_nonblocking(true).unwrap();
        let mut b = [0u8; 256];
        let n = uplink.read(&mut b).unwrap();
        assert_eq!(&b[4 + 6..4 + 12], &MAC);
        assert_eq!(n, 4 + 14 + 28);
    }
}
