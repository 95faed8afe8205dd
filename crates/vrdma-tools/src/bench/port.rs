//! `vrdma bench --only port`: a device on an Ethernet port whose uplink is
//! a TAP (as `vrdma serve --tap` runs one for a guest) beside a device on
//! the UDP transport, each writing 1 MiB RC WRITEs to a device on the UDP
//! transport, in one run, as ratios.
//!
//! Everything runs in a network namespace of the bench's own (made with
//! `unshare`, so the bench needs root): the TAP holds 10.77.0.1 on the
//! namespace's side — the peer device is bound there — and the port's
//! device is 10.77.0.2 behind it (a permanent neighbour entry stands for
//! the ARP a guest would answer). The port's frames cross the kernel's
//! TAP both ways; the UDP pair is two devices on the namespace's own
//! loopback. Lines: the port with UDP segmentation offload (its runs of
//! packets written as one frame, a peer's GSO datagrams read whole), the
//! same port with frames whole (one system call each, as before), and
//! the UDP transport.
//!
//! Both devices of a pair busy-poll on their own thread, so their CPU time
//! is their wall time; what a line costs the kernel is the system time of
//! each thread (`getrusage(RUSAGE_THREAD)`), reported per MiB beside it.

use std::{
    net::{IpAddr, Ipv4Addr},
    os::unix::net::UnixStream,
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use nix::{
    sched::{CloneFlags, unshare},
    sys::resource::{UsageWho, getrusage},
};
use vrdma_device::{
    transport::Transport,
    verbs::{BASE, Context, Remote},
};
use vrdma_engine::qp::QpType;
use vrdma_fabric::eth::{EthPort, EthStats, Link};
use vrdma_wire::{Qpn, Rkey};

use super::{MEM, MSG, REPS, median, post_writes};
use crate::common::{loopback_connect, random_psn};

const TAP: &str = "vrbench0";
const TAP_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x77, 0x01];
const PORT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x77, 0x02];
/// The TAP's address in the namespace: the peer's.
const PEER: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
/// The port device's address, behind the TAP.
const PORT: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
const UDP_A: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 45);
const UDP_B: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 46);
/// The TAP's MTU: a jumbo Ethernet, so that the port runs at IB MTU 4096
/// as the UDP pair does over loopback.
const NETDEV_MTU: u32 = 9000;

/// What one pair's run measured.
#[derive(Clone, Copy, Debug, Default)]
struct Run {
    bytes_per_sec: f64,
    /// Each side's system time and CPU time, ns per MiB.
    a_sys: f64,
    a_cpu: f64,
    b_sys: f64,
    b_cpu: f64,
    /// The port's counters (the port lines).
    eth: Option<EthStats>,
}

/// The calling thread's (user, system) CPU time, ns.
fn thread_times() -> (u64, u64) {
    let Ok(u) = getrusage(UsageWho::RUSAGE_THREAD) else {
        return (0, 0);
    };
    let ns =
        |t: nix::sys::time::TimeVal| t.tv_sec() as u64 * 1_000_000_000 + t.tv_usec() as u64 * 1000;
    (ns(u.user_time()), ns(u.system_time()))
}

fn ip(args: &str) -> Result<()> {
    let st = Command::new("ip")
        .args(args.split(' '))
        .status()
        .context("running iproute2's ip")?;
    ensure!(st.success(), "ip {args} failed");
    Ok(())
}

/// The port device: a fresh TAP (`offload` as asked), addressed and
/// neighboured in the namespace; its guest side one end of a socket pair
/// (the other returned, held while the device runs).
fn port_device(offload: bool) -> Result<(Context<EthPort>, UnixStream)> {
    let link = if offload {
        Link::tap(TAP)
    } else {
        Link::tap_whole(TAP)
    }
    .with_context(|| format!("opening TAP {TAP}"))?;
    let (guest, held) = UnixStream::pair()?;
    let port = EthPort::with_stream(guest, link, PORT_MAC)?;
    let mac = TAP_MAC.map(|b| format!("{b:02x}")).join(":");
    let port_mac = PORT_MAC.map(|b| format!("{b:02x}")).join(":");
    ip(&format!("link set {TAP} address {mac} mtu {NETDEV_MTU} up"))?;
    ip(&format!("addr replace {PEER}/24 dev {TAP}"))?;
    ip(&format!(
        "neigh replace {PORT} lladdr {port_mac} dev {TAP} nud permanent"
    ))?;
    let dev = Context::open_eth(port, IpAddr::V4(PORT), NETDEV_MTU, TAP_MAC, MEM, false)?;
    Ok((dev, held))
}

