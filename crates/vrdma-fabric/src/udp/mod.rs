//! RoCEv2 over UDP: a port bound to one IPv4 or IPv6 address on UDP port
//! 4791, carrying a device's packets.
//!
//! A [`UdpPort`] knows sockets and the wire format, nothing of the engine:
//! a device hands it each packet as bytes written into the port's send
//! buffer ([`UdpPort::slot`]) plus an [`Outgoing`] that says where the
//! packet goes and which of its payload bytes stay in memory, and takes
//! each packet the port receives with the IP header it came in
//! ([`UdpPort::receive`]). Several ports can share a host on different
//! addresses (127.0.0.x in the tests).
//!
//! **Receive.** `recvmmsg` takes up to a batch of datagrams per call with
//! their TOS / traffic class and TTL / hop limit. A socket does not show
//! the IPv4 Identification the ICRC covers, so the ICRC check recovers it
//! ([`frame::unframe_datagram`]); the packets then go to the device.
//! Anything that is not a well-formed RoCEv2 packet with a good ICRC is
//! counted ([`UdpStats`]) and dropped.
//!
//! **Send.** Each packet leaves from a socket bound to its UDP source port
//! (per QP, chosen by the engine: ECMP entropy), created on first use; the
//! ICRC is computed for the headers the kernel writes (an unconnected
//! socket with DF set writes IPv4 Identification 0, and numbers a GSO
//! datagram's segments from there). Consecutive packets from one socket
//! go out in one `sendmmsg`, runs of equal packets to one peer as GSO
//! datagrams. The socket carries the packet's traffic class (or the port's
//! DSCP/ECN when the packet sets none) and hop limit as options; a packet
//! with others carries them as ancillary data. A payload the device lends
//! is not copied: `sendmmsg` gathers it from the memory ([`Lender`]),
//! between the headers and the ICRC, and the ICRC is computed over a
//! volatile copy of it, a chunk at a time.

mod sys;

use std::{
    collections::HashMap,
    io,
    net::{IpAddr, SocketAddr, UdpSocket},
    os::fd::{AsRawFd, BorrowedFd, RawFd},
};

use vrdma_wire::{
    Error as WireError, Gid, ROCEV2_UDP_PORT,
    frame::{self, IpRepr, Route},
    icrc::Icrc,
    packet, udp,
};

use crate::{Lender, Piece};

/// The longest packet a port sends or accepts: what a RoCE packet can be
/// (BTH, the longest extension headers, a 4096-byte payload, the ICRC).
pub const MAX_PACKET: usize = packet::MAX_LEN;

/// How a [`UdpPort`] is set up.
#[derive(Clone, Debug)]
pub struct Config {
    /// The address to bind; the device's GID is derived from it.
    pub addr: IpAddr,
    /// The UDP port to receive on: 4791 (IANA's RoCEv2 port) unless a test
    /// says otherwise.
    pub port: u16,
    /// DSCP (6 bits) and ECN (2 bits) for packets whose traffic class is 0.
    pub tos: u8,
    /// Datagrams per system call (1..=64).
    pub batch: usize,
    /// Send runs of packets to one peer as UDP GSO datagrams
    /// (`UDP_SEGMENT`: the kernel splits them, one trip through the stack
    /// for up to 64 packets) and receive coalesced ones (`UDP_GRO`), where
    /// the kernel supports them. The kernel refuses GSO on sockets without
    /// UDP checksums, so with GSO the datagrams carry a UDP checksum (the
    /// NIC's or the kernel's; RoCEv2 receivers accept it). Without it they
    /// carry none, as rxe sends them.
    pub gso: bool,
}

impl Config {
    /// Port 4791, TOS 0, batches of 32, GSO where the kernel has it.
    pub fn new(addr: IpAddr) -> Self {
        Config {
            addr,
            port: ROCEV2_UDP_PORT,
            tos: 0,
            batch: 32,
            gso: true,
        }
    }
}

