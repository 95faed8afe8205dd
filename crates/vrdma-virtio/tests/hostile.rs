//! A hostile driver and VMM against the virtio-rdma device, through the
//! real vhost-user protocol: commands with bad handles, lengths and fields,
//! page lists outside guest memory, wild ring indices, WQEs rewritten
//! after their doorbell, doorbells of destroyed QPs, vring addresses
//! outside memory, a memory table replaced under a live QP, a front-end
//! gone mid-transfer. After each, a well-behaved pair of devices keeps
//! exchanging byte-exact, and every daemon thread lives.

use std::{sync::Arc, time::Duration};

use vhost::VringConfigData;
use vrdma_testkit::virtio::*;
use vrdma_virtio::abi::{self, event, op, qp_type, status};
use zerocopy::{FromZeros, IntoBytes};

static NET: Net = Net::new(27);

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
    fn new(name: &str) -> Self {
        let da = NET.device(&format!("{name}-good-a"));
        let db = NET.device(&format!("{name}-good-b"));
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

    /// A SEND each way and a WRITE, byte-exact.
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

fn ring(header: u64, entries: u32, stride: u32, npages: u32) -> abi::RingDesc {
    abi::RingDesc {
        header: header.into(),
        entries: entries.into(),
        stride: stride.into(),
        npages: npages.into(),
        reserved: 0.into(),
    }
}

#[test]
fn bad_commands_get_the_spec_statuses() {
    let mut good = Good::new("commands");
    let dev = NET.device("commands");
    let mut s = Endpoint::new(&dev);
    let ctx = s.ctx.handle;
    let fe = &mut s.fe;
    // Framing (§6.4 step 1).
    let (len, resp) = fe.raw(&[1, 0, 0], 64);
    assert_eq!(
        (len, resp[0]),
        (8, status::LENGTH as u8),
        "shorter than a header"
    );
    fe.refused(status::UNSUPPORTED, 99, ctx, &[], &[]);
    fe.refused(status::UNSUPPORTED, 64, ctx, &[], &[]);
    fe.refused(status::LENGTH, op::ALLOC_PD, ctx, &[0; 4], &[]);
    fe.refused(status::LENGTH, op::DEALLOC_PD, ctx, &[0; 4], &[]);
    // The response room too small for QUERY_DEVICE's body.
    let (len, resp) = fe.raw(
        &vrdma_testkit::virtio::frontend::request(op::QUERY_DEVICE, 0, &[], &[]),
        16,
    );
    assert_eq!((len, resp[0]), (8, status::LENGTH as u8));
    // A chain that cannot carry a status: used.len 0 (DEV-12).
    let bad = dev.backend.bad_chains();
    let (len, _) = fe.raw(
        &vrdma_testkit::virtio::frontend::request(op::ALLOC_PD, ctx, &[], &[]),
        4,
    );
    assert_eq!(len, 0);
    let at = fe.ram.pages(1);
    let (len, _) = fe.chain(&[
        vrdma_testkit::virtio::vq::Buf::w(at, 64),
        vrdma_testkit::virtio::vq::Buf::r(at + 64, 8),
    ]);
    assert_eq!(len, 0, "a readable buffer after a writable one");
    assert_eq!(dev.backend.bad_chains(), bad + 2);
    // The header (step 2): flags, context.
    let mut req = vrdma_testkit::virtio::frontend::request(op::ALLOC_PD, ctx, &[], &[]);
    req[2] = 1;
    let (_, resp) = fe.raw(&req, 64);
    assert_eq!(resp[0], status::INVALID as u8, "flags not 0 (DEV-15)");
    fe.refused(status::NOENT, op::ALLOC_PD, ctx + 1000, &[], &[]);
    fe.refused(status::NOENT, op::ALLOC_PD, 0, &[], &[]);
    // Reserved fields (step 3), handles (step 4).
    let h = |handle: u32, reserved: u32| abi::HandleReq {
        handle: handle.into(),
        reserved: reserved.into(),
    };
    fe.refused(
        status::INVALID,
        op::DEALLOC_PD,
        ctx,
        h(s.pd, 1).as_bytes(),
        &[],
    );
    fe.refused(
        status::NOENT,
        op::DEALLOC_PD,
        ctx,
        h(9999, 0).as_bytes(),
        &[],
    );
    fe.refused(
        status::NOENT,
        op::DESTROY_CQ,
        ctx,
        h(9999, 0).as_bytes(),
        &[],
    );
    fe.refused(
        status::NOENT,
        op::DESTROY_QP,
        ctx,
        h(0xff_ffff, 0).as_bytes(),
        &[],
    );
    fe.refused(
        status::NOENT,
        op::DEREG_MR,
        ctx,
        h(0xdead_0000, 0).as_bytes(),
        &[],
    );
    fe.refused(status::NOENT, op::QUERY_SRQ, ctx, h(7, 0).as_bytes(), &[]);
    // Another context's objects are no objects of this one (DEV-18).
    let other = fe.context(64);
    fe.refused(
        status::NOENT,
        op::DEALLOC_PD,
        other.handle,
        h(s.pd, 0).as_bytes(),
        &[],
    );
    fe.refused(
        status::NOENT,
        op::DESTROY_CQ,
        other.handle,
        h(s.cq.handle, 0).as_bytes(),
        &[],
    );
    // Values (step 5).
    let cc = abi::CreateContextReq {
        doorbell_bits: 100.into(),
        npages: 1.into(),
    };
    fe.refused(
        status::INVALID,
        op::CREATE_CONTEXT,
        0,
        cc.as_bytes(),
        &[fe.ram.pages(1)],
    );
    let mw = abi::AllocMwReq {
        pd: s.pd.into(),
        mw_type: 3.into(),
    };
    fe.refused(status::INVALID, op::ALLOC_MW, ctx, mw.as_bytes(), &[]);
    let hdr = fe.ram.header();
    let cq = abi::CreateCqReq {
        ring: ring(hdr, 100, 32, 1),
    };
    fe.refused(
        status::INVALID,
        op::CREATE_CQ,
        ctx,
        cq.as_bytes(),
        &[fe.ram.pages(1)],
    );
    let cq = abi::CreateCqReq {
        ring: ring(hdr + 8, 128, 32, 1),
    };
    fe.refused(
        status::FAULT,
        op::CREATE_CQ,
        ctx,
        cq.as_bytes(),
        &[fe.ram.pages(1)],
    );
    let dma = abi::RegDmaMrReq {
        pd: s.pd.into(),
        access: (1u32 << 10).into(),
    };
    fe.refused(
        status::UNSUPPORTED,
        op::REG_DMA_MR,
        ctx,
        dma.as_bytes(),
        &[],
    );
    let mut bad_qp = abi::ModifyQpReq {
        qpn: 0.into(),
        attr_mask: mask::STATE.into(),
        attrs: Default::default(),
    };
    fe.refused(status::NOENT, op::MODIFY_QP, ctx, bad_qp.as_bytes(), &[]);
    let q = fe.qp(&s.ctx, s.pd, &QpSpec::new(qp_type::RC, s.cq.handle));
    bad_qp.qpn = q.qpn.into();
    bad_qp.attrs.qp_state = state::RTS.into();
    fe.refused(status::INVALID, op::MODIFY_QP, ctx, bad_qp.as_bytes(), &[]);
    bad_qp.attr_mask = (mask::STATE | mask::CAP).into();
    fe.refused(
        status::UNSUPPORTED,
        op::MODIFY_QP,
        ctx,
        bad_qp.as_bytes(),
        &[],
    );
    // Use by other objects (step 9).
    fe.refused(
        status::BUSY,
        op::DEALLOC_PD,
        ctx,
        h(s.pd, 0).as_bytes(),
        &[],
    );
    fe.refused(
        status::BUSY,
        op::DESTROY_CQ,
        ctx,
        h(s.cq.handle, 0).as_bytes(),
        &[],
    );
    // And the device serves on.
    let _ = fe.query_device();
    good.check(&[&dev]);
}

#[test]
fn page_lists_outside_guest_memory_fault() {
    let mut good = Good::new("fault");
    let dev = NET.device("fault");
    let mut s = Endpoint::with_memory(&dev, 16 << 20);
    let ctx = s.ctx.handle;
    let end = s.fe.ram.end();
    let fe = &mut s.fe;
    let mr = abi::RegMrReq {
        pd: s.pd.into(),
        access: 1.into(),
        iova: 0x1000.into(),
        length: 8192.into(),
        page_shift: 12.into(),
        offset: 0.into(),
        npages: 2.into(),
        reserved: 0.into(),
    };
    fe.refused(
        status::FAULT,
        op::REG_MR,
        ctx,
        mr.as_bytes(),
        &[0x10_000, end],
    );
    fe.refused(
        status::FAULT,
        op::REG_MR,
        ctx,
        mr.as_bytes(),
        &[0x10_000, !0xfff_u64],
    );
    fe.refused(
        status::FAULT,
        op::REG_MR,
        ctx,
        mr.as_bytes(),
        &[0x10_000, 0x20_100],
    );
    let cq = abi::CreateCqReq {
        ring: ring(fe.ram.header(), 128, 32, 1),
    };
    fe.refused(
        status::FAULT,
        op::CREATE_CQ,
        ctx,
        cq.as_bytes(),
        &[end + 4096],
    );
    let cq = abi::CreateCqReq {
        ring: ring(end - 32, 128, 32, 1),
    };
    fe.refused(
        status::FAULT,
        op::CREATE_CQ,
        ctx,
        cq.as_bytes(),
        &[fe.ram.pages(1)],
    );
    let cc = abi::CreateContextReq {
        doorbell_bits: 64.into(),
        npages: 1.into(),
    };
    fe.refused(status::FAULT, op::CREATE_CONTEXT, 0, cc.as_bytes(), &[end]);
    // A fast registration whose page list is outside memory completes
    // in error.
    let dev_b = NET.device("fault-peer");
    let mut b = Endpoint::new(&dev_b);
    let mut qa = s.qp(qp_type::RC);
    let qb = b.qp(qp_type::RC);
    connect(&mut s, &qa, &mut b, &qb);
    let k = s.fe.alloc_mr(&s.ctx, s.pd, 4);
    let key = (k.lkey.get() & !0xff) | ((k.lkey.get() + 1) & 0xff);
    qa.post_send(&Wqe::reg_mr(
        1,
        key,
        0x9000_0000,
        4096,
        end + 64,
        1,
        12,
        ALL_ACCESS,
    ));
    let c = s.cq.wait(1, "the fast registration")[0];
    assert_eq!(
        (c.wr_id.get(), c.status),
        (1, wc::LOC_PROT_ERR),
        "§7.9: a page_list outside memory"
    );
    // … and one naming a page outside memory (on a fresh QP: the first
    // went to ERR).
    let mut qa2 = s.qp(qp_type::RC);
    let qb2 = b.qp(qp_type::RC);
    connect(&mut s, &qa2, &mut b, &qb2);
    let list = s.fe.ram.alloc(8, 8);
    s.fe.ram.write(list, &end.to_le_bytes());
    qa2.post_send(&Wqe::reg_mr(
        2,
        key,
        0x9000_0000,
        4096,
        list,
        1,
        12,
        ALL_ACCESS,
    ));
    let c = s.cq.wait(1, "the fast registration")[0];
    assert_eq!(
        (c.wr_id.get(), c.status),
        (2, wc::LOC_PROT_ERR),
        "§7.9: a page outside memory"
    );
    good.check(&[&dev, &dev_b]);
}

/// §7.9, DEV-32/33: receive WQEs naming more SGEs than their queue takes.
/// In a QP's own ring the first fails the QP with one QP_FATAL and the
/// later ones flush with no event of their own; in an SRQ the first
/// raises SRQ_ERR once and the SRQ takes nothing more (a good WQE after it
/// stays in the ring).
#[test]
fn malformed_receives_fail_their_queue_once() {
    let mut good = Good::new("malformed-recv");
    let dev = NET.device("malformed-recv");
    let mut s = Endpoint::new(&dev);
    let mut q = s.qp(qp_type::RC);
    s.fe.qp_init(&s.ctx, &q, ALL_ACCESS);
    // A header naming 200 SGEs, none behind it.
    let bad = |wr_id: u64| {
        abi::RecvWqeHdr {
            wr_id: wr_id.into(),
            count: 200.into(),
            reserved: [0; 6],
        }
        .as_bytes()
        .to_vec()
    };
    let rq = q.rq.as_mut().expect("a receive ring");
    rq.push(&s.fe.ram, &bad(1));
    q.door.ring(q.doorbell);
    s.fe.wait_event_of(event::QP_FATAL, q.qpn);
    let cs = s.cq.wait(1, "the malformed receive flushed");
    assert_eq!((cs[0].wr_id.get(), cs[0].status), (1, wc::WR_FLUSH_ERR));
    // A second one, in a later turn: flushed, no second QP_FATAL.
    let rq = q.rq.as_mut().expect("a receive ring");
    rq.push(&s.fe.ram, &bad(2));
    q.door.ring(q.doorbell);
    let cs = s.cq.wait(1, "the second malformed receive flushed");
    assert_eq!((cs[0].wr_id.get(), cs[0].status), (2, wc::WR_FLUSH_ERR));

    let mut srq = s.fe.srq(&s.ctx, s.pd, 16, 1, 0);
    srq.ring.push(&s.fe.ram, &bad(3));
    srq.post_recv(4, &[s.mr.sge(0, 64)]);
    // SRQ_ERR next, with no second QP_FATAL before it (events come in
    // order; the port's PORT_ACTIVE may be anywhere).
    s.fe.wait_event_of(event::SRQ_ERR, srq.handle);
    let of_objects = |fe: &Frontend| {
        fe.events
            .iter()
            .filter(|e| e.event_type.get() != event::PORT_ACTIVE)
            .copied()
            .collect::<Vec<_>>()
    };
    assert_eq!(of_objects(&s.fe), vec![], "no other event");
    assert_eq!(srq.ring.consumer(&s.fe.ram), 1, "the good WQE not taken");
    // Rung again: still nothing taken, no second SRQ_ERR. Two command
    // round trips after the ring: the device's turn after the first one's
    // answer scans the doorbell bits set before it, and delivers its
    // events before it takes the second command.
    srq.door.ring(srq.doorbell);
    s.fe.query_device();
    s.fe.query_device();
    s.fe.drain();
    assert_eq!(srq.ring.consumer(&s.fe.ram), 1);
    assert_eq!(of_objects(&s.fe), vec![], "no event after the SRQ broke");
    good.check(&[&dev]);
}

#[test]
fn wild_producer_index_is_qp_fatal() {
    let mut good = Good::new("wild");
    let dev = NET.device("wild");
    let mut s = Endpoint::new(&dev);
    let mut q = s.qp(qp_type::RC);
    s.fe.qp_init(&s.ctx, &q, ALL_ACCESS);
    // The receive ring's producer a million ahead of its consumer.
    let rq = q.rq.as_mut().expect("a receive ring");
    rq.prod = 1_000_000;
    rq.publish(&s.fe.ram);
    q.door.ring(q.doorbell);
    let e = s.fe.wait_event_of(event::QP_FATAL, q.qpn);
    assert_eq!(e.context.get(), s.ctx.handle);
    assert_eq!(
        s.fe.query_qp(&s.ctx, q.qpn).attrs.qp_state.get(),
        state::ERR
    );
    assert!(dev.stats().rings.broken_rings >= 1);
    good.check(&[&dev]);
}

#[test]
fn a_wqe_rewritten_after_its_doorbell_changes_nothing() {
    let mut good = Good::new("rewrite");
    let da = NET.device("rewrite-a");
    let db = NET.device("rewrite-b");
    let mut a = Endpoint::new(&da);
    let mut b = Endpoint::new(&db);
    let mut qa = a.qp(qp_type::RC);
    let qb = b.qp(qp_type::RC);
    connect(&mut a, &qa, &mut b, &qb);
    for i in 0..20u64 {
        let d = pattern(i as u8, 2000);
        a.put(0, &d);
        b.fe.ram.fill(b.mr.gpa + 8192, 4096, 0);
        b.fe.ram.fill(b.mr.gpa + 65536, 4096, 0);
        let slot = qa.sq.slot(qa.sq.prod);
        qa.post_send(&Wqe::write(
            i,
            &[a.mr.sge(0, 2000)],
            b.mr.addr(8192),
            b.mr.rkey,
        ));
        // The device took it (its consumer index passed the slot): the
        // slot is the driver's again, rewritten to aim elsewhere.
        let deadline = std::time::Instant::now() + WAIT;
        while qa.sq.consumer(&a.fe.ram) != qa.sq.prod {
            assert!(
                std::time::Instant::now() < deadline,
                "the device takes the WQE"
            );
            std::thread::yield_now();
        }
        let evil = Wqe::write(999, &[a.mr.sge(4096, 4000)], b.mr.addr(65536), b.mr.rkey).bytes();
        a.fe.ram.write(slot, &evil[..]);
        let c = a.cq.expect_ok(wc::RDMA_WRITE, i);
        assert_eq!(c.byte_len.get(), 2000);
        assert_eq!(b.get(8192, 2000), d, "the copy taken at the doorbell");
        assert_eq!(
            b.get(65536, 4096),
            vec![0; 4096],
            "the rewrite reached nothing"
        );
    }
    good.check(&[&da, &db]);
}

#[test]
fn doorbells_of_destroyed_qps_are_stale_and_harmless() {
    let mut good = Good::new("stale");
    let dev = NET.device("stale");
    let mut s = Endpoint::new(&dev);
    let q = s.qp(qp_type::RC);
    let (door, idx) = (q.door.clone(), q.doorbell);
    s.fe.destroy(op::DESTROY_QP, &s.ctx, q.qpn)
        .expect("DESTROY_QP");
    let before = dev.stats().stale_doorbells;
    for _ in 0..10 {
        door.ring(idx);
        door.ring(4000);
    }
    // Bits past every object too; the device counts them as stale.
    let deadline = std::time::Instant::now() + WAIT;
    while dev.stats().stale_doorbells < before + 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "stale doorbells counted"
        );
        door.kick();
        std::thread::sleep(Duration::from_millis(1));
    }
    // The index is free again: the next QP gets it and works.
    let q2 = s.qp(qp_type::RC);
    assert_eq!(q2.doorbell, idx, "the lowest free doorbell index");
    let _ = s.fe.query_device();
    good.check(&[&dev]);
}

