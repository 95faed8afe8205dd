//! RC over a lossy network (IBTA's reliable service, DESIGN invariant 1):
//! whatever packets are lost (here up to six, chosen by proptest), every
//! message is delivered exactly once, in order, and every signaled WR
//! completes exactly once, in order, with the data intact — over the wire
//! (MTU-sized packets) and over a same-host medium, where a payload is
//! lent on in runs of segments that each take their PSN (`Net::same_host`).

use proptest::prelude::*;
use vrdma_engine::{
    memory::Memory,
    wc::{WcOpcode, WcStatus},
    wr::{Payload, RecvWr, SendFlags, SendOp, SendWr, Sge},
};
use vrdma_testkit::{
    net::{Net, Quiet},
    setup::{self, BASE, Connection, Ids},
};
use vrdma_wire::Psn;

const MEM: usize = 1024 * 1024;
// Layout, 8 KiB per operation: a's sources at 0, a's READ/atomic results
// at RESULTS; b's SEND/WRITE targets at 0, b's READ sources at READS, b's
// atomic targets at ATOMICS.
const RESULTS: u64 = 256 * 1024;
const READS: u64 = 512 * 1024;
const ATOMICS: u64 = 768 * 1024;

/// An engine with 1 MiB of memory and an RC QP 32 deep, every WR
/// signaled.
fn side(net: &mut Net, n: u8) -> Ids {
    setup::EngineSpec::new(n)
        .mem(MEM)
        .cqe(256)
        .depth(32)
        .sig_all(true)
        .add_to(net)
}

/// Connects the two sides: a short timeout, PSNs that wrap early, four
/// READs/atomics in flight each way.
fn connect(net: &mut Net, a: Ids, b: Ids) {
    Connection {
        psn: Psn::from_masked(0xff_fff0),
        timeout: 8,
        min_rnr_timer: 1,
        max_rd_atomic: 4,
        max_dest_rd_atomic: 4,
        ..Connection::default()
    }
    .pair(net, a, b);
}

/// One operation of the workload: kind 0 SEND, 1 WRITE, 2 READ, 3 FETCH_ADD.
fn op() -> impl Strategy<Value = (u8, u32)> {
    (0u8..4, 1u32..5000)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn every_message_arrives_once_in_order_whatever_is_lost(
        ops in prop::collection::vec(op(), 1..16),
        drops in prop::collection::btree_set(0u64..200, 0..7),
        same_host in any::<bool>(),
    ) {
        let mut net = Net::default();
        let a = side(&mut net, 1);
        let b = side(&mut net, 2);
        connect(&mut net, a, b);
        if same_host {
            net.same_host();
        }
        net.drop = drops;
        // Source data on a, slots of 8 KiB per operation.
        let src: Vec<u8> = (0..256 * 1024).map(|i| (i * 7 + 3) as u8).collect();
        net.nodes[a.node].mem.write(BASE, &src).unwrap();
        net.nodes[b.node].mem.write(BASE + READS, &src).unwrap();
        net.nodes[b.node].mem.write(BASE + ATOMICS, &src).unwrap();
        let mut sends = 0u64;
        for (i, &(kind, len)) in ops.iter().enumerate() {
            let at = i as u64 * 8192;
            let (op, len) = match kind {
                0 => (SendOp::Send, len),
                1 => (SendOp::RdmaWrite { remote_addr: BASE + at, rkey: b.rkey }, len),
                2 => (SendOp::RdmaRead { remote_addr: BASE + READS + at, rkey: b.rkey }, len),
                _ => (SendOp::FetchAdd { remote_addr: BASE + ATOMICS + at, rkey: b.rkey, add: 1 }, 8),
            };
            if kind == 0 {
                let r = [Sge { addr: BASE + at, length: 8192, lkey: b.lkey }];
                net.nodes[b.node].engine.post_recv(b.qpn, &RecvWr { wr_id: 1000 + i as u64, sg_list: &r }).unwrap();
                sends += 1;
            }
            let local = if kind == 2 || kind == 3 { BASE + RESULTS + at } else { BASE + at };
            let s = [Sge { addr: local, length: len, lkey: a.lkey }];
            net.nodes[a.node].engine.post_send(a.qpn, &SendWr { wr_id: i as u64, op, payload: Payload::Sges(&s), flags: SendFlags::SIGNALED, ud: None }).unwrap();
        }
        let mut rounds = 0;
        loop {
            match net.run(10_000) {
                Quiet::Idle => break,
                Quiet::Timer(t) => net.advance_to(t),
                Quiet::Busy => prop_assert!(false, "the network never went quiet"),
            }
            rounds += 1;
            prop_assert!(rounds < 200, "no progress");
        }
        // Requester: every WR once, in order, successful.
        let mut wcs = Vec::new();
        net.nodes[a.node].engine.poll_cq(a.cq, 256, &mut wcs).unwrap();
        let got: Vec<(u64, WcStatus)> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
        let want: Vec<(u64, WcStatus)> = (0..ops.len() as u64).map(|i| (i, WcStatus::Success)).collect();
        prop_assert_eq!(got, want);
        // Responder: every SEND once, in order.
        let mut rw = Vec::new();
        net.nodes[b.node].engine.poll_cq(b.cq, 256, &mut rw).unwrap();
        prop_assert_eq!(rw.len() as u64, sends);
        prop_assert!(rw.windows(2).all(|p| p[0].wr_id < p[1].wr_id));
        prop_assert!(rw.iter().all(|w| w.status == WcStatus::Success && w.opcode == WcOpcode::Recv));
        // Data: SENDs and WRITEs landed, READs came back, atomics ran once.
        for (i, &(kind, len)) in ops.iter().enumerate() {
            let at = i as u64 * 8192;
            let len = len as usize;
            match kind {
                0 | 1 => {
                    let mut got = vec![0; len];
                    net.nodes[b.node].mem.read(BASE + at, &mut got).unwrap();
                    prop_assert_eq!(&got[..], &src[at as usize..at as usize + len]);
                }
                2 => {
                    let mut got = vec![0; len];
                    net.nodes[a.node].mem.read(BASE + RESULTS + at, &mut got).unwrap();
                    prop_assert_eq!(&got[..], &src[at as usize..at as usize + len]);
                }
                _ => {
                    let mut word = [0u8; 8];
                    let target = BASE + ATOMICS + at;
                    net.nodes[b.node].mem.read(target, &mut word).unwrap();
                    let off = at as usize;
                    let before = u64::from_le_bytes(src[off..off + 8].try_into().unwrap());
                    prop_assert_eq!(u64::from_le_bytes(word), before.wrapping_add(1), "the atomic ran exactly once");
                }
            }
        }
    }
}
