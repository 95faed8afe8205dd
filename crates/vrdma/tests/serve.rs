//! `vrdma serve` confined (`--seccomp kill`: a system call outside its
//! allow-list kills it), end to end: the daemon's device, its uplink a
//! socket this test listens on and joins to a device served in this
//! process (an Ethernet port on the accepted stream), a guest on each
//! (the test kit's: a vfio-user client and the driver model) running a
//! whole RC exchange — SEND, WRITE, READ, atomics — byte-exact. The
//! daemon is confined (seccomp filter, no new privileges, no
//! capabilities, on every thread), and outlives what a hostile client
//! sends it: unsealed memory, a flood of frames, garbage for messages.
//! Unsealed guest memory is refused unless `--allow-unsealed`, and then
//! guarded: the daemon survives the client truncating it.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::IpAddr,
    os::{
        fd::AsFd,
        unix::net::{UnixListener, UnixStream},
    },
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap};
use vrdma_pvrdma::abi::{self, PAGE_SIZE, cmd, reg};
use vrdma_testkit::pvrdma::{
    Endpoint, Guest, Net, connect, eth::frame, exchange, hdr, le32, mac_of, one_page,
    read_and_atomics, side::RAM, unsealed_page,
};
use vrdma_vfio_user::proto::{self, Header, cmd as vcmd};
use vrdma_wire::Gid;
use zerocopy::IntoBytes;

/// This binary's block of addresses (see `vrdma_testkit::pvrdma`).
static NET: Net = Net::new(24);

use vrdma_testkit::errno::{EINVAL, EPERM};

/// How long the daemon may take to start, and to stop.
const LIMIT: Duration = Duration::from_secs(10);

/// A `vrdma serve` with one device, as a child process.
struct Daemon {
    child: Child,
    name: String,
    /// Its stderr, line by line.
    lines: mpsc::Receiver<String>,
    socket: PathBuf,
    netdev: PathBuf,
    addr: IpAddr,
    mac: [u8; 6],
}

impl Daemon {
    /// Starts `vrdma serve ARGS --device …` with one device `name` (its
    /// files in `dir`, its guest's address one of this binary's, the
    /// source filter on, on the network `serve-tests`) whose uplink connects to a socket this test
    /// listens on; returns once the daemon said it is ready, with this
    /// test's end of the uplink.
    fn start(dir: &Path, name: &str, args: &[&str]) -> (Daemon, UnixStream) {
        Self::start_kind(dir, name, args, "pvrdma")
    }

