//! The virtio-rdma device's life end to end, through the real vhost-user
//! protocol: error completions and asynchronous events on the eventq,
//! completion notification on the notifyq (arming, the arm/complete
//! race), adaptive doorbell polling, 16 384 QPs and CQs on one device,
//! and a front-end that reconnects.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use vrdma_testkit::virtio::{frontend::request, vq::Buf, *};
use vrdma_virtio::abi::{self, cq_header, event, qp_type, wr};
use zerocopy::IntoBytes;

static NET: Net = Net::new(26);

fn pair(name: &str, ty: u8) -> (Device, Device, Endpoint, Endpoint, Qp, Qp) {
    let da = NET.device(&format!("{name}-a"));
    let db = NET.device(&format!("{name}-b"));
    let mut a = Endpoint::new(&da);
    let mut b = Endpoint::new(&db);
    let qa = a.qp(ty);
    let qb = b.qp(ty);
    connect(&mut a, &qa, &mut b, &qb);
    (da, db, a, b, qa, qb)
}

#[test]
fn a_cq_overflow_raises_cq_err_then_qp_fatal() {
    let (_da, _db, mut a, mut b, _qa, mut qb) = pair("overflow", qp_type::RC);
    // A QP of a's on a CQ of 128 entries, connected to a second QP of b's.
    let mut small = a.fe.cq(&a.ctx, 128);
    let spec = QpSpec::new(qp_type::RC, small.handle);
    let mut q = a.fe.qp(&a.ctx, a.pd, &spec);
    let qb2 = b.qp(qp_type::RC);
    connect(&mut a, &q, &mut b, &qb2);
    // 140 signaled WRITEs, never polled: the 129th completion finds the
    // ring full.
    for i in 0..140 {
        q.post_send(&Wqe::write(i, &[a.mr.sge(0, 8)], b.mr.addr(0), b.mr.rkey));
    }
    // CQ_ERR, then QP_FATAL for the QP that used the CQ (DEV-48), both
    // in a's context.
    let evs =
        a.fe.wait_events_in_order(&[(event::CQ_ERR, small.handle), (event::QP_FATAL, q.qpn)]);
    assert!(
        evs.iter().all(|e| e.context.get() == a.ctx.handle),
        "{evs:?}"
    );
    assert_eq!(
        small.producer(),
        128,
        "the ring full, nothing written past it"
    );
    let cs = small.wait(128, "the completions that fitted");
    assert!(cs.iter().all(|c| c.status == wc::SUCCESS));
    assert_eq!(
        a.fe.query_qp(&a.ctx, q.qpn).attrs.qp_state.get(),
        state::ERR
    );
    // The CQ in error takes nothing more.
    small.expect_none(Duration::from_millis(30));
    // The other QPs of the device go on.
    send_checked(&mut b, &mut qb, &mut a, &mut { _qa }, 3, 500);
}

#[test]
fn a_remote_access_error_completes_and_raises_qp_access_err() {
    let (_da, _db, mut a, mut b, mut qa, qb) = pair("remote-access", qp_type::RC);
    // A WRITE past the end of b's MR.
    qa.post_send(&Wqe::write(
        1,
        &[a.mr.sge(0, 64)],
        b.mr.addr(b.mr.len - 8),
        b.mr.rkey,
    ));
    let c = a.cq.wait(1, "the WRITE's completion")[0];
    assert_eq!((c.wr_id.get(), c.status), (1, wc::REM_ACCESS_ERR));
    let e = b.fe.wait_event_of(event::QP_ACCESS_ERR, qb.qpn);
    assert_eq!(e.context.get(), b.ctx.handle);
    assert_eq!(
        a.fe.query_qp(&a.ctx, qa.qpn).attrs.qp_state.get(),
        state::ERR
    );
}

#[test]
fn a_wqe_with_a_bad_opcode_completes_in_error() {
    let (_da, _db, mut a, _b, mut qa, _qb) = pair("bad-opcode", qp_type::RC);
    qa.post_send(&Wqe::new(200, 1));
    qa.post_send(&Wqe::write(2, &[a.mr.sge(0, 8)], 0, 0));
    let cs = a.cq.wait(2, "the bad WQE and the flush after it");
    assert_eq!((cs[0].wr_id.get(), cs[0].status), (1, wc::LOC_QP_OP_ERR));
    assert_eq!((cs[1].wr_id.get(), cs[1].status), (2, wc::WR_FLUSH_ERR));
    assert_eq!(
        a.fe.query_qp(&a.ctx, qa.qpn).attrs.qp_state.get(),
        state::ERR
    );
    assert_eq!(
        a.fe.query_qp(&a.ctx, qa.qpn).attrs.qp_state.get(),
        state::ERR
    );
}

