//! `vrdma demo`: the README's first command. Two vrdma devices in one
//! process, each on its own loopback address and thread, connected by an
//! RC QP over real UDP sockets: a ping-pong, then a short bandwidth and
//! latency table. Nothing to set up and nothing to install.

use std::{
    net::IpAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use vrdma_engine::{
    attr::Mtu,
    wc::{Wc, WcStatus},
    wr::{SendFlags, SendOp},
};

use vrdma_device::verbs::{BASE, Context};

use crate::{
    args::DemoArgs,
    common::{Hello, loopback_side},
};

/// Memory per device: a source and a destination region of 1 MiB each
/// and room for the receives.
const MEM: usize = 4 << 20;
const SRC: u64 = BASE;
const DST: u64 = BASE + (1 << 20);
const RECV: u64 = BASE + (2 << 20);
/// Receives the echoing side keeps posted.
const RECV_DEPTH: u32 = 256;
/// Bandwidth tests keep this many WRs in flight.
const DEPTH: u64 = 32;
/// How long the client waits for a completion before it calls a test
/// stalled.
const LIMIT: Duration = Duration::from_secs(10);

/// One side: a device with an RC QP, connected through `tx` / `rx`.
fn side(
    addr: IpAddr,
    tx: &mpsc::Sender<Hello>,
    rx: &mpsc::Receiver<Hello>,
) -> Result<(Context, vrdma_wire::Qpn, Hello)> {
    let sides = loopback_side(addr, MEM, (2 * DEPTH as u32, 2 * RECV_DEPTH), tx, rx)?;
    ensure!(
        sides.0.active_mtu() == Mtu::Mtu4096,
        "loopback should carry 4096-byte packets"
    );
    Ok(sides)
}

/// A signaled send; up to 64 bytes of SEND or WRITE go inline.
fn post(
    dev: &mut Context,
    qpn: vrdma_wire::Qpn,
    wr_id: u64,
    op: SendOp,
    addr: u64,
    len: u32,
) -> Result<()> {
    let inline = len <= 64 && matches!(op, SendOp::Send | SendOp::RdmaWrite { .. });
    let flags = if inline {
        SendFlags::SIGNALED.with(SendFlags::INLINE)
    } else {
        SendFlags::SIGNALED
    };
    Ok(dev.post_send(qpn, wr_id, op, (addr, len), flags, None)?)
}

fn post_recvs(dev: &mut Context, qpn: vrdma_wire::Qpn, n: u32, len: u32) -> Result<()> {
    Ok(dev.post_recvs(qpn, 0, RECV, len, n)?)
}

fn check(wc: &Wc) -> Result<()> {
    if wc.status != WcStatus::Success {
        bail!("completion {} failed: {:?}", wc.wr_id, wc.status);
    }
    Ok(())
}

/// The passive side: echoes every SEND it receives back, until `stop`.
fn echo(
    addr: IpAddr,
    tx: mpsc::Sender<Hello>,
    rx: mpsc::Receiver<Hello>,
    stop: Arc<AtomicBool>,
) -> Result<()> {
    let (mut dev, qpn, _) = side(addr, &tx, &rx)?;
    post_recvs(&mut dev, qpn, RECV_DEPTH, 4096)?;
    let mut posted = RECV_DEPTH;
    while !stop.load(Ordering::Relaxed) {
        let wcs = dev.poll(Duration::from_millis(10))?.to_vec();
        for wc in wcs {
            check(&wc)?;
            if wc.opcode == vrdma_engine::wc::WcOpcode::Recv {
                posted -= 1;
                post(&mut dev, qpn, 1, SendOp::Send, RECV, wc.byte_len)?;
                if posted < RECV_DEPTH / 2 {
                    post_recvs(&mut dev, qpn, RECV_DEPTH - posted, 4096)?;
                    posted = RECV_DEPTH;
                }
            }
        }
    }
    Ok(())
}

/// Latencies in ns, sorted: typical (median), average, 99 %, 99.9 %.
fn percentiles(mut v: Vec<u64>) -> (f64, f64, f64, f64) {
    v.sort_unstable();
    let at = |q: f64| v[((v.len() as f64 * q) as usize).min(v.len() - 1)] as f64 / 1000.0;
    let avg = v.iter().sum::<u64>() as f64 / v.len() as f64 / 1000.0;
    (at(0.5), avg, at(0.99), at(0.999))
}

pub fn run(a: &DemoArgs) -> Result<()> {
    ensure!(
        a.iters > 0 && a.megabytes > 0,
        "iterations and megabytes must be positive"
    );
    let (a_addr, b_addr) = (IpAddr::V4(a.addr_a), IpAddr::V4(a.addr_b));
    let (to_b, from_a) = mpsc::channel();
    let (to_a, from_b) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let server = {
        let stop = stop.clone();
        thread::Builder::new()
            .name("vrdma-demo-b".into())
            .spawn(move || echo(b_addr, to_a, from_a, stop))?
    };
    let result = client(a, a_addr, &to_b, &from_b);
    stop.store(true, Ordering::Relaxed);
    let served = server
        .join()
        .map_err(|_| anyhow!("the echo side panicked"))?;
    result.and(served.context("the echo side"))
}

/// The active side: a ping-pong, then the bandwidth tests, then the
/// device's counters.
fn client(
    a: &DemoArgs,
    addr: IpAddr,
    tx: &mpsc::Sender<Hello>,
    rx: &mpsc::Receiver<Hello>,
) -> Result<()> {
    let (mut dev, qpn, peer) = side(addr, tx, rx)?;
    println!(
        "vrdma demo: two devices in this process, {} and {}, RC over UDP port 4791, MTU 4096, busy-polling",
        a.addr_a, a.addr_b
    );
    println!(
        "  QPN 0x{:06x} ({}) <-> QPN 0x{:06x} ({})",
        qpn.value(),
        a.addr_a,
        peer.remote.qpn.value(),
        a.addr_b
    );
    let (rtts, total) = ping_pong(a, &mut dev, qpn)?;
    print_latency(a, rtts, total);
    bandwidth(a, &mut dev, qpn, &peer)?;
    print_counters(a, &dev);
    Ok(())
}

/// The ping-pong: a 64-byte SEND each way per iteration, the echo checked
/// byte for byte. Returns each iteration's one-way latency in ns (half
/// its round trip) and the time they all took.
fn ping_pong(
    a: &DemoArgs,
    dev: &mut Context,
    qpn: vrdma_wire::Qpn,
) -> Result<(Vec<u64>, Duration)> {
    post_recvs(dev, qpn, RECV_DEPTH, 4096)?;
    let mut posted = RECV_DEPTH;
    dev.write(SRC, &[0x7b; 64])?;
    let mut rtts = Vec::with_capacity(a.iters as usize);
    let start = Instant::now();
    for i in 0..u64::from(a.iters) {
        let t = Instant::now();
        post(dev, qpn, i, SendOp::Send, SRC, 64)?;
        let (mut sent, mut got) = (false, false);
        while !(sent && got) {
            let wcs = dev.poll(LIMIT)?.to_vec();
            ensure!(!wcs.is_empty(), "ping-pong stalled at iteration {i}");
            for wc in wcs {
                check(&wc)?;
                match wc.opcode {
                    vrdma_engine::wc::WcOpcode::Send => sent = true,
                    _ => {
                        ensure!(wc.byte_len == 64, "echo of {} bytes", wc.byte_len);
                        got = true;
                        posted -= 1;
                    }
                }
            }
        }
        rtts.push(t.elapsed().as_nanos() as u64 / 2);
        if posted < RECV_DEPTH / 2 {
            post_recvs(dev, qpn, RECV_DEPTH - posted, 4096)?;
            posted = RECV_DEPTH;
        }
    }
    let total = start.elapsed();
    ensure!(
        {
            let mut got = [0u8; 64];
            dev.read(RECV, &mut got)?;
            got == [0x7b; 64]
        },
        "the echo came back different"
    );
    Ok((rtts, total))
}

/// The ping-pong's line, then the table's header and its latency row.
fn print_latency(a: &DemoArgs, rtts: Vec<u64>, total: Duration) {
    let (typ, avg, p99, p999) = percentiles(rtts);
    println!(
        "pingpong: {} × 64 B SEND each way in {:.2} s = {:.2} usec/iter",
        a.iters,
        total.as_secs_f64(),
        total.as_secs_f64() * 1e6 / f64::from(a.iters)
    );
    println!();
    println!(
        " {:<12} {:>8} {:>8} {:>12} {:>10} {:>13} {:>10} {:>10} {:>11}",
        "test",
        "bytes",
        "iters",
        "BW [MB/s]",
        "BW [Gb/s]",
        "t_typical[us]",
        "t_avg[us]",
        "99% [us]",
        "99.9% [us]"
    );
    println!(
        " {:<12} {:>8} {:>8} {:>12} {:>10} {:>13.2} {:>10.2} {:>10.2} {:>11.2}",
        "send_lat", 64, a.iters, "", "", typ, avg, p99, p999
    );
}

/// Bandwidth: WRITE at three sizes, then READ at two, `a.megabytes` MiB
/// each with [`DEPTH`] WRs in flight, a row of the table each.
fn bandwidth(a: &DemoArgs, dev: &mut Context, qpn: vrdma_wire::Qpn, peer: &Hello) -> Result<()> {
    for (name, size) in [
        ("write_bw", 4096u32),
        ("write_bw", 65536),
        ("write_bw", 1 << 20),
        ("read_bw", 65536),
        ("read_bw", 1 << 20),
    ] {
        let fill: Vec<u8> = (0..size as usize)
            .map(|i| (i as u8) ^ (size >> 12) as u8)
            .collect();
        dev.write(SRC, &fill)?;
        let iters = (a.megabytes << 20) / u64::from(size);
        let op = |_: u64| match name {
            "write_bw" => SendOp::RdmaWrite {
                remote_addr: DST,
                rkey: peer.rkey,
            },
            _ => SendOp::RdmaRead {
                remote_addr: SRC,
                rkey: peer.rkey,
            },
        };
        // READ brings the peer's source into our destination.
        let local = if name == "write_bw" { SRC } else { DST };
        let start = Instant::now();
        let (mut posted, mut done) = (0u64, 0u64);
        while done < iters {
            while posted < iters && posted - done < DEPTH {
                post(dev, qpn, posted, op(posted), local, size)?;
                posted += 1;
            }
            let wcs = dev.poll(LIMIT)?;
            ensure!(!wcs.is_empty(), "{name} stalled after {done} of {iters}");
            for wc in wcs {
                check(wc)?;
            }
            done += wcs.len() as u64;
        }
        let secs = start.elapsed().as_secs_f64();
        let bytes = (iters * u64::from(size)) as f64;
        println!(
            " {:<12} {:>8} {:>8} {:>12.2} {:>10.2}",
            name,
            size,
            iters,
            bytes / secs / 1e6,
            bytes * 8.0 / secs / 1e9
        );
    }
    Ok(())
}

/// What the active side's device counted: its system calls, resends and
/// bad checksums.
fn print_counters(a: &DemoArgs, dev: &Context) {
    let s = dev.dev.transport().stats();
    let e = dev.dev.engine().stats();
    println!();
    println!(
        "device {}: {} datagrams sent in {} sendmmsg calls, {} received in {} recvmmsg calls; {} retransmitted, {} bad ICRC",
        a.addr_a,
        s.tx_datagrams,
        s.tx_calls,
        s.rx_datagrams,
        s.rx_calls,
        e.tx_retransmitted,
        s.rx_bad_icrc
    );
}
