//! A raw-UDP baseline: the best plain UDP this machine does on loopback,
//! for the benchmark to put beside vrdma's numbers.
//!
//! Every function runs two threads, a sender and a receiver, on two
//! loopback addresses (127.0.0.51 and 127.0.0.52, say). Nothing waits
//! without a bound: a stream's receiver reads with a short timeout and
//! stops once it has every byte, or 200 ms after the sender finished with
//! nothing arriving; a ping-pong gives each round trip one second.
//!
//! Each datagram of a stream ends in a 4-byte trailer, the little-endian
//! CRC-32 of the bytes before it, which the sender precomputes once in its
//! source buffer and the receiver checks for every datagram it gets, as a
//! RoCE receiver checks each packet's ICRC. A datagram shorter than 4 bytes
//! carries no trailer.
//!
//! UDP has no flow control, and a sender that outruns its receiver only
//! fills the receive buffer and has the kernel drop the rest (flooding 1 GiB
//! of GSO on loopback here lost from 3% to half of it). The stream
//! therefore paces its sender with a credit window, the cheapest one
//! possible: the receiver publishes the bytes it has taken in an atomic
//! counter (no packets, no syscalls), and the sender keeps at most a
//! quarter of the granted `SO_RCVBUF` in flight (a 4 KiB datagram costs
//! about twice its size there; the other half is margin). So the stream
//! measures what the pair sustains without loss, as RDMA's RC transport
//! must, at no cost for the acks that real flow control would send. A
//! datagram lost anyway is reported, not resent: the sender writes off
//! what is in flight after 200 ms without progress and carries on (long
//! enough for a receiver descheduled on a busy host to come back).

use std::{
    hint::black_box,
    io::{ErrorKind, IoSliceMut},
    net::{IpAddr, SocketAddr, UdpSocket},
    os::fd::AsRawFd,
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use nix::{
    errno::Errno,
    sys::socket::{ControlMessageOwned, MsgFlags, getsockopt, recvmsg, setsockopt, sockopt},
};

/// The sender's source and the receiver's destination buffers.
const WINDOW: usize = 1 << 20;
/// The largest UDP payload in one IPv4 datagram; a GSO send may not exceed it.
const MAX_UDP_PAYLOAD: usize = 65_507;
/// The most segments one GSO send may carry (the kernel's `UDP_MAX_SEGMENTS`).
const MAX_GSO_SEGMENTS: usize = 64;
/// Room given to each receive: a GRO batch or any single datagram fits.
const RECV_ROOM: usize = 1 << 16;
/// `SO_RCVBUF` and `SO_SNDBUF` asked for; the kernel caps them at
/// `net.core.rmem_max` and `wmem_max`.
const SOCKET_BUFFER: usize = 8 << 20;
/// How long one receive waits before the receiver checks on the sender.
const RECV_POLL: Duration = Duration::from_millis(20);
/// How long the receiver keeps listening after the sender finished.
const DRAIN_IDLE: Duration = Duration::from_millis(200);
/// A receiver that hears nothing for this long gives up, sender or not.
const STALL: Duration = Duration::from_secs(10);
/// A sender short of credit for this long writes off what is in flight
/// as lost.
const CREDIT_WAIT: Duration = Duration::from_millis(200);
/// The longest one ping-pong round trip may take.
const ROUND_TRIP_LIMIT: Duration = Duration::from_secs(1);
/// The trailer: the CRC-32 of the datagram's other bytes.
const TRAILER: usize = 4;

/// Pins the calling thread to CPU `cpu` when the machine has it (best
/// effort: a benchmark's two sides each on a core of their own, so that
/// the scheduler does not move them onto one; vrdma's sides get the same).
pub fn pin(cpu: usize) {
    use nix::sched::{CpuSet, sched_setaffinity};
    let mut set = CpuSet::new();
    if set.set(cpu).is_ok() {
        // Refused (no such CPU, a restricted cpuset): run unpinned.
        let _ = sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
    }
}

/// Lets the calling thread run on every CPU again (the kernel keeps those
/// that exist and are allowed).
pub fn unpin() {
    use nix::sched::{CpuSet, sched_setaffinity};
    let mut set = CpuSet::new();
    for cpu in 0..CpuSet::count() {
        let _ = set.set(cpu);
    }
    let _ = sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
}

/// One bandwidth measurement, taken on the receiver.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Throughput {
    /// Payload bytes received.
    pub bytes: u64,
    /// From the first receive's return to the last one's.
    pub seconds: f64,
    /// Datagrams received (a GRO batch counts each of its segments).
    pub datagrams: u64,
    /// `send`/`sendmsg` calls the sender made.
    pub send_calls: u64,
    /// Receive calls that returned data.
    pub recv_calls: u64,
}

