//! The three measurements, the same code on every face: side A's driver
//! in a thread of its own, side B's passive (a thread only where its device
//! needs one) or echoing. Each runs for a warm-up and then for a measured
//! time, and ends with a message whose bytes are checked at the peer.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use crate::{
    port::{Port, layout, pattern},
    threads::{self, Use},
};

/// 64-byte WRITEs in flight in the message-rate test, and how often one is
/// signaled (as `vrdma bench`'s message rate).
const RATE_WINDOW: u64 = 64;
const SIGNAL_EVERY: u64 = 16;
/// 1 MiB WRITEs in flight in the bandwidth test (as `vrdma bench`).
const BW_WINDOW: u64 = 16;
const MIB: u64 = 1 << 20;
/// WRITEs a latency side may have uncompleted (it reaps as it goes).
const LAT_DEPTH: u64 = 16;
const SMALL: u32 = 64;
/// How long a run may go without a completion before it is declared
/// stalled (the retransmit timeout is 67 ms: this is 30 of them).
const STUCK: Duration = Duration::from_secs(2);

/// Which CPU each side's driver thread is pinned to, if any.
#[derive(Clone, Copy, Debug, Default)]
pub struct Pins {
    pub a: Option<usize>,
    pub b: Option<usize>,
}

/// How long a measurement warms up and then measures.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub warm: Duration,
    pub measure: Duration,
}

/// A measurement's value and what the process's threads did meanwhile.
#[derive(Clone, Debug)]
pub struct Sample {
    /// Messages/s, bytes/s, or half round trips in ns (every sample).
    pub values: Vec<f64>,
    pub threads: Use,
    /// Doorbellq kicks per posted WQE on side A (virtio-rdma).
    pub kicks_per_post: Option<f64>,
    /// The run stopped completing WRITEs: what was seen (no value then).
    pub stalled: Option<Stall>,
    /// Side A's retransmit timeouts in the whole run, where known.
    pub timeouts: Option<u64>,
    /// Operations in the measured part (WRITEs; MiB; half round trips),
    /// what the threads' CPU time is divided by.
    pub ops: f64,
}

/// A run whose WRITEs stopped completing.
#[derive(Clone, Debug)]
pub struct Stall {
    pub done: u64,
    pub posted: u64,
    /// Whether one kick of the doorbell queue made them complete again
    /// (within a second): a device that was waiting to be woken.
    pub kick_resumed: bool,
}

impl Sample {
    fn stalled(s: Stall) -> Self {
        Sample {
            values: Vec::new(),
            threads: Use::default(),
            kicks_per_post: None,
            stalled: Some(s),
            timeouts: None,
            ops: 0.0,
        }
    }
}

/// A run that has gone [`STUCK`] without a completion: one kick, then a
/// second for a completion to come.
fn stall(a: &mut dyn Port, done: u64, posted: u64) -> Stall {
    a.kick();
    let mut wcs = Vec::new();
    let t = Instant::now();
    let mut kick_resumed = false;
    while t.elapsed() < Duration::from_secs(1) {
        if reap(a, &mut wcs).0 > 0 {
            kick_resumed = true;
            break;
        }
    }
    Stall {
        done,
        posted,
        kick_resumed,
    }
}

/// The two sides after a measurement, for its check.
pub type Sides = (Box<dyn Port>, Box<dyn Port>);

/// Runs `drive` on side A in a thread of its own, while B echoes
/// (`echo`) or only keeps its device running; returns what `drive`
/// returned and both sides.
fn run<T: Send + 'static>(
    mut a: Box<dyn Port>,
    mut b: Box<dyn Port>,
    pins: Pins,
    echo: bool,
    drive: impl FnOnce(&mut dyn Port) -> T + Send + 'static,
) -> (T, Sides) {
    let stop = Arc::new(AtomicBool::new(false));
    let halt = stop.clone();
    let (tb, parked) = if echo || b.needs_thread() {
        let t = std::thread::Builder::new()
            .name("driver-b".into())
            .spawn(move || {
                if let Some(cpu) = pins.b {
                    threads::pin(0, cpu);
                }
                if echo {
                    echo_loop(&mut *b, &halt);
                } else {
                    while !halt.load(Ordering::Relaxed) {
                        b.idle();
                    }
                }
                b
            })
            .expect("side B's thread");
        (Some(t), None)
    } else {
        (None, Some(b))
    };
    let ta = std::thread::Builder::new()
        .name("driver-a".into())
        .spawn(move || {
            if let Some(cpu) = pins.a {
                threads::pin(0, cpu);
            }
            let r = drive(&mut *a);
            (r, a)
        })
        .expect("side A's thread");
    let joined = ta.join();
    stop.store(true, Ordering::Relaxed);
    let b = match (tb, parked) {
        (Some(t), _) => t.join().unwrap_or_else(|e| std::panic::resume_unwind(e)),
        (None, Some(b)) => b,
        (None, None) => unreachable!("side B is in a thread or parked"),
    };
    let (r, a) = joined.unwrap_or_else(|e| std::panic::resume_unwind(e));
    (r, (a, b))
}

