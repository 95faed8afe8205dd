//! RC's edge cases on the simulator, each set up with packets lost on
//! purpose: a PSN wrap inside a message, a READ whose responses partly
//! arrived, a duplicate atomic, RNR forever, partitions; and UC and UD,
//! which do not recover.

use vrdma_engine::{
    AhHandle, Memory,
    qp::{AhAttr, QpState, QpType},
    wc::{Wc, WcOpcode, WcStatus},
    wr::{Payload, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest},
};
use vrdma_testkit::{
    setup::{self, BASE, Connection, Ids},
    sim::{DropRule, EventKind, Link, Quiet, Sim},
};
use vrdma_wire::{Psn, QKey};
const MEM: u64 = 1 << 20;
/// Each side's layout: sources at 0, targets at TARGET, atomics at WORD.
const TARGET: u64 = 512 * 1024;
const WORD: u64 = 1024 * 1024 - 64;

const A: usize = 0;
const B: usize = 1;

/// Opcodes as they appear in the trace.
const RC_READ_REQUEST: u8 = 0x0c;
const RC_READ_RESPONSE_FIRST: u8 = 0x0d;
const RC_READ_RESPONSE_LAST: u8 = 0x0f;
const RC_READ_RESPONSE_ONLY: u8 = 0x10;
const RC_ATOMIC_ACK: u8 = 0x12;

#[derive(Clone, Copy)]
struct Setup {
    qp_type: QpType,
    psn: u32,
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    min_rnr_timer: u8,
    link: Link,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            qp_type: QpType::Rc,
            psn: 0x1000,
            timeout: 4,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
            link: Link::PERFECT,
        }
    }
}

struct Pair {
    sim: Sim,
    ends: [Ids; 2],
    qp_type: QpType,
    /// A's address handle for B (UD).
    ah: AhHandle,
}

fn pair(s: Setup) -> Pair {
    // 25 Gb/s ports.
    let mut sim = Sim::new(7, s.link, Some(25_000_000_000 / 8));
    let ends = [A, B].map(|n| {
        let (mut e, mut mem, ids) = setup::EngineSpec::new(n as u8 + 1)
            .mem(MEM as usize)
            .depth(16)
            .qp_type(s.qp_type)
            .build();
        let pattern: Vec<u8> = (0..TARGET).map(|i| (i * 7 + n as u64 * 13) as u8).collect();
        mem.write(BASE, &pattern).unwrap();
        if n == A {
            // The first AH of a fresh engine: handle 1.
            let ah = e
                .create_ah(
                    ids.pd,
                    AhAttr {
                        dgid: setup::gid(B as u8 + 1),
                        port_num: 1,
                        hop_limit: 64,
                        ..AhAttr::default()
                    },
                )
                .unwrap();
            assert_eq!(ah, AhHandle(1));
        }
        let node = sim.add(e, mem, ids.gid);
        Ids { node, ..ids }
    });
    let ah = AhHandle(1);
    let rc = s.qp_type == QpType::Rc;
    let c = Connection {
        psn: Psn::from_masked(s.psn),
        timeout: if rc { s.timeout } else { 0 },
        retry_cnt: if rc { s.retry_cnt } else { 0 },
        rnr_retry: if rc { s.rnr_retry } else { 0 },
        min_rnr_timer: if rc { s.min_rnr_timer } else { 0 },
        max_rd_atomic: if rc { 4 } else { 0 },
        max_dest_rd_atomic: if rc { 4 } else { 0 },
        ..Connection::default()
    };
    c.pair_in_sim(&mut sim, ends[A], ends[B]);
    // Each engine starts with a port-active event; nothing else is
    // expected.
    for n in [A, B] {
        while sim.poll_event(n).is_some() {}
    }
    Pair {
        sim,
        ends,
        qp_type: s.qp_type,
        ah,
    }
}

