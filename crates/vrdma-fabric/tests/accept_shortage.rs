//! An Ethernet port whose guest NIC connects while the process's
//! descriptor table is full: the accept fails (EMFILE), and that is a
//! shortage to wait out, not the port's end. The port keeps serving, does
//! not spin on its listener meanwhile (its descriptor is not readable
//! until the wait is over), and takes the NIC once descriptors are free
//! again.
//!
//! This binary holds one test on purpose: it fills the process's
//! descriptor table (a lowered `RLIMIT_NOFILE`), which would fail any test
//! running beside it in another thread.

use std::{
    fs::File,
    io::{Read, Write},
    os::unix::net::{UnixListener, UnixStream},
    time::{Duration, Instant},
};

use nix::{
    poll::{PollFd, PollFlags, PollTimeout, poll},
    sys::resource::{Resource, getrlimit, setrlimit},
};
use vrdma_fabric::eth::{EthPort, Link, Stream};

const MAC: [u8; 6] = [0x52, 0x54, 0, 0x12, 0x34, 0x56];

/// Whether `fd` becomes readable within `ms` milliseconds.
fn readable(fd: std::os::fd::BorrowedFd<'_>, ms: u16) -> bool {
    let mut p = [PollFd::new(fd, PollFlags::POLLIN)];
    poll(&mut p, PollTimeout::from(ms)).unwrap() > 0
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
fn a_guest_nic_that_connects_while_descriptors_run_out_is_taken_once_they_are_back() {
    let dir = std::env::temp_dir().join(format!("vrdma-eth-shortage-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("guest.net");
    let (u, mut uplink) = UnixStream::pair().unwrap();
    let l = UnixListener::bind(&path).unwrap();
    let mut port = EthPort::with_listener(l, Link::Stream(Stream::new(u).unwrap()), MAC).unwrap();
    // The NIC connects (its socket is this process's too: made before the
    // table fills), and the table fills before the port accepts it.
    let mut nic = UnixStream::connect(&path).unwrap();
    let (held, limits) = fill_table();
    let r = port.receive(|_, _| {});
    let after = (port.stats(), port.guest_connected(), readable(port.fd(), 0));
    // A second turn while the table is still full: the same.
    let r2 = port.receive(|_, _| {});
    drop(held);
    setrlimit(Resource::RLIMIT_NOFILE, limits.0, limits.1).unwrap();

    // The port went on: no error, no guest yet, and its descriptor is not
    // readable while the shortage is waited out (a listener with a
    // connection waiting is readable: watching it would spin).
    assert!(r.is_ok(), "a full descriptor table ended the port: {r:?}");
    assert!(r2.is_ok(), "the second turn: {r2:?}");
    let (stats, connected, spinning) = after;
    assert!(!connected);
    assert_eq!(stats.guest_connects, 0);
    assert_eq!(stats.accept_shortages, 1);
    assert!(
        !spinning,
        "the port's descriptor is readable while it waits"
    );

    // Descriptors are back: the port wakes by itself (bounded wait) and
    // takes the NIC, which then reaches the uplink.
    let limit = Instant::now() + Duration::from_secs(10);
    while !port.guest_connected() {
        assert!(Instant::now() < limit, "the NIC was never taken");
        if readable(port.fd(), 1000) {
            port.receive(|_, _| {}).unwrap();
        }
    }
    assert_eq!(port.stats().guest_connects, 1);
    let frame = {
        let mut f = vec![0xff; 6];
        f.extend_from_slice(&MAC);
        f.extend_from_slice(&0x0800u16.to_be_bytes());
        f.resize(60, 0);
        f
    };
    nic.write_all(&(frame.len() as u32).to_be_bytes()).unwrap();
    nic.write_all(&frame).unwrap();
    while port.stats().uplink_tx == 0 {
        assert!(Instant::now() < limit, "the NIC's frame never left");
        if readable(port.fd(), 1000) {
            port.receive(|_, _| {}).unwrap();
        }
    }
    let mut got = vec![0u8; 4 + frame.len()];
    uplink
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    uplink.read_exact(&mut got).unwrap();
    assert_eq!(&got[4..], &frame[..]);
    let _ = std::fs::remove_dir_all(&dir);
}