/// Reaps `a`'s completions, each of which must have succeeded; returns
/// how many came and the last one's wr_id.
fn reap(a: &mut dyn Port, wcs: &mut Vec<(u64, u32)>) -> (u64, Option<u64>) {
    wcs.clear();
    a.poll(wcs);
    (wcs.len() as u64, last_ok(wcs))
}

/// The last of `wcs`' wr_ids, each completion checked to have succeeded.
pub(crate) fn last_ok(wcs: &[(u64, u32)]) -> Option<u64> {
    let mut last = None;
    for &(id, status) in wcs {
        assert_eq!(
            status, 0,
            "WRITE {id} completed in error (ibv_wc_status {status})"
        );
        last = Some(id);
    }
    last
}

/// Posts one signaled WRITE of `len` bytes from `src` to `dst` after
/// putting `data` at `src`, and waits for its completion: the message
/// whose bytes the peer is checked for.
fn last_message(
    a: &mut dyn Port,
    wr_id: u64,
    src: u64,
    dst: u64,
    data: &[u8],
) -> Result<(), Stall> {
    a.put(src, data);
    a.post_write(wr_id, src, data.len() as u32, dst, true);
    a.ring();
    let mut wcs = Vec::new();
    let t = Instant::now();
    loop {
        if reap(a, &mut wcs).1 == Some(wr_id) {
            return Ok(());
        }
        if t.elapsed() >= STUCK {
            return Err(stall(a, wr_id - 1, wr_id));
        }
    }
}

/// The clock of a measurement: warm-up, then the measured part, with the
/// threads' use over it.
struct Clock {
    timing: Timing,
    start: Instant,
    mark: Option<(Instant, threads::Snapshot)>,
}

impl Clock {
    fn new(timing: Timing) -> Self {
        Clock {
            timing,
            start: Instant::now(),
            mark: None,
        }
    }

    /// Whether the measured part runs now (it starts on the first call
    /// past the warm-up).
    fn measuring(&mut self, now: Instant) -> bool {
        if self.mark.is_none() && now - self.start >= self.timing.warm {
            self.mark = Some((now, threads::snapshot()));
        }
        self.mark.is_some()
    }

    fn over(&self, now: Instant) -> bool {
        self.mark
            .as_ref()
            .is_some_and(|(t, _)| now - *t >= self.timing.measure)
    }

    /// The measured part's length and the threads' use over it.
    fn end(&self, now: Instant) -> (Duration, Use) {
        let (t, s) = self.mark.as_ref().expect("the measured part started");
        let wall = now - *t;
        (wall, s.until(&threads::snapshot(), wall))
    }
}

