//! The stepped mode (`--stepped`, issue 33 item 1): both drivers and both
//! devices of a pair advanced in turn on this one thread — A's driver posts
//! and rings, A's device takes a round, B's device, then the drivers poll
//! — so that no scheduler sits between them and nothing spins: each
//! phase's cost is the thread's own CPU clock over it
//! (`CLOCK_THREAD_CPUTIME_ID`, the clock's own read subtracted), per
//! operation, the same on any machine. A device round is one that never
//! sleeps (`vrdma_face::vfio::Server::step`): the lines stepped are those
//! whose device is a vfio-user server (PVRDMA with shared doorbells,
//! virtio-rdma as a virtio-pci function with polled doorbells) and
//! engine-direct (whose driver holds its device: its post goes into the
//! engine, its round is `Context::progress`). virtio-rdma over vhost-user
//! runs the same face code as virtio-pci, in a thread the vhost-user
//! library owns, so it is not stepped.

use std::time::{Duration, Instant};

use nix::time::{ClockId, clock_gettime};

use crate::port::{Port, layout, pattern};

/// A device round the stepped mode runs (a held device's `step`); whether
/// it did work.
pub type Step = Box<dyn FnMut() -> bool + Send>;

/// A pair as the stepped mode drives it.
pub struct Pair {
    pub a: Box<dyn Port>,
    pub b: Box<dyn Port>,
    /// A's device round and B's (engine-direct: none; its ports' `round`).
    pub steps: [Step; 2],
}

/// The CPU time of one measurement's phases, ns, summed over its
/// operations.
#[derive(Clone, Copy, Debug, Default)]
pub struct Phases {
    /// Both drivers: posting, ringing, polling, looking at the buffer.
    pub driver: f64,
    /// Both devices' rounds (engine-direct: the engine's rounds).
    pub device: f64,
    /// Operations measured (WRITEs; MiB; half round trips).
    pub ops: f64,
    /// Rounds of the loop, and the device rounds that found nothing.
    pub loops: f64,
    pub idle_rounds: f64,
}

impl Phases {
    pub fn per_op(&self) -> (f64, f64) {
        (self.driver / self.ops, self.device / self.ops)
    }
}

/// This thread's CPU time, ns.
fn cpu() -> u64 {
    let t = clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID).expect("the thread's CPU clock");
    t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
}

/// What one read of the clock adds to the phase it ends (the median of
/// back-to-back reads), subtracted from every phase.
pub fn clock_cost() -> f64 {
    let mut d: Vec<u64> = (0..2001)
        .map(|_| {
            let t = cpu();
            cpu() - t
        })
        .collect();
    d.sort_unstable();
    d[d.len() / 2] as f64
}

/// The phases' clock: each `lap` ends a phase and returns its CPU time,
/// less what the clock's read costs.
struct Laps {
    last: u64,
    cost: f64,
}

impl Laps {
    fn new(cost: f64) -> Self {
        Laps { last: cpu(), cost }
    }

    fn lap(&mut self) -> f64 {
        let now = cpu();
        let d = (now - self.last) as f64 - self.cost;
        self.last = now;
        d.max(0.0)
    }
}

/// How long the loop may go without a completion before the run is
/// declared stalled (a bench that hangs tells nothing).
const STUCK: Duration = Duration::from_secs(5);

const RATE_WINDOW: u64 = 64;
const SIGNAL_EVERY: u64 = 16;
const BW_WINDOW: u64 = 16;
const MIB: u64 = 1 << 20;
const SMALL: u32 = 64;

/// One of the stepped loop's rounds: A's device, then B's; their time is
/// the devices'. Returns how many found nothing.
fn devices(p: &mut Pair, laps: &mut Laps, ph: &mut Phases) {
    p.a.round();
    let a = (p.steps[0])();
    p.b.round();
    let b = (p.steps[1])();
    ph.device += laps.lap();
    ph.idle_rounds += f64::from(u8::from(!a)) + f64::from(u8::from(!b));
    ph.loops += 1.0;
}

/// Reaps A's completions (each must have succeeded); the last one's wr_id.
fn reap(a: &mut dyn Port, wcs: &mut Vec<(u64, u32)>) -> Option<u64> {
    wcs.clear();
    a.poll_ready(wcs);
    crate::measure::last_ok(wcs)
}