impl Throughput {
    /// Received bytes per second; 0 when fewer than two receives returned
    /// data (no interval to divide by).
    pub fn bytes_per_sec(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// How the raw stream sends and receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// UDP GSO on the sender (`UDP_SEGMENT`: one `send` carries up to
    /// 64 KiB of whole segments) and UDP GRO on the receiver (one
    /// `recvmsg` returns a batch and its segment size).
    Gso,
    /// One `send` and one `recv` per datagram.
    OneDatagramPerSyscall,
}

/// Streams `total` bytes as `segment`-byte UDP datagrams (the last one
/// shorter if `segment` does not divide `total`) from `src` to `dst:port`,
/// and measures on the receiver what arrived and how fast.
///
/// Both sockets ask for 8 MiB `SO_RCVBUF`/`SO_SNDBUF` and take what the
/// kernel grants. The sender is connected to the receiver, so its sends
/// skip the per-call address lookup, and it sends from a 1 MiB buffer of
/// whole datagrams, wrapping to its start. In [`Mode::Gso`] it sets
/// `UDP_SEGMENT` to `segment` and sends as many whole segments per call
/// as fit in 65,507 bytes (15 of 4096), at most 64; the receiver enables
/// `UDP_GRO` and `recvmsg`s up to 64 KiB at a time straight into a 1 MiB
/// destination window (wrapping), splits what arrived by the segment size
/// in the `UDP_GRO` control message and checks each segment's CRC
/// trailer. In [`Mode::OneDatagramPerSyscall`] each datagram is one `send`
/// and one `recv`, with the same check.
///
/// The sender keeps at most a quarter of the receiver's `SO_RCVBUF` (as
/// granted) in flight, counting what the receiver reported taking through
/// a shared atomic counter (see the module's doc); a datagram lost anyway
/// is missing from `bytes` and `datagrams`, not resent.
///
/// # Errors
///
/// A bad `segment` (below 4 or above 65,507) or mixed address families,
/// a socket that cannot be bound or set up (no GSO or GRO support), a
/// failed send or receive, a datagram whose CRC does not match, or no data
/// for 10 s.
pub fn stream(
    mode: Mode,
    src: IpAddr,
    dst: IpAddr,
    port: u16,
    total: u64,
    segment: usize,
) -> Result<Throughput> {
    ensure!(
        (TRAILER..=MAX_UDP_PAYLOAD).contains(&segment),
        "segment must be {TRAILER}..={MAX_UDP_PAYLOAD} bytes, not {segment}"
    );
    ensure!(
        src.is_ipv4() == dst.is_ipv4(),
        "{src} and {dst} are of different address families"
    );
    let receiver = bind(SocketAddr::new(dst, port))?;
    let sender = bind(SocketAddr::new(src, 0))?;
    for sock in [&receiver, &sender] {
        enlarge_buffers(sock)?;
    }
    let to = receiver.local_addr().context("receiver's address")?;
    sender
        .connect(to)
        .with_context(|| format!("connect the sender to {to}"))?;
    receiver
        .set_read_timeout(Some(RECV_POLL))
        .context("set the receiver's read timeout")?;
    if mode == Mode::Gso {
        let size = i32::try_from(segment).context("segment size")?;
        setsockopt(&sender, sockopt::UdpGsoSegment, &size)
            .context("enable UDP GSO (UDP_SEGMENT) on the sender")?;
        setsockopt(&receiver, sockopt::UdpGroSegment, &true)
            .context("enable UDP GRO on the receiver")?;
    }

    let granted = getsockopt(&receiver, sockopt::RcvBuf).context("read SO_RCVBUF back")?;
    let per_call = match mode {
        Mode::Gso => (MAX_UDP_PAYLOAD / segment).clamp(1, MAX_GSO_SEGMENTS),
        Mode::OneDatagramPerSyscall => 1,
    };
    let window = (granted / 4).max(per_call * segment) as u64;

    let sender_done = AtomicBool::new(false);
    let receiver_done = AtomicBool::new(false);
    let taken = AtomicU64::new(0);
    thread::scope(|s| {
        let rx = thread::Builder::new()
            .name("rawudp-rx".into())
            .spawn_scoped(s, || {
                let _done = SetOnDrop(&receiver_done);
                pin(1);
                receive_stream(mode, &receiver, total, &sender_done, &taken)
            })
            .context("spawn the receiver thread")?;
        let tx = thread::Builder::new()
            .name("rawudp-tx".into())
            .spawn_scoped(s, || {
                let _done = SetOnDrop(&sender_done);
                pin(0);
                let credit = Credit {
                    window,
                    taken: &taken,
                    receiver_done: &receiver_done,
                };
                send_stream(&sender, total, segment, per_call, &credit)
            });
        let tx = match tx {
            Ok(tx) => tx,
            Err(e) => {
                sender_done.store(true, Ordering::Release);
                return Err(e).context("spawn the sender thread");
            }
        };
        let sent = tx
            .join()
            .map_err(|_| anyhow!("the sender thread panicked"))?;
        let received = rx
            .join()
            .map_err(|_| anyhow!("the receiver thread panicked"))?;
        let send_calls = sent.context("raw UDP sender")?;
        let mut throughput = received.context("raw UDP receiver")?;
        throughput.send_calls = send_calls;
        Ok(throughput)
    })
}

/// Raw-UDP ping-pong of `size`-byte datagrams between `src` and
/// `dst:port`, both sides busy-polling non-blocking sockets (as an RDMA
/// application busy-polls its CQ): `warmup` round trips, then `iters`
/// measured ones. Returns one sample per measured round trip, half its
/// time in nanoseconds as seen by the initiator (from before its send to
/// after its receive), in the order taken.
///
/// The first 4 bytes of each message (fewer if `size` is smaller) carry
/// the round trip's number, and the reply must echo it.
///
/// # Errors
///
/// A `size` of 0 or above 65,507, mixed address families, a socket that
/// cannot be set up, a failed send or receive, a wrong reply, or a round
/// trip that took over a second (naming it: a lost datagram is not
/// resent).
pub fn pingpong(
    src: IpAddr,
    dst: IpAddr,
    port: u16,
    size: usize,
    warmup: u32,
    iters: u32,
) -> Result<Vec<f64>> {
    ensure!(
        (1..=MAX_UDP_PAYLOAD).contains(&size),
        "size must be 1..={MAX_UDP_PAYLOAD} bytes, not {size}"
    );
    ensure!(
        src.is_ipv4() == dst.is_ipv4(),
        "{src} and {dst} are of different address families"
    );
    let responder = bind(SocketAddr::new(dst, port))?;
    let initiator = bind(SocketAddr::new(src, 0))?;
    let responder_addr = responder.local_addr().context("responder's address")?;
    let initiator_addr = initiator.local_addr().context("initiator's address")?;
    initiator
        .connect(responder_addr)
        .with_context(|| format!("connect the initiator to {responder_addr}"))?;
    responder
        .connect(initiator_addr)
        .with_context(|| format!("connect the responder to {initiator_addr}"))?;
    for sock in [&initiator, &responder] {
        sock.set_nonblocking(true)
            .context("make the ping-pong socket non-blocking")?;
    }
    let rounds = u64::from(warmup) + u64::from(iters);

    let stop = AtomicBool::new(false);
    thread::scope(|s| {
        let echo = thread::Builder::new()
            .name("rawudp-pong".into())
            .spawn_scoped(s, || {
                let _stop = SetOnDrop(&stop);
                pin(1);
                echo(&responder, rounds, &stop)
            })
            .context("spawn the responder thread")?;
        let ping = thread::Builder::new()
            .name("rawudp-ping".into())
            .spawn_scoped(s, || {
                let _stop = SetOnDrop(&stop);
                pin(0);
                ping(&initiator, size, warmup, iters, &stop)
            });
        let ping = match ping {
            Ok(ping) => ping,
            Err(e) => {
                stop.store(true, Ordering::Release);
                return Err(e).context("spawn the initiator thread");
            }
        };
        let samples = ping
            .join()
            .map_err(|_| anyhow!("the initiator thread panicked"))?;
        let echoed = echo
            .join()
            .map_err(|_| anyhow!("the responder thread panicked"))?;
        // The responder's failure explains the initiator's, not the reverse.
        echoed.context("raw UDP ping-pong responder")?;
        samples.context("raw UDP ping-pong initiator")
    })
}

/// memcpy bandwidth: copies a `len`-byte buffer into another and back,
/// `rounds` copies in all, and returns bytes copied per second (0 if the
/// clock saw no time pass).
pub fn memcpy(len: usize, rounds: u32) -> f64 {
    let mut a = vec![0x5a_u8; len];
    let mut b = vec![0xa5_u8; len];
    // Fault both buffers in before the clock starts.
    b.copy_from_slice(&a);
    let start = Instant::now();
    for round in 0..rounds {
        if round % 2 == 0 {
            b.copy_from_slice(black_box(&a));
        } else {
            a.copy_from_slice(black_box(&b));
        }
        black_box((&mut a, &mut b));
    }
    let seconds = start.elapsed().as_secs_f64();
    if seconds > 0.0 {
        len as f64 * f64::from(rounds) / seconds
    } else {
        0.0
    }
}

/// memcpy bandwidth over memory larger than the caches: `count` copies of
/// `block` bytes, going round a source and a destination of `span` bytes
/// each a block at a time (as the same-host benchmark's WRITEs go round
/// their memory); bytes copied per second.
pub fn memcpy_span(block: usize, span: usize, count: u64) -> f64 {
    let span = span.max(block);
    let src = vec![0x5a_u8; span];
    let mut dst = vec![0xa5_u8; span];
    dst.copy_from_slice(&src);
    let slots = (span / block) as u64;
    let start = Instant::now();
    for i in 0..count {
        let at = ((i % slots) as usize) * block;
        dst[at..at + block].copy_from_slice(black_box(&src[at..at + block]));
        black_box(&mut dst);
    }
    let seconds = start.elapsed().as_secs_f64();
    if seconds > 0.0 {
        (block as u64 * count) as f64 / seconds
    } else {
        0.0
    }
}

/// The round trip of one cache line between CPUs 0 and 1, in nanoseconds
/// (the median of `rounds` rounds of `count` hand-overs each): what a
/// same-host message costs at least, since its bytes, its queue's entry
/// and its ACK cross between the cores the same way. On a virtual machine
/// it moves with where the host places the vCPUs (on this 2-vCPU guest a
/// C loop of the same kind measured 80–110 ns most of the time and
/// 380–430 in spells, when the 64 B SEND rate over shm fell from 7.0 to
/// 3.5 M/s), so the same-host table prints it beside the rates.
pub fn core_to_core(count: u64, rounds: usize) -> f64 {
    let flag = AtomicU64::new(0);
    let mut runs = Vec::with_capacity(rounds);
    thread::scope(|s| {
        let flag = &flag;
        s.spawn(move || {
            pin(1);
            // Answers each odd value with the next even one.
            for i in 0..count * rounds as u64 {
                while flag.load(Ordering::Acquire) != 2 * i + 1 {
                    std::hint::spin_loop();
                }
                flag.store(2 * i + 2, Ordering::Release);
            }
        });
        pin(0);
        for r in 0..rounds as u64 {
            let start = Instant::now();
            for i in r * count..(r + 1) * count {
                flag.store(2 * i + 1, Ordering::Release);
                while flag.load(Ordering::Acquire) != 2 * i + 2 {
                    std::hint::spin_loop();
                }
            }
            runs.push(start.elapsed().as_nanos() as f64 / count as f64);
        }
        unpin();
    });
    runs.sort_by(f64::total_cmp);
    runs[runs.len() / 2]
}

/// Sets the flag when dropped, so that a thread's partner learns it ended
/// however it ended.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

fn bind(addr: SocketAddr) -> Result<UdpSocket> {
    UdpSocket::bind(addr).with_context(|| format!("bind a UDP socket to {addr}"))
}

fn enlarge_buffers(sock: &UdpSocket) -> Result<()> {
    setsockopt(sock, sockopt::RcvBuf, &SOCKET_BUFFER).context("set SO_RCVBUF")?;
    setsockopt(sock, sockopt::SndBuf, &SOCKET_BUFFER).context("set SO_SNDBUF")?;
    Ok(())
}

/// Writes a datagram's CRC trailer over its last 4 bytes.
fn seal(datagram: &mut [u8]) {
    if let Some((body, trailer)) = datagram.split_last_chunk_mut::<TRAILER>() {
        *trailer = crc32fast::hash(body).to_le_bytes();
    }
}

/// Whether a datagram's trailer matches its bytes.
fn intact(datagram: &[u8]) -> bool {
    match datagram.split_last_chunk::<TRAILER>() {
        Some((body, trailer)) => crc32fast::hash(body) == u32::from_le_bytes(*trailer),
        None => true,
    }
}

/// `len` bytes of the stream's pattern.
fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

/// The sender's credit window.
struct Credit<'a> {
    /// The most bytes the sender may have sent and the receiver not taken.
    window: u64,
    /// The bytes the receiver took so far.
    taken: &'a AtomicU64,
    /// Set when the receiver stops.
    receiver_done: &'a AtomicBool,
}

