//! The faces against engine-direct, in one run (issue 20):
//!
//! ```sh
//! cargo bench -p vrdma-tools --bench faces               # about 2 minutes
//! cargo bench -p vrdma-tools --bench faces -- --quick    # about 30 s (or FACES_QUICK=1)
//! ```
//!
//! Two devices on loopback UDP (127.30.x.y, a fresh pair for every
//! measurement), RC at MTU 4096, driven six ways:
//!
//! | line | the driver | the device |
//! |---|---|---|
//! | engine-direct | `vrdma_device::verbs`, as `vrdma bench`/`vrdma perf` | the driver's own thread (pinned, one core per side) |
//! | virtio, doorbells=poll | the virtio kit's front-end and verbs (WQEs in guest rings, doorbells in the context's area) | `vrdma_virtio::server::Server` over vhost-user; the device polls the doorbell areas while work flows |
//! | virtio, poll, B rings 1/ms | the same, the passive side's driver ringing its QP's doorbell once a millisecond (which keeps its device polling) | as doorbells=poll |
//! | virtio, doorbells=event | the same | every doorbell kicked, the device asleep between |
//! | pvrdma, doorbells=shared | the PVRDMA kit's driver model | `vrdma_pvrdma::Server` over vfio-user, polling every ring |
//! | pvrdma, doorbells=trap | the same, each post a doorbell write (a vfio-user message and its reply) | the same, waiting in `poll(2)` between |
//!
//! Three measurements on each: (a) 64-byte WRITE message rate (64 in
//! flight, one in 16 signaled), (b) 1 MiB WRITE bandwidth (16 in flight),
//! (c) 64-byte WRITE ping-pong half round trip (each side polls the last
//! byte of its buffer, as `ib_write_lat`). Each ends with a message whose
//! bytes are checked at the peer. The lines alternate within each round
//! (this machine has slow spells of seconds); each face's ratio to
//! engine-direct is the median of the rounds' ratios. First, a probe: five
//! lone 64-byte WRITEs to a peer whose driver does nothing, each timed to
//! its completion, and then the two devices' CPU over a second of both
//! drivers idle. Each measurement also records what the process's
//! threads did (`/proc/self/task/*/schedstat`): which busy-polled, the
//! cores used, and the run-queue wait.
//!
//! Options (after `--`): `--quick`, `--rounds N`, `--secs S` (each
//! measurement's measured part), `--pin` (each face side's driver and
//! device threads on one core: A's on CPU 0, B's on CPU 1), `--only
//! rate|bw|lat`, `--faces virtio-event,pvrdma-trap,…` (only those
//! lines beside engine-direct: engine, virtio-poll, virtio-rung,
//! virtio-event, pci-poll, pci-event, pvrdma-shared, pvrdma-trap), `--no-probe` (no lone WRITEs first), `--verbose`, and
//! the medium: `--shm` (each pair's devices on one same-host switch, as
//! one daemon's), `--shm-rings` (each device on a switch of its own, the
//! two joined through a rendezvous directory, as two daemons' with
//! `--shm-dir`: rings between them); UDP loopback without either.
//! With `FACES_SPIN=1` in the environment, each PVRDMA device prints its
//! polling policy's counters (`spin.*`, `vrdma_face::spin`) when it stops.

mod engine;
mod measure;
mod port;
mod pvrdma;
mod stepped;
mod threads;
mod virtio;

use std::{
    any::Any,
    net::{IpAddr, Ipv4Addr},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use measure::{Pins, Sample, Timing};
use port::Port;
use vrdma_fabric::shm::{JoinConfig, Switch};
use vrdma_wire::Gid;

/// This binary's loopback block (the test suites have 20–27).
const BLOCK: u8 = 30;

/// A fresh address of the block.
fn addr() -> IpAddr {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let k = NEXT.fetch_add(1, Ordering::Relaxed);
    let (hi, lo) = (k / 254 % 256, k % 254 + 1);
    IpAddr::V4(Ipv4Addr::new(127, BLOCK, hi as u8, lo as u8))
}

/// How the devices are driven.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
enum Face {
    Engine,
    VirtioPoll,
    /// Polled doorbells, the passive side's driver ringing once a
    /// millisecond.
    VirtioPollRung,
    VirtioEvent,
    VirtioPciPoll,
    VirtioPciEvent,
    PvrdmaShared,
    PvrdmaTrapped,
}

impl Face {
    /// The line's name for `--faces`.
    fn key(self) -> &'static str {
        match self {
            Face::Engine => "engine",
            Face::VirtioPoll => "virtio-poll",
            Face::VirtioPollRung => "virtio-rung",
            Face::VirtioEvent => "virtio-event",
            Face::VirtioPciPoll => "pci-poll",
            Face::VirtioPciEvent => "pci-event",
            Face::PvrdmaShared => "pvrdma-shared",
            Face::PvrdmaTrapped => "pvrdma-trap",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Face::Engine => "engine-direct",
            Face::VirtioPoll => "virtio, doorbells=poll",
            Face::VirtioPollRung => "virtio, poll, B rings 1/ms",
            Face::VirtioEvent => "virtio, doorbells=event",
            Face::VirtioPciPoll => "virtio-pci, doorbells=poll",
            Face::VirtioPciEvent => "virtio-pci, doorbells=event",
            Face::PvrdmaShared => "pvrdma, doorbells=shared",
            Face::PvrdmaTrapped => "pvrdma, doorbells=trap",
        }
    }
}