/// `len`-byte WRITEs, `window` in flight, one in `every` signaled, until
/// `warm + ops` have completed; the phases of the last `ops`. Ends with a
/// WRITE whose bytes are checked at the peer.
#[allow(clippy::too_many_arguments)]
fn writes(
    p: &mut Pair,
    cost: f64,
    (len, window, every): (u32, u64, u64),
    (src, dst, slots, stride): (u64, u64, u64, u64),
    warm: u64,
    ops: u64,
    seed: u32,
) -> Phases {
    let span = (slots * stride).max(u64::from(len));
    p.a.put(src, &pattern(seed ^ 0x55, span as usize));
    let mut wcs = Vec::new();
    let (mut posted, mut done) = (0u64, 0u64);
    let mut ph = Phases::default();
    let mut laps = Laps::new(cost);
    let mut progress = Instant::now();
    let mut measuring = false;
    while done < warm + ops {
        if !measuring && done >= warm {
            measuring = true;
            ph = Phases::default();
            laps = Laps::new(cost);
        }
        let before = posted;
        while posted - done < window {
            posted += 1;
            let slot = (posted % slots) * stride;
            let signaled = posted.is_multiple_of(every);
            p.a.post_write(posted, src + slot, len, dst + slot, signaled);
        }
        if posted > before {
            p.a.ring();
        }
        ph.driver += laps.lap();
        devices(p, &mut laps, &mut ph);
        if let Some(id) = reap(&mut *p.a, &mut wcs) {
            done = id;
            progress = Instant::now();
        }
        ph.driver += laps.lap();
        assert!(
            progress.elapsed() < STUCK,
            "stalled: {done} of {posted} WRITEs completed"
        );
    }
    ph.ops = ops as f64;
    // The last WRITE, checked at the peer.
    let check = pattern(seed, len as usize);
    let last = src + slots * stride;
    p.a.put(last, &check);
    posted += 1;
    p.a.post_write(posted, last, len, dst + slots * stride, true);
    p.a.ring();
    let t = Instant::now();
    while reap(&mut *p.a, &mut wcs) != Some(posted) {
        devices(p, &mut laps, &mut Phases::default());
        assert!(t.elapsed() < STUCK, "the last WRITE never completed");
    }
    assert_eq!(
        p.b.get(dst + slots * stride, len as usize),
        check,
        "the last WRITE's bytes at the peer"
    );
    ph
}

/// 64-byte WRITEs, 64 in flight, one in 16 signaled (the faces bench's
/// message rate): the phases per WRITE.
pub fn rate(p: &mut Pair, cost: f64, ops: u64, seed: u32) -> Phases {
    use layout::{DST_MSG, SLOTS, SRC_MSG};
    writes(
        p,
        cost,
        (SMALL, RATE_WINDOW, SIGNAL_EVERY),
        (SRC_MSG, DST_MSG, SLOTS, 64),
        ops / 4,
        ops,
        seed,
    )
}

/// 1 MiB WRITEs, 16 in flight, all signaled: the phases per MiB.
pub fn bandwidth(p: &mut Pair, cost: f64, ops: u64, seed: u32) -> Phases {
    use layout::{DST_BW, SRC_BW};
    // One slot: every WRITE of the same source to the same destination.
    // The checked one goes to the same place (slots 0 + stride 0).
    writes(
        p,
        cost,
        (MIB as u32, BW_WINDOW, 1),
        (SRC_BW, DST_BW, 1, 0),
        ops / 4,
        ops,
        seed,
    )
}

/// 64-byte WRITEs ping-ponged (ib_write_lat's pattern, as the faces
/// bench's latency): each side writes the peer's last byte with a
/// sequence number once it has seen the peer's; the phases per half
/// round trip.
pub fn latency(p: &mut Pair, cost: f64, ops: u64, seed: u32) -> Phases {
    use layout::{DST_LAT, SRC_LAT};
    let last = u64::from(SMALL) - 1;
    let mut wcs = Vec::new();
    let mut ph = Phases::default();
    let mut laps = Laps::new(cost);
    let warm = ops / 4;
    let base = pattern(seed, SMALL as usize);
    for (side, _) in [(&mut p.a, 0), (&mut p.b, 1)] {
        side.put(SRC_LAT, &base);
        side.put(DST_LAT + last, &[0]);
    }
    let mut seq = 0u64;
    let mut t = Instant::now();
    while seq < warm + ops {
        if seq == warm {
            ph = Phases::default();
            laps = Laps::new(cost);
        }
        seq += 1;
        let byte = (seq % 251 + 1) as u8;
        // The side whose turn it is writes; the other waits for the byte.
        let tx = if seq % 2 == 1 { &mut p.a } else { &mut p.b };
        tx.put(SRC_LAT + last, &[byte]);
        tx.post_write(seq, SRC_LAT, SMALL, DST_LAT, true);
        tx.ring();
        ph.driver += laps.lap();
        loop {
            devices(p, &mut laps, &mut ph);
            let (tx, rx) = if seq % 2 == 1 {
                (&mut p.a, &mut p.b)
            } else {
                (&mut p.b, &mut p.a)
            };
            // The writer reaps as it goes (its CQ never fills).
            wcs.clear();
            tx.poll_ready(&mut wcs);
            assert!(wcs.iter().all(|&(_, s)| s == 0), "a WRITE failed");
            let seen = rx.byte(DST_LAT + last) == byte;
            ph.driver += laps.lap();
            if seen {
                break;
            }
            assert!(t.elapsed() < STUCK, "half round trip {seq} never arrived");
        }
        t = Instant::now();
    }
    // The last message's bytes, whole, at its reader.
    let reader = if seq % 2 == 1 { &p.b } else { &p.a };
    let mut want = base.clone();
    want[last as usize] = (seq % 251 + 1) as u8;
    assert_eq!(
        reader.get(DST_LAT, SMALL as usize),
        want,
        "the last 64-byte WRITE's bytes"
    );
    ph.ops = ops as f64;
    ph
}
