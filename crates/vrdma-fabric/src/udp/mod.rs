//! RoCEv2 over UDP: an [`Engine`] behind real sockets.
//!
//! A [`UdpDevice`] is bound to one IPv4 or IPv6 address on UDP port 4791;
//! its GID table holds that address (IPv4-mapped for IPv4), so a peer that
//! knows the address knows the GID. Several devices can share a host on
//! different addresses (127.0.0.x in the tests).
//!
//! **Receive.** `recvmmsg` takes up to a batch of datagrams per call with
//! their TOS / traffic class and TTL / hop limit. A socket does not show
//! the IPv4 Identification the ICRC covers, so the ICRC check recovers it
//! ([`frame::unframe_datagram`]); the packets then go to the engine.
//! Anything that is not a well-formed RoCEv2 packet with a good ICRC is
//! counted ([`UdpStats`]) and dropped; what is wrong inside a good packet
//! (unknown QPN, bad key, out-of-window PSN…) the engine counts and, where
//! IBTA says so, NAKs.
//!
//! **Send.** Each packet leaves from a socket bound to the QP's UDP source
//! port (`0xC000 | QPN`, as the engine chooses it: ECMP entropy per QP),
//! created on first use; the ICRC is computed for the headers the kernel
//! writes (an unconnected socket with DF set writes IPv4 Identification
//! 0). Consecutive packets from one socket go out in one `sendmmsg`, runs
//! of equal packets to one peer as GSO datagrams. The socket carries the
//! QP's traffic class (or the device's DSCP/ECN when the QP sets none) and
//! hop limit as options; a packet with others carries them as ancillary
//! data. A SEND's, WRITE's or READ response's payload is not copied: the
//! engine lends it ([`Engine::poll_transmit_gather`]) and `sendmmsg`
//! gathers it from the memory, between the headers and the ICRC.
//!
//! **Time.** The engine's clock is nanoseconds since the device was
//! created; [`UdpDevice::progress`] runs due timers, and
//! [`UdpDevice::wait`] sleeps in `poll(2)` until a datagram arrives or the
//! engine's next deadline. A caller that never waits busy-polls.

mod sys;

use std::{
    collections::HashMap,
    io,
    net::{IpAddr, SocketAddr, UdpSocket},
    os::fd::{AsRawFd, RawFd},
    time::{Duration, Instant},
};

use vrdma_engine::{
    Engine, Memory,
    attr::{DeviceAttr, Mtu, PortAttr},
    transmit::{MAX_PACKET, PayloadRef, Transmit},
};
use vrdma_wire::{Error as WireError, Gid, ROCEV2_UDP_PORT, frame};

/// How a [`UdpDevice`] is set up.
#[derive(Clone, Debug)]
pub struct Config {
    /// The address to bind; the device's GID is derived from it.
    pub addr: IpAddr,
    /// The UDP port to receive on: 4791 (IANA's RoCEv2 port) unless a test
    /// says otherwise.
    pub port: u16,
    /// DSCP (6 bits) and ECN (2 bits) for packets of QPs whose traffic
    /// class is 0.
    pub tos: u8,
    /// The port's active MTU (what QPs may use as path MTU). `None`:
    /// derived from the MTU of the interface holding `addr`, as rxe
    /// derives it from its netdev ([`active_mtu`]).
    pub mtu: Option<Mtu>,
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
    /// Port 4791, TOS 0, the interface's MTU, batches of 32.
    pub fn new(addr: IpAddr) -> Self {
        Config {
            addr,
            port: ROCEV2_UDP_PORT,
            tos: 0,
            mtu: None,
            batch: 32,
            gso: true,
        }
    }
}

/// What the fabric saw, beside the engine's own counters
/// ([`Engine::stats`]).
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
    /// Datagrams the kernel refused (no route, too long): dropped.
    pub tx_failed: u64,
    /// Packets sent from the receive socket because the QP's source port
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

/// What one [`UdpDevice::progress`] did.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct Progress {
    pub received: usize,
    pub sent: usize,
}