#[test]
fn armed_cqs_notify_on_the_notifyq() {
    let (_da, _db, mut a, mut b, mut qa, mut qb) = pair("arm", qp_type::RC);
    // NEXT: the next completion notifies.
    b.cq.arm(cq_header::ARM_NEXT);
    qb.post_recv(1, &[b.mr.sge(0, 64)]);
    qa.post_send(&Wqe::send(2, &[a.mr.sge(0, 8)]));
    a.cq.expect_ok(wc::SEND, 2);
    let n = b.fe.wait_notification(b.cq.handle);
    assert_eq!(n.context.get(), b.ctx.handle);
    b.cq.expect_ok(wc::RECV, 1);
    // One arm, one notification: another completion brings none.
    qb.post_recv(3, &[b.mr.sge(0, 64)]);
    qa.post_send(&Wqe::send(4, &[a.mr.sge(0, 8)]));
    a.cq.expect_ok(wc::SEND, 4);
    b.cq.expect_ok(wc::RECV, 3);
    // SOLICITED: an unsolicited message does not notify, a solicited one
    // does.
    b.cq.arm(cq_header::ARM_SOLICITED);
    qb.post_recv(5, &[b.mr.sge(0, 64)]);
    qb.post_recv(7, &[b.mr.sge(0, 64)]);
    qa.post_send(&Wqe::send(6, &[a.mr.sge(0, 8)]));
    a.cq.expect_ok(wc::SEND, 6);
    b.cq.expect_ok(wc::RECV, 5);
    qa.post_send(&Wqe::send(8, &[a.mr.sge(0, 8)]).flags(wr::SIGNALED | wr::SOLICITED));
    a.cq.expect_ok(wc::SEND, 8);
    b.fe.wait_notification(b.cq.handle);
    b.cq.expect_ok(wc::RECV, 7);
    b.fe.drain();
    assert!(
        b.fe.notifications.is_empty(),
        "one notification per arm (DEV-43): {:?}",
        b.fe.notifications
    );
}

#[test]
fn an_arm_after_an_unconsumed_completion_notifies_at_once() {
    let (_da, _db, mut a, mut b, mut qa, mut qb) = pair("arm-race", qp_type::RC);
    qb.post_recv(1, &[b.mr.sge(0, 64)]);
    qa.post_send(&Wqe::send(2, &[a.mr.sge(0, 8)]));
    a.cq.expect_ok(wc::SEND, 2);
    // The completion is in b's ring, not consumed; the arm's snapshot is
    // the consumer index before it (§9.2).
    let deadline = Instant::now() + WAIT;
    while b.cq.producer() == b.cq.cons {
        assert!(Instant::now() < deadline, "the receive's completion");
        std::thread::yield_now();
    }
    b.cq.arm(cq_header::ARM_NEXT);
    b.fe.wait_notification(b.cq.handle);
    b.cq.expect_ok(wc::RECV, 1);

    // An arm for solicited completions only, passed by an unsolicited
    // one; then an arm for the next, satisfied at once by that completion
    // (still unconsumed). The first arm merged into the second: a later
    // solicited message brings no second notification (DEV-43).
    b.cq.arm(cq_header::ARM_SOLICITED);
    qb.post_recv(3, &[b.mr.sge(0, 64)]);
    qb.post_recv(5, &[b.mr.sge(0, 64)]);
    qa.post_send(&Wqe::send(4, &[a.mr.sge(0, 8)]));
    a.cq.expect_ok(wc::SEND, 4);
    let deadline = Instant::now() + WAIT;
    while b.cq.producer() == b.cq.cons {
        assert!(Instant::now() < deadline, "the receive's completion");
        std::thread::yield_now();
    }
    b.cq.arm(cq_header::ARM_NEXT);
    b.fe.wait_notification(b.cq.handle);
    b.cq.expect_ok(wc::RECV, 3);
    qa.post_send(&Wqe::send(6, &[a.mr.sge(0, 8)]).flags(wr::SIGNALED | wr::SOLICITED));
    a.cq.expect_ok(wc::SEND, 6);
    b.cq.expect_ok(wc::RECV, 5);
    // Two command round trips: the turn that wrote the completion has
    // delivered its notifications before the second is answered.
    b.fe.query_device();
    b.fe.query_device();
    b.fe.drain();
    assert!(
        b.fe.notifications.is_empty(),
        "one arm, one notification: {:?}",
        b.fe.notifications
    );
}

