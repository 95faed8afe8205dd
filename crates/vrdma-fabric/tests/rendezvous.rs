//! Same-host shared memory between daemons: switches that joined one
//! rendezvous directory (each standing for a daemon; here, in one test
//! process) carry packets between their ports through rings; and a peer
//! that lies — spoken to by hand, as a hostile daemon would — is refused
//! without harm to the switch or its devices.

use std::{
    fs::{File, OpenOptions},
    io::{IoSlice, IoSliceMut},
    net::Ipv4Addr,
    os::fd::{AsFd, AsRawFd, OwnedFd},
    path::PathBuf,
    time::{Duration, Instant},
};

use nix::sys::socket::{
    AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType, UnixAddr,
    connect, recvmsg, sendmsg, socket,
};
use vrdma_fabric::{
    NoLender,
    shm::{JoinConfig, Port, Rendezvous, Switch, ring},
};
use vrdma_wire::{Gid, frame::Route};

fn gid(last: u8) -> Gid {
    Ipv4Addr::new(127, 0, 9, last).into()
}

fn route(src: u8, dst: u8) -> Route {
    Route {
        src: gid(src),
        dst: gid(dst),
        traffic_class: 0,
        hop_limit: 64,
        flow_label: 0,
    }
}

/// A fresh rendezvous directory for test `name`.
fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vrdma-rdv-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Waits (10 s at most) for `ok`: the rendezvous threads work on their
/// own time.
fn eventually(what: &str, mut ok: impl FnMut() -> bool) {
    let limit = Instant::now() + Duration::from_secs(10);
    while !ok() {
        assert!(Instant::now() < limit, "{what}: not within 10 s");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A "daemon": a switch that joined `d`, and a port on it holding `gids`.
fn daemon(d: &PathBuf, gids: &[Gid]) -> (Switch, Rendezvous, Port) {
    let sw = Switch::new();
    let r = sw.join(JoinConfig::new(d)).unwrap();
    let mut p = sw.attach().unwrap();
    p.set_local(gids);
    (sw, r, p)
}

/// Receives on `p` until `n` packets came (10 s at most).
fn take(p: &mut Port, n: usize) -> Vec<(Route, Vec<u8>)> {
    let mut got = Vec::new();
    eventually("packets", || {
        p.receive(|r, b, _| got.push((*r, b.to_vec())));
        got.len() >= n
    });
    got
}

#[test]
fn two_daemons_carry_packets_both_ways_and_forget_each_other_when_one_leaves() {
    let d = dir("two");
    let (sa, ra, mut a) = daemon(&d, &[gid(1)]);
    let (sb, rb, mut b) = daemon(&d, &[gid(2), gid(3)]);
    eventually("each daemon holds the other's addresses", || {
        sa.holds(&gid(2)) && sa.holds(&gid(3)) && sb.holds(&gid(1))
    });
    assert_eq!(
        ra.stats().peers.load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    for i in 0..200u32 {
        let mut pkt = vec![0u8; 60 + (i as usize % 4000)];
        pkt[..4].copy_from_slice(&i.to_le_bytes());
        a.send(
            &route(1, 2 + (i % 2) as u8),
            &pkt,
            pkt.len(),
            &[],
            &NoLender,
        )
        .unwrap();
        if i % 50 == 49 {
            a.flush();
            take(&mut b, 50);
        }
    }
    b.send(&route(3, 1), &[7; 100], 100, &[], &NoLender)
        .unwrap();
    b.flush();
    let got = take(&mut a, 1);
    assert_eq!(got[0].0, route(3, 1));
    assert_eq!(got[0].1, vec![7; 100]);
    assert_eq!(a.stats().tx_packets, 200);
    assert_eq!(b.stats().rx_packets, 200);
    // Wake-ups: an armed receiver's descriptor becomes readable.
    b.arm();
    a.send(&route(1, 2), &[1; 64], 64, &[], &NoLender).unwrap();
    a.flush();
    let mut fds = [nix::poll::PollFd::new(b.fd(), nix::poll::PollFlags::POLLIN)];
    assert_eq!(
        nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(5000u16)).unwrap(),
        1,
        "the armed device was woken"
    );
    assert_eq!(take(&mut b, 1).len(), 1);

    // B leaves: A forgets its addresses, and what A sends them goes
    // elsewhere (the uplink, for a device).
    drop((rb, b, sb));
    eventually("A forgets B's addresses", || {
        !sa.holds(&gid(2)) && !sa.holds(&gid(3))
    });
    assert!(!a.reaches(&gid(2)));
    drop(ra);
    assert!(
        std::fs::read_dir(&d).unwrap().next().is_none(),
        "sockets removed"
    );
}

/// The hostile daemon: a connection to the switch's socket, spoken to by
/// hand.
struct Fake {
    sock: OwnedFd,
}

const HELLO: u32 = 1;
const RING: u32 = 2;
const GIDS: u32 = 3;

impl Fake {
    fn connect(r: &Rendezvous) -> Fake {
        let sock = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        connect(sock.as_raw_fd(), &UnixAddr::new(r.path()).unwrap()).unwrap();
        let f = Fake { sock };
        let mut m = HELLO.to_le_bytes().to_vec();
        m.extend_from_slice(b"VRDMASHM");
        m.extend_from_slice(&1u32.to_le_bytes());
        m.extend_from_slice(&0x1234_5678u64.to_le_bytes());
        f.send(&m, &[]);
        f
    }

    fn send(&self, m: &[u8], fds: &[i32]) {
        let iov = [IoSlice::new(m)];
        let c = [ControlMessage::ScmRights(fds)];
        let cm: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &c };
        sendmsg::<()>(self.sock.as_raw_fd(), &iov, cm, MsgFlags::empty(), None).unwrap();
    }

    /// The next message from the switch and the files of the descriptors
    /// that came with it, reopened through /proc (a memfd reopens; an
    /// eventfd does not: `None`); None once the switch closed the
    /// connection.
    fn recv(&self) -> Option<(Vec<u8>, Vec<Option<File>>)> {
        let mut buf = vec![0u8; 4096];
        let mut iov = [IoSliceMut::new(&mut buf)];
        let mut space = nix::cmsg_space!([i32; 4]);
        let msg = recvmsg::<()>(
            self.sock.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .ok()?;
        let mut files = Vec::new();
        for c in msg.cmsgs().unwrap() {
            if let ControlMessageOwned::ScmRights(raw) = c {
                for fd in raw {
                    let f = OpenOptions::new()
                        .read(true)
                        .write(true)
                        .open(format!("/proc/self/fd/{fd}"))
                        .ok();
                    files.push(f);
                    let _ = nix::unistd::close(fd);
                }
            }
        }
        let n = msg.bytes;
        (n > 0).then(|| (buf[..n].to_vec(), files))
    }

    fn ring_msg(port: u32, slots: u32) -> Vec<u8> {
        let mut m = RING.to_le_bytes().to_vec();
        m.extend_from_slice(&port.to_le_bytes());
        m.extend_from_slice(&slots.to_le_bytes());
        m
    }

    fn gids_msg(port: u32, gids: &[Gid]) -> Vec<u8> {
        let mut m = GIDS.to_le_bytes().to_vec();
        m.extend_from_slice(&port.to_le_bytes());
        m.extend_from_slice(&(gids.len() as u32).to_le_bytes());
        for g in gids {
            m.extend_from_slice(&g.0);
        }
        m
    }
}

#[test]
fn a_lying_daemon_is_refused_and_the_devices_keep_their_packets() {
    let d = dir("liar");
    let (sa, ra, mut a) = daemon(&d, &[gid(1)]);
    let fake = Fake::connect(&ra);
    // The switch answers HELLO and offers a ring for its device, with
    // that device's addresses.
    let (hello, _) = fake.recv().expect("HELLO");
    assert_eq!(&hello[..4], &HELLO.to_le_bytes());
    let (m, mut fds) = fake.recv().expect("RING");
    assert_eq!(&m[..4], &RING.to_le_bytes());
    assert_eq!(fds.len(), 2, "the ring's memfd and the device's eventfd");
    let slots = u32::from_le_bytes(m[8..12].try_into().unwrap());
    let (gm, _) = fake.recv().expect("GIDS");
    assert_eq!(&gm[..4], &GIDS.to_le_bytes());
    let ring_file = fds[0].take().expect("a memfd");
    assert!(fds[1].is_none(), "an eventfd (it cannot be reopened)");
    let mut into_a =
        ring::open(OwnedFd::from(ring_file.try_clone().unwrap()), slots).expect("a sealed ring");

    // Rings the fake offers that must be refused: unsealed, and with a
    // wake-up descriptor that is not an eventfd.
    let bad = |fds: &[i32]| fake.send(&Fake::ring_msg(7, 8), fds);
    let unsealed = nix::sys::memfd::memfd_create(
        "x",
        nix::sys::memfd::MFdFlags::MFD_CLOEXEC | nix::sys::memfd::MFdFlags::MFD_ALLOW_SEALING,
    )
    .unwrap();
    nix::unistd::ftruncate(&unsealed, i64::try_from(ring::ring_len(8)).unwrap()).unwrap();
    let ev = nix::sys::eventfd::EventFd::new().unwrap();
    bad(&[unsealed.as_raw_fd(), ev.as_fd().as_raw_fd()]);
    let (good, _fd) = {
        let (c, fd) = ring::create(8, "fake").unwrap();
        (c, fd)
    };
    let (pr, pw) = nix::unistd::pipe().unwrap();
    bad(&[_fd.as_raw_fd(), pw.as_raw_fd()]);
    eventually("both rings refused", || {
        ra.stats()
            .bad_rings
            .load(std::sync::atomic::Ordering::Relaxed)
            == 2
    });
    drop((pr, good));

    // Packets into the device's ring from a source the fake never
    // announced: refused, counted.
    into_a.push(&route(9, 1), &[1; 80]).unwrap();
    into_a.publish();
    eventually("the spoofed packet refused", || {
        a.receive(|_, _, _| panic!("a packet from an address the peer does not hold"));
        a.stats().rx_refused == 1
    });
    // It announces a device at an address of its own and one of A's: the
    // second is A's, a conflict.
    let (c2, fd2) = ring::create(8, "fake2").unwrap();
    let ev2 = nix::sys::eventfd::EventFd::new().unwrap();
    fake.send(
        &Fake::ring_msg(1, 8),
        &[fd2.as_raw_fd(), ev2.as_fd().as_raw_fd()],
    );
    fake.send(&Fake::gids_msg(1, &[gid(9), gid(1)]), &[]);
    eventually("the fake's address taken, A's kept", || {
        sa.holds(&gid(9))
            && ra
                .stats()
                .gid_conflicts
                .load(std::sync::atomic::Ordering::Relaxed)
                == 1
    });
    // Now from its address: delivered.
    into_a.push(&route(9, 1), &[2; 80]).unwrap();
    into_a.publish();
    let got = take(&mut a, 1);
    assert_eq!(got[0].1, vec![2; 80]);
    // To A's address, A's own device still gets its packets (not the
    // fake's ring).
    a.send(&route(1, 9), &[3; 50], 50, &[], &NoLender).unwrap();
    a.flush();
    let mut c2 = c2;
    let mut buf = vec![0u8; vrdma_wire::packet::MAX_LEN];
    eventually("A's packet in the fake's ring", || c2.pop(&mut buf).is_ok());
    assert_eq!(&buf[..50], &[3; 50]);

    // An index from nowhere (the fake writes the producer's count
    // itself): the ring is broken and read no more; the device is fine,
    // and still hears its own switch.
    let raw = vm_memory::MmapRegion::<()>::from_file(
        vm_memory::FileOffset::new(ring_file, 0),
        ring::ring_len(slots),
    )
    .unwrap();
    use vm_memory::{Bytes, VolatileMemory};
    raw.as_volatile_slice()
        .store(1u64 << 50, 0, std::sync::atomic::Ordering::SeqCst)
        .unwrap();
    eventually("the ring broken", || {
        a.receive(|_, _, _| panic!("nothing from a broken ring"));
        a.stats().rx_broken == 1
    });
    // Counted once, and the ring is gone: later rounds read nothing of it.
    for _ in 0..10 {
        a.receive(|_, _, _| panic!("nothing from a broken ring"));
    }
    assert_eq!(a.stats().rx_broken, 1);
    let mut local = sa.attach().unwrap();
    local.set_local(&[gid(5)]);
    local
        .send(&route(5, 1), &[4; 40], 40, &[], &NoLender)
        .unwrap();
    local.flush();
    assert_eq!(take(&mut a, 1)[0].1, vec![4; 40]);

    // A message out of shape: the connection is dropped, and with it the
    // fake's addresses.
    fake.send(&[9, 0, 0, 0], &[]);
    eventually("the fake dropped", || !sa.holds(&gid(9)));
    assert!(
        ra.stats()
            .refused
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );
    assert!(sa.holds(&gid(1)));
}

/// A connection that never says HELLO does not keep a peer's place: it is
/// closed once its HELLO is overdue (5 s).
#[test]
fn a_silent_connection_is_closed() {
    let d = dir("silent");
    let (_sa, ra, _a) = daemon(&d, &[gid(1)]);
    let sock = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap();
    connect(sock.as_raw_fd(), &UnixAddr::new(ra.path()).unwrap()).unwrap();
    let peers = || ra.stats().peers.load(std::sync::atomic::Ordering::Relaxed);
    eventually("the connection taken", || peers() == 1);
    eventually("the silent connection closed", || peers() == 0);
    assert_eq!(
        ra.stats()
            .refused
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}
