//! A hostile VMM's guest memory against the virtio-rdma device, through
//! the real vhost-user protocol: hugetlbfs files whose pages the huge page
//! pool cannot supply, unsealed files shrunk under the device (allowed, or
//! refused), regions past the device's region and byte limits — and the
//! object budget, which comes from the guest's configured size, never from
//! what its VMM chose to map. After each, the daemon lives, the device
//! serves a well-behaved guest again, and another pair of devices keeps
//! exchanging byte-exact.
//!
//! A scenario that kills the process without its protection runs in a
//! child (this binary again, running only that test), each on a block of
//! addresses of its own.

use std::{
    os::fd::{AsRawFd, OwnedFd},
    sync::Arc,
    time::Instant,
};

use nix::fcntl::SealFlag;
use vrdma_testkit::virtio::*;
use vrdma_virtio::{
    abi::qp_type,
    vhost::{ANNOUNCED_MEM_SLOTS, DEFAULT_MAX_REGIONS, MemoryLimits},
};

static NET: Net = Net::new(31);
/// The children's blocks: one each.
static HUGETLB_NET: Net = Net::new(32);
static UNSEALED_NET: Net = Net::new(33);

const MIB: u64 = 1 << 20;

/// The test binary again, running only test `name`, told that it is the
/// child; how it ended.
fn run_child(name: &str) -> std::process::ExitStatus {
    std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args([name, "--exact", "--test-threads=1", "--nocapture"])
        .env("VRDMA_VIRTIO_TEST_CHILD", name)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("running the child")
}

/// Whether this process is the child running test `name`.
fn is_child(name: &str) -> bool {
    std::env::var("VRDMA_VIRTIO_TEST_CHILD").is_ok_and(|v| v == name)
}

/// A memfd of `len` bytes named `name`, with the seals given.
fn memfd(name: &std::ffi::CStr, len: u64, seals: SealFlag, huge: bool) -> Option<OwnedFd> {
    use nix::{
        fcntl::{FcntlArg, fcntl},
        sys::memfd::{MFdFlags, memfd_create},
    };
    let mut flags = MFdFlags::MFD_ALLOW_SEALING;
    if huge {
        flags |= MFdFlags::MFD_HUGETLB;
    }
    let fd = memfd_create(name, flags).ok()?;
    nix::unistd::ftruncate(&fd, i64::try_from(len).expect("a size")).ok()?;
    if !seals.is_empty() {
        fcntl(&fd, FcntlArg::F_ADD_SEALS(seals)).expect("F_ADD_SEALS");
    }
    Some(fd)
}

fn sealed(name: &std::ffi::CStr, len: u64) -> OwnedFd {
    let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
    memfd(name, len, seals, false).expect("a memfd")
}

/// Descriptors of this process open on a memfd named `name`.
fn open_memfds(name: &str) -> usize {
    let want = format!("/memfd:{name} ");
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy().starts_with(&want))
        .count()
}

/// The largest mapping of this process, in bytes.
fn largest_mapping() -> u64 {
    std::fs::read_to_string("/proc/self/maps")
        .expect("/proc/self/maps")
        .lines()
        .filter_map(|l| {
            let (a, b) = l.split_whitespace().next()?.split_once('-')?;
            let (a, b) = (
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            );
            Some(b - a)
        })
        .max()
        .unwrap_or(0)
}

/// Whether the huge page pool is empty: a hugetlbfs page touched then
/// faults (vm-memory maps without a reservation).
fn no_huge_pages() -> bool {
    std::fs::read_to_string("/proc/meminfo")
        .expect("/proc/meminfo")
        .lines()
        .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["HugePages_Free:", "0"])
}

/// Waits (bounded) until `f` holds.
fn wait_for(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "{what} within {WAIT:?}");
        std::thread::yield_now();
    }
}

/// The well-behaved pair that must keep working.
struct Good {
    _da: Device,
    _db: Device,
    a: Endpoint,
    b: Endpoint,
    qa: Qp,
    qb: Qp,
    round: u8,
}

impl Good {
    fn new(net: &Net, name: &str) -> Self {
        let da = net.device(&format!("{name}-good-a"));
        let db = net.device(&format!("{name}-good-b"));
        let mut a = Endpoint::new(&da);
        let mut b = Endpoint::new(&db);
        let qa = a.qp(qp_type::RC);
        let qb = b.qp(qp_type::RC);
        connect(&mut a, &qa, &mut b, &qb);
        Good {
            _da: da,
            _db: db,
            a,
            b,
            qa,
            qb,
            round: 0,
        }
    }

