//! When a device's thread polls the guest and when it sleeps: one policy
//! for every face's loop — virtio-rdma's over vhost-user and as a virtio-pci
//! function, PVRDMA's shared doorbells.
//!
//! A polled device reads the guest's doorbells in memory instead of
//! waiting for a kick, which saves the kick (a VM exit, a system call)
//! while the thread has a core of its own. On a host with fewer cores than
//! busy threads — the normal state of a cloud host — a spinning device
//! takes the core its own driver needs, and every round trip waits out a
//! scheduler slice. So the policy is:
//!
//! - **An adaptive window** (QEMU's AioContext polling): the device spins at
//!   most `window` after it last found work, then sleeps until a kick. When
//!   the next work comes after a sleep, the window grows ×2 if a longer
//!   spin (up to the configured maximum) would have caught it and shrinks
//!   ÷2 if not — so a window only costs CPU where it pays.
//! - **Yield**: an empty round gives the core away (`sched_yield`), so a
//!   runnable thread on this CPU — the driver, a vCPU, another tenant's
//!   device — runs first; with nobody waiting the yield returns at once.
//! - **A preemption guard**: a spinning thread that was switched out
//!   involuntarily (its involuntary context switches, `getrusage`'s
//!   `ru_nivcsw` for the thread, grew: its yield let another thread run, or
//!   the scheduler took the core) is short of a core. It stops spinning at
//!   once and does not start again for a hold-off that doubles (1 ms to
//!   256 ms) while that keeps happening and ends when a spin completes
//!   without one. Measured on a 2-core host with four busy threads
//!   (BENCHMARKS.md): the signal is there at the first empty round, where
//!   waiting for the scheduler's tick would cost a slice.
//! - **Nothing lost at the switch**: before sleeping the face tells its
//!   drivers to kick again and looks at the doorbells once more (a doorbell
//!   rung before a driver read the word); that is the face's part
//!   (`set_polling(false)` then a last look), the policy only says when.
//!
//! [`Spin`] is the decision, on a clock and signals it is given (the tests
//! drive it deterministically); [`Spinner`] is the same on the calling
//! thread's own clock readings and switch counts.

use std::time::Duration;

/// The longest spin after the last work, unless a device is told
/// otherwise (`vrdma serve --device ...,spin=US`).
pub const DEFAULT_WINDOW: Duration = Duration::from_micros(200);
/// The shortest and the longest hold-off after a spin was preempted.
pub const HOLD_MIN: Duration = Duration::from_millis(1);
pub const HOLD_MAX: Duration = Duration::from_millis(256);
/// The shortest window the adaptive window shrinks to.
pub const WINDOW_MIN: Duration = Duration::from_micros(4);
/// While a spin finds work round after round, how often its thread's
/// switches are read (`getrusage`, a system call a round otherwise: a
/// busy round's cost is the device's cost per operation). After an empty
/// round, whose yield is where the signal shows first, they are read at
/// once.
pub const CHECK_EVERY: Duration = Duration::from_micros(50);

/// What the loop does after a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum Next {
    /// Look again at once (after a yield, when the round found nothing).
    Spin,
    /// Stop polling: the face re-arms its notifications, looks once more,
    /// and the loop sleeps until something comes.
    Sleep,
}

/// What the policy did, for `vrdma stat` and the benches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpinStats {
    /// Spins started (a kick or work that woke a sleeping device).
    pub started: u64,
    /// Spins refused: a wake-up inside a hold-off.
    pub held: u64,
    /// Spins that ran out their window with nothing found.
    pub ran_out: u64,
    /// Spins stopped because the thread was preempted.
    pub preempted: u64,
    /// Times the window grew and shrank.
    pub grown: u64,
    pub shrunk: u64,
}

impl SpinStats {
    /// As `vrdma stat` shows them: `spin.started`, `spin.held`, ...
    pub fn counters(&self) -> Vec<(String, u64)> {
        [
            ("started", self.started),
            ("held", self.held),
            ("ran_out", self.ran_out),
            ("preempted", self.preempted),
            ("grown", self.grown),
            ("shrunk", self.shrunk),
        ]
        .into_iter()
        .map(|(k, n)| (format!("spin.{k}"), n))
        .collect()
    }
}

/// The decision: when to spin, for how long, and when not at all.
#[derive(Clone, Debug)]
pub struct Spin {
    max: u64,
    window: u64,
    /// Whether the device is spinning, and when it last found work.
    spinning: bool,
    last_work: u64,
    /// When the last spin ended by running out (the next wake-up's delay
    /// from its last work tells whether a longer window would have caught
    /// it); None after a preempted spin or before any.
    ran_out_at: Option<u64>,
    hold: u64,
    held_until: u64,
    stats: SpinStats,
}