impl Credit<'_> {
    /// Waits until `len` more bytes fit in the window, given `sent` bytes
    /// sent so far of which `written_off` were given up as lost. Returns
    /// the new `written_off`.
    fn wait(&self, sent: u64, len: u64, written_off: u64) -> Result<u64> {
        let mut spins = 0_u32;
        let mut since: Option<(Instant, u64)> = None;
        loop {
            let taken = self.taken.load(Ordering::Acquire);
            let in_flight = sent.saturating_sub(written_off).saturating_sub(taken);
            if in_flight + len <= self.window {
                return Ok(written_off);
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) {
                ensure!(
                    !self.receiver_done.load(Ordering::Acquire),
                    "the receiver stopped after taking {taken} of the {sent} bytes sent"
                );
                let now = Instant::now();
                match since {
                    Some((start, at)) if at == taken => {
                        if now.duration_since(start) >= CREDIT_WAIT {
                            // Lost: what is in flight will never be taken.
                            return Ok(written_off + in_flight);
                        }
                    }
                    _ => since = Some((now, taken)),
                }
            }
            std::hint::spin_loop();
        }
    }
}

/// Sends the stream, `per_call` segments per send; returns the number of
/// send calls.
fn send_stream(
    sock: &UdpSocket,
    total: u64,
    segment: usize,
    per_call: usize,
    credit: &Credit<'_>,
) -> Result<u64> {
    // The source: whole sealed datagrams, about 1 MiB of them.
    let mut source = pattern(WINDOW / segment * segment);
    source.chunks_exact_mut(segment).for_each(seal);
    let segment64 = segment as u64;
    let (mut sent, mut written_off) = (0_u64, 0_u64);
    let mut full = total / segment64;
    let tail = usize::try_from(total % segment64).context("tail length")?;

    let mut calls = 0_u64;
    let mut offset = 0;
    while full > 0 {
        let count = usize::try_from(full.min(per_call as u64)).context("segment count")?;
        let len = count * segment;
        if offset + len > source.len() {
            offset = 0;
        }
        written_off = credit.wait(sent, len as u64, written_off)?;
        send_all(sock, &source[offset..offset + len])?;
        sent += len as u64;
        calls += 1;
        offset += len;
        full -= count as u64;
    }
    if tail > 0 {
        let mut last = pattern(tail);
        seal(&mut last);
        credit.wait(sent, tail as u64, written_off)?;
        send_all(sock, &last)?;
        calls += 1;
    }
    Ok(calls)
}

