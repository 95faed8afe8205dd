//! The engine with many QPs: two engines with N RC QPs each, every QP
//! created and brought up to RTS, connected pairwise, all idle but one
//! pair. For N = 1 … 16 384:
//!
//! - **message rate**: the active QP's 64 B SENDs (batches of 64, one
//!   signaled, moved packet by packet between the engines until both are
//!   quiet, completions checked), per message;
//! - **timer path**: one `poll_timeout` and one `handle_timeout` at a time
//!   before the deadline, with the active QP's retransmit timer armed — the
//!   calls every device round makes.
//!
//! Both must stay flat as N grows: nothing in the data path or the timers
//! scans idle QPs.
//!
//! Run: `cargo bench -p vrdma-engine --bench scale` (about a minute; it
//! prints a Markdown table).

use std::{hint::black_box, time::Instant};
use vrdma_engine::{
    transmit::MAX_PACKET,
    wc::{Wc, WcStatus},
    wr::{Payload, RecvWr, SendFlags, SendOp, SendWr, Sge},
};
use vrdma_testkit::{
    direct::{End, exchange},
    setup::{BASE, Connection, EngineSpec, gid},
};
use vrdma_wire::Qpn;

const BATCH: u64 = 64;
const SIZES: [u32; 5] = [1, 16, 256, 4096, 16_384];

/// Engine `n` with `qps` RC QPs; the first is the active one (64 deep),
/// the rest idle (4 deep), all on one CQ.
fn end(n: u8, qps: u32) -> (End, Vec<Qpn>) {
    let mut end = End::new(&EngineSpec::new(n).cqe(4096).depth(64), n);
    let idle = EngineSpec::new(n).depth(4).qp_init(end.ids.pd, end.ids.cq);
    let mut all = vec![end.ids.qpn];
    for _ in 1..qps {
        all.push(end.engine.create_qp(idle).expect("within max_qp").0);
    }
    (end, all)
}

/// Two engines with `qps` QPs each, QP i of one connected to QP i of the
/// other, all in RTS.
fn pair(qps: u32) -> (End, End) {
    let (mut a, qa) = end(1, qps);
    let (mut b, qb) = end(2, qps);
    let c = Connection::default();
    for (x, y) in qa.iter().zip(&qb) {
        c.join(&mut a.engine, *x, gid(2), *y);
        c.join(&mut b.engine, *y, gid(1), *x);
    }
    (a, b)
}

/// One batch of 64 B SENDs on the active QPs, checked.
fn batch(a: &mut End, b: &mut End, buf: &mut [u8], wcs: &mut Vec<Wc>) {
    for i in 0..BATCH {
        let r = [Sge {
            addr: BASE + 0x8000,
            length: 64,
            lkey: b.ids.lkey,
        }];
        let recv = RecvWr {
            wr_id: i,
            sg_list: &r,
        };
        b.engine.post_recv(b.ids.qpn, &recv).unwrap();
        let s = [Sge {
            addr: BASE,
            length: 64,
            lkey: a.ids.lkey,
        }];
        let flags = if i + 1 == BATCH {
            SendFlags::SIGNALED
        } else {
            SendFlags::default()
        };
        let send = SendWr {
            wr_id: i,
            op: SendOp::Send,
            payload: Payload::Sges(&s),
            flags,
            ud: None,
        };
        a.engine.post_send(a.ids.qpn, &send).unwrap();
    }
    exchange(a, b, buf);
    wcs.clear();
    a.engine.poll_cq(a.ids.cq, 4096, wcs).unwrap();
    assert!(
        wcs.len() == 1 && wcs[0].status == WcStatus::Success,
        "send completions: {wcs:?}"
    );
    wcs.clear();
    b.engine.poll_cq(b.ids.cq, 4096, wcs).unwrap();
    assert!(
        wcs.len() == BATCH as usize && wcs.iter().all(|w| w.status == WcStatus::Success),
        "receive completions: {}",
        wcs.len()
    );
}

/// Times `f` run `iters` times; ns per run.
fn time(iters: u32, mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    start.elapsed().as_nanos() as f64 / f64::from(iters)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    // This machine has slow spells that last seconds: every size runs once
    // per round, the rounds back to back, and each size's figure is the
    // median of its rounds, its ratio the median of the rounds' ratios to
    // one QP.
    const ROUNDS: usize = 5;
    let mut pairs: Vec<(End, End)> = SIZES.iter().map(|&n| pair(n)).collect();
    let mut buf = vec![0u8; MAX_PACKET];
    let mut wcs = Vec::with_capacity(4096);
    // Message rate: ns per 64 B SEND.
    let mut per_msg = vec![Vec::new(); SIZES.len()];
    let mut ratio = vec![Vec::new(); SIZES.len()];
    for _ in 0..ROUNDS {
        let mut round = Vec::new();
        for (a, b) in pairs.iter_mut() {
            batch(a, b, &mut buf, &mut wcs);
            let ns = time(3000, || batch(a, b, &mut buf, &mut wcs)) / BATCH as f64;
            round.push(ns);
        }
        for (i, ns) in round.iter().enumerate() {
            per_msg[i].push(*ns);
            ratio[i].push(round[0] / ns);
        }
    }
    // The timer path: the active QP's retransmit timer armed (one SEND out,
    // never acknowledged); one poll_timeout and one handle_timeout before
    // the deadline per call, as a device's every round makes.
    let mut timer = vec![Vec::new(); SIZES.len()];
    let mut armed = Vec::new();
    for (a, _) in pairs.iter_mut() {
        let s = [Sge {
            addr: BASE,
            length: 64,
            lkey: a.ids.lkey,
        }];
        let send = SendWr {
            wr_id: 0,
            op: SendOp::Send,
            payload: Payload::Sges(&s),
            flags: SendFlags::SIGNALED,
            ud: None,
        };
        a.engine.post_send(a.ids.qpn, &send).unwrap();
        assert!(a.engine.poll_transmit(0, &a.mem, &mut buf).is_some());
        armed.push(a.engine.poll_timeout().expect("the retransmit timer"));
    }
    for _ in 0..ROUNDS {
        for (i, (a, _)) in pairs.iter_mut().enumerate() {
            let due = armed[i];
            let ns = time(2_000_000, || {
                black_box(a.engine.poll_timeout());
                a.engine.handle_timeout(black_box(due - 1));
            });
            timer[i].push(ns);
            assert_eq!(a.engine.poll_timeout(), Some(due), "nothing fired");
        }
    }
    println!("engine with N RC QPs (all in RTS, one active), median of {ROUNDS} rounds");
    println!();
    println!("| QPs | 64 B SEND, ns/message | messages/s | rate vs 1 QP | timer path, ns/call |");
    println!("|---:|---:|---:|---:|---:|");
    for (i, n) in SIZES.iter().enumerate() {
        let ns = median(&mut per_msg[i]);
        println!(
            "| {n} | {ns:.0} | {:.2} M | {:.0} % | {:.1} |",
            1e3 / ns,
            100.0 * median(&mut ratio[i]),
            median(&mut timer[i])
        );
    }
}