impl Pair {
    fn post(&mut self, wr_id: u64, op: SendOp, at: u64, len: u32) {
        let e = self.ends[A];
        let sge = [Sge {
            addr: BASE + at,
            length: len,
            lkey: e.lkey,
        }];
        let ud = (self.qp_type == QpType::Ud).then_some(UdDest {
            av: vrdma_engine::wr::Av::Handle(self.ah),
            remote_qpn: self.ends[B].qpn,
            remote_qkey: QKey(0x1111_1111),
        });
        self.sim
            .node_mut(A)
            .engine
            .post_send(
                e.qpn,
                &SendWr {
                    wr_id,
                    op,
                    payload: Payload::Sges(&sge),
                    flags: SendFlags::SIGNALED,
                    ud,
                },
            )
            .unwrap();
    }

    fn post_recv(&mut self, wr_id: u64, at: u64, len: u32) {
        let e = self.ends[B];
        let sge = [Sge {
            addr: BASE + at,
            length: len,
            lkey: e.lkey,
        }];
        self.sim
            .node_mut(B)
            .engine
            .post_recv(
                e.qpn,
                &RecvWr {
                    wr_id,
                    sg_list: &sge,
                },
            )
            .unwrap();
    }

    fn write_op(&self, at: u64) -> SendOp {
        SendOp::RdmaWrite {
            remote_addr: BASE + at,
            rkey: self.ends[B].rkey,
        }
    }

    fn read_op(&self, at: u64) -> SendOp {
        SendOp::RdmaRead {
            remote_addr: BASE + at,
            rkey: self.ends[B].rkey,
        }
    }

    /// Runs until nothing is pending (or `limit` ns of simulated time).
    fn settle(&mut self, limit: u64) -> Quiet {
        let deadline = self.sim.now() + limit;
        self.sim.run_until(deadline)
    }

    fn poll(&mut self, n: usize) -> Vec<Wc> {
        let mut out = Vec::new();
        self.sim
            .poll_cq(n, self.ends[n].cq, usize::MAX, &mut out)
            .unwrap();
        out
    }

    fn bytes(&self, n: usize, at: u64, len: u64) -> Vec<u8> {
        let mut v = vec![0; len as usize];
        self.sim.node(n).mem.read(BASE + at, &mut v).unwrap();
        v
    }

    fn state(&self, n: usize) -> QpState {
        self.sim
            .node(n)
            .engine
            .query_qp(self.ends[n].qpn)
            .unwrap()
            .0
            .qp_state
    }

    /// Packets `from` sent with `opcode`, as (PSN) in sending order, from
    /// the trace's recent events.
    fn sent(&self, from: usize, opcodes: &[u8]) -> Vec<u32> {
        self.sim
            .recent()
            .filter_map(|e| match e.kind {
                EventKind::Sent {
                    from: f,
                    opcode,
                    psn,
                    ..
                } if f == from && opcodes.contains(&opcode) => Some(psn),
                _ => None,
            })
            .collect()
    }
}

fn only_success(wcs: &[Wc], wr_id: u64, opcode: WcOpcode, len: u32) {
    assert_eq!(wcs.len(), 1, "{wcs:?}");
    let w = &wcs[0];
    assert_eq!(
        (w.wr_id, w.status, w.opcode, w.byte_len),
        (wr_id, WcStatus::Success, opcode, len),
        "{w:?}"
    );
}

// ---- PSN wrap ---------------------------------------------------------

