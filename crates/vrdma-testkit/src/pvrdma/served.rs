//! A device served on a vfio-user socket in a thread of its own, as `vrdma
//! serve` serves each of its devices: its counters copied out after each
//! turn for the test to read, and a gate that holds the thread between
//! turns.

use std::{
    path::PathBuf,
    sync::{
        Arc, Condvar, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use vrdma_device::Transport;
use vrdma_pvrdma::{FaceStats, Pvrdma, Server};

/// `m` locked (a thread that panicked holding it left its data whole:
/// the snapshots are replaced, never updated in place).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A device served on a socket in a thread of its own.
#[derive(Debug)]
pub struct Served {
    pub socket: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// The face's counters and the clients served, as of the device
    /// thread's last turn.
    snapshot: Arc<Mutex<(FaceStats, u64)>>,
    /// The device's counters by name (`vrdma stat`'s), as of its last turn.
    counters: Arc<Mutex<Vec<(String, u64)>>>,
    gate: Arc<(Mutex<Gate>, Condvar)>,
}

/// How long a test waits for the device thread at its gate (a turn lasts
/// at most the server's idle wait; a thread that died never comes).
const GATE_LIMIT: Duration = Duration::from_secs(10);

fn gate_wait<'a>(
    cv: &Condvar,
    g: std::sync::MutexGuard<'a, Gate>,
    deadline: std::time::Instant,
) -> std::sync::MutexGuard<'a, Gate> {
    let left = deadline.saturating_duration_since(std::time::Instant::now());
    assert!(
        !left.is_zero(),
        "the device thread did not come to its gate"
    );
    cv.wait_timeout(g, left)
        .unwrap_or_else(PoisonError::into_inner)
        .0
}

/// Holds the device thread between turns (for a test that needs two inputs
/// taken in one turn): `paused` stops it before its next turn, `steps`
/// lets it take that many; `parked` says it is waiting.
#[derive(Debug, Default)]
struct Gate {
    paused: bool,
    steps: u32,
    parked: bool,
}

impl Served {
    /// Serves the function `make` builds (in the device's own thread: a
    /// device is not moved between threads).
    pub fn start<T: Transport + 'static>(
        name: &str,
        make: impl FnOnce() -> Pvrdma<T> + Send + 'static,
    ) -> Self {
        Self::start_with(name, vrdma_vfio_user::Config::default(), make)
    }

    /// [`Served::start`] with a server `config`.
    pub fn start_with<T: Transport + 'static>(
        name: &str,
        config: vrdma_vfio_user::Config,
        make: impl FnOnce() -> Pvrdma<T> + Send + 'static,
    ) -> Self {
        let socket =
            std::env::temp_dir().join(format!("vrdma-test-{}-{name}.sock", std::process::id()));
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let snapshot = Arc::new(Mutex::new((FaceStats::default(), 0)));
        let snap = snapshot.clone();
        let counters = Arc::new(Mutex::new(Vec::new()));
        let count = counters.clone();
        let gate = Arc::new((Mutex::new(Gate::default()), Condvar::new()));
        let gated = gate.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let path = socket.clone();
        let name = name.to_owned();
        let thread = std::thread::spawn(move || {
            let mut server = Server::bind_with(&path, make(), &name, &config)
                .expect("binding the device's socket");
            // The test waits for this (it cannot have gone).
            let _ = tx.send(());
            // Server::run's loop, with the counters copied out each turn,
            // and held at the gate while a test pauses it.
            while !s.load(Ordering::Relaxed) {
                {
                    let (m, cv) = &*gated;
                    let mut g = lock(m);
                    while g.paused && g.steps == 0 && !s.load(Ordering::Relaxed) {
                        g.parked = true;
                        cv.notify_all();
                        g = cv
                            .wait_timeout(g, Duration::from_millis(20))
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                    }
                    g.parked = false;
                    g.steps = g.steps.saturating_sub(1);
                }
                // Stopped while held at the gate: no further turn (a test
                // that paused the device may have taken its peers away).
                if s.load(Ordering::Relaxed) {
                    break;
                }
                server.turn().expect("the device's turn");
                *lock(&snap) = (server.function().stats(), server.clients);
                *lock(&count) = server.counters();
            }
        });
        rx.recv().expect("the device thread bound its socket");
        Served {
            socket,
            stop,
            thread: Some(thread),
            snapshot,
            counters,
            gate,
        }
    }

    /// Stops the device thread before its next turn; returns once it waits
    /// there (a turn under way ends first).
    pub fn pause(&self) {
        let (m, cv) = &*self.gate;
        let mut g = lock(m);
        g.paused = true;
        let deadline = std::time::Instant::now() + GATE_LIMIT;
        while !g.parked {
            g = gate_wait(cv, g, deadline);
        }
    }

    /// Lets a paused device take one turn; returns when it has.
    pub fn step(&self) {
        let (m, cv) = &*self.gate;
        let mut g = lock(m);
        assert!(g.paused, "step() needs pause() first");
        g.steps += 1;
        g.parked = false;
        cv.notify_all();
        let deadline = std::time::Instant::now() + GATE_LIMIT;
        while !(g.parked && g.steps == 0) {
            g = gate_wait(cv, g, deadline);
        }
    }

    pub fn resume(&self) {
        let (m, cv) = &*self.gate;
        lock(m).paused = false;
        cv.notify_all();
    }

    /// The device counter `name` once `ok` holds for it (2 s at most).
    pub fn counter_when(&self, name: &str, ok: impl Fn(u64) -> bool) -> u64 {
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        loop {
            let v = lock(&self.counters)
                .iter()
                .find(|(k, _)| k == name)
                .map_or(0, |&(_, n)| n);
            if ok(v) || std::time::Instant::now() >= deadline {
                return v;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// The face's counters once `ok` holds for them (2 s at most; the
    /// device thread copies them out after each turn).
    pub fn stats_when(&self, ok: impl Fn(&FaceStats) -> bool) -> FaceStats {
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        loop {
            let s = lock(&self.snapshot).0;
            if ok(&s) || std::time::Instant::now() >= deadline {
                return s;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    pub fn stats(&self) -> FaceStats {
        lock(&self.snapshot).0
    }

    /// Clients the server accepted.
    pub fn clients(&self) -> u64 {
        lock(&self.snapshot).1
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take()
            && t.join().is_err()
            && !std::thread::panicking()
        {
            panic!("the device thread panicked");
        }
    }
}