/// 64-byte WRITEs from A's slots to B's, [`RATE_WINDOW`] in flight, one
/// in [`SIGNAL_EVERY`] signaled; messages per second.
pub fn rate(
    a: Box<dyn Port>,
    b: Box<dyn Port>,
    pins: Pins,
    timing: Timing,
    seed: u32,
) -> (Sample, Sides) {
    let check = pattern(seed, SMALL as usize);
    let data = check.clone();
    let (sample, (a, b)) = run(a, b, pins, false, move |a| {
        use layout::{DST_MSG, SLOTS, SRC_MSG};
        a.put(SRC_MSG, &pattern(seed ^ 0x55, (SLOTS * 64) as usize));
        let mut wcs = Vec::new();
        let mut clock = Clock::new(timing);
        let (mut posted, mut done) = (0u64, 0u64);
        let (mut at_mark, mut kicks_at_mark) = (None, 0);
        let mut progress = Instant::now();
        let sample = loop {
            let before = posted;
            while posted - done < RATE_WINDOW {
                posted += 1;
                let slot = (posted % SLOTS) * 64;
                let signaled = posted.is_multiple_of(SIGNAL_EVERY);
                a.post_write(posted, SRC_MSG + slot, SMALL, DST_MSG + slot, signaled);
            }
            if posted > before {
                a.ring();
            }
            // A signaled WRITE completes every one before it.
            let now = Instant::now();
            if let (_, Some(id)) = reap(a, &mut wcs) {
                done = id;
                progress = now;
            }
            if now - progress >= STUCK {
                return Sample::stalled(stall(a, done, posted));
            }
            if clock.measuring(now) && at_mark.is_none() {
                at_mark = Some(done);
                kicks_at_mark = a.kicks().unwrap_or(0);
            }
            if clock.over(now) {
                let (wall, threads) = clock.end(now);
                let msgs = done - at_mark.unwrap_or(0);
                let kicks = a.kicks().map(|k| (k - kicks_at_mark) as f64 / msgs as f64);
                break Sample {
                    values: vec![msgs as f64 / wall.as_secs_f64()],
                    threads,
                    kicks_per_post: kicks,
                    stalled: None,
                    timeouts: None,
                    ops: msgs as f64,
                };
            }
        };
        let slot = SLOTS * 64;
        match last_message(a, posted + 1, SRC_MSG + slot, DST_MSG + slot, &data) {
            Ok(()) => sample,
            Err(st) => Sample::stalled(st),
        }
    });
    if sample.stalled.is_none() {
        let got = b.get(layout::DST_MSG + layout::SLOTS * 64, SMALL as usize);
        assert_eq!(got, check, "the last 64-byte WRITE's bytes at the peer");
    }
    (sample, (a, b))
}

/// 1 MiB WRITEs from A's source to B's destination, [`BW_WINDOW`] in
/// flight, all signaled; bytes per second.
pub fn bandwidth(
    a: Box<dyn Port>,
    b: Box<dyn Port>,
    pins: Pins,
    timing: Timing,
    seed: u32,
) -> (Sample, Sides) {
    let check = pattern(seed, MIB as usize);
    let data = check.clone();
    let (sample, (a, b)) = run(a, b, pins, false, move |a| {
        use layout::{DST_BW, SRC_BW};
        a.put(SRC_BW, &pattern(seed ^ 0x55, MIB as usize));
        let mut wcs = Vec::new();
        let mut clock = Clock::new(timing);
        let (mut posted, mut done) = (0u64, 0u64);
        let mut at_mark = None;
        let mut progress = Instant::now();
        let sample = loop {
            let before = posted;
            while posted - done < BW_WINDOW {
                posted += 1;
                a.post_write(posted, SRC_BW, MIB as u32, DST_BW, true);
            }
            if posted > before {
                a.ring();
            }
            let now = Instant::now();
            let (n, _) = reap(a, &mut wcs);
            if n > 0 {
                done += n;
                progress = now;
            }
            if now - progress >= STUCK {
                return Sample::stalled(stall(a, done, posted));
            }
            if clock.measuring(now) && at_mark.is_none() {
                at_mark = Some(done);
            }
            if clock.over(now) {
                let (wall, threads) = clock.end(now);
                let bytes = (done - at_mark.unwrap_or(0)) * MIB;
                break Sample {
                    values: vec![bytes as f64 / wall.as_secs_f64()],
                    threads,
                    kicks_per_post: None,
                    stalled: None,
                    timeouts: None,
                    ops: (bytes / MIB) as f64,
                };
            }
        };
        // Every WRITE in flight done, then the checked one.
        let mut t = Instant::now();
        while done < posted {
            let n = reap(a, &mut wcs).0;
            if n > 0 {
                done += n;
                t = Instant::now();
            }
            if t.elapsed() >= STUCK {
                return Sample::stalled(stall(a, done, posted));
            }
        }
        match last_message(a, posted + 1, SRC_BW, DST_BW, &data) {
            Ok(()) => sample,
            Err(st) => Sample::stalled(st),
        }
    });
    if sample.stalled.is_none() {
        assert!(
            b.get(layout::DST_BW, MIB as usize) == check,
            "the last 1 MiB WRITE's bytes at the peer"
        );
    }
    (sample, (a, b))
}