impl Spin {
    /// A policy whose window is at most `max` (0: never spin).
    pub fn new(max: Duration) -> Spin {
        let max = max.as_nanos().min(u128::from(u64::MAX)) as u64;
        Spin {
            max,
            window: max,
            spinning: false,
            last_work: 0,
            ran_out_at: None,
            hold: 0,
            held_until: 0,
            stats: SpinStats::default(),
        }
    }

    /// Whether the device is spinning.
    pub fn spinning(&self) -> bool {
        self.spinning
    }

    /// The window now (ns).
    pub fn window(&self) -> u64 {
        self.window
    }

    pub fn stats(&self) -> SpinStats {
        self.stats
    }

    /// Something woke a sleeping device at `now` (a kick, a doorbell seen
    /// in a last look): whether it may spin. Inside a hold-off it may not
    /// (the face stays in event mode); otherwise the window adapts to how
    /// long after the last spin ran out the work came.
    pub fn wake(&mut self, now: u64) -> bool {
        if self.spinning {
            self.last_work = now;
            return true;
        }
        if self.max == 0 {
            return false;
        }
        if now < self.held_until {
            self.stats.held += 1;
            return false;
        }
        if let Some(at) = self.ran_out_at.take() {
            // The work came `now - at` after the spin gave up, `window`
            // after its last work: a window as long as the whole gap
            // (within the maximum) would have caught it.
            let gap = now.saturating_sub(at).saturating_add(self.window);
            if gap <= self.max {
                self.grow();
            } else {
                self.shrink();
            }
        }
        self.spinning = true;
        self.last_work = now;
        self.stats.started += 1;
        true
    }

    /// After a round of a spinning device at `now`: whether it found work,
    /// and whether its thread was switched out involuntarily since the
    /// last round. A device that is not spinning gets [`Next::Sleep`].
    pub fn round(&mut self, now: u64, busy: bool, preempted: bool) -> Next {
        if !self.spinning {
            return Next::Sleep;
        }
        if preempted {
            self.spinning = false;
            self.ran_out_at = None;
            self.hold = (self.hold.saturating_mul(2)).clamp(nanos(HOLD_MIN), nanos(HOLD_MAX));
            self.held_until = now.saturating_add(self.hold);
            self.stats.preempted += 1;
            return Next::Sleep;
        }
        if busy {
            self.last_work = now;
            return Next::Spin;
        }
        if now.saturating_sub(self.last_work) >= self.window {
            self.spinning = false;
            self.ran_out_at = Some(now);
            // A spin that ended by itself: the core was there.
            self.hold = 0;
            self.stats.ran_out += 1;
            return Next::Sleep;
        }
        Next::Spin
    }

    /// The device stops polling for a reason of its own (a reset, the
    /// driver gone): no spin, no hold-off, the window kept.
    pub fn stop(&mut self) {
        self.spinning = false;
        self.ran_out_at = None;
    }

    fn grow(&mut self) {
        let w = self.window.saturating_mul(2).min(self.max);
        if w > self.window {
            self.stats.grown += 1;
        }
        self.window = w;
    }

    fn shrink(&mut self) {
        let w = (self.window / 2).max(nanos(WINDOW_MIN).min(self.max));
        if w < self.window {
            self.stats.shrunk += 1;
        }
        self.window = w;
    }
}

/// How often a device that cannot be kicked looks at the guest when it
/// does not spin (PVRDMA's shared doorbells: the stock driver writes its
/// doorbells into memory and never traps): soon after its last work, and
/// less and less often while nothing comes, so that an idle device costs
/// under 1 % of a core (a look, its wake-up and the network's reads, cost
/// about 40 µs on the 2-core KVM guest of BENCHMARKS.md: 200 a second) and
/// a busy one answers within the interval.
pub const LOOK_MIN: Duration = Duration::from_micros(50);
pub const LOOK_MAX: Duration = Duration::from_millis(5);

/// The interval between looks: none after a look that found work (more
/// may be there: the device looks again at once, as a busy one does),
/// [`LOOK_MIN`] after the first that found nothing, doubling to
/// [`LOOK_MAX`] with every further one.
#[derive(Clone, Copy, Debug)]
pub struct Looks(Duration);

impl Default for Looks {
    fn default() -> Self {
        Looks(LOOK_MIN)
    }
}

impl Looks {
    /// After a look that found work or not: how long until the next.
    pub fn after(&mut self, found: bool) -> Duration {
        if found {
            self.0 = LOOK_MIN;
            return Duration::ZERO;
        }
        let d = self.0;
        self.0 = (self.0 * 2).min(LOOK_MAX);
        d
    }
}