    /// A SEND each way and a WRITE, byte-exact; every daemon given lives.
    fn check(&mut self, devices: &[&Device]) {
        for d in devices {
            assert!(d.alive(), "the daemon of {:?} lives", d.socket);
        }
        self.round += 1;
        let r = self.round;
        send_checked(
            &mut self.a,
            &mut self.qa,
            &mut self.b,
            &mut self.qb,
            r,
            3000,
        );
        send_checked(
            &mut self.b,
            &mut self.qb,
            &mut self.a,
            &mut self.qa,
            r ^ 0x80,
            1000,
        );
        let d = pattern(r, 5000);
        self.a.put(0, &d);
        self.qa.post_send(&Wqe::write(
            9,
            &[self.a.mr.sge(0, 5000)],
            self.b.mr.addr(100_000),
            self.b.mr.rkey,
        ));
        self.a.cq.expect_ok(wc::RDMA_WRITE, 9);
        assert_eq!(self.b.get(100_000, 5000), d);
    }
}

/// The device serves a guest of 16 MiB whose memory is whole, exchanging
/// with a peer.
fn serves_a_whole_guest(net: &Net, dev: &Device, name: &str) {
    let mut s = Endpoint::with_memory(dev, 16 * MIB);
    let _ = s.fe.query_device();
    let peer = net.device(&format!("{name}-peer"));
    let mut p = Endpoint::new(&peer);
    let mut qs = s.qp(qp_type::RC);
    let mut qp = p.qp(qp_type::RC);
    connect(&mut s, &qs, &mut p, &qp);
    send_checked(&mut s, &mut qs, &mut p, &mut qp, 0x5a, 4000);
}

/// A sealed hugetlbfs memfd passed the old check, and rust-vmm's
/// SET_VRING_ADDR read of the used index from it — a huge page the empty
/// pool cannot supply — killed the daemon with SIGBUS, every device with
/// it. Now a hugetlbfs region, sealed or not, is guarded before anything
/// touches it: the read finds a zero page, counted; an unsealed one is
/// refused (unsealed memory is not allowed); the daemon lives, the device
/// serves a whole guest next, and another pair keeps exchanging.
#[test]
fn hugetlbfs_guest_memory_is_guarded_before_its_first_touch() {
    const NAME: &str = "hugetlbfs_guest_memory_is_guarded_before_its_first_touch";
    let size = 16 * MIB;
    let Some(_probe) = memfd(c"vrdma-probe", 2 * MIB, SealFlag::empty(), true) else {
        eprintln!("no MFD_HUGETLB on this kernel: nothing to test");
        return;
    };
    if !is_child(NAME) {
        let s = run_child(NAME);
        assert!(
            s.success(),
            "the child (killed by SIGBUS without the guard): {s:?}"
        );
        return;
    }
    let net = &HUGETLB_NET;
    let mut good = Good::new(net, "hugetlb");
    let dev = net.device("hugetlb");

    // Unsealed: refused.
    let open = memfd(c"vrdma-hugetlb-open", size, SealFlag::empty(), true).expect("hugetlbfs");
    let ram = Arc::new(Ram::new(0, size));
    let mut fe = Frontend::negotiated(&dev.socket, ram.clone(), Options::default());
    let vmm = ram.region().as_ptr() as u64;
    assert!(
        fe.set_mem_table_of(0, size, vmm, &open).is_err(),
        "an unsealed hugetlbfs file accepted"
    );
    assert_eq!(dev.backend.memory_refused(), 1);
    drop(fe);

    // Sealed: taken, guarded.
    let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW;
    let huge = memfd(c"vrdma-hugetlb", size, seals, true).expect("hugetlbfs");
    let mut fe = Frontend::negotiated(&dev.socket, ram.clone(), Options::default());
    fe.set_mem_table_of(0, size, vmm, &huge)
        .expect("a sealed hugetlbfs file is taken");
    assert_eq!(dev.backend.memory_usage().maps, 1);
    // The rings' addresses name the hugetlbfs region: rust-vmm reads each
    // used index there (a huge page from an empty pool), as the device's
    // turns read the rings.
    fe.try_start_vrings([0; 4])
        .expect("the vrings set up on guarded memory");
    if no_huge_pages() {
        assert!(
            dev.backend.memory_faults() >= 1,
            "the huge page lost, counted"
        );
    }
    // The device's turn reads the controlq's rings there too.
    fe.control.notify();
    assert!(dev.alive(), "the daemon lives");
    drop(fe);

    serves_a_whole_guest(net, &dev, "hugetlb");
    good.check(&[&dev]);
}

