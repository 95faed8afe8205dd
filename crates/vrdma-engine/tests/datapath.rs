//! Two engines on the deterministic test network: UD, UC and RC sends and
//! writes end to end, with completions, protection errors, RNR and timeouts.

use std::net::Ipv4Addr;

use vrdma_engine::{
    Engine,
    attr::{DeviceAttr, Mtu, PortAttr},
    memory::VecMemory,
    mr::{Access, MrRequest, Translation},
    qp::{AhAttr, AttrMask, QpAttr, QpCap, QpInitAttr, QpState, QpType},
    wc::{WcFlags, WcOpcode, WcStatus},
    wr::{Payload, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest},
};
use vrdma_testkit::net::{Net, Quiet};
use vrdma_wire::{Lkey, QKey, Qpn, Rkey, frame::IpRepr, grh, packet};

mod common;
use common::*;

#[test]
fn ud_send_with_immediate_delivers_grh_source_qp_and_data() {
    let (mut net, a, b) = pair(QpType::Ud, 7);
    let data = pattern(100, 1);
    fill(&mut net, a, 0, &data);
    let rsge = [sge(b, 0x100, 140)];
    recv(&mut net, b, 9, &rsge);
    let ah = ah_to(&mut net, a, gid(2));
    let ssge = [sge(a, 0, 100)];
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::SendWithImm { imm: 0x1122_3344 },
        payload: Payload::Sges(&ssge),
        flags: SendFlags::SIGNALED | SendFlags::SOLICITED,
        ud: Some(UdDest {
            av: vrdma_engine::wr::Av::Handle(ah),
            remote_qpn: b.qpn,
            remote_qkey: QKey(0x1111_1111),
        }),
    };
    e(&mut net, a).post_send(a.qpn, &wr).unwrap();
    assert_eq!(net.run(100), Quiet::Idle);
    let wc = poll(&mut net, b);
    assert_eq!(wc.len(), 1);
    let w = wc[0];
    assert_eq!(
        (w.wr_id, w.status, w.opcode),
        (9, WcStatus::Success, WcOpcode::Recv)
    );
    assert_eq!(w.byte_len, 140, "GRH + payload");
    assert_eq!(w.src_qp, a.qpn.value());
    assert_eq!(w.imm_data, 0x1122_3344);
    assert!(w.wc_flags.contains(WcFlags::GRH.with(WcFlags::WITH_IMM)));
    assert_eq!(read(&net, b, 0x100 + 40, 100), data);
    let g = read(&net, b, 0x100, 40);
    let ip = grh::parse(&grh::Packet::new_unchecked(&g[..])).unwrap();
    assert_eq!(ip.sgid(), gid(1));
    assert_eq!(ip.dgid(), gid(2));
    let sent = poll(&mut net, a);
    assert_eq!(sent.len(), 1);
    assert_eq!((sent[0].wr_id, sent[0].status), (1, WcStatus::Success));
}

#[test]
fn ud_with_a_wrong_qkey_is_dropped_and_counted() {
    let (mut net, a, b) = pair(QpType::Ud, 7);
    let rsge = [sge(b, 0, 200)];
    recv(&mut net, b, 9, &rsge);
    let ah = e(&mut net, a)
        .create_ah(
            a.pd,
            AhAttr {
                dgid: gid(2),
                port_num: 1,
                ..AhAttr::default()
            },
        )
        .unwrap();
    let ssge = [sge(a, 0, 8)];
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::Send,
        payload: Payload::Sges(&ssge),
        flags: SendFlags::default(),
        ud: Some(UdDest {
            av: vrdma_engine::wr::Av::Handle(ah),
            remote_qpn: b.qpn,
            remote_qkey: QKey(0x2222),
        }),
    };
    e(&mut net, a).post_send(a.qpn, &wr).unwrap();
    net.run(100);
    assert!(poll(&mut net, b).is_empty());
    assert_eq!(e(&mut net, b).stats().rx_bad_key, 1);
    assert!(
        poll(&mut net, a).is_empty(),
        "unsignaled and successful: no CQE"
    );
}

#[test]
fn rc_send_across_packets_and_sges_arrives_whole_and_completes_on_ack() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let data = pattern(3000, 7);
    fill(&mut net, a, 0, &data);
    // Gather from two SGEs, scatter into three.
    let ssge = [sge(a, 0, 1000), sge(a, 1000, 2000)];
    let rsge = [
        sge(b, 0x4000, 10),
        sge(b, 0x5000, 1990),
        sge(b, 0x6000, 1000),
    ];
    recv(&mut net, b, 20, &rsge);
    send(&mut net, a, 10, SendOp::Send, &ssge, SendFlags::SIGNALED);
    assert_eq!(net.run(100), Quiet::Idle);
    let got = [
        read(&net, b, 0x4000, 10),
        read(&net, b, 0x5000, 1990),
        read(&net, b, 0x6000, 1000),
    ]
    .concat();
    assert_eq!(got, data);
    let rw = poll(&mut net, b);
    assert_eq!(rw.len(), 1);
    assert_eq!(
        (rw[0].wr_id, rw[0].status, rw[0].byte_len),
        (20, WcStatus::Success, 3000)
    );
    let sw = poll(&mut net, a);
    assert_eq!(sw.len(), 1);
    assert_eq!(
        (sw[0].wr_id, sw[0].status, sw[0].opcode),
        (10, WcStatus::Success, WcOpcode::Send)
    );
    // 3 data packets (PSNs wrap from 0xfffffe) and one coalesced ACK.
    assert_eq!(net.delivered, 4);
    assert_eq!(e(&mut net, a).poll_timeout(), None, "nothing outstanding");
}

#[test]
fn rc_write_with_immediate_lands_and_consumes_one_receive() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let data = pattern(5000, 3);
    fill(&mut net, a, 0, &data);
    recv(&mut net, b, 30, &[]);
    let ssge = [sge(a, 0, 5000)];
    send(
        &mut net,
        a,
        11,
        SendOp::RdmaWriteWithImm {
            remote_addr: BASE + 0x8000,
            rkey: b.rkey,
            imm: 0xdead_beef,
        },
        &ssge,
        SendFlags::SIGNALED,
    );
    net.run(100);
    assert_eq!(read(&net, b, 0x8000, 5000), data);
    let rw = poll(&mut net, b);
    assert_eq!(rw.len(), 1);
    assert_eq!(rw[0].opcode, WcOpcode::RecvRdmaWithImm);
    assert_eq!((rw[0].byte_len, rw[0].imm_data), (5000, 0xdead_beef));
    let sw = poll(&mut net, a);
    assert_eq!(
        (sw[0].wr_id, sw[0].status, sw[0].opcode),
        (11, WcStatus::Success, WcOpcode::RdmaWrite)
    );
}

#[test]
fn rc_write_outside_the_remote_mr_is_a_remote_access_error_on_both_sides() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let ssge = [sge(a, 0, 64)];
    send(
        &mut net,
        a,
        12,
        SendOp::RdmaWrite {
            remote_addr: BASE + MEM as u64 - 32,
            rkey: b.rkey,
        },
        &ssge,
        SendFlags::default(),
    );
    net.run(100);
    let sw = poll(&mut net, a);
    assert_eq!(sw.len(), 1, "errors complete even unsignaled");
    assert_eq!((sw[0].wr_id, sw[0].status), (12, WcStatus::RemAccessErr));
    assert_eq!(qp_state(&mut net, a), QpState::Err);
    assert_eq!(qp_state(&mut net, b), QpState::Err);
    assert_eq!(
        read(&net, b, MEM as u64 - 32, 32),
        vec![0; 32],
        "nothing written"
    );
    // No completion reports the error at the responder: an event does.
    let eb = e(&mut net, b);
    let events: Vec<_> = std::iter::from_fn(|| eb.poll_event()).collect();
    assert!(
        events.contains(&vrdma_engine::event::AsyncEvent::QpAccessErr { qp: b.qpn }),
        "{events:?}"
    );
}

