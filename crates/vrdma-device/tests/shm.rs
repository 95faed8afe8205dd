//! Same-host shared memory: devices of one process on one switch
//! (`vrdma_fabric::shm`) in front of their UDP ports. Every operation runs
//! over shm with nothing on the UDP sockets; a peer not on the switch is
//! still reached over UDP; the receiving engine's checks (keys, rights,
//! bounds) apply as for a packet from the wire; a peer that goes away
//! ends its partners' work in error completions; a device sleeping on its
//! descriptor wakes for a packet from shm.
//!
//! Each test uses its own 127.0.8.x addresses (the UDP ports are bound
//! even when unused), so that the tests can run in parallel.

mod common;

use std::{
    net::{IpAddr, Ipv4Addr},
    thread,
    time::{Duration, Instant},
};

use common::{
    BASE, End, ah, bytes, connect, end, end_on, fill, qp, receive, recv, run_until, same, send,
    send_ud,
};
use vrdma_device::{Transport, transport::SameHost};
use vrdma_engine::{
    Memory,
    attr::Mtu,
    qp::QpType,
    wc::{WcOpcode, WcStatus},
    wr::SendOp,
};
use vrdma_fabric::{
    shm::{JoinConfig, Switch},
    udp::UdpPort,
};
use vrdma_testkit::setup::Connection;
use vrdma_wire::{Gid, Psn, Qpn};

fn v4(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 8, last))
}

type ShmEnd = End<SameHost<UdpPort>>;

/// The named counter of a device.
fn counter<T: Transport>(e: &End<T>, name: &str) -> u64 {
    e.dev
        .counters()
        .into_iter()
        .find(|(k, _)| k == name)
        .map_or_else(|| panic!("no counter {name}"), |(_, n)| n)
}

/// Whether `fd` becomes readable within `ms` milliseconds.
fn readable(fd: std::os::fd::BorrowedFd<'_>, ms: u16) -> bool {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    poll(&mut fds, PollTimeout::from(ms)).expect("poll") > 0
}

/// Two devices on one switch with an RC QP each, connected.
fn rc_pair(sw: &Switch, last: u8, mtu: Mtu) -> (ShmEnd, ShmEnd, Qpn, Qpn) {
    let mut a = end_on(sw, v4(last), mtu);
    let mut b = end_on(sw, v4(last + 1), mtu);
    let (qa, qb) = (qp(&mut a, QpType::Rc), qp(&mut b, QpType::Rc));
    let (ga, gb) = (a.gid, b.gid);
    connect(&mut a, qa, gb, qb, mtu);
    connect(&mut b, qb, ga, qa, mtu);
    (a, b, qa, qb)
}