/// With unsealed memory allowed, a region whose file the VMM shrinks
/// under the device is guarded: the device's own reads of its rings, and
/// a read through its memory's lease from another thread (what a device
/// of the same process does copying a payload lent on), find zero pages,
/// counted — the guard is keyed by address, not by thread. The daemon
/// lives, the device serves a whole guest next, another pair exchanges.
#[test]
fn unsealed_memory_allowed_is_guarded_for_the_device_and_its_loans() {
    const NAME: &str = "unsealed_memory_allowed_is_guarded_for_the_device_and_its_loans";
    if !is_child(NAME) {
        let s = run_child(NAME);
        assert!(
            s.success(),
            "the child (killed by SIGBUS without the guard): {s:?}"
        );
        return;
    }
    use vrdma_fabric::Lender;
    let net = &UNSEALED_NET;
    let mut good = Good::new(net, "unsealed");
    let limits = MemoryLimits {
        allow_unsealed: true,
        ..MemoryLimits::for_guest(Some(16 * MIB))
    };
    let dev = net.device_limited("unsealed", limits, |_| {});
    let size = 16 * MIB;
    let file = memfd(c"vrdma-unsealed", size, SealFlag::empty(), false).expect("a memfd");
    let ram = Arc::new(Ram::from_file(file.into(), 0, size));
    let mut fe = dev.connect_with(ram.clone(), Options::default());
    let _ = fe.query_device();
    let at = ram.pages(4);
    let bytes = pattern(7, 3 * 4096);
    ram.write(at, &bytes[..]);
    let lease = dev.with_face(|f| f.device().mem().lease().clone());
    // Another thread reads the device's memory through the lease: the
    // normal path first.
    let read = |lease: &vrdma_device::memory::Lease| {
        let lease = lease.clone();
        std::thread::spawn(move || {
            let mut out = vec![0u8; 3 * 4096];
            let src = lease.map().lend(at, out.len()).expect("lent");
            src.copy_to(&mut out[..]);
            out
        })
        .join()
        .expect("the reading thread")
    };
    assert_eq!(read(&lease), bytes);
    assert_eq!(dev.backend.memory_faults(), 0);
    // The VMM shrinks the file to nothing. The test's own view is not
    // guarded: it touches the memory no more.
    ram.file.set_len(0).expect("ftruncate");
    assert_eq!(read(&lease), vec![0u8; 3 * 4096], "lost pages read zeros");
    let faults = dev.backend.memory_faults();
    assert!(faults >= 3, "one per page lost: {faults}");
    // The device's turn reads the controlq's available ring (a page of
    // its own, which only a kick makes it read): a zero page too.
    fe.control.notify();
    wait_for("the device's fault repaired", || {
        dev.backend.memory_faults() > faults
    });
    assert!(dev.alive(), "the daemon lives");
    drop(fe);
    drop(lease);

    serves_a_whole_guest(net, &dev, "unsealed");
    good.check(&[&dev]);
}