#[test]
fn rc_write_with_a_wrong_key_byte_is_refused() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let ssge = [sge(a, 0, 8)];
    let stale = Rkey(b.rkey.0 ^ 0x01);
    send(
        &mut net,
        a,
        13,
        SendOp::RdmaWrite {
            remote_addr: BASE,
            rkey: stale,
        },
        &ssge,
        SendFlags::SIGNALED,
    );
    net.run(100);
    assert_eq!(poll(&mut net, a)[0].status, WcStatus::RemAccessErr);
}

#[test]
fn rnr_waits_for_the_timer_then_succeeds_once_a_receive_is_posted() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    fill(&mut net, a, 0, b"hello, rnr");
    let ssge = [sge(a, 0, 10)];
    send(&mut net, a, 14, SendOp::Send, &ssge, SendFlags::SIGNALED);
    // SEND, RNR NAK; then the requester waits (min_rnr_timer 1 = 10 µs).
    let Quiet::Timer(t) = net.run(100) else {
        panic!("expected an RNR wait")
    };
    assert_eq!(net.delivered, 2);
    assert!(poll(&mut net, a).is_empty());
    let rsge = [sge(b, 0x200, 64)];
    recv(&mut net, b, 40, &rsge);
    net.advance_to(t);
    assert_eq!(net.run(100), Quiet::Idle);
    assert_eq!(read(&net, b, 0x200, 10), b"hello, rnr");
    assert_eq!(poll(&mut net, a)[0].status, WcStatus::Success);
    assert_eq!(poll(&mut net, b)[0].wr_id, 40);
}

#[test]
fn rnr_retries_run_out() {
    let (mut net, a, _b) = pair(QpType::Rc, 2);
    let ssge = [sge(a, 0, 4)];
    send(&mut net, a, 15, SendOp::Send, &ssge, SendFlags::default());
    let mut rounds = 0;
    while let Quiet::Timer(t) = net.run(100) {
        net.advance_to(t);
        rounds += 1;
        assert!(rounds < 10, "no end to the retries");
    }
    let sw = poll(&mut net, a);
    assert_eq!((sw[0].wr_id, sw[0].status), (15, WcStatus::RnrRetryExcErr));
    assert_eq!(
        rounds, 2,
        "rnr_retry = 2: two delayed resends, then the error"
    );
    assert_eq!(qp_state(&mut net, a), QpState::Err);
}

#[test]
fn an_unanswered_request_times_out_after_retry_cnt_resends() {
    let mut net = Net::default();
    let a = side(&mut net, 1, QpType::Rc, false);
    // The peer's GID belongs to nobody: every packet is lost.
    connect_to(&mut net, a, gid(9), Qpn::from_masked(99), 7);
    let ssge = [sge(a, 0, 4)];
    send(&mut net, a, 16, SendOp::Send, &ssge, SendFlags::SIGNALED);
    let mut timeouts = 0;
    while let Quiet::Timer(t) = net.run(100) {
        // 4.096 µs × 2^10 per attempt.
        assert_eq!(t - net.now, 4096 << 10);
        net.advance_to(t);
        timeouts += 1;
        assert!(timeouts < 10);
    }
    assert_eq!(
        timeouts, 3,
        "retry_cnt = 2: the first send and two resends time out"
    );
    let sw = poll(&mut net, a);
    assert_eq!((sw[0].wr_id, sw[0].status), (16, WcStatus::RetryExcErr));
    // The first send, then each resend after a timeout twice (two copies
    // of the first packet of a resend).
    assert_eq!((net.undeliverable, net.delivered), (5, 0));
}

#[test]
fn uc_send_and_write_without_acks() {
    let (mut net, a, b) = pair(QpType::Uc, 7);
    let data = pattern(2500, 9);
    fill(&mut net, a, 0, &data);
    let rsge = [sge(b, 0, 4096)];
    recv(&mut net, b, 50, &rsge);
    let ssge = [sge(a, 0, 2500)];
    for (id, op) in [
        (1, SendOp::Send),
        (
            2,
            SendOp::RdmaWrite {
                remote_addr: BASE + 0x9000,
                rkey: b.rkey,
            },
        ),
    ] {
        let wr = SendWr {
            wr_id: id,
            op,
            payload: Payload::Sges(&ssge),
            flags: SendFlags::SIGNALED,
            ud: None,
        };
        e(&mut net, a).post_send(a.qpn, &wr).unwrap();
    }
    net.run(100);
    assert_eq!(read(&net, b, 0, 2500), data);
    assert_eq!(read(&net, b, 0x9000, 2500), data);
    assert_eq!(net.delivered, 6, "3 + 3 packets, no ACKs on UC");
    let ids: Vec<u64> = poll(&mut net, a).iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, [1, 2]);
    assert_eq!(poll(&mut net, b)[0].byte_len, 2500);
}

#[test]
fn zero_length_send_and_inline_data() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let rsge = [sge(b, 0, 16)];
    for id in [60, 61] {
        recv(&mut net, b, id, &rsge);
    }
    let zero = SendWr {
        wr_id: 1,
        op: SendOp::Send,
        payload: Payload::Sges(&[]),
        flags: SendFlags::SIGNALED,
        ud: None,
    };
    let inline = SendWr {
        wr_id: 2,
        op: SendOp::Send,
        payload: Payload::Inline(b"inline!"),
        flags: SendFlags::SIGNALED | SendFlags::INLINE,
        ud: None,
    };
    e(&mut net, a).post_send(a.qpn, &zero).unwrap();
    e(&mut net, a).post_send(a.qpn, &inline).unwrap();
    net.run(100);
    let rw = poll(&mut net, b);
    assert_eq!(
        rw.iter().map(|w| (w.wr_id, w.byte_len)).collect::<Vec<_>>(),
        [(60, 0), (61, 7)]
    );
    assert_eq!(read(&net, b, 0, 7), b"inline!");
    assert_eq!(poll(&mut net, a).len(), 2);
}

#[test]
fn a_bad_local_sge_is_a_local_protection_error() {
    // Found as the payload is copied, or as it is lent to a gather send.
    for gather in [false, true] {
        let (mut net, a, _b) = pair(QpType::Rc, 7);
        net.gather = gather;
        let bad = [Sge {
            addr: BASE,
            length: 8,
            lkey: Lkey(a.lkey.0 ^ 0x10),
        }];
        let wr = SendWr {
            wr_id: 70,
            op: SendOp::Send,
            payload: Payload::Sges(&bad),
            flags: SendFlags::default(),
            ud: None,
        };
        e(&mut net, a).post_send(a.qpn, &wr).unwrap();
        net.run(100);
        let sw = poll(&mut net, a);
        assert_eq!((sw[0].wr_id, sw[0].status), (70, WcStatus::LocProtErr));
        assert_eq!(qp_state(&mut net, a), QpState::Err);
        assert_eq!(net.delivered, 0, "nothing left the QP");
    }
}