/// What the port saw and did.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct UdpStats {
    pub rx_datagrams: u64,
    pub rx_bytes: u64,
    /// `recvmmsg` calls that returned datagrams.
    pub rx_calls: u64,
    /// ICRC did not verify (corrupt, or no IPv4 Identification explains it).
    pub rx_bad_icrc: u64,
    /// Not a RoCEv2 packet: too short, longer than any packet the device
    /// accepts, or from an address of the other IP version.
    pub rx_malformed: u64,
    pub tx_datagrams: u64,
    pub tx_bytes: u64,
    /// `sendmmsg` calls.
    pub tx_calls: u64,
    /// Datagrams the kernel refused (no route, too long), or packets that
    /// could not be sealed: dropped.
    pub tx_failed: u64,
    /// Packets sent from the receive socket because their source port
    /// could not be bound.
    pub src_port_fallback: u64,
}

impl UdpStats {
    /// Every counter with its name, in declaration order (for `vrdma
    /// stat` and logs). Destructured so that a new counter cannot be
    /// left out.
    pub fn fields(&self) -> [(&'static str, u64); 10] {
        let UdpStats {
            rx_datagrams,
            rx_bytes,
            rx_calls,
            rx_bad_icrc,
            rx_malformed,
            tx_datagrams,
            tx_bytes,
            tx_calls,
            tx_failed,
            src_port_fallback,
        } = *self;
        [
            ("rx_datagrams", rx_datagrams),
            ("rx_bytes", rx_bytes),
            ("rx_calls", rx_calls),
            ("rx_bad_icrc", rx_bad_icrc),
            ("rx_malformed", rx_malformed),
            ("tx_datagrams", tx_datagrams),
            ("tx_bytes", tx_bytes),
            ("tx_calls", tx_calls),
            ("tx_failed", tx_failed),
            ("src_port_fallback", src_port_fallback),
        ]
    }
}

/// One packet for the port to send: its bytes were written at the port's
/// [`UdpPort::slot`] — all of them, or, when the device lends the payload,
/// the bytes before the payload (`payload_at` of them) followed by the
/// bytes after it (pad and ICRC field).
#[derive(Clone, Copy, Debug)]
pub struct Outgoing<'a> {
    /// Where it goes at the IP layer.
    pub route: Route,
    /// Its UDP source port (per QP: ECMP entropy).
    pub src_port: u16,
    /// The whole packet's length, BTH through ICRC, lent bytes included.
    pub len: usize,
    /// Where in the packet the lent payload goes.
    pub payload_at: usize,
    /// The lent payload's pieces, in order (empty: the slot holds the
    /// whole packet).
    pub lent: &'a [Piece],
}

/// The interface MTU of the interface that holds `addr`, as the kernel
/// reports it (any 127.x address lives on the loopback device, though only
/// 127.0.0.1 is listed on it); `None` when unknown.
pub fn interface_mtu(addr: IpAddr) -> Option<u32> {
    let name = sys::interface_of(addr).or_else(|| addr.is_loopback().then(|| "lo".to_owned()))?;
    let mtu = std::fs::read_to_string(format!("/sys/class/net/{name}/mtu")).ok()?;
    mtu.trim().parse().ok()
}

/// Source-port sockets beyond this many are not opened (the receive socket
/// sends instead).
const MAX_SOURCE_SOCKETS: usize = 1024;

/// After this many packets in a row whose TOS or TTL differ from their
/// source socket's options, the options are set to the latest packet's
/// (a QP number used again by a QP of another traffic class).
const PRESET_AFTER: u32 = 64;

/// The source socket the last packet matched with its options (a
/// packet that did not match clears it, so that the miss count stays
/// exact).
#[derive(Clone, Copy, Debug)]
struct LastSource {
    port: u16,
    fd: RawFd,
    preset: (u8, u8),
}

/// A socket bound to a QP's UDP source port.
#[derive(Debug)]
struct Source {
    socket: UdpSocket,
    /// The TOS / traffic class and TTL / hop limit set as its options:
    /// packets with these need no ancillary data.
    preset: Option<(u8, u8)>,
    /// Packets in a row that did not match `preset`.
    misses: u32,
}

/// A RoCEv2 port on UDP sockets: the receive socket bound to the port's
/// address, the per-source-port send sockets, and the batches.
#[derive(Debug)]
pub struct UdpPort {
    config: Config,
    gid: Gid,
    socket: UdpSocket,
    /// Sockets bound to packets' source ports, by port (`None`: binding
    /// failed, the receive socket sends instead).
    sources: HashMap<u16, Option<Source>>,
    last_source: Option<LastSource>,
    recv: sys::RecvBatch,
    send: sys::SendBatch,
    /// The socket the queued datagrams leave from.
    send_fd: RawFd,
    stats: UdpStats,
}