/// The verbs' event loop — arm (`ibv_req_notify_cq`), wait for the
/// notification (`ibv_get_cq_event`), poll until empty — against a sender
/// of bursts of one to eight messages spaced by a few pseudo-random
/// microseconds, each burst sent only once the last was all received:
/// completions land before an arm's consumer snapshot, between the
/// snapshot and the device's look at the arm word, and after it (issue 35
/// item 3's arm/complete race, the device's side). The last completion of
/// a burst is the one nothing else would wake the receiver for: a device
/// that lost it (a completion before the arm's look, not notified at once)
/// leaves the receiver waiting past the kit's limit: with the device's
/// notify-at-once rule removed this test fails. And each arm brings
/// exactly one notification (DEV-43), however the race went.
#[test]
fn an_arm_racing_its_completions_loses_no_wakeup_and_notifies_once() {
    const N: u64 = 3000;
    let (_da, _db, mut a, mut b, mut qa, mut qb) = pair("arm-stress", qp_type::RC);
    for i in 0..64 {
        qb.post_recv(i, &[b.mr.sge(0, 64)]);
    }
    let received = Arc::new(AtomicU32::new(0));
    let seen = received.clone();
    let sender = std::thread::spawn(move || {
        // xorshift: the same bursts and pauses every run.
        let mut x = 0x9e37_79b9_u32;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        };
        let mut i = 0;
        while i < N {
            let burst = (1 + u64::from(next() % 8)).min(N - i);
            for _ in 0..burst {
                // One in 16 signaled, reaped as they come.
                let w = Wqe::send(i, &[a.mr.sge(0, 8)]);
                let w = if i % 16 == 15 { w } else { w.unsignaled() };
                qa.post_send(&w);
                while a.cq.poll().is_some() {}
                i += 1;
                let pause = Instant::now() + Duration::from_micros(u64::from(next() % 32));
                while Instant::now() < pause {
                    std::hint::spin_loop();
                }
            }
            let deadline = Instant::now() + WAIT;
            while u64::from(seen.load(Ordering::Acquire)) < i {
                assert!(Instant::now() < deadline, "the receiver stopped before {i}");
                std::thread::yield_now();
            }
        }
        (a, qa)
    });
    let (mut got, mut arms) = (0u64, 0u64);
    let mut y = 0x2545_f491_u32;
    while got < N {
        // A driver slow between its last empty poll and its arm (0 to 15
        // µs): the burst's last completion often lands in between, and
        // the arm's snapshot is then behind the producer.
        y ^= y << 13;
        y ^= y >> 17;
        y ^= y << 5;
        let pause = Instant::now() + Duration::from_micros(u64::from(y % 16));
        while Instant::now() < pause {
            std::hint::spin_loop();
        }
        b.cq.arm(cq_header::ARM_NEXT);
        arms += 1;
        // A message is still to come, or came: the notification must.
        let _ = b.fe.wait_notification(b.cq.handle);
        while let Some(c) = b.cq.poll() {
            assert_eq!((c.status, c.opcode), (wc::SUCCESS, wc::RECV), "{c:?}");
            assert_eq!(c.wr_id.get(), got % 64, "in order");
            qb.post_recv(got % 64, &[b.mr.sge(0, 64)]);
            got += 1;
            received.store(got as u32, Ordering::Release);
        }
    }
    let _keep = sender.join().expect("the sender");
    assert_eq!(got, N);
    // Two command round trips: any notification still on its way is in.
    b.fe.query_device();
    b.fe.query_device();
    b.fe.drain();
    assert!(
        b.fe.notifications.is_empty(),
        "{arms} arms, one notification each: more came: {:?}",
        b.fe.notifications
    );
}

/// Receives that wait in the engine for messages (as a kernel's QP1 or
/// any server's QP keep posted) are no work for the device: it stops
/// polling past its spin period all the same, and still takes a message
/// for them.
#[test]
fn an_idle_device_with_receives_posted_stops_polling() {
    let (_da, _db, mut a, mut b, mut qa, mut qb) = pair("adaptive-recvs", qp_type::RC);
    send_checked(&mut a, &mut qa, &mut b, &mut qb, 1, 100);
    for i in 0..8u64 {
        qa.post_recv(300 + i, &[a.mr.sge(4096, 64)]);
        qb.post_recv(400 + i, &[b.mr.sge(4096, 64)]);
    }
    assert!(
        a.ctx.door.wait_poll(0, WAIT),
        "a device whose QP only holds receives stops polling"
    );
    assert!(
        b.ctx.door.wait_poll(0, WAIT),
        "a device whose QP only holds receives stops polling"
    );
    // A post made while the poll word reads 0 kicks, and the kick wakes
    // the device. A kick of one of the receives above may still be on its
    // way when the word first reads 0 (it sets the device spinning again
    // for a spin period), so a post that finds the device polling is let
    // through and the next one tried, three at most.
    let mut kicked = false;
    for i in 0..3u64 {
        assert!(
            a.ctx.door.wait_poll(0, WAIT),
            "the device stops polling again"
        );
        kicked = qa.post_send(&Wqe::send(9 + i, &[a.mr.sge(0, 8)]));
        a.cq.expect_ok(wc::SEND, 9 + i);
        b.cq.expect_ok(wc::RECV, 400 + i);
        if kicked {
            break;
        }
    }
    assert!(
        kicked,
        "poll = 0: the post kicks, and the kick wakes the device"
    );
}

#[test]
fn an_idle_device_stops_polling_and_a_kick_wakes_it() {
    let (_da, _db, mut a, mut b, mut qa, mut qb) = pair("adaptive", qp_type::RC);
    send_checked(&mut a, &mut qa, &mut b, &mut qb, 1, 100);
    // Past the spin period (200 µs) with nothing to do, the device says
    // so in the context's poll word.
    assert!(
        a.ctx.door.wait_poll(0, WAIT),
        "the idle device's poll word reads 0"
    );
    let kicks = a.fe.kicker.kicks.load(std::sync::atomic::Ordering::Relaxed);
    qb.post_recv(7, &[b.mr.sge(4096, 64)]);
    let kicked = qa.post_send(&Wqe::send(8, &[a.mr.sge(0, 8)]));
    assert!(kicked, "poll = 0: the post kicks the doorbellq");
    assert_eq!(
        a.fe.kicker.kicks.load(std::sync::atomic::Ordering::Relaxed),
        kicks + 1
    );
    a.cq.expect_ok(wc::SEND, 8);
    b.cq.expect_ok(wc::RECV, 7);
}