impl Progress {
    pub fn is_idle(&self) -> bool {
        self.received == 0 && self.sent == 0
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

/// A round that received this many bytes sends its answers at once
/// instead of in the next round: a stream's ACKs, which the sender's
/// window waits for, are not held behind the receiver's next turn.
const SEND_NOW_BYTES: u64 = 16 << 10;

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

/// A RoCEv2 device on a UDP socket: the engine, the memory it serves, and
/// the sockets.
#[derive(Debug)]
pub struct UdpDevice<M: Memory> {
    engine: Engine,
    mem: M,
    config: Config,
    gid: Gid,
    socket: UdpSocket,
    /// Sockets bound to QP source ports, by port (`None`: binding failed,
    /// the receive socket sends instead).
    sources: HashMap<u16, Option<Source>>,
    last_source: Option<LastSource>,
    epoch: Instant,
    /// [`UdpDevice::clock`].
    clock: u64,
    recv: sys::RecvBatch,
    send: sys::SendBatch,
    /// The socket the queued datagrams leave from.
    send_fd: RawFd,
    stats: UdpStats,
}

impl<M: Memory> UdpDevice<M> {
    /// Binds `config.addr:config.port` and creates an engine with the
    /// default device limits whose GID 0 is the address.
    pub fn bind(config: Config, mem: M) -> io::Result<Self> {
        let gid = match config.addr {
            IpAddr::V4(a) => Gid::from(a),
            IpAddr::V6(a) => Gid::from(a),
        };
        let mut attr = DeviceAttr::default();
        // A GUID per address, so that devices on one host differ (rxe
        // derives it from the MAC address).
        let guid = match config.addr {
            IpAddr::V4(a) => 0x0200_0000_0000_0000 | u64::from(u32::from(a)),
            IpAddr::V6(a) => 0x0200_0000_0000_0000 | (u128::from(a) as u64 & 0x00ff_ffff_ffff_ffff),
        };
        attr.node_guid = guid;
        attr.sys_image_guid = guid;
        let mut port = PortAttr::with_gids(&[gid]);
        port.active_mtu = config.mtu.unwrap_or_else(|| {
            // Any 127.x address lives on the loopback device, though only
            // 127.0.0.1 is listed on it.
            let name = sys::interface_of(config.addr)
                .or_else(|| config.addr.is_loopback().then(|| "lo".to_owned()));
            let netdev = name.and_then(|name| {
                let mtu = std::fs::read_to_string(format!("/sys/class/net/{name}/mtu")).ok()?;
                mtu.trim().parse().ok()
            });
            // Unknown: what rxe reports on a 1500-byte Ethernet.
            active_mtu(netdev.unwrap_or(1500))
        });
        let engine = Engine::new(attr, port);
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
        Ok(UdpDevice {
            engine,
            mem,
            gid,
            socket,
            sources: HashMap::new(),
            last_source: None,
            epoch: Instant::now(),
            clock: 0,
            recv: sys::RecvBatch::new(config.batch, slot),
            send: sys::SendBatch::new(),
            send_fd,
            stats: UdpStats::default(),
            config,
        })
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

    /// The port's active MTU.
    pub fn active_mtu(&self) -> Mtu {
        self.engine
            .query_port(1)
            .map_or(Mtu::Mtu256, |p| p.active_mtu)
    }

    /// GID 0: the bound address.
    pub fn gid(&self) -> Gid {
        self.gid
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.socket.local_addr()
    }

    pub fn stats(&self) -> UdpStats {
        self.stats
    }

    /// The engine's clock: nanoseconds since the device was bound.
    pub fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The engine's clock as the last [`UdpDevice::progress`] read it (a
    /// caller that polls often can pace itself without reading the clock
    /// again).
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// One round without blocking: sends everything the engine has (what
    /// the application posted since the last round, and the answers to
    /// what arrived in it), receives what is queued (a few batches at
    /// most, so that sending is never starved) and runs due timers.
    ///
    /// Answers to what arrives wait for the next round, after the
    /// application had its turn: a peer that replies to a message (a
    /// ping-pong, a write_lat) then sends the ACK and its reply in one
    /// system call, its reply not behind a call of its own. A caller that
    /// polls keeps the delay to one turn of its loop; [`UdpDevice::wait`]
    /// sends before it sleeps.
    ///
    /// The round reads the clock once: what arrives in it is stamped, and
    /// the timers run, at its start ([`UdpDevice::clock`]).
    pub fn progress(&mut self) -> io::Result<Progress> {
        let now = self.now();
        self.clock = now;
        let mut p = Progress {
            sent: self.transmit(now),
            ..Progress::default()
        };
        let before = self.stats.rx_bytes;
        for _ in 0..4 {
            let n = self.receive_batch(now)?;
            p.received += n;
            if n < self.config.batch {
                break;
            }
        }
        if self.stats.rx_bytes - before >= SEND_NOW_BYTES {
            p.sent += self.transmit(now);
        }
        if self.engine.poll_timeout().is_some_and(|t| t <= now) {
            self.engine.handle_timeout(now);
        }
        Ok(p)
    }

    /// Sends what the engine has now (answers included, which
    /// [`UdpDevice::progress`] otherwise sends in its next round); the
    /// number of packets sent.
    pub fn send_pending(&mut self) -> usize {
        let now = self.now();
        self.transmit(now)
    }

    /// Sends what the engine has; if there was nothing, sleeps until a
    /// datagram arrives, the engine's next deadline, or `limit`, whichever
    /// is first (event mode; busy-polling callers never call it).
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
        sys::wait_readable(self.socket.as_raw_fd(), ms)?;
        Ok(())
    }

    fn receive_batch(&mut self, now: u64) -> io::Result<usize> {
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
                    Ok(u) => self.engine.handle_packet(now, &u.ip, u.roce, &mut self.mem),
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

    /// Sends every packet the engine has; the number sent. The engine
    /// writes each packet straight into the send batch.
    fn transmit(&mut self, now: u64) -> usize {
        let mut sent = 0;
        loop {
            if self.send.is_full(MAX_PACKET) {
                sent += self.flush(0);
            }
            let slot = self.send.slot(MAX_PACKET);
            let Some(t) = self.engine.poll_transmit_gather(now, &self.mem, slot) else {
                break;
            };
            // A lent payload is not in the slot: the bytes after it (pad,
            // ICRC) move up to the headers, and the slot holds `stored`.
            let stored = t.len - t.referenced;
            if t.referenced > 0 {
                slot.copy_within(t.payload_at + t.referenced..t.len, t.payload_at);
            }
            let addr = match t.dgid.to_ipv4() {
                Some(v4) => SocketAddr::new(IpAddr::V4(v4), ROCEV2_UDP_PORT),
                None => SocketAddr::new(IpAddr::V6(t.dgid.into()), ROCEV2_UDP_PORT),
            };
            let traffic_class = if t.traffic_class == 0 {
                self.config.tos
            } else {
                t.traffic_class
            };
            let mut dest = sys::Dest {
                addr,
                traffic_class,
                hop_limit: t.hop_limit,
                preset: false,
            };
            let (fd, port) = self.source_socket(t.udp_src_port, &mut dest, stored, &mut sent);
            if fd != self.send_fd {
                // The batch leaves from one socket: send what it holds,
                // this packet moving to the front of the next.
                sent += self.flush(stored);
                self.send_fd = fd;
            }
            let gso = self.config.gso;
            let lent = self.engine.gathered();
            let pieces = if t.referenced == 0 { 1 } else { 2 + lent.len() };
            let index = self.send.next_index(&dest, t.len, pieces, gso);
            let roce = &mut self.send.slot(MAX_PACKET)[..stored];
            // At most MAX_SEGMENTS (64) segments: the index fits a u16.
            let sealed = if t.referenced == 0 {
                t.seal_for_socket_segment(roce, port, index as u16)
            } else {
                let (head, tail) = roce.split_at_mut(t.payload_at);
                seal_lent(&t, head, lent, tail, &self.mem, port, index as u16)
            };
            if let Err(e) = sealed {
                // The engine wrote the packet and checked what it lent.
                tracing::error!(error = %e, "cannot seal an engine packet");
                self.stats.tx_failed += 1;
                continue;
            }
            if t.referenced == 0 {
                self.send.commit(&dest, stored, gso);
            } else {
                let tail = stored - t.payload_at;
                self.send.commit_parts(&dest, t.payload_at, lent, tail, gso);
            }
        }
        sent + self.flush(0)
    }

    /// Sends the batch, keeping `tail` uncommitted bytes (see
    /// [`sys::SendBatch::flush`]).
    fn flush(&mut self, tail: usize) -> usize {
        if self.send.len() == 0 {
            // Nothing committed: a tail already starts the slot.
            return 0;
        }
        let f = self.send.flush(self.send_fd, tail, &self.mem);
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
                tracing::warn!(port, error = %e, "cannot bind a QP source port; using the receive socket");
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
            *sent += self.flush(tail);
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

/// Seals a packet whose payload the engine lent: `head` and `tail` are
/// its bytes around the payload, `lent` the payload's pieces in `mem`.
fn seal_lent(
    t: &Transmit,
    head: &[u8],
    lent: &[PayloadRef],
    tail: &mut [u8],
    mem: &impl Memory,
    port: u16,
    index: u16,
) -> Result<(), WireError> {
    const ON_STACK: usize = 4;
    let missing = || WireError::OutOfRange {
        what: "a lent payload address",
        value: lent.first().map_or(0, |r| r.addr),
    };
    // A payload is one piece (or a few, across pages): no allocation then.
    let mut few: [&[u8]; ON_STACK] = [&[]; ON_STACK];
    let many: Vec<&[u8]>;
    let payload: &[&[u8]] = if lent.len() <= ON_STACK {
        for (slot, r) in few.iter_mut().zip(lent) {
            *slot = mem.slice(r.addr, r.len).ok_or_else(missing)?;
        }
        &few[..lent.len()]
    } else {
        many = lent
            .iter()
            .map(|r| mem.slice(r.addr, r.len).ok_or_else(missing))
            .collect::<Result<_, _>>()?;
        &many
    };
    t.seal_parts(head, payload, tail, port, index)
}

impl<M: Memory> Drop for UdpDevice<M> {
    /// Sends what is queued: the answers to the last packets received
    /// wait for a next round that a closing device does not have (a
    /// peer's last message would go unacknowledged, and its sender retry
    /// into the void).
    fn drop(&mut self) {
        self.send_pending();
    }
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