/// An 8-packet message starting four PSNs before the 2^24 wrap, with the
/// packets on either side of the wrap lost once each: go-back-N across the
/// wrap, then every byte in place and one completion on each side.
#[test]
fn psn_wrap_in_the_middle_of_a_multi_packet_message_with_losses() {
    const LEN: u32 = 8 * 1024;
    for kind in ["send", "write", "read"] {
        let mut p = pair(Setup {
            psn: 0x00ff_fffc,
            ..Setup::default()
        });
        // Requests go A→B; a READ's data comes back B→A.
        let (from, to) = if kind == "read" { (B, A) } else { (A, B) };
        for psn in [0x00ff_ffff, 0] {
            p.sim.drop_packets(DropRule {
                from,
                to,
                opcode: None,
                psn: Some(psn),
                count: 1,
            });
        }
        match kind {
            "send" => {
                p.post_recv(1, TARGET, LEN);
                p.post(2, SendOp::Send, 0, LEN);
            }
            "write" => p.post(2, p.write_op(TARGET), 0, LEN),
            _ => p.post(2, p.read_op(0), TARGET, LEN),
        }
        assert_eq!(p.settle(1_000_000_000), Quiet::Idle, "{kind}");
        let opcode = match kind {
            "send" => WcOpcode::Send,
            "write" => WcOpcode::RdmaWrite,
            _ => WcOpcode::RdmaRead,
        };
        only_success(&p.poll(A), 2, opcode, LEN);
        let recv = p.poll(B);
        if kind == "send" {
            only_success(&recv, 1, WcOpcode::Recv, LEN);
        } else {
            assert!(recv.is_empty(), "{kind}: {recv:?}");
        }
        // The source's bytes are at the target, on the other side.
        let (src, dst) = if kind == "read" { (B, A) } else { (A, B) };
        assert_eq!(
            p.bytes(dst, TARGET, u64::from(LEN)),
            p.bytes(src, 0, u64::from(LEN)),
            "{kind}"
        );
        // Both drops happened, and both sides moved past the wrap.
        assert_eq!(p.sim.stats().lost, 2, "{kind}");
        let (sq, _) = p.sim.node(A).engine.qp_psns(p.ends[A].qpn).unwrap();
        assert_eq!(sq, Psn::from_masked(4), "{kind}: A's next PSN");
        let (_, rq) = p.sim.node(B).engine.qp_psns(p.ends[B].qpn).unwrap();
        assert_eq!(rq, Psn::from_masked(4), "{kind}: B's expected PSN");
        assert_eq!((p.state(A), p.state(B)), (QpState::Rts, QpState::Rts));
    }
}

// ---- READ retransmission -----------------------------------------------

/// An 8-packet READ whose fourth response is lost: the fifth is an implied
/// NAK, the requester asks again for the rest only (from the fourth), the
/// responder serves those five from its resources, and the data is whole.
#[test]
fn a_read_whose_responses_partly_arrived_is_asked_again_for_the_rest() {
    const LEN: u32 = 8 * 1024;
    let mut p = pair(Setup::default());
    p.sim.drop_packets(DropRule {
        from: B,
        to: A,
        opcode: None,
        psn: Some(0x1003),
        count: 1,
    });
    p.post(1, p.read_op(0), TARGET, LEN);
    assert_eq!(p.settle(1_000_000_000), Quiet::Idle);
    only_success(&p.poll(A), 1, WcOpcode::RdmaRead, LEN);
    assert_eq!(p.bytes(A, TARGET, 8192), p.bytes(B, 0, 8192));
    // The request, then the request for the rest.
    assert_eq!(p.sent(A, &[RC_READ_REQUEST]), [0x1000, 0x1003]);
    // Eight responses, then the five from the lost one on.
    let responses = p.sent(
        B,
        &(RC_READ_RESPONSE_FIRST..=RC_READ_RESPONSE_ONLY).collect::<Vec<_>>(),
    );
    let want: Vec<u32> = (0x1000..0x1008).chain(0x1003..0x1008).collect();
    assert_eq!(responses, want);
    let last = p.sent(B, &[RC_READ_RESPONSE_LAST]);
    assert_eq!(last, [0x1007, 0x1007]);
    let stats = p.sim.node(A).engine.stats();
    assert_eq!((stats.retry_implied_nak, stats.retry_timeout), (1, 0));
}

// ---- duplicate atomics -------------------------------------------------