#[test]
fn a_polling_device_takes_posts_without_a_kick() {
    let opts = vrdma_virtio::face::Options {
        poll: true,
        ..Default::default()
    };
    let da = NET.device_with("polling-a", opts, Duration::from_secs(5));
    let db = NET.device("polling-b");
    let mut a = Endpoint::new(&da);
    let mut b = Endpoint::new(&db);
    let mut qa = a.qp(qp_type::RC);
    let mut qb = b.qp(qp_type::RC);
    connect(&mut a, &qa, &mut b, &qb);
    send_checked(&mut a, &mut qa, &mut b, &mut qb, 1, 100);
    // The device polls while work flows (a 5 s window: it never runs out
    // here) — unless its thread was preempted (this suite's tests share
    // the machine's cores): then it stops at once and waits for kicks for
    // a hold-off (vrdma_face::spin). So the poll word reads 1, or the
    // device counted a preemption; and a post kicks only after one.
    let preempted = || counter(&da, "spin.preempted");
    let deadline = Instant::now() + WAIT;
    while !a.ctx.door.wait_poll(1, Duration::from_millis(1)) && preempted() == 0 {
        assert!(
            Instant::now() < deadline,
            "the busy device neither polls nor was preempted"
        );
    }
    for i in 0..20u64 {
        qb.post_recv(100 + i, &[b.mr.sge(4096, 64)]);
        let kicked = qa.post_send(&Wqe::send(200 + i, &[a.mr.sge(0, 8)]));
        assert!(
            !kicked || preempted() > 0,
            "poll = 0 for a device that was never preempted (post {i})"
        );
        a.cq.expect_ok(wc::SEND, 200 + i);
        b.cq.expect_ok(wc::RECV, 100 + i);
    }
    let started = counter(&da, "spin.started");
    assert!(started >= 1, "the device never started polling");
}

/// The switch between polling and sleeping loses no post: devices whose
/// window is 5 µs go back and forth between the two all the time (the
/// driver's pauses straddle the window), and every one of 10 000 sends —
/// rung while the poll word read 1, or kicked when it read 0 — completes.
/// A doorbell rung just before the device stopped polling would otherwise
/// wait for ever (the device re-arms, then looks once more).
#[test]
fn no_post_is_lost_where_the_device_stops_polling() {
    let opts = vrdma_virtio::face::Options {
        poll: true,
        ..Default::default()
    };
    let da = NET.device_with("switch-a", opts.clone(), Duration::from_micros(5));
    let db = NET.device_with("switch-b", opts, Duration::from_micros(5));
    let mut a = Endpoint::new(&da);
    let mut b = Endpoint::new(&db);
    let mut qa = a.qp(qp_type::RC);
    let mut qb = b.qp(qp_type::RC);
    connect(&mut a, &qa, &mut b, &qb);
    let mut kicked = 0;
    for i in 0..10_000u64 {
        qb.post_recv(i, &[b.mr.sge(4096, 64)]);
        // 0 to 12 µs: before, across and after the window's end.
        let until = Instant::now() + Duration::from_micros(i % 13);
        while Instant::now() < until {
            std::hint::spin_loop();
        }
        kicked += u64::from(qa.post_send(&Wqe::send(i, &[a.mr.sge(0, 8)])));
        a.cq.expect_ok(wc::SEND, i);
        b.cq.expect_ok(wc::RECV, i);
    }
    let started = counter(&da, "spin.started");
    assert!(kicked > 0, "no post found the device asleep");
    assert!(started > 1, "the device never went back to polling");
}

/// A counter of `dev`'s (`vrdma stat`'s).
fn counter(dev: &Device, name: &str) -> u64 {
    dev.backend
        .counters()
        .into_iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no counter {name}"))
}

#[test]
fn sixteen_thousand_qps_and_cqs_on_one_device() {
    const N: u32 = 16_384;
    let da = NET.device("scale-a");
    let db = NET.device("scale-b");
    da.backend
        .with_face(|f| f.set_budget(vrdma_device::ObjectBudget::Fixed(1 << 30)));
    let mut fe = da.connect(256 << 20);
    let ctx = fe.context(1 << 16);
    fe.set_gid(&ctx, 0, da.gid()).expect("SET_GID");
    let pd = fe.pd(&ctx);
    let mr = fe.reg_mr(&ctx, pd, 1 << 16, ALL_ACCESS);
    let start = Instant::now();
    let mut last = None;
    for i in 0..N {
        let cq = fe.cq(&ctx, 128);
        let q = fe.qp(&ctx, pd, &QpSpec::small(qp_type::RC, cq.handle));
        if i == N - 1 {
            last = Some((cq, q));
        }
    }
    let made = start.elapsed();
    let (mut cq, mut q) = last.expect("the last QP");
    // The last QP exchanges with a peer on another device.
    let mut b = Endpoint::new(&db);
    let mut qb = b.qp(qp_type::RC);
    let t = Instant::now();
    let mut a = Endpoint {
        fe,
        ctx,
        pd,
        cq: b.fe.cq(&b.ctx, 128), // placeholder: replaced below
        mr,
        gid: da.gid(),
    };
    std::mem::swap(&mut a.cq, &mut cq);
    connect(&mut a, &q, &mut b, &qb);
    send_checked(&mut a, &mut q, &mut b, &mut qb, 5, 2000);
    send_checked(&mut b, &mut qb, &mut a, &mut q, 6, 2000);
    let exchange = t.elapsed();
    let stats = da.stats();
    println!(
        "virtio-rdma scale: {N} QPs and {N} CQs (+1 context, PD, MR) created over vhost-user in {:.2} s ({:.1} µs per object); a SEND each way on the last QP in {:.1} ms; {} commands",
        made.as_secs_f64(),
        made.as_secs_f64() * 1e6 / f64::from(2 * N),
        exchange.as_secs_f64() * 1e3,
        stats.commands
    );
    assert_eq!(stats.refused, 0);
}

