//! The hostile guest on the Ethernet port, as `vrdma serve` deploys the
//! device: each device's port sits between its guest's NIC (a stream
//! socket the port listens on; the test connects as QEMU's `-netdev
//! stream` and sends what a NIC would) and an uplink, and the uplinks
//! meet in a switch (`vrdma_testkit::pvrdma::eth::Switch`).
//!
//! Each test reproduces one item of what a tenant can do to the daemon —
//! a long message looped back, a NIC that floods its stream or connects
//! twice, frames and GIDs spoofing another tenant, page lists past its
//! budget, DMA maps and descriptors it should not send, a bug in its
//! device's round — and checks the answer it gets (a counter, an errno,
//! an event), that the hostile guest's own device still works, and that a
//! well-behaved tenant on the same switch (two more devices, their guests
//! exchanging in a thread of their own) exchanged byte-exact throughout.

use std::{
    io::Read,
    net::Ipv4Addr,
    os::{fd::AsFd, unix::net::UnixStream},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use vrdma_engine::attr::Mtu;
use vrdma_pvrdma::abi::{self, PAGE_SIZE, cmd, eqe, qp_type, send_flags, wc_opcode, wr_opcode};
use vrdma_testkit::pvrdma::{
    Device, Endpoint, Net, Steady, connect,
    eth::{Nic, Switch, eth_function, frame},
    exchange, function, hdr, one_page, page_lists_past_the_budget, rc_up_mtu, sealed_memfd, sge,
    side::RAM,
    unsealed_page, wait_event, wqe,
};
use vrdma_testkit::tripwire::Tripwire;
use vrdma_vfio_user::proto::{self, RegionAccess, cmd as vcmd};
use zerocopy::IntoBytes;

/// This binary's block of addresses (see `vrdma_testkit::pvrdma`).
static NET: Net = Net::new(22);

use vrdma_testkit::errno::{EINVAL, ENOSPC, EPERM};

/// A MAC no port of the switch has.
const NOBODY_MAC: [u8; 6] = [2, 0xee, 0xee, 0xee, 0xee, 0xee];

/// The well-behaved tenant: two devices on the switch whose guests
/// exchange from the start of a test to its end.
struct Bystanders {
    steady: Steady,
    _devices: (Device, Device),
}

impl Bystanders {
    fn start(name: &str, switch: &Switch) -> Self {
        let (d1, d2, a, b) = NET.eth_pair(name, switch);
        Bystanders {
            steady: Steady::start(a, b),
            _devices: (d1, d2),
        }
    }

    /// Checks that they are still exchanging and that every exchange was
    /// byte-exact; the exchanges made.
    fn finish(self) -> u64 {
        let (_, _, rounds) = self.steady.finish();
        assert!(rounds >= 4, "{rounds} exchanges");
        rounds
    }
}

/// Writes a pattern that depends on `seed` over `len` bytes at `at`, a
/// mebibyte at a time.
fn fill(g: &vrdma_testkit::pvrdma::Guest, at: u64, len: u64, seed: u64) {
    let mut chunk = vec![0u8; 1 << 20];
    for off in (0..len).step_by(chunk.len()) {
        for (i, b) in chunk.iter_mut().enumerate() {
            *b = ((off + i as u64 + seed) * 13 / 7) as u8;
        }
        g.put(at + off, &chunk);
    }
}

/// Whether `len` bytes at `a` and `b` are equal (a mebibyte at a time).
fn same(g: &vrdma_testkit::pvrdma::Guest, a: u64, b: u64, len: u64) -> bool {
    (0..len)
        .step_by(1 << 20)
        .all(|off| g.get(a + off, 1 << 20) == g.get(b + off, 1 << 20))
}

#[test]
fn a_64_mib_read_between_two_qps_of_one_guest_is_paced_by_the_loopback_bound() {
    const LEN: u64 = 64 << 20;
    let switch = Switch::new();
    let others = Bystanders::start("eth-loop-w", &switch);
    let h = NET.eth_device("eth-loop-h", &switch);
    let mut a = Endpoint::with_ram(&h, 2 * LEN + RAM);
    // Two QPs of the guest's, connected to each other at its own address:
    // every packet goes through the port's loopback.
    let (cq, pd) = (a.cq.handle, a.pd);
    let qa = a.g.create_qp(qp_type::RC, pd, cq, cq, 16);
    let qb = a.g.create_qp(qp_type::RC, pd, cq, cq, 16);
    rc_up_mtu(&mut a.g, &qa, a.gid, qb.qpn, a.mac, 5);
    rc_up_mtu(&mut a.g, &qb, a.gid, qa.qpn, a.mac, 5);
    let src = a.g.alloc(LEN / PAGE_SIZE);
    let dst = a.g.alloc(LEN / PAGE_SIZE);
    fill(&a.g, src, LEN, 1);
    let pages: Vec<u64> = (0..LEN / PAGE_SIZE).map(|i| src + i * PAGE_SIZE).collect();
    let va = 0x5000_0000_0000u64;
    let (_, _, rkey) = a.g.user_mr(pd, va, &pages, 1 | 4);
    let paused = h.counter_when("eth.tx_paused", |_| true);
    let looped = h.counter_when("eth.roce_rx", |_| true);

    let mut qa = qa;
    let mut r = wqe(7, wr_opcode::RDMA_READ, send_flags::SIGNALED, 1);
    r.wr[0] = va.into();
    r.wr[1] = u64::from(rkey).into();
    let start = Instant::now();
    a.g.post_send(&mut qa, &r, &[sge(dst, LEN as u32, a.lkey)]);
    let c = a.g.poll_n_for(&mut a.cq, 1, Duration::from_secs(120));
    assert_eq!(c.len(), 1, "the READ's completion");
    let took = start.elapsed();
    assert_eq!(
        (c[0].wr_id.get(), c[0].status.get(), c[0].opcode.get()),
        (7, 0, wc_opcode::RDMA_READ)
    );
    assert!(same(&a.g, src, dst, LEN), "the READ's bytes");
    a.g.check_canaries();
    // 16 384 responses of 4 KiB came back through the loopback queue, and
    // it filled: the device waited for room instead of queueing them all.
    let n = h.counter_when("eth.roce_rx", |n| n >= looped + LEN / 4096);
    assert!(n >= looped + LEN / 4096, "{} packets looped", n - looped);
    let p = h.counter_when("eth.tx_paused", |n| n > paused);
    assert!(p > paused, "the loopback queue never filled");
    let rounds = others.finish();
    eprintln!(
        "64 MiB READ looped back in {took:?}, {} pauses; the others exchanged {rounds} times",
        p - paused
    );
}

#[test]
fn a_nic_flooding_its_stream_holds_no_thread_and_a_second_nic_is_turned_away() {
    let switch = Switch::new();
    let others = Bystanders::start("eth-flood-w", &switch);
    let (h, x, mut a, mut b) = NET.eth_pair("eth-flood", &switch);
    let mut nic = Nic::connect(&h);
    let mut x_nic = Nic::connect(&x);
    let (h_ip, x_ip) = (frame::v4(h.addr), frame::v4(x.addr));

    // The guest's own frames (its MAC, its address: the filter passes
    // them), to a MAC nobody has, written as fast as the port takes them.
    let flood = frame::udp(
        NOBODY_MAC,
        h.mac,
        h_ip,
        Ipv4Addr::new(10, 9, 9, 9),
        9,
        &[0x5a; 1400],
    );
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    // Eight writers on the one stream, so that it never runs dry while the
    // port reads (each write, 16 frames, is one the kernel does not cut:
    // the writers' frames never interleave). A port that read its stream
    // until it ran dry held its thread until the peer's retries ran out
    // (tried, without the per-turn bound: an exchange's WRITE ended in
    // RETRY_EXC_ERR in each of 4 runs).
    let flooders: Vec<_> = (0..8)
        .map(|_| {
            let mut flood_nic = nic.sock.try_clone().unwrap();
            let (stop, sent) = (stop.clone(), sent.clone());
            let mut m = (flood.len() as u32).to_be_bytes().to_vec();
            m.extend_from_slice(&flood);
            let burst: Vec<u8> = m.repeat(16);
            std::thread::spawn(move || {
                use std::io::Write;
                while !stop.load(Ordering::Relaxed) {
                    flood_nic.write_all(&burst).unwrap();
                    sent.fetch_add(16, Ordering::Relaxed);
                }
            })
        })
        .collect();
    // Meanwhile the flooded device's thread answers its guest's commands
    // and doorbells and its peer's packets (its stream is read a bounded
    // amount per turn), and the other tenant goes on.
    while sent.load(Ordering::Relaxed) < 64 {
        std::thread::sleep(Duration::from_millis(1));
    }
    for _ in 0..5 {
        exchange(&mut a, &mut b);
        a.g.create_pd(0);
    }
    others.steady.check();
    assert!(
        flooders.iter().all(|f| !f.is_finished()),
        "the flood went on meanwhile"
    );
    stop.store(true, Ordering::Relaxed);
    for f in flooders {
        f.join().unwrap();
    }
    let frames = sent.load(Ordering::Relaxed);
    // Every frame of the flood was taken (none is lost on the guest's
    // side: the NIC waits for the port).
    let rx = h.counter_when("eth.guest_rx", |n| n >= frames);
    assert_eq!(rx, frames, "the frames the NIC sent");
    assert!(frames > 1000, "a flood of {frames} frames");

    // A second connection to the guest socket while the NIC is connected:
    // closed at once, counted, and the NIC is still the port's.
    let mut second = UnixStream::connect(h.netdev.as_ref().unwrap()).unwrap();
    assert_eq!(h.counter_when("eth.guest_refused", |n| n == 1), 1);
    second
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut byte = [0u8; 1];
    assert_eq!(
        second.read(&mut byte).unwrap(),
        0,
        "the newcomer was closed"
    );
    let hello = frame::udp(x.mac, h.mac, h_ip, x_ip, 9, b"still the port's NIC");
    nic.send(&hello).unwrap();
    let got = x_nic.receive(Duration::from_secs(5));
    assert_eq!(got.as_deref(), Some(&hello[..]), "the first NIC's frame");
    assert_eq!(h.counter_when("eth.guest_connects", |_| true), 1);
    exchange(&mut a, &mut b);
    let rounds = others.finish();
    eprintln!("flood of {frames} frames; the others exchanged {rounds} times");
}

#[test]
fn spoofed_frames_and_gids_are_refused_and_the_guests_own_pass() {
    let switch = Switch::new();
    let others = Bystanders::start("eth-spoof-w", &switch);
    let (h, x, mut a, mut b) = NET.eth_pair("eth-spoof", &switch);
    let mut nic = Nic::connect(&h);
    let mut x_nic = Nic::connect(&x);
    let (h_ip, x_ip) = (frame::v4(h.addr), frame::v4(x.addr));
    let someone = frame::v4(NET.addr());

    // To X's guest: what the guest may send, and what spoofs another
    // tenant (its MAC, its address, an ARP claiming it or naming another
    // MAC, RoCEv2 from its address).
    let own = |tag: &[u8]| frame::udp(x.mac, h.mac, h_ip, x_ip, 9, tag);
    let own_arp = frame::arp_request(h.mac, h.mac, h_ip, x_ip);
    let sent = [
        own(b"own 1"),
        frame::udp(x.mac, x.mac, h_ip, x_ip, 9, b"another's MAC"),
        frame::udp(x.mac, h.mac, someone, x_ip, 9, b"another's address"),
        frame::arp_request(h.mac, h.mac, someone, x_ip),
        frame::arp_request(h.mac, x.mac, h_ip, x_ip),
        frame::udp(x.mac, h.mac, someone, x_ip, 4791, &[0; 64]),
        own_arp.clone(),
        own(b"own 2"),
    ];
    for f in &sent {
        nic.send(f).unwrap();
    }
    let got = x_nic.receive_until(Duration::from_secs(5), |f| f == own(b"own 2"));
    assert_eq!(got, vec![own(b"own 1"), own_arp, own(b"own 2")]);
    assert_eq!(h.counter_when("eth.guest_rx", |n| n == 8), 8);
    assert_eq!(h.counter_when("eth.spoofed_mac", |n| n == 1), 1);
    assert_eq!(h.counter_when("eth.spoofed_ip", |n| n == 4), 4);

    // GIDs: another's address is refused on CREATE_BIND; the guest's own
    // (and its MAC's link-local address) are taken.
    let bind = |index: u32, gid: vrdma_wire::Gid| abi::CreateBind {
        hdr: hdr(cmd::CREATE_BIND),
        mtu: 1024.into(),
        vlan: 0xfff.into(),
        index: index.into(),
        new_gid: gid.0,
        gid_type: abi::GID_TYPE_ROCE_V2,
        reserved: [0; 3],
    };
    for gid in [x.gid(), vrdma_wire::Gid::from(someone)] {
        assert_eq!(a.g.refused(&bind(1, gid)), EINVAL, "{gid:?}");
    }
    assert_eq!(h.counter_when("pvrdma.gids_refused", |n| n == 2), 2);
    let link_local = vrdma_fabric::eth::link_local(h.mac);
    a.g.command(&bind(1, vrdma_wire::Gid::from(link_local)))
        .expect("the guest's link-local address");
    a.g.command(&bind(2, h.gid())).expect("the guest's address");
    assert_eq!(h.counter_when("pvrdma.gids_refused", |_| true), 2);
    exchange(&mut a, &mut b);
    others.finish();
}

#[test]
fn page_lists_past_the_budget_are_refused_on_the_ethernet_port_too() {
    let switch = Switch::new();
    let others = Bystanders::start("eth-budget-w", &switch);
    let (h, _x, mut a, mut b) = NET.eth_pair("eth-budget", &switch);
    exchange(&mut a, &mut b);
    page_lists_past_the_budget(&h, &mut a, &mut b);
    // The guest gone, what it held goes with it.
    drop(a);
    assert_eq!(h.counter_when("objects.bytes", |n| n == 0), 0);
    others.finish();
}

#[test]
fn dma_maps_and_descriptor_floods_are_refused_and_nothing_stays_held() {
    let switch = Switch::new();
    let others = Bystanders::start("eth-dma-w", &switch);
    let mut config = vrdma_vfio_user::Config::default();
    // The guest's RAM and one more.
    config.dma.max_maps = 2;
    let h = NET.eth_device_with("eth-dma-h", &switch, config, eth_function);
    let x = NET.eth_device("eth-dma-x", &switch);
    let mut a = Endpoint::new(&h);
    let mut b = Endpoint::new(&x);
    connect(&mut a, &mut b);

    let unsealed = unsealed_page();
    let (pipe_r, _pipe_w) = nix::unistd::pipe().unwrap();
    let sealed = sealed_memfd(c"sealed", PAGE_SIZE);
    for (fd, addr, want) in [
        (unsealed.as_fd(), 0x4_0000_0000, EPERM),
        (pipe_r.as_fd(), 0x4_0000_0000, EINVAL),
        (sealed.as_fd(), 0x4_0000_0000, 0),
        (sealed.as_fd(), 0x5_0000_0000, ENOSPC),
    ] {
        let (hd, _) = a.g.request(vcmd::DMA_MAP, one_page(addr).as_bytes(), &[fd]);
        assert_eq!(hd.error, want, "{fd:?}");
    }
    assert_eq!(h.counter_when("vfio.dma_refused", |n| n == 3), 3);
    assert_eq!(h.counter_when("vfio.dma_maps", |n| n == 2), 2);
    // Two files and three eventfds.
    assert_eq!(h.counter_when("vfio.fds", |n| n == 5), 5);
    exchange(&mut a, &mut b);

    // Descriptors where none is taken, 16 (the most a message may carry)
    // a message, a thousand messages: each refused, none kept.
    let event: std::os::fd::OwnedFd = nix::sys::eventfd::EventFd::new().unwrap().into();
    let sixteen = [event.as_fd(); 16];
    let read = RegionAccess {
        offset: 0,
        region: 1,
        count: 4,
    };
    for _ in 0..1000 {
        let (hd, _) = a.g.request(vcmd::REGION_READ, read.as_bytes(), &sixteen);
        assert_eq!(hd.error, EINVAL);
    }
    assert_eq!(h.counter_when("vfio.fds", |_| true), 5);
    exchange(&mut a, &mut b);

    // More than a message may carry (the kernel's most, 253): the client
    // is dropped, every descriptor closed, and the device reset.
    let many = [event.as_fd(); 253];
    let dropped = h.counter_when("vfio.clients_dropped", |_| true);
    let reset = proto::Header {
        id: 9,
        command: vcmd::DEVICE_RESET,
        size: proto::HEADER_LEN as u32,
        flags: 0,
        error: 0,
    };
    a.g.conn.send(reset.as_bytes(), &many).unwrap();
    assert!(
        !matches!(a.g.conn.receive(), Ok(Some(_))),
        "a reply to a message with 253 descriptors"
    );
    assert_eq!(
        h.counter_when("vfio.clients_dropped", |n| n > dropped),
        dropped + 1
    );
    for (name, want) in [("vfio.fds", 0), ("vfio.dma_maps", 0), ("vfio.dma_bytes", 0)] {
        assert_eq!(h.counter_when(name, |n| n == want), want, "{name}");
    }
    drop(a);
    // The device serves its next guest.
    let mut a = Endpoint::new(&h);
    b.new_qp();
    connect(&mut a, &mut b);
    exchange(&mut a, &mut b);
    others.finish();
}

#[test]
fn a_panic_in_an_ethernet_devices_round_is_reported_and_the_device_reset() {
    let switch = Switch::new();
    let others = Bystanders::start("eth-panic-w", &switch);
    let trip = Arc::new(AtomicBool::new(false));
    let wire = trip.clone();
    let h = NET.eth_device_with(
        "eth-panic-h",
        &switch,
        vrdma_vfio_user::Config::default(),
        move |port, mac| function(Tripwire::new(port, wire), mac, Mtu::Mtu4096),
    );
    let x = NET.eth_device("eth-panic-x", &switch);
    let mut a = Endpoint::new(&h);
    let mut b = Endpoint::new(&x);
    connect(&mut a, &mut b);
    exchange(&mut a, &mut b);

    trip.store(true, Ordering::Relaxed);
    // The guest hears of it; the device counts it and forgets the guest's
    // objects (a reset).
    wait_event(&mut a.g, (eqe::DEVICE_FATAL, 1));
    assert_eq!(h.counter_when("pvrdma.panics", |n| n == 1), 1);
    assert_eq!(h.counter_when("objects.qps", |n| n == 0), 0);
    assert_eq!(h.stats_when(|s| s.resets >= 1).panics, 1);
    others.steady.check();
    // The device thread lives on: a new client (the VM restarted) probes
    // the device and its objects exchange with the other device.
    drop(a);
    let mut a = Endpoint::new(&h);
    b.new_qp();
    connect(&mut a, &mut b);
    exchange(&mut a, &mut b);
    others.finish();
}

/// Two guests' devices served as `vrdma serve` serves them (each in a
/// thread of its own, on an Ethernet port whose uplink is on the switch)
/// and also on one same-host switch: everything they exchange — SENDs,
/// WRITEs, READs, atomics — goes through shared memory, not a frame of it
/// on the Ethernet switch; a third device on the Ethernet switch alone is
/// reached over it as before, from the same guest.
#[test]
fn guests_of_one_daemon_exchange_over_shm_and_others_over_the_wire() {
    use vrdma_device::transport::SameHost;
    use vrdma_fabric::shm;
    use vrdma_testkit::pvrdma::read_and_atomics;

    let switch = Switch::new();
    let same_host = shm::Switch::new();
    let on_shm = |name: &str| {
        let s = same_host.clone();
        NET.eth_device_with(
            name,
            &switch,
            vrdma_vfio_user::Config::default(),
            move |port, mac| {
                let t = SameHost::new(&s, port).expect("joining the same-host switch");
                function(t, mac, Mtu::Mtu4096)
            },
        )
    };
    let (da, db) = (on_shm("eth-shm-a"), on_shm("eth-shm-b"));
    let mut a = Endpoint::new(&da);
    let mut b = Endpoint::new(&db);
    connect(&mut a, &mut b);
    let frames = switch.stats().forwarded.load(Ordering::Relaxed);
    for _ in 0..3 {
        exchange(&mut a, &mut b);
        read_and_atomics(&mut a, &mut b);
        read_and_atomics(&mut b, &mut a);
    }
    assert_eq!(
        switch.stats().forwarded.load(Ordering::Relaxed),
        frames,
        "a frame between them went over the Ethernet switch"
    );
    for d in [&da, &db] {
        let n = d.counter_when("shm.rx_packets", |n| n >= 20);
        assert!(n >= 20, "{n} packets over shm");
        assert_eq!(d.counter_when("eth.roce_tx", |_| true), 0);
        // Nothing waited for a timeout: each device, asleep between
        // doorbells, was woken by every packet shm brought it.
        assert_eq!(d.counter_when("engine.tx_retransmitted", |_| true), 0);
    }

    // A device on the Ethernet switch alone: reached over it, from a new
    // QP of the same guest.
    let dc = NET.eth_device("eth-shm-c", &switch);
    let mut c = Endpoint::new(&dc);
    a.new_qp();
    connect(&mut a, &mut c);
    exchange(&mut a, &mut c);
    read_and_atomics(&mut a, &mut c);
    assert!(switch.stats().forwarded.load(Ordering::Relaxed) > frames);
    let n = dc.counter_when("eth.roce_rx", |n| n > 0);
    assert!(n > 0, "c heard nothing over the wire");
    assert!(da.counter_when("eth.roce_tx", |n| n > 0) > 0);
}