/// One send of `bytes`, which the kernel must take whole.
fn send_all(sock: &UdpSocket, bytes: &[u8]) -> Result<()> {
    loop {
        match sock.send(bytes) {
            Ok(n) if n == bytes.len() => return Ok(()),
            Ok(n) => bail!("sent {n} of {} bytes", bytes.len()),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e).with_context(|| format!("send {} bytes", bytes.len())),
        }
    }
}

/// Receives the stream until it has `total` bytes, or the sender finished
/// and nothing arrived for [`DRAIN_IDLE`].
fn receive_stream(
    mode: Mode,
    sock: &UdpSocket,
    total: u64,
    sender_done: &AtomicBool,
    taken: &AtomicU64,
) -> Result<Throughput> {
    let mut dest = vec![0_u8; WINDOW];
    let mut cmsg = nix::cmsg_space!(i32);
    let mut offset = 0;
    let (mut bytes, mut datagrams, mut calls, mut corrupt) = (0_u64, 0_u64, 0_u64, 0_u64);
    let (mut first, mut last) = (None, Instant::now());
    let mut done_seen: Option<Instant> = None;

    while bytes < total {
        if dest.len() - offset < RECV_ROOM {
            offset = 0;
        }
        let room = &mut dest[offset..offset + RECV_ROOM];
        let got = match mode {
            Mode::Gso => recv_gro(sock, room, &mut cmsg)?,
            Mode::OneDatagramPerSyscall => recv_one(sock, room)?,
        };
        let now = Instant::now();
        let Some((len, segment)) = got else {
            if sender_done.load(Ordering::Acquire) {
                let since = *done_seen.get_or_insert(now);
                if now.duration_since(since.max(last)) >= DRAIN_IDLE {
                    break;
                }
            } else if now.duration_since(last) >= STALL {
                bail!(
                    "no datagram for {} s after {bytes} of {total} bytes",
                    STALL.as_secs()
                );
            }
            continue;
        };
        first.get_or_insert(now);
        last = now;
        calls += 1;
        bytes += len as u64;
        // A datagram cannot be empty here (the sender sends none); guard
        // `chunks` against a zero segment size anyway.
        for datagram in dest[offset..offset + len].chunks(segment.max(1)) {
            datagrams += 1;
            if !intact(datagram) {
                corrupt += 1;
            }
        }
        offset += len;
        taken.store(bytes, Ordering::Release);
    }
    ensure!(
        corrupt == 0,
        "{corrupt} of {datagrams} datagrams failed their CRC check"
    );
    Ok(Throughput {
        bytes,
        seconds: first.map_or(0.0, |first| last.duration_since(first).as_secs_f64()),
        datagrams,
        send_calls: 0,
        recv_calls: calls,
    })
}