/// A gather-send fabric's poll lends a WRITE's payload piece by piece —
/// here from an MR over scattered pages and two SGEs, so that packets
/// cross pages and SGEs — and the peer gets every byte.
#[test]
fn lent_payloads_follow_pages_and_sges_and_keep_their_checks() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    net.gather = true;
    // Eight 4 KiB pages of A's memory, in a scrambled order, as one MR.
    let order = [5u64, 2, 7, 0, 3, 6, 1, 4];
    let pages: Vec<u64> = order.iter().map(|p| BASE + 0x8000 + p * 0x1000).collect();
    let (lkey, _) = e(&mut net, a)
        .reg_mr(MrRequest {
            pd: a.pd,
            iova: 0x7000_0000,
            length: 8 * 0x1000 - 0x123,
            access: Access::LOCAL_WRITE,
            translation: Translation::Pages {
                page_shift: 12,
                offset: 0x123,
                pages,
            },
        })
        .unwrap();
    // The MR's bytes, in its own order.
    let data = pattern(8 * 0x1000, 77);
    for (i, p) in order.iter().enumerate() {
        fill(
            &mut net,
            a,
            0x8000 + p * 0x1000,
            &data[i * 0x1000..(i + 1) * 0x1000],
        );
    }
    let mr_byte = |va: u64| data[(va - 0x7000_0000 + 0x123) as usize];
    // 10,000 bytes from the paged MR at an odd place, then 3,000 from the
    // plain one, into B at 0x2000.
    let (va, n1, n2) = (0x7000_0000 + 0x2f1, 10_000u32, 3_000u32);
    let plain = pattern(n2 as usize, 3);
    fill(&mut net, a, 0x1000, &plain);
    let sges = [
        Sge {
            addr: va,
            length: n1,
            lkey,
        },
        sge(a, 0x1000, n2),
    ];
    let mut lent_pieces = 0;
    send(
        &mut net,
        a,
        5,
        SendOp::RdmaWrite {
            remote_addr: BASE + 0x2000,
            rkey: b.rkey,
        },
        &sges,
        SendFlags::SIGNALED,
    );
    while net.step() > 0 {
        lent_pieces = lent_pieces.max(net.nodes[a.node].engine.gathered().len());
    }
    let sw = poll(&mut net, a);
    assert_eq!((sw[0].wr_id, sw[0].status), (5, WcStatus::Success));
    let mut want: Vec<u8> = (0..u64::from(n1)).map(|i| mr_byte(va + i)).collect();
    want.extend(&plain);
    assert_eq!(read(&net, b, 0x2000, want.len()), want);
    assert!(lent_pieces >= 2, "some packet crossed a page or an SGE");
}

#[test]
fn a_receive_half_filled_when_the_qp_fails_is_flushed_not_lost() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let rsge = [sge(b, 0, 4096)];
    recv(&mut net, b, 80, &rsge);
    recv(&mut net, b, 81, &rsge);
    let ssge = [sge(a, 0, 3000)];
    send(&mut net, a, 1, SendOp::Send, &ssge, SendFlags::default());
    assert_eq!(net.step(), 1, "the first of three packets");
    e(&mut net, b)
        .modify_qp(
            b.qpn,
            &QpAttr {
                qp_state: QpState::Err,
                ..QpAttr::default()
            },
            AttrMask::STATE,
        )
        .unwrap();
    let got: Vec<(u64, WcStatus)> = poll(&mut net, b)
        .iter()
        .map(|w| (w.wr_id, w.status))
        .collect();
    assert_eq!(
        got,
        [(80, WcStatus::WrFlushErr), (81, WcStatus::WrFlushErr)]
    );
}

#[test]
fn rc_read_brings_remote_data_in_several_responses() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let data = pattern(3000, 5);
    fill(&mut net, b, 0x3000, &data);
    let local = [sge(a, 0x100, 1000), sge(a, 0x2000, 2000)];
    send(
        &mut net,
        a,
        90,
        SendOp::RdmaRead {
            remote_addr: BASE + 0x3000,
            rkey: b.rkey,
        },
        &local,
        SendFlags::SIGNALED,
    );
    assert_eq!(net.run(100), Quiet::Idle);
    let got = [read(&net, a, 0x100, 1000), read(&net, a, 0x2000, 2000)].concat();
    assert_eq!(got, data);
    let sw = poll(&mut net, a);
    assert_eq!(sw.len(), 1);
    assert_eq!(
        (sw[0].wr_id, sw[0].status, sw[0].opcode, sw[0].byte_len),
        (90, WcStatus::Success, WcOpcode::RdmaRead, 3000)
    );
    assert_eq!(net.delivered, 4, "one request, three responses");
    assert!(
        poll(&mut net, b).is_empty(),
        "a READ consumes nothing at the target"
    );
}

#[test]
fn rc_read_needs_remote_read_rights() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    // An MR on the target without REMOTE_READ.
    let (_, wr_only) = e(&mut net, b)
        .reg_mr(MrRequest {
            pd: b.pd,
            iova: BASE,
            length: 4096,
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            translation: Translation::Identity,
        })
        .unwrap();
    let local = [sge(a, 0, 64)];
    send(
        &mut net,
        a,
        91,
        SendOp::RdmaRead {
            remote_addr: BASE,
            rkey: wr_only,
        },
        &local,
        SendFlags::default(),
    );
    net.run(100);
    assert_eq!(poll(&mut net, a)[0].status, WcStatus::RemAccessErr);
    assert_eq!(qp_state(&mut net, b), QpState::Err);
}

#[test]
fn rc_atomics_execute_once_and_return_the_original_value() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    // The target word holds 40 (little-endian, the host's order).
    fill(&mut net, b, 0x80, &40u64.to_le_bytes());
    let local = [sge(a, 0x10, 8)];
    send(
        &mut net,
        a,
        1,
        SendOp::FetchAdd {
            remote_addr: BASE + 0x80,
            rkey: b.rkey,
            add: 2,
        },
        &local,
        SendFlags::SIGNALED,
    );
    net.run(100);
    assert_eq!(poll(&mut net, a)[0].status, WcStatus::Success);
    assert_eq!(read(&net, b, 0x80, 8), 42u64.to_le_bytes());
    assert_eq!(read(&net, a, 0x10, 8), 40u64.to_le_bytes());
    let swap = |compare, wr_id| SendWr {
        wr_id,
        op: SendOp::CompareSwap {
            remote_addr: BASE + 0x80,
            rkey: b.rkey,
            compare,
            swap: 7,
        },
        payload: Payload::Sges(&local),
        flags: SendFlags::SIGNALED,
        ud: None,
    };
    post(&mut net, a, &swap(41, 2));
    net.run(100);
    assert_eq!(
        read(&net, b, 0x80, 8),
        42u64.to_le_bytes(),
        "no swap: 42 != 41"
    );
    post(&mut net, a, &swap(42, 3));
    net.run(100);
    assert_eq!(read(&net, b, 0x80, 8), 7u64.to_le_bytes());
    assert_eq!(read(&net, a, 0x10, 8), 42u64.to_le_bytes());
    let got: Vec<(u64, WcOpcode)> = poll(&mut net, a)
        .iter()
        .map(|w| (w.wr_id, w.opcode))
        .collect();
    assert_eq!(got, [(2, WcOpcode::CompSwap), (3, WcOpcode::CompSwap)]);
}

