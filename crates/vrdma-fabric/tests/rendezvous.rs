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
    shm::{JoinConfig, Owned, Port, Rendezvous, Switch, Trust, ring, write_grant},
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
    let (na, nb) = (sa.default_network(), sb.default_network());
    eventually("each daemon holds the other's addresses", || {
        sa.holds(&na, &gid(2)) && sa.holds(&na, &gid(3)) && sb.holds(&nb, &gid(1))
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
        !sa.holds(&na, &gid(2)) && !sa.holds(&na, &gid(3))
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
const NETS: u32 = 5;

fn hello_msg(id: u64) -> Vec<u8> {
    let mut m = HELLO.to_le_bytes().to_vec();
    m.extend_from_slice(b"VRDMASHM");
    m.extend_from_slice(&2u32.to_le_bytes());
    m.extend_from_slice(&id.to_le_bytes());
    m
}

impl Fake {
    /// Connected to `path`, past HELLO (as instance `id`), saying its
    /// devices are on `nets`.
    fn connect_to(path: &std::path::Path, id: u64, nets: &[&str]) -> Fake {
        let sock = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        connect(sock.as_raw_fd(), &UnixAddr::new(path).unwrap()).unwrap();
        let f = Fake { sock };
        f.send(&hello_msg(id), &[]);
        f.send(&Fake::nets_msg(nets), &[]);
        f
    }

    fn connect(r: &Rendezvous) -> Fake {
        Fake::connect_to(r.path(), 0x1234_5678, &["default"])
    }

    fn send(&self, m: &[u8], fds: &[i32]) {
        let iov = [IoSlice::new(m)];
        let c = [ControlMessage::ScmRights(fds)];
        let cm: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &c };
        // A closed connection (the switch dropped it) is the test's to see.
        let _ = sendmsg::<()>(self.sock.as_raw_fd(), &iov, cm, MsgFlags::empty(), None);
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

    /// The next message of `kind` (others skipped).
    fn recv_kind(&self, kind: u32) -> Option<(Vec<u8>, Vec<Option<File>>)> {
        loop {
            let (m, f) = self.recv()?;
            if m[..4] == kind.to_le_bytes() {
                return Some((m, f));
            }
        }
    }

    fn nets_msg(nets: &[&str]) -> Vec<u8> {
        let mut m = NETS.to_le_bytes().to_vec();
        m.extend_from_slice(&(nets.len() as u32).to_le_bytes());
        for n in nets {
            m.push(n.len() as u8);
            m.extend_from_slice(n.as_bytes());
        }
        m
    }

    fn ring_msg_on(port: u32, slots: u32, net: &str) -> Vec<u8> {
        let mut m = RING.to_le_bytes().to_vec();
        m.extend_from_slice(&port.to_le_bytes());
        m.extend_from_slice(&slots.to_le_bytes());
        m.push(net.len() as u8);
        m.extend_from_slice(net.as_bytes());
        m
    }

    fn ring_msg(port: u32, slots: u32) -> Vec<u8> {
        Fake::ring_msg_on(port, slots, "default")
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

    /// Offers the switch a ring into its device `port` on `net`, with a
    /// fresh eventfd: the consumer's end, kept.
    fn offer_ring(
        &self,
        port: u32,
        net: &str,
    ) -> (ring::Consumer, OwnedFd, nix::sys::eventfd::EventFd) {
        let (c, fd) = ring::create(8, "fake").unwrap();
        let ev = nix::sys::eventfd::EventFd::new().unwrap();
        self.send(
            &Fake::ring_msg_on(port, 8, net),
            &[fd.as_raw_fd(), ev.as_fd().as_raw_fd()],
        );
        (c, fd, ev)
    }

    /// The ring the switch gave it for its device, opened (the producer's
    /// end) with its memfd.
    fn take_ring(&self) -> (ring::Producer, File) {
        let (m, mut fds) = self.recv_kind(RING).expect("RING");
        assert_eq!(fds.len(), 2, "the ring's memfd and the device's eventfd");
        let slots = u32::from_le_bytes(m[8..12].try_into().unwrap());
        let file = fds[0].take().expect("a memfd");
        assert!(fds[1].is_none(), "an eventfd (it cannot be reopened)");
        let p = ring::open(OwnedFd::from(file.try_clone().unwrap()), slots).expect("a sealed ring");
        (p, file)
    }
}

fn stat(a: &std::sync::atomic::AtomicU64) -> u64 {
    a.load(std::sync::atomic::Ordering::Relaxed)
}

#[test]
fn a_lying_daemon_is_refused_and_the_devices_keep_their_packets() {
    let d = dir("liar");
    let (sa, ra, mut a) = daemon(&d, &[gid(1)]);
    let na = sa.default_network();
    let fake = Fake::connect(&ra);
    // The switch answers HELLO and offers a ring for its device, with
    // that device's addresses.
    let (hello, _) = fake.recv().expect("HELLO");
    assert_eq!(&hello[..4], &HELLO.to_le_bytes());
    let (mut into_a, ring_file) = fake.take_ring();
    let (gm, _) = fake.recv_kind(GIDS).expect("GIDS");
    assert_eq!(&gm[..4], &GIDS.to_le_bytes());

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
    eventually("both rings refused", || stat(&ra.stats().bad_rings) == 2);
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
        sa.holds(&na, &gid(9)) && stat(&ra.stats().gid_conflicts) == 1
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
    let len = ring_file.metadata().unwrap().len() as usize;
    let raw = vm_memory::MmapRegion::<()>::from_file(vm_memory::FileOffset::new(ring_file, 0), len)
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
    eventually("the fake dropped", || !sa.holds(&na, &gid(9)));
    assert!(stat(&ra.stats().refused) >= 1);
    assert!(sa.holds(&na, &gid(1)));
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

fn euid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// A "daemon" on `d` that trusts no peer with an address it was not
/// granted (the grants are this test user's, standing for root's).
fn strict(d: &PathBuf) -> (Switch, Rendezvous) {
    let sw = Switch::new();
    let mut c = JoinConfig::new(d);
    c.trust = Trust {
        uids: vec![],
        grant_owner: euid(),
    };
    let r = sw.join(c).unwrap();
    (sw, r)
}

/// Issue 31: a peer admitted to the directory announces an address nobody
/// on the switch holds (an off-host peer's) beside one it was granted.
/// The granted one is taken; the other is refused and counted, the
/// device's packets for it stay on the uplink, and packets "from" it in the
/// peer's ring are refused.
#[test]
fn a_peer_announcing_an_address_it_was_not_granted_is_refused_and_traffic_stays_on_the_uplink() {
    let d = dir("grant");
    write_grant(&d, euid(), &[("default".into(), vec![gid(8)])]).unwrap();
    let (sa, ra) = strict(&d);
    let na = sa.default_network();
    let mut a = sa.attach().unwrap();
    a.set_local(&[gid(1)]);
    let fake = Fake::connect(&ra);
    let (mut into_a, _file) = fake.take_ring();
    let (_c, _fd, _ev) = fake.offer_ring(1, "default");
    fake.send(&Fake::gids_msg(1, &[gid(9), gid(8)]), &[]);
    eventually("the granted address taken, the other refused", || {
        sa.holds(&na, &gid(8)) && stat(&ra.stats().claims_refused) == 1
    });
    assert!(
        !sa.holds(&na, &gid(9)),
        "the foreign address is not the peer's"
    );
    // Control: the granted address leads to the peer's ring.
    assert!(a.reaches(&gid(8)));
    // The foreign one: the uplink's.
    let before = a.stats().tx_uplink;
    assert!(!a.reaches(&gid(9)));
    assert_eq!(a.stats().tx_uplink, before + 1);
    // From the foreign address: refused; from the granted one: delivered.
    into_a.push(&route(9, 1), &[1; 70]).unwrap();
    into_a.push(&route(8, 1), &[2; 70]).unwrap();
    into_a.publish();
    let got = take(&mut a, 1);
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].0, got[0].1.clone()), (route(8, 1), vec![2; 70]));
    assert_eq!(a.stats().rx_refused, 1);
}

/// Issue 37: two tenants' devices with one address each, on two networks,
/// in each of two daemons: each device's packets reach only its own
/// network's peer, byte for byte, and the other tenant's device receives
/// nothing.
#[test]
fn two_tenants_with_one_address_on_two_networks_across_two_daemons() {
    let d = dir("nets");
    let port = |sw: &Switch, net: &str, g: Gid| {
        let n = sw.network(net).unwrap();
        let mut p = sw.attach_to(&n, Owned::Only(vec![g])).unwrap();
        p.set_local(&[g]);
        p
    };
    let s1 = Switch::new();
    let r1 = s1.join(JoinConfig::new(&d)).unwrap();
    let (mut a1, mut b1) = (port(&s1, "tenant-a", gid(1)), port(&s1, "tenant-b", gid(1)));
    let s2 = Switch::new();
    let r2 = s2.join(JoinConfig::new(&d)).unwrap();
    let (mut a2, mut b2) = (port(&s2, "tenant-a", gid(2)), port(&s2, "tenant-b", gid(2)));
    let (ta, tb) = (
        s1.network("tenant-a").unwrap(),
        s1.network("tenant-b").unwrap(),
    );
    eventually("each network's peer known on the first switch", || {
        s1.holds(&ta, &gid(2)) && s1.holds(&tb, &gid(2))
    });
    let (ua, ub) = (
        s2.network("tenant-a").unwrap(),
        s2.network("tenant-b").unwrap(),
    );
    eventually("and on the second", || {
        s2.holds(&ua, &gid(1)) && s2.holds(&ub, &gid(1))
    });
    a1.send(&route(1, 2), b"tenant A's", 10, &[], &NoLender)
        .unwrap();
    a1.flush();
    b1.send(&route(1, 2), b"tenant B's", 10, &[], &NoLender)
        .unwrap();
    b1.flush();
    assert_eq!(take(&mut a2, 1)[0].1, b"tenant A's");
    assert_eq!(take(&mut b2, 1)[0].1, b"tenant B's");
    // And back.
    b2.send(&route(2, 1), b"B again", 7, &[], &NoLender)
        .unwrap();
    b2.flush();
    assert_eq!(take(&mut b1, 1)[0].1, b"B again");
    for p in [&mut a1, &mut a2, &mut b2] {
        p.receive(|r, b, _| panic!("a packet for another tenant: {r:?} {b:?}"));
    }
    assert_eq!((a2.stats().rx_packets, b2.stats().rx_packets), (1, 1));
    assert_eq!((a1.stats().rx_packets, b1.stats().rx_packets), (0, 1));
    assert_eq!(
        (
            stat(&r1.stats().gid_conflicts),
            stat(&r2.stats().gid_conflicts)
        ),
        (0, 0),
        "the same address on two networks is no conflict"
    );
}

/// Issue 37: a peer announces a device on a network its user was not
/// granted: the ring is refused and counted, no ring of that network's
/// device is given to it, and a legitimate peer's traffic goes on.
#[test]
fn a_peer_on_a_network_it_was_not_granted_is_refused_and_a_legitimate_peer_goes_on() {
    let d = dir("net-grant");
    write_grant(&d, euid(), &[("default".into(), vec![gid(2), gid(8)])]).unwrap();
    let (sa, ra) = strict(&d);
    let mut a = sa.attach().unwrap();
    a.set_local(&[gid(1)]);
    let tb = sa.network("tenant-b").unwrap();
    let mut t = sa.attach_to(&tb, Owned::Only(vec![gid(1)])).unwrap();
    t.set_local(&[gid(1)]);
    let fake = Fake::connect_to(ra.path(), 77, &["default", "tenant-b"]);
    let _ring = fake.take_ring();
    let (_c, _fd, _ev) = fake.offer_ring(5, "tenant-b");
    fake.send(&Fake::gids_msg(5, &[gid(8)]), &[]);
    eventually("the ring of tenant-b refused", || {
        stat(&ra.stats().networks_refused) == 1
    });
    assert!(!sa.holds(&tb, &gid(8)));
    // A legitimate daemon on the granted network exchanges with A.
    let sb = Switch::new();
    let rb = sb.join(JoinConfig::new(&d)).unwrap();
    let mut b = sb.attach().unwrap();
    b.set_local(&[gid(2)]);
    let na = sa.default_network();
    eventually("B's address taken by A", || sa.holds(&na, &gid(2)));
    eventually("A's address taken by B", || {
        sb.holds(&sb.default_network(), &gid(1))
    });
    b.send(&route(2, 1), &[5; 300], 300, &[], &NoLender)
        .unwrap();
    b.flush();
    assert_eq!(take(&mut a, 1)[0].1, vec![5; 300]);
    t.receive(|r, _, _| panic!("tenant-b's device got {r:?}"));
    assert_eq!(t.stats().rx_packets, 0);
    drop(rb);
}

/// The Python fake: connects to `path` as instance `id` (a HELLO that
/// claims another daemon's identity), says it has the default network,
/// says `connected` once the daemon gave it a ring (its HELLO handled),
/// and stays connected until its standard input closes. A process of its
/// own: the kernel gives the switch its pid.
const IMPOSTOR: &str = r#"
import os, socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.send(struct.pack('<I', 1) + b'VRDMASHM' + struct.pack('<IQ', 2, int(sys.argv[2])))
s.send(struct.pack('<II', 5, 1) + bytes([7]) + b'default')
# The daemon gives a ring only to a peer whose HELLO it took: once one
# came, whatever the HELLO made the daemon do is done.
while True:
    m, anc, _, _ = s.recvmsg(4096, socket.CMSG_SPACE(4 * 8))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            for (fd,) in struct.iter_unpack('i', data[:len(data) - len(data) % 4]):
                os.close(fd)
    if not m or struct.unpack('<I', m[:4])[0] == 2:
        break
print('connected' if m else 'closed', flush=True)
sys.stdin.read()
"#;

/// Learns the instance a switch's HELLO gives.
fn instance_of(r: &Rendezvous) -> u64 {
    let f = Fake::connect_to(r.path(), 0xdead, &[]);
    let (m, _) = f.recv_kind(HELLO).expect("HELLO");
    u64::from_le_bytes(m[16..24].try_into().unwrap())
}

/// Issue 31: a peer that carries a live daemon's identity in its HELLO
/// (another process, with the other daemon's instance) evicts nobody: the
/// two real daemons keep their connection and their addresses, and their
/// packets flow. Before identities came from the kernel, one of the two
/// impostors (one at each daemon, each claiming the other) made its
/// daemon drop the genuine connection.
#[test]
fn a_peer_impersonating_a_live_daemon_evicts_nobody() {
    use std::io::BufRead;
    let d = dir("impostor");
    let (sa, ra, mut a) = daemon(&d, &[gid(1)]);
    let (sb, rb, mut b) = daemon(&d, &[gid(2)]);
    let (na, nb) = (sa.default_network(), sb.default_network());
    eventually("A and B connected", || {
        sa.holds(&na, &gid(2)) && sb.holds(&nb, &gid(1))
    });
    let (ia, ib) = (instance_of(&ra), instance_of(&rb));
    let spawn = |path: &std::path::Path, id: u64| {
        let mut c = std::process::Command::new("python3")
            .arg("-c")
            .arg(IMPOSTOR)
            .arg(path)
            .arg(id.to_string())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3 for the impostor");
        let mut line = String::new();
        std::io::BufReader::new(c.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "connected");
        c
    };
    // At A, one claiming B; at B, one claiming A.
    let mut i1 = spawn(ra.path(), ib);
    let mut i2 = spawn(rb.path(), ia);
    // Each daemon handled its impostor's HELLO (it gave it a ring): a
    // genuine connection it dropped for it would have taken its peer's
    // addresses with it by then.
    assert!(
        sa.holds(&na, &gid(2)) && sb.holds(&nb, &gid(1)),
        "a genuine connection dropped"
    );
    assert!(stat(&ra.stats().peers) == 2 && stat(&rb.stats().peers) == 2);
    a.send(&route(1, 2), &[6; 90], 90, &[], &NoLender).unwrap();
    a.flush();
    assert_eq!(take(&mut b, 1)[0].1, vec![6; 90]);
    b.send(&route(2, 1), &[7; 90], 90, &[], &NoLender).unwrap();
    b.flush();
    assert_eq!(take(&mut a, 1)[0].1, vec![7; 90]);
    for c in [&mut i1, &mut i2] {
        drop(c.stdin.take());
        c.wait().unwrap();
    }
}

/// Issue 31: one peer's junk (records from an address it does not hold)
/// fills its ring every round; a legitimate peer's ring, read after it, is
/// still read: refused records do not eat the device's batch, and rings
/// are read round-robin.
#[test]
fn a_junk_filling_peer_does_not_starve_a_legitimate_one() {
    let d = dir("junk");
    let (sa, ra, mut a) = daemon(&d, &[gid(1)]);
    // The junk peer first: its ring is the first the device reads.
    let fake = Fake::connect(&ra);
    let (mut into_a, _file) = fake.take_ring();
    let (sb, rb, mut b) = daemon(&d, &[gid(2)]);
    let na = sa.default_network();
    eventually("B known to A", || sa.holds(&na, &gid(2)));
    eventually("A known to B", || sb.holds(&sb.default_network(), &gid(1)));
    let fill = |p: &mut ring::Producer| {
        while p.push(&route(50, 1), &[0; 64]).is_ok() {}
        p.publish();
    };
    fill(&mut into_a);
    for i in 0..10u8 {
        b.send(&route(2, 1), &[i; 40], 40, &[], &NoLender).unwrap();
    }
    b.flush();
    let mut got = Vec::new();
    let limit = Instant::now() + Duration::from_secs(10);
    // Three rounds, the junk ring refilled before each: B's packets must
    // come through (ten of them, a batch holds 64).
    for _ in 0..3 {
        fill(&mut into_a);
        // B's ring is published at its flush; wait for it to be visible.
        while Instant::now() < limit && got.len() < 10 {
            if a.receive(|_, p, _| got.push(p.to_vec())) == 0 {
                std::thread::yield_now();
                continue;
            }
            break;
        }
    }
    assert_eq!(got.len(), 10, "the legitimate peer's packets in 3 rounds");
    assert!(a.stats().rx_refused > 0);
    drop((rb, ra));
}

/// The rendezvous directory must be root's or this user's, and sticky if
/// anyone may write it: otherwise any user could replace what a daemon
/// puts there.
#[test]
fn a_world_writable_directory_without_the_sticky_bit_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let d = dir("mode");
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = Switch::new().join(JoinConfig::new(&d)).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let sw = Switch::new();
    let r = sw.join(JoinConfig::new(&d)).expect("sticky: joined");
    // A link planted under the daemon's socket name is replaced, never
    // followed: the file it names keeps its mode.
    let mode = std::fs::metadata(r.path()).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
}

