//! RoCEv2 over real UDP sockets on loopback: two devices, each on its own
//! 127.0.0.x address (IPv6: two QPs of one device on ::1), exchanging
//! every operation; packets that are not RoCEv2 are counted and dropped.
//!
//! Each test uses its own addresses, so that the tests of this file can
//! run in parallel. Both devices progress in the test's thread; the time
//! limit only turns a hang into a failure.

mod common;

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
    time::{Duration, Instant},
};

use common::{
    BASE, ah, bytes, connect, end, fill, qp, receive, recv, run_until, same, send, send_ud,
};
use vrdma_device::{GuestMem, udp_device};
use vrdma_engine::{
    AhHandle, Memory,
    attr::{DeviceAttr, Mtu},
    qp::QpType,
    wc::{WcOpcode, WcStatus},
    wr::SendOp,
};
use vrdma_fabric::udp::Config;
use vrdma_wire::{Gid, Qpn};

fn v4(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 7, last))
}

#[test]
fn rc_every_operation_over_loopback_udp() {
    for mtu in [Mtu::Mtu1024, Mtu::Mtu4096] {
        let last = if mtu == Mtu::Mtu1024 { 1 } else { 3 };
        let mut a = end(v4(last), mtu);
        let mut b = end(v4(last + 1), mtu);
        let qa = qp(&mut a, QpType::Rc);
        let qb = qp(&mut b, QpType::Rc);
        let (ga, gb) = (a.dev.transport().gid(), b.dev.transport().gid());
        connect(&mut a, qa, gb, qb, mtu);
        connect(&mut b, qb, ga, qa, mtu);

        // SEND of 100 kB into a posted receive (through the PSN wrap).
        let len = 100_000;
        fill(&mut a, BASE, len, 1);
        recv(&mut b, qb, 7, BASE + 0x20_0000, len as u32);
        send(&mut a, qa, 1, SendOp::Send, BASE, len as u32);
        // 1 MiB RDMA WRITE.
        let wlen = 1 << 20;
        fill(&mut a, BASE + 0x10_0000, wlen, 2);
        let write = SendOp::RdmaWrite {
            remote_addr: BASE + 0x10_0000,
            rkey: b.rkey,
        };
        send(&mut a, qa, 2, write, BASE + 0x10_0000, wlen as u32);
        // READ back 64 kB of what B holds.
        fill(&mut b, BASE + 0x30_0000, 65536, 3);
        let read = SendOp::RdmaRead {
            remote_addr: BASE + 0x30_0000,
            rkey: b.rkey,
        };
        send(&mut a, qa, 3, read, BASE + 0x38_0000, 65536);
        // FETCH_ADD on a word of B.
        let word = BASE + 0x3f_0000;
        b.dev
            .mem_mut()
            .write(BASE + 0x3f_0000, &40u64.to_le_bytes())
            .unwrap();
        let fa = SendOp::FetchAdd {
            remote_addr: word,
            rkey: b.rkey,
            add: 2,
        };
        send(&mut a, qa, 4, fa, BASE + 0x3f_8000, 8);

        let wcs = run_until(&mut a, &mut b, 4);
        let ids: Vec<_> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(ids, [1, 2, 3, 4].map(|i| (i, WcStatus::Success)), "{mtu:?}");
        let mut rx = Vec::new();
        b.dev.engine_mut().poll_cq(b.cq, 8, &mut rx).unwrap();
        assert_eq!(rx.len(), 1);
        assert_eq!(
            (rx[0].wr_id, rx[0].status, rx[0].byte_len),
            (7, WcStatus::Success, len as u32)
        );
        same(
            bytes(&b, BASE + 0x20_0000, len),
            bytes(&a, BASE, len),
            "SEND",
        );
        same(
            bytes(&b, BASE + 0x10_0000, wlen),
            bytes(&a, BASE + 0x10_0000, wlen),
            "WRITE",
        );
        same(
            bytes(&a, BASE + 0x38_0000, 65536),
            bytes(&b, BASE + 0x30_0000, 65536),
            "READ",
        );
        assert_eq!(bytes(&a, BASE + 0x3f_8000, 8), 40u64.to_le_bytes());
        assert_eq!(bytes(&b, word, 8), 42u64.to_le_bytes());

        // Every packet was a good RoCEv2 packet; each QP sent from its
        // own source port.
        for e in [&a, &b] {
            let s = e.dev.transport().stats();
            assert_eq!(
                (s.rx_bad_icrc, s.rx_malformed, s.tx_failed),
                (0, 0, 0),
                "{s:?}"
            );
            assert_eq!(s.src_port_fallback, 0);
            assert!(s.tx_datagrams > 0 && s.rx_datagrams > 0);
            assert!(s.tx_calls < s.tx_datagrams, "no batching: {s:?}");
        }
        assert_eq!(
            a.dev.transport().stats().tx_datagrams,
            b.dev.transport().stats().rx_datagrams,
            "loopback lost nothing"
        );
    }
}

