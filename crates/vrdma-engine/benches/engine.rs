//! Engine-only message rate: two engines on one core exchanging packets
//! directly (no framing, no ICRC, no sockets), as CPU time per packet.
//!
//! Run: `cargo bench -p vrdma-engine --bench engine`
//!
//! Each iteration posts a batch of WRs on A and moves every packet
//! (requests one way, ACKs the other) until both engines are idle, then
//! polls and checks the completions. Throughput is reported per packet moved. A
//! second row per workload times the batch's payload copies alone, so
//! that the engine's own cost per packet is the difference.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use vrdma_engine::{
    attr::Mtu,
    transmit::MAX_PACKET,
    wc::{Wc, WcStatus},
    wr::{Payload, RecvWr, SendFlags, SendOp, SendWr, Sge},
};
use vrdma_testkit::{
    direct::{End, exchange},
    setup::{BASE, Connection, EngineSpec, gid},
};
use vrdma_wire::{Psn, Qpn};

const MEM: usize = 1 << 20;
const BATCH: u64 = 64;

fn end(n: u8) -> End {
    End::new(&EngineSpec::new(n).mem(MEM).cqe(4096).depth(1024), n)
}

fn connect(x: &mut End, peer: u8, dest: Qpn, mtu: Mtu) {
    Connection {
        mtu,
        psn: Psn::from_masked(1),
        ..Connection::default()
    }
    .join(&mut x.engine, x.ids.qpn, gid(peer), dest);
}

fn rate(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine");
    for (name, len, write) in [
        ("64 B SEND", 64u32, false),
        ("4 KiB RDMA WRITE", 4096, true),
    ] {
        let mut a = end(1);
        let mut b = end(2);
        let (aq, bq) = (a.ids.qpn, b.ids.qpn);
        connect(&mut a, 2, bq, Mtu::Mtu4096);
        connect(&mut b, 1, aq, Mtu::Mtu4096);
        let mut buf = vec![0u8; MAX_PACKET];
        let mut wcs: Vec<Wc> = Vec::with_capacity(4096);
        // Packets per batch: one request per message plus the ACKs
        // (measured once, then used as the throughput unit).
        let run_batch = |a: &mut End, b: &mut End, buf: &mut [u8], wcs: &mut Vec<Wc>| -> u64 {
            for i in 0..BATCH {
                if !write {
                    let r = [Sge {
                        addr: BASE + 0x8_0000,
                        length: len,
                        lkey: b.ids.lkey,
                    }];
                    b.engine
                        .post_recv(
                            b.ids.qpn,
                            &RecvWr {
                                wr_id: i,
                                sg_list: &r,
                            },
                        )
                        .unwrap();
                }
                let s = [Sge {
                    addr: BASE,
                    length: len,
                    lkey: a.ids.lkey,
                }];
                let op = if write {
                    SendOp::RdmaWrite {
                        remote_addr: BASE + 0x8_0000,
                        rkey: b.ids.rkey,
                    }
                } else {
                    SendOp::Send
                };
                // One signaled WR per batch, as perftest does (cq_mod).
                let flags = if i + 1 == BATCH {
                    SendFlags::SIGNALED
                } else {
                    SendFlags::default()
                };
                a.engine
                    .post_send(
                        a.ids.qpn,
                        &SendWr {
                            wr_id: i,
                            op,
                            payload: Payload::Sges(&s),
                            flags,
                            ud: None,
                        },
                    )
                    .unwrap();
            }
            let n = exchange(a, b, buf);
            // The batch must have worked: one successful send completion
            // (the signaled last WR) and, for SENDs, one successful
            // receive per message. A regression that errors the QP would
            // otherwise look like a faster engine.
            wcs.clear();
            a.engine.poll_cq(a.ids.cq, 4096, wcs).unwrap();
            assert!(
                wcs.len() == 1 && wcs[0].status == WcStatus::Success && wcs[0].wr_id == BATCH - 1,
                "send completions: {wcs:?}"
            );
            wcs.clear();
            b.engine.poll_cq(b.ids.cq, 4096, wcs).unwrap();
            let expected = if write { 0 } else { BATCH as usize };
            assert!(
                wcs.len() == expected
                    && wcs
                        .iter()
                        .all(|w| w.status == WcStatus::Success && w.byte_len == len),
                "receive completions: {} of {expected}",
                wcs.len()
            );
            n
        };
        let packets = run_batch(&mut a, &mut b, &mut buf, &mut wcs);
        g.throughput(Throughput::Elements(packets));
        g.bench_function(name, |bench| {
            bench.iter(|| black_box(run_batch(&mut a, &mut b, &mut buf, &mut wcs)))
        });
        // The payload copies the batch cannot avoid, on their own: each
        // message's bytes from the sender's memory into a packet and from
        // the packet into the receiver's memory. The figure is
        // per packet *excluding* these, so BENCHMARKS.md subtracts this row
        // (same packet count) from the one above.
        let n = len as usize;
        let (src, dst) = (0x100, 0x8_0000);
        g.bench_function(format!("{name}: payload copies only"), |bench| {
            bench.iter(|| {
                for _ in 0..BATCH {
                    buf[..n].copy_from_slice(&a.mem.bytes()[src..src + n]);
                    b.mem.bytes_mut()[dst..dst + n].copy_from_slice(black_box(&buf[..n]));
                }
                black_box(&b.mem);
            })
        });
    }
    g.finish();
}

criterion_group!(benches, rate);
criterion_main!(benches);