#[test]
fn a_front_end_that_reconnects_resumes_and_a_new_memory_resets() {
    let (da, _db, mut a, mut b, mut qa, mut qb) = pair("reconnect", qp_type::RC);
    send_checked(&mut a, &mut qa, &mut b, &mut qb, 1, 3000);
    let resets = da.stats().resets;
    // The same memory file and control queue: the device resumes.
    a.fe.reconnect();
    let q = a.fe.query_qp(&a.ctx, qa.qpn);
    assert_eq!(q.attrs.qp_state.get(), state::RTS, "the QP is still there");
    send_checked(&mut a, &mut qa, &mut b, &mut qb, 2, 3000);
    send_checked(&mut b, &mut qb, &mut a, &mut qa, 3, 3000);
    assert_eq!(da.stats().resets, resets, "no reset on a resume");
    // A write posted while disconnected is taken after the reconnection.
    a.fe.reconnect();
    let d = pattern(4, 1000);
    a.put(0, &d);
    qa.post_send(&Wqe::write(
        9,
        &[a.mr.sge(0, 1000)],
        b.mr.addr(8192),
        b.mr.rkey,
    ));
    a.cq.expect_ok(wc::RDMA_WRITE, 9);
    assert_eq!(b.get(8192, 1000), d);
    // A front-end with fresh memory: the device resets before serving it.
    let ctx = a.ctx.handle;
    drop(a);
    let mut fe = da.connect(16 << 20);
    fe.refused(abi::status::NOENT, abi::op::ALLOC_PD, ctx, &[], &[]);
    assert_eq!(da.stats().resets, resets + 1, "one reset");
    let _ = fe.context(64);
}

/// Event mode on `da` (whose front-end is made with `opts`): a receive
/// posted with its doorbell's bits set is taken on the kick (DEV-39); the
/// area's `poll` word reads 0 throughout, sampled in a thread while a
/// busy exchange runs both ways (DEV-40, §8.6).
fn event_mode(name: &str, da: &Device, opts: Options) {
    let db = NET.device(&format!("{name}-peer"));
    let fe = Frontend::connect_with(&da.socket, Arc::new(Ram::new(0, 64 << 20)), opts);
    assert_eq!(
        fe.features & abi::feature::DOORBELL_POLL,
        0,
        "DOORBELL_POLL not negotiated"
    );
    let mut a = Endpoint::on(fe, da.gid());
    let mut b = Endpoint::new(&db);
    let q = a.qp(qp_type::RC);
    a.fe.qp_init(&a.ctx, &q, ALL_ACCESS);
    let mut rq = q.rq.clone().expect("a receive ring");
    rq.push(&a.fe.ram, &recv_wqe(1, &[a.mr.sge(0, 64)]));
    // The bits set, then the kick (the driver's steps 2-5 of §8.3 with
    // `poll` 0, DRV-22): the device scans (DEV-39). (Whether it takes a
    // post before a kick is not the spec's: it may scan on any turn.)
    q.door.set_bits(q.doorbell);
    assert_eq!(q.door.poll(), 0);
    q.door.kick();
    let deadline = Instant::now() + WAIT;
    while rq.consumer(&a.fe.ram) != 1 {
        assert!(Instant::now() < deadline, "the kick takes the receive");
        std::thread::yield_now();
    }

    // A busy exchange, the poll word watched all along.
    let area = a.ctx.door.area;
    let ram = a.fe.ram.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(AtomicU32::new(0));
    let started = Arc::new(AtomicBool::new(false));
    let (halt, max, up) = (stop.clone(), seen.clone(), started.clone());
    let watcher = std::thread::spawn(move || {
        let mut samples = 0u64;
        while !halt.load(Ordering::Relaxed) {
            max.fetch_max(
                ram.load_acquire(area + abi::doorbell::POLL),
                Ordering::Relaxed,
            );
            samples += 1;
            up.store(true, Ordering::Relaxed);
            std::thread::sleep(Duration::from_micros(20));
        }
        samples
    });
    // The exchange starts once the watcher watches (on a loaded host it
    // could otherwise be over before the watcher first ran).
    let deadline = Instant::now() + WAIT;
    while !started.load(Ordering::Relaxed) {
        assert!(Instant::now() < deadline, "the watcher never ran");
        std::thread::yield_now();
    }
    let mut qa = a.qp(qp_type::RC);
    let mut qb = b.qp(qp_type::RC);
    connect(&mut a, &qa, &mut b, &qb);
    for i in 0..10u8 {
        send_checked(&mut a, &mut qa, &mut b, &mut qb, i, 1000);
        send_checked(&mut b, &mut qb, &mut a, &mut qa, i | 0x80, 1000);
    }
    stop.store(true, Ordering::Relaxed);
    let samples = watcher.join().expect("the watcher");
    assert!(samples > 0);
    assert_eq!(seen.load(Ordering::Relaxed), 0, "poll read 1 in event mode");
    assert_eq!(a.ctx.door.poll(), 0);
}