#[test]
fn reads_beyond_max_rd_atomic_wait_and_a_fence_waits_for_them() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    fill(&mut net, b, 0, &pattern(2048, 1));
    let l1 = [sge(a, 0, 2048)];
    let l2 = [sge(a, 0x1000, 2048)];
    for (id, l) in [(1, &l1), (2, &l2)] {
        let wr = SendWr {
            wr_id: id,
            op: SendOp::RdmaRead {
                remote_addr: BASE,
                rkey: b.rkey,
            },
            payload: Payload::Sges(l),
            flags: SendFlags::SIGNALED,
            ud: None,
        };
        post(&mut net, a, &wr);
    }
    let rsge = [sge(b, 0x8000, 16)];
    recv(&mut net, b, 7, &rsge);
    let fenced = SendWr {
        wr_id: 3,
        op: SendOp::Send,
        payload: Payload::Inline(b"after"),
        flags: SendFlags::SIGNALED | SendFlags::INLINE | SendFlags::FENCE,
        ud: None,
    };
    post(&mut net, a, &fenced);
    // max_rd_atomic = 1: the second READ goes only after the first is
    // answered (two responses), the fenced SEND only after both.
    for _ in 0..2 {
        net.step();
    }
    // Both responses of READ 1 have been sent; READ 2 was held back.
    assert_eq!(e(&mut net, a).stats().tx_packets, 1, "READ 2 waited");
    assert_eq!(e(&mut net, b).stats().tx_packets, 2);
    // READ 2 goes out; the fenced SEND must wait for its answer.
    net.step();
    assert_eq!(e(&mut net, a).stats().tx_packets, 2, "READ 2 sent");
    assert_eq!(
        e(&mut net, b).stats().rx_packets,
        2,
        "the SEND was held by the fence"
    );
    assert_eq!(net.run(100), Quiet::Idle);
    let ids: Vec<u64> = poll(&mut net, a).iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, [1, 2, 3]);
    assert_eq!(read(&net, a, 0x1000, 2048), pattern(2048, 1));
    assert_eq!(read(&net, b, 0x8000, 5), b"after");
}

#[test]
fn a_zero_length_read_completes() {
    let (mut net, a, _b) = pair(QpType::Rc, 7);
    // A zero-length READ needs no valid key (IBTA Vol1 §9.4.3).
    send(
        &mut net,
        a,
        5,
        SendOp::RdmaRead {
            remote_addr: 0,
            rkey: Rkey(0),
        },
        &[],
        SendFlags::SIGNALED,
    );
    net.run(100);
    let sw = poll(&mut net, a);
    assert_eq!((sw[0].status, sw[0].byte_len), (WcStatus::Success, 0));
}

#[test]
fn an_atomic_without_remote_atomic_rights_changes_nothing() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let (_, no_atomic) = e(&mut net, b)
        .reg_mr(MrRequest {
            pd: b.pd,
            iova: BASE,
            length: 4096,
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            translation: Translation::Identity,
        })
        .unwrap();
    fill(&mut net, b, 0x80, &5u64.to_le_bytes());
    let local = [sge(a, 0x10, 8)];
    send(
        &mut net,
        a,
        1,
        SendOp::FetchAdd {
            remote_addr: BASE + 0x80,
            rkey: no_atomic,
            add: 1,
        },
        &local,
        SendFlags::SIGNALED,
    );
    net.run(100);
    assert_eq!(poll(&mut net, a)[0].status, WcStatus::RemAccessErr);
    assert_eq!(read(&net, b, 0x80, 8), 5u64.to_le_bytes());
}

#[test]
fn receives_come_from_an_srq_and_its_limit_event_fires_once() {
    use vrdma_engine::{
        event::AsyncEvent,
        objects::{SrqAttr, SrqAttrMask},
    };
    let mut net = Net::default();
    let a = side(&mut net, 1, QpType::Rc, false);
    // The target: a QP on an SRQ.
    let mut eb = Engine::new(DeviceAttr::default(), PortAttr::with_gids(&[gid(2)]));
    let pd = eb.alloc_pd().unwrap();
    let (cq, _) = eb.create_cq(64, 0).unwrap();
    let (lkey, rkey) = eb
        .reg_mr(MrRequest {
            pd,
            iova: BASE,
            length: MEM as u64,
            access: Access::LOCAL_WRITE,
            translation: Translation::Identity,
        })
        .unwrap();
    let (srq, _) = eb
        .create_srq(
            pd,
            SrqAttr {
                max_wr: 2,
                max_sge: 1,
                srq_limit: 0,
            },
        )
        .unwrap();
    let (qpn, _) = eb
        .create_qp(QpInitAttr {
            pd,
            send_cq: cq,
            recv_cq: cq,
            srq: Some(srq),
            cap: QpCap {
                max_send_wr: 4,
                max_recv_wr: 0,
                max_send_sge: 1,
                max_recv_sge: 0,
                max_inline_data: 0,
            },
            qp_type: QpType::Rc,
            sq_sig_all: false,
        })
        .unwrap();
    let node = net.add(eb, VecMemory::new(BASE, MEM), gid(2));
    let b = Ids {
        node,
        gid: gid(2),
        pd,
        cq,
        qpn,
        lkey,
        rkey,
    };
    connect(&mut net, a, b, 7);
    connect(&mut net, b, a, 7);
    // Grow the SRQ, fill it with three receives, arm the limit at 2.
    let eb = e(&mut net, b);
    assert_eq!(
        eb.modify_srq(
            srq,
            SrqAttr {
                max_wr: 4,
                ..SrqAttr::default()
            },
            SrqAttrMask::MAX_WR
        )
        .unwrap()
        .max_wr,
        4
    );
    for i in 0..3u64 {
        let sg = [sge(b, i * 0x100, 0x100)];
        eb.post_srq_recv(
            srq,
            &RecvWr {
                wr_id: 100 + i,
                sg_list: &sg,
            },
        )
        .unwrap();
    }
    assert!(
        eb.modify_srq(
            srq,
            SrqAttr {
                srq_limit: 4,
                ..SrqAttr::default()
            },
            SrqAttrMask::LIMIT
        )
        .is_err(),
        "not below the SRQ's size"
    );
    eb.modify_srq(
        srq,
        SrqAttr {
            srq_limit: 2,
            ..SrqAttr::default()
        },
        SrqAttrMask::LIMIT,
    )
    .unwrap();
    while eb.poll_event().is_some() {}
    for id in 0..2 {
        let wr = SendWr {
            wr_id: id,
            op: SendOp::Send,
            payload: Payload::Inline(b"srq"),
            flags: SendFlags::INLINE,
            ud: None,
        };
        post(&mut net, a, &wr);
    }
    net.run(100);
    let ids: Vec<u64> = poll(&mut net, b).iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, [100, 101]);
    assert_eq!(read(&net, b, 0x100, 3), b"srq");
    let eb = e(&mut net, b);
    assert_eq!(eb.poll_event(), Some(AsyncEvent::SrqLimitReached { srq }));
    assert_eq!(eb.poll_event(), None, "once: the limit disarms");
    assert_eq!(eb.query_srq(srq).unwrap().srq_limit, 0);
}

#[test]
fn a_lost_middle_packet_is_nakked_and_resent_go_back_n() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let data = pattern(3000, 11);
    fill(&mut net, a, 0, &data);
    let rsge = [sge(b, 0x4000, 4096)];
    recv(&mut net, b, 1, &rsge);
    let ssge = [sge(a, 0, 3000)];
    send(&mut net, a, 2, SendOp::Send, &ssge, SendFlags::SIGNALED);
    net.drop.insert(1);
    assert_eq!(net.run(100), Quiet::Idle);
    assert_eq!(read(&net, b, 0x4000, 3000), data);
    let rw = poll(&mut net, b);
    assert_eq!(rw.len(), 1, "delivered exactly once");
    assert_eq!(rw[0].byte_len, 3000);
    assert_eq!(poll(&mut net, a)[0].status, WcStatus::Success);
    let sb = e(&mut net, b).stats();
    assert_eq!(sb.rx_out_of_sequence, 1, "the LAST after the hole; one NAK");
    assert_eq!(net.dropped, 1);
}