/// Brings QP 0 of `dev` up against its peer's (exchanged through the
/// channels); returns the QP and the peer's rkey.
fn connect<T: Transport>(
    dev: &mut Context<T>,
    tx: &mpsc::Sender<(Remote, Rkey)>,
    rx: &mpsc::Receiver<(Remote, Rkey)>,
) -> Result<(Qpn, Rkey)> {
    let c = loopback_connect();
    let qpn = dev.create_qp(QpType::Rc, 64, 64, 64)?;
    dev.init_qp(qpn, &c)?;
    let me = Remote {
        qpn,
        psn: random_psn(),
        gid: dev.gid(),
    };
    tx.send((me, dev.rkey))?;
    let (peer, rkey) = rx.recv_timeout(Duration::from_secs(30))?;
    dev.connect(qpn, me.psn, peer, &c)?;
    Ok((qpn, rkey))
}

/// Writes 1 MiB WRITEs for `total` bytes through `qpn` (`DEPTH` in
/// flight) and returns the seconds they took and this thread's (CPU,
/// system) time over them, ns.
fn write<T: Transport>(
    dev: &mut Context<T>,
    qpn: Qpn,
    rkey: Rkey,
    total: u64,
) -> Result<(f64, u64, u64)> {
    let fill: Vec<u8> = (0..MSG).map(|i| i as u8).collect();
    dev.write(BASE, &fill)?;
    let iters = total.div_ceil(MSG);
    let (u0, s0) = thread_times();
    let start = Instant::now();
    post_writes(dev, qpn, rkey, iters, |_| (BASE, BASE + MSG))?;
    let secs = start.elapsed().as_secs_f64();
    let (u1, s1) = thread_times();
    Ok((secs, u1 - u0 + s1 - s0, s1 - s0))
}

/// Answers until `stop`; this thread's (CPU, system) time from `go` on.
fn answer<T: Transport>(dev: &mut Context<T>, stop: &AtomicBool) -> Result<(u64, u64)> {
    let (u0, s0) = thread_times();
    while !stop.load(Ordering::Relaxed) {
        dev.progress()?;
    }
    let (u1, s1) = thread_times();
    Ok((u1 - u0 + s1 - s0, s1 - s0))
}

/// A pair: the device `make_a` opens on this thread (first: the port's
/// TAP and addresses exist before the peer binds to one), the one `make_b`
/// opens on a thread of its own; 1 MiB WRITEs for `total` bytes from A to
/// B (`a_writes`) or from B to A, the other answering until they are done.
fn pair<TA: Transport, TB: Transport>(
    make_a: impl FnOnce() -> Result<(Context<TA>, Option<UnixStream>)>,
    make_b: impl FnOnce() -> Result<Context<TB>> + Send + 'static,
    a_writes: bool,
    eth: impl Fn(&Context<TA>) -> Option<EthStats>,
    total: u64,
) -> Result<Run> {
    let (to_b, from_a) = mpsc::channel();
    let (to_a, from_b) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let stop_b = stop.clone();
    let (mut dev, _held) = make_a()?;
    let tb = thread::Builder::new().name("bench-port-b".into()).spawn(
        move || -> Result<(f64, u64, u64)> {
            let mut dev = make_b()?;
            let (qpn, rkey) = connect(&mut dev, &to_a, &from_a)?;
            if a_writes {
                let (c, s) = answer(&mut dev, &stop_b)?;
                Ok((0.0, c, s))
            } else {
                let r = write(&mut dev, qpn, rkey, total);
                stop_b.store(true, Ordering::Relaxed);
                r
            }
        },
    )?;
    let result = (|| -> Result<(f64, u64, u64)> {
        let (qpn, rkey) = connect(&mut dev, &to_b, &from_b)?;
        if a_writes {
            write(&mut dev, qpn, rkey, total)
        } else {
            let (c, s) = answer(&mut dev, &stop)?;
            Ok((0.0, c, s))
        }
    })();
    if a_writes {
        stop.store(true, Ordering::Relaxed);
    }
    let b = tb.join().map_err(|_| anyhow!("side B panicked"))?;
    // B's failure first: it is why A's exchange would have failed.
    let (b_secs, b_cpu, b_sys) = b.context("side B")?;
    let (a_secs, a_cpu, a_sys) = match result {
        Ok(r) => r,
        Err(e) => {
            stop.store(true, Ordering::Relaxed);
            return Err(e);
        }
    };
    let mib = total.div_ceil(MSG) as f64;
    let secs = if a_writes { a_secs } else { b_secs };
    Ok(Run {
        bytes_per_sec: mib * MSG as f64 / secs,
        a_cpu: a_cpu as f64 / mib,
        a_sys: a_sys as f64 / mib,
        b_cpu: b_cpu as f64 / mib,
        b_sys: b_sys as f64 / mib,
        eth: eth(&dev),
    })
}