/// The atomic acknowledgement is lost: the requester times out and asks
/// again (twice, see the requester), and the responder answers from the
/// saved result: the word is added to once, the original value returned.
#[test]
fn a_duplicate_atomic_is_answered_from_the_saved_result() {
    let mut p = pair(Setup::default());
    p.sim
        .node_mut(B)
        .mem
        .write(BASE + WORD, &40u64.to_le_bytes())
        .unwrap();
    p.sim.drop_packets(DropRule {
        from: B,
        to: A,
        opcode: Some(RC_ATOMIC_ACK),
        psn: None,
        count: 1,
    });
    let op = SendOp::FetchAdd {
        remote_addr: BASE + WORD,
        rkey: p.ends[B].rkey,
        add: 2,
    };
    p.post(1, op, TARGET, 8);
    assert_eq!(p.settle(1_000_000_000), Quiet::Idle);
    only_success(&p.poll(A), 1, WcOpcode::FetchAdd, 8);
    assert_eq!(p.bytes(B, WORD, 8), 42u64.to_le_bytes(), "added once");
    assert_eq!(p.bytes(A, TARGET, 8), 40u64.to_le_bytes(), "the original");
    assert_eq!(p.sim.node(A).engine.stats().retry_timeout, 1);
    assert!(p.sim.node(B).engine.stats().rx_duplicate >= 1);
}

/// Every atomic request is duplicated by the network: each COMPARE_AND_SWAP
/// and FETCH_AND_ADD still executes exactly once.
#[test]
fn atomics_duplicated_by_the_network_execute_once() {
    let mut p = pair(Setup {
        link: Link {
            duplicate: 1.0,
            ..Link::PERFECT
        },
        ..Setup::default()
    });
    for i in 0..20u64 {
        let op = if i % 2 == 0 {
            SendOp::FetchAdd {
                remote_addr: BASE + WORD,
                rkey: p.ends[B].rkey,
                add: 1,
            }
        } else {
            // Swaps in the value the word holds after i operations.
            SendOp::CompareSwap {
                remote_addr: BASE + WORD,
                rkey: p.ends[B].rkey,
                compare: i,
                swap: i + 1,
            }
        };
        p.post(i, op, TARGET + 8 * i, 8);
        assert_eq!(p.settle(1_000_000_000), Quiet::Idle);
        let opcode = if i % 2 == 0 {
            WcOpcode::FetchAdd
        } else {
            WcOpcode::CompSwap
        };
        only_success(&p.poll(A), i, opcode, 8);
        assert_eq!(p.bytes(A, TARGET + 8 * i, 8), i.to_le_bytes(), "op {i}");
    }
    assert_eq!(p.bytes(B, WORD, 8), 20u64.to_le_bytes());
    assert!(p.sim.node(B).engine.stats().rx_duplicate >= 20);
}

// ---- RNR ---------------------------------------------------------------

/// rnr_retry = 7 retries forever: a SEND to a responder that posts no
/// receive for a simulated hour stays pending, costs a bounded number of
/// packets (the back-off), and completes once a receive is posted.
#[test]
fn rnr_retry_7_held_for_a_simulated_hour_costs_bounded_work() {
    const HOUR: u64 = 3_600 * 1_000_000_000;
    let mut p = pair(Setup::default());
    p.post(1, SendOp::Send, 0, 100);
    assert_eq!(p.settle(HOUR), Quiet::TimeLimit, "still retrying");
    assert!(p.poll(A).is_empty());
    assert_eq!((p.state(A), p.state(B)), (QpState::Rts, QpState::Rts));
    let sends = p.sim.node(A).engine.stats().tx_packets;
    let naks = p.sim.node(A).engine.stats().rnr_naks;
    // min_rnr_timer 1 = 10 µs: eight waits of 10 µs, then doubling up to
    // the 32 ms cap: about an hour / 32 ms resends in all.
    let cap = vrdma_engine::datapath::RNR_BACKOFF_CAP;
    let floor = HOUR / cap;
    assert!(
        (floor..floor + 40).contains(&sends),
        "{sends} SENDs in an hour (about {floor} expected)"
    );
    assert_eq!(naks, sends, "every SEND NAKed (the hour ends in a wait)");
    assert_eq!(p.sim.stats().sent, sends + naks);
    // A receive, and the next resend (at most one cap later) is delivered.
    p.post_recv(9, TARGET, 100);
    assert_eq!(p.settle(2 * cap), Quiet::Idle);
    only_success(&p.poll(A), 1, WcOpcode::Send, 100);
    only_success(&p.poll(B), 9, WcOpcode::Recv, 100);
    assert_eq!(p.bytes(B, TARGET, 100), p.bytes(A, 0, 100));
}

