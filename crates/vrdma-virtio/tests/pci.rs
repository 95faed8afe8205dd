//! The virtio-pci transport of the virtio-rdma device (docs/virtio-rdma.md
//! §13.3; VIRTIO 1.2 §4.1) through the real vfio-user protocol: what the
//! function presents, the status handshake with its refusals, every stray
//! access a guest (or a VMM) can make, the PCI configuration access
//! window, interrupts, resets, a client that goes away, and a panic inside
//! a turn. The operations themselves run over this transport in
//! `operations_pci.rs`.

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use vrdma_testkit::virtio::{
    pci::{PciLink, QUEUE_VECTORS, common},
    vq::Vq,
    *,
};
use vrdma_vfio_user::proto::region;
use vrdma_virtio::{
    abi::{self, event, feature, qp_type, vq as vqi},
    pci::{BAR0_SIZE, BAR2_SIZE, DEVICE_ID, NO_VECTOR, VECTORS, VENDOR_ID, device_status as st},
};

static NET: PciNet = PciNet::new(30);

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// A link to `dev` on fresh memory, its four queues made (not set up).
fn link(dev: &PciDevice) -> (Arc<Ram>, PciLink, [Vq; 4]) {
    let ram = Arc::new(Ram::new(0, 16 << 20));
    let l = PciLink::connect(&dev.socket, &ram);
    let qs = [
        Vq::new(&ram, vqi::CONTROL, 64),
        Vq::new(&ram, vqi::EVENT, 64),
        Vq::new(&ram, vqi::NOTIFY, 64),
        Vq::new(&ram, vqi::DOORBELL, 2),
    ];
    (ram, l, qs)
}

/// VIRTIO 1.2 §4.1.2, §4.1.4: a modern virtio function — its identity,
/// the five capabilities on BAR2 (each queue's notify address alone in a
/// page), MSI-X, four queues, exactly the features of §2.2, and §3's
/// configuration.
#[test]
fn the_function_presents_a_modern_virtio_rdma_device() {
    let dev = NET.device("identity");
    let (_ram, l, _) = link(&dev);
    let cfg = l.client().read(region::CONFIG, 0, 256);
    assert_eq!(le16(&cfg, 0), VENDOR_ID);
    assert_eq!(le16(&cfg, 2), DEVICE_ID, "0x1040 + 42");
    assert_eq!(DEVICE_ID, 0x106a);
    assert!(cfg[8] >= 1, "a modern device's revision is 1 or more");
    assert!(le16(&cfg, 0x2e) >= 0x40, "subsystem ID 0x40 or more");
    let lay = l.layout;
    assert_eq!(lay.bar, 2);
    assert_eq!(lay.multiplier, 4096, "page-per-vq notify addresses (§8.7)");
    let ends = [
        (lay.common, 0x38),
        (lay.isr, 1),
        (lay.device, 64),
        (lay.notify, 4 * 4096),
    ];
    for (at, len) in ends {
        assert!(at + len <= BAR2_SIZE, "a structure inside BAR2");
    }
    assert_ne!(lay.pci_cfg, 0, "the PCI configuration access capability");
    // MSI-X: VECTORS entries, table in BAR0.
    let mut at = cfg[0x34] as usize;
    let mut msix = None;
    while at != 0 {
        if cfg[at] == 0x11 {
            msix = Some(at);
        }
        at = cfg[at + 1] as usize;
    }
    let m = msix.expect("an MSI-X capability");
    assert_eq!(u32::from(le16(&cfg, m + 2) & 0x7ff) + 1, VECTORS);
    assert!(BAR0_SIZE >= u64::from(VECTORS) * 16);
    assert_eq!(l.common_read(common::NUM_QUEUES, 2), 4);
    let f = l.device_features();
    let want = feature::VERSION_1
        | feature::RING_INDIRECT_DESC
        | feature::RING_EVENT_IDX
        | feature::DOORBELL_POLL
        | feature::STATS;
    assert_eq!(f, want, "exactly §2.2's features");
    for q in 0..4 {
        l.common_write(common::QUEUE_SELECT, 2, q);
        assert_eq!(l.common_read(common::QUEUE_NOTIFY_OFF, 2), q);
        assert_eq!(l.common_read(common::QUEUE_SIZE, 2), 1024);
        assert_eq!(l.common_read(common::QUEUE_ENABLE, 2), 0);
        assert_eq!(
            l.common_read(common::QUEUE_MSIX_VECTOR, 2),
            u64::from(NO_VECTOR)
        );
    }
    let c = l.device_config(64);
    assert_eq!(&c[..6], &mac_of(dev.addr), "the sibling NIC's MAC (§3)");
    assert_eq!(
        u32::from_le_bytes([c[24], c[25], c[26], c[27]]),
        (4 << 20) + 4096,
        "max_request"
    );
}