/// §2.2, §8.6: a device made without polling (`doorbells=event`) does
/// not offer DOORBELL_POLL; it takes posts on kicks and keeps `poll` 0.
#[test]
fn a_device_in_event_mode_takes_posts_on_kicks_and_keeps_poll_0() {
    let opts = vrdma_virtio::face::Options {
        poll: false,
        ..Default::default()
    };
    let da = NET.device_with("event-dev", opts, vrdma_virtio::vhost::DEFAULT_SPIN);
    let fe = da.connect(16 << 20);
    assert_eq!(
        fe.offered & abi::feature::DOORBELL_POLL,
        0,
        "DOORBELL_POLL offered by a device that does not poll"
    );
    drop(fe);
    event_mode("event-dev", &da, Options::default());
}

/// A message longer than a round's budget of packets leaves whole from a
/// device in event mode: a 1 MiB UC SEND at MTU 1024 is 1024 packets, a
/// round sends 256 or 512, and no ACK comes back to wake the sender's
/// worker for the rest — the device turns again while its turn was busy.
#[test]
fn a_uc_send_longer_than_a_round_leaves_whole_in_event_mode() {
    let opts = vrdma_virtio::face::Options {
        poll: false,
        ..Default::default()
    };
    let da = NET.device_with("long-uc-a", opts.clone(), vrdma_virtio::vhost::DEFAULT_SPIN);
    let db = NET.device_with("long-uc-b", opts, vrdma_virtio::vhost::DEFAULT_SPIN);
    let mut a = Endpoint::new(&da);
    let mut b = Endpoint::new(&db);
    let mut qa = a.qp(qp_type::UC);
    let mut qb = b.qp(qp_type::UC);
    connect(&mut a, &qa, &mut b, &qb);
    // The side's MR is 1 MiB: 1 MiB less the page the receive skips.
    const LEN: u32 = (1 << 20) - 4096;
    for i in 0..3u64 {
        let data = vec![0x30 + i as u8; LEN as usize];
        a.put(0, &data);
        qb.post_recv(i, &[b.mr.sge(4096, LEN)]);
        qa.post_send(&Wqe::send(i, &[a.mr.sge(0, LEN)]));
        a.cq.expect_ok(wc::SEND, i);
        let c = b.cq.expect_ok(wc::RECV, i);
        assert_eq!(c.byte_len.get(), LEN);
        assert_eq!(b.get(4096, LEN as usize), data, "the SEND's bytes");
    }
}

/// DEV-40: a polling device whose driver does not accept DOORBELL_POLL
/// keeps `poll` 0 and takes posts on kicks.
#[test]
fn a_driver_without_doorbell_poll_gets_event_mode() {
    let da = NET.device("event-drv");
    let fe = da.connect(16 << 20);
    assert_ne!(fe.offered & abi::feature::DOORBELL_POLL, 0, "offered");
    drop(fe);
    event_mode(
        "event-drv",
        &da,
        Options {
            poll: false,
            ..Default::default()
        },
    );
}

/// §6.31: QUERY_STATS is defined only with VIRTIO_RDMA_F_STATS; a driver
/// that did not accept it is answered ERR_UNSUPPORTED, one that did gets
/// the counters.
#[test]
fn query_stats_needs_its_feature() {
    let da = NET.device("stats-feature");
    let mut fe = Frontend::connect_with(
        &da.socket,
        Arc::new(Ram::new(0, 16 << 20)),
        Options {
            stats: false,
            ..Default::default()
        },
    );
    assert_ne!(fe.offered & abi::feature::STATS, 0, "offered");
    assert_eq!(fe.features & abi::feature::STATS, 0);
    fe.refused(abi::status::UNSUPPORTED, abi::op::QUERY_STATS, 0, &[], &[]);
    drop(fe);
    let mut fe = da.connect(16 << 20);
    assert_ne!(fe.features & abi::feature::STATS, 0);
    let r: abi::StatsResp = fe.ok(abi::op::QUERY_STATS, 0, &[], &[]);
    // Nothing moved but the first driver's refused QUERY_STATS (the
    // refusals are the device's, kept across drivers; the data path's
    // counters are the engine's, new with each reset).
    let v: Vec<u64> = r.value.iter().map(|v| v.get()).collect();
    let refused = abi::STATS_NAMES
        .iter()
        .position(|n| *n == "refused_commands")
        .expect("named");
    for (i, n) in v.iter().enumerate() {
        assert_eq!(*n, u64::from(i == refused), "slot {i}: {v:?}");
    }
    // A body is refused: QUERY_STATS has none.
    fe.refused(abi::status::LENGTH, abi::op::QUERY_STATS, 0, &[0; 8], &[]);
}