// A port moves to the thread that serves it (a vhost-user backend must be
// Send and Sync): it holds no raw pointer between calls.
const _: fn() = || {
    fn send<T: Send>() {}
    send::<UdpPort>();
};

impl UdpPort {
    /// Binds `config.addr:config.port`.
    pub fn bind(config: Config) -> io::Result<Self> {
        let gid = match config.addr {
            IpAddr::V4(a) => Gid::from(a),
            IpAddr::V6(a) => Gid::from(a),
        };
        let socket = UdpSocket::bind(SocketAddr::new(config.addr, config.port))?;
        let mut config = config;
        // GSO and GRO where the kernel has them (Linux 4.18 / 5.0).
        config.gso = config.gso
            && sys::set_int_option(socket.as_raw_fd(), libc::SOL_UDP, libc::UDP_SEGMENT, 0).is_ok()
            && sys::set_int_option(socket.as_raw_fd(), libc::SOL_UDP, libc::UDP_GRO, 1).is_ok();
        configure(&socket, config.addr, true, config.gso)?;
        let send_fd = socket.as_raw_fd();
        // A coalesced (GRO) datagram holds up to 64 KiB.
        let slot = if config.gso { 1 << 16 } else { MAX_PACKET + 64 };
        Ok(UdpPort {
            gid,
            socket,
            sources: HashMap::new(),
            last_source: None,
            recv: sys::RecvBatch::new(config.batch, slot),
            send: sys::SendBatch::new(),
            send_fd,
            stats: UdpStats::default(),
            config,
        })
    }

    /// The bound address as a GID (IPv4-mapped for IPv4).
    pub fn gid(&self) -> Gid {
        self.gid
    }

    /// The address the port was asked to bind.
    pub fn addr(&self) -> IpAddr {
        self.config.addr
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.socket.local_addr()
    }

    pub fn stats(&self) -> UdpStats {
        self.stats
    }

    /// Datagrams per receive call.
    pub fn batch(&self) -> usize {
        self.config.batch
    }