/// A finite rnr_retry waits the advertised time each round, then fails.
#[test]
fn a_finite_rnr_retry_ends_in_rnr_retry_exc_err() {
    let mut p = pair(Setup {
        rnr_retry: 3,
        min_rnr_timer: 14, // 1.28 ms
        ..Setup::default()
    });
    p.post(1, SendOp::Send, 0, 100);
    p.post(2, SendOp::Send, 0, 100);
    assert_eq!(p.settle(1_000_000_000), Quiet::Idle);
    let wcs = p.poll(A);
    let got: Vec<_> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(
        got,
        [(1, WcStatus::RnrRetryExcErr), (2, WcStatus::WrFlushErr)]
    );
    assert_eq!(p.sim.node(A).engine.stats().rnr_naks, 4);
    // Three waits of 1.28 ms.
    assert!(
        (3_840_000..4_000_000).contains(&p.sim.now()),
        "{}",
        p.sim.now()
    );
    assert_eq!(p.state(A), QpState::Err);
}

// ---- partitions --------------------------------------------------------

/// Four WRs into a partition that outlasts the retry budget: the first ends
/// in RETRY_EXC_ERR after retry_cnt + 1 timeouts, the rest are flushed in
/// order, the QP is in ERR, and the responder saw nothing.
#[test]
fn a_partition_longer_than_the_retry_budget_is_retry_exc_err_and_a_clean_flush() {
    let mut p = pair(Setup {
        timeout: 10, // 4.19 ms
        retry_cnt: 3,
        ..Setup::default()
    });
    p.sim.partition(A, B);
    p.post_recv(9, TARGET, 4096);
    p.post(1, p.write_op(TARGET), 0, 3000);
    p.post(2, SendOp::Send, 0, 100);
    p.post(3, p.read_op(0), TARGET, 2000);
    let op = SendOp::FetchAdd {
        remote_addr: BASE + WORD,
        rkey: p.ends[B].rkey,
        add: 1,
    };
    p.post(4, op, TARGET + 4096, 8);
    assert_eq!(p.settle(10_000_000_000), Quiet::Idle);
    let wcs = p.poll(A);
    let got: Vec<_> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(
        got,
        [
            (1, WcStatus::RetryExcErr),
            (2, WcStatus::WrFlushErr),
            (3, WcStatus::WrFlushErr),
            (4, WcStatus::WrFlushErr)
        ]
    );
    assert_eq!(p.sim.node(A).engine.stats().retry_timeout, 3);
    let t = 4096u64 << 10;
    assert!(
        (4 * t..4 * t + 1_000_000).contains(&p.sim.now()),
        "the error after four timeouts, at {}",
        p.sim.now()
    );
    assert_eq!(p.state(A), QpState::Err);
    assert_eq!(p.state(B), QpState::Rts);
    assert!(p.poll(B).is_empty());
    assert_eq!(p.sim.stats().delivered, 0);
    assert_eq!(p.sim.poll_event(A), None);
}