/// Every RC operation from `a` to `b` (SEND 100 kB, WRITE 1 MiB, READ
/// 64 KiB, FETCH_ADD, COMPARE_SWAP, WRITE with immediate), each byte and
/// completion checked; then that none of it went over UDP and nothing was
/// lost or malformed.
fn every_rc_operation(a: &mut ShmEnd, b: &mut ShmEnd, qa: Qpn, qb: Qpn, what: &str) {
    let len = 100_000;
    fill(a, BASE, len, 1);
    recv(b, qb, 7, BASE + 0x20_0000, len as u32);
    send(a, qa, 1, SendOp::Send, BASE, len as u32);
    let wlen = 1 << 20;
    fill(a, BASE + 0x10_0000, wlen, 2);
    let write = SendOp::RdmaWrite {
        remote_addr: BASE + 0x10_0000,
        rkey: b.rkey,
    };
    send(a, qa, 2, write, BASE + 0x10_0000, wlen as u32);
    fill(b, BASE + 0x30_0000, 65536, 3);
    let read = SendOp::RdmaRead {
        remote_addr: BASE + 0x30_0000,
        rkey: b.rkey,
    };
    send(a, qa, 3, read, BASE + 0x38_0000, 65536);
    let word = BASE + 0x3f_0000;
    b.dev.mem_mut().write(word, &40u64.to_le_bytes()).unwrap();
    let fa = SendOp::FetchAdd {
        remote_addr: word,
        rkey: b.rkey,
        add: 2,
    };
    send(a, qa, 4, fa, BASE + 0x3f_8000, 8);
    let cs = SendOp::CompareSwap {
        remote_addr: word,
        rkey: b.rkey,
        compare: 42,
        swap: 7,
    };
    send(a, qa, 5, cs, BASE + 0x3f_8008, 8);
    recv(b, qb, 8, BASE + 0x3e_0000, 0);
    let wimm = SendOp::RdmaWriteWithImm {
        remote_addr: BASE + 0x3d_0000,
        rkey: b.rkey,
        imm: 0xfeed_f00d,
    };
    send(a, qa, 6, wimm, BASE, 5000);

    let wcs = run_until(a, b, 6);
    let ids: Vec<_> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(
        ids,
        [1, 2, 3, 4, 5, 6].map(|i| (i, WcStatus::Success)),
        "{what}"
    );
    let rx = receive(b, 2, "the SEND and the WRITE with immediate");
    assert_eq!(
        (rx[0].wr_id, rx[0].status, rx[0].byte_len),
        (7, WcStatus::Success, len as u32)
    );
    assert_eq!(
        (rx[1].wr_id, rx[1].opcode, rx[1].imm_data, rx[1].byte_len),
        (8, WcOpcode::RecvRdmaWithImm, 0xfeed_f00d, 5000)
    );
    same(bytes(b, BASE + 0x20_0000, len), bytes(a, BASE, len), "SEND");
    same(
        bytes(b, BASE + 0x10_0000, wlen),
        bytes(a, BASE + 0x10_0000, wlen),
        "WRITE",
    );
    same(
        bytes(a, BASE + 0x38_0000, 65536),
        bytes(b, BASE + 0x30_0000, 65536),
        "READ",
    );
    same(
        bytes(b, BASE + 0x3d_0000, 5000),
        bytes(a, BASE, 5000),
        "WRITE with immediate",
    );
    assert_eq!(bytes(a, BASE + 0x3f_8000, 8), 40u64.to_le_bytes());
    assert_eq!(bytes(a, BASE + 0x3f_8008, 8), 42u64.to_le_bytes());
    assert_eq!(bytes(b, word, 8), 7u64.to_le_bytes());

    // All of it through shared memory: nothing on the sockets, nothing
    // lost, and the engines saw every packet.
    for e in [&*a, &*b] {
        assert_eq!(counter(e, "udp.tx_datagrams"), 0, "{what}");
        assert_eq!(counter(e, "udp.rx_datagrams"), 0, "{what}");
        assert_eq!(counter(e, "shm.tx_dropped_full"), 0, "{what}");
        assert_eq!(counter(e, "shm.rx_refused"), 0, "{what}");
        assert_eq!(counter(e, "engine.rx_malformed"), 0, "{what}");
    }
    assert_eq!(
        counter(a, "shm.tx_packets"),
        counter(b, "shm.rx_packets"),
        "{what}"
    );
    assert_eq!(
        counter(b, "shm.tx_packets"),
        counter(a, "shm.rx_packets"),
        "{what}"
    );
    assert!(counter(a, "shm.tx_bytes") > wlen as u64 + len as u64);
    assert_eq!(
        counter(b, "engine.rx_packets"),
        counter(b, "shm.rx_packets")
    );
}

#[test]
fn rc_every_operation_over_shm_and_nothing_on_udp() {
    for (mtu, last) in [(Mtu::Mtu1024, 1), (Mtu::Mtu4096, 3)] {
        let sw = Switch::new();
        let (mut a, mut b, qa, qb) = rc_pair(&sw, last, mtu);
        every_rc_operation(&mut a, &mut b, qa, qb, &format!("{mtu:?}"));
        // Devices of one process: the long payloads were lent on (one
        // copy) in runs of segments, not cut into MTUs — the 1 MiB WRITE
        // alone would be 256 packets at 4 KiB, 1024 at 1 KiB.
        let per_run = (mtu.bytes() * vrdma_engine::datapath::JUMBO_PSNS) as u64;
        assert!(counter(&b, "shm.rx_lent") >= (1 << 20) / per_run, "{mtu:?}");
        assert!(
            counter(&a, "shm.rx_lent") >= 1,
            "{mtu:?}: the READ's response"
        );
        assert!(
            counter(&b, "shm.rx_packets") < (1 << 20) / u64::from(mtu.bytes()),
            "{mtu:?}"
        );
        assert_eq!(counter(&b, "loan.refused"), 0);
    }
}

