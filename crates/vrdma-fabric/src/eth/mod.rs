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

mod sys;

use std::{
    collections::{HashSet, VecDeque},
    fs::File,
    io::{self, Read, Write},
    net::IpAddr,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd},
        unix::net::{UnixListener, UnixStream},
    },
    path::Path,
};

use vm_memory::Bytes;
use vrdma_wire::{
    Gid,
    ethernet::{self, MacAddr},
    frame::{self, IpRepr, Route},
};

use crate::{Lender, Piece};

/// The largest frame carried: a 9000-byte jumbo IP packet and its Ethernet
/// header (with a VLAN tag).
pub const MAX_FRAME: usize = 9000 + ethernet::HEADER_LEN + ethernet::VLAN_LEN;

/// Frames a stream may hold waiting for its peer to read (beyond them,
/// frames are dropped).
const STREAM_BACKLOG: usize = 1 << 20;

/// The RoCEv2 UDP port.
const ROCE_PORT: u16 = 4791;

/// One side of the port: a TAP device, or a stream of length-prefixed
/// frames.
#[derive(Debug)]
pub enum Link {
    Tap(File),
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
    /// the peer closed the stream (or sent a frame no Ethernet has).
    fn read_frames(&mut self, mut f: impl FnMut(&[u8])) -> io::Result<bool> {
        let mut buf = [0u8; 16384];
        loop {
            match self.sock.read(&mut buf) {
                Ok(0) => return Ok(false),
                Ok(n) => self.rx.extend_from_slice(&buf[..n]),
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
            f(&self.rx[at + 4..at + 4 + len]);
            at += 4 + len;
        }
        self.rx.drain(..at);
        Ok(true)
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
    /// A TAP device by name (it must exist or may be created; it is opened
    /// without packet information, one frame per read and write).
    pub fn tap(name: &str) -> io::Result<Self> {
        sys::open_tap(name).map(Link::Tap)
    }

    /// A stream socket: a server at `path`'s peer (connects to it).
    pub fn connect(path: &Path) -> io::Result<Self> {
        Stream::new(UnixStream::connect(path)?).map(Link::Stream)
    }

    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Link::Tap(f) => f.as_fd(),
            Link::Stream(s) => s.sock.as_fd(),
        }
    }

    /// Sends one frame; false if it was dropped (no room now).
    fn send(&mut self, frame: &[u8]) -> io::Result<bool> {
        match self {
            Link::Tap(f) => match f.write(frame) {
                Ok(_) => Ok(true),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
                // A frame the TAP refuses (too long for it): dropped.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
                Err(e) if e.raw_os_error() == Some(libc::EIO) => Ok(false),
                Err(e) => Err(e),
            },
            Link::Stream(s) => {
                let ok = s.queue(frame);
                s.flush()?;
                Ok(ok)
            }
        }
    }