#[derive(Clone, Copy, Debug, Eq, PartialEq)]
enum Test {
    Rate,
    Bandwidth,
    Latency,
}

/// Two connected sides of `face`, what keeps their devices alive, and the
/// pins of their driver threads.
struct Setup {
    a: Box<dyn Port>,
    b: Box<dyn Port>,
    devices: Box<dyn Any>,
    pins: Pins,
    /// The two switches' rendezvous (`--shm-rings`): dropped after the
    /// devices.
    _rings: Option<Rings>,
}

/// What carries a pair's packets.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
enum Medium {
    Udp,
    /// One same-host switch: the devices of one daemon.
    Shm,
    /// A switch each, joined through a rendezvous directory: two daemons'.
    Rings,
}

/// Two switches' memberships of a rendezvous directory of their own; the
/// directory goes with them.
struct Rings {
    members: Option<(vrdma_fabric::shm::Rendezvous, vrdma_fabric::shm::Rendezvous)>,
    dir: std::path::PathBuf,
}

impl Drop for Rings {
    fn drop(&mut self) {
        drop(self.members.take());
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Side A's and side B's switches over `medium`, and the rendezvous that
/// joins two.
fn switches(medium: Medium, k: u32) -> (Option<Switch>, Option<Switch>, Option<Rings>) {
    match medium {
        Medium::Udp => (None, None, None),
        Medium::Shm => {
            let s = Switch::new();
            (Some(s.clone()), Some(s), None)
        }
        Medium::Rings => {
            let dir =
                std::env::temp_dir().join(format!("vrdma-faces-rings-{}-{k}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("a rendezvous directory");
            let (a, b) = (Switch::new(), Switch::new());
            let ra = a.join(JoinConfig::new(&dir)).expect("switch A joins");
            let rb = b.join(JoinConfig::new(&dir)).expect("switch B joins");
            let rings = Rings {
                members: Some((ra, rb)),
                dir,
            };
            (Some(a), Some(b), Some(rings))
        }
    }
}

/// Waits until each switch reaches the other side's address through the
/// rendezvous (a few milliseconds), so that the measurement runs on the
/// rings and not on the uplink.
fn joined(sa: &Switch, sb: &Switch, aa: IpAddr, ab: IpAddr) {
    let t = Instant::now();
    let (na, nb) = (sa.default_network(), sb.default_network());
    while !(sa.holds(&na, &Gid::from(ab)) && sb.holds(&nb, &Gid::from(aa))) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the two switches never reached each other's device"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A fresh pair of `face`. With `pin`, a face's side A (driver and device
/// threads) goes on CPU 0 and side B on CPU 1; engine-direct is always so
/// pinned, as `vrdma bench` pins it.
fn setup(face: Face, pin: bool, medium: Medium, k: u32) -> Setup {
    let (aa, ab) = (addr(), addr());
    let (switch_a, switch_b, rings) = switches(medium, k);
    let (swa, swb) = (switch_a.as_ref(), switch_b.as_ref());
    let mut s = setup_on(face, pin, [aa, ab], [swa, swb], k);
    if let (Medium::Rings, Some(sa), Some(sb)) = (medium, swa, swb) {
        joined(sa, sb, aa, ab);
    }
    s._rings = rings;
    s
}

fn setup_on(
    face: Face,
    pin: bool,
    [aa, ab]: [IpAddr; 2],
    [swa, swb]: [Option<&Switch>; 2],
    k: u32,
) -> Setup {
    let both = Pins {
        a: Some(0),
        b: Some(1),
    };
    let face_pins = if pin { both } else { Pins::default() };
    match face {
        Face::Engine => {
            let (a, b) = engine::pair(aa, ab, [swa, swb]);
            Setup {
                a: Box::new(a),
                b: Box::new(b),
                devices: Box::new(()),
                pins: both,
                _rings: None,
            }
        }
        Face::VirtioPoll | Face::VirtioPollRung | Face::VirtioEvent => {
            let poll = face != Face::VirtioEvent;
            let da = virtio::device(aa, &format!("v{k}a"), poll, swa);
            let db = virtio::device(ab, &format!("v{k}b"), poll, swb);
            let ((a, wa), (b, wb)) = virtio::pair(&da, &db, face == Face::VirtioPollRung);
            if pin {
                wa.iter().for_each(|&t| threads::pin(t, 0));
                wb.iter().for_each(|&t| threads::pin(t, 1));
            }
            Setup {
                a: Box::new(a),
                b: Box::new(b),
                devices: Box::new((da, db)),
                pins: face_pins,
                _rings: None,
            }
        }
        Face::VirtioPciPoll | Face::VirtioPciEvent => {
            let poll = face == Face::VirtioPciPoll;
            let names = [format!("vp{k}a"), format!("vp{k}b")];
            let da = virtio::pci_device(aa, &names[0], poll, swa);
            let db = virtio::pci_device(ab, &names[1], poll, swb);
            let ((a, wa), (b, wb)) = virtio::pci_pair(&da, &db, [&names[0], &names[1]], 0);
            if pin {
                wa.iter().for_each(|&t| threads::pin(t, 0));
                wb.iter().for_each(|&t| threads::pin(t, 1));
            }
            Setup {
                a: Box::new(a),
                b: Box::new(b),
                devices: Box::new((da, db)),
                pins: face_pins,
                _rings: None,
            }
        }
        Face::PvrdmaShared | Face::PvrdmaTrapped => {
            let shared = face == Face::PvrdmaShared;
            let qps = pvrdma::MAX_QP;
            let da = pvrdma::Device::new(aa, &format!("p{k}a"), shared, swa.cloned(), qps);
            let db = pvrdma::Device::new(ab, &format!("p{k}b"), shared, swb.cloned(), qps);
            if pin {
                threads::pin(da.tid, 0);
                threads::pin(db.tid, 1);
            }
            let (a, b) = pvrdma::pair(&da, &db, !shared, 0);
            Setup {
                a: Box::new(a),
                b: Box::new(b),
                devices: Box::new((da, db)),
                pins: face_pins,
                _rings: None,
            }
        }
    }
}

/// One measurement of `test` on a fresh pair of `face`.
fn measure(face: Face, test: Test, opts: &Opts, k: u32) -> Sample {
    if opts.verbose {
        eprintln!("  {test:?} on {}", face.name());
    }
    let s = setup(face, opts.pin, opts.medium, k);
    let seed = k.wrapping_mul(2_654_435_761);
    let (mut sample, (a, b)) = match test {
        Test::Rate => measure::rate(s.a, s.b, s.pins, opts.timing, seed),
        Test::Bandwidth => measure::bandwidth(s.a, s.b, s.pins, opts.timing, seed),
        Test::Latency => measure::latency(s.a, s.b, s.pins, opts.timing, seed),
    };
    sample.timeouts = a.retry_timeouts();
    // The guests go before their devices.
    drop((a, b));
    drop(s.devices);
    sample
}

#[derive(Clone, Debug)]
struct Opts {
    rounds: usize,
    timing: Timing,
    pin: bool,
    /// What carries each pair's packets.
    medium: Medium,
    /// Says each measurement as it starts.
    verbose: bool,
    /// Skips the lone-WRITE probe.
    no_probe: bool,
    faces: Vec<Face>,
    tests: Vec<Test>,
    /// The stepped mode (`stepped`).
    stepped: bool,
    /// QPs made on each device beside the measured one, never used.
    idle_qps: u32,
}

fn opts() -> Opts {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick")
        || std::env::var_os("FACES_QUICK").is_some_and(|v| v != "0");
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let rounds = value("--rounds")
        .map(|v| v.parse().expect("--rounds N"))
        .unwrap_or(if quick { 3 } else { 5 });
    let secs: f64 = value("--secs")
        .map(|v| v.parse().expect("--secs S"))
        .unwrap_or(if quick { 0.25 } else { 1.0 });
    let every = [
        Face::Engine,
        Face::VirtioPoll,
        Face::VirtioPollRung,
        Face::VirtioEvent,
        Face::VirtioPciPoll,
        Face::VirtioPciEvent,
        Face::PvrdmaShared,
        Face::PvrdmaTrapped,
    ];
    // engine-direct is always the first line: every ratio is against it.
    let faces = match value("--faces") {
        None => every.to_vec(),
        Some(keys) => {
            let mut faces = vec![Face::Engine];
            for key in keys.split(',') {
                let face = every.iter().find(|f| f.key() == key).unwrap_or_else(|| {
                    let keys: Vec<_> = every.iter().map(|f| f.key()).collect();
                    panic!("--faces {key}: one of {}", keys.join(","))
                });
                if !faces.contains(face) {
                    faces.push(*face);
                }
            }
            faces
        }
    };
    let tests = match value("--only").as_deref() {
        None => vec![Test::Rate, Test::Bandwidth, Test::Latency],
        Some("rate") => vec![Test::Rate],
        Some("bw") => vec![Test::Bandwidth],
        Some("lat") => vec![Test::Latency],
        Some(o) => panic!("--only {o}: rate, bw or lat"),
    };
    Opts {
        rounds,
        timing: Timing {
            warm: Duration::from_secs_f64(secs / 5.0),
            measure: Duration::from_secs_f64(secs),
        },
        pin: args.iter().any(|a| a == "--pin"),
        medium: if args.iter().any(|a| a == "--shm-rings") {
            Medium::Rings
        } else if args.iter().any(|a| a == "--shm") {
            Medium::Shm
        } else {
            Medium::Udp
        },
        verbose: args.iter().any(|a| a == "--verbose"),
        no_probe: args.iter().any(|a| a == "--no-probe"),
        faces,
        tests,
        stepped: args.iter().any(|a| a == "--stepped"),
        idle_qps: value("--idle-qps")
            .map(|v| v.parse().expect("--idle-qps N"))
            .unwrap_or(0),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    assert!(!v.is_empty(), "a median of nothing");
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn quantile(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() as f64 * q) as usize).min(s.len() - 1)]
}

fn sorted(mut v: Vec<f64>, f: impl Fn(f64) -> String) -> String {
    v.sort_by(f64::total_cmp);
    v.into_iter().map(f).collect::<Vec<_>>().join(" ")
}

/// Every round's samples: `[round][face]` for each test.
type Rounds = Vec<Vec<Sample>>;

fn main() {
    let run_dir = std::env::temp_dir().join(format!("vrdma-faces-run-{}", std::process::id()));
    // SAFETY: no other thread exists yet (the first device is made below),
    // so nothing reads the environment concurrently.
    unsafe { std::env::set_var("VRDMA_RUN_DIR", &run_dir) };
    let opts = opts();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "faces: {} rounds, each measurement {:.2} s after {:.2} s of warm-up, a fresh device pair each; {}, RC at MTU 4096; {cpus} CPUs; face threads {}",
        opts.rounds,
        opts.timing.measure.as_secs_f64(),
        opts.timing.warm.as_secs_f64(),
        match opts.medium {
            Medium::Shm => "the pair on one same-host switch (shm, as one daemon's)",
            Medium::Rings =>
                "each device on a switch of its own, the two joined by a rendezvous (shm rings, as two daemons')",
            Medium::Udp => "loopback 127.30.x.y",
        },
        if opts.pin {
            "pinned (side A on CPU 0, side B on CPU 1)"
        } else {
            "unpinned (engine-direct pinned, as vrdma bench)"
        }
    );
    let start = Instant::now();
    if opts.stepped {
        stepped_run(&opts);
        println!("\n(run took {:.0} s)", start.elapsed().as_secs_f64());
        let _ = std::fs::remove_dir_all(&run_dir);
        return;
    }
    if !opts.no_probe {
        probe(&opts);
    }
    let mut all: Vec<(Test, Rounds)> = opts.tests.iter().map(|&t| (t, Vec::new())).collect();
    let mut k = 0;
    for r in 0..opts.rounds {
        for (test, rounds) in all.iter_mut() {
            let mut row = Vec::new();
            for &face in &opts.faces {
                k += 1;
                // A failure ends the run at once: the devices of a failed
                // measurement are not taken down (their threads may be
                // what failed).
                let m = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    measure(face, *test, &opts, k)
                }));
                match m {
                    Ok(s) => row.push(s),
                    Err(_) => {
                        eprintln!(
                            "faces: {test:?} on {} failed (round {})",
                            face.name(),
                            r + 1
                        );
                        std::process::exit(101);
                    }
                }
            }
            rounds.push(row);
        }
        eprintln!(
            "  round {} of {} done at {:.0} s",
            r + 1,
            opts.rounds,
            start.elapsed().as_secs_f64()
        );
    }
    report(&opts, &all);
    println!("\n(run took {:.0} s)", start.elapsed().as_secs_f64());
    let _ = std::fs::remove_dir_all(&run_dir);
}

/// Lone 64-byte WRITEs to a peer whose driver does nothing (a WRITE's
/// target, as `ib_write_bw`'s server): how long each takes to complete,
/// and the requester's retransmit timeouts meanwhile.
fn probe(opts: &Opts) {
    const N: u32 = 5;
    println!(
        "\nlone 64 B WRITEs, A to B, {N} of them 20 ms apart, B's driver idle: post to completion; then both drivers idle for 1 s: the two devices' CPU"
    );
    // (The line whose B rings once a millisecond is the poll line here:
    // B has no thread in this probe.)
    let faces = opts.faces.iter().filter(|&&f| f != Face::VirtioPollRung);
    for (k, &face) in faces.enumerate() {
        let mut s = setup(face, false, opts.medium, 10_000 + k as u32);
        let before = s.a.retry_timeouts();
        let times = measure::lone_writes(&mut *s.a, &mut *s.b, N, Duration::from_millis(20));
        let after = s.a.retry_timeouts();
        let timeouts = match (before, after) {
            (Some(b), Some(a)) => format!("{}", a - b),
            _ => "-".to_owned(),
        };
        // Then both drivers idle for a second: what the process's threads
        // (the two devices', the drivers asleep) cost meanwhile.
        let idle = Duration::from_secs(1);
        let t0 = threads::snapshot();
        let w0 = Instant::now();
        std::thread::sleep(idle);
        let used = t0.until(&threads::snapshot(), w0.elapsed()).cores;
        println!(
            " {:<26} median {:>9.1} us, max {:>9.1} us; A's retransmit timeouts: {timeouts}; idle: {:.2} % of a core",
            face.name(),
            median(times.clone()) / 1e3,
            times.iter().copied().fold(0.0, f64::max) / 1e3,
            used * 100.0
        );
        drop((s.a, s.b));
        drop(s.devices);
    }
}

/// A sample's value: the rate, or the typical half round trip; none when
/// it stalled.
fn value(test: Test, s: &Sample) -> Option<f64> {
    if s.stalled.is_some() || s.values.is_empty() {
        return None;
    }
    Some(match test {
        Test::Latency => median(s.values.clone()),
        _ => s.values[0],
    })
}

/// Face `i`'s values and its ratios to engine-direct (face / engine) in
/// the rounds where neither stalled; and what stalled.
fn rounds_of(
    test: Test,
    rounds: &Rounds,
    i: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<measure::Stall>) {
    let (mut mine, mut ratios, mut diffs, mut stalls) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for row in rounds {
        if let Some(st) = &row[i].stalled {
            stalls.push(st.clone());
        }
        if let Some(m) = value(test, &row[i]) {
            mine.push(m);
            if let Some(e) = value(test, &row[0]) {
                ratios.push(m / e);
                diffs.push(m - e);
            }
        }
    }
    (mine, ratios, diffs, stalls)
}

/// "stalled in k of n rounds …", or nothing.
fn stalls_note(stalls: &[measure::Stall], n: usize) -> String {
    if stalls.is_empty() {
        return String::new();
    }
    let resumed = stalls.iter().filter(|s| s.kick_resumed).count();
    let at: Vec<String> = stalls
        .iter()
        .map(|s| format!("{}/{}", s.done, s.posted))
        .collect();
    format!(
        "  STALLED in {} of {n} rounds (completed/posted: {}; one doorbell kick resumed it in {} of them)",
        stalls.len(),
        at.join(" "),
        resumed
    )
}

/// The table, the targets and the threads.
fn report(opts: &Opts, all: &[(Test, Rounds)]) {
    let faces = &opts.faces;
    for (test, rounds) in all {
        println!();
        let (title, unit, scale): (&str, &str, f64) = match test {
            Test::Rate => (
                "64 B RDMA WRITE message rate (64 in flight, 1 in 16 signaled)",
                "Mmsg/s",
                1e-6,
            ),
            Test::Bandwidth => ("1 MiB RDMA WRITE bandwidth (16 in flight)", "MB/s", 1e-6),
            Test::Latency => (
                "64 B RDMA WRITE half round trip (ib_write_lat's ping-pong)",
                "us",
                1e-3,
            ),
        };
        println!("{title}");
        match test {
            Test::Latency => println!(
                " {:<26} {:>9} {:>9} {:>10} {:>10}   rounds (face / engine, sorted)",
                "", "typical", "99%", "vs engine", "- engine"
            ),
            _ => println!(
                " {:<26} {:>9} {:>10}   rounds (face / engine, sorted)",
                "", unit, "vs engine"
            ),
        }
        for (i, face) in faces.iter().enumerate() {
            let (mine, ratios, diffs, stalls) = rounds_of(*test, rounds, i);
            let note = stalls_note(&stalls, rounds.len());
            if mine.is_empty() || ratios.is_empty() {
                println!(" {:<26} {:>9}{note}", face.name(), "-");
                continue;
            }
            let ratio = median(ratios.clone());
            match test {
                Test::Latency => {
                    let every: Vec<f64> = rounds
                        .iter()
                        .flat_map(|row| row[i].values.clone())
                        .collect();
                    println!(
                        " {:<26} {:>9.2} {:>9.2} {:>9.2}x {:>+10.2}   {}{note}",
                        face.name(),
                        median(mine) * scale,
                        quantile(&every, 0.99) * scale,
                        ratio,
                        median(diffs) * scale,
                        sorted(ratios, |r| format!("{r:.2}x"))
                    );
                }
                _ => println!(
                    " {:<26} {:>9.2} {:>9.0}%   {}{note}",
                    face.name(),
                    median(mine) * scale,
                    ratio * 100.0,
                    sorted(ratios, |r| format!("{:.0}%", r * 100.0))
                ),
            }
        }
    }
    targets(opts, all);
    cpu_table(opts, all);
    threads_table(opts, all);
}

/// The issue's targets, for the virtio-rdma face with polled doorbells.
fn targets(opts: &Opts, all: &[(Test, Rounds)]) {
    for face in [Face::VirtioPoll, Face::VirtioPollRung] {
        if let Some(v) = opts.faces.iter().position(|&f| f == face) {
            targets_of(face, v, all);
        }
    }
}

fn targets_of(face: Face, v: usize, all: &[(Test, Rounds)]) {
    println!(
        "\nissue 20's targets: {} against engine-direct (medians of rounds)",
        face.name()
    );
    for (test, rounds) in all {
        let (_, ratios, diffs, _) = rounds_of(*test, rounds, v);
        if ratios.is_empty() {
            println!("  {test:?}: no round completed");
            continue;
        }
        match test {
            Test::Rate | Test::Bandwidth => {
                let r = median(ratios);
                let (what, goal) = if *test == Test::Rate {
                    ("64 B message rate", 0.8)
                } else {
                    ("1 MiB WRITE bandwidth", 0.9)
                };
                println!(
                    "  {what:<34} {:>6.0}%  (goal >= {:.0}%: {})",
                    r * 100.0,
                    goal * 100.0,
                    if r >= goal { "met" } else { "NOT met" }
                );
            }
            Test::Latency => {
                let d = median(diffs) / 1e3;
                println!(
                    "  {:<34} {:>+6.2} us (goal <= 1 us: {})",
                    "doorbell's cost to a half RTT",
                    d,
                    if d <= 1.0 { "met" } else { "NOT met" }
                );
            }
        }
    }
}

/// The threads' CPU time per operation (their own clocks, so a scheduler
/// that keeps a thread waiting adds nothing): all threads, the drivers'
/// and the devices', per 64 B WRITE (rate), per MiB (bandwidth) and per
/// half round trip (latency); and each face's devices' cost over
/// engine-direct's whole (whose threads are driver and device at once).
fn cpu_table(opts: &Opts, all: &[(Test, Rounds)]) {
    println!(
        "\nCPU time per operation, thread clocks (medians of rounds): all threads = driver + device; engine-direct's threads are both (counted as driver); device - engine = the face's devices' time plus its drivers' beyond engine-direct's"
    );
    println!(
        " {:<26} {:>30} {:>30} {:>30}",
        "", "64 B WRITE ns: all drv dev", "1 MiB WRITE us: all drv dev", "half RTT ns: all drv dev"
    );
    let per = |test: Test, i: usize| -> Option<(f64, f64, f64)> {
        let ok: Vec<&Sample> = all
            .iter()
            .find(|(t, _)| *t == test)?
            .1
            .iter()
            .map(|row| &row[i])
            .filter(|s| s.stalled.is_none() && s.ops > 0.0)
            .collect();
        if ok.is_empty() {
            return None;
        }
        let scale = if test == Test::Bandwidth { 1e-3 } else { 1.0 };
        let f =
            |g: &dyn Fn(&Sample) -> f64| median(ok.iter().map(|s| g(s) / s.ops * scale).collect());
        Some((
            f(&|s| s.threads.driver_ns + s.threads.device_ns),
            f(&|s| s.threads.driver_ns),
            f(&|s| s.threads.device_ns),
        ))
    };
    let tests = [Test::Rate, Test::Bandwidth, Test::Latency];
    for (i, face) in opts.faces.iter().enumerate() {
        let mut line = format!(" {:<26}", face.name());
        for &test in &tests {
            line += &match per(test, i) {
                Some((a, d, v)) => format!(" {a:>12.1} {d:>8.1} {v:>8.1}"),
                None => format!(" {:>30}", "-"),
            };
        }
        println!("{line}");
    }
    println!(" over engine-direct (all threads, face - engine):");
    for (i, face) in opts.faces.iter().enumerate().skip(1) {
        let mut line = format!(" {:<26}", face.name());
        for &test in &tests {
            line += &match (per(test, i), per(test, 0)) {
                (Some((a, _, _)), Some((e, _, _))) => {
                    format!(
                        " {:>+12.1} {:>16}",
                        a - e,
                        format!("({:.0} %)", (a / e - 1.0) * 100.0)
                    )
                }
                _ => format!(" {:>30}", "-"),
            };
        }
        println!("{line}");
    }
}

/// What the threads did: how many ran at least half the time, the cores
/// used, and how many waited for a core on average.
fn threads_table(opts: &Opts, all: &[(Test, Rounds)]) {
    println!(
        "\nthreads during the measured part (medians of rounds): busy = threads that wanted a core >= 80 % of the time (running or runnable: busy-polling); cores = CPU time / wall time; wait = run-queue time / wall time (threads runnable without a core, on average)"
    );
    println!(
        " {:<26} {:>22} {:>22} {:>22}   kicks/post (rate)",
        "", "rate: busy cores wait", "bw: busy cores wait", "lat: busy cores wait"
    );
    for (i, face) in opts.faces.iter().enumerate() {
        let mut line = format!(" {:<26}", face.name());
        let mut kicks = String::new();
        let mut timeouts = Vec::new();
        for test in [Test::Rate, Test::Bandwidth, Test::Latency] {
            let all_runs: Vec<&Sample> = all
                .iter()
                .find(|(t, _)| *t == test)
                .map(|(_, rounds)| rounds.iter().map(|row| &row[i]).collect())
                .unwrap_or_default();
            let known: Vec<f64> = all_runs
                .iter()
                .filter_map(|s| s.timeouts)
                .map(|n| n as f64)
                .collect();
            timeouts.push(if known.is_empty() {
                "-".to_owned()
            } else {
                format!("{:.0}", median(known))
            });
            let ok: Vec<&Sample> = all
                .iter()
                .find(|(t, _)| *t == test)
                .map(|(_, rounds)| {
                    rounds
                        .iter()
                        .map(|row| &row[i])
                        .filter(|s| s.stalled.is_none())
                        .collect()
                })
                .unwrap_or_default();
            if ok.is_empty() {
                line += &format!(" {:>22}", "-");
                continue;
            }
            let f = |g: &dyn Fn(&Sample) -> f64| median(ok.iter().map(|s| g(s)).collect());
            line += &format!(
                " {:>10.0} {:>5.2} {:>5.2}",
                f(&|s| f64::from(s.threads.busy)),
                f(&|s| s.threads.cores),
                f(&|s| s.threads.waiting)
            );
            if test == Test::Rate && ok[0].kicks_per_post.is_some() {
                kicks = format!("{:.4}", f(&|s| s.kicks_per_post.unwrap_or(0.0)));
            }
        }
        println!("{line}   {kicks:<10}   {}", timeouts.join(" "));
    }
    println!(" busy threads in the last round (rate | bw | lat):");
    for (i, face) in opts.faces.iter().enumerate() {
        let names: Vec<String> = [Test::Rate, Test::Bandwidth, Test::Latency]
            .iter()
            .map(|&test| {
                all.iter()
                    .find(|(t, _)| *t == test)
                    .and_then(|(_, rounds)| rounds.last())
                    .map_or("-".to_owned(), |row| row[i].threads.names.join(" "))
            })
            .collect();
        println!("   {:<26} {}", face.name(), names.join(" | "));
    }
}

/// The lines the stepped mode can step (see `stepped`).
fn steppable(face: Face) -> bool {
    matches!(
        face,
        Face::Engine | Face::PvrdmaShared | Face::VirtioPciPoll
    )
}

/// A fresh pair of `face` for the stepped mode, its devices held (their
/// rounds the caller's), and what keeps the devices alive.
fn stepped_pair(face: Face, opts: &Opts, k: u32) -> (stepped::Pair, Box<dyn Any>, Resume) {
    let (aa, ab) = (addr(), addr());
    let (switch_a, switch_b, rings) = switches(opts.medium, k);
    let (swa, swb) = (switch_a.as_ref(), switch_b.as_ref());
    let idle = opts.idle_qps;
    let none = || -> stepped::Step { Box::new(|| false) };
    let (pair, devices, resume): (stepped::Pair, Box<dyn Any>, Resume) = match face {
        Face::Engine => {
            let (a, b) = engine::pair(aa, ab, [swa, swb]);
            let pair = stepped::Pair {
                a: Box::new(a),
                b: Box::new(b),
                steps: [none(), none()],
            };
            (pair, Box::new(()), Box::new(|_| {}))
        }
        Face::PvrdmaShared => {
            let qps = pvrdma::MAX_QP.max(idle + 16);
            let mut da = pvrdma::Device::new(aa, &format!("s{k}a"), true, swa.cloned(), qps);
            let mut db = pvrdma::Device::new(ab, &format!("s{k}b"), true, swb.cloned(), qps);
            let (a, b) = pvrdma::pair(&da, &db, false, idle);
            da.hold();
            db.hold();
            let pair = stepped::Pair {
                a: Box::new(a),
                b: Box::new(b),
                steps: [da.stepper(), db.stepper()],
            };
            let resume: Resume = Box::new(|d: &mut dyn Any| {
                if let Some((da, db)) = d.downcast_mut::<(pvrdma::Device, pvrdma::Device)>() {
                    da.resume();
                    db.resume();
                }
            });
            (pair, Box::new((da, db)), resume)
        }
        Face::VirtioPciPoll => {
            let names = [format!("sp{k}a"), format!("sp{k}b")];
            let da = virtio::pci_device(aa, &names[0], true, swa);
            let db = virtio::pci_device(ab, &names[1], true, swb);
            let ((a, _), (b, _)) = virtio::pci_pair(&da, &db, [&names[0], &names[1]], idle);
            da.hold().expect("A's device thread");
            db.hold().expect("B's device thread");
            let step = |d: &std::sync::Arc<virtio::PciDevice>| -> stepped::Step {
                let d = d.clone();
                Box::new(move || d.step().expect("the device's step"))
            };
            let pair = stepped::Pair {
                a: Box::new(a),
                b: Box::new(b),
                steps: [step(&da), step(&db)],
            };
            let resume: Resume = Box::new(|d: &mut dyn Any| {
                type Both = (
                    std::sync::Arc<virtio::PciDevice>,
                    std::sync::Arc<virtio::PciDevice>,
                );
                if let Some((da, db)) = d.downcast_mut::<Both>() {
                    da.resume();
                    db.resume();
                }
            });
            (pair, Box::new((da, db)), resume)
        }
        _ => unreachable!("only steppable lines are stepped"),
    };
    if let (Medium::Rings, Some(sa), Some(sb)) = (opts.medium, swa, swb) {
        joined(sa, sb, aa, ab);
    }
    (pair, Box::new((devices, rings, switch_a, switch_b)), resume)
}

/// What `stepped_pair` keeps: the devices, the rendezvous, the switches.
type Kept = (Box<dyn Any>, Option<Rings>, Option<Switch>, Option<Switch>);

/// Gives held devices (what `stepped_pair` kept of them) their threads
/// back, for their guests' goodbyes.
type Resume = Box<dyn FnOnce(&mut dyn Any)>;

/// The stepped mode: every steppable line, each test, in rounds; each
/// measurement a fixed number of operations after a quarter as many of
/// warm-up; medians of rounds of each phase's CPU time per operation.
fn stepped_run(opts: &Opts) {
    let faces: Vec<Face> = opts
        .faces
        .iter()
        .copied()
        .filter(|&f| steppable(f))
        .collect();
    let cost = stepped::clock_cost();
    let scale = opts.timing.measure.as_secs_f64();
    let ops = |test: Test| -> u64 {
        let base = match test {
            Test::Rate => 200_000.0,
            Test::Bandwidth => 1_000.0,
            Test::Latency => 20_000.0,
        };
        ((base * scale) as u64).max(16)
    };
    println!(
        "\nstepped: both drivers and both devices advanced in turn on one thread, no scheduler between them; each phase's CPU time from the thread's own clock (one read: {cost:.0} ns, subtracted); {} QPs idle on each device beside the measured one",
        opts.idle_qps
    );
    // [test][face] -> every round's phases.
    let mut all: Vec<Vec<Vec<stepped::Phases>>> =
        vec![vec![Vec::new(); faces.len()]; opts.tests.len()];
    let mut k = 20_000;
    for r in 0..opts.rounds {
        for (t, &test) in opts.tests.iter().enumerate() {
            for (f, &face) in faces.iter().enumerate() {
                k += 1;
                let (mut pair, mut devices, resume) = stepped_pair(face, opts, k);
                let seed = k;
                let ph = match test {
                    Test::Rate => stepped::rate(&mut pair, cost, ops(test), seed),
                    Test::Bandwidth => stepped::bandwidth(&mut pair, cost, ops(test), seed),
                    Test::Latency => stepped::latency(&mut pair, cost, ops(test), seed),
                };
                // The guests' goodbyes need devices that answer.
                if let Some((d, ..)) = devices.downcast_mut::<Kept>() {
                    resume(&mut **d);
                }
                drop(pair);
                drop(devices);
                all[t][f].push(ph);
            }
        }
        eprintln!("  round {} of {} done", r + 1, opts.rounds);
    }
    let engine = faces.iter().position(|&f| f == Face::Engine);
    for (t, &test) in opts.tests.iter().enumerate() {
        let (what, unit, scale) = match test {
            Test::Rate => (
                "64 B WRITE (64 in flight, 1 in 16 signaled)",
                "ns per WRITE",
                1.0,
            ),
            Test::Bandwidth => ("1 MiB WRITE (16 in flight)", "us per MiB", 1e-3),
            Test::Latency => ("64 B WRITE ping-pong", "ns per half round trip", 1.0),
        };
        println!("\n{what}: {unit}, medians of {} rounds", opts.rounds);
        println!(
            " {:<28} {:>10} {:>10} {:>10} {:>14} {:>14} {:>10} {:>12}",
            "",
            "all",
            "drivers",
            "devices",
            "all - engine",
            "devices/engine",
            "loops/op",
            "idle rounds"
        );
        let med = |f: usize, g: &dyn Fn(&stepped::Phases) -> f64| -> f64 {
            median(all[t][f].iter().map(g).collect())
        };
        let all_of = |f: usize| med(f, &|p| (p.driver + p.device) / p.ops);
        for (f, &face) in faces.iter().enumerate() {
            let (drv, dev) = (med(f, &|p| p.per_op().0), med(f, &|p| p.per_op().1));
            let every = all_of(f);
            // engine-direct's rounds are its ports' own (not counted).
            let idle = if face == Face::Engine {
                format!("{:>12}", "-")
            } else {
                let idle = med(f, &|p| p.idle_rounds / (2.0 * p.loops).max(1.0));
                format!("{:>11.0}%", idle * 100.0)
            };
            let (over, ratio) = match engine {
                Some(e) if e != f => (
                    format!("{:>+14.1}", (every - all_of(e)) * scale),
                    format!("{:>13.2}x", dev / all_of(e)),
                ),
                _ => (format!("{:>14}", "-"), format!("{:>14}", "-")),
            };
            println!(
                " {:<28} {:>10.1} {:>10.1} {:>10.1} {over} {ratio} {:>10.2} {idle}",
                face.name(),
                every * scale,
                drv * scale,
                dev * scale,
                med(f, &|p| p.loops / p.ops),
            );
        }
    }
    println!(
        "\n(all - engine: what the face adds per operation over engine-direct, drivers and devices together; devices/engine: the face's devices' time against engine-direct's whole, whose driver is its device; loops/op: rounds of the loop — each a round of both devices — per operation; idle rounds: the devices' rounds that found nothing)"
    );
}