fn nanos(d: Duration) -> u64 {
    d.as_nanos() as u64
}

/// [`Spin`] on the calling thread: its clock readings are given, its
/// involuntary context switches read here (`getrusage(RUSAGE_THREAD)`),
/// and an empty spinning round yields the core. Every call must come from
/// the device's own thread.
#[derive(Debug)]
pub struct Spinner {
    spin: Spin,
    switches: u64,
    /// When the switches were last read (device clock, ns).
    checked: u64,
    /// Whether the last round yielded the core.
    yielded: bool,
}

impl Spinner {
    pub fn new(max: Duration) -> Spinner {
        Spinner {
            spin: Spin::new(max),
            switches: involuntary_switches(),
            checked: 0,
            yielded: false,
        }
    }

    pub fn policy(&self) -> &Spin {
        &self.spin
    }

    pub fn spinning(&self) -> bool {
        self.spin.spinning()
    }

    /// See [`Spin::wake`]. The switch count starts afresh: switches while
    /// the device slept are not the spin's.
    pub fn wake(&mut self, now: u64) -> bool {
        let was = self.spin.spinning();
        let ok = self.spin.wake(now);
        if ok && !was {
            self.switches = involuntary_switches();
            self.checked = now;
            self.yielded = false;
        }
        ok
    }

    /// See [`Spin::round`]; an empty round that goes on spinning has
    /// yielded the core when this returns. The switches are read after a
    /// round that yielded, and otherwise every [`CHECK_EVERY`].
    pub fn round(&mut self, now: u64, busy: bool) -> Next {
        if !self.spin.spinning() {
            return Next::Sleep;
        }
        let preempted = if self.yielded || now.saturating_sub(self.checked) >= nanos(CHECK_EVERY) {
            let n = involuntary_switches();
            let preempted = n > self.switches;
            self.switches = n;
            self.checked = now;
            preempted
        } else {
            false
        };
        let next = self.spin.round(now, busy, preempted);
        self.yielded = next == Next::Spin && !busy;
        if self.yielded {
            std::thread::yield_now();
        }
        next
    }

    pub fn stop(&mut self) {
        self.spin.stop();
    }
}

/// Timers of the calling thread fire on time: its timer slack (by
/// default 50 µs, which the kernel may add to every sleep to group
/// wake-ups) set to 1 ns, so that a device looking at intervals of 50 µs
/// looks after 50 µs, not 100. For a device's own thread, before it
/// serves; an error (a kernel that refuses) leaves the default.
pub fn precise_timers() {
    let _ = nix::sys::prctl::set_timerslack(1);
}