    /// Receives what is there: each frame to `f`. Ok(false) when the link
    /// closed.
    fn receive(&mut self, mut f: impl FnMut(&[u8])) -> io::Result<bool> {
        match self {
            Link::Tap(t) => {
                let mut buf = [0u8; MAX_FRAME + 64];
                for _ in 0..64 {
                    match t.read(&mut buf) {
                        Ok(0) => return Ok(false),
                        Ok(n) => f(&buf[..n]),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(true)
            }
            Link::Stream(s) => s.read_frames(f),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Link::Tap(_) => Ok(()),
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
}

impl EthStats {
    pub fn fields(&self) -> [(&'static str, u64); 13] {
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
        ]
    }
}

/// Where the guest's NIC connects: QEMU connects to the listener (and
/// reconnects after a restart); a test may give a connected stream.
#[derive(Debug)]
struct Guest {
    listener: Option<UnixListener>,
    stream: Option<Stream>,
}

/// The port.
#[derive(Debug)]
pub struct EthPort {
    guest: Guest,
    uplink: Link,
    /// The guest's MAC: the source of the device's frames.
    mac: MacAddr,
    /// The device's addresses.
    locals: HashSet<IpAddr>,
    /// The next packet the engine writes.
    slot: Vec<u8>,
    /// Scratch for one IP packet, one frame.
    ip_buf: Vec<u8>,
    frame_buf: Vec<u8>,
    /// Device packets for the device itself, as IP packets.
    looped: VecDeque<Vec<u8>>,
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

impl EthPort {
    /// A port whose guest side listens at `guest_socket` (QEMU's
    /// `-netdev stream,server=off,addr.path=…` connects there) and whose
    /// uplink is `uplink`; `mac` is the guest NIC's.
    pub fn listen(guest_socket: &Path, uplink: Link, mac: [u8; 6]) -> io::Result<Self> {
        if guest_socket.exists() {
            if UnixStream::connect(guest_socket).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("{} is served by another process", guest_socket.display()),
                ));
            }
            std::fs::remove_file(guest_socket)?;
        }
        let l = UnixListener::bind(guest_socket)?;
        l.set_nonblocking(true)?;
        Self::with_guest(
            Guest {
                listener: Some(l),
                stream: None,
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
            },
            uplink,
            mac,
        )
    }

    fn with_guest(guest: Guest, uplink: Link, mac: [u8; 6]) -> io::Result<Self> {
        if let Link::Tap(f) = &uplink {
            sys::set_nonblocking(f.as_raw_fd())?;
        }
        let epoll = sys::Epoll::new()?;
        let p = EthPort {
            guest,
            uplink,
            mac: MacAddr(mac),
            locals: HashSet::new(),
            slot: vec![0; vrdma_wire::packet::MAX_LEN],
            ip_buf: Vec::with_capacity(MAX_FRAME),
            frame_buf: Vec::with_capacity(MAX_FRAME),
            looped: VecDeque::new(),
            ident: 0,
            epoll,
            stats: EthStats::default(),
        };
        p.epoll.add(p.uplink.fd(), TOKEN_UPLINK)?;
        if let Some(l) = &p.guest.listener {
            p.epoll.add(l.as_fd(), TOKEN_LISTENER)?;
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
    /// Returns the frames taken.
    pub fn receive(&mut self, mut deliver: impl FnMut(&IpRepr, &[u8])) -> io::Result<usize> {
        self.epoll.drain();
        let mut n = 0;
        // The device's packets to itself.
        while let Some(p) = self.looped.pop_front() {
            n += 1;
            self.stats.roce_rx += 1;
            self.stats.rx_bytes += p.len() as u64;
            match frame::unframe_ip(&p) {
                Ok(u) => deliver(&u.ip, u.roce),
                Err(_) => self.stats.bad_roce += 1,
            }
        }
        self.accept_guest()?;
        // The guest's frames: out on the uplink.
        let mut out: Vec<Vec<u8>> = Vec::new();
        let open = match &mut self.guest.stream {
            Some(s) => s.read_frames(|f| out.push(f.to_vec()))?,
            None => true,
        };
        for f in &out {
            n += 1;
            self.stats.guest_rx += 1;
            self.send_to_uplink(f)?;
        }
        if !open {
            self.guest_gone();
        }
        // The uplink's frames: to the device or the guest.
        let mut frames: Vec<Vec<u8>> = Vec::new();
        let up = self.uplink.receive(|f| frames.push(f.to_vec()))?;
        if !up {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the uplink closed",
            ));
        }
        for f in &frames {
            n += 1;
            self.stats.uplink_rx += 1;
            self.stats.rx_bytes += f.len() as u64;
            match self.steer(f) {
                Steer::Device => match roce_of(f) {
                    Some(ip) => match frame::unframe_ip(ip) {
                        Ok(u) => {
                            self.stats.roce_rx += 1;
                            deliver(&u.ip, u.roce);
                        }
                        Err(_) => self.stats.bad_roce += 1,
                    },
                    None => self.stats.bad_roce += 1,
                },
                Steer::Guest => self.send_to_guest(f)?,
            }
        }
        Ok(n)
    }

    /// Where a frame from the uplink goes.
    fn steer(&self, f: &[u8]) -> Steer {
        if frame::peek_udp_dst_port(f, true) != Some(ROCE_PORT) {
            return Steer::Guest;
        }
        match frame::decode_ethernet(f) {
            Ok(d) if self.locals.contains(&d.repr.ip.dst()) => Steer::Device,
            // RoCEv2 that cannot even be parsed, for a local address, is
            // the device's (to be counted); for another address, the
            // guest's business.
            Err(_) if dst_ip(f).is_some_and(|a| self.locals.contains(&a)) => Steer::Device,
            _ => Steer::Guest,
        }
    }

    fn accept_guest(&mut self) -> io::Result<()> {
        let Some(l) = &self.guest.listener else {
            return Ok(());
        };
        match l.accept() {
            Ok((sock, _)) => {
                // A new connection replaces the old (QEMU reconnected).
                self.guest_gone();
                let stream = Stream::new(sock)?;
                self.epoll.add(stream.sock.as_fd(), TOKEN_GUEST)?;
                self.guest.stream = Some(stream);
                self.stats.guest_connects += 1;
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn guest_gone(&mut self) {
        if let Some(s) = self.guest.stream.take() {
            self.epoll.remove(s.sock.as_fd());
        }
    }

    fn send_to_guest(&mut self, f: &[u8]) -> io::Result<()> {
        let Some(s) = &mut self.guest.stream else {
            self.stats.guest_absent += 1;
            return Ok(());
        };
        if s.queue(f) {
            self.stats.guest_tx += 1;
        } else {
            self.stats.guest_full += 1;
        }
        if let Err(e) = s.flush() {
            tracing::debug!(error = %e, "guest stream broke");
            self.guest_gone();
        }
        Ok(())
    }

    fn send_to_uplink(&mut self, f: &[u8]) -> io::Result<()> {
        if self.uplink.send(f)? {
            self.stats.uplink_tx += 1;
        } else {
            self.stats.uplink_full += 1;
        }
        Ok(())
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
        // The RoCE packet, whole: headers, the lent payload, pad and ICRC.
        let referenced: usize = lent.iter().map(|p| p.len).sum();
        let mut roce = std::mem::take(&mut self.frame_buf);
        roce.clear();
        roce.extend_from_slice(&self.slot[..payload_at]);
        for p in lent {
            let Some(v) = mem.lend(p.addr, p.len) else {
                // The memory went away under the packet: lost, as on a
                // network.
                self.frame_buf = roce;
                return Ok(0);
            };
            let at = roce.len();
            roce.resize(at + p.len, 0);
            if v.read_slice(&mut roce[at..], 0).is_err() {
                self.frame_buf = roce;
                return Ok(0);
            }
        }
        roce.extend_from_slice(&self.slot[payload_at..len - referenced]);
        self.ident = self.ident.wrapping_add(1);
        let ip = route.ip(roce.len(), self.ident);
        let emitted = ip
            .map_err(|e| io::Error::other(e.to_string()))
            .and_then(|ip| {
                frame::emit_ip_packet(&ip, src_port, &roce, &mut self.ip_buf)
                    .map_err(|e| io::Error::other(e.to_string()))
            });
        self.frame_buf = roce;
        if emitted.is_err() {
            return Ok(0);
        }
        self.stats.roce_tx += 1;
        if self.locals.contains(&route.dst.ip()) {
            // For the device itself.
            self.looped.push_back(self.ip_buf.clone());
            self.epoll.wake()?;
            return Ok(1);
        }
        let Some(dmac) = dmac else {
            self.stats.no_dmac += 1;
            return Ok(0);
        };
        let ethertype: u16 = match route.dst.ip() {
            IpAddr::V4(_) => 0x0800,
            IpAddr::V6(_) => 0x86dd,
        };
        let mut f = std::mem::take(&mut self.frame_buf);
        f.clear();
        f.extend_from_slice(&dmac);
        f.extend_from_slice(&self.mac.0);
        f.extend_from_slice(&ethertype.to_be_bytes());
        f.extend_from_slice(&self.ip_buf);
        let r = self.send_to_uplink(&f);
        self.frame_buf = f;
        r.map(|()| 1)
    }

    /// Writes what the streams hold.
    pub fn flush(&mut self) -> io::Result<()> {
        self.uplink.flush()?;
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