    /// [`Daemon::start`] with a device of `kind` (`vrdma serve`'s
    /// `kind=`).
    fn start_kind(dir: &Path, name: &str, args: &[&str], kind: &str) -> (Daemon, UnixStream) {
        let uplink_path = dir.join(format!("{name}.uplink"));
        let listener = UnixListener::bind(&uplink_path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = NET.addr();
        let mac = mac_of(addr);
        let mac_s: Vec<String> = mac.iter().map(|b| format!("{b:02x}")).collect();
        let socket = dir.join(format!("{name}.sock"));
        let netdev = dir.join(format!("{name}.net"));
        let device = format!(
            "kind={kind},socket={},netdev={},uplink=stream:{},mac={},spoof=on,ip={addr},net=serve-tests,name={name}",
            socket.display(),
            netdev.display(),
            uplink_path.display(),
            mac_s.join(":"),
        );
        let mut child = Command::new(env!("CARGO_BIN_EXE_vrdma"))
            .arg("serve")
            .args(args)
            .args(["--device", &device])
            .env("VRDMA_RUN_DIR", dir.join("run"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning vrdma serve");
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[vrdma serve] {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut d = Daemon {
            child,
            name: name.to_owned(),
            lines,
            socket,
            netdev,
            addr,
            mac,
        };
        // The daemon connects its uplink while it opens the device.
        let deadline = Instant::now() + LIMIT;
        let uplink = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    d.alive();
                    assert!(Instant::now() < deadline, "the daemon never connected");
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => panic!("accepting the daemon's uplink: {e}"),
            }
        };
        uplink.set_nonblocking(false).unwrap();
        let ready = format!("vrdma serve: {name} ready");
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match d.lines.recv_timeout(left) {
                Ok(l) if l == ready => break,
                Ok(_) => {}
                Err(_) => {
                    d.alive();
                    panic!("the daemon never said it was ready");
                }
            }
        }
        (d, uplink)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Panics if the daemon has ended (how, and what that means).
    fn alive(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            use std::os::unix::process::ExitStatusExt;
            let hint = if status.signal() == Some(libc_sigsys()) {
                ": SIGSYS, a system call missing from vrdma-tools' sandbox::allowed() \
                 (run with --seccomp log, or strace -f, to find it)"
            } else {
                ""
            };
            panic!("vrdma serve ({}) ended: {status}{hint}", self.name);
        }
    }

    /// SIGTERM, and how the daemon ended.
    fn stop(mut self) -> ExitStatus {
        self.alive();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(self.pid()).unwrap()),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let deadline = Instant::now() + LIMIT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "the daemon did not stop");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if std::thread::panicking()
            && let Ok(Some(status)) = self.child.try_wait()
        {
            use std::os::unix::process::ExitStatusExt;
            eprintln!("vrdma serve ({}) had ended: {status}", self.name);
            if status.signal() == Some(libc_sigsys()) {
                eprintln!(
                    "SIGSYS: a system call missing from vrdma-tools' sandbox::allowed() \
                     (run with --seccomp log, or strace -f, to find it)"
                );
            }
        }
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// SIGSYS's number (what a seccomp kill sends).
fn libc_sigsys() -> i32 {
    nix::sys::signal::Signal::SIGSYS as i32
}

/// The options that confine a daemon in kill mode, and where under a
/// test's directory its counters then go: as root, with a user of its own
/// (`nobody`; a confined root daemon must not stay root:
/// `sandbox::refuse_staying_root`), its counters in that user's directory.
fn kill_mode() -> (Vec<&'static str>, &'static str) {
    if nix::unistd::Uid::effective().is_root() {
        (vec!["--seccomp", "kill", "--user", "nobody"], "run/nobody")
    } else {
        (vec!["--seccomp", "kill"], "run")
    }
}

/// A rendezvous directory under `dir` that the daemons' user may write:
/// as root, root's and sticky, writable by all (as /tmp is), for daemons
/// that become `nobody`.
fn rendezvous_dir(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let rdv = dir.join("rdv");
    std::fs::create_dir_all(&rdv).unwrap();
    if nix::unistd::Uid::effective().is_root() {
        std::fs::set_permissions(&rdv, std::fs::Permissions::from_mode(0o1777)).unwrap();
    }
    rdv
}

/// A fresh directory for test `name`'s files.
fn test_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vrdma-serve-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("run")).unwrap();
    dir
}

/// Checks that every thread of process `pid` is confined: a seccomp
/// filter, no new privileges, no effective capability.
fn confined(pid: u32) {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
    let mut n = 0;
    for t in tasks {
        let status = std::fs::read_to_string(t.unwrap().path().join("status")).unwrap();
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k)?.strip_prefix(':'))
                .map(|v| v.trim().to_owned())
                .unwrap_or_else(|| panic!("{k} in {status}"))
        };
        assert_eq!(field("Seccomp"), "2", "a filter");
        assert_eq!(field("NoNewPrivs"), "1");
        assert_eq!(field("CapEff"), "0000000000000000");
        n += 1;
    }
    // The main thread and the device's.
    assert!(n >= 2, "{n} threads");
}