#[test]
fn vring_addresses_outside_memory_are_refused() {
    let mut good = Good::new("vring");
    let dev = NET.device("vring");
    let mut fe = dev.connect(16 << 20);
    let ctx = fe.context(64);
    let bad = VringConfigData {
        queue_max_size: 64,
        queue_size: 64,
        flags: 0,
        desc_table_addr: 0x10,
        used_ring_addr: 0x20,
        avail_ring_addr: 0x30,
        log_addr: None,
    };
    assert!(
        fe.acked(|c| vhost::VhostBackend::set_vring_addr(c, 0, &bad))
            .is_err(),
        "addresses no region maps"
    );
    // A refused message ends the connection (rust-vmm's daemon stops at
    // an error it reports): the device pauses; the VMM reconnecting with
    // the same memory and queues finds it serving, its context intact.
    fe.reconnect();
    let _ = fe.query_device();
    let _ = fe.pd(&ctx);
    drop(fe);
    let mut s = Endpoint::new(&dev);
    let _ = s.fe.query_port();
    good.check(&[&dev]);
}

#[test]
fn a_memory_table_shrunk_under_a_live_qp_breaks_its_rings() {
    let mut good = Good::new("memtable");
    let dev = NET.device("memtable");
    let ram = Arc::new(Ram::new(0, 64 << 20));
    let fe = Frontend::connect(&dev.socket, ram.clone());
    let mut s = Endpoint::on(fe, dev.gid());
    // The QP's rings far above the first 16 MiB.
    let _ = ram.alloc(24 << 20, PAGE);
    let mut q = s.qp(qp_type::RC);
    assert!(q.sq.base > 16 << 20);
    s.fe.qp_init(&s.ctx, &q, ALL_ACCESS);
    // The VMM maps only the first 16 MiB of the same file now.
    let small = Ram::from_file(ram.file.try_clone().expect("dup"), 0, 16 << 20);
    s.fe.set_mem_table_to(&small).expect("SET_MEM_TABLE");
    q.post_recv(1, &[s.mr.sge(0, 64)]);
    let e = s.fe.wait_event_of(event::QP_FATAL, q.qpn);
    assert_eq!(e.context.get(), s.ctx.handle);
    good.check(&[&dev]);
}