/// One GRO receive into `room`: the bytes and their segment size, or
/// `None` on timeout.
fn recv_gro(sock: &UdpSocket, room: &mut [u8], cmsg: &mut [u8]) -> Result<Option<(usize, usize)>> {
    loop {
        let mut iov = [IoSliceMut::new(room)];
        match recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(cmsg), MsgFlags::empty()) {
            Ok(msg) => {
                ensure!(
                    !msg.flags.contains(MsgFlags::MSG_TRUNC),
                    "a GRO batch did not fit in {RECV_ROOM} bytes"
                );
                let segment = msg
                    .cmsgs()
                    .context("read the UDP_GRO control message")?
                    .find_map(|c| match c {
                        ControlMessageOwned::UdpGroSegments(size) => usize::try_from(size).ok(),
                        _ => None,
                    })
                    // No control message: a single datagram.
                    .unwrap_or(msg.bytes);
                return Ok(Some((msg.bytes, segment)));
            }
            Err(Errno::EAGAIN) => return Ok(None),
            Err(Errno::EINTR) => {}
            Err(e) => return Err(e).context("recvmsg"),
        }
    }
}

/// One plain receive into `room`: the datagram's length (twice, as bytes
/// and as its own segment size), or `None` on timeout.
fn recv_one(sock: &UdpSocket, room: &mut [u8]) -> Result<Option<(usize, usize)>> {
    loop {
        match sock.recv(room) {
            Ok(n) => return Ok(Some((n, n))),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Ok(None);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e).context("recv"),
        }
    }
}

