//! Set-up shared by the tests that run devices on real sockets: a
//! device with a PD, a CQ and one MR over all its memory, and posting,
//! filling and comparing that memory.

#![allow(dead_code)] // each test file uses its own part

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use vrdma_device::{Device, GuestMem, Transport, transport::SameHost, udp_device_behind};
use vrdma_engine::{
    AhHandle, CqHandle, Memory, PdHandle,
    attr::{DeviceAttr, Mtu},
    mr::{Access, MrRequest, Translation},
    qp::{AhAttr, QpCap, QpInitAttr, QpType},
    wc::Wc,
    wr::{Payload, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest},
};
use vrdma_fabric::{
    shm::Switch,
    udp::{Config, UdpPort},
};
use vrdma_testkit::setup::Connection;
use vrdma_wire::{Gid, Lkey, Psn, QKey, Qpn, Rkey};

/// Where each device's memory starts, and how much it has.
pub const BASE: u64 = 0x10_0000;
pub const MEM: usize = 4 << 20;

/// A device on a socket (or on same-host shared memory in front of one),
/// with a PD, a CQ and an MR over all its memory.
pub struct End<T: Transport = UdpPort> {
    pub dev: Device<GuestMem, T>,
    /// The port's address.
    pub gid: Gid,
    pub pd: PdHandle,
    pub cq: CqHandle,
    pub lkey: Lkey,
    pub rkey: Rkey,
}

/// A device bound to `addr` whose port runs at `mtu`.
pub fn end(addr: IpAddr, mtu: Mtu) -> End {
    end_with(Config::new(addr), Some(mtu))
}

/// A device set up as `config` says, its port at `mtu` (`None`: the
/// interface's).
pub fn end_with(config: Config, mtu: Option<Mtu>) -> End {
    end_behind(config, mtu, Ok)
}

/// A device bound to `addr` whose port runs at `mtu`, also on `switch`.
pub fn end_on(switch: &Switch, addr: IpAddr, mtu: Mtu) -> End<SameHost<UdpPort>> {
    end_behind(Config::new(addr), Some(mtu), |p| SameHost::new(switch, p))
}

/// A device set up as `config` says, its port behind what `wrap` makes.
pub fn end_behind<T: Transport>(
    config: Config,
    mtu: Option<Mtu>,
    wrap: impl FnOnce(UdpPort) -> std::io::Result<T>,
) -> End<T> {
    let mem = GuestMem::anonymous(BASE, MEM).expect("memory");
    let mut gid = Gid::default();
    let wrap = |p: UdpPort| {
        gid = p.gid();
        wrap(p)
    };
    let mut dev = udp_device_behind(config, DeviceAttr::default(), mtu, mem, wrap).expect("bind");
    let e = dev.engine_mut();
    let pd = e.alloc_pd().unwrap();
    let (cq, _) = e.create_cq(1024, 0).unwrap();
    let (lkey, rkey) = e
        .reg_mr(MrRequest {
            pd,
            iova: BASE,
            length: MEM as u64,
            access: Access::LOCAL_WRITE
                | Access::REMOTE_WRITE
                | Access::REMOTE_READ
                | Access::REMOTE_ATOMIC,
            translation: Translation::Identity,
        })
        .unwrap();
    End {
        dev,
        gid,
        pd,
        cq,
        lkey,
        rkey,
    }
}

/// A signaled send WR of `len` bytes at `at`.
pub fn send<T: Transport>(e: &mut End<T>, qpn: Qpn, wr_id: u64, op: SendOp, at: u64, len: u32) {
    send_to(e, qpn, wr_id, op, (at, len), None);
}