/// An RC QP on each of `a` and `b`, connected, with short timeouts
/// (4.096 µs · 2^8, about 1 ms a try, 2 retries).
fn short_pair(a: &mut ShmEnd, b: &mut ShmEnd, mtu: Mtu) -> (Qpn, Qpn) {
    let (qa, qb) = (qp(a, QpType::Rc), qp(b, QpType::Rc));
    let short = Connection {
        mtu,
        psn: Psn::from_masked(1),
        timeout: 8,
        retry_cnt: 2,
        ..Connection::default()
    };
    short.join(a.dev.engine_mut(), qa, b.gid, qb);
    short.join(b.dev.engine_mut(), qb, a.gid, qa);
    (qa, qb)
}

/// [`short_pair`], and a 2 MiB WRITE from `a` to `b` under way: returns
/// once part of it reached `b`.
fn write_under_way(a: &mut ShmEnd, b: &mut ShmEnd, mtu: Mtu) {
    let (qa, _) = short_pair(a, b, mtu);
    let op = SendOp::RdmaWrite {
        remote_addr: BASE,
        rkey: b.rkey,
    };
    send(a, qa, 1, op, BASE, 2 << 20);
    let limit = Instant::now() + Duration::from_secs(10);
    while counter(b, "shm.rx_packets") == 0 {
        a.dev.progress().unwrap();
        b.dev.progress().unwrap();
        assert!(Instant::now() < limit, "nothing reached b");
    }
}

