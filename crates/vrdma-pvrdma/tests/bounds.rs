//! What a hostile tenant can make the daemon hold, measured: devices on
//! Ethernet ports (as `vrdma serve` makes them) in this process, and for
//! each hostile scenario the process's open descriptors (`/proc/self/fd`)
//! and its peak resident memory (`VmHWM`, reset through
//! `/proc/self/clear_refs` before the scenario) against bounds derived
//! from the daemon's budgets — and both back down once the hostile guest
//! has gone. A well-behaved tenant (two more devices) exchanges byte-exact
//! throughout.
//!
//! Guest RAM is shared memory (a memfd, as QEMU's), every page of it
//! touched beforehand by the guest and, for the transfer, by the device
//! (a first transfer before the measured one), so that what grows during
//! a scenario is the daemon's own anonymous memory.
//!
//! One test, in its own binary: the process's numbers are its own, the
//! scenarios one after another.

use std::{
    io::Write,
    net::Ipv4Addr,
    os::fd::AsFd,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use vrdma_fabric::eth::MAX_FRAME;
use vrdma_pvrdma::abi::{PAGE_SIZE, qp_type, send_flags, wc_opcode, wr_opcode};
use vrdma_testkit::pvrdma::{
    Device, Endpoint, Guest, Net, Steady,
    eth::{Nic, Switch, eth_function, frame},
    exchange,
    measure::{open_fds, peak_growth, reset_peak, status},
    one_page, rc_up_mtu, sealed_memfd, sge,
    side::{RAM, eventually_within},
    wqe,
};
use vrdma_vfio_user::proto::{self, RegionAccess, cmd as vcmd};
use zerocopy::IntoBytes;

/// This binary's block of addresses (see `vrdma_testkit::pvrdma`).
static NET: Net = Net::new(23);

const MIB: u64 = 1 << 20;

// The daemon's bounds these scenarios press against (vrdma-fabric's
// eth/mod.rs, vrdma-vfio-user's dma.rs and proto.rs).

/// A device's packets to itself wait in a queue of at most this many
/// bytes (`LOOPBACK_BYTES`).
const LOOPBACK: u64 = MIB;
/// A stream (the guest's, the uplink) holds at most this many bytes of
/// frames waiting to be written (`STREAM_BACKLOG`).
const STREAM_BACKLOG: u64 = MIB;
/// A stream is read at most this much per turn (`READ_PER_TURN`), and
/// keeps at most one partial frame beyond it.
const READ_PER_TURN: u64 = 64 << 10;
/// MSI-X vectors: an eventfd each.
const VECTORS: usize = 3;
/// The most descriptors one vfio-user message may carry.
const MSG_FDS: usize = 16;

/// What the process may grow by besides the bounded queues: the
/// allocator's arenas and caches, the threads' stacks, the engine's
/// per-packet scratch, a counters file being written.
const SLACK: u64 = 8 * MIB;
/// Descriptors besides those a scenario's budget accounts for: a
/// counters file being written, the test's own (a connection, its
/// guest's RAM and vectors).
const FD_SLACK: usize = 8;

/// The DMA-map budget the descriptor scenario's device is given.
const MAPS: usize = 256;

/// The well-behaved tenant.
struct Bystanders {
    steady: Steady,
    _devices: (Device, Device),
}

/// Checks what a scenario measured, `growth`, against its `bound`.
fn check(what: &str, growth: u64, bound: u64) {
    eprintln!(
        "{what}: peak growth {:.1} MiB (bound {:.1} MiB)",
        growth as f64 / MIB as f64,
        bound as f64 / MIB as f64
    );
    assert!(
        growth <= bound,
        "{what}: the process grew by {growth} bytes at its peak, over a bound of {bound}"
    );
}

#[test]
fn what_a_hostile_guest_makes_the_daemon_hold_is_bounded_by_its_budgets() {
    let switch = Switch::new();
    let (d1, d2, a, b) = NET.eth_pair("bounds-w", &switch);
    a.g.touch_ram();
    b.g.touch_ram();
    let others = Bystanders {
        steady: Steady::start(a, b),
        _devices: (d1, d2),
    };

    loopback(&switch);
    page_lists(&switch);
    flood(&switch);
    descriptors(&switch);
    let (_, _, rounds) = others.steady.finish();
    eprintln!("the other tenant exchanged {rounds} times");
}

/// Two QPs of one guest READ 64 MiB from each other through the port's
/// loopback. Bound: the loopback queue, the two streams' backlogs, a read
/// turn, and the slack (the device takes at most 256 packets a round from
/// the engine, while the loopback queue has room; the engine makes the
/// responses from guest memory as it sends them: the message itself is
/// never held).
fn loopback(switch: &Switch) {
    const LEN: u64 = 64 << 20;
    let base = status("VmRSS");
    let h = NET.eth_device("bounds-loop", switch);
    let mut a = Endpoint::with_ram(&h, 2 * LEN + RAM);
    let (cq, pd) = (a.cq.handle, a.pd);
    let mut qa = a.g.create_qp(qp_type::RC, pd, cq, cq, 16);
    let qb = a.g.create_qp(qp_type::RC, pd, cq, cq, 16);
    rc_up_mtu(&mut a.g, &qa, a.gid, qb.qpn, a.mac, 5);
    rc_up_mtu(&mut a.g, &qb, a.gid, qa.qpn, a.mac, 5);
    let src = a.g.alloc(LEN / PAGE_SIZE);
    let dst = a.g.alloc(LEN / PAGE_SIZE);
    let pages: Vec<u64> = (0..LEN / PAGE_SIZE).map(|i| src + i * PAGE_SIZE).collect();
    let va = 0x5000_0000_0000u64;
    let (_, _, rkey) = a.g.user_mr(pd, va, &pages, 1 | 4);
    a.g.touch_ram();
    let mut read = |a: &mut Endpoint, id: u64, seed: u8| {
        let chunk = vec![seed; MIB as usize];
        for off in (0..LEN).step_by(MIB as usize) {
            a.g.put(src + off, &chunk);
            a.g.put(src + off + 4096, &off.to_le_bytes());
        }
        let mut r = wqe(id, wr_opcode::RDMA_READ, send_flags::SIGNALED, 1);
        r.wr[0] = va.into();
        r.wr[1] = u64::from(rkey).into();
        a.g.post_send(&mut qa, &r, &[sge(dst, LEN as u32, a.lkey)]);
        let c = a.g.poll_n_for(&mut a.cq, 1, Duration::from_secs(120));
        assert_eq!(c.len(), 1, "the READ's completion");
        assert_eq!(
            (c[0].wr_id.get(), c[0].status.get(), c[0].opcode.get()),
            (id, 0, wc_opcode::RDMA_READ)
        );
    };
    // A first READ brings every page of both buffers into the device's
    // mapping; the second is measured.
    read(&mut a, 1, 0x11);
    reset_peak();
    let before = status("VmRSS");
    read(&mut a, 2, 0x22);
    let growth = peak_growth(before);
    for off in (0..LEN).step_by(MIB as usize) {
        let got = a.g.get(dst + off, MIB as usize);
        assert!(got[..4096].iter().all(|&x| x == 0x22), "at {off:#x}");
        assert_eq!(got[4096..4104], off.to_le_bytes(), "at {off:#x}");
    }
    check(
        "a 64 MiB READ looped back",
        growth,
        LOOPBACK + 2 * STREAM_BACKLOG + READ_PER_TURN + SLACK,
    );
    drop(a);
    gone(&h, base);
}

/// 1 GiB MRs named by two guest pages each (2 MiB of page list apiece in
/// the daemon), made until refused, and more asked for. Bound: the
/// object budget (derived from the guest's 16 MiB: 64 MiB and 64 KiB)
/// and the slack.
fn page_lists(switch: &Switch) {
    let base = status("VmRSS");
    let h = NET.eth_device("bounds-mr", switch);
    let mut a = Endpoint::new(&h);
    a.g.touch_ram();
    let mr = a.giant_mr_request();
    let g = &mut a.g;
    reset_peak();
    let before = status("VmRSS");
    // 48 of them would hold 96 MiB.
    let (mut made, mut refused) = (0, 0);
    for _ in 0..48 {
        match g.command(&mr) {
            Ok(_) => made += 1,
            Err(_) => refused += 1,
        }
    }
    let growth = peak_growth(before);
    eprintln!("page lists: {made} made, {refused} refused");
    // The guest shares its RAM: the budget is derived from it.
    let budget = vrdma_device::derived_budget(RAM);
    check("1 GiB MRs of two pages", growth, budget + SLACK);
    assert_eq!(h.counter_when("budget.limit", |_| true), budget);
    let bytes = h.counter_when("objects.bytes", |_| true);
    assert!(bytes <= budget, "{bytes} held over a budget of {budget}");
    assert!(refused > 0, "{made} made, none refused");
    drop(a);
    assert_eq!(h.counter_when("objects.bytes", |n| n == 0), 0);
    gone(&h, base);
}

/// The guest's NIC floods its stream (eight writers) while its device
/// exchanges. Bound: a read turn and a partial frame, the two streams'
/// backlogs, and the slack.
fn flood(switch: &Switch) {
    let base = status("VmRSS");
    let h = NET.eth_device("bounds-flood-h", switch);
    let x = NET.eth_device("bounds-flood-x", switch);
    let mut a = Endpoint::new(&h);
    let mut b = Endpoint::new(&x);
    a.g.touch_ram();
    b.g.touch_ram();
    vrdma_testkit::pvrdma::connect(&mut a, &mut b);
    exchange(&mut a, &mut b);
    let nic = Nic::connect(&h);
    let f = frame::udp(
        [2, 0xee, 0xee, 0xee, 0xee, 0xee],
        h.mac,
        frame::v4(h.addr),
        Ipv4Addr::new(10, 9, 9, 9),
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
            let mut s = nic.sock.try_clone().unwrap();
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
    reset_peak();
    let before = status("VmRSS");
    for _ in 0..10 {
        exchange(&mut a, &mut b);
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    let growth = peak_growth(before);
    let frames = sent.load(Ordering::Relaxed);
    assert_eq!(
        h.counter_when("eth.guest_rx", |n| n >= frames),
        frames,
        "every frame of the flood taken"
    );
    eprintln!("flood: {frames} frames");
    check(
        "a NIC flooding its stream",
        growth,
        READ_PER_TURN + MAX_FRAME as u64 + 2 * STREAM_BACKLOG + SLACK,
    );
    drop(nic);
    drop(a);
    drop(b);
    gone(&h, base);
}

/// DMA maps (each a sealed memfd of one page, the client's copy closed)
/// past the map budget, then a thousand messages of 16 descriptors where
/// none is taken, then one with 253. Descriptors held: at most the map
/// budget (each map's file) and the vectors, beyond what the guest's own
/// set-up holds, and the slack; none left once the guest has gone. The
/// memory of the maps themselves is the client's files (mapped, never
/// touched): bound, the slack.
fn descriptors(switch: &Switch) {
    let mut config = vrdma_vfio_user::Config::default();
    config.dma.max_maps = MAPS;
    let rss = status("VmRSS");
    let h = NET.eth_device_with("bounds-fds", switch, config, eth_function);
    // The earlier scenarios' devices have left the switch (it closes a
    // port's socket once the device closed its end): the bystanders' two
    // ports and this device's.
    assert!(eventually_within(Duration::from_secs(5), || switch.ports() == 3));
    let base = open_fds();
    let mut g = Guest::connect(&h.socket, RAM);
    assert_eq!(g.probe(), 0);
    let connected = open_fds();
    // The guest's connection, RAM and vectors, at both ends.
    assert!(
        connected - base <= 2 * (2 + VECTORS) + FD_SLACK,
        "{} descriptors for a guest's set-up",
        connected - base
    );
    reset_peak();
    let before = status("VmRSS");
    let (mut mapped, mut refused) = (0, 0);
    let mut peak = connected;
    for i in 0..2 * MAPS as u64 {
        let fd = sealed_memfd(c"bounds-map", PAGE_SIZE);
        let (hd, _) = g.request(
            vcmd::DMA_MAP,
            one_page(0x10_0000_0000 + i * 0x10_0000).as_bytes(),
            &[fd.as_fd()],
        );
        drop(fd);
        match hd.error {
            0 => mapped += 1,
            28 => refused += 1,
            e => panic!("DMA_MAP: errno {e}"),
        }
        peak = peak.max(open_fds());
    }
    // Descriptors where none is taken: each refused and closed.
    let event: std::os::fd::OwnedFd = nix::sys::eventfd::EventFd::new().unwrap().into();
    let read = RegionAccess {
        offset: 0,
        region: 1,
        count: 4,
    };
    for _ in 0..1000 {
        let (hd, _) = g.request(
            vcmd::REGION_READ,
            read.as_bytes(),
            &[event.as_fd(); MSG_FDS],
        );
        assert_eq!(hd.error, 22);
        peak = peak.max(open_fds());
    }
    // Beyond the guest's set-up, the daemon holds a descriptor for each
    // map but the RAM's (the map budget less one); the client's copies
    // are closed as they are sent, and a message's descriptors as it is
    // refused.
    let growth = peak - connected;
    let bound = MAPS - 1 + FD_SLACK;
    eprintln!(
        "descriptors: {mapped} maps, {refused} refused; {growth} more descriptors at the peak \
         (bound {bound})"
    );
    assert!(growth <= bound, "{growth} descriptors held for {MAPS} maps");
    assert_eq!((mapped, refused), (MAPS - 1, MAPS + 1), "the RAM is a map");
    assert_eq!(
        h.counter_when("vfio.fds", |_| true),
        (MAPS + VECTORS) as u64
    );
    let memory = peak_growth(before);
    // 253 descriptors: the client is dropped with everything it held.
    let reset = proto::Header {
        id: 9,
        command: vcmd::DEVICE_RESET,
        size: proto::HEADER_LEN as u32,
        flags: 0,
        error: 0,
    };
    g.conn
        .send(reset.as_bytes(), &[event.as_fd(); 253])
        .unwrap();
    assert!(!matches!(g.conn.receive(), Ok(Some(_))));
    assert_eq!(h.counter_when("vfio.fds", |n| n == 0), 0);
    drop(g);
    drop(event);
    // Nothing of the guest's is left open, at either end. (At most as
    // many as before, not exactly as many: a descriptor of an earlier
    // scenario that was still closing when `base` was read may have gone
    // since.)
    assert!(
        eventually_within(Duration::from_secs(5), || open_fds() <= base),
        "{} descriptors left of the {base} before the guest came",
        open_fds()
    );
    check("DMA maps and descriptor floods", memory, SLACK);
    gone(&h, rss);
}

/// Checks that the process's resident memory is back within the slack of
/// `before` (what it was before the scenario's device and guest came) once
/// its guest has gone.
fn gone(h: &Device, before: u64) {
    let back = eventually_within(Duration::from_secs(5), || status("VmRSS") <= before + SLACK);
    assert!(
        back,
        "{}: {} MiB resident, {} MiB before",
        h.socket.display(),
        status("VmRSS") / MIB,
        before / MIB
    );
}
