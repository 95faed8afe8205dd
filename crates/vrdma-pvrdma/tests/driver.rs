//! A guest driver, modelled in the test, against a PVRDMA device served
//! over vfio-user: the probe handshake, the kernel's objects (PD, DMA MR,
//! CQ, RC QP), data both ways between two devices, CQ notifications, and a
//! device reset.

use vrdma_pvrdma::abi::{self, send_flags, wc_opcode, wr_opcode};
use vrdma_testkit::pvrdma::{Endpoint, Net, connect, hdr, rc_up, sge, udp_function, wqe};

/// This binary's block of addresses (see `vrdma_testkit::pvrdma`).
static NET: Net = Net::new(20);

#[test]
fn two_guests_exchange_sends_writes_reads_and_atomics() {
    let (_da, _db, mut a, mut b) = NET.pair("drv");

    // SEND 4 KiB, A to B, through the kernel's DMA MR (bus addresses).
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 1) as u8).collect();
    a.g.put(a.buf, &data);
    b.g.post_recv(&mut b.qp, 77, &[sge(b.buf, 4096, b.lkey)]);
    a.g.post_send(
        &mut a.qp,
        &wqe(1, wr_opcode::SEND, send_flags::SIGNALED, 1),
        &[sge(a.buf, 4096, a.lkey)],
    );
    let sent = a.g.poll_n(&mut a.cq, 1);
    assert_eq!(sent.len(), 1);
    assert_eq!((sent[0].wr_id.get(), sent[0].status.get()), (1, 0));
    assert_eq!(sent[0].opcode.get(), wc_opcode::SEND);
    assert_eq!(sent[0].qp.get(), u64::from(a.qp.handle));
    let got = b.g.poll_n(&mut b.cq, 1);
    assert_eq!(got.len(), 1);
    let w = got[0];
    assert_eq!(
        (w.wr_id.get(), w.status.get(), w.opcode.get()),
        (77, 0, wc_opcode::RECV)
    );
    assert_eq!(w.byte_len.get(), 4096);
    assert_eq!(b.g.get(b.buf, 4096), data);
    // The ring slots came back as the engine retired the WQEs.
    assert_eq!(a.g.sq_cons(&a.qp), 1);

    // WRITE into B's user MR, READ it back, FETCH_ADD on it.
    let va = 0x7f00_0000_0000u64;
    let mpage = b.g.alloc(2);
    let (_, _, rkey) = b.g.user_mr(b.pd, va, &[mpage, mpage + 4096], 1 | 2 | 4 | 8);
    let mut w = wqe(2, wr_opcode::RDMA_WRITE, send_flags::SIGNALED, 1);
    w.wr[0] = (va + 100).into();
    w.wr[1] = u64::from(rkey).into();
    a.g.put(a.buf, b"written by A");
    a.g.post_send(&mut a.qp, &w, &[sge(a.buf, 12, a.lkey)]);
    let done = a.g.poll_n(&mut a.cq, 1);
    assert_eq!((done[0].wr_id.get(), done[0].status.get()), (2, 0));
    assert_eq!(b.g.get(mpage + 100, 12), b"written by A");

    let mut r = wqe(3, wr_opcode::RDMA_READ, send_flags::SIGNALED, 1);
    r.wr[0] = (va + 100).into();
    r.wr[1] = u64::from(rkey).into();
    a.g.post_send(&mut a.qp, &r, &[sge(a.buf + 8192, 12, a.lkey)]);
    let done = a.g.poll_n(&mut a.cq, 1);
    assert_eq!((done[0].wr_id.get(), done[0].status.get()), (3, 0));
    assert_eq!(done[0].opcode.get(), wc_opcode::RDMA_READ);
    assert_eq!(a.g.get(a.buf + 8192, 12), b"written by A");

    b.g.put(mpage + 4096, &41u64.to_le_bytes());
    let mut f = wqe(4, wr_opcode::ATOMIC_FETCH_AND_ADD, send_flags::SIGNALED, 1);
    f.wr[0] = (va + 4096).into();
    f.wr[1] = 1u64.into();
    f.wr[3] = u64::from(rkey).into();
    a.g.post_send(&mut a.qp, &f, &[sge(a.buf + 12288, 8, a.lkey)]);
    let done = a.g.poll_n(&mut a.cq, 1);
    assert_eq!((done[0].wr_id.get(), done[0].status.get()), (4, 0));
    assert_eq!(done[0].opcode.get(), wc_opcode::FETCH_ADD);
    assert_eq!(a.g.get(a.buf + 12288, 8), 41u64.to_le_bytes());
    assert_eq!(b.g.get(mpage + 4096, 8), 42u64.to_le_bytes());
}