    /// The receive socket, to wait on.
    pub fn fd(&self) -> BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.socket)
    }

    /// Waits until a datagram arrives or `timeout_ms` passes (negative:
    /// forever).
    pub fn wait_readable(&self, timeout_ms: i32) -> io::Result<bool> {
        sys::wait_readable(self.socket.as_raw_fd(), timeout_ms)
    }

    /// One receive call without blocking: each RoCEv2 packet among the
    /// datagrams it returns whose ICRC verifies goes to `deliver` with the
    /// IP header it came in (rebuilt from what the socket reports); the
    /// number of datagrams received (0 when none was waiting).
    pub fn receive(&mut self, mut deliver: impl FnMut(&IpRepr, &[u8])) -> io::Result<usize> {
        let n = self.recv.recv(self.socket.as_raw_fd())?;
        if n == 0 {
            return Ok(0);
        }
        self.stats.rx_calls += 1;
        for i in 0..n {
            let d = self.recv.get(i);
            self.stats.rx_datagrams += 1;
            self.stats.rx_bytes += d.data.len() as u64;
            let Some(src) = d.src else {
                self.stats.rx_malformed += 1;
                continue;
            };
            // A coalesced datagram cut by the slot keeps its whole
            // segments; anything else cut was too long to be RoCEv2.
            let data = match (d.truncated, d.segment) {
                (false, _) => d.data,
                (true, Some(g)) if g <= d.data.len() => {
                    self.stats.rx_malformed += 1;
                    tracing::debug!(%src, "coalesced datagram longer than a slot: its tail dropped");
                    &d.data[..d.data.len() / g * g]
                }
                (true, _) => {
                    self.stats.rx_malformed += 1;
                    tracing::debug!(%src, "datagram longer than any RoCEv2 packet");
                    continue;
                }
            };
            let info = frame::DatagramInfo {
                src,
                dst: self.config.addr,
                traffic_class: d.traffic_class,
                hop_limit: d.hop_limit,
                flow_label: d.flow_label,
            };
            if data.is_empty() {
                self.stats.rx_malformed += 1;
                continue;
            }
            // GRO coalesced datagrams of one size (the last may be
            // shorter): each is a packet of its own, with its own ICRC.
            let segment = d.segment.unwrap_or(data.len()).max(1);
            self.stats.rx_datagrams += data.len().div_ceil(segment).saturating_sub(1) as u64;
            for roce in data.chunks(segment) {
                if roce.len() > MAX_PACKET {
                    self.stats.rx_malformed += 1;
                    tracing::debug!(%src, len = roce.len(), "datagram longer than any RoCEv2 packet");
                    continue;
                }
                match frame::unframe_datagram(&info, roce) {
                    Ok(u) => deliver(&u.ip, u.roce),
                    Err(WireError::BadIcrc { found, computed }) => {
                        self.stats.rx_bad_icrc += 1;
                        tracing::debug!(%src, found, computed, "bad ICRC");
                    }
                    Err(e) => {
                        self.stats.rx_malformed += 1;
                        tracing::debug!(%src, error = %e, "not a RoCEv2 packet");
                    }
                }
            }
        }
        Ok(n)
    }

    /// Whether the send batch has no room for another packet: the caller
    /// flushes before it asks for a [`UdpPort::slot`].
    pub fn is_full(&self) -> bool {
        self.send.is_full(MAX_PACKET)
    }

    /// Where the next packet is written: [`MAX_PACKET`] bytes of the send
    /// batch, which has room for it ([`UdpPort::is_full`] was flushed).
    pub fn slot(&mut self) -> &mut [u8] {
        self.send.slot(MAX_PACKET)
    }

    /// Queues the packet written at [`UdpPort::slot`]: seals its ICRC for
    /// the headers the kernel will write (reading the lent payload from
    /// `mem`) and adds it to the batch, sending the batch first when the
    /// packet leaves from another socket. A packet that cannot be sealed
    /// (its lent memory gone) is dropped and counted. Returns the packets
    /// the batch sent on the way (0 unless it had to be sent first).
    pub fn queue(&mut self, out: &Outgoing<'_>, mem: &impl Lender) -> usize {
        let referenced: usize = out.lent.iter().map(|p| p.len).sum();
        // A lent payload is not in the slot: the bytes after it (pad, ICRC)
        // follow the headers there, and the slot holds `stored`.
        let Some(stored) = out.len.checked_sub(referenced) else {
            self.stats.tx_failed += 1;
            return 0;
        };
        let dst = match out.route.dst.to_ipv4() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(out.route.dst.into()),
        };
        let traffic_class = if out.route.traffic_class == 0 {
            self.config.tos
        } else {
            out.route.traffic_class
        };
        let mut dest = sys::Dest {
            addr: SocketAddr::new(dst, ROCEV2_UDP_PORT),
            traffic_class,
            hop_limit: out.route.hop_limit,
            preset: false,
        };
        let mut sent = 0;
        let (fd, port) = self.source_socket(out.src_port, &mut dest, stored, &mut sent, mem);
        if fd != self.send_fd {
            // The batch leaves from one socket: send what it holds, this
            // packet moving to the front of the next.
            sent += self.flush_keeping(stored, mem);
            self.send_fd = fd;
        }
        let gso = self.config.gso;
        let pieces = if out.lent.is_empty() {
            1
        } else {
            2 + out.lent.len()
        };
        let index = self.send.next_index(&dest, out.len, pieces, gso);
        let roce = &mut self.send.slot(MAX_PACKET)[..stored];
        // At most MAX_SEGMENTS (64) segments: the index fits a u16.
        let sealed = seal(&out.route, port, index as u16, roce, out, mem);
        if let Err(e) = sealed {
            tracing::debug!(error = %e, "cannot seal a packet: dropped");
            self.stats.tx_failed += 1;
            return sent;
        }
        if out.lent.is_empty() {
            self.send.commit(&dest, stored, gso);
        } else {
            let tail = stored - out.payload_at;
            self.send
                .commit_parts(&dest, out.payload_at, out.lent, tail, gso);
        }
        sent
    }

    /// Sends what is queued; the number of packets sent.
    pub fn flush(&mut self, mem: &impl Lender) -> usize {
        self.flush_keeping(0, mem)
    }

    /// Sends the batch, keeping `tail` uncommitted bytes (see
    /// [`sys::SendBatch::flush`]).
    fn flush_keeping(&mut self, tail: usize, mem: &impl Lender) -> usize {
        if self.send.len() == 0 {
            // Nothing committed: a tail already starts the slot.
            return 0;
        }
        let f = self.send.flush(self.send_fd, tail, mem);
        if f.gso_refused && self.config.gso {
            // The lost segments are resent by RC, one datagram each now.
            tracing::warn!(
                "the kernel refuses GSO datagrams here: sending one packet per datagram"
            );
            self.config.gso = false;
        }
        self.stats.tx_datagrams += f.sent as u64;
        self.stats.tx_bytes += f.bytes as u64;
        self.stats.tx_failed += f.failed as u64;
        self.stats.tx_calls += f.calls as u64;
        f.sent
    }

    /// The socket bound to source port `port` (opened on first use), and
    /// the port it really has: the receive socket's when binding fails.
    /// Marks `dest` [`sys::Dest::preset`] when the socket's TOS and TTL
    /// options are its own, setting them on a new socket (and on one whose
    /// packets differed [`PRESET_AFTER`] times in a row, after sending
    /// what the batch holds from it with the old ones: `tail` bytes are
    /// kept, and what was sent is added to `sent`).
    fn source_socket(
        &mut self,
        port: u16,
        dest: &mut sys::Dest,
        tail: usize,
        sent: &mut usize,
        mem: &impl Lender,
    ) -> (RawFd, u16) {
        let fields = (dest.traffic_class, dest.hop_limit);
        // A run of packets from one QP asks for the same socket: no
        // lookup (which showed in profiles of streams).
        if let Some(hit) = self.last_source
            && hit.port == port
            && hit.preset == fields
        {
            dest.preset = true;
            return (hit.fd, port);
        }
        self.last_source = None;
        if !self.sources.contains_key(&port) && self.sources.len() < MAX_SOURCE_SOCKETS {
            let s = UdpSocket::bind(SocketAddr::new(self.config.addr, port))
                .and_then(|s| configure(&s, self.config.addr, false, self.config.gso).map(|()| s));
            if let Err(e) = &s {
                tracing::warn!(port, error = %e, "cannot bind a source port; using the receive socket");
            }
            let source = s.ok().map(|socket| Source {
                socket,
                preset: None,
                misses: PRESET_AFTER,
            });
            self.sources.insert(port, source);
        }
        let Some(Some(source)) = self.sources.get_mut(&port) else {
            self.stats.src_port_fallback += 1;
            return (self.socket.as_raw_fd(), self.config.port);
        };
        let fd = source.socket.as_raw_fd();
        if source.preset == Some(fields) {
            source.misses = 0;
            dest.preset = true;
            self.last_source = Some(LastSource {
                port,
                fd,
                preset: fields,
            });
            return (fd, port);
        }
        source.misses += 1;
        if source.misses < PRESET_AFTER {
            return (fd, port);
        }
        source.misses = 0;
        source.preset = None;
        if fd == self.send_fd {
            // Queued datagrams from this socket count on its options.
            *sent += self.flush_keeping(tail, mem);
        }
        match sys::preset(fd, dest) {
            Ok(()) => {
                if let Some(Some(source)) = self.sources.get_mut(&port) {
                    source.preset = Some(fields);
                }
                dest.preset = true;
            }
            Err(e) => tracing::debug!(port, error = %e, "cannot set a source socket's TOS/TTL"),
        }
        (fd, port)
    }
}