/// The ping-pong initiator: half of each measured round trip, in ns.
fn ping(
    sock: &UdpSocket,
    size: usize,
    warmup: u32,
    iters: u32,
    stop: &AtomicBool,
) -> Result<Vec<f64>> {
    let mut message = pattern(size);
    let mut reply = vec![0_u8; RECV_ROOM];
    let tag = size.min(4);
    let mut samples = Vec::with_capacity(iters as usize);
    for round in 0..warmup.saturating_add(iters) {
        message[..tag].copy_from_slice(&round.to_le_bytes()[..tag]);
        let start = Instant::now();
        send_nonblocking(sock, &message, stop)
            .with_context(|| format!("round trip {round}: send"))?;
        let n = recv_nonblocking(sock, &mut reply, stop, Some(start + ROUND_TRIP_LIMIT))
            .with_context(|| format!("round trip {round}"))?;
        let elapsed = start.elapsed();
        ensure!(
            reply[..n] == message[..],
            "round trip {round}: the reply ({n} bytes) is not the message ({size} bytes) echoed"
        );
        if round >= warmup {
            samples.push(elapsed.as_secs_f64() * 1e9 / 2.0);
        }
    }
    Ok(samples)
}

/// The ping-pong responder: echoes `rounds` messages, or fewer if the
/// initiator stops first.
fn echo(sock: &UdpSocket, rounds: u64, stop: &AtomicBool) -> Result<()> {
    let mut buf = vec![0_u8; RECV_ROOM];
    for round in 0..rounds {
        let n = match recv_nonblocking(sock, &mut buf, stop, None) {
            Ok(n) => n,
            // The initiator stopped: nothing more will come.
            Err(_) if stop.load(Ordering::Acquire) => return Ok(()),
            Err(e) => return Err(e).with_context(|| format!("round trip {round}: receive")),
        };
        send_nonblocking(sock, &buf[..n], stop)
            .with_context(|| format!("round trip {round}: echo"))?;
    }
    Ok(())
}