/// The calling thread's involuntary context switches so far (0 if the
/// kernel will not say).
pub fn involuntary_switches() -> u64 {
    use nix::sys::resource::{UsageWho, getrusage};
    getrusage(UsageWho::RUSAGE_THREAD).map_or(0, |u| u.involuntary_context_switches() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1000;
    const MS: u64 = 1_000_000;

    #[test]
    fn a_spin_runs_its_window_out_after_the_last_work() {
        let mut s = Spin::new(Duration::from_micros(100));
        assert!(s.wake(0));
        assert_eq!(s.round(50 * US, true, false), Next::Spin);
        assert_eq!(s.round(149 * US, false, false), Next::Spin);
        assert_eq!(s.round(150 * US, false, false), Next::Sleep);
        assert!(!s.spinning());
        assert_eq!(s.stats().ran_out, 1);
        // Asleep: every round says so.
        assert_eq!(s.round(151 * US, true, false), Next::Sleep);
    }

    #[test]
    fn a_preempted_spin_stops_at_once_and_holds_off_doubling() {
        let mut s = Spin::new(Duration::from_micros(100));
        let mut now = 0;
        let mut holds = Vec::new();
        for _ in 0..12 {
            assert!(s.wake(now));
            assert_eq!(s.round(now + US, false, true), Next::Sleep);
            let until = s.held_until;
            holds.push(until - (now + US));
            // Inside the hold-off a kick does not start a spin.
            assert!(!s.wake(until - 1));
            now = until;
        }
        assert_eq!(holds[0], MS);
        assert_eq!(holds[1], 2 * MS);
        assert_eq!(holds[8], 256 * MS);
        assert_eq!(holds[11], 256 * MS, "capped");
        assert_eq!(s.stats().preempted, 12);
        assert_eq!(s.stats().held, 12);
        // A spin that runs out by itself ends the hold-off series.
        assert!(s.wake(now));
        assert_eq!(s.round(now + 200 * US, false, false), Next::Sleep);
        assert!(s.wake(now + 201 * US));
        assert_eq!(s.round(now + 202 * US, false, true), Next::Sleep);
        assert_eq!(s.held_until - (now + 202 * US), MS);
    }

    #[test]
    fn the_window_grows_when_a_longer_spin_would_have_caught_the_work() {
        let mut s = Spin::new(Duration::from_micros(64));
        // Shrink first: work that comes long after the spin gave up.
        assert!(s.wake(0));
        assert_eq!(s.round(64 * US, false, false), Next::Sleep);
        assert!(s.wake(10 * MS));
        assert_eq!(s.window(), 32 * US);
        assert_eq!(s.round(10 * MS + 32 * US, false, false), Next::Sleep);
        // Work 10 µs after it gave up: 32 + 10 ≤ 64, a longer one pays.
        assert!(s.wake(10 * MS + 42 * US));
        assert_eq!(s.window(), 64 * US);
        assert_eq!(s.stats().grown, 1);
        assert_eq!(s.stats().shrunk, 1);
    }

    #[test]
    fn the_window_shrinks_to_its_floor_and_never_past_the_maximum() {
        let mut s = Spin::new(Duration::from_micros(200));
        let mut now = 0;
        for _ in 0..20 {
            assert!(s.wake(now));
            let w = s.window();
            assert_eq!(s.round(now + w, false, false), Next::Sleep);
            now += w + 100 * MS;
        }
        assert_eq!(s.window(), 4 * US);
        // Work 1 µs after each spin gives up: the window doubles up to the
        // maximum (where the gap since the last work exceeds it, so it
        // halves again, as QEMU's does).
        let mut widest = 0;
        for _ in 0..20 {
            assert!(s.wake(now));
            let w = s.window();
            assert!(w <= 200 * US);
            widest = widest.max(w);
            assert_eq!(s.round(now + w, false, false), Next::Sleep);
            now += w + US;
        }
        assert_eq!(widest, 200 * US);
    }

    #[test]
    fn looks_double_while_nothing_comes_and_start_over_after_work() {
        let mut l = Looks::default();
        let got: Vec<u128> = (0..8).map(|_| l.after(false).as_micros()).collect();
        assert_eq!(got, [50, 100, 200, 400, 800, 1600, 3200, 5000]);
        assert_eq!(l.after(true), Duration::ZERO);
        assert_eq!(l.after(true), Duration::ZERO);
        assert_eq!(l.after(false), LOOK_MIN);
        assert_eq!(l.after(false).as_micros(), 100);
    }

    #[test]
    fn no_window_never_spins() {
        let mut s = Spin::new(Duration::ZERO);
        assert!(!s.wake(5));
        assert_eq!(s.round(6, true, false), Next::Sleep);
    }

    #[test]
    fn work_keeps_a_spin_going_however_long() {
        let mut s = Spin::new(Duration::from_micros(10));
        assert!(s.wake(0));
        for t in 1..10_000 {
            assert_eq!(s.round(t * 5 * US, true, false), Next::Spin);
        }
        assert_eq!(s.stats().ran_out, 0);
    }

    #[test]
    fn a_stop_is_not_a_preemption() {
        let mut s = Spin::new(Duration::from_micros(10));
        assert!(s.wake(0));
        s.stop();
        assert!(!s.spinning());
        assert!(s.wake(1), "no hold-off after a stop");
    }

    #[test]
    fn a_yield_to_a_runnable_thread_on_the_same_core_counts_as_involuntary() {
        // The guard's signal, on this kernel: this thread and a busy one
        // pinned to one CPU; this thread's yield lets the other run, and
        // its involuntary switch count grows.
        use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
        use nix::unistd::Pid;
        use std::sync::{
            Arc,
            atomic::{AtomicBool, Ordering},
        };
        let mine = sched_getaffinity(Pid::from_raw(0)).unwrap();
        let Some(cpu) = (0..CpuSet::count()).find(|&c| mine.is_set(c).unwrap_or(false)) else {
            panic!("no CPU in this thread's affinity");
        };
        let mut one = CpuSet::new();
        one.set(cpu).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let busy = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                sched_setaffinity(Pid::from_raw(0), &one).unwrap();
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        };
        sched_setaffinity(Pid::from_raw(0), &one).unwrap();
        let before = involuntary_switches();
        let t0 = std::time::Instant::now();
        let mut after = before;
        while after == before && t0.elapsed() < Duration::from_secs(5) {
            std::thread::yield_now();
            after = involuntary_switches();
        }
        stop.store(true, Ordering::Relaxed);
        sched_setaffinity(Pid::from_raw(0), &mine).unwrap();
        busy.join().unwrap();
        assert!(
            after > before,
            "no involuntary switch seen in 5 s of yields"
        );
    }
}