/// VIRTIO 1.2 §2.2.2, §3.1.1: FEATURES_OK reads back only for features
/// the device offered, VERSION_1 among them; features are fixed once it
/// is set; DRIVER_OK without FEATURES_OK, or with a queue outside guest
/// memory, sets DEVICE_NEEDS_RESET with a configuration interrupt and
/// serves nothing; a reset makes it whole.
#[test]
fn the_status_handshake_refuses_what_the_device_cannot_honour() {
    let dev = NET.device("handshake");
    let (_ram, l, qs) = link(&dev);
    l.reset();
    let offered = l.device_features();
    assert!(
        !l.negotiate(offered | feature::ACCESS_PLATFORM),
        "not offered"
    );
    l.reset();
    assert!(
        !l.negotiate(offered & !feature::VERSION_1),
        "no VERSION_1 (DEV-1)"
    );
    l.reset();
    assert!(l.negotiate(feature::VERSION_1));
    // Fixed from now on.
    l.set_driver_features(offered);
    l.common_write(common::DRIVER_FEATURE_SELECT, 4, 0);
    assert_eq!(
        l.common_read(common::DRIVER_FEATURE, 4),
        0,
        "no change after FEATURES_OK"
    );
    // DRIVER_OK with the doorbellq's rings past the end of memory.
    l.setup_config_vector();
    for q in &qs[..3] {
        l.setup_queue(q);
    }
    l.common_write(common::QUEUE_SELECT, 2, 3);
    l.common_write(common::QUEUE_SIZE, 2, 2);
    l.common_write(common::QUEUE_DESC, 4, (32 << 20) & 0xffff_ffff);
    l.common_write(common::QUEUE_ENABLE, 2, 1);
    let before = dev.pci_stats();
    l.set_status(st::ACKNOWLEDGE | st::DRIVER | st::FEATURES_OK | st::DRIVER_OK);
    assert_ne!(l.status() & st::NEEDS_RESET, 0, "DEVICE_NEEDS_RESET");
    assert!(l.take_vector(0), "a configuration change interrupt");
    let after = dev.pci_stats();
    assert_eq!(after.start_refused, before.start_refused + 1);
    // Nothing is served: a kick of the controlq is idle.
    let at = l.layout.notify;
    l.client().write_u(l.layout.bar, at, 2, 0);
    assert_eq!(dev.pci_stats().idle_kicks, after.idle_kicks + 1);
    // DRIVER_OK without FEATURES_OK.
    l.reset();
    assert_eq!(l.status() & st::NEEDS_RESET, 0, "a reset clears it");
    l.set_status(st::ACKNOWLEDGE | st::DRIVER | st::DRIVER_OK);
    assert_ne!(l.status() & st::NEEDS_RESET, 0);
    l.reset();
    drop(l);
    // A new driver starts the device and is served.
    let mut fe = dev.connect(16 << 20);
    let _ = fe.query_device();
}