#[test]
fn a_front_end_gone_mid_transfer_leaves_the_daemon_serving() {
    let mut good = Good::new("gone");
    let da = NET.device("gone-a");
    let db = NET.device("gone-b");
    let mut a = Endpoint::new(&da);
    let mut b = Endpoint::new(&db);
    let mut qa = a.qp(qp_type::RC);
    let qb = b.qp(qp_type::RC);
    connect(&mut a, &qa, &mut b, &qb);
    for i in 0..16 {
        qa.post_send(&Wqe::write(
            i,
            &[a.mr.sge(0, 65536)],
            b.mr.addr(0),
            b.mr.rkey,
        ));
    }
    drop(a);
    drop(b);
    // Both daemons serve the next guests (fresh memory: reset first).
    let mut a = Endpoint::new(&da);
    let mut b = Endpoint::new(&db);
    let mut qa = a.qp(qp_type::RC);
    let mut qb = b.qp(qp_type::RC);
    connect(&mut a, &qa, &mut b, &qb);
    send_checked(&mut a, &mut qa, &mut b, &mut qb, 1, 4000);
    good.check(&[&da, &db]);
}

/// A memfd of `len` bytes with the seals given (none: another process
/// holding it can truncate it under the device).
fn memfd(len: u64, seals: nix::fcntl::SealFlag) -> std::fs::File {
    use nix::fcntl::{FcntlArg, fcntl};
    let fd = nix::sys::memfd::memfd_create(
        c"vrdma-virtio-hostile",
        nix::sys::memfd::MFdFlags::MFD_ALLOW_SEALING,
    )
    .expect("memfd_create");
    nix::unistd::ftruncate(&fd, i64::try_from(len).expect("a size")).expect("ftruncate");
    if !seals.is_empty() {
        fcntl(&fd, FcntlArg::F_ADD_SEALS(seals)).expect("F_ADD_SEALS");
    }
    std::fs::File::from(fd)
}