/// A rendezvous directory of this test's own.
fn rendezvous_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("vrdma-shm-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Waits (10 s at most) until `sw` reaches `gid` (the rendezvous threads
/// exchange addresses on their own time).
fn until_reached(sw: &Switch, gid: &Gid) {
    let limit = Instant::now() + Duration::from_secs(10);
    while !sw.holds(&sw.default_network(), gid) {
        assert!(Instant::now() < limit, "{gid:?} not announced within 10 s");
        thread::sleep(Duration::from_millis(2));
    }
}

/// Two daemons — two switches that joined one rendezvous directory, a
/// device on each: every RC operation through the rings between them,
/// nothing on UDP.
#[test]
fn devices_of_two_daemons_run_every_operation_through_rings() {
    let d = rendezvous_dir("two");
    let mtu = Mtu::Mtu4096;
    let (sa, sb) = (Switch::new(), Switch::new());
    let ra = sa.join(JoinConfig::new(&d)).unwrap();
    let rb = sb.join(JoinConfig::new(&d)).unwrap();
    let mut a = end_on(&sa, v4(50), mtu);
    let mut b = end_on(&sb, v4(51), mtu);
    until_reached(&sa, &b.gid);
    until_reached(&sb, &a.gid);
    let (qa, qb) = (qp(&mut a, QpType::Rc), qp(&mut b, QpType::Rc));
    let (ga, gb) = (a.gid, b.gid);
    connect(&mut a, qa, gb, qb, mtu);
    connect(&mut b, qb, ga, qa, mtu);
    every_rc_operation(&mut a, &mut b, qa, qb, "two daemons");
    drop((rb, ra));
}

/// A daemon that goes away mid-transfer (its device and its membership
/// dropped): its partner's WRITE in flight ends in RETRY_EXC_ERR, and the
/// partner serves on — a device of its own daemon still reaches it.
#[test]
fn a_daemon_gone_mid_transfer_costs_an_error_completion_only() {
    let d = rendezvous_dir("gone");
    let mtu = Mtu::Mtu1024;
    let (sa, sb) = (Switch::new(), Switch::new());
    let _ra = sa.join(JoinConfig::new(&d)).unwrap();
    let rb = sb.join(JoinConfig::new(&d)).unwrap();
    let mut a = end_on(&sa, v4(52), mtu);
    let mut b = end_on(&sb, v4(53), mtu);
    let mut c = end_on(&sa, v4(54), mtu);
    until_reached(&sa, &b.gid);
    until_reached(&sb, &a.gid);
    write_under_way(&mut a, &mut b, mtu);
    drop((b, rb, sb));
    let wcs = receive(&mut a, 1, "the WRITE's end");
    assert_eq!(wcs[0].status, WcStatus::RetryExcErr);
    // a serves on: its own daemon's c reaches it.
    let (qa2, qc) = (qp(&mut a, QpType::Rc), qp(&mut c, QpType::Rc));
    let (ga, gc) = (a.gid, c.gid);
    connect(&mut a, qa2, gc, qc, mtu);
    connect(&mut c, qc, ga, qa2, mtu);
    fill(&mut c, BASE, 4096, 8);
    recv(&mut a, qa2, 9, BASE + 0x1000, 4096);
    send(&mut c, qc, 10, SendOp::Send, BASE, 4096);
    let wcs = run_until(&mut c, &mut a, 1);
    assert_eq!(wcs[0].status, WcStatus::Success);
    let rx = receive(&mut a, 1, "c's SEND");
    assert_eq!(rx[0].wr_id, 9);
}

#[test]
fn uc_and_ud_over_shm_with_the_grh_of_the_wire() {
    let mtu = Mtu::Mtu1024;
    let sw = Switch::new();
    let mut a = end_on(&sw, v4(5), mtu);
    let mut b = end_on(&sw, v4(6), mtu);
    let (ua, ub) = (qp(&mut a, QpType::Uc), qp(&mut b, QpType::Uc));
    let (ga, gb) = (a.gid, b.gid);
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
    assert_eq!((rx[0].imm_data, rx[0].byte_len), (0x1122_3344, 3000));
    same(
        bytes(&b, BASE + 0x8000, 3000),
        bytes(&a, BASE, 3000),
        "UC WRITE",
    );

    let (da, db) = (qp(&mut a, QpType::Ud), qp(&mut b, QpType::Ud));
    for (e, q) in [(&mut a, da), (&mut b, db)] {
        connect(e, q, Gid::default(), Qpn::default(), mtu);
    }
    let ah = ah(&mut a, gb, 0x20, 9);
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
    // The GRH is the IPv4 header the packet would have had on the wire.
    let grh = bytes(&b, BASE + 0x2_0000, 40);
    assert_eq!(&grh[20 + 12..20 + 16], &[127, 0, 8, 5], "source address");
    assert_eq!(&grh[20 + 16..20 + 20], &[127, 0, 8, 6], "destination");
    assert_eq!((grh[20 + 1], grh[20 + 8]), (0x20, 9), "TOS and TTL");
    same(
        bytes(&b, BASE + 0x2_0000 + 40, 1024),
        bytes(&a, BASE + 0x4000, 1024),
        "UD SEND",
    );
    assert_eq!(counter(&a, "udp.tx_datagrams"), 0);
}

/// A device on the switch reaches a peer that is not on it over UDP, and
/// one that is over shm, from the same QP type and the same CQ.
#[test]
fn the_path_is_chosen_per_destination() {
    let mtu = Mtu::Mtu1024;
    let sw = Switch::new();
    let mut a = end_on(&sw, v4(10), mtu);
    let mut b = end_on(&sw, v4(11), mtu);
    let mut c = end(v4(12), mtu);
    let (qab, qb) = (qp(&mut a, QpType::Rc), qp(&mut b, QpType::Rc));
    let (qac, qc) = (qp(&mut a, QpType::Rc), qp(&mut c, QpType::Rc));
    let (ga, gb, gc) = (a.gid, b.gid, c.gid);
    connect(&mut a, qab, gb, qb, mtu);
    connect(&mut b, qb, ga, qab, mtu);
    connect(&mut a, qac, gc, qc, mtu);
    connect(&mut c, qc, ga, qac, mtu);
    fill(&mut a, BASE, 20_000, 4);
    for (qpn, rkey, id) in [(qab, b.rkey, 1), (qac, c.rkey, 2)] {
        let op = SendOp::RdmaWrite {
            remote_addr: BASE + 0x10_0000,
            rkey,
        };
        send(&mut a, qpn, id, op, BASE, 20_000);
    }
    let limit = Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    while got.len() < 2 {
        a.dev.progress().unwrap();
        b.dev.progress().unwrap();
        c.dev.progress().unwrap();
        a.dev.engine_mut().poll_cq(a.cq, 8, &mut got).unwrap();
        assert!(Instant::now() < limit, "only {got:?}");
    }
    assert!(got.iter().all(|w| w.status == WcStatus::Success), "{got:?}");
    for e in [
        &bytes(&b, BASE + 0x10_0000, 20_000),
        &bytes(&c, BASE + 0x10_0000, 20_000),
    ] {
        same(e, bytes(&a, BASE, 20_000), "WRITE");
    }
    // b heard a only through shm, c only through UDP.
    assert_eq!(counter(&b, "udp.rx_datagrams"), 0);
    assert!(counter(&b, "shm.rx_bytes") >= 20_000);
    assert!(counter(&c, "udp.rx_datagrams") >= 20);
    assert_eq!(
        counter(&a, "udp.tx_datagrams"),
        counter(&c, "udp.rx_datagrams")
    );
    assert_eq!(counter(&a, "shm.tx_packets"), counter(&b, "shm.rx_packets"));
}

/// Issue 37: devices of two networks on one switch reach each other only
/// as the host's network lets them — here over UDP — never through memory;
/// a device of the sender's own network is reached through memory; and a
/// device takes as a GID only the addresses it owns (a guest's SET_GID of
/// another network's address is refused before it reaches the switch).
#[test]
fn devices_of_two_networks_on_one_switch_meet_only_on_the_wire() {
    use vrdma_fabric::shm::Owned;
    let mtu = Mtu::Mtu1024;
    let sw = Switch::new();
    let (n1, n2) = (sw.network("n1").unwrap(), sw.network("n2").unwrap());
    let on = |net: &vrdma_fabric::shm::Network, last: u8| {
        let owned = Owned::Only(vec![Gid::from(v4(last))]);
        let net = net.clone();
        common::end_behind(vrdma_fabric::udp::Config::new(v4(last)), Some(mtu), |p| {
            SameHost::on(Some((&sw, &net)), owned, p)
        })
    };
    let mut a = on(&n1, 30);
    let mut b = on(&n2, 31);
    let mut c = on(&n1, 32);
    // The GIDs a device may take: its own, not another network's.
    assert!(a.dev.transport().admits_gid(&a.gid));
    assert!(!a.dev.transport().admits_gid(&b.gid));
    let (qab, qb) = (qp(&mut a, QpType::Rc), qp(&mut b, QpType::Rc));
    let (qac, qc) = (qp(&mut a, QpType::Rc), qp(&mut c, QpType::Rc));
    let (ga, gb, gc) = (a.gid, b.gid, c.gid);
    connect(&mut a, qab, gb, qb, mtu);
    connect(&mut b, qb, ga, qab, mtu);
    connect(&mut a, qac, gc, qc, mtu);
    connect(&mut c, qc, ga, qac, mtu);
    fill(&mut a, BASE, 20_000, 6);
    for (qpn, rkey, id) in [(qab, b.rkey, 1), (qac, c.rkey, 2)] {
        let op = SendOp::RdmaWrite {
            remote_addr: BASE + 0x10_0000,
            rkey,
        };
        send(&mut a, qpn, id, op, BASE, 20_000);
    }
    let limit = Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    while got.len() < 2 {
        a.dev.progress().unwrap();
        b.dev.progress().unwrap();
        c.dev.progress().unwrap();
        a.dev.engine_mut().poll_cq(a.cq, 8, &mut got).unwrap();
        assert!(Instant::now() < limit, "only {got:?}");
    }
    assert!(got.iter().all(|w| w.status == WcStatus::Success), "{got:?}");
    for e in [
        &bytes(&b, BASE + 0x10_0000, 20_000),
        &bytes(&c, BASE + 0x10_0000, 20_000),
    ] {
        same(e, bytes(&a, BASE, 20_000), "WRITE");
    }
    // b, of the other network, heard a only over UDP; c only through memory.
    assert_eq!(counter(&b, "shm.rx_packets"), 0);
    assert!(counter(&b, "udp.rx_datagrams") >= 20);
    assert_eq!(counter(&c, "udp.rx_datagrams"), 0);
    assert!(counter(&c, "shm.rx_bytes") >= 20_000);
    // a's packets for b: to the uplink, held by another network here.
    assert!(counter(&a, "shm.tx_other_network") >= 20);
}

/// The receiving engine checks a packet from shm as one from the wire: a
/// WRITE with a key that names no MR of the peer's ends in a remote
/// access error and changes nothing; one past the MR's end too.
#[test]
fn the_responders_checks_apply_over_shm() {
    let mtu = Mtu::Mtu1024;
    for (case, last) in [("a forged rkey", 20), ("past the MR", 22)] {
        let sw = Switch::new();
        let (mut a, mut b, qa, _) = rc_pair(&sw, last, mtu);
        fill(&mut a, BASE, 4096, 6);
        let before = bytes(&b, BASE, common::MEM);
        let (remote_addr, rkey) = match case {
            "a forged rkey" => (BASE, vrdma_wire::Rkey(b.rkey.0 ^ 0x0100)),
            _ => (BASE + common::MEM as u64 - 100, b.rkey),
        };
        send(
            &mut a,
            qa,
            1,
            SendOp::RdmaWrite { remote_addr, rkey },
            BASE,
            4096,
        );
        let wcs = run_until(&mut a, &mut b, 1);
        assert_eq!(wcs[0].status, WcStatus::RemAccessErr, "{case}");
        assert!(
            bytes(&b, BASE, common::MEM) == before,
            "{case}: the peer's memory changed"
        );
        assert_eq!(counter(&a, "udp.tx_datagrams"), 0);
    }
}

/// A peer that goes away mid-transfer (its device dropped: its port
/// leaves the switch) costs its partner an error completion, not a hang:
/// the WRITE in flight retries into the void and ends in RETRY_EXC_ERR.
#[test]
fn a_peer_gone_mid_transfer_ends_in_an_error_completion() {
    let mtu = Mtu::Mtu1024;
    let sw = Switch::new();
    let mut a = end_on(&sw, v4(30), mtu);
    let mut b = end_on(&sw, v4(31), mtu);
    // Part of it arrives, then the peer is gone.
    write_under_way(&mut a, &mut b, mtu);
    drop(b);
    let wcs = receive(&mut a, 1, "the WRITE's end");
    assert_eq!(wcs[0].status, WcStatus::RetryExcErr);
    assert!(counter(&a, "shm.tx_packets") > 0);
    // With the peer's address gone from the switch, the retries went to
    // the network, where an address that moved would be.
    assert!(counter(&a, "udp.tx_datagrams") > 0);
}

/// A run of segments whose peer left the switch between the engine's poll
/// and the send (here: an engine told of a peer already gone) is dropped
/// and counted, never sent to the uplink as an over-long datagram; once
/// the device asks the switch again, RC resends MTU by MTU through the
/// uplink, where a moved address would be.
#[test]
fn a_run_for_a_peer_gone_is_not_sent_to_the_uplink() {
    let mtu = Mtu::Mtu1024;
    let sw = Switch::new();
    let mut a = end_on(&sw, v4(34), mtu);
    let mut b = end_on(&sw, v4(35), mtu);
    let (qa, _) = short_pair(&mut a, &mut b, mtu);
    let gone = b.gid;
    drop(b);
    a.dev.engine_mut().set_jumbo(&[gone]);
    let op = SendOp::RdmaWrite {
        remote_addr: BASE,
        rkey: vrdma_wire::Rkey(1),
    };
    send(&mut a, qa, 1, op, BASE, 256 << 10);
    a.dev.send_pending();
    assert!(counter(&a, "shm.tx_runs_off_switch") >= 1);
    assert_eq!(counter(&a, "udp.tx_datagrams"), 0, "an over-long datagram");
    // The next round asks the switch, which no longer holds the peer: the
    // retries go out MTU by MTU.
    let wcs = receive(&mut a, 1, "the WRITE's end");
    assert_eq!(wcs[0].status, WcStatus::RetryExcErr);
    assert!(counter(&a, "udp.tx_datagrams") > 0);
    assert_eq!(counter(&a, "udp.tx_failed"), 0);
}

/// A device asleep on its descriptor (event mode) wakes for a packet that
/// comes over shm from another thread, and for every one after it: each
/// time it has nothing to do, its descriptor must become readable (not
/// time out) before the next packet is there.
#[test]
fn a_sleeping_device_wakes_for_shm() {
    let mtu = Mtu::Mtu1024;
    let sw = Switch::new();
    let (mut a, mut b, qa, qb) = rc_pair(&sw, 40, mtu);
    const N: u64 = 200;
    for i in 0..N {
        recv(&mut b, qb, i, BASE + 0x1000 * i, 64);
    }
    let receiver = thread::spawn(move || {
        let limit = Instant::now() + Duration::from_secs(20);
        let mut got = Vec::new();
        while (got.len() as u64) < N {
            let p = b.dev.progress().unwrap();
            b.dev.engine_mut().poll_cq(b.cq, 64, &mut got).unwrap();
            if p.is_idle() && (got.len() as u64) < N && b.dev.send_pending() == 0 {
                // The sender waits for this device's ACK before it sends
                // again, so a packet is coming: the descriptor must say so.
                b.dev.transport_mut().arm();
                assert!(
                    readable(b.dev.fd(), 10_000),
                    "no wake-up after {} of {N}",
                    got.len()
                );
            }
            assert!(Instant::now() < limit, "{} of {N} received", got.len());
        }
        // The last SEND's ACK.
        b.dev.send_pending();
        (got, b)
    });
    for i in 0..N {
        fill(&mut a, BASE + 64 * i, 64, i as u8);
        send(&mut a, qa, i, SendOp::Send, BASE + 64 * i, 64);
        // One at a time: each SEND must wake the sleeping receiver.
        let wcs = receive(&mut a, 1, "a SEND's ACK");
        assert_eq!(wcs[0].status, WcStatus::Success);
    }
    let (got, b) = receiver.join().unwrap();
    assert!(got.iter().all(|w| w.status == WcStatus::Success));
    for i in 0..N {
        same(
            bytes(&b, BASE + 0x1000 * i, 64),
            bytes(&a, BASE + 64 * i, 64),
            "SEND",
        );
    }
}

/// DEREG_MR while an operation on the MR is in flight over shm: the
/// responder's MR under a WRITE (its rkey dies: the WRITE ends in
/// REM_ACCESS_ERR), then the requester's under a READ whose responses
/// wait, lent on, in its mailbox (they find no MR: LOC_PROT_ERR) — each an
/// error completion, nothing hangs, and not a byte of the deregistered
/// memory changes after its DEREG_MR.
#[test]
fn dereg_mr_under_an_operation_in_flight() {
    let mtu = Mtu::Mtu1024;
    let len = 2u32 << 20;
    for (case, last) in [
        ("the responder's MR under a WRITE", 60),
        ("the requester's MR under a READ", 62),
    ] {
        let sw = Switch::new();
        let (mut a, mut b, qa, _) = rc_pair(&sw, last, mtu);
        fill(&mut a, BASE, len as usize, 3);
        fill(&mut b, BASE + 0x20_0000, len as usize, 4);
        let write = case.contains("WRITE");
        let op = if write {
            SendOp::RdmaWrite {
                remote_addr: BASE,
                rkey: b.rkey,
            }
        } else {
            SendOp::RdmaRead {
                remote_addr: BASE + 0x20_0000,
                rkey: b.rkey,
            }
        };
        send(&mut a, qa, 1, op, BASE, len);
        if write {
            // Part of it moves (the send window holds the rest back), then
            // the MR goes.
            let limit = Instant::now() + Duration::from_secs(10);
            while counter(&b, "shm.rx_bytes") < 64 << 10 {
                a.dev.progress().unwrap();
                b.dev.progress().unwrap();
                assert!(Instant::now() < limit, "{case}: nothing moved");
            }
            assert!(
                counter(&b, "shm.rx_bytes") < u64::from(len),
                "{case}: all moved"
            );
        } else {
            // The request goes, the responses come back lent on and wait in
            // a's mailbox; then the MR goes.
            a.dev.progress().unwrap();
            b.dev.progress().unwrap();
            assert_eq!(counter(&a, "shm.rx_packets"), 0, "{case}");
        }
        let owner = if write { &mut b } else { &mut a };
        let key = owner.lkey;
        owner.dev.engine_mut().dereg_mr(key).unwrap();
        let frozen = bytes(owner, BASE, common::MEM);
        let wcs = run_until(&mut a, &mut b, 1);
        let want = if write {
            WcStatus::RemAccessErr
        } else {
            WcStatus::LocProtErr
        };
        assert_eq!(wcs[0].status, want, "{case}");
        // Both keep going a while: nothing more lands.
        for _ in 0..100 {
            a.dev.progress().unwrap();
            b.dev.progress().unwrap();
        }
        let owner = if write { &b } else { &a };
        assert!(
            bytes(owner, BASE, common::MEM) == frozen,
            "{case}: memory changed after DEREG_MR"
        );
    }
}

/// One copy: a long payload is lent on, and its receiver copies it from
/// the sender's memory later — so the sender's side of the grant is
/// fenced. Its MR deregistered, or its memory map replaced (as a face does
/// when the guest's maps change), while a payload waits lent on in the
/// receiver's mailbox: the receiver refuses it (`loan.refused`) and not a
/// byte of it lands. A deregistered source then ends the WRITE (or the
/// READ, whose responder lent the payload) in an error completion when RC
/// resends; a replaced map serves the resend from the new map, and the
/// WRITE completes whole.
#[test]
fn a_payload_lent_on_is_fenced_by_its_senders_grant() {
    let mtu = Mtu::Mtu4096;
    let len = 1u32 << 20;
    for (case, last) in [
        ("a WRITE's source MR deregistered", 70),
        ("a READ's responder MR deregistered", 72),
        ("a WRITE's source map replaced", 74),
    ] {
        let sw = Switch::new();
        let mut a = end_on(&sw, v4(last), mtu);
        let mut b = end_on(&sw, v4(last + 1), mtu);
        let (qa, _) = short_pair(&mut a, &mut b, mtu);
        fill(&mut a, BASE, len as usize, 5);
        fill(&mut b, BASE + 0x20_0000, len as usize, 6);
        let read = case.contains("READ");
        let op = if read {
            SendOp::RdmaRead {
                remote_addr: BASE + 0x20_0000,
                rkey: b.rkey,
            }
        } else {
            SendOp::RdmaWrite {
                remote_addr: BASE + 0x20_0000,
                rkey: b.rkey,
            }
        };
        // The READ lands in a's memory, the WRITE in b's.
        let (dst_before, src) = if read {
            (
                bytes(&a, BASE + 0x28_0000, len as usize),
                bytes(&b, BASE + 0x20_0000, len as usize),
            )
        } else {
            (
                bytes(&b, BASE + 0x20_0000, len as usize),
                bytes(&a, BASE, len as usize),
            )
        };
        send(
            &mut a,
            qa,
            1,
            op,
            if read { BASE + 0x28_0000 } else { BASE },
            len,
        );
        // The payload's first packets leave, lent on, and wait unread.
        a.dev.progress().unwrap();
        if read {
            b.dev.progress().unwrap();
            b.dev.send_pending();
            assert!(counter(&b, "shm.tx_packets") > 0, "{case}: no response");
            let key = b.lkey;
            b.dev.engine_mut().dereg_mr(key).unwrap();
        } else if case.contains("deregistered") {
            let key = a.lkey;
            a.dev.engine_mut().dereg_mr(key).unwrap();
        } else {
            let map = a.dev.mem().map().clone();
            a.dev.mem().revoke();
            *a.dev.mem_mut() = vrdma_device::GuestMem::from_map(map);
        }
        let (receiver, at) = if read {
            (&mut a, BASE + 0x28_0000)
        } else {
            (&mut b, BASE + 0x20_0000)
        };
        receiver.dev.progress().unwrap();
        assert!(counter(receiver, "loan.refused") > 0, "{case}: read anyway");
        assert_eq!(
            counter(receiver, "shm.rx_lent"),
            counter(receiver, "loan.refused")
        );
        same(bytes(receiver, at, len as usize), &dst_before, case);
        let wcs = run_until(&mut a, &mut b, 1);
        let want = match case {
            c if c.contains("replaced") => WcStatus::Success,
            c if c.contains("READ") => WcStatus::RemAccessErr,
            _ => WcStatus::LocProtErr,
        };
        assert_eq!(wcs[0].status, want, "{case}");
        if want == WcStatus::Success {
            same(bytes(&b, BASE + 0x20_0000, len as usize), &src, case);
        } else {
            for _ in 0..100 {
                a.dev.progress().unwrap();
                b.dev.progress().unwrap();
            }
            let receiver = if read { &a } else { &b };
            same(bytes(receiver, at, len as usize), &dst_before, case);
        }
    }
}