#[test]
fn an_armed_cq_notifies_once_through_its_ring_and_vector_2() {
    let (_da, _db, mut a, mut b) = NET.pair("notify");
    b.g.arm(&b.cq, 0, false);
    for i in 0..2 {
        b.g.post_recv(&mut b.qp, 10 + i, &[sge(b.buf, 64, b.lkey)]);
    }
    for i in 0..2 {
        a.g.post_send(
            &mut a.qp,
            &wqe(i, wr_opcode::SEND, send_flags::SIGNALED, 1),
            &[sge(a.buf, 64, a.lkey)],
        );
    }
    assert!(b.g.wait_irq(2), "CQ interrupt");
    assert_eq!(b.g.poll_n(&mut b.cq, 2).len(), 2);
    // One notification for the arm, not one per completion.
    assert_eq!(b.g.notifications(), vec![b.cq.handle]);
    assert!(!b.g.irq_fired(2));
}

#[test]
fn a_device_reset_forgets_everything_the_guest_made() {
    let d = NET.device("reset");
    let mut a = Endpoint::new(&d);
    a.g.write32(1, abi::reg::CTL, abi::reg::CTL_RESET);
    assert_eq!(a.g.read32(1, abi::reg::ERR), 0);
    // No shared region: a command is refused without reading the slot.
    let r = a.g.command(&hdr(abi::cmd::CREATE_PD));
    assert!(r.is_err());
    // A new probe starts from nothing: handles are handed out afresh.
    assert_eq!(a.g.probe(), 0);
    let pd = a.g.create_pd(0);
    assert_eq!(pd, a.pd, "the first PD's handle again");
}

/// The mode with no exit per post (`share_doorbells`): BAR2 is memory the
/// client maps. A post whose doorbell was never written is taken all the
/// same (by the sweep, and counted), one rung is taken for its doorbell; a CQ arm stored
/// there and overwritten by a POLL before the device read it (the
/// provider's arm-then-poll) still gets its notification; a trapped
/// device beside it works as before.
#[test]
fn shared_doorbells_take_posts_without_an_exit_and_lose_no_arm() {
    let da = NET.device_with(
        "shared-a",
        vrdma_vfio_user::Config::default(),
        |addr, mac| {
            let mut f = udp_function(addr, mac);
            f.share_doorbells().unwrap();
            f
        },
    );
    let db = NET.device("shared-b");
    let mut a = Endpoint::new(&da);
    let mut b = Endpoint::new(&db);
    assert!(
        b.g.map_doorbells(0x8000_0000).is_none(),
        "B traps its doorbells"
    );
    let bells = a.g.map_doorbells(0x8000_0000).expect("A's are shared");
    connect(&mut a, &mut b);
    for i in 0..4 {
        b.g.post_recv(&mut b.qp, 20 + i, &[sge(b.buf, 64, b.lkey)]);
    }
    let doorbells = da.stats().doorbells;
    // Written into the ring, no doorbell: taken, sent, completed.
    a.g.write_send(
        &mut a.qp,
        &wqe(1, wr_opcode::SEND, send_flags::SIGNALED, 1),
        &[sge(a.buf, 64, a.lkey)],
    );
    assert_eq!(b.g.poll_n(&mut b.cq, 1).len(), 1);
    assert_eq!(da.stats().doorbells, doorbells, "no doorbell rang");
    assert_eq!(da.stats().sweep_found, 1, "the sweep found it");
    let done = a.g.poll_n(&mut a.cq, 1);
    assert_eq!((done[0].wr_id.get(), done[0].status.get()), (1, 0));
    // Rung as the driver rings it (its store lands in the page): the
    // device reads the word and takes what it names.
    use vm_memory::Bytes;
    let doorbells = da.stats().doorbells;
    a.g.write_send(
        &mut a.qp,
        &wqe(9, wr_opcode::SEND, send_flags::SIGNALED, 1),
        &[sge(a.buf, 64, a.lkey)],
    );
    bells
        .write_obj(
            a.qp.handle | abi::uar::QP_SEND,
            vm_memory::GuestAddress(0x8000_0000),
        )
        .unwrap();
    assert_eq!(b.g.poll_n(&mut b.cq, 1).len(), 1);
    assert_eq!(a.g.poll_n(&mut a.cq, 1)[0].wr_id.get(), 9);
    assert_eq!(da.stats().doorbells, doorbells + 1, "the doorbell read");
    // ARM, then POLL over it before the device could look: the arm holds.
    let word = vm_memory::GuestAddress(0x8000_0000 + 4);
    bells
        .write_obj(a.cq.handle | abi::uar::CQ_ARM, word)
        .unwrap();
    bells
        .write_obj(a.cq.handle | abi::uar::CQ_POLL, word)
        .unwrap();
    // The device takes the word (swaps it to 0) before the completion
    // comes: a notification is for a completion after the arm.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while bells.read_obj::<u32>(word).unwrap() != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the device read its doorbells"
        );
        std::thread::yield_now();
    }
    a.g.write_send(
        &mut a.qp,
        &wqe(2, wr_opcode::SEND, send_flags::SIGNALED, 1),
        &[sge(a.buf, 64, a.lkey)],
    );
    assert!(a.g.wait_irq(2), "CQ interrupt");
    assert_eq!(a.g.notifications(), vec![a.cq.handle]);
    assert_eq!(a.g.poll_n(&mut a.cq, 1)[0].wr_id.get(), 2);
    assert_eq!(b.g.poll_n(&mut b.cq, 1).len(), 1);
    // Not armed again: the next completion notifies nothing.
    a.g.write_send(
        &mut a.qp,
        &wqe(3, wr_opcode::SEND, send_flags::SIGNALED, 1),
        &[sge(a.buf, 64, a.lkey)],
    );
    assert_eq!(a.g.poll_n(&mut a.cq, 1)[0].wr_id.get(), 3);
    assert!(!a.g.irq_fired(2));
    assert!(a.g.notifications().is_empty());
}

