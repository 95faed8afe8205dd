//! A peer daemon that connects to the rendezvous while the process's
//! descriptor table is full: the accept fails (EMFILE), a shortage the
//! rendezvous thread waits out without spinning on its listener (which
//! stays readable while the connection waits) — it spends next to no CPU
//! meanwhile — and the connection is taken once descriptors are back.
//!
//! This binary holds one test on purpose: it fills the process's
//! descriptor table (a lowered `RLIMIT_NOFILE`), which would fail any test
//! running beside it in another thread.

use std::{
    fs::File,
    io::{Read, Seek},
    os::fd::AsRawFd,
    path::PathBuf,
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use nix::sys::{
    resource::{Resource, getrlimit, setrlimit},
    socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket},
};
use vrdma_fabric::shm::{JoinConfig, Switch};

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vrdma-rdv-short-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The `/proc` stat file of this process's thread named `name`, open (a
/// new thread names itself once it runs: looked for 10 s at most).
fn thread_stat(name: &str) -> File {
    let limit = Instant::now() + Duration::from_secs(10);
    loop {
        for t in std::fs::read_dir("/proc/self/task").unwrap() {
            let p = t.unwrap().path();
            if std::fs::read_to_string(p.join("comm")).is_ok_and(|c| c.trim() == name) {
                return File::open(p.join("stat")).unwrap();
            }
        }
        assert!(Instant::now() < limit, "no thread {name}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The CPU time (user and system, in clock ticks) a thread's stat file
/// reports, read again through the same descriptor.
fn cpu_ticks(stat: &mut File) -> u64 {
    let mut s = String::new();
    stat.rewind().unwrap();
    stat.read_to_string(&mut s).unwrap();
    // After the command's closing parenthesis: state is field 3, utime
    // and stime fields 14 and 15.
    let rest = &s[s.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// Fills the descriptor table: the soft limit lowered to what is open now
/// and a few more, those few taken. Returns what holds them and the limit
/// to restore.
fn fill_table() -> (Vec<File>, (u64, u64)) {
    let limits = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    setrlimit(Resource::RLIMIT_NOFILE, open + 8, limits.1).unwrap();
    let base = File::open("/dev/null").unwrap();
    let mut held = Vec::new();
    loop {
        match base.try_clone() {
            Ok(f) => held.push(f),
            Err(e) if e.raw_os_error() == Some(libc::EMFILE) => break,
            Err(e) => panic!("filling the table: {e}"),
        }
    }
    held.push(base);
    (held, limits)
}

#[test]
fn a_peer_that_connects_while_descriptors_run_out_is_taken_once_they_are_back() {
    let d = dir("full");
    let sw = Switch::new();
    let r = sw.join(JoinConfig::new(&d)).unwrap();
    let mut stat = thread_stat("vrdma-shm");
    let sock = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap();
    let (held, limits) = fill_table();
    // Connected once the table is full: the rendezvous thread's accept
    // meets EMFILE.
    connect(sock.as_raw_fd(), &UnixAddr::new(r.path()).unwrap()).unwrap();
    let before = cpu_ticks(&mut stat);
    // Half a second to measure what the thread spends.
    std::thread::sleep(Duration::from_millis(500));
    let spent = cpu_ticks(&mut stat) - before;
    let peers = r.stats().peers.load(Ordering::Relaxed);
    drop(held);
    setrlimit(Resource::RLIMIT_NOFILE, limits.0, limits.1).unwrap();
    assert_eq!(peers, 0, "no descriptor for the peer");
    // A thread spinning for half a second spends about 50 ticks (100 Hz).
    assert!(spent <= 5, "{spent} ticks in 500 ms: the rendezvous spins");
    // Descriptors are back: the connection is taken (at the next try,
    // within a second).
    let limit = Instant::now() + Duration::from_secs(10);
    while r.stats().peers.load(Ordering::Relaxed) == 0 {
        assert!(Instant::now() < limit, "the peer was never taken");
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(sock);
    drop(r);
    let _ = std::fs::remove_dir_all(&d);
}