#[test]
fn a_lost_ack_is_recovered_by_timeout_without_a_second_delivery() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let rsge = [sge(b, 0, 64)];
    for id in [1, 2] {
        recv(&mut net, b, id, &rsge);
    }
    let wr = SendWr {
        wr_id: 3,
        op: SendOp::Send,
        payload: Payload::Inline(b"once"),
        flags: SendFlags::SIGNALED | SendFlags::INLINE,
        ud: None,
    };
    post(&mut net, a, &wr);
    net.drop.insert(1); // the ACK
    let Quiet::Timer(t) = net.run(100) else {
        panic!("expected the retransmit timer")
    };
    assert!(poll(&mut net, a).is_empty());
    net.advance_to(t);
    assert_eq!(net.run(100), Quiet::Idle);
    assert_eq!(poll(&mut net, a)[0].status, WcStatus::Success);
    let rw = poll(&mut net, b);
    assert_eq!(
        rw.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        [1],
        "the duplicate is not delivered again"
    );
    // The resend after the timeout is a duplicate (its second copy is not
    // sent: the ACK for the first came back before it).
    assert_eq!(e(&mut net, b).stats().rx_duplicate, 1);
}

#[test]
fn a_lost_read_response_is_asked_for_again() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let data = pattern(3000, 13);
    fill(&mut net, b, 0x3000, &data);
    let local = [sge(a, 0x100, 3000)];
    send(
        &mut net,
        a,
        4,
        SendOp::RdmaRead {
            remote_addr: BASE + 0x3000,
            rkey: b.rkey,
        },
        &local,
        SendFlags::SIGNALED,
    );
    // Packets: 0 request, 1..=3 responses; lose the middle response.
    net.drop.insert(2);
    let mut rounds = 0;
    while let Quiet::Timer(t) = net.run(100) {
        net.advance_to(t);
        rounds += 1;
        assert!(rounds < 5);
    }
    assert_eq!(read(&net, a, 0x100, 3000), data);
    let sw = poll(&mut net, a);
    assert_eq!((sw[0].status, sw[0].byte_len), (WcStatus::Success, 3000));
    assert!(e(&mut net, a).stats().rx_out_of_sequence >= 1);
}

#[test]
fn a_duplicate_atomic_is_answered_from_the_replay_cache() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    fill(&mut net, b, 0x80, &10u64.to_le_bytes());
    let local = [sge(a, 0x10, 8)];
    send(
        &mut net,
        a,
        5,
        SendOp::FetchAdd {
            remote_addr: BASE + 0x80,
            rkey: b.rkey,
            add: 1,
        },
        &local,
        SendFlags::SIGNALED,
    );
    net.drop.insert(1); // the atomic acknowledgement
    let Quiet::Timer(t) = net.run(100) else {
        panic!("expected the retransmit timer")
    };
    net.advance_to(t);
    assert_eq!(net.run(100), Quiet::Idle);
    assert_eq!(read(&net, b, 0x80, 8), 11u64.to_le_bytes(), "executed once");
    assert_eq!(read(&net, a, 0x10, 8), 10u64.to_le_bytes());
    assert_eq!(poll(&mut net, a)[0].status, WcStatus::Success);
    // The resend is answered from the saved result (its second copy is
    // not sent: the answer came back before it).
    assert_eq!(e(&mut net, b).stats().rx_duplicate, 1);
}

// ---- memory windows, fast registration, invalidation ----------------------

use vrdma_engine::mr::MwType;

fn write_wr(wr_id: u64, s: Ids, rkey: Rkey, at: u64, len: u32) -> SendWr<'static> {
    let sg: &'static [Sge] = Box::leak(Box::new([sge(s, 0, len)]));
    SendWr {
        wr_id,
        op: SendOp::RdmaWrite {
            remote_addr: BASE + at,
            rkey,
        },
        payload: Payload::Sges(sg),
        flags: SendFlags::SIGNALED,
        ud: None,
    }
}

#[test]
fn fast_registration_then_local_invalidation() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let k = fast_reg(&mut net, b, 0x8000, 0x42);
    fill(&mut net, a, 0, b"via frmr");
    // The FRMR's iova is 0x7700_0000 (mapped onto BASE + 0x8000).
    let mut wr = write_wr(2, a, Rkey(k.0), 0, 8);
    wr.op = SendOp::RdmaWrite {
        remote_addr: 0x7700_0010,
        rkey: Rkey(k.0),
    };
    post(&mut net, a, &wr);
    net.run(100);
    let got: Vec<(u64, WcStatus)> = poll(&mut net, a)
        .iter()
        .map(|w| (w.wr_id, w.status))
        .collect();
    assert_eq!(got, [(2, WcStatus::Success)]);
    assert_eq!(read(&net, b, 0x8010, 8), b"via frmr");
    // LOCAL_INV on b; then the key names nothing.
    send(
        &mut net,
        b,
        3,
        SendOp::LocalInv {
            invalidate: Rkey(k.0),
        },
        &[],
        SendFlags::SIGNALED,
    );
    net.run(100);
    let wc = poll(&mut net, b);
    assert_eq!(
        (wc[0].wr_id, wc[0].status, wc[0].opcode),
        (3, WcStatus::Success, WcOpcode::LocalInv)
    );
    assert!(e(&mut net, b).mr(k).is_none());
    let mut wr = write_wr(4, a, Rkey(k.0), 0, 8);
    wr.op = SendOp::RdmaWrite {
        remote_addr: 0x7700_0010,
        rkey: Rkey(k.0),
    };
    post(&mut net, a, &wr);
    net.run(100);
    assert_eq!(poll(&mut net, a)[0].status, WcStatus::RemAccessErr);
}

#[test]
fn a_peer_invalidates_a_fast_registered_mr_with_send_with_invalidate() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let k = fast_reg(&mut net, b, 0x8000, 7);
    let rsge = [sge(b, 0x100, 64)];
    recv(&mut net, b, 9, &rsge);
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::SendWithInv {
            invalidate: Rkey(k.0),
        },
        payload: Payload::Inline(b"done with it"),
        flags: SendFlags::SIGNALED | SendFlags::INLINE,
        ud: None,
    };
    post(&mut net, a, &wr);
    net.run(100);
    let wc = poll(&mut net, b);
    assert_eq!(wc[0].wr_id, 9);
    assert!(wc[0].wc_flags.contains(WcFlags::WITH_INV));
    assert_eq!(wc[0].imm_data, k.0, "the invalidated rkey");
    assert!(e(&mut net, b).mr(k).is_none());
    assert_eq!(poll(&mut net, a)[0].status, WcStatus::Success);
}

#[test]
fn send_with_invalidate_of_a_regular_mr_is_an_invalid_request() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let rsge = [sge(b, 0x100, 64)];
    recv(&mut net, b, 9, &rsge);
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::SendWithInv { invalidate: b.rkey },
        payload: Payload::Inline(b"x"),
        flags: SendFlags::INLINE,
        ud: None,
    };
    post(&mut net, a, &wr);
    net.run(100);
    assert_eq!(poll(&mut net, a)[0].status, WcStatus::RemInvReqErr);
    assert!(
        e(&mut net, b).mr(b.lkey).is_some(),
        "ibv_reg_mr MRs cannot be invalidated"
    );
}

/// `b` registers an MR with MW_BIND over its memory; returns its lkey.
fn bindable(net: &mut Net, s: Ids) -> Lkey {
    e(net, s)
        .reg_mr(MrRequest {
            pd: s.pd,
            iova: BASE,
            length: MEM as u64,
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::MW_BIND,
            translation: Translation::Identity,
        })
        .unwrap()
        .0
}

fn bind(net: &mut Net, s: Ids, mw: Rkey, key: u8, mr: Lkey, at: u64, len: u64) -> WcStatus {
    bind_with(net, s, mw, key, mr, at, len, Access::REMOTE_WRITE)
}