/// A slot is the guest's again as soon as the device copied its WQE, not
/// when the engine retires it: perftest's latency tests post into a
/// one-slot ring the moment they poll the completion of the last post,
/// and found it full while the consumer index trailed the completion.
#[test]
fn a_slot_comes_back_when_its_wqe_is_taken() {
    let da = NET.device("slot-a");
    let db = NET.device("slot-b");
    let mut a = Endpoint::new(&da);
    let mut b = Endpoint::new(&db);
    let mut qa =
        a.g.create_qp(abi::qp_type::RC, a.pd, a.cq.handle, a.cq.handle, 1);
    let mut qb =
        b.g.create_qp(abi::qp_type::RC, b.pd, b.cq.handle, b.cq.handle, 1);
    rc_up(&mut a.g, &qa, b.gid, qb.qpn, b.mac);
    rc_up(&mut b.g, &qb, a.gid, qa.qpn, a.mac);
    for i in 0..20u64 {
        b.g.post_recv(&mut qb, i, &[sge(b.buf, 64, b.lkey)]);
        assert_eq!(
            b.g.rq_cons(&qb),
            (i as u32 + 1) & 1,
            "the receive slot is back"
        );
        a.g.post_send(
            &mut qa,
            &wqe(i, wr_opcode::SEND, send_flags::SIGNALED, 1),
            &[sge(a.buf, 64, a.lkey)],
        );
        // The doorbell's reply comes after the device took the WQE, before
        // the peer could have acknowledged it.
        assert_eq!(
            a.g.sq_cons(&qa),
            (i as u32 + 1) & 1,
            "the send slot is back"
        );
        let done = a.g.poll_n(&mut a.cq, 1);
        assert_eq!((done[0].wr_id.get(), done[0].status.get()), (i, 0));
        assert_eq!(b.g.poll_n(&mut b.cq, 1)[0].wr_id.get(), i);
    }
}