/// Regions past the device's limits — a sparse 64 TiB region (the
/// address space another tenant's maps need), or one region more than
/// allowed (each holds a descriptor) — are refused with the protocol's
/// error when they come: nothing of them stays mapped or open, the
/// device keeps what it had, the daemon lives and serves a whole guest
/// next, and another pair maps its memory and exchanges byte-exact.
#[test]
fn regions_past_the_byte_and_region_limits_are_refused() {
    let mut good = Good::new(&NET, "limits");
    let limits = MemoryLimits::for_guest(Some(32 * MIB));
    assert_eq!(limits.max_regions, DEFAULT_MAX_REGIONS);
    assert_eq!(limits.max_bytes, 32 * MIB, "the guest's size");
    let dev = NET.device_limited("limits", limits, |_| {});
    let size = 16 * MIB;
    let opts = Options {
        mem_slots: true,
        ..Options::default()
    };
    let connect = || {
        let ram = Arc::new(Ram::new(0, size));
        let mut fe = Frontend::negotiated(&dev.socket, ram.clone(), opts.clone());
        let max = vhost::vhost_user::VhostUserFrontend::get_max_mem_slots(fe.conn())
            .expect("GET_MAX_MEM_SLOTS");
        assert_eq!(max, ANNOUNCED_MEM_SLOTS as u64, "what rust-vmm announces");
        let vmm = ram.region().as_ptr() as u64;
        let fd = ram.file.try_clone().expect("dup");
        fe.add_mem_region(0, size, vmm, &fd)
            .expect("the guest's RAM");
        fe
    };
    // Far from any mapping of the guest's.
    let vmm_of = |gpa: u64| 0x6000_0000_0000 + gpa;

    // A sparse 64 TiB region.
    let mut fe = connect();
    let huge = sealed(c"vrdma-limits-huge", 64 << 40);
    let gpa = 64 << 40;
    assert!(
        fe.add_mem_region(gpa, 64 << 40, vmm_of(gpa), &huge)
            .is_err(),
        "64 TiB past a 32 MiB guest taken"
    );
    assert!(
        largest_mapping() < 1 << 40,
        "the refused region is unmapped ({:#x} bytes mapped at once)",
        largest_mapping()
    );
    assert_eq!(open_memfds("vrdma-limits-huge"), 1, "only the test's own");
    let held = dev.backend.memory_usage();
    assert_eq!((held.maps, held.bytes), (1, size), "the RAM, kept");
    drop(fe);

    // A region at a time up to the limit (the RAM is one), then one more.
    let mut fe = connect();
    let small: Vec<OwnedFd> = (0..DEFAULT_MAX_REGIONS)
        .map(|_| sealed(c"vrdma-limits-small", 4096))
        .collect();
    let base = 1 << 40;
    for (i, fd) in small[..DEFAULT_MAX_REGIONS - 1].iter().enumerate() {
        let gpa = base + 4096 * i as u64;
        fe.add_mem_region(gpa, 4096, vmm_of(gpa), fd)
            .unwrap_or_else(|e| panic!("region {i} of {DEFAULT_MAX_REGIONS}: {e}"));
    }
    assert_eq!(dev.backend.memory_usage().maps, DEFAULT_MAX_REGIONS);
    let last = &small[DEFAULT_MAX_REGIONS - 1];
    let gpa = base + 4096 * (DEFAULT_MAX_REGIONS as u64);
    let before = open_memfds("vrdma-limits-small");
    assert!(
        fe.add_mem_region(gpa, 4096, vmm_of(gpa), last).is_err(),
        "a region past the limit taken"
    );
    assert_eq!(
        open_memfds("vrdma-limits-small"),
        before,
        "the refused region's descriptor closed"
    );
    let held = dev.backend.memory_usage();
    assert_eq!(
        (held.maps, held.fds),
        (DEFAULT_MAX_REGIONS, DEFAULT_MAX_REGIONS)
    );
    assert_eq!(dev.backend.memory_refused(), 2);
    assert!(last.as_raw_fd() >= 0);
    drop(fe);

    serves_a_whole_guest(&NET, &dev, "limits");
    // The device let go of the regions of the connections gone.
    assert_eq!(dev.backend.memory_usage().maps, 1);
    good.check(&[&dev]);
}

/// The object budget comes from the guest's configured size — 16 MiB
/// here, whose VMM maps 32 MiB: 64 MiB and 64 KiB, not 64 MiB and 128 KiB
/// — and, with no size configured, from what is mapped (under the
/// default size).
#[test]
fn the_object_budget_comes_from_the_configured_guest_size() {
    let budget = |dev: &Device| {
        dev.backend
            .counters()
            .into_iter()
            .find(|(k, _)| k == "budget.limit")
            .map(|(_, v)| v)
            .expect("budget.limit")
    };
    let sized = NET.device_limited("budget-sized", MemoryLimits::default(), |f| {
        f.set_guest_size(Some(16 * MIB));
    });
    let plain = NET.device("budget-plain");
    let mut a = Endpoint::with_memory(&sized, 32 * MIB);
    let mut b = Endpoint::with_memory(&plain, 32 * MIB);
    assert_eq!(budget(&sized), vrdma_device::derived_budget(16 * MIB));
    assert_eq!(budget(&plain), vrdma_device::derived_budget(32 * MIB));
    assert_eq!(sized.with_face(|f| f.guest_size()), Some(16 * MIB));
    // And the sized device serves within it.
    let mut qa = a.qp(qp_type::RC);
    let mut qb = b.qp(qp_type::RC);
    connect(&mut a, &qa, &mut b, &qb);
    send_checked(&mut a, &mut qa, &mut b, &mut qb, 3, 4000);
    // A reset keeps the size.
    a.fe.reset_and_restart();
    assert_eq!(budget(&sized), vrdma_device::derived_budget(16 * MIB));
}