/// Stores the ICRC of a packet sent as segment `index` of a UDP datagram
/// from `src_port` (the kernel gives a GSO datagram's segments consecutive
/// IPv4 Identifications from 0; IPv6 has none): `roce` is what the slot
/// holds of it — the whole packet, or the bytes around a lent payload,
/// which is read from `mem` a chunk at a time into a buffer of ours (a
/// volatile copy: the bytes may be changing under a guest's hand, and a
/// Rust reference to them would be unsound).
fn seal(
    route: &Route,
    src_port: u16,
    index: u16,
    roce: &mut [u8],
    out: &Outgoing<'_>,
    mem: &impl Lender,
) -> Result<(), WireError> {
    let ip = route.ip(out.len, index)?;
    let mut ip_header = [0u8; vrdma_wire::ipv6::HEADER_LEN];
    let ip_header = &mut ip_header[..ip.buffer_len()];
    ip.emit(ip_header)?;
    let mut udp_header = [0u8; udp::HEADER_LEN];
    udp::Repr {
        src_port,
        checksum: false,
    }
    .emit_header(&mut udp_header, udp::HEADER_LEN + out.len)?;
    let head_len = if out.lent.is_empty() {
        roce.len()
    } else {
        out.payload_at
    };
    if head_len > roce.len() || roce.len() < packet::ICRC_LEN {
        return Err(WireError::OutOfRange {
            what: "a packet's head",
            value: head_len as u64,
        });
    }
    let (head, tail) = roce.split_at_mut(head_len);
    // A whole packet: its last four bytes are the ICRC field.
    let (head, tail) = if out.lent.is_empty() {
        let (h, t) = head.split_at_mut(head.len() - packet::ICRC_LEN);
        (&*h, t)
    } else {
        (&*head, tail)
    };
    let mut crc = Icrc::new(ip_header, &udp_header, head)?;
    let mut chunk = [0u8; 1024];
    for piece in out.lent {
        let missing = || WireError::OutOfRange {
            what: "a lent payload address",
            value: piece.addr,
        };
        let slice = mem.lend(piece.addr, piece.len).ok_or_else(missing)?;
        let mut done = 0;
        while done < piece.len {
            let n = (piece.len - done).min(chunk.len());
            let part = slice.subslice(done, n).map_err(|_| missing())?;
            part.copy_to(&mut chunk[..n]);
            crc.update(&chunk[..n]);
            done += n;
        }
    }
    let value = crc.finish(tail)?;
    let at = tail.len() - packet::ICRC_LEN;
    tail[at..].copy_from_slice(&value.to_le_bytes());
    Ok(())
}