#[allow(clippy::too_many_arguments)]
fn bind_with(
    net: &mut Net,
    s: Ids,
    mw: Rkey,
    key: u8,
    mr: Lkey,
    at: u64,
    len: u64,
    access: Access,
) -> WcStatus {
    let wr = SendWr {
        wr_id: 600,
        op: SendOp::BindMw {
            mw,
            key,
            mr,
            addr: BASE + at,
            length: len,
            access,
        },
        payload: Payload::Sges(&[]),
        flags: SendFlags::SIGNALED,
        ud: None,
    };
    post(net, s, &wr);
    net.run(100);
    let wc = poll(net, s);
    assert_eq!(wc[0].opcode, WcOpcode::BindMw);
    wc[0].status
}

#[test]
fn a_type_2_window_grants_only_its_range_to_its_qp_until_invalidated() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let mr = bindable(&mut net, b);
    let mw = e(&mut net, b).alloc_mw(b.pd, MwType::Two).unwrap();
    assert_eq!(
        bind(&mut net, b, mw, 0x11, mr, 0x2000, 0x100),
        WcStatus::Success
    );
    let key = Rkey::new(mw.index(), 0x11);
    assert_eq!(
        e(&mut net, b).dereg_mr(mr).unwrap_err().errno(),
        vrdma_engine::error::errno::EBUSY
    );
    fill(&mut net, a, 0, b"windowed");
    post(&mut net, a, &write_wr(1, a, key, 0x2000, 8));
    net.run(100);
    assert_eq!(poll(&mut net, a)[0].status, WcStatus::Success);
    assert_eq!(read(&net, b, 0x2000, 8), b"windowed");
    // A SEND with invalidate from the bound QP's peer unbinds it.
    let rsge = [sge(b, 0x100, 64)];
    recv(&mut net, b, 9, &rsge);
    let wr = SendWr {
        wr_id: 2,
        op: SendOp::SendWithInv { invalidate: key },
        payload: Payload::Inline(b"bye"),
        flags: SendFlags::INLINE,
        ud: None,
    };
    post(&mut net, a, &wr);
    net.run(100);
    assert!(poll(&mut net, b)[0].wc_flags.contains(WcFlags::WITH_INV));
    assert!(e(&mut net, b).mw(key).unwrap().binding.is_none());
    e(&mut net, b).dereg_mr(mr).unwrap();
    post(&mut net, a, &write_wr(3, a, key, 0x2000, 8));
    net.run(100);
    assert_eq!(poll(&mut net, a)[0].status, WcStatus::RemAccessErr);
}

#[test]
fn a_window_bounds_its_range() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let mr = bindable(&mut net, b);
    let mw = e(&mut net, b).alloc_mw(b.pd, MwType::Two).unwrap();
    bind(&mut net, b, mw, 0x22, mr, 0x2000, 0x100);
    post(
        &mut net,
        a,
        &write_wr(1, a, Rkey::new(mw.index(), 0x22), 0x20f8, 16),
    );
    net.run(100);
    assert_eq!(poll(&mut net, a)[0].status, WcStatus::RemAccessErr);
    assert_eq!(read(&net, b, 0x20f8, 16), vec![0; 16]);
}

#[test]
fn type_1_windows_rebind_with_a_new_key_and_cannot_be_invalidated() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let mr = bindable(&mut net, b);
    let mw = e(&mut net, b).alloc_mw(b.pd, MwType::One).unwrap();
    assert_eq!(
        bind(&mut net, b, mw, 1, mr, 0x1000, 0x100),
        WcStatus::Success
    );
    let k1 = Rkey::new(mw.index(), 1);
    assert_eq!(
        bind(&mut net, b, k1, 2, mr, 0x3000, 0x100),
        WcStatus::Success
    );
    let k2 = Rkey::new(mw.index(), 2);
    post(&mut net, a, &write_wr(1, a, k2, 0x3000, 8));
    net.run(100);
    assert_eq!(poll(&mut net, a)[0].status, WcStatus::Success);
    let inv = SendWr {
        wr_id: 5,
        op: SendOp::LocalInv { invalidate: k2 },
        payload: Payload::Sges(&[]),
        flags: SendFlags::default(),
        ud: None,
    };
    post(&mut net, b, &inv);
    net.run(100);
    let wc = poll(&mut net, b);
    assert_eq!((wc[0].wr_id, wc[0].status), (5, WcStatus::LocQpOpErr));
    assert_eq!(qp_state(&mut net, b), QpState::Err);
    // The old key died with the rebind.
    assert!(e(&mut net, b).mw(k1).is_none());
}

#[test]
fn binding_needs_mw_bind_rights_on_the_mr() {
    let (mut net, _a, b) = pair(QpType::Rc, 7);
    let mw = e(&mut net, b).alloc_mw(b.pd, MwType::Two).unwrap();
    // b.lkey's MR has no MW_BIND.
    assert_eq!(bind(&mut net, b, mw, 3, b.lkey, 0, 64), WcStatus::MwBindErr);
    assert_eq!(qp_state(&mut net, b), QpState::Err);
}

#[test]
fn a_binds_local_write_right_is_ignored_and_other_rights_are_refused() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let mr = bindable(&mut net, b);
    let mw = e(&mut net, b).alloc_mw(b.pd, MwType::One).unwrap();
    // As rdma-core's MW tests bind: LOCAL_WRITE beside REMOTE_WRITE.
    let rights = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    assert_eq!(
        bind_with(&mut net, b, mw, 0x31, mr, 0x1000, 0x40, rights),
        WcStatus::Success
    );
    let key = Rkey::new(mw.index(), 0x31);
    let binding = e(&mut net, b).mw(key).unwrap().binding.unwrap();
    assert_eq!(binding.access, Access::REMOTE_WRITE, "no local right kept");
    fill(&mut net, a, 0, b"through");
    post(&mut net, a, &write_wr(1, a, key, 0x1000, 7));
    net.run(100);
    assert_eq!(poll(&mut net, a)[0].status, WcStatus::Success);
    assert_eq!(read(&net, b, 0x1000, 7), b"through");
    // A right no window has (MW_BIND) is a bind error.
    let rights = Access::REMOTE_READ | Access::MW_BIND;
    assert_eq!(
        bind_with(&mut net, b, mw, 0x32, mr, 0x1000, 0x40, rights),
        WcStatus::MwBindErr
    );
}

#[test]
fn a_resend_does_not_run_a_local_operation_twice() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let k = fast_reg(&mut net, a, 0x8000, 0x42);
    let rsge = [sge(b, 0, 64)];
    recv(&mut net, b, 9, &rsge);
    let send = SendWr {
        wr_id: 1,
        op: SendOp::Send,
        payload: Payload::Inline(b"x"),
        flags: SendFlags::SIGNALED | SendFlags::INLINE,
        ud: None,
    };
    let inv = SendWr {
        wr_id: 2,
        op: SendOp::LocalInv {
            invalidate: Rkey(k.0),
        },
        payload: Payload::Sges(&[]),
        flags: SendFlags::SIGNALED,
        ud: None,
    };
    post(&mut net, a, &send);
    post(&mut net, a, &inv);
    // The SEND is lost; the LOCAL_INV behind it has already run.
    net.drop.insert(net.sent);
    let Quiet::Timer(t) = net.run(100) else {
        panic!("expected the retransmit timer")
    };
    assert!(e(&mut net, a).mr(k).is_none());
    net.advance_to(t);
    assert_eq!(net.run(100), Quiet::Idle);
    let got: Vec<(u64, WcStatus)> = poll(&mut net, a)
        .iter()
        .map(|w| (w.wr_id, w.status))
        .collect();
    assert_eq!(
        got,
        [(1, WcStatus::Success), (2, WcStatus::Success)],
        "in order, each once"
    );
    assert_eq!(qp_state(&mut net, a), QpState::Rts);
}