/// Sends `bytes` on a new connection to `socket`; true if the daemon
/// closed it (EOF within 5 s).
fn closed_after(socket: &Path, bytes: &[u8]) -> bool {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// The counters device `name` published last in `run` (a stopped
/// daemon's, as `vrdma stat` reads them).
fn counters(run: &Path, name: &str) -> std::collections::HashMap<String, u64> {
    let path = run.join(format!("{name}.stat"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(text.contains("state closed"), "{text}");
    text.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            Some((k.to_owned(), v.parse().ok()?))
        })
        .collect()
}

fn header(command: u16, size: u32) -> Header {
    Header {
        id: 1,
        command,
        size,
        flags: 0,
        error: 0,
    }
}

#[test]
fn a_confined_daemon_serves_a_whole_exchange_and_outlives_hostile_input() {
    if nix::unistd::Uid::effective().is_root() {
        // A root daemon without --user drops every thread's capabilities:
        // with the logging filter (kill mode needs --user as root; the
        // next test runs it so).
        serve_confined("confined", &["--seccomp", "log"], "run");
    } else {
        serve_confined("confined", &["--seccomp", "kill"], "run");
    }
}

#[test]
fn a_daemon_confined_as_a_user_of_its_own_does_the_same() {
    let args = ["--seccomp", "kill", "--user", "nobody"];
    if nix::unistd::Uid::effective().is_root() {
        // Its counters then go to a directory of the user's.
        serve_confined("as-nobody", &args, "run/nobody");
    } else {
        // Only root can change user: the daemon says so and ends.
        let dir = test_dir("as-nobody");
        let out = Command::new(env!("CARGO_BIN_EXE_vrdma"))
            .arg("serve")
            .args(args)
            .args([
                "--device",
                "socket=/s,netdev=/n,uplink=stream:/u,mac=02:00:00:00:00:01",
            ])
            .env("VRDMA_RUN_DIR", dir.join("run"))
            .output()
            .unwrap();
        assert!(!out.status.success());
    }
}

/// A root daemon asked to confine itself in kill mode without becoming
/// another user is refused before it opens anything, and told what to
/// pass: it would stay uid 0, the owner of root's files.
#[test]
fn a_root_daemon_is_not_confined_without_a_user_of_its_own() {
    if !nix::unistd::Uid::effective().is_root() {
        return;
    }
    let dir = test_dir("stays-root");
    let socket = dir.join("d.sock");
    for user in [None, Some("root"), Some("0")] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vrdma"));
        cmd.args(["serve", "--seccomp", "kill"]);
        if let Some(u) = user {
            cmd.args(["--user", u]);
        }
        let device = format!(
            "socket={},netdev={},uplink=stream:{},mac=02:00:00:00:00:01",
            socket.display(),
            dir.join("d.net").display(),
            dir.join("d.uplink").display()
        );
        let out = cmd
            .args(["--device", &device])
            .env("VRDMA_RUN_DIR", dir.join("run"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{user:?}: {err}");
        assert!(err.contains("--user"), "{user:?}: {err}");
        assert!(!socket.exists(), "{user:?}: nothing opened");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The daemon's device `name`, confined by `args`, serving a guest's
/// whole exchange with a device of this process before and after hostile
/// input; its counters published under `run` in its directory.
fn serve_confined(name: &str, args: &[&str], run: &str) {
    let dir = test_dir(name);
    let (mut d, uplink) = Daemon::start(&dir, name, args);
    let peer = NET.eth_device_on(&format!("{name}-peer"), uplink);
    let daemon_side = |d: &Daemon| Endpoint::on(&d.socket, Gid::from(d.addr), d.mac, RAM);
    let mut a = daemon_side(&d);
    let mut b = Endpoint::new(&peer);
    connect(&mut a, &mut b);
    exchange(&mut a, &mut b);
    read_and_atomics(&mut a, &mut b);
    read_and_atomics(&mut b, &mut a);
    confined(d.pid());

    // Unsealed memory from the guest's own connection: refused, and the
    // guest goes on.
    let fd = unsealed_page();
    let (h, _) = a.g.request(
        vcmd::DMA_MAP,
        one_page(0x4_0000_0000).as_bytes(),
        &[fd.as_fd()],
    );
    assert_eq!(h.error, EPERM, "an unsealed memfd");
    // A pipe for an interrupt (the daemon looks the descriptor up in
    // /proc/self/fd): refused.
    let (_pipe_r, pipe_w) = nix::unistd::pipe().unwrap();
    let set = proto::IrqSet {
        argsz: 20,
        flags: proto::irq::DATA_EVENTFD | proto::irq::ACTION_TRIGGER,
        index: proto::irq_index::MSIX,
        start: 0,
        count: 1,
    };
    let (h, _) =
        a.g.request(vcmd::DEVICE_SET_IRQS, set.as_bytes(), &[pipe_w.as_fd()]);
    assert_eq!(h.error, EINVAL, "a pipe for an interrupt");
    exchange(&mut a, &mut b);

    // The guest's NIC floods the daemon's netdev (eight writers, the
    // guest's own frames to a MAC nobody has) while the guest exchanges.
    let nic = UnixStream::connect(&d.netdev).unwrap();
    let f = frame::udp(
        [2, 0xee, 0xee, 0xee, 0xee, 0xee],
        d.mac,
        frame::v4(d.addr),
        std::net::Ipv4Addr::new(10, 9, 9, 9),
        9,
        &[0x5a; 1400],
    );
    let mut m = (f.len() as u32).to_be_bytes().to_vec();
    m.extend_from_slice(&f);
    let burst = m.repeat(16);
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..8)
        .map(|_| {
            let mut s = nic.try_clone().unwrap();
            let (stop, sent, burst) = (stop.clone(), sent.clone(), burst.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if s.write_all(&burst).is_err() {
                        return;
                    }
                    sent.fetch_add(16, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for _ in 0..5 {
        exchange(&mut a, &mut b);
        read_and_atomics(&mut a, &mut b);
    }
    // A second NIC meanwhile: closed at once.
    let mut second = UnixStream::connect(&d.netdev).unwrap();
    second
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    assert_eq!(second.read(&mut [0u8; 1]).unwrap(), 0, "a second NIC");
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    let frames = sent.load(Ordering::Relaxed);
    assert!(frames > 1000, "a flood of {frames} frames");
    d.alive();

    // The guest goes; clients send what is no message (a size shorter
    // than a header, a size past any message, a header cut short, a
    // message cut short): each is closed.
    drop(a);
    drop(nic);
    for bytes in [
        header(vcmd::VERSION, 8).as_bytes().to_vec(),
        header(vcmd::VERSION, u32::MAX).as_bytes().to_vec(),
        header(vcmd::VERSION, 100).as_bytes()[..10].to_vec(),
        header(vcmd::VERSION, 100).as_bytes().to_vec(),
        vec![0xff; 4096],
    ] {
        assert!(closed_after(&d.socket, &bytes), "{bytes:02x?}");
        d.alive();
    }

    // The next guest is served as the first was.
    let mut a = daemon_side(&d);
    b.new_qp();
    connect(&mut a, &mut b);
    exchange(&mut a, &mut b);
    read_and_atomics(&mut a, &mut b);
    read_and_atomics(&mut b, &mut a);
    confined(d.pid());
    // The daemon stops on SIGTERM, cleanly; the peer, held between turns
    // meanwhile, goes after it without another turn (its uplink closes
    // with the daemon).
    drop((a, b));
    peer.pause();
    let status = d.stop();
    assert!(status.success(), "vrdma serve: {status}");
    let c = counters(&dir.join(run), name);
    assert_eq!(c["eth.guest_rx"], frames, "every frame of the flood taken");
    assert_eq!(c["eth.guest_refused"], 1, "the second NIC");
    assert_eq!(c["vfio.dma_refused"], 1, "the unsealed map");
    assert_eq!(c["pvrdma.panics"], 0);
    assert_eq!((c["vfio.fds"], c["vfio.dma_maps"]), (0, 0), "nothing held");
    eprintln!("a flood of {frames} frames");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unsealed_guest_memory_is_refused_unless_allowed_and_then_guarded() {
    let dir = test_dir("unsealed");
    let (kill, run) = kill_mode();
    // By default: EPERM.
    let (mut d, _uplink) = Daemon::start(&dir, "sealed-only", &kill);
    let mut g = Guest::connect(&d.socket, RAM);
    let fd = unsealed_page();
    let (h, _) = g.request(
        vcmd::DMA_MAP,
        one_page(0x4_0000_0000).as_bytes(),
        &[fd.as_fd()],
    );
    assert_eq!(h.error, EPERM, "an unsealed memfd");
    assert_eq!(g.probe(), 0);
    drop(g);
    d.alive();
    assert!(d.stop().success());

    // --allow-unsealed: taken, used (the response slot is in it), and
    // truncated under the daemon, which lives on.
    let unsealed_ok = [kill.as_slice(), &["--allow-unsealed"]].concat();
    let (mut d, _uplink) = Daemon::start(&dir, "unsealed-ok", &unsealed_ok);
    let mut g = Guest::connect(&d.socket, RAM);
    let extra = 0x4_0000_0000u64;
    let (h, _) = g.request(vcmd::DMA_MAP, one_page(extra).as_bytes(), &[fd.as_fd()]);
    assert_eq!(h.error, 0, "an unsealed memfd, allowed");
    let view = GuestMemoryMmap::<()>::from_ranges_with_files([(
        GuestAddress(extra),
        PAGE_SIZE as usize,
        Some(FileOffset::new(
            std::fs::File::from(fd.try_clone().unwrap()),
            0,
        )),
    )])
    .unwrap();
    let mut dsr = g.dsr_template();
    dsr.resp_slot_dma = extra.into();
    g.resp_slot = extra;
    assert_eq!(g.load_dsr(&dsr), 0);
    g.write32(1, reg::IMR, 0);
    g.write32(1, reg::CTL, reg::CTL_ACTIVATE);
    assert_eq!(g.read32(1, reg::ERR), 0);
    let create_pd = |g: &mut Guest| {
        let mut slot = vec![0u8; abi::MAX_REQUEST];
        let req = abi::Handle {
            hdr: hdr(cmd::CREATE_PD),
            handle: 0.into(),
            reserved: [0; 4],
        };
        slot[..24].copy_from_slice(req.as_bytes());
        g.put(g.cmd_slot, &slot);
        g.write32(1, reg::REQUEST, 0);
        g.read32(1, reg::ERR)
    };
    assert_eq!(create_pd(&mut g), 0);
    assert!(g.wait_irq(0), "the response interrupt");
    let mut r = [0u8; 24];
    view.read_slice(&mut r, GuestAddress(extra)).unwrap();
    assert_eq!(le32(&r[8..12]), cmd::ACK | cmd::CREATE_PD, "the response");
    // The client shrinks the file under the daemon: its next response
    // goes to a page that is gone (a SIGBUS the daemon repairs).
    nix::unistd::ftruncate(&fd, 0).unwrap();
    assert_eq!(create_pd(&mut g), 0);
    d.alive();
    assert_eq!(
        g.read32(1, reg::VERSION),
        abi::VERSION,
        "the device answers"
    );
    confined(d.pid());
    drop(g);
    assert!(d.stop().success());
    let c = counters(&dir.join(run), "unsealed-ok");
    assert_eq!(c["vfio.dma_faults"], 1, "the lost page's fault, repaired");
    assert_eq!(c["vfio.dma_refused"], 0);
    assert_eq!(
        counters(&dir.join(run), "sealed-only")["vfio.dma_refused"],
        1
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Two confined daemons (`--seccomp kill`) that joined one rendezvous
/// directory (`--shm-dir`), a device each whose uplink leads nowhere (a
/// socket this test holds and never reads): their guests' whole RC
/// exchange — SEND, WRITE, READ, atomics, both ways — can only go through
/// the rings between the daemons. It does, byte-exact; the daemons stay
/// confined, nothing arrived over an uplink, and each counted the
/// packets it took from shared memory.
#[test]
fn two_confined_daemons_reach_each_other_through_their_rendezvous() {
    let dir = test_dir("rendezvous");
    let rdv = rendezvous_dir(&dir);
    let rdv_s = rdv.display().to_string();
    let (kill, run) = kill_mode();
    let args = [kill.as_slice(), &["--shm-dir", rdv_s.as_str()]].concat();
    let (d1, _u1) = Daemon::start(&dir, "rdv-a", &args);
    let (d2, _u2) = Daemon::start(&dir, "rdv-b", &args);
    let side = |d: &Daemon| Endpoint::on(&d.socket, Gid::from(d.addr), d.mac, RAM);
    let (mut a, mut b) = (side(&d1), side(&d2));
    connect(&mut a, &mut b);
    for _ in 0..3 {
        exchange(&mut a, &mut b);
        read_and_atomics(&mut a, &mut b);
        read_and_atomics(&mut b, &mut a);
    }
    confined(d1.pid());
    confined(d2.pid());
    drop((a, b));
    let (n1, n2) = (d1.name.clone(), d2.name.clone());
    for d in [d1, d2] {
        let status = d.stop();
        assert!(status.success(), "vrdma serve: {status}");
    }
    for n in [n1, n2] {
        let c = counters(&dir.join(run), &n);
        assert!(
            c["shm.rx_packets"] >= 20,
            "{n}: {} packets from shm",
            c["shm.rx_packets"]
        );
        assert_eq!(
            c.get("eth.roce_rx").copied().unwrap_or(0),
            0,
            "{n}: nothing over the uplink"
        );
        assert_eq!(c.get("shm.rx_refused").copied().unwrap_or(0), 0, "{n}");
    }
    // (What root granted the daemons' user, `grants/`, stays.)
    let left: Vec<_> = std::fs::read_dir(&rdv)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != "grants")
        .collect();
    assert!(
        left.is_empty(),
        "the daemons took their sockets with them: {left:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// virtio-rdma as a virtio-pci function over vfio-user (`kind=virtio-pci`,
/// docs/virtio-rdma.md §13.3), served by two confined daemons that reach
/// each other through their rendezvous: the test kit's virtio-pci
/// front-end on each (a vfio-user client and `virtio_pci_modern`'s
/// start-up, the driver above it), RC SENDs, WRITEs and READs checked byte
/// for byte; the daemons stay confined and stop cleanly with nothing held.
#[test]
fn confined_daemons_serve_virtio_rdma_as_a_pci_function() {
    use vrdma_testkit::virtio as v;
    let dir = test_dir("virtio-pci");
    let rdv = rendezvous_dir(&dir);
    let rdv_s = rdv.display().to_string();
    let (kill, run) = kill_mode();
    let args = [kill.as_slice(), &["--shm-dir", rdv_s.as_str()]].concat();
    let (d1, _u1) = Daemon::start_kind(&dir, "vpci-a", &args, "virtio-pci");
    let (d2, _u2) = Daemon::start_kind(&dir, "vpci-b", &args, "virtio-pci");
    let side = |d: &Daemon| {
        let ram = Arc::new(v::Ram::new(0, 64 << 20));
        let fe = v::Frontend::connect_pci(&d.socket, ram, v::Options::default());
        v::Endpoint::on(fe, Gid::from(d.addr))
    };
    let (mut a, mut b) = (side(&d1), side(&d2));
    let mut qa = a.qp(vrdma_virtio::abi::qp_type::RC);
    let mut qb = b.qp(vrdma_virtio::abi::qp_type::RC);
    v::connect(&mut a, &qa, &mut b, &qb);
    for round in 0..3u8 {
        v::send_checked(&mut a, &mut qa, &mut b, &mut qb, round, 5000);
        v::send_checked(&mut b, &mut qb, &mut a, &mut qa, round + 10, 70_000);
        let data = v::pattern(round, 30_000);
        a.put(0, &data);
        qa.post_send(&v::Wqe::write(
            1,
            &[a.mr.sge(0, 30_000)],
            b.mr.addr(65536),
            b.mr.rkey,
        ));
        a.cq.expect_ok(v::wc::RDMA_WRITE, 1);
        assert_eq!(b.get(65536, 30_000), data, "the WRITE's bytes");
        qa.post_send(&v::Wqe::read(
            2,
            &[a.mr.sge(131_072, 30_000)],
            b.mr.addr(65536),
            b.mr.rkey,
        ));
        a.cq.expect_ok(v::wc::RDMA_READ, 2);
        assert_eq!(a.get(131_072, 30_000), data, "the READ's bytes");
    }
    confined(d1.pid());
    confined(d2.pid());
    drop((a, b));
    let (n1, n2) = (d1.name.clone(), d2.name.clone());
    for d in [d1, d2] {
        let status = d.stop();
        assert!(status.success(), "vrdma serve: {status}");
    }
    for n in [n1, n2] {
        let c = counters(&dir.join(run), &n);
        assert!(
            c["shm.rx_packets"] >= 10,
            "{n}: {} packets from shm",
            c["shm.rx_packets"]
        );
        assert_eq!(c["pci.panics"], 0, "{n}");
        assert!(
            c["pci.kicks"] > 0,
            "{n}: kicks through the notify addresses"
        );
        assert_eq!(
            (c["vfio.fds"], c["vfio.dma_maps"]),
            (0, 0),
            "{n}: nothing held"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