/// Every access at no field, at a field with the wrong width, at a field
/// that is read-only, at a queue that does not exist, at a notify address
/// that is not one, or with a vector the function has not: nothing
/// changes, reads give 0 (or NO_VECTOR), each is counted; then the device
/// starts and serves as if nothing had happened.
#[test]
fn stray_accesses_change_nothing_and_are_counted() {
    let dev = NET.device("stray");
    let (_ram, l, _) = link(&dev);
    let bar = l.layout.bar;
    let c = l.layout.common;
    let before = dev.pci_stats().bad_accesses;
    let mut strays = 0;
    {
        let mut cl = l.client();
        // Wrong widths.
        assert_eq!(cl.read_u(bar, c + common::DEVICE_FEATURE, 2), 0);
        cl.write_u(bar, c + common::QUEUE_SELECT, 4, 0x1_0001);
        cl.write_u(bar, c + common::DEVICE_STATUS, 2, 0x0f0f);
        // Misaligned, and past the structure's fields.
        assert_eq!(cl.read_u(bar, c + 0x13, 1), 0);
        cl.write_u(bar, c + 0x3e, 2, 1);
        // Read-only fields.
        cl.write_u(bar, c + common::NUM_QUEUES, 2, 9);
        cl.write_u(bar, c + common::DEVICE_FEATURE, 4, u64::from(u32::MAX));
        cl.write_u(bar, c + common::QUEUE_NOTIFY_OFF, 2, 7);
        // The device configuration and the ISR are read-only.
        cl.write_u(bar, l.layout.device, 4, 0xdead_beef);
        cl.write_u(bar, l.layout.isr, 1, 0xff);
        // A notify address that is not a queue's.
        cl.write_u(bar, l.layout.notify + 8, 2, 0);
        // Nothing at all.
        assert_eq!(cl.read_u(bar, 0x7000, 4), 0);
        strays += 12;
    }
    assert_eq!(l.common_read(common::NUM_QUEUES, 2), 4);
    assert_eq!(l.common_read(common::QUEUE_SELECT, 2), 0);
    assert_eq!(l.status(), 0);
    assert_eq!(&l.device_config(6), &mac_of(dev.addr));
    // A queue that does not exist reads 0 and takes nothing.
    l.common_write(common::QUEUE_SELECT, 2, 7);
    assert_eq!(l.common_read(common::QUEUE_SIZE, 2), 0);
    l.common_write(common::QUEUE_SIZE, 2, 16);
    l.common_write(common::QUEUE_ENABLE, 2, 1);
    assert_eq!(l.common_read(common::QUEUE_ENABLE, 2), 0);
    strays += 2;
    // A size that is no power of two, or over the maximum.
    l.common_write(common::QUEUE_SELECT, 2, 0);
    l.common_write(common::QUEUE_SIZE, 2, 3);
    l.common_write(common::QUEUE_SIZE, 2, 2048);
    assert_eq!(l.common_read(common::QUEUE_SIZE, 2), 1024);
    strays += 2;
    // A vector the function does not have reads back as NO_VECTOR.
    l.common_write(common::QUEUE_MSIX_VECTOR, 2, u64::from(VECTORS));
    assert_eq!(
        l.common_read(common::QUEUE_MSIX_VECTOR, 2),
        u64::from(NO_VECTOR)
    );
    l.common_write(common::CONFIG_MSIX_VECTOR, 2, 77);
    assert_eq!(
        l.common_read(common::CONFIG_MSIX_VECTOR, 2),
        u64::from(NO_VECTOR)
    );
    assert_eq!(dev.pci_stats().bad_accesses, before + strays);
    drop(l);
    let mut s = Endpoint::new(&dev);
    let _ = s.fe.query_port();
    let q = s.qp(qp_type::RC);
    assert_ne!(q.qpn, 0);
}