/// The same WRs into a partition shorter than the budget: after the heal
/// everything completes, in order, with the data in place.
#[test]
fn a_partition_shorter_than_the_retry_budget_recovers_fully() {
    let mut p = pair(Setup {
        timeout: 10,
        retry_cnt: 3,
        ..Setup::default()
    });
    p.sim
        .node_mut(B)
        .mem
        .write(BASE + WORD, &5u64.to_le_bytes())
        .unwrap();
    p.sim.partition(A, B);
    p.post_recv(9, TARGET + 8192, 4096);
    p.post(1, p.write_op(TARGET), 0, 3000);
    p.post(2, SendOp::Send, 0, 100);
    p.post(3, p.read_op(0), TARGET + 16384, 2000);
    let op = SendOp::FetchAdd {
        remote_addr: BASE + WORD,
        rkey: p.ends[B].rkey,
        add: 1,
    };
    p.post(4, op, TARGET + 32768, 8);
    // Two and a half timeouts, then the heal.
    let t = 4096u64 << 10;
    assert_eq!(p.settle(5 * t / 2), Quiet::TimeLimit);
    assert!(p.poll(A).is_empty());
    p.sim.heal(A, B);
    assert_eq!(p.settle(10_000_000_000), Quiet::Idle);
    let wcs = p.poll(A);
    let got: Vec<_> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(
        got,
        [
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::Success),
            (4, WcStatus::Success)
        ]
    );
    only_success(&p.poll(B), 9, WcOpcode::Recv, 100);
    assert_eq!(p.bytes(B, TARGET, 3000), p.bytes(A, 0, 3000));
    assert_eq!(p.bytes(B, TARGET + 8192, 100), p.bytes(A, 0, 100));
    assert_eq!(p.bytes(A, TARGET + 16384, 2000), p.bytes(B, 0, 2000));
    assert_eq!(p.bytes(A, TARGET + 32768, 8), 5u64.to_le_bytes());
    assert_eq!(p.bytes(B, WORD, 8), 6u64.to_le_bytes());
    // Two timeouts in the partition, and the third resends into the
    // healed network.
    assert_eq!(p.sim.node(A).engine.stats().retry_timeout, 3);
    assert_eq!((p.state(A), p.state(B)), (QpState::Rts, QpState::Rts));
}

// ---- UC and UD ----------------------------------------------------------

/// UC: a lost middle packet loses its message silently (no completion on
/// the responder, success on the requester, which does not know); the next
/// message arrives whole into the same receive.
#[test]
fn uc_drops_the_rest_of_a_message_after_a_gap() {
    let mut p = pair(Setup {
        qp_type: QpType::Uc,
        ..Setup::default()
    });
    p.sim.drop_packets(DropRule {
        from: A,
        to: B,
        opcode: None,
        psn: Some(0x1001),
        count: 1,
    });
    p.post_recv(9, TARGET, 8192);
    p.post(1, SendOp::Send, 0, 4000);
    p.post(2, SendOp::Send, 4096, 3000);
    assert_eq!(p.settle(1_000_000_000), Quiet::Idle);
    let got: Vec<_> = p.poll(A).iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(got, [(1, WcStatus::Success), (2, WcStatus::Success)]);
    only_success(&p.poll(B), 9, WcOpcode::Recv, 3000);
    assert_eq!(p.bytes(B, TARGET, 3000), p.bytes(A, 4096, 3000));
    let b = p.sim.node(B).engine.stats();
    assert_eq!(b.rx_out_of_sequence, 1);
    // Three packets of the first message arrived; the two after the gap
    // were dropped.
    assert_eq!(b.rx_packets, 3 + 3);
}

/// UD: each datagram stands alone; a lost one is simply missing.
#[test]
fn ud_loses_a_datagram_and_delivers_the_next() {
    let mut p = pair(Setup {
        qp_type: QpType::Ud,
        ..Setup::default()
    });
    p.sim.drop_packets(DropRule {
        from: A,
        to: B,
        opcode: None,
        psn: Some(0x1000),
        count: 1,
    });
    // A UD receive holds the 40-byte GRH first.
    p.post_recv(9, TARGET, 1064);
    p.post(1, SendOp::Send, 0, 1000);
    p.post(2, SendOp::Send, 1000, 1000);
    assert_eq!(p.settle(1_000_000_000), Quiet::Idle);
    let got: Vec<_> = p.poll(A).iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(got, [(1, WcStatus::Success), (2, WcStatus::Success)]);
    let r = p.poll(B);
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!(
        (r[0].wr_id, r[0].status, r[0].byte_len),
        (9, WcStatus::Success, 1040)
    );
    assert_eq!(p.bytes(B, TARGET + 40, 1000), p.bytes(A, 1000, 1000));
}
