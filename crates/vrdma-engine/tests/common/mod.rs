//! Set-up shared by the engine's integration tests: two engines on the
//! deterministic test network, each with one PD, one CQ, one QP and one MR
//! over all of its memory.

// Each test file uses its own subset of these helpers.
#![allow(dead_code)]

use vrdma_engine::{
    AhHandle, Engine,
    attr::Mtu,
    memory::Memory,
    mr::{Access, Translation},
    qp::{AhAttr, QpState, QpType},
    wc::{Wc, WcOpcode, WcStatus},
    wr::{Payload, RecvWr, SendFlags, SendOp, SendWr, Sge},
};
use vrdma_testkit::{
    net::Net,
    setup::{self, Connection},
};
use vrdma_wire::{Gid, Lkey, Psn, Qpn};

/// What a side of a test is: the objects of one engine on the network.
pub use vrdma_testkit::setup::{BASE, Ids, gid};

/// The engines' memory: the kit's default.
pub const MEM: usize = 64 * 1024;

/// An engine (GID 127.0.0.n) with a QP of type `ty` on the network.
pub fn side(net: &mut Net, n: u8, ty: QpType, sig_all: bool) -> Ids {
    setup::EngineSpec::new(n)
        .qp_type(ty)
        .sig_all(sig_all)
        .add_to(net)
}

pub fn e(net: &mut Net, s: Ids) -> &mut Engine {
    &mut net.nodes[s.node].engine
}

/// Brings `s` to RTS, connected to `peer` (UD: QKey 0x11111111).
pub fn connect(net: &mut Net, s: Ids, peer: Ids, rnr_retry: u8) {
    connect_to(net, s, peer.gid, peer.qpn, rnr_retry);
}

/// Brings `s` to RTS, its path aimed at `dgid` / `dest_qpn`, MTU 1024.
pub fn connect_to(net: &mut Net, s: Ids, dgid: Gid, dest_qpn: Qpn, rnr_retry: u8) {
    connect_mtu(net, s, dgid, dest_qpn, rnr_retry, Mtu::Mtu1024);
}

/// How these tests connect: short timers, two retries, PSNs that wrap
/// after two packets.
pub fn conn(rnr_retry: u8, mtu: Mtu) -> Connection {
    Connection {
        mtu,
        psn: Psn::from_masked(0x00ff_fffe),
        timeout: 10,
        retry_cnt: 2,
        rnr_retry,
        min_rnr_timer: 1,
        ..Connection::default()
    }
}

/// Brings `s` to RTS, its path aimed at `dgid` / `dest_qpn`.
pub fn connect_mtu(net: &mut Net, s: Ids, dgid: Gid, dest_qpn: Qpn, rnr_retry: u8, mtu: Mtu) {
    conn(rnr_retry, mtu).join(e(net, s), s.qpn, dgid, dest_qpn);
}

pub fn pair(ty: QpType, rnr_retry: u8) -> (Net, Ids, Ids) {
    let mut net = Net::default();
    let a = side(&mut net, 1, ty, false);
    let b = side(&mut net, 2, ty, false);
    connect(&mut net, a, b, rnr_retry);
    connect(&mut net, b, a, rnr_retry);
    (net, a, b)
}

pub fn fill(net: &mut Net, s: Ids, at: u64, data: &[u8]) {
    net.nodes[s.node].mem.write(BASE + at, data).unwrap();
}

pub fn read(net: &Net, s: Ids, at: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    net.nodes[s.node].mem.read(BASE + at, &mut v).unwrap();
    v
}

pub fn sge(s: Ids, at: u64, len: u32) -> Sge {
    Sge {
        addr: BASE + at,
        length: len,
        lkey: s.lkey,
    }
}

pub fn poll(net: &mut Net, s: Ids) -> Vec<Wc> {
    let mut v = Vec::new();
    e(net, s).poll_cq(s.cq, 64, &mut v).unwrap();
    v
}

pub fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

pub fn qp_state(net: &mut Net, s: Ids) -> QpState {
    e(net, s).query_qp(s.qpn).unwrap().0.qp_state
}

/// Posts a receive of `sges` (`wr_id`) on `s`'s QP; it must be accepted.
pub fn recv(net: &mut Net, s: Ids, wr_id: u64, sges: &[Sge]) {
    e(net, s)
        .post_recv(
            s.qpn,
            &RecvWr {
                wr_id,
                sg_list: sges,
            },
        )
        .unwrap();
}

/// An address handle on `s`'s PD towards `dgid` (port 1, hop limit 64).
pub fn ah_to(net: &mut Net, s: Ids, dgid: Gid) -> AhHandle {
    e(net, s)
        .create_ah(
            s.pd,
            AhAttr {
                dgid,
                port_num: 1,
                hop_limit: 64,
                ..AhAttr::default()
            },
        )
        .unwrap()
}

/// Posts a work request on `s`'s connected QP (`wr_id`, `op` over
/// `sges`, with `flags`); it must be accepted.
pub fn send(net: &mut Net, s: Ids, wr_id: u64, op: SendOp, sges: &[Sge], flags: SendFlags) {
    post(
        net,
        s,
        &SendWr {
            wr_id,
            op,
            payload: Payload::Sges(sges),
            flags,
            ud: None,
        },
    );
}

/// Posts `wr` on `s`'s QP; it must be accepted.
pub fn post(net: &mut Net, s: Ids, wr: &SendWr<'_>) {
    e(net, s).post_send(s.qpn, wr).unwrap();
}

/// Fast-registers 4 pages at `at` on `s` under `key` (iova 0x7700_0000,
/// local and remote read/write) with a REG_MR work request, and checks its
/// completion.
pub fn fast_reg(net: &mut Net, s: Ids, at: u64, key: u8) -> Lkey {
    let en = e(net, s);
    let mr = en.alloc_mr(s.pd, 8).unwrap();
    assert!(en.mr(mr).is_none(), "invalid until registered");
    en.map_mr_pages(
        mr,
        Translation::Pages {
            page_shift: 12,
            offset: 0,
            pages: (0..4).map(|i| BASE + at + i * 4096).collect(),
        },
    )
    .unwrap();
    let reg = SendWr {
        wr_id: 500,
        op: SendOp::RegMr {
            mr,
            key,
            iova: 0x7700_0000,
            length: 4 * 4096,
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        },
        payload: Payload::Sges(&[]),
        flags: SendFlags::SIGNALED,
        ud: None,
    };
    post(net, s, &reg);
    net.run(100);
    let wc = poll(net, s);
    assert_eq!(
        (wc[0].wr_id, wc[0].status, wc[0].opcode),
        (500, WcStatus::Success, WcOpcode::RegMr)
    );
    Lkey::new(mr.index(), key)
}