/// A signaled send WR of the `len` bytes at `at`, to `ud` on a UD QP.
pub fn send_to<T: Transport>(
    e: &mut End<T>,
    qpn: Qpn,
    wr_id: u64,
    op: SendOp,
    (at, len): (u64, u32),
    ud: Option<UdDest>,
) {
    let sge = [Sge {
        addr: at,
        length: len,
        lkey: e.lkey,
    }];
    e.dev
        .engine_mut()
        .post_send(
            qpn,
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

/// A receive of `len` bytes at `at`.
pub fn recv<T: Transport>(e: &mut End<T>, qpn: Qpn, wr_id: u64, at: u64, len: u32) {
    let sge = [Sge {
        addr: at,
        length: len,
        lkey: e.lkey,
    }];
    e.dev
        .engine_mut()
        .post_recv(
            qpn,
            &RecvWr {
                wr_id,
                sg_list: &sge,
            },
        )
        .unwrap();
}

/// Fills `len` bytes at `at` with a pattern that depends on `seed`.
pub fn fill<T: Transport>(e: &mut End<T>, at: u64, len: usize, seed: u8) {
    let data: Vec<u8> = (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    e.dev
        .mem_mut()
        .write(at, &data)
        .expect("in the device's memory");
}

/// A copy of the `len` bytes at `at`.
pub fn bytes<T: Transport>(e: &End<T>, at: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    e.dev
        .mem()
        .read(at, &mut v)
        .expect("in the device's memory");
    v
}

/// Byte-exact, reporting the first difference instead of the buffers.
pub fn same(got: impl AsRef<[u8]>, want: impl AsRef<[u8]>, what: &str) {
    let (got, want) = (got.as_ref(), want.as_ref());
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "{what}: byte {i} is {:#04x}, expected {:#04x}",
            got[i], want[i]
        );
    }
}

/// A QP of type `ty` on `e`'s PD and CQ, 256 deep, one SGE, 64 bytes
/// inline.
pub fn qp<T: Transport>(e: &mut End<T>, ty: QpType) -> Qpn {
    let (qpn, _) = e
        .dev
        .engine_mut()
        .create_qp(QpInitAttr {
            pd: e.pd,
            send_cq: e.cq,
            recv_cq: e.cq,
            srq: None,
            cap: QpCap {
                max_send_wr: 256,
                max_recv_wr: 256,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 64,
            },
            qp_type: ty,
            sq_sig_all: false,
        })
        .unwrap();
    qpn
}

/// Brings `qpn` to RTS towards QP `dest` at `dgid`.
pub fn connect<T: Transport>(e: &mut End<T>, qpn: Qpn, dgid: Gid, dest: Qpn, mtu: Mtu) {
    Connection {
        mtu,
        psn: Psn::from_masked(0x00ff_fff0),
        max_rd_atomic: 16,
        max_dest_rd_atomic: 16,
        ..Connection::default()
    }
    .join(e.dev.engine_mut(), qpn, dgid, dest);
}

/// Progresses both ends until `want` completions arrived on `a`'s CQ.
pub fn run_until<T: Transport, U: Transport>(
    a: &mut End<T>,
    b: &mut End<U>,
    want: usize,
) -> Vec<Wc> {
    poll_until(a, Some(b), want, "completions")
}

/// Progresses `e` until `want` completions arrived on its CQ (`what`
/// names them in the failure).
pub fn receive<T: Transport>(e: &mut End<T>, want: usize, what: &str) -> Vec<Wc> {
    poll_until::<T, T>(e, None, want, what)
}

/// Progresses `on` (and `also`) until `want` completions arrived on
/// `on`'s CQ; the time limit only turns a hang into a failure.
pub fn poll_until<T: Transport, U: Transport>(
    on: &mut End<T>,
    mut also: Option<&mut End<U>>,
    want: usize,
    what: &str,
) -> Vec<Wc> {
    let limit = Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    while got.len() < want {
        on.dev.progress().unwrap();
        if let Some(b) = also.as_mut() {
            b.dev.progress().unwrap();
        }
        on.dev.engine_mut().poll_cq(on.cq, 64, &mut got).unwrap();
        assert!(
            Instant::now() < limit,
            "{what}: only {} of {want}: {got:?}",
            got.len()
        );
    }
    got
}

/// A signaled UD SEND of the `len` bytes at `at` through address handle
/// `ah` to QP `to` (Q_Key 0x11111111).
pub fn send_ud<T: Transport>(
    e: &mut End<T>,
    qpn: Qpn,
    wr_id: u64,
    at: (u64, u32),
    ah: AhHandle,
    to: Qpn,
) {
    let ud = UdDest {
        av: vrdma_engine::wr::Av::Handle(ah),
        remote_qpn: to,
        remote_qkey: QKey(0x1111_1111),
    };
    send_to(e, qpn, wr_id, SendOp::Send, at, Some(ud));
}

/// An address handle on `e` for `dgid` with this traffic class and hop
/// limit.
pub fn ah<T: Transport>(e: &mut End<T>, dgid: Gid, traffic_class: u8, hop_limit: u8) -> AhHandle {
    let attr = AhAttr {
        dgid,
        port_num: 1,
        hop_limit,
        traffic_class,
        ..AhAttr::default()
    };
    e.dev.engine_mut().create_ah(e.pd, attr).unwrap()
}