/// One run of each line, in turn: out of the port (offloaded, whole),
/// over UDP, into the port (offloaded, whole), over UDP.
fn round(total: u64) -> Result<[Run; 6]> {
    let port_stats = |c: &Context<EthPort>| Some(c.dev.transport().stats());
    let peer = || Context::open(IpAddr::V4(PEER), MEM, false).map_err(Into::into);
    let port = |offload| move || port_device(offload).map(|(d, h)| (d, Some(h)));
    let udp = |a_writes| {
        pair(
            || Ok((Context::open(IpAddr::V4(UDP_A), MEM, false)?, None)),
            || Context::open(IpAddr::V4(UDP_B), MEM, false).map_err(Into::into),
            a_writes,
            |_| None,
            total,
        )
    };
    Ok([
        pair(port(true), peer, true, port_stats, total)?,
        pair(port(false), peer, true, port_stats, total)?,
        udp(true)?,
        pair(port(true), peer, false, port_stats, total)?,
        pair(port(false), peer, false, port_stats, total)?,
        udp(false)?,
    ])
}

/// The port table; in a network namespace of its own, on a thread of its
/// own (a thread's namespace is its own, and the threads it starts are
/// in it).
pub fn port(total: u64) -> Result<()> {
    println!();
    let t = thread::Builder::new()
        .name("bench-port".into())
        .spawn(move || -> Result<()> {
            if let Err(e) = unshare(CloneFlags::CLONE_NEWNET) {
                bail!("the port table needs a network namespace of its own (root): {e}");
            }
            ip("link set lo up")?;
            table(total)
        })?;
    t.join().map_err(|_| anyhow!("the port bench panicked"))?
}

fn table(total: u64) -> Result<()> {
    let mut rounds = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        rounds.push(round(total)?);
    }
    let m = |i: usize, f: fn(&Run) -> f64| median(rounds.iter().map(|r| f(&r[i])).collect());
    // Each port line against the UDP line of its direction, round by round.
    let udp_of = |i: usize| if i < 3 { 2 } else { 5 };
    let ratios = |i: usize| {
        let mut v: Vec<f64> = rounds
            .iter()
            .map(|r| r[i].bytes_per_sec / r[udp_of(i)].bytes_per_sec)
            .collect();
        v.sort_by(f64::total_cmp);
        v
    };
    println!(
        " {:<44} {:>7} {:>7} {:>10} {:>9} {:>10} {:>9}",
        format!("Ethernet port, 1 MiB WRITE (median of {REPS})"),
        "GB/s",
        "vs UDP",
        "A µs/MiB",
        "A sys",
        "B µs/MiB",
        "B sys"
    );
    let names = [
        "port -> peer: TAP with UDP offloads",
        "port -> peer: TAP, frames whole",
        "UDP transport A -> B (loopback)",
        "peer -> port: TAP with UDP offloads",
        "peer -> port: TAP, frames whole",
        "UDP transport B -> A (loopback)",
    ];
    for (i, name) in names.iter().enumerate() {
        println!(
            " {name:<44} {:>7.2} {:>6.0}% {:>10.1} {:>9.1} {:>10.1} {:>9.1}",
            m(i, |r| r.bytes_per_sec) / 1e9,
            median(ratios(i)) * 100.0,
            m(i, |r| r.a_cpu) / 1e3,
            m(i, |r| r.a_sys) / 1e3,
            m(i, |r| r.b_cpu) / 1e3,
            m(i, |r| r.b_sys) / 1e3,
        );
    }
    let show = |v: Vec<f64>| {
        v.iter()
            .map(|r| format!("{:.0}%", r * 100.0))
            .collect::<Vec<_>>()
            .join(" ")
    };
    for (i, what) in [
        (0, "port -> peer, offloaded"),
        (1, "port -> peer, whole"),
        (3, "peer -> port, offloaded"),
        (4, "peer -> port, whole"),
    ] {
        println!(
            "   ({what} / UDP in each round, sorted: {})",
            show(ratios(i))
        );
    }
    for (i, what) in [(0, "port -> peer"), (3, "peer -> port")] {
        if let Some(s) = rounds.last().and_then(|r| r[i].eth) {
            println!(
                "   (last offloaded {what} run: {} packets out in {} GSO frames; {} in, {} GSO frames; {} dropped at the TAP, {} malformed)",
                s.uplink_tx,
                s.uplink_gso_tx,
                s.uplink_rx,
                s.uplink_gso_rx,
                s.uplink_full,
                s.bad_vnet
            );
        }
    }
    println!(
        "   (A: the port's device, or the UDP pair's first; B: its peer. Both busy-poll, so CPU is wall time; sys is the kernel's share)"
    );
    Ok(())
}
