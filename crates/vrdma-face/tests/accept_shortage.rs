//! A device's vfio-user server whose client connects while the process's
//! descriptor table is full: the accept fails (EMFILE), a shortage the
//! server waits out. Meanwhile its loop does not spin on the listener
//! (which stays readable while the connection waits): a turn sleeps until
//! the next try instead of returning at once. Once descriptors are free
//! again the waiting client is taken and served.
//!
//! This binary holds one test on purpose: it fills the process's
//! descriptor table (a lowered `RLIMIT_NOFILE`), which would fail any test
//! running beside it in another thread.

use std::{
    fs::File,
    io,
    os::{
        fd::{AsFd, BorrowedFd},
        unix::net::UnixStream,
    },
    time::{Duration, Instant},
};

use nix::{
    errno::Errno,
    sys::{
        eventfd::{EfdFlags, EventFd},
        resource::{Resource, getrlimit, setrlimit},
    },
};
use vrdma_device::Progress;
use vrdma_face::vfio::{Served, Server};
use vrdma_vfio_user::{Bus, Function, Region, pci::ConfigSpace, proto, socket::Client};
use zerocopy::IntoBytes;

/// A function with nothing behind it: no regions, never busy, a network
/// descriptor that never becomes readable.
struct Idle {
    config: ConfigSpace,
    net: EventFd,
}

impl Function for Idle {
    fn region(&self, _: u32) -> Region {
        Region {
            size: 0,
            mmap: None,
        }
    }
    fn irq_counts(&self) -> Vec<u32> {
        vec![0; 5]
    }
    fn config(&self) -> &ConfigSpace {
        &self.config
    }
    fn config_mut(&mut self) -> &mut ConfigSpace {
        &mut self.config
    }
    fn region_read(&mut self, _: &mut Bus<'_>, _: u32, _: u64, _: &mut [u8]) -> Result<(), Errno> {
        Err(Errno::EINVAL)
    }
    fn region_write(&mut self, _: &mut Bus<'_>, _: u32, _: u64, _: &[u8]) -> Result<(), Errno> {
        Err(Errno::EINVAL)
    }
    fn config_written(&mut self, _: &mut Bus<'_>) {}
    fn reset(&mut self, _: &mut Bus<'_>) {}
    fn memory_changed(&mut self, _: &mut Bus<'_>) {}
}

impl Served for Idle {
    fn progress(&mut self, _: &mut Bus<'_>) -> io::Result<Progress> {
        Ok(Progress::default())
    }
    fn recheck(&self) -> Option<std::time::Duration> {
        None
    }
    fn now(&self) -> u64 {
        0
    }
    fn fd(&self) -> BorrowedFd<'_> {
        self.net.as_fd()
    }
    fn arm(&mut self) {}
    fn client_gone(&mut self) {}
    fn fail(&mut self, _: &mut Bus<'_>) {}
    fn counters(&self) -> Vec<(String, u64)> {
        Vec::new()
    }
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
            Err(e) if e.raw_os_error() == Some(Errno::EMFILE as i32) => break,
            Err(e) => panic!("filling the table: {e}"),
        }
    }
    held.push(base);
    (held, limits)
}

#[test]
fn a_client_that_connects_while_descriptors_run_out_is_served_once_they_are_back() {
    let dir = std::env::temp_dir().join(format!("vrdma-face-shortage-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // SAFETY: this binary's only test, before it starts a thread: nothing
    // reads the environment meanwhile.
    unsafe { std::env::set_var("VRDMA_RUN_DIR", dir.join("run")) };
    let socket = dir.join("dev.sock");
    let function = Idle {
        config: ConfigSpace::new(0x15ad, 0x0820, 0x02_0700, 0),
        net: EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC).unwrap(),
    };
    let mut server = Server::bind(&socket, function, "shortage").unwrap();
    // Turns with nothing to do: a turn then sleeps (up to its idle wait).
    server.turn().unwrap();

    let client = UnixStream::connect(&socket).unwrap();
    let (held, limits) = fill_table();
    // For as long as the table stays full, turns come only as often as
    // the server tries again (10 ms, then longer): a loop that spun on
    // the readable listener would turn thousands of times.
    let t0 = Instant::now();
    let mut turns = 0;
    let mut result = Ok(());
    while t0.elapsed() < Duration::from_millis(100) && result.is_ok() {
        result = server.turn();
        turns += 1;
    }
    let clients = server.clients;
    drop(held);
    setrlimit(Resource::RLIMIT_NOFILE, limits.0, limits.1).unwrap();
    result.unwrap();
    assert_eq!(clients, 0, "no descriptor for the client");
    assert!(
        server
            .counters()
            .contains(&("vfio.accept_shortages".into(), turns))
    );
    assert!(turns <= 10, "{turns} turns in 100 ms: the loop spins");

    // Descriptors are back: the client is taken (the next try, at most a
    // second away) and answered.
    let limit = Instant::now() + Duration::from_secs(10);
    while server.clients == 0 {
        assert!(Instant::now() < limit, "the client was never taken");
        server.turn().unwrap();
    }
    let mut client = Client::new(client).unwrap();
    let version = proto::Header {
        id: 1,
        command: proto::cmd::VERSION,
        size: proto::HEADER_LEN as u32,
        flags: 0,
        error: 0,
    };
    client.send(version.as_bytes(), &[]).unwrap();
    let replier = std::thread::spawn(move || client.receive());
    while !replier.is_finished() {
        assert!(Instant::now() < limit, "no reply");
        server.turn().unwrap();
    }
    let reply = replier.join().unwrap().unwrap().unwrap();
    assert_eq!(reply.header.id, 1);
    let _ = std::fs::remove_dir_all(&dir);
}
