//! `vrdma bench`: vrdma beside the best this machine does without it, in
//! one run, as ratios — the numbers `BENCHMARKS.md` records.
//!
//! - **Bandwidth:** 1 MiB RDMA WRITEs between two vrdma devices on
//!   loopback (one thread each, busy-polling, RC at MTU 4096) against a
//!   raw UDP stream of the same bytes in 4 KiB datagrams: GSO
//!   (`UDP_SEGMENT`) send, GRO (`UDP_GRO`) receive into a destination
//!   buffer, a CRC-32 over each datagram ([`crate::rawudp`]); and the same
//!   stream one datagram per system call; and `memcpy`.
//! - **Latency:** a 64-byte RDMA WRITE ping-pong (each side polls the last
//!   byte of its buffer for the peer's write, as `ib_write_lat`) against a
//!   raw UDP ping-pong of 64-byte datagrams, both sides busy-polling; half
//!   round trips.
//!
//! Both sides of every test busy-poll on their own thread: on a 2-core
//! machine nothing else may run beside it. The compared runs alternate in
//! rounds, back to back, and each comparison is the median of the rounds'
//! ratios: this machine has slow spells of seconds, which would otherwise
//! land on one side of a comparison.

use std::{
    net::{IpAddr, Ipv4Addr},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

mod port;

use anyhow::{Context as _, Result, anyhow, ensure};
use vrdma_engine::{
    qp::QpType,
    wc::WcStatus,
    wr::{SendFlags, SendOp},
};
use vrdma_fabric::{
    shm::{JoinConfig, Rendezvous, Switch},
    udp::UdpPort,
};
use vrdma_wire::{Qpn, Rkey};

use vrdma_device::{
    transport::{SameHost, Transport},
    verbs::{BASE, Context, Remote},
};

use crate::{
    args::BenchArgs,
    common::{loopback_connect, random_psn},
    rawudp,
};

const A: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 43);
const B: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 44);
/// The raw UDP tests' port (the devices have 4791).
const RAW_PORT: u16 = 24791;
/// Bytes of the bandwidth tests' message.
const MSG: u64 = 1 << 20;
/// The latency tests' message.
const SMALL: u32 = 64;
/// WRITEs in flight in the bandwidth test.
const DEPTH: u64 = 16;
/// Each device: a 1 MiB source and a 1 MiB destination.
const MEM: usize = 2 << 20;
const SRC: u64 = BASE;
const DST: u64 = BASE + MSG;

/// A device (on its UDP port, perhaps with same-host shared memory in
/// front of it), its active QP and the peer's rkey.
type Side = (Context<SameHost<UdpPort>>, Qpn, Rkey);

/// What carries a pair's packets.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
enum Medium {
    /// Their UDP ports, over loopback.
    Udp,
    /// Same-host shared memory (`vrdma_fabric::shm`): one switch, as the
    /// devices of one daemon.
    Shm,
    /// Same-host shared memory between daemons: two switches that joined
    /// one rendezvous directory, the packets in rings between them.
    Rings,
}

impl Medium {
    fn name(self) -> &'static str {
        match self {
            Medium::Udp => "UDP loopback",
            Medium::Shm => "shm 1 daemon",
            Medium::Rings => "shm 2 daemons",
        }
    }
}

/// What one device tells the other before their QPs connect: every QP
/// (the active one first) and the rkey of its memory.
type Hello = (Vec<Remote>, Rkey);

/// How many QPs each device has and how deep the active one's queues are,
/// what carries their packets, and how much memory each device has.
#[derive(Clone, Copy, Debug)]
struct Shape {
    qps: u32,
    send: u32,
    recv: u32,
    medium: Medium,
    mem: usize,
}

impl Shape {
    /// One QP, as the bandwidth and latency tests use, over UDP.
    const ONE: Shape = Shape {
        qps: 1,
        send: 2 * DEPTH as u32,
        recv: 1,
        medium: Medium::Udp,
        mem: MEM,
    };

    fn over(self, medium: Medium) -> Shape {
        Shape { medium, ..self }
    }
}