#[test]
fn uc_and_ud_over_loopback_udp() {
    let mtu = Mtu::Mtu1024;
    let mut a = end(v4(5), mtu);
    let mut b = end(v4(6), mtu);
    // UC: a 3-packet WRITE with immediate, which consumes a receive.
    let (ua, ub) = (qp(&mut a, QpType::Uc), qp(&mut b, QpType::Uc));
    let (ga, gb) = (a.dev.transport().gid(), b.dev.transport().gid());
    connect(&mut a, ua, gb, ub, mtu);
    connect(&mut b, ub, ga, ua, mtu);
    fill(&mut a, BASE, 3000, 9);
    recv(&mut b, ub, 70, BASE + 0x1000, 0);
    let op = SendOp::RdmaWriteWithImm {
        remote_addr: BASE + 0x8000,
        rkey: b.rkey,
        imm: 0x1122_3344,
    };
    send(&mut a, ua, 11, op, BASE, 3000);
    let wcs = run_until(&mut a, &mut b, 1);
    assert_eq!((wcs[0].wr_id, wcs[0].status), (11, WcStatus::Success));
    let rx = receive(&mut b, 1, "UC WRITE_WITH_IMM");
    assert_eq!(rx[0].opcode, WcOpcode::RecvRdmaWithImm);
    assert_eq!((rx[0].imm_data, rx[0].byte_len), (0x1122_3344, 3000));
    same(
        bytes(&b, BASE + 0x8000, 3000),
        bytes(&a, BASE, 3000),
        "UC WRITE",
    );

    // UD: a datagram to B's QP through an address handle; the receive
    // holds the GRH (the IPv4 header in its last 20 bytes) then the data.
    let (da, db) = (qp(&mut a, QpType::Ud), qp(&mut b, QpType::Ud));
    for (e, q) in [(&mut a, da), (&mut b, db)] {
        connect(e, q, Gid::default(), Qpn::default(), mtu);
    }
    let ah = ah(&mut a, gb, 0, 64);
    recv(&mut b, db, 80, BASE + 0x2_0000, 40 + 1024);
    fill(&mut a, BASE + 0x4000, 1024, 5);
    send_ud(&mut a, da, 12, (BASE + 0x4000, 1024), ah, db);
    let wcs = run_until(&mut a, &mut b, 1);
    assert_eq!((wcs[0].wr_id, wcs[0].status), (12, WcStatus::Success));
    let rx = receive(&mut b, 1, "UD datagram");
    assert_eq!(
        (rx[0].wr_id, rx[0].byte_len, rx[0].src_qp),
        (80, 40 + 1024, da.value())
    );
    let grh = bytes(&b, BASE + 0x2_0000, 40).to_vec();
    assert_eq!(
        &grh[20 + 12..20 + 16],
        &[127, 0, 7, 5],
        "GRH source address"
    );
    assert_eq!(
        &grh[20 + 16..20 + 20],
        &[127, 0, 7, 6],
        "GRH destination address"
    );
    assert_eq!(grh[20 + 8], 64, "TTL");
    same(
        bytes(&b, BASE + 0x2_0000 + 40, 1024),
        bytes(&a, BASE + 0x4000, 1024),
        "UD SEND",
    );
}

/// Each datagram leaves with its address handle's traffic class and hop
/// limit (the device's TOS when the class is 0), whether its source
/// socket has them as options or they travel as ancillary data, and when
/// one QP switches between handles (the socket's options follow a run of
/// 64 datagrams of one kind): the receiver's GRH shows the IPv4 header.
#[test]
fn every_datagram_carries_its_traffic_class_and_hop_limit() {
    let mtu = Mtu::Mtu1024;
    let mut config = Config::new(v4(13));
    config.tos = 0x60;
    let mut a = common::end_with(config, Some(mtu));
    let mut b = end(v4(14), mtu);
    let (da, db) = (qp(&mut a, QpType::Ud), qp(&mut b, QpType::Ud));
    for (e, q) in [(&mut a, da), (&mut b, db)] {
        connect(e, q, Gid::default(), Qpn::default(), mtu);
    }
    let gb = b.dev.transport().gid();
    // (traffic class, hop limit) as the handle says, and as the wire must.
    let kinds = [
        ((0xb9, 7), (0xb9, 7)),
        ((0x48, 200), (0x48, 200)),
        ((0, 64), (0x60, 64)),
    ];
    let ahs: Vec<AhHandle> = kinds
        .iter()
        .map(|&((traffic_class, hop_limit), _)| ah(&mut a, gb, traffic_class, hop_limit))
        .collect();
    // One of the first kind, a run of the second long enough to move the
    // socket's options, then the others in turn.
    let mut plan = vec![0];
    plan.extend([1; 70]);
    plan.extend([0, 2, 1, 2, 0, 0]);
    const SLOT: u64 = 0x100;
    const RX: u64 = BASE + 0x2_0000;
    let mut done = 0;
    for (round, chunk) in plan.chunks(32).enumerate() {
        for (k, &kind) in chunk.iter().enumerate() {
            let i = (round * 32 + k) as u64;
            recv(&mut b, db, i, RX + i * SLOT, 40 + 16);
            fill(&mut a, BASE + i * SLOT, 16, i as u8);
            send_ud(&mut a, da, i, (BASE + i * SLOT, 16), ahs[kind], db);
        }
        let sent = run_until(&mut a, &mut b, chunk.len());
        assert!(
            sent.iter().all(|w| w.status == WcStatus::Success),
            "{sent:?}"
        );
        let rx = receive(&mut b, chunk.len(), "UD datagrams");
        for w in &rx {
            let i = w.wr_id as usize;
            assert_eq!(
                (w.status, w.byte_len),
                (WcStatus::Success, 40 + 16),
                "datagram {i}"
            );
            let grh = bytes(&b, RX + i as u64 * SLOT, 40);
            let (_, (tos, ttl)) = kinds[plan[i]];
            assert_eq!(
                (grh[20 + 1], grh[20 + 8]),
                (tos, ttl),
                "datagram {i}: TOS, TTL"
            );
            same(
                bytes(&b, RX + i as u64 * SLOT + 40, 16),
                bytes(&a, BASE + i as u64 * SLOT, 16),
                "UD SEND",
            );
            done += 1;
        }
    }
    assert_eq!(done, plan.len());
}