/// VIRTIO 1.2 §4.1.4.9: the PCI configuration access capability reaches
/// the BAR it names — a read of num_queues and a write of the device
/// status through the window — and a window of a length other than 1, 2
/// or 4, misaligned, or past its BAR, moves nothing.
#[test]
fn the_configuration_window_reaches_the_bar() {
    let dev = NET.device("window");
    let (_ram, l, _) = link(&dev);
    let w = l.layout.pci_cfg;
    let set = |bar: u8, off: u32, len: u32| {
        let mut cl = l.client();
        cl.write(region::CONFIG, w + 4, &[bar]);
        cl.write(region::CONFIG, w + 8, &off.to_le_bytes());
        cl.write(region::CONFIG, w + 12, &len.to_le_bytes());
    };
    let c = l.layout.common as u32;
    set(2, c + common::NUM_QUEUES as u32, 2);
    assert_eq!(l.client().read_u(region::CONFIG, w + 16, 4) & 0xffff, 4);
    set(2, c + common::DEVICE_STATUS as u32, 1);
    l.client()
        .write(region::CONFIG, w + 16, &[st::ACKNOWLEDGE, 0, 0, 0]);
    assert_eq!(l.status(), st::ACKNOWLEDGE, "written through the window");
    for (bar, off, len) in [
        (2, c + common::DEVICE_STATUS as u32, 3),
        (2, c + common::NUM_QUEUES as u32 + 1, 2),
        (2, BAR2_SIZE as u32, 4),
        (5, 0, 4),
    ] {
        set(bar, off, len);
        assert_eq!(l.client().read_u(region::CONFIG, w + 16, 4), 0);
        l.client()
            .write(region::CONFIG, w + 16, &[0xff, 0xff, 0xff, 0xff]);
    }
    assert_eq!(l.status(), st::ACKNOWLEDGE, "nothing written");
    l.reset();
}

/// VIRTIO 1.2 §4.1.5: interrupts go through the vectors the driver set —
/// the controlq's answers, the eventq's PORT_ACTIVE, the notifyq's CQ
/// notification each through its own; a queue with NO_VECTOR interrupts
/// never; the ISR says why for a driver that reads it, and a read clears
/// it.
#[test]
fn interrupts_follow_the_vectors_the_driver_set() {
    let dev = NET.device("vectors");
    let peer = NET.device("vectors-peer");
    let mut a = Endpoint::new(&dev);
    let mut b = Endpoint::new(&peer);
    assert_eq!(QUEUE_VECTORS, [1, 2, 3, NO_VECTOR]);
    let before = dev.pci_stats().interrupts;
    let _ = a.fe.query_device();
    // The answer is in the used ring before the interrupt that follows it
    // is counted (the front-end polls the ring): wait for the count.
    let t = std::time::Instant::now();
    while dev.pci_stats().interrupts <= before {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(5),
            "the controlq's vector: no interrupt"
        );
        std::thread::yield_now();
    }
    a.fe.wait_event("PORT_ACTIVE", |e| e.event_type.get() == event::PORT_ACTIVE);
    // A CQ armed: its notification comes through the notifyq's vector.
    let mut qa = a.qp(qp_type::RC);
    let mut qb = b.qp(qp_type::RC);
    connect(&mut a, &qa, &mut b, &qb);
    a.cq.arm(abi::cq_header::ARM_NEXT);
    send_checked(&mut b, &mut qb, &mut a, &mut qa, 1, 100);
    let n = a.fe.wait_notification(a.cq.handle);
    assert_eq!(n.cq.get(), a.cq.handle);
    // The ISR: set by those interrupts, cleared by a read.
    let isr = {
        let l = a.fe.pci();
        let lay = l.layout;
        let first = l.client().read_u(lay.bar, lay.isr, 1);
        let second = l.client().read_u(lay.bar, lay.isr, 1);
        (first, second)
    };
    assert_eq!(isr, (1, 0), "queue interrupt bit, then cleared");
}