/// One device of a pair: `shape.qps` RC QPs, all brought up to RTS and
/// connected to the peer's, QP i to QP i; the first is the active one,
/// the rest idle (4 deep).
fn side(
    addr: Ipv4Addr,
    shape: Shape,
    switch: Option<&Switch>,
    tx: &mpsc::Sender<Hello>,
    rx: &mpsc::Receiver<Hello>,
) -> Result<Side> {
    let mut dev = Context::open_same_host(switch, IpAddr::V4(addr), shape.mem, false, 4096)?;
    let c = loopback_connect();
    let mut mine = Vec::with_capacity(shape.qps as usize);
    for i in 0..shape.qps {
        let qpn = if i == 0 {
            dev.create_qp(QpType::Rc, shape.send, shape.recv, 64)?
        } else {
            dev.create_qp(QpType::Rc, 4, 4, 0)?
        };
        dev.init_qp(qpn, &c)?;
        mine.push(Remote {
            qpn,
            psn: random_psn(),
            gid: dev.gid(),
        });
    }
    tx.send((mine.clone(), dev.rkey))?;
    let (peers, rkey) = rx.recv_timeout(Duration::from_secs(60))?;
    ensure!(
        peers.len() == mine.len(),
        "the peer has another number of QPs"
    );
    if let Some(sw) = switch {
        // Another daemon's addresses come through the rendezvous on its
        // own time: the test starts once the peer is reached by shm.
        let t = Instant::now();
        while !sw.holds(&sw.default_network(), &peers[0].gid) {
            ensure!(
                t.elapsed() < Duration::from_secs(10),
                "the peer never came through shm"
            );
            thread::sleep(Duration::from_millis(1));
        }
    }
    for (m, p) in mine.iter().zip(&peers) {
        dev.connect(m.qpn, m.psn, *p, &c)?;
    }
    Ok((dev, mine[0].qpn, rkey))
}

/// Runs `a` and `b` on two connected devices, each on its own thread;
/// `b` runs until `a` returns.
fn pair<T: Send + 'static>(
    shape: Shape,
    a: impl FnOnce(Side) -> Result<T> + Send + 'static,
    b: impl FnOnce(Side, &AtomicBool) -> Result<()> + Send + 'static,
) -> Result<T> {
    let (to_b, from_a) = mpsc::channel();
    let (to_a, from_b) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let stop_b = stop.clone();
    let (switch, switch_b, _rendezvous) = switches(shape.medium)?;
    let tb = thread::Builder::new()
        .name("bench-b".into())
        .spawn(move || -> Result<()> {
            rawudp::pin(1);
            b(side(B, shape, switch_b.as_ref(), &to_a, &from_a)?, &stop_b)
        })?;
    // Side A runs on this thread: pinned for the test, then let go.
    rawudp::pin(0);
    let result = side(A, shape, switch.as_ref(), &to_b, &from_b).and_then(a);
    rawudp::unpin();
    stop.store(true, Ordering::Relaxed);
    let rb = tb.join().map_err(|_| anyhow!("side B panicked"))?;
    let value = result?;
    rb.context("side B")?;
    Ok(value)
}

/// The switches of a pair's two sides over `medium` (none over UDP), and
/// what keeps two daemons' switches joined.
type Switches = (Option<Switch>, Option<Switch>, Option<Rings>);

/// Two switches' memberships of a rendezvous directory of their own,
/// removed when dropped.
struct Rings {
    members: Option<(Rendezvous, Rendezvous)>,
    dir: std::path::PathBuf,
}