/// Issue 31: one user holds at most 16 of a daemon's 64 peer slots.
#[test]
fn one_user_holds_at_most_sixteen_peer_slots() {
    let d = dir("slots");
    let (_sa, ra, _a) = daemon(&d, &[gid(1)]);
    let fakes: Vec<Fake> = (0..17)
        .map(|i| Fake::connect_to(ra.path(), 1000 + i, &[]))
        .collect();
    eventually("sixteen taken, the seventeenth refused", || {
        stat(&ra.stats().peers) == 16 && stat(&ra.stats().refused) == 1
    });
    drop(fakes);
}

/// Issue 31: GIDS beyond a peer's allowance wait and the latest is
/// applied: a flood of them changes the directory at a bounded rate, and
/// none is lost.
#[test]
fn a_flood_of_address_announcements_is_held_back_and_the_latest_applied() {
    let d = dir("gids-flood");
    let (sa, ra, _a) = daemon(&d, &[gid(1)]);
    let na = sa.default_network();
    let fake = Fake::connect(&ra);
    let _ring = fake.take_ring();
    let (_c, _fd, _ev) = fake.offer_ring(1, "default");
    for k in 0..200u8 {
        fake.send(&Fake::gids_msg(1, &[gid(100 + k % 50)]), &[]);
    }
    fake.send(&Fake::gids_msg(1, &[gid(250)]), &[]);
    eventually("the last announcement applied", || sa.holds(&na, &gid(250)));
    assert!(
        stat(&ra.stats().gids_deferred) > 0,
        "the allowance held some back"
    );
    assert!(!sa.holds(&na, &gid(149)), "earlier addresses released");
}