/// §11.1, DEV-51: status 0 destroys everything the driver made; the
/// device serves a driver that starts again from nothing. A client that
/// goes away (a VMM that dies) resets the device the same way.
#[test]
fn a_reset_and_a_client_gone_leave_nothing_behind() {
    let dev = NET.device("reset");
    let peer = NET.device("reset-peer");
    let mut a = Endpoint::new(&dev);
    let mut b = Endpoint::new(&peer);
    let mut qa = a.qp(qp_type::RC);
    let mut qb = b.qp(qp_type::RC);
    connect(&mut a, &qa, &mut b, &qb);
    send_checked(&mut a, &mut qa, &mut b, &mut qb, 1, 5000);
    assert!(!dev.with_face(|f| f.is_empty()));
    a.fe.reset_and_restart();
    assert!(
        dev.with_face(|f| f.is_empty()),
        "nothing left after a reset"
    );
    let counts = dev.with_face(|f| f.device().engine().counts());
    assert_eq!(counts, vrdma_engine::Counts::default());
    let mut a = Endpoint::on(a.fe, dev.gid());
    let mut qa = a.qp(qp_type::RC);
    let mut qb = b.qp(qp_type::RC);
    connect(&mut a, &qa, &mut b, &qb);
    send_checked(&mut b, &mut qb, &mut a, &mut qa, 2, 5000);
    // The client goes.
    let resets = dev.pci_stats().resets;
    drop(a);
    let deadline = std::time::Instant::now() + WAIT;
    while dev.pci_stats().resets == resets {
        assert!(
            std::time::Instant::now() < deadline,
            "the device resets when its client goes"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(dev.with_face(|f| f.is_empty()));
    let mut a = Endpoint::new(&dev);
    let mut qa = a.qp(qp_type::RC);
    let mut qb = b.qp(qp_type::RC);
    connect(&mut a, &qa, &mut b, &qb);
    send_checked(&mut a, &mut qa, &mut b, &mut qb, 3, 5000);
}

/// §10.4: a panic inside a turn fails the device: DEVICE_FATAL on its
/// eventq, DEVICE_NEEDS_RESET with a configuration interrupt, no object
/// left, ERR_DEVICE for all but the queries; a reset (status 0) and a new
/// start serve again, and the server thread lives.
#[test]
fn a_panic_in_a_turn_needs_a_reset() {
    use vrdma_testkit::tripwire::Tripwire;
    let trip = Arc::new(AtomicBool::new(false));
    let t = trip.clone();
    let dev = NET.device_on(
        "panic",
        vrdma_virtio::face::Options::default(),
        vrdma_virtio::vhost::DEFAULT_SPIN,
        move |p| Tripwire::new(p, t),
    );
    let peer = NET.device("panic-peer");
    let mut s = Endpoint::new(&dev);
    let mut b = Endpoint::new(&peer);
    let config_irqs = s.fe.pci().config_interrupts.load(Ordering::Relaxed);
    trip.store(true, Ordering::Relaxed);
    let _ = s.fe.query_device();
    let e = s.fe.wait_event_of(event::DEVICE_FATAL, 0);
    assert_eq!(e.context.get(), 0);
    assert!(dev.alive());
    assert_ne!(s.fe.pci().status() & st::NEEDS_RESET, 0);
    let deadline = std::time::Instant::now() + WAIT;
    while s.fe.pci().config_interrupts.load(Ordering::Relaxed) == config_irqs {
        assert!(
            std::time::Instant::now() < deadline,
            "a configuration interrupt"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    assert_eq!(dev.pci_stats().panics, 1);
    let _ = s.fe.query_port();
    s.fe.refused(
        abi::status::DEVICE,
        abi::op::ALLOC_PD,
        s.ctx.handle,
        &[],
        &[],
    );
    s.fe.reset_and_restart();
    assert_eq!(s.fe.pci().status() & st::NEEDS_RESET, 0);
    let mut s = Endpoint::on(s.fe, dev.gid());
    let mut q = s.qp(qp_type::RC);
    let mut qb = b.qp(qp_type::RC);
    connect(&mut s, &q, &mut b, &qb);
    send_checked(&mut s, &mut q, &mut b, &mut qb, 4, 3000);
}

/// The controlq's available index more than the queue's size ahead: the
/// device counts the broken ring and its thread goes on (the fuzzer found
/// it held for good), then serves the mended queue.
#[test]
fn an_available_index_from_nowhere_holds_no_thread() {
    let dev = Arc::new(NET.device("avail-nowhere"));
    let mut fe = dev.connect(16 << 20);
    let _ = fe.query_device();
    let bad = dev.pci_stats().bad_chains;
    let (avail, idx) = (fe.control.avail, fe.control.avail_idx);
    fe.ram
        .store_u16(avail + 2, idx.wrapping_add(200), Ordering::Release);
    fe.control.notify();
    let (tx, rx) = std::sync::mpsc::channel();
    let d = dev.clone();
    std::thread::spawn(move || {
        while d.pci_stats().bad_chains == bad {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        let _ = tx.send(());
    });
    rx.recv_timeout(WAIT)
        .expect("the broken ring is counted, and the device's thread is not held");
    fe.ram.store_u16(avail + 2, idx, Ordering::Release);
    let _ = fe.query_device();
}