/// After a refused SET_MEM_TABLE, a careless VMM tries to set its queues
/// up anyway: the device refuses them, and serves nothing.
fn serves_nothing(fe: &mut Frontend, dev: &Device) {
    let commands = dev.stats().commands;
    // With no memory table adopted the virtqueues cannot even be set up
    // (their addresses translate to nothing: VHOST_USER_SET_VRING_ADDR is
    // refused), so no kick can reach the device.
    assert!(
        fe.try_start_vrings([0; 4]).is_err(),
        "virtqueues set up in refused memory"
    );
    assert_eq!(dev.stats().commands, commands, "no command carried out");
    assert!(dev.alive(), "the daemon lives");
}

/// Guest memory must be sealed against shrinking and as long as the
/// region it backs (§13.1, architecture: "anything else is refused at
/// SET_MEM_TABLE"): an unsealed memfd, and a sealed one shorter than its
/// region, are refused — the front-end sees the failure, the device
/// serves nothing from them — and the device then serves a guest whose
/// memory is whole, while another pair keeps exchanging.
#[test]
fn guest_memory_not_sealed_or_short_is_refused_at_set_mem_table() {
    use nix::fcntl::SealFlag;
    let mut good = Good::new("unsealed");
    let dev = NET.device("unsealed");
    let size = 16u64 << 20;

    // A memfd that can shrink (sealed against growing only).
    let ram = Arc::new(Ram::from_file(memfd(size, SealFlag::F_SEAL_GROW), 0, size));
    let mut fe = Frontend::negotiated(&dev.socket, ram, Options::default());
    assert!(
        fe.set_mem_table().is_err(),
        "memory not sealed against shrinking accepted"
    );
    serves_nothing(&mut fe, &dev);
    drop(fe);

    // A sealed memfd of 8 MiB announced as a region of 16 MiB.
    let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
    let short = memfd(size / 2, seals);
    let ram = Arc::new(Ram::new(0, size));
    let mut fe = Frontend::negotiated(&dev.socket, ram.clone(), Options::default());
    let region = vhost::VhostUserMemoryRegionInfo {
        guest_phys_addr: 0,
        memory_size: size,
        userspace_addr: ram.region().as_ptr() as u64,
        mmap_offset: 0,
        mmap_handle: std::os::fd::AsRawFd::as_raw_fd(&short),
    };
    assert!(
        fe.acked(|c| vhost::VhostBackend::set_mem_table(c, &[region]))
            .is_err(),
        "a file shorter than its region accepted"
    );
    serves_nothing(&mut fe, &dev);
    drop(fe);

    // The device serves a guest with whole memory.
    let mut s = Endpoint::new(&dev);
    let _ = s.fe.query_device();
    let _ = s.qp(qp_type::RC);
    good.check(&[&dev]);
}