impl Drop for Rings {
    fn drop(&mut self) {
        // The daemons leave (their sockets with them), then the directory.
        drop(self.members.take());
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn switches(medium: Medium) -> Result<Switches> {
    Ok(match medium {
        Medium::Udp => (None, None, None),
        Medium::Shm => {
            let s = Switch::new();
            (Some(s.clone()), Some(s), None)
        }
        Medium::Rings => {
            static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let dir = std::env::temp_dir().join(format!(
                "vrdma-bench-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir)?;
            let (a, b) = (Switch::new(), Switch::new());
            let ra = a.join(JoinConfig::new(&dir))?;
            let rb = b.join(JoinConfig::new(&dir))?;
            let rings = Rings {
                members: Some((ra, rb)),
                dir,
            };
            (Some(a), Some(b), Some(rings))
        }
    })
}

/// Side B of the bandwidth test: only answers (ACKs).
fn serve((mut dev, _, _): Side, stop: &AtomicBool) -> Result<()> {
    while !stop.load(Ordering::Relaxed) {
        dev.progress()?;
    }
    Ok(())
}

/// 1 MiB WRITEs for `total` bytes, `DEPTH` in flight; bytes per second.
fn write_bw(total: u64) -> Result<f64> {
    write_bw_over(Shape::ONE, total)
}

/// 1 MiB WRITEs for `total` bytes, `DEPTH` in flight, over the pair
/// `shape` says; bytes per second. With more than [`MEM`] bytes of memory
/// each, the WRITEs go round its two halves 1 MiB at a time (source in
/// the first, destination in the second), so that a memory larger than
/// the caches is not cache-resident.
fn write_bw_over(shape: Shape, total: u64) -> Result<f64> {
    let half = shape.mem as u64 / 2;
    let slots = (half / MSG).max(1);
    pair(
        shape,
        move |(mut dev, qpn, rkey)| {
            let iters = total.div_ceil(MSG);
            let fill: Vec<u8> = (0..MSG).map(|i| i as u8).collect();
            for k in 0..slots {
                dev.write(SRC + k * MSG, &fill)?;
            }
            let start = Instant::now();
            post_writes(&mut dev, qpn, rkey, iters, |n| {
                let at = (n % slots) * MSG;
                (SRC + at, SRC + half + at)
            })?;
            Ok((iters * MSG) as f64 / start.elapsed().as_secs_f64())
        },
        serve,
    )
}

/// Posts `iters` 1 MiB signaled WRITEs through `qpn` (the `n`th from and
/// to the addresses `at(n)` gives; `rkey` the peer's), [`DEPTH`] in
/// flight, and reaps them: an error if one fails or none completes for
/// 10 s.
fn post_writes<T: Transport>(
    dev: &mut Context<T>,
    qpn: Qpn,
    rkey: Rkey,
    iters: u64,
    at: impl Fn(u64) -> (u64, u64),
) -> Result<()> {
    let (mut posted, mut done) = (0u64, 0u64);
    while done < iters {
        while posted < iters && posted - done < DEPTH {
            let (src, dst) = at(posted);
            let op = SendOp::RdmaWrite {
                remote_addr: dst,
                rkey,
            };
            dev.post_send(
                qpn,
                posted,
                op,
                (src, MSG as u32),
                SendFlags::SIGNALED,
                None,
            )?;
            posted += 1;
        }
        let wcs = dev.poll(Duration::from_secs(10))?;
        ensure!(!wcs.is_empty(), "WRITE stalled after {done} of {iters}");
        for wc in wcs {
            ensure!(
                wc.status == WcStatus::Success,
                "WRITE failed: {:?}",
                wc.status
            );
        }
        done += wcs.len() as u64;
    }
    Ok(())
}

/// The 64-byte WRITE ping-pong, as `ib_write_lat` runs it: each side
/// writes a sequence number into the last byte of the peer's buffer once
/// it sees the peer's; A writes first. Every WRITE is signaled and a side
/// reaps its completions as they come (perftest's loop consumes one per
/// iteration, so the ACK of the WRITE just posted is not waited for).
/// Half round trips in ns, measured on A.
fn write_lat(warmup: u32, iters: u32) -> Result<Vec<f64>> {
    write_lat_over(Shape::ONE, SMALL, warmup, iters)
}

/// [`write_lat`] with `size`-byte WRITEs over the pair `shape` says.
fn write_lat_over(shape: Shape, size: u32, warmup: u32, iters: u32) -> Result<Vec<f64>> {
    type Dev = Context<SameHost<UdpPort>>;
    let seen = move |dev: &Dev| dev.byte(DST + u64::from(size) - 1).unwrap_or(0);
    let write = move |dev: &mut Dev, qpn, rkey, seq: u8| -> Result<()> {
        dev.write(SRC + u64::from(size) - 1, &[seq])?;
        Ok(dev.post_send(
            qpn,
            0,
            SendOp::RdmaWrite {
                remote_addr: DST,
                rkey,
            },
            (SRC, size),
            SendFlags::SIGNALED.with(SendFlags::INLINE),
            None,
        )?)
    };
    // Completions reaped; a side never has more than DEPTH WRITEs out.
    let reap = |dev: &mut Dev, out: &mut u64| -> Result<()> {
        for wc in dev.poll_now()? {
            ensure!(
                wc.status == WcStatus::Success,
                "WRITE failed: {:?}",
                wc.status
            );
            *out -= 1;
        }
        Ok(())
    };
    pair(
        shape,
        move |(mut dev, qpn, rkey)| {
            let mut samples = Vec::with_capacity(iters as usize);
            let limit = Duration::from_secs(1);
            let mut out = 0u64;
            for i in 0..warmup + iters {
                let seq = (i % 255 + 1) as u8;
                let t = Instant::now();
                while out >= DEPTH {
                    reap(&mut dev, &mut out)?;
                }
                write(&mut dev, qpn, rkey, seq)?;
                out += 1;
                while seen(&dev) != seq {
                    reap(&mut dev, &mut out)?;
                    ensure!(t.elapsed() < limit, "round trip {i} took over a second");
                }
                if i >= warmup {
                    samples.push(t.elapsed().as_nanos() as f64 / 2.0);
                }
            }
            // Every WRITE answered before the peer goes.
            let t = Instant::now();
            while out > 0 {
                reap(&mut dev, &mut out)?;
                ensure!(t.elapsed() < limit, "{out} WRITEs never completed");
            }
            Ok(samples)
        },
        move |(mut dev, qpn, rkey), stop| {
            let (mut last, mut out) = (0u8, 0u64);
            while !stop.load(Ordering::Relaxed) {
                reap(&mut dev, &mut out)?;
                let seq = seen(&dev);
                if seq != last && out < DEPTH {
                    last = seq;
                    write(&mut dev, qpn, rkey, seq)?;
                    out += 1;
                }
            }
            Ok(())
        },
    )
}

/// Runs per measurement; each line is their median. This machine has slow
/// spells that last seconds: the runs of the lines being compared are
/// taken in turn, back to back, so that a spell hits them alike.
const REPS: usize = 5;

/// SENDs in flight in the message-rate test, and how often one is
/// signaled. 128 in flight and 512 receives posted are perftest's
/// `ib_send_bw` defaults. The window must be deeper than what a receiver
/// takes in one round (64 packets, then one ACK): at 64 the sender had
/// nothing left to send while the receiver worked through a round, the
/// two sides took turns, and the test measured their sum — 4.3 M/s on
/// shm against 7.0 at 128, the same build alternating.
const SEND_DEPTH: u64 = 128;
const SIGNAL_EVERY: u64 = 16;
/// Receives the message-rate test's receiver keeps posted.
const RECV_DEPTH: u32 = 512;

/// 64-byte SENDs on the active QP of two devices with `qps` QPs each (the
/// rest idle, all in RTS), `SEND_DEPTH` in flight, one in `SIGNAL_EVERY`
/// signaled, the receiver reposting each receive as it completes;
/// messages per second.
fn send_rate(qps: u32, msgs: u64) -> Result<f64> {
    send_rate_over(qps, Medium::Udp, msgs)
}

/// [`send_rate`] over `medium`.
fn send_rate_over(qps: u32, medium: Medium, msgs: u64) -> Result<f64> {
    let shape = Shape {
        qps,
        send: SEND_DEPTH as u32,
        recv: RECV_DEPTH,
        medium,
        mem: MEM,
    };
    pair(
        shape,
        move |(mut dev, qpn, _)| {
            let limit = Duration::from_secs(10);
            let (mut posted, mut done) = (0u64, 0u64);
            let start = Instant::now();
            while done < msgs {
                while posted < msgs && posted - done < SEND_DEPTH {
                    posted += 1;
                    let flags = if posted % SIGNAL_EVERY == 0 || posted == msgs {
                        SendFlags::SIGNALED
                    } else {
                        SendFlags::default()
                    };
                    dev.post_send(qpn, posted, SendOp::Send, (SRC, SMALL), flags, None)?;
                }
                let wcs = dev.poll(limit)?;
                ensure!(!wcs.is_empty(), "SEND stalled after {done} of {msgs}");
                for wc in wcs {
                    ensure!(
                        wc.status == WcStatus::Success,
                        "SEND failed: {:?}",
                        wc.status
                    );
                    // A signaled WR completes every unsignaled one before it.
                    done = wc.wr_id;
                }
            }
            Ok(msgs as f64 / start.elapsed().as_secs_f64())
        },
        |(mut dev, qpn, _), stop| {
            dev.post_recvs(qpn, 0, DST, SMALL, RECV_DEPTH)?;
            while !stop.load(Ordering::Relaxed) {
                let wcs = dev.poll_now()?;
                let n = wcs.len() as u32;
                if let Some(bad) = wcs.iter().find(|w| w.status != WcStatus::Success) {
                    return Err(anyhow!("receive failed: {:?}", bad.status));
                }
                if n > 0 {
                    dev.post_recvs(qpn, 0, DST, SMALL, n)?;
                }
            }
            Ok(())
        },
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median, 99 % and 99.9 % of samples in ns, as µs.
fn percentiles(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() as f64 * q) as usize).min(v.len() - 1)] / 1000.0;
    (at(0.5), at(0.99), at(0.999))
}

pub fn run(a: &BenchArgs) -> Result<()> {
    ensure!(
        a.megabytes > 0 && a.iters > 0,
        "megabytes and iterations must be positive"
    );
    let total = a
        .megabytes
        .checked_mul(1 << 20)
        .ok_or_else(|| anyhow!("{} MiB is too much", a.megabytes))?;
    println!(
        "vrdma bench: {} MiB per bandwidth test, {} round trips per latency test; loopback {A} -> {B}, both sides busy-polling",
        a.megabytes, a.iters
    );
    if a.only.is_none() || a.only.as_deref() == Some("bw") {
        bandwidth(total)?;
    }
    if a.only.is_none() || a.only.as_deref() == Some("lat") {
        latency(a.iters)?;
    }
    if a.only.is_none() || a.only.as_deref() == Some("scale") {
        scale(a.qps)?;
    }
    if a.only.is_none() || a.only.as_deref() == Some("shm") {
        same_host(total, a.iters)?;
    }
    if a.only.is_none() || a.only.as_deref() == Some("port") {
        port::port(total)?;
    }
    Ok(())
}

/// Each device's memory in the same-host table's bandwidth test: 64 MiB,
/// a source half and a destination half gone round 1 MiB at a time, larger
/// than the caches (memcpy gets the same).
const SPAN: usize = 64 << 20;
/// The same-host table's latency test's WRITE.
const TINY: u32 = 8;

/// The same-host table: two devices of this process on one switch
/// (`vrdma_fabric::shm`, as one daemon's devices), and on two switches
/// joined through a rendezvous directory (as two daemons'), against the
/// same two over UDP loopback; 1 MiB WRITEs also against single-core
/// memcpy of the same amount of memory.
fn same_host(total: u64, iters: u32) -> Result<()> {
    const MSGS: u64 = 300_000;
    const MEDIA: [Medium; 3] = [Medium::Udp, Medium::Shm, Medium::Rings];
    println!();
    println!(
        " {:<44} {:>12} {:>10} {:>10}",
        format!("same host (median of {REPS})"),
        "value",
        "vs memcpy",
        "vs UDP"
    );
    let wide = Shape {
        mem: SPAN,
        ..Shape::ONE
    };
    let part = iters.div_ceil(REPS as u32);
    let warmup = part / 10;
    // Per medium: bandwidth, latency, rate; and each round's ratios
    // (bandwidth to memcpy, and each to UDP).
    let mut memcpy = Vec::new();
    let mut runs: [[Vec<f64>; 3]; 3] = Default::default();
    let mut ratios: [[Vec<f64>; 4]; 3] = Default::default();
    for _ in 0..REPS {
        let m = rawudp::memcpy_span(MSG as usize, SPAN / 2, total / MSG);
        memcpy.push(m);
        let mut round = [[0.0; 3]; 3];
        for (k, medium) in MEDIA.into_iter().enumerate() {
            round[k] = [
                write_bw_over(wide.over(medium), total)?,
                median(write_lat_over(Shape::ONE.over(medium), TINY, warmup, part)?),
                send_rate_over(1, medium, MSGS)?,
            ];
        }
        for k in 0..3 {
            for t in 0..3 {
                runs[k][t].push(round[k][t]);
                ratios[k][t + 1].push(round[k][t] / round[0][t]);
            }
            ratios[k][0].push(round[k][0] / m);
        }
    }
    let c2c = rawudp::core_to_core(100_000, 5);
    println!(" (a cache line's round trip between the two cores: {c2c:.0} ns)");
    let pct = |r: f64| format!("{:.0}%", r * 100.0);
    let times = |r: f64| format!("{r:.2}x");
    let row = |name: String, v: String, a: String, b: String| {
        println!(" {name:<44} {v:>12} {a:>10} {b:>10}");
    };
    row(
        "memcpy, 1 MiB blocks over 32 MiB".into(),
        format!("{:.2} GB/s", median(memcpy) / 1e9),
        pct(1.0),
        String::new(),
    );
    for (k, medium) in MEDIA.into_iter().enumerate() {
        row(
            format!("RC WRITE 1 MiB, {}", medium.name()),
            format!("{:.2} GB/s", median(runs[k][0].clone()) / 1e9),
            pct(median(ratios[k][0].clone())),
            pct(median(ratios[k][1].clone())),
        );
    }
    for (k, medium) in MEDIA.into_iter().enumerate() {
        row(
            format!("RC WRITE 8 B half RTT, {}", medium.name()),
            format!("{:.2} us", median(runs[k][1].clone()) / 1000.0),
            String::new(),
            times(median(ratios[k][2].clone())),
        );
    }
    for (k, medium) in MEDIA.into_iter().enumerate() {
        row(
            format!("RC SEND 64 B rate, {}", medium.name()),
            format!("{:.2} M/s", median(runs[k][2].clone()) / 1e6),
            String::new(),
            times(median(ratios[k][3].clone())),
        );
    }
    let sorted = |mut v: Vec<f64>, f: &dyn Fn(f64) -> String| {
        v.sort_by(f64::total_cmp);
        v.into_iter().map(f).collect::<Vec<_>>().join(" ")
    };
    for (k, medium) in MEDIA.into_iter().enumerate().skip(1) {
        println!(
            "   ({} each round, sorted: WRITE / memcpy {}; / UDP: WRITE {}, latency {}, rate {})",
            medium.name(),
            sorted(ratios[k][0].clone(), &pct),
            sorted(ratios[k][1].clone(), &pct),
            sorted(ratios[k][2].clone(), &times),
            sorted(ratios[k][3].clone(), &times)
        );
    }
    Ok(())
}

/// The scale table: the active QP's message rate with `qps` QPs per device
/// against one.
fn scale(qps: u32) -> Result<()> {
    const MSGS: u64 = 300_000;
    println!();
    println!(
        " {:<44} {:>12} {:>10}",
        format!("64 B SEND message rate (median of {REPS})"),
        "Mmsg/s",
        "vs 1 QP"
    );
    let (mut one, mut many) = (Vec::new(), Vec::new());
    let mut ratios = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        let r1 = send_rate(1, MSGS)?;
        let rn = send_rate(qps, MSGS)?;
        ratios.push(rn / r1);
        one.push(r1);
        many.push(rn);
    }
    println!(
        " {:<44} {:>12.2} {:>9.0}%",
        "1 QP per device",
        median(one) / 1e6,
        100.0
    );
    println!(
        " {:<44} {:>12.2} {:>9.0}%",
        format!("{qps} QPs per device (all RTS), one active"),
        median(many) / 1e6,
        100.0 * median(ratios.clone())
    );
    ratios.sort_by(f64::total_cmp);
    println!(
        "   ({qps} QPs / 1 QP in each round, sorted: {})",
        ratios
            .iter()
            .map(|r| format!("{:.0}%", r * 100.0))
            .collect::<Vec<_>>()
            .join(" ")
    );
    Ok(())
}

/// The bandwidth table.
fn bandwidth(total: u64) -> Result<()> {
    let (ia, ib) = (IpAddr::V4(A), IpAddr::V4(B));
    println!();
    println!(
        " {:<44} {:>12} {:>10}",
        format!("bandwidth (median of {REPS})"),
        "GB/s",
        "vs GSO"
    );

    // The raw stream and vrdma run back to back in each round, and each
    // round gives vrdma's fraction of the raw stream: their median is the
    // comparison (medians of each line taken apart could pair a fast
    // spell of one with a slow spell of the other).
    let mut runs: [Vec<f64>; 4] = Default::default();
    let mut ratios = Vec::with_capacity(REPS);
    let mut lost = 0;
    for _ in 0..REPS {
        let gso = rawudp::stream(rawudp::Mode::Gso, ia, ib, RAW_PORT, total, 4096)?;
        ensure!(gso.bytes > 0, "the raw UDP stream moved nothing");
        lost += total.saturating_sub(gso.bytes);
        let vrdma = write_bw(total)?;
        ratios.push(vrdma / gso.bytes_per_sec());
        runs[1].push(gso.bytes_per_sec());
        runs[3].push(vrdma);
        runs[0].push(rawudp::memcpy(MSG as usize, 2000));
        let single = rawudp::stream(
            rawudp::Mode::OneDatagramPerSyscall,
            ia,
            ib,
            RAW_PORT + 1,
            total / 4,
            4096,
        )?;
        runs[2].push(single.bytes_per_sec());
    }
    let mut sorted = ratios.clone();
    sorted.sort_by(f64::total_cmp);
    let [memcpy, gso_bw, single, vrdma] = runs.map(median);
    let row = |name: &str, bw: f64, ratio: f64| {
        println!(" {name:<44} {:>12.2} {:>9.0}%", bw / 1e9, ratio * 100.0);
    };
    row("memcpy, 1 MiB blocks", memcpy, memcpy / gso_bw);
    row("raw UDP, GSO 4 KiB segments + GRO + CRC-32", gso_bw, 1.0);
    row(
        "raw UDP, one 4 KiB datagram per syscall",
        single,
        single / gso_bw,
    );
    row("vrdma RC RDMA WRITE 1 MiB, MTU 4096", vrdma, median(ratios));
    println!(
        "   (vrdma / raw GSO in each round, sorted: {})",
        sorted
            .iter()
            .map(|r| format!("{:.0}%", r * 100.0))
            .collect::<Vec<_>>()
            .join(" ")
    );
    if lost > 0 {
        println!("   (the raw GSO stream lost {lost} bytes: UDP has no flow control)");
    }
    Ok(())
}

/// The latency table.
fn latency(iters: u32) -> Result<()> {
    let (ia, ib) = (IpAddr::V4(A), IpAddr::V4(B));
    println!();
    println!(
        " {:<44} {:>12} {:>10} {:>10} {:>10}",
        "latency (half round trip)", "typical us", "99% us", "99.9% us", "vs UDP"
    );
    // In REPS rounds, raw then vrdma back to back (as the bandwidth runs):
    // the percentiles are over all samples, the ratio the median of the
    // rounds' ratios of typical values.
    let part = iters.div_ceil(REPS as u32);
    let warmup = part / 10;
    let (mut raw, mut vrdma) = (Vec::new(), Vec::new());
    let mut ratios = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        let r = rawudp::pingpong(ia, ib, RAW_PORT + 2, SMALL as usize, warmup, part)?;
        let v = write_lat(warmup, part)?;
        ratios.push(percentiles(v.clone()).0 / percentiles(r.clone()).0);
        raw.extend(r);
        vrdma.extend(v);
    }
    let (raw_t, raw_99, raw_999) = percentiles(raw);
    let (v_t, v_99, v_999) = percentiles(vrdma);
    println!(
        " {:<44} {raw_t:>12.2} {raw_99:>10.2} {raw_999:>10.2} {:>9.2}x",
        "raw UDP ping-pong, 64 B", 1.0
    );
    println!(
        " {:<44} {v_t:>12.2} {v_99:>10.2} {v_999:>10.2} {:>9.2}x",
        "vrdma RC RDMA WRITE 64 B (polling memory)",
        median(ratios.clone())
    );
    ratios.sort_by(f64::total_cmp);
    println!(
        "   (vrdma / raw typical in each round, sorted: {})",
        ratios
            .iter()
            .map(|r| format!("{r:.2}x"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    Ok(())
}
