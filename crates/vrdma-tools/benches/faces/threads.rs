//! The process's threads as the scheduler saw them (`/proc/self/task/*/
//! schedstat`: time on a CPU and time runnable but waiting for one), and
//! pinning a thread, by its id, to a CPU.

use std::{collections::HashMap, fs, time::Duration};

use nix::{
    sched::{CpuSet, sched_setaffinity},
    unistd::Pid,
};

/// Each thread's name and its CPU and run-queue time (ns) at one moment.
#[derive(Clone, Debug, Default)]
pub struct Snapshot(HashMap<i32, (String, u64, u64)>);

/// Every thread of the process, now.
pub fn snapshot() -> Snapshot {
    let mut m = HashMap::new();
    let Ok(dir) = fs::read_dir("/proc/self/task") else {
        return Snapshot(m);
    };
    for e in dir.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let path = e.path();
        let comm = fs::read_to_string(path.join("comm")).unwrap_or_default();
        let Ok(stat) = fs::read_to_string(path.join("schedstat")) else {
            continue;
        };
        let mut f = stat
            .split_whitespace()
            .map(|x| x.parse::<u64>().unwrap_or(0));
        let (run, wait) = (f.next().unwrap_or(0), f.next().unwrap_or(0));
        m.insert(tid, (comm.trim().to_owned(), run, wait));
    }
    Snapshot(m)
}

/// What the threads did between two snapshots, over `wall`.
#[derive(Clone, Debug, Default)]
pub struct Use {
    /// Threads that wanted a core at least 80 % of the time (running or
    /// runnable: a thread that busy-polls), and their names.
    pub busy: u32,
    pub names: Vec<String>,
    /// CPU time of all threads over wall time (cores in use).
    pub cores: f64,
    /// Run-queue time of all threads over wall time: how many threads,
    /// on average, were runnable and waiting for a core.
    pub waiting: f64,
    /// CPU time (ns, the threads' own clocks) of the drivers' threads
    /// (`driver-*`: the guests' side; engine-direct's, which are their
    /// devices too) and of every other thread (the devices': their loops,
    /// workers and server threads).
    pub driver_ns: f64,
    pub device_ns: f64,
}

impl Snapshot {
    /// The threads' use from `self` to `later`, over `wall`.
    pub fn until(&self, later: &Snapshot, wall: Duration) -> Use {
        let w = wall.as_nanos() as f64;
        let mut u = Use::default();
        for (tid, (name, run1, wait1)) in &later.0 {
            let (run0, wait0) = self.0.get(tid).map_or((0, 0), |(_, r, q)| (*r, *q));
            let run = run1.saturating_sub(run0) as f64;
            let wait = wait1.saturating_sub(wait0) as f64;
            if run + wait >= 0.8 * w {
                u.busy += 1;
                u.names.push(name.clone());
            }
            u.cores += run / w;
            u.waiting += wait / w;
            if name.starts_with("driver-") {
                u.driver_ns += run;
            } else {
                u.device_ns += run;
            }
        }
        u.names.sort();
        u
    }

    /// The ids of threads called `name`.
    pub fn named(&self, name: &str) -> Vec<i32> {
        let mut v: Vec<i32> = self
            .0
            .iter()
            .filter(|(_, (n, _, _))| n == name)
            .map(|(t, _)| *t)
            .collect();
        v.sort_unstable();
        v
    }
}

/// Pins thread `tid` (0: the calling thread) to `cpu`; refused (no such
/// CPU, a restricted cpuset): it runs unpinned.
pub fn pin(tid: i32, cpu: usize) {
    let mut set = CpuSet::new();
    if set.set(cpu).is_ok() {
        let _ = sched_setaffinity(Pid::from_raw(tid), &set);
    }
}

/// The calling thread's id.
pub fn tid() -> i32 {
    nix::unistd::gettid().as_raw()
}