/// Spins until `sock` takes `bytes` or the partner stops.
fn send_nonblocking(sock: &UdpSocket, bytes: &[u8], stop: &AtomicBool) -> Result<()> {
    loop {
        match sock.send(bytes) {
            Ok(n) if n == bytes.len() => return Ok(()),
            Ok(n) => bail!("sent {n} of {} bytes", bytes.len()),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                if stop.load(Ordering::Acquire) {
                    bail!("the other side stopped");
                }
                std::hint::spin_loop();
            }
            Err(e) => return Err(e).context("send"),
        }
    }
}

/// Spins until a datagram arrives (returning its length), the partner
/// stops, or `deadline` passes.
fn recv_nonblocking(
    sock: &UdpSocket,
    buf: &mut [u8],
    stop: &AtomicBool,
    deadline: Option<Instant>,
) -> Result<usize> {
    let mut spins = 0_u32;
    loop {
        match sock.recv(buf) {
            Ok(n) => return Ok(n),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
            Err(e) => return Err(e).context("recv"),
        }
        spins = spins.wrapping_add(1);
        // Reading the clock and the flag costs more than a failed recv
        // saves; look every 256 spins.
        if spins.is_multiple_of(256) {
            if stop.load(Ordering::Acquire) {
                bail!("the other side stopped");
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                bail!(
                    "no reply within {} s (a lost datagram is not resent)",
                    ROUND_TRIP_LIMIT.as_secs()
                );
            }
        }
        std::hint::spin_loop();
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn lo(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
    }

    const SEGMENT: usize = 4096;

    fn check_stream(t: &Throughput, total: u64) {
        assert!(t.bytes > 0 && t.bytes <= total, "{t:?}");
        assert!(t.datagrams > 0 && t.datagrams <= total.div_ceil(SEGMENT as u64));
        assert!(t.send_calls > 0 && t.recv_calls > 0);
        assert!(t.seconds >= 0.0);
    }

    #[test]
    fn gso_stream_delivers_crc_checked_bytes() {
        let total = 4 << 20;
        let t = stream(Mode::Gso, lo(61), lo(62), 20_001, total, SEGMENT).unwrap();
        check_stream(&t, total);
        // 15 segments per send: 1024 datagrams need 69 sends.
        assert_eq!(t.send_calls, 1024_u64.div_ceil(15));
    }

    #[test]
    fn one_datagram_per_syscall_stream_delivers_crc_checked_bytes() {
        let total = 4 << 20;
        let t = stream(
            Mode::OneDatagramPerSyscall,
            lo(63),
            lo(64),
            20_002,
            total,
            SEGMENT,
        )
        .unwrap();
        check_stream(&t, total);
        assert_eq!(t.send_calls, 1024);
        assert_eq!(t.recv_calls, t.datagrams);
    }

    #[test]
    fn gso_stream_sends_a_short_last_datagram() {
        let total = (1 << 20) + 1000;
        let t = stream(Mode::Gso, lo(65), lo(66), 20_003, total, SEGMENT).unwrap();
        check_stream(&t, total);
        assert_eq!(t.send_calls, 256_u64.div_ceil(15) + 1);
    }

    #[test]
    fn stream_rejects_impossible_segments() {
        for segment in [0, 3, MAX_UDP_PAYLOAD + 1] {
            assert!(stream(Mode::Gso, lo(67), lo(68), 20_004, 1 << 20, segment).is_err());
        }
    }

    #[test]
    fn crc_trailer_detects_a_flipped_bit() {
        let mut datagram = pattern(SEGMENT);
        seal(&mut datagram);
        assert!(intact(&datagram));
        datagram[100] ^= 1;
        assert!(!intact(&datagram));
        // Too short to carry a trailer: nothing to check.
        assert!(intact(&[1, 2, 3]));
    }

    #[test]
    fn pingpong_returns_one_positive_sample_per_iteration() {
        let samples = pingpong(lo(69), lo(70), 20_005, 64, 10, 100).unwrap();
        assert_eq!(samples.len(), 100);
        assert!(samples.iter().all(|&ns| ns > 0.0));
    }

    #[test]
    fn credit_writes_off_what_is_in_flight_when_nothing_is_taken() {
        let (taken, receiver_done) = (AtomicU64::new(1000), AtomicBool::new(false));
        let credit = Credit {
            window: 4000,
            taken: &taken,
            receiver_done: &receiver_done,
        };
        // 3000 in flight and 1000 more fit.
        assert_eq!(credit.wait(4000, 1000, 0).unwrap(), 0);
        // 3000 in flight and 2000 more do not: after 200 ms the 3000 are lost.
        let start = Instant::now();
        assert_eq!(credit.wait(4000, 2000, 0).unwrap(), 3000);
        assert!(start.elapsed() >= CREDIT_WAIT);
        // A receiver that stopped is an error, not a wait.
        receiver_done.store(true, Ordering::Release);
        let err = credit.wait(4000, 2000, 0).unwrap_err();
        assert!(err.to_string().contains("receiver stopped"), "{err:#}");
    }

    #[test]
    fn pingpong_without_a_reply_fails_naming_the_round_trip() {
        let silent = bind(SocketAddr::new(lo(77), 20_007)).unwrap();
        let initiator = bind(SocketAddr::new(lo(78), 0)).unwrap();
        initiator.connect(silent.local_addr().unwrap()).unwrap();
        initiator.set_nonblocking(true).unwrap();
        let err = ping(&initiator, 64, 0, 1, &AtomicBool::new(false)).unwrap_err();
        assert!(format!("{err:#}").contains("round trip 0"), "{err:#}");
    }

    #[test]
    fn pingpong_of_one_byte_works() {
        let samples = pingpong(lo(71), lo(72), 20_006, 1, 0, 10).unwrap();
        assert_eq!(samples.len(), 10);
    }

    #[test]
    fn memcpy_reports_a_positive_rate() {
        assert!(memcpy(64 << 10, 100) > 0.0);
    }

    /// The numbers for the benchmark's comparison; run with
    /// `cargo test --release -p vrdma rawudp -- --ignored --nocapture`.
    /// Each stream runs five times (this machine's numbers vary run to
    /// run); the median and the best are printed.
    #[test]
    #[ignore = "a measurement, not a test: run it in release"]
    fn measure_raw_udp_baseline() {
        for (mode, total, port) in [
            (Mode::Gso, 1_u64 << 30, 20_010),
            (Mode::OneDatagramPerSyscall, 256 << 20, 20_011),
        ] {
            let sent = total.div_ceil(SEGMENT as u64);
            let mut rates = Vec::new();
            for _ in 0..5 {
                let t = stream(mode, lo(73), lo(74), port, total, SEGMENT).unwrap();
                println!(
                    "stream {mode:?}: {:.2} GB/s, {} of {total} bytes in {:.3} s, \
                     {} of {sent} datagrams ({} lost), {} sends, {} receives",
                    t.bytes_per_sec() / 1e9,
                    t.bytes,
                    t.seconds,
                    t.datagrams,
                    sent - t.datagrams,
                    t.send_calls,
                    t.recv_calls,
                );
                rates.push(t.bytes_per_sec());
            }
            rates.sort_by(f64::total_cmp);
            println!(
                "stream {mode:?}: median {:.2} GB/s, best {:.2} GB/s",
                rates[rates.len() / 2] / 1e9,
                rates[rates.len() - 1] / 1e9,
            );
        }
        let mut samples = pingpong(lo(75), lo(76), 20_012, 64, 1000, 20_000).unwrap();
        samples.sort_by(f64::total_cmp);
        let pct = |p: f64| samples[((samples.len() - 1) as f64 * p) as usize];
        println!(
            "pingpong 64 B: half RTT median {:.2} us, p1 {:.2} us, p99 {:.2} us",
            pct(0.5) / 1e3,
            pct(0.01) / 1e3,
            pct(0.99) / 1e3,
        );
        println!(
            "memcpy 1 MiB x 2000: {:.2} GB/s",
            memcpy(1 << 20, 2000) / 1e9
        );
    }
}