/// Socket options: DF without path-MTU state (IPv4 Identification 0 on an
/// unconnected socket), zero UDP checksums as RoCEv2 sends them, and —
/// for the receive socket — the TOS/TTL ancillary data and larger
/// buffers.
fn configure(s: &UdpSocket, addr: IpAddr, receive: bool, gso: bool) -> io::Result<()> {
    let fd = s.as_raw_fd();
    match addr {
        IpAddr::V4(_) => {
            sys::set_int_option(
                fd,
                libc::IPPROTO_IP,
                libc::IP_MTU_DISCOVER,
                libc::IP_PMTUDISC_PROBE,
            )?;
            if !gso {
                sys::set_int_option(fd, libc::SOL_SOCKET, libc::SO_NO_CHECK, 1)?;
            }
            if receive {
                sys::set_int_option(fd, libc::IPPROTO_IP, libc::IP_RECVTOS, 1)?;
                sys::set_int_option(fd, libc::IPPROTO_IP, libc::IP_RECVTTL, 1)?;
            }
        }
        IpAddr::V6(_) => {
            sys::set_int_option(
                fd,
                libc::IPPROTO_IPV6,
                libc::IPV6_MTU_DISCOVER,
                libc::IPV6_PMTUDISC_PROBE,
            )?;
            if receive {
                sys::set_int_option(fd, libc::IPPROTO_IPV6, libc::IPV6_RECVTCLASS, 1)?;
                sys::set_int_option(fd, libc::IPPROTO_IPV6, libc::IPV6_RECVHOPLIMIT, 1)?;
                sys::set_int_option(fd, libc::IPPROTO_IPV6, libc::IPV6_FLOWINFO, 1)?;
                // RoCEv2 peers (rxe) may send a zero UDP checksum.
                sys::set_int_option(fd, libc::SOL_UDP, libc::UDP_NO_CHECK6_RX, 1)?;
            }
        }
    }
    if receive {
        // Room for bursts: 4 MiB if privileged (SO_*BUFFORCE), else what
        // net.core.[rw]mem_max allows.
        for (force, plain) in [
            (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
            (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
        ] {
            if sys::set_int_option(fd, libc::SOL_SOCKET, force, 4 << 20).is_err() {
                sys::set_int_option(fd, libc::SOL_SOCKET, plain, 4 << 20)?;
            }
        }
    } else {
        // Nothing is meant to arrive on a source port.
        sys::set_int_option(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, 0)?;
        if sys::set_int_option(fd, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, 4 << 20).is_err() {
            sys::set_int_option(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, 4 << 20)?;
        }
    }
    Ok(())
}