/// DEV-1, §13: a driver that sets features without VIRTIO_F_VERSION_1
/// (legacy) is served nothing: a command it posts and kicks stays unused
/// (watched for 300 ms: absence can only be watched for a while), its
/// rings untouched; then a driver that negotiates VERSION_1 on the same
/// device is answered.
#[test]
fn a_driver_without_version_1_is_served_nothing() {
    let da = NET.device("legacy");
    let mut fe = Frontend::connect_with(
        &da.socket,
        Arc::new(Ram::new(0, 16 << 20)),
        Options {
            version_1: false,
            ..Default::default()
        },
    );
    assert_eq!(fe.features & abi::feature::VERSION_1, 0);
    // Datagrams at its port: an unserved device does not read its network
    // either, and packets left there must not wake its worker for good.
    let udp = std::net::UdpSocket::bind((da.addr, 0)).expect("a UDP socket");
    for _ in 0..64 {
        udp.send_to(&[0u8; 64], (da.addr, 4791))
            .expect("a datagram");
    }
    let req = request(abi::op::QUERY_DEVICE, 0, &[], &[]);
    let (at, resp) = (fe.ram.alloc(4096, 4096), fe.ram.alloc(4096, 4096));
    fe.ram.write(at, &req[..]);
    fe.ram.fill(resp, 4096, 0xee);
    fe.control
        .add(&[Buf::r(at, req.len() as u32), Buf::w(resp, 4096)]);
    fe.control.notify();
    fe.kicker.kick();
    let until = Instant::now() + Duration::from_millis(300);
    while Instant::now() < until {
        assert_eq!(fe.control.poll_used(), None, "a legacy driver's command");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(fe.ram.read_bytes(resp, 8), vec![0xee; 8], "nothing written");
    // Its wake-ups in those 300 ms: the kicks and a packet or two, not a
    // worker spinning on an unread socket (hundreds of thousands).
    let woken = counter(&da, "virtio.unversioned_events");
    assert!((1..16).contains(&woken), "{woken} wake-ups");
    drop(fe);
    let mut fe = da.connect(16 << 20);
    assert_ne!(fe.features & abi::feature::VERSION_1, 0);
    assert!(fe.query_device().max_qp.get() >= 16384);
}

/// Virtio 1.2 §2.7.10: a driver without VIRTIO_F_EVENT_IDX that sets
/// VIRTQ_AVAIL_F_NO_INTERRUPT in an available ring gets its buffers used
/// without a notification; with the flag clear, it is notified.
#[test]
fn no_interrupt_is_honoured_without_event_idx() {
    let da = NET.device("no-interrupt");
    let mut fe = Frontend::connect_with(
        &da.socket,
        Arc::new(Ram::new(0, 16 << 20)),
        Options {
            event_idx: false,
            ..Default::default()
        },
    );
    assert_eq!(fe.features & abi::feature::RING_EVENT_IDX, 0);
    // A QUERY_DEVICE on the controlq, its used entry awaited without
    // sleeping on (and so without reading) the call eventfd.
    let query = |fe: &mut Frontend| {
        let req = request(abi::op::QUERY_DEVICE, 0, &[], &[]);
        let (at, resp) = (fe.ram.alloc(4096, 4096), fe.ram.alloc(4096, 4096));
        fe.ram.write(at, &req[..]);
        fe.control
            .add(&[Buf::r(at, req.len() as u32), Buf::w(resp, 4096)]);
        fe.control.notify();
        let deadline = Instant::now() + WAIT;
        while fe.control.poll_used().is_none() {
            assert!(Instant::now() < deadline, "the command's used entry");
            std::thread::yield_now();
        }
    };
    let _ = fe.control.call.read();
    fe.ram
        .store_u16(fe.control.avail, 1, std::sync::atomic::Ordering::SeqCst);
    // Two commands: the device decided on the first one's notification
    // before it took the second.
    query(&mut fe);
    query(&mut fe);
    assert!(
        fe.control.call.read().is_err(),
        "notified despite NO_INTERRUPT"
    );
    fe.ram
        .store_u16(fe.control.avail, 0, std::sync::atomic::Ordering::SeqCst);
    query(&mut fe);
    let deadline = Instant::now() + WAIT;
    while fe.control.call.read().is_err() {
        assert!(
            Instant::now() < deadline,
            "a notification with the flag clear"
        );
        std::thread::yield_now();
    }
}

/// §10.3, DEV-49: with no eventq buffer posted, events past the bound
/// (here 64, the least the spec allows) are dropped and counted; when
/// buffers come, the events queued are delivered in order, then one
/// EVENTS_LOST whose `object` is the number dropped; the count starts
/// again from zero.
#[test]
fn events_past_the_bound_become_one_events_lost() {
    const BOUND: usize = 64;
    const N: usize = BOUND + 6;
    let opts = vrdma_virtio::face::Options {
        max_pending_events: BOUND,
        ..Default::default()
    };
    let da = NET.device_with("events-lost", opts, vrdma_virtio::vhost::DEFAULT_SPIN);
    let fe = Frontend::connect_with(
        &da.socket,
        Arc::new(Ram::new(0, 64 << 20)),
        Options {
            buffers: 0,
            ..Default::default()
        },
    );
    let mut a = Endpoint::on(fe, da.gid());
    let srq = a.fe.srq(&a.ctx, a.pd, 64, 1, 0);
    let mut spec = QpSpec::small(qp_type::RC, a.cq.handle);
    spec.srq = srq.handle;
    // N QPs on the SRQ, each to ERR: one QP_LAST_WQE_REACHED each.
    let mut qpns = Vec::new();
    for _ in 0..N + 1 {
        let q = a.fe.qp(&a.ctx, a.pd, &spec);
        a.fe.qp_init(&a.ctx, &q, ALL_ACCESS);
        qpns.push(q.qpn);
    }
    for &qpn in &qpns[..N] {
        a.fe.qp_state(&a.ctx, qpn, state::ERR).expect("to ERR");
    }
    a.fe.stock(128, 0);
    // What comes: the events queued, in order — port events the device
    // raised before the QPs' (context 0), then the QPs' — and then one
    // EVENTS_LOST with the number dropped.
    let deadline = Instant::now() + WAIT;
    loop {
        a.fe.drain();
        let lost =
            a.fe.events
                .iter()
                .position(|e| e.event_type.get() == event::EVENTS_LOST);
        if lost.is_some() && a.fe.events.len() > BOUND {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no EVENTS_LOST after the queued events within {WAIT:?}: {:?}",
            a.fe.events
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let got: Vec<(u32, u32, u32)> =
        a.fe.events
            .drain(..)
            .map(|e| (e.event_type.get(), e.object.get(), e.context.get()))
            .collect();
    let early = got
        .iter()
        .take_while(|e| matches!(e.0, event::PORT_ACTIVE | event::PORT_ERR) && e.2 == 0)
        .count();
    let kept = BOUND - early;
    let dropped = N - kept;
    let mut want: Vec<(u32, u32, u32)> = got[..early].to_vec();
    want.extend(
        qpns[..kept]
            .iter()
            .map(|&q| (event::QP_LAST_WQE_REACHED, q, a.ctx.handle)),
    );
    want.push((event::EVENTS_LOST, dropped as u32, 0));
    assert_eq!(got, want, "the queued events in order, then EVENTS_LOST");
    assert_eq!(da.stats().events_lost, dropped as u64, "dropped, counted");
    // Counting starts again: the next event comes alone.
    a.fe.qp_state(&a.ctx, qpns[N], state::ERR).expect("to ERR");
    a.fe.wait_event_of(event::QP_LAST_WQE_REACHED, qpns[N]);
    let _ = a.fe.query_device();
    a.fe.drain();
    assert!(a.fe.events.is_empty(), "{:?}", a.fe.events);
}

/// §10.4, DEV-50, DEV-14: a panic inside a device's turn (its transport
/// panics in a receive) fails that device alone: DEVICE_FATAL on its
/// eventq, no object left, every command but QUERY_DEVICE and QUERY_PORT
/// answered ERR_DEVICE — until RESET_DEVICE, after which it serves and
/// exchanges again; another pair exchanges throughout, and the daemon
/// thread lives.
#[test]
fn a_panic_in_a_turn_fails_only_that_device() {
    use vrdma_testkit::tripwire::Tripwire;
    let (_ga, _gb, mut a, mut b, mut qa, mut qb) = pair("panic-good", qp_type::RC);
    let trip = Arc::new(AtomicBool::new(false));
    let t = trip.clone();
    let dev = NET.device_on(
        "panic",
        vrdma_virtio::face::Options::default(),
        vrdma_virtio::vhost::DEFAULT_SPIN,
        move |p| Tripwire::new(p, t),
    );
    let mut s = Endpoint::new(&dev);
    let q = s.qp(qp_type::RC);
    s.fe.qp_init(&s.ctx, &q, ALL_ACCESS);
    send_checked(&mut a, &mut qa, &mut b, &mut qb, 1, 1000);
    // The device's next turn receives, and panics.
    trip.store(true, Ordering::Relaxed);
    let _ = s.fe.query_device();
    let e = s.fe.wait_event_of(event::DEVICE_FATAL, 0);
    assert_eq!(e.context.get(), 0);
    assert!(dev.alive(), "the daemon thread lives");
    let counts = dev.backend.with_face(|f| f.device().engine().counts());
    assert_eq!(counts, vrdma_engine::Counts::default(), "no object left");
    let panics = dev
        .backend
        .counters()
        .into_iter()
        .find(|(k, _)| k == "virtio.panics");
    assert_eq!(panics.map(|p| p.1), Some(1));
    // ERR_DEVICE for all but the queries.
    let _ = s.fe.query_device();
    let _ = s.fe.query_port();
    let dev_err = abi::status::DEVICE;
    s.fe.refused(dev_err, abi::op::ALLOC_PD, s.ctx.handle, &[], &[]);
    s.fe.refused(dev_err, abi::op::DESTROY_CONTEXT, s.ctx.handle, &[], &[]);
    let page = s.fe.ram.pages(1);
    let cc = abi::CreateContextReq {
        doorbell_bits: 64.into(),
        npages: 1.into(),
    };
    s.fe.refused(dev_err, abi::op::CREATE_CONTEXT, 0, cc.as_bytes(), &[page]);
    s.fe.refused(dev_err, 99, 0, &[], &[]);
    // The other pair exchanges.
    send_checked(&mut a, &mut qa, &mut b, &mut qb, 2, 3000);
    send_checked(&mut b, &mut qb, &mut a, &mut qa, 3, 3000);
    // RESET_DEVICE: the device serves a fresh driver and exchanges.
    s.fe.reset_and_restart();
    let mut s = Endpoint::on(s.fe, dev.gid());
    let mut q = s.qp(qp_type::RC);
    let mut qb2 = b.qp(qp_type::RC);
    connect(&mut s, &q, &mut b, &qb2);
    send_checked(&mut s, &mut q, &mut b, &mut qb2, 4, 3000);
    send_checked(&mut b, &mut qb2, &mut s, &mut q, 5, 3000);
}