#[test]
fn destroying_a_qp_unbinds_its_type_2_windows() {
    let (mut net, _a, b) = pair(QpType::Rc, 7);
    let mr = bindable(&mut net, b);
    let mw = e(&mut net, b).alloc_mw(b.pd, MwType::Two).unwrap();
    assert_eq!(
        bind(&mut net, b, mw, 0x33, mr, 0x2000, 0x100),
        WcStatus::Success
    );
    let key = Rkey::new(mw.index(), 0x33);
    let eb = e(&mut net, b);
    assert!(eb.mw(key).unwrap().binding.is_some());
    eb.destroy_qp(b.qpn).unwrap();
    assert!(
        eb.mw(key).unwrap().binding.is_none(),
        "a reused QPN must not inherit it"
    );
    eb.dereg_mr(mr).unwrap();
}

#[test]
fn a_slot_reused_after_a_bind_gets_a_key_the_window_never_had() {
    let (mut net, _a, b) = pair(QpType::Rc, 7);
    let mr = bindable(&mut net, b);
    let mw = e(&mut net, b).alloc_mw(b.pd, MwType::One).unwrap();
    let bound = Rkey::new(mw.index(), mw.key().wrapping_add(1));
    assert_eq!(
        bind(&mut net, b, mw, bound.key(), mr, 0x1000, 0x100),
        WcStatus::Success
    );
    let eb = e(&mut net, b);
    eb.dealloc_mw(bound).unwrap();
    let (_, r) = eb
        .reg_mr(MrRequest {
            pd: b.pd,
            iova: BASE,
            length: 4096,
            access: Access::LOCAL_WRITE,
            translation: Translation::Identity,
        })
        .unwrap();
    assert_eq!(r.index(), mw.index(), "the slot is reused");
    assert_ne!(r, bound);
    assert_ne!(r, mw);
}