#[test]
fn rc_over_ipv6_loopback() {
    // ::1 is the only IPv6 loopback address: two QPs of one device talk
    // to each other through the socket.
    let mut end_a = end(IpAddr::V6(Ipv6Addr::LOCALHOST), Mtu::Mtu1024);
    let cq = end_a.cq;
    let q1 = qp(&mut end_a, QpType::Rc);
    let q2 = qp(&mut end_a, QpType::Rc);
    let g = end_a.dev.transport().gid();
    connect(&mut end_a, q1, g, q2, Mtu::Mtu1024);
    connect(&mut end_a, q2, g, q1, Mtu::Mtu1024);
    fill(&mut end_a, BASE, 5000, 4);
    let op = SendOp::RdmaWrite {
        remote_addr: BASE + 0x10_0000,
        rkey: end_a.rkey,
    };
    send(&mut end_a, q1, 1, op, BASE, 5000);
    let limit = Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    while got.is_empty() {
        end_a.dev.progress().unwrap();
        end_a.dev.engine_mut().poll_cq(cq, 8, &mut got).unwrap();
        assert!(Instant::now() < limit, "no completion over IPv6");
    }
    assert_eq!((got[0].wr_id, got[0].status), (1, WcStatus::Success));
    same(
        bytes(&end_a, BASE + 0x10_0000, 5000),
        bytes(&end_a, BASE, 5000),
        "IPv6 WRITE",
    );
    let s = end_a.dev.transport().stats();
    assert_eq!((s.rx_bad_icrc, s.rx_malformed), (0, 0), "{s:?}");
}

#[test]
fn the_port_mtu_follows_the_interface() {
    // Loopback's MTU is 65536.
    let mem = GuestMem::anonymous(BASE, 4096).unwrap();
    let dev = udp_device(Config::new(v4(12)), DeviceAttr::default(), None, mem).unwrap();
    assert_eq!(dev.engine().query_port(1).unwrap().active_mtu, Mtu::Mtu4096);
}

#[test]
fn garbage_datagrams_are_counted_and_dropped() {
    let mtu = Mtu::Mtu1024;
    let mut a = end(v4(9), mtu);
    let mut b = end(v4(10), mtu);
    let (qa, qb) = (qp(&mut a, QpType::Rc), qp(&mut b, QpType::Rc));
    let (ga, gb) = (a.dev.transport().gid(), b.dev.transport().gid());
    connect(&mut a, qa, gb, qb, mtu);
    connect(&mut b, qb, ga, qa, mtu);

    // A stranger sends B: an empty datagram, a short one, a packet whose
    // ICRC is wrong, and one longer than any RoCEv2 packet.
    let stranger = UdpSocket::bind((Ipv4Addr::new(127, 0, 7, 11), 0)).unwrap();
    let to = SocketAddr::new(v4(10), 4791);
    stranger.send_to(&[], to).unwrap();
    stranger.send_to(&[0x04; 10], to).unwrap();
    let mut bad = [0u8; 32];
    bad[0] = 0x04; // RC SEND_ONLY
    bad[1] = 0x40;
    bad[2] = 0xff;
    bad[3] = 0xff;
    bad[7] = qb.value() as u8;
    stranger.send_to(&bad, to).unwrap();
    stranger.send_to(&vec![0u8; 9000], to).unwrap();

    // Valid traffic still flows.
    fill(&mut a, BASE, 64, 8);
    recv(&mut b, qb, 1, BASE + 0x100, 64);
    send(&mut a, qa, 2, SendOp::Send, BASE, 64);
    run_until(&mut a, &mut b, 1);
    let s = b.dev.transport().stats();
    assert_eq!(s.rx_bad_icrc, 1, "{s:?}"); // the 32-byte one
    // Empty, 10 bytes, and 9000 bytes (longer than any RoCEv2 packet).
    assert_eq!(s.rx_malformed, 3, "{s:?}");
    same(bytes(&b, BASE + 0x100, 64), bytes(&a, BASE, 64), "SEND");
}