/// A controlq whose available index runs more than the queue's size ahead
/// of what the device took (chains from nowhere, which `virtio-queue`
/// cannot take): the device counts the broken ring and goes on — its
/// thread is not held looking at the ring again and again (it was, until
/// the fuzzer of the virtio-pci transport found it) — and serves the
/// queue again once the driver mends the index.
#[test]
fn an_available_index_from_nowhere_holds_no_thread() {
    let dev = Arc::new(NET.device("avail-nowhere"));
    let mut fe = dev.connect(16 << 20);
    let _ = fe.query_device();
    let bad = dev.backend.bad_chains();
    let (avail, idx) = (fe.control.avail, fe.control.avail_idx);
    fe.ram.store_u16(
        avail + 2,
        idx.wrapping_add(200),
        std::sync::atomic::Ordering::Release,
    );
    fe.control.notify();
    // Asked from another thread: a device whose thread is held never
    // answers.
    let (tx, rx) = std::sync::mpsc::channel();
    let d = dev.clone();
    std::thread::spawn(move || {
        while d.backend.bad_chains() == bad {
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = tx.send(());
    });
    rx.recv_timeout(WAIT)
        .expect("the broken ring is counted, and the device's thread is not held");
    fe.ram
        .store_u16(avail + 2, idx, std::sync::atomic::Ordering::Release);
    let _ = fe.query_device();
}

/// Issue 31: a virtqueue the device cannot use — here a VMM that replaced
/// the memory table with one that no longer holds the controlq's used
/// ring — fails that device (counted, DEVICE_FATAL), not the daemon and
/// not for good: once the driver resets the device and sets its queues up
/// anew, it serves again; a second tenant is served throughout.
#[test]
fn a_virtqueue_the_device_cannot_use_resets_the_device_not_for_good() {
    let mut good = Good::new("vq-broken");
    let dev = NET.device("vq-broken");
    let mut fe = dev.connect(16 << 20);
    let _ = fe.query_device();
    let broken = || {
        dev.backend
            .counters()
            .iter()
            .find(|(k, _)| k == "virtio.broken_queues")
            .map_or(0, |(_, v)| *v)
    };
    assert_eq!(broken(), 0);
    // Memory up to the controlq's used ring only.
    let (base, used) = (fe.ram.base, fe.control.used);
    let vmm = fe.vmm_addr(base);
    let file = fe.ram.file.try_clone().unwrap();
    fe.set_mem_table_of(base, used - base, vmm, &file)
        .expect("a smaller table taken");
    // A command whose response the device cannot use.
    let req = abi::CmdHdr {
        opcode: op::QUERY_DEVICE.into(),
        ..Default::default()
    };
    let at = fe.ram.pages(1);
    fe.ram.write(at, req.as_bytes());
    fe.control
        .add(&[vq::Buf::r(at, 8), vq::Buf::w(at + 512, 1024)]);
    fe.control.notify();
    let limit = std::time::Instant::now() + WAIT;
    while broken() == 0 {
        assert!(
            std::time::Instant::now() < limit,
            "the broken queue counted"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    good.check(&[&dev]);
    // The driver resets the device and starts again: served.
    fe.reset_and_restart();
    let d = fe.query_device();
    assert!(d.max_qp.get() > 0);
    let mut s = Endpoint::on(fe, dev.gid());
    let _ = s.qp(qp_type::RC);
    good.check(&[&dev]);
}

/// Issue 38: a refusal can be seen — a malformed WQE and a refused command
/// are counted by the rule they broke (`virtio.refused.*` in `vrdma stat`)
/// beside the bare totals, and logged (rate-limited).
#[test]
fn refused_wqes_and_commands_are_counted_by_reason() {
    let dev = NET.device("refusal-reasons");
    let db = NET.device("refusal-reasons-b");
    let mut a = Endpoint::new(&dev);
    let mut b = Endpoint::new(&db);
    let mut qa = a.qp(qp_type::UD);
    let mut qb = b.qp(qp_type::UD);
    connect(&mut a, &qa, &mut b, &qb);
    let reason_of = |d: &vrdma_testkit::virtio::Device, k: &str| {
        d.backend
            .counters()
            .iter()
            .find(|(n, _)| n == k)
            .map_or(0, |(_, v)| *v)
    };
    // A receive WQE with more SGEs than its queue takes (4): the QP
    // fails, the WQE is flushed.
    qb.post_recv(7, &[b.mr.sge(0, 8); 5]);
    let c = b.cq.wait(1, "the malformed receive's completion");
    assert_eq!((c[0].wr_id.get(), c[0].status), (7, wc::WR_FLUSH_ERR));
    assert_eq!(
        reason_of(
            &db,
            "virtio.refused.recv_wqe.more_sges_than_the_queue_takes"
        ),
        1
    );
    let reason = |k: &str| {
        dev.backend
            .counters()
            .iter()
            .find(|(n, _)| n == k)
            .map_or(0, |(_, v)| *v)
    };
    let mut bad_av = av(b.gid);
    bad_av.reserved = 1.into();
    qa.post_send(&Wqe::send(5, &[a.mr.sge(0, 8)]).ud(bad_av, qb.qpn, QKEY));
    let c = a.cq.wait(1, "the malformed send's completion");
    assert_eq!((c[0].wr_id.get(), c[0].status), (5, wc::LOC_QP_OP_ERR));
    assert_eq!(
        reason("virtio.refused.send_wqe.an_address_vector_s_reserved_field_0"),
        1
    );
    assert_eq!(reason("virtio.malformed_wqes"), 1);
    // A command on a handle that names nothing.
    let mut attrs = abi::QpAttrs::new_zeroed();
    attrs.qp_state = state::RTS.into();
    assert!(a.fe.modify_qp(&a.ctx, 4242, mask::STATE, &attrs).is_err());
    let refused: u64 = dev
        .backend
        .counters()
        .iter()
        .filter(|(n, _)| n.starts_with("virtio.refused.command."))
        .map(|(_, v)| *v)
        .sum();
    assert!(refused >= 1, "the refused MODIFY_QP counted by its reason");
    // What the guest's driver reads for `rdma statistic` (QUERY_STATS,
    // §6.31): the same refusals, and the data path's packets.
    let stats = |fe: &mut vrdma_testkit::virtio::Frontend| -> Vec<u64> {
        let r: abi::StatsResp = fe.ok(abi::op::QUERY_STATS, 0, &[], &[]);
        r.value.iter().map(|v| v.get()).collect()
    };
    let at = |name: &str| {
        abi::STATS_NAMES
            .iter()
            .position(|n| *n == name)
            .expect(name)
    };
    // A good datagram (a's QP went to ERR with the malformed WQE; a new
    // one sends it), so that the data path's counters move.
    let mut qa2 = a.qp(qp_type::UD);
    a.fe.qp_init(&a.ctx, &qa2, ALL_ACCESS);
    a.fe.qp_rtr(&a.ctx, &qa2, qb.qpn, b.gid);
    a.fe.qp_rts(&a.ctx, &qa2);
    qa2.post_send(&Wqe::send(6, &[a.mr.sge(0, 8)]).ud(av(b.gid), qb.qpn, QKEY));
    let c = a.cq.wait(1, "the good send's completion");
    assert_eq!((c[0].wr_id.get(), c[0].status), (6, wc::SUCCESS));
    let sa = stats(&mut a.fe);
    assert_eq!(sa[at("refused_send_wqes")], 1);
    assert_eq!(sa[at("refused_recv_wqes")], 0);
    assert!(sa[at("refused_commands")] >= 1);
    assert!(sa[at("tx_packets")] >= 1, "{sa:?}");
    assert!(
        sa[abi::STATS_NAMES.len()..].iter().all(|&v| v == 0),
        "reserved slots 0"
    );
    let sb = stats(&mut b.fe);
    assert_eq!(sb[at("refused_recv_wqes")], 1);
    assert_eq!(sb[at("refused_send_wqes")], 0);
}