/// The 64-byte WRITE ping-pong as `ib_write_lat` runs it: each side writes
/// a sequence number into the last byte of the peer's buffer once it sees
/// the peer's (A first), reaping its completions as they come; half round
/// trips in ns, measured on A.
pub fn latency(
    mut a: Box<dyn Port>,
    mut b: Box<dyn Port>,
    pins: Pins,
    timing: Timing,
    seed: u32,
) -> (Sample, Sides) {
    use layout::{DST_LAT, SRC_LAT};
    a.put(SRC_LAT, &pattern(seed, SMALL as usize));
    b.put(SRC_LAT, &pattern(seed ^ 0xaa, SMALL as usize));
    let (sample, (a, b)) = run(a, b, pins, true, move |a| {
        let mut wcs = Vec::new();
        let mut clock = Clock::new(timing);
        let mut samples = Vec::new();
        let mut out = 0u64;
        let mut i = 0u32;
        loop {
            let seq = (i % 255 + 1) as u8;
            i += 1;
            let t = Instant::now();
            while out >= LAT_DEPTH {
                out -= reap(a, &mut wcs).0;
                if t.elapsed() >= STUCK {
                    return Sample::stalled(stall(a, u64::from(i), u64::from(i) + out));
                }
            }
            a.put(SRC_LAT + u64::from(SMALL) - 1, &[seq]);
            a.post_write(0, SRC_LAT, SMALL, DST_LAT, true);
            a.ring();
            out += 1;
            while a.byte(DST_LAT + u64::from(SMALL) - 1) != seq {
                out -= reap(a, &mut wcs).0;
                if t.elapsed() >= STUCK {
                    return Sample::stalled(stall(a, u64::from(i), u64::from(i) + out));
                }
            }
            let now = Instant::now();
            if clock.measuring(t) {
                samples.push((now - t).as_nanos() as f64 / 2.0);
            }
            if clock.over(now) {
                let (_, threads) = clock.end(now);
                let t = Instant::now();
                while out > 0 {
                    out -= reap(a, &mut wcs).0;
                    if t.elapsed() >= STUCK {
                        return Sample::stalled(stall(a, u64::from(i) - out, u64::from(i)));
                    }
                }
                // Each sample is a round trip: two half round trips.
                let ops = 2.0 * samples.len() as f64;
                break Sample {
                    values: samples,
                    threads,
                    kicks_per_post: None,
                    stalled: None,
                    timeouts: None,
                    ops,
                };
            }
        }
    });
    // The last message each way: B's source in A's buffer, A's in B's.
    if sample.stalled.is_none() {
        let (sa, sb) = (a.get(SRC_LAT, 64), b.get(SRC_LAT, 64));
        assert_eq!(sa[..63], pattern(seed, 63)[..], "A's message");
        assert_eq!(a.get(DST_LAT, 64), sb, "B's last WRITE's bytes at A");
        assert_eq!(b.get(DST_LAT, 64), sa, "A's last WRITE's bytes at B");
    }
    (sample, (a, b))
}

/// Side B of the ping-pong: answers each new sequence number with a WRITE
/// of it, until stopped.
fn echo_loop(b: &mut dyn Port, stop: &AtomicBool) {
    use layout::{DST_LAT, SRC_LAT};
    let (mut last, mut out) = (0u8, 0u64);
    let mut wcs = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        out -= reap(b, &mut wcs).0;
        let seq = b.byte(DST_LAT + u64::from(SMALL) - 1);
        if seq != last && out < LAT_DEPTH {
            last = seq;
            b.put(SRC_LAT + u64::from(SMALL) - 1, &[seq]);
            b.post_write(0, SRC_LAT, SMALL, DST_LAT, true);
            b.ring();
            out += 1;
        }
    }
}

/// One 64-byte WRITE at a time from A to B, `n` of them `gap` apart (so
/// that the devices go idle between), B's driver doing nothing: each one's
/// time from post to completion, in ns.
pub fn lone_writes(a: &mut dyn Port, b: &mut dyn Port, n: u32, gap: Duration) -> Vec<f64> {
    use layout::{DST_MSG, SRC_MSG};
    let mut wcs = Vec::new();
    let mut times = Vec::new();
    for i in 0..n {
        std::thread::sleep(gap);
        let data = pattern(i, SMALL as usize);
        a.put(SRC_MSG, &data);
        let t = Instant::now();
        a.post_write(u64::from(i) + 1, SRC_MSG, SMALL, DST_MSG, true);
        a.ring();
        loop {
            // A device with no thread of its own gets its round.
            b.idle_once();
            if reap(a, &mut wcs).1 == Some(u64::from(i) + 1) {
                break;
            }
            assert!(t.elapsed() < STUCK, "a lone WRITE never completed");
        }
        times.push(t.elapsed().as_nanos() as f64);
        assert_eq!(
            b.get(DST_MSG, SMALL as usize),
            data,
            "the lone WRITE's bytes"
        );
    }
    times
}