/// The ACK of a message whose completion the guest has read goes out
/// before the guest's next command acts: ibv_rc_pingpong's client reads
/// its last receive and destroys its QP at once; a device that took the
/// DESTROY_QP in the turn that received the message, before sending that
/// turn's answers, lost the ACK, and the peer (rxe, whose retry_cnt 7 is
/// infinite) resent its last SEND for ever.
#[test]
fn a_destroy_qp_does_not_take_the_ack_of_a_message_just_received() {
    let (da, db, mut a, mut b) = NET.pair("ack");
    b.g.post_recv(&mut b.qp, 5, &[sge(b.buf, 64, b.lkey)]);

    // B stops between turns; A's SEND reaches B's socket, and so does B's
    // DESTROY_QP (the slot filled, the REQUEST write sent, not yet taken).
    db.pause();
    let sent = da.counter_when("engine.tx_packets", |_| true);
    a.g.post_send(
        &mut a.qp,
        &wqe(9, wr_opcode::SEND, send_flags::SIGNALED, 1),
        &[sge(a.buf, 64, a.lkey)],
    );
    assert_eq!(
        da.counter_when("engine.tx_packets", |n| n > sent),
        sent + 1,
        "A sent its SEND"
    );
    // (sent is not yet queued at B when the kernel defers loopback's
    // receive to ksoftirqd: wait for it in B's socket)
    let b_addr = std::net::SocketAddr::new(db.addr, 4791);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while udp_rx_queue(b_addr) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "A's SEND never reached B's socket"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let slot = {
        let req = abi::Handle {
            hdr: hdr(abi::cmd::DESTROY_QP),
            handle: b.qp.handle.into(),
            reserved: [0; 4],
        };
        let mut s = vec![0u8; abi::MAX_REQUEST];
        s[..std::mem::size_of::<abi::Handle>()]
            .copy_from_slice(zerocopy::IntoBytes::as_bytes(&req));
        s
    };
    b.g.put(b.g.cmd_slot, &slot);
    b.g.start_write32(1, abi::reg::REQUEST, 0);
    // One turn takes both: the SEND (its completion written) and then the
    // command (the counters are B's as of its last turn).
    let rx = db.counter_when("engine.rx_packets", |_| true);
    let commands = db.counter_when("pvrdma.commands", |_| true);
    db.step();
    assert!(
        db.counter_when("engine.rx_packets", |_| true) > rx,
        "the turn received the SEND"
    );
    assert_eq!(
        db.counter_when("pvrdma.commands", |_| true),
        commands + 1,
        "the turn ran the command"
    );
    db.resume();
    b.g.finish_write();
    assert_eq!(b.g.read32(1, abi::reg::ERR), 0, "DESTROY_QP");
    let got = b.g.poll_n(&mut b.cq, 1);
    assert_eq!(
        (got.len(), got[0].wr_id.get(), got[0].status.get()),
        (1, 5, 0)
    );

    // A's SEND is acknowledged (its retries would go to a QP that is gone,
    // and end in RETRY_EXC_ERR).
    let done = a.g.poll_n(&mut a.cq, 1);
    assert_eq!(done.len(), 1, "A's SEND completed");
    assert_eq!((done[0].wr_id.get(), done[0].status.get()), (9, 0));
}

/// The bytes waiting in the receive queue of the UDP socket bound to `at`
/// (IPv4), from /proc/net/udp (addresses in the kernel's byte order, hex).
fn udp_rx_queue(at: std::net::SocketAddr) -> u64 {
    let std::net::SocketAddr::V4(v4) = at else {
        panic!("IPv4 only");
    };
    let want = format!(
        "{:08X}:{:04X}",
        u32::from_ne_bytes(v4.ip().octets()),
        v4.port()
    );
    std::fs::read_to_string("/proc/net/udp")
        .unwrap()
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(1) == Some(&want.as_str())).then(|| {
                let rx = f[4].split(':').nth(1).unwrap_or("0");
                u64::from_str_radix(rx, 16).unwrap_or(0)
            })
        })
        .sum()
}

/// The default device takes the queues middleware asks for with its own
/// defaults: UCX's UD QPs have 4 096-entry receive queues (at 1 024, the
/// default of old, the device refused them and UCX failed every test).
#[test]
fn queues_as_deep_as_middleware_asks_are_made_on_the_default_device() {
    let (_da, _db, mut a, _b) = NET.pair("deep");
    let qp =
        a.g.create_qp(abi::qp_type::UD, a.pd, a.cq.handle, a.cq.handle, 4096);
    assert_ne!(qp.qpn, 0);
}