#[test]
fn messages_of_odd_lengths_at_every_path_mtu() {
    // PMTU 256, 1024 and 4096; lengths around the packet boundaries; RC
    // SEND with immediate, WRITE with immediate and READ, UC SEND and
    // WRITE. Every byte and every CQE field is checked.
    // Each also with the payloads lent by reference, as a gather-send
    // fabric polls.
    for (mtu, gather) in [Mtu::Mtu256, Mtu::Mtu1024, Mtu::Mtu4096]
        .into_iter()
        .flat_map(|m| [(m, false), (m, true)])
    {
        let m = mtu.bytes();
        for len in [1, m - 1, m, m + 1, 3 * m + 7] {
            for ty in [QpType::Rc, QpType::Uc] {
                let mut net = Net {
                    gather,
                    ..Net::default()
                };
                let a = side(&mut net, 1, ty, false);
                let b = side(&mut net, 2, ty, false);
                connect_mtu(&mut net, a, gid(2), b.qpn, 7, mtu);
                connect_mtu(&mut net, b, gid(1), a.qpn, 7, mtu);
                let data = pattern(len as usize, len as u8);
                fill(&mut net, a, 0, &data);
                let ops: Vec<(SendOp, WcOpcode)> = {
                    let mut v = vec![
                        (SendOp::SendWithImm { imm: len }, WcOpcode::Recv),
                        (
                            SendOp::RdmaWriteWithImm {
                                remote_addr: BASE + 0x8000,
                                rkey: b.rkey,
                                imm: !len,
                            },
                            WcOpcode::RecvRdmaWithImm,
                        ),
                    ];
                    if ty == QpType::Rc {
                        v.push((
                            SendOp::RdmaRead {
                                remote_addr: BASE + 0x8000,
                                rkey: b.rkey,
                            },
                            WcOpcode::Recv,
                        ));
                    }
                    v
                };
                for (i, (op, recv_op)) in ops.iter().enumerate() {
                    let rsge = [sge(b, 0, 16384)];
                    recv(&mut net, b, 100 + i as u64, &rsge);
                    let local = if matches!(op, SendOp::RdmaRead { .. }) {
                        0x4000
                    } else {
                        0
                    };
                    let ssge = [sge(a, local, len)];
                    let wr = SendWr {
                        wr_id: i as u64,
                        op: *op,
                        payload: Payload::Sges(&ssge),
                        flags: SendFlags::SIGNALED | SendFlags::SOLICITED,
                        ud: None,
                    };
                    post(&mut net, a, &wr);
                    assert_eq!(net.run(1000), Quiet::Idle, "{mtu:?} {len} {ty:?} {op:?}");
                    let sw = poll(&mut net, a);
                    assert_eq!(sw.len(), 1, "{mtu:?} {len} {ty:?} {op:?}");
                    let w = sw[0];
                    assert_eq!(
                        (w.wr_id, w.status, w.opcode, w.byte_len),
                        (i as u64, WcStatus::Success, op.wc_opcode(), len)
                    );
                    assert_eq!(
                        (w.qp_num, w.src_qp, w.wc_flags, w.imm_data),
                        (a.qpn.value(), 0, WcFlags::default(), 0)
                    );
                    match op {
                        SendOp::RdmaRead { .. } => {
                            assert_eq!(read(&net, a, 0x4000, len as usize), data);
                            assert!(poll(&mut net, b).is_empty());
                            // The unused receive is still posted.
                            e(&mut net, b)
                                .modify_qp(
                                    b.qpn,
                                    &QpAttr {
                                        qp_state: QpState::Err,
                                        ..QpAttr::default()
                                    },
                                    AttrMask::STATE,
                                )
                                .unwrap();
                            assert_eq!(poll(&mut net, b)[0].status, WcStatus::WrFlushErr);
                        }
                        _ => {
                            let rw = poll(&mut net, b);
                            assert_eq!(rw.len(), 1, "{mtu:?} {len} {ty:?} {op:?}");
                            let r = rw[0];
                            let imm = match op {
                                SendOp::SendWithImm { imm }
                                | SendOp::RdmaWriteWithImm { imm, .. } => *imm,
                                _ => 0,
                            };
                            assert_eq!(
                                (r.wr_id, r.status, r.opcode, r.byte_len),
                                (100 + i as u64, WcStatus::Success, *recv_op, len)
                            );
                            assert_eq!(
                                (r.qp_num, r.src_qp, r.wc_flags, r.imm_data),
                                (b.qpn.value(), 0, WcFlags::WITH_IMM, imm)
                            );
                            let at = if *recv_op == WcOpcode::Recv {
                                0
                            } else {
                                0x8000
                            };
                            assert_eq!(
                                read(&net, b, at, len as usize),
                                data,
                                "{mtu:?} {len} {ty:?}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_forged_read_response_acknowledges_nothing() {
    // A SEND is outstanding (its packet lost); a READ response for a PSN
    // far beyond anything sent must not complete it.
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let rsge = [sge(b, 0, 64)];
    recv(&mut net, b, 9, &rsge);
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::Send,
        payload: Payload::Inline(b"x"),
        flags: SendFlags::SIGNALED | SendFlags::INLINE,
        ud: None,
    };
    post(&mut net, a, &wr);
    net.drop.insert(0);
    let Quiet::Timer(t) = net.run(100) else {
        panic!("expected the retransmit timer")
    };
    let (next, _) = e(&mut net, a).qp_psns(a.qpn).unwrap();
    let forged = packet::Repr::new(
        vrdma_wire::bth::Repr {
            opcode: vrdma_wire::Opcode::RcReadResponseOnly,
            solicited: false,
            mig_req: false,
            pad_cnt: 0,
            pkey: vrdma_wire::PKey::DEFAULT,
            fecn: false,
            becn: false,
            dest_qp: a.qpn,
            ack_req: false,
            psn: next.wrapping_add(1000),
        },
        packet::ExtHeaders {
            aeth: Some(vrdma_wire::aeth::Repr {
                syndrome: vrdma_wire::aeth::Syndrome::Ack(vrdma_wire::aeth::CreditCode::INVALID),
                msn: vrdma_wire::Msn::from_masked(1),
            }),
            ..Default::default()
        },
        &[],
    );
    let mut bytes = vec![0; forged.buffer_len()];
    forged
        .emit(&mut packet::Packet::new_unchecked(&mut bytes[..]))
        .unwrap();
    let ip = IpRepr::V4(vrdma_wire::ipv4::Repr {
        src: Ipv4Addr::new(127, 0, 0, 2),
        dst: Ipv4Addr::new(127, 0, 0, 1),
        tos: 0,
        ident: 0,
        dont_frag: true,
        ttl: 64,
        payload_len: 0,
    });
    let node = &mut net.nodes[a.node];
    node.engine.handle_packet(0, &ip, &bytes, &mut node.mem);
    assert!(
        poll(&mut net, a).is_empty(),
        "the forged response completed the SEND"
    );
    net.advance_to(t);
    assert_eq!(net.run(100), Quiet::Idle);
    assert_eq!(poll(&mut net, a)[0].status, WcStatus::Success);
    assert_eq!(poll(&mut net, b)[0].wr_id, 9);
}

/// Over a same-host medium (`Net::same_host`) a lent payload travels in
/// runs of segments — one packet for a 20 000-byte WRITE, READ response or
/// SEND at MTU 1024 — each segment still taking its PSN, so a run lost is
/// resent whole after the timeout, and the bytes land as over the wire.
#[test]
fn a_same_host_medium_carries_runs_of_segments_each_with_its_psn() {
    for lose_first in [false, true] {
        let (mut net, a, b) = pair(QpType::Rc, 7);
        net.same_host();
        let data = pattern(20_000, 9);
        fill(&mut net, a, 0, &data);
        fill(&mut net, b, 0x8000, &data);
        if lose_first {
            net.drop.insert(0);
        }
        let (psn0, _) = e(&mut net, a).qp_psns(a.qpn).unwrap();
        let r = [sge(b, 0x4000, 20_000)];
        recv(&mut net, b, 7, &r);
        let write = [sge(a, 0, 20_000)];
        let into = [sge(a, 0xa000, 20_000)];
        for (id, op, s) in [
            (
                1,
                SendOp::RdmaWrite {
                    remote_addr: BASE,
                    rkey: b.rkey,
                },
                &write,
            ),
            (
                2,
                SendOp::RdmaRead {
                    remote_addr: BASE + 0x8000,
                    rkey: b.rkey,
                },
                &into,
            ),
            (3, SendOp::Send, &write),
        ] {
            let wr = SendWr {
                wr_id: id,
                op,
                payload: Payload::Sges(s),
                flags: SendFlags::SIGNALED,
                ud: None,
            };
            e(&mut net, a).post_send(a.qpn, &wr).unwrap();
        }
        let mut rounds = 0;
        loop {
            match net.run(100) {
                Quiet::Idle => break,
                Quiet::Timer(t) => net.advance_to(t),
                Quiet::Busy => panic!("never quiet"),
            }
            rounds += 1;
            assert!(rounds < 20, "no progress");
        }
        let sw = poll(&mut net, a);
        let got: Vec<_> = sw.iter().map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(
            got,
            [1, 2, 3].map(|i| (i, WcStatus::Success)),
            "lose_first {lose_first}"
        );
        assert_eq!(read(&net, b, 0, 20_000), data);
        assert_eq!(read(&net, a, 0xa000, 20_000), data);
        assert_eq!(read(&net, b, 0x4000, 20_000), data);
        // 20 segments a message: 40 request PSNs (the READ's included).
        let (psn, _) = e(&mut net, a).qp_psns(a.qpn).unwrap();
        assert_eq!(psn, psn0.wrapping_add(60));
        // Three runs and their answers (and the lost run's resend) — not
        // 60 MTU-sized packets.
        assert!(net.delivered <= 8, "{} packets", net.delivered);
        // The lost run resent (twice: a timeout's first resend goes out
        // twice), nothing else.
        assert_eq!(
            e(&mut net, a).stats().tx_retransmitted,
            if lose_first { 2 } else { 0 }
        );
    }
}

/// A run of segments is taken only from a peer whose medium carries such
/// runs ([`Engine::set_jumbo`]): from any other it is an over-long packet,
/// refused with an invalid-request NAK, and nothing is written.
#[test]
fn a_run_of_segments_from_a_wire_peer_is_an_invalid_request() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    net.same_host();
    e(&mut net, b).set_jumbo(&[]);
    let data = pattern(20_000, 3);
    fill(&mut net, a, 0, &data);
    let s = [sge(a, 0, 20_000)];
    send(
        &mut net,
        a,
        5,
        SendOp::RdmaWrite {
            remote_addr: BASE,
            rkey: b.rkey,
        },
        &s,
        SendFlags::SIGNALED,
    );
    net.run(100);
    let sw = poll(&mut net, a);
    assert_eq!(
        sw.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(5, WcStatus::RemInvReqErr)]
    );
    assert_eq!(read(&net, b, 0, 20_000), vec![0; 20_000]);
    assert_eq!(e(&mut net, b).stats().rx_malformed, 1);
}

/// Every way an MR's grant ends revokes the fence its lent payloads carry
/// (`vrdma_engine::fence`): a SEND with invalidate that arrives lent on (its
/// wait comes after the packet, `Engine::finish_revocations`), LOCAL_INV,
/// DEREG_MR; a new registration of the same MR comes with an open fence.
#[test]
fn the_end_of_an_mrs_grant_revokes_its_fence() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    net.same_host();
    let k = fast_reg(&mut net, b, 0x8000, 7);
    let fence = e(&mut net, b).mr(k).unwrap().fence.clone();
    assert!(!fence.is_revoked());
    let data = pattern(8000, 4);
    fill(&mut net, a, 0, &data);
    let rsge = [sge(b, 0x1000, 8000)];
    recv(&mut net, b, 9, &rsge);
    let s = [sge(a, 0, 8000)];
    send(
        &mut net,
        a,
        1,
        SendOp::SendWithInv {
            invalidate: Rkey(k.0),
        },
        &s,
        SendFlags::SIGNALED,
    );
    net.run(100);
    let wc = poll(&mut net, b);
    assert!(wc[0].wc_flags.contains(WcFlags::WITH_INV));
    assert_eq!(read(&net, b, 0x1000, 8000), data, "lent on, one run");
    assert!(fence.is_revoked(), "SEND with invalidate");
    // Registered again: a new, open fence; LOCAL_INV revokes it.
    let k = fast_reg(&mut net, b, 0x8000, 8);
    let fence = e(&mut net, b).mr(k).unwrap().fence.clone();
    assert!(!fence.is_revoked());
    send(
        &mut net,
        b,
        2,
        SendOp::LocalInv {
            invalidate: Rkey(k.0),
        },
        &[],
        SendFlags::SIGNALED,
    );
    net.run(100);
    assert_eq!(poll(&mut net, b)[0].status, WcStatus::Success);
    assert!(fence.is_revoked(), "LOCAL_INV");
    let regular = e(&mut net, a).mr(a.lkey).unwrap().fence.clone();
    e(&mut net, a).dereg_mr(a.lkey).unwrap();
    assert!(regular.is_revoked(), "DEREG_MR");
}
