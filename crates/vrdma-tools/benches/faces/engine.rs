//! Engine-direct: two devices in this process driven through
//! `vrdma_device::verbs`, as `vrdma bench` and `vrdma perf` drive them —
//! the driver's thread is its device's only thread: posting goes straight
//! into the engine, and polling the CQ runs a round of the device.

use std::net::IpAddr;

use vrdma_device::{
    transport::SameHost,
    verbs::{ALL_ACCESS, BASE, Connect, Context, Remote},
};
use vrdma_engine::{
    attr::Mtu,
    qp::QpType,
    wc::Wc,
    wr::{SendFlags, SendOp},
};
use vrdma_fabric::{shm::Switch, udp::UdpPort};
use vrdma_wire::{Psn, QKey, Qpn, Rkey};

use crate::port::{Port, layout};

/// One side: its device, its QP and the peer's rkey.
pub struct EnginePort {
    ctx: Context<SameHost<UdpPort>>,
    qpn: Qpn,
    peer_rkey: Rkey,
}

/// The attributes `vrdma bench` brings its QPs up with (MTU 4096).
fn attrs() -> Connect {
    Connect {
        mtu: Mtu::Mtu4096,
        sl: 0,
        hop_limit: 64,
        traffic_class: 0,
        min_rnr_timer: 12,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 16,
        max_dest_rd_atomic: 16,
        qkey: QKey(0),
        access: ALL_ACCESS,
    }
}

/// Two devices at `a` and `b` (on the same-host switches given, one for
/// each), an RC QP each, connected.
pub fn pair(a: IpAddr, b: IpAddr, switches: [Option<&Switch>; 2]) -> (EnginePort, EnginePort) {
    let c = attrs();
    let open = |addr, switch: Option<&Switch>| {
        let mut ctx = Context::open_same_host(switch, addr, layout::LEN as usize, false, 4096)
            .unwrap_or_else(|e| panic!("opening a device on {addr}: {e}"));
        let qpn = ctx.create_qp(QpType::Rc, 256, 1, 0).expect("an RC QP");
        ctx.init_qp(qpn, &c).expect("the QP to INIT");
        (ctx, qpn)
    };
    let ((mut ca, qa), (mut cb, qb)) = (open(a, switches[0]), open(b, switches[1]));
    let (pa, pb) = (Psn::from_masked(0x1234), Psn::from_masked(0x5678));
    let ra = Remote {
        qpn: qa,
        psn: pa,
        gid: ca.gid(),
    };
    let rb = Remote {
        qpn: qb,
        psn: pb,
        gid: cb.gid(),
    };
    ca.connect(qa, pa, rb, &c).expect("A's QP to RTS");
    cb.connect(qb, pb, ra, &c).expect("B's QP to RTS");
    let (ka, kb) = (ca.rkey, cb.rkey);
    (
        EnginePort {
            ctx: ca,
            qpn: qa,
            peer_rkey: kb,
        },
        EnginePort {
            ctx: cb,
            qpn: qb,
            peer_rkey: ka,
        },
    )
}

impl Port for EnginePort {
    fn post_write(&mut self, wr_id: u64, src: u64, len: u32, dst: u64, signaled: bool) {
        let flags = if signaled {
            SendFlags::SIGNALED
        } else {
            SendFlags::default()
        };
        let op = SendOp::RdmaWrite {
            remote_addr: BASE + dst,
            rkey: self.peer_rkey,
        };
        self.ctx
            .post_send(self.qpn, wr_id, op, (BASE + src, len), flags, None)
            .expect("posting a WRITE");
    }

    fn ring(&mut self) {}

    fn poll(&mut self, out: &mut Vec<(u64, u32)>) {
        let wcs: &[Wc] = self.ctx.poll_now().expect("a round of the device");
        out.extend(wcs.iter().map(|w| (w.wr_id, w.status as u32)));
    }

    fn idle(&mut self) {
        self.ctx.progress().expect("a round of the device");
    }

    fn idle_once(&mut self) {
        self.idle();
    }

    fn needs_thread(&self) -> bool {
        true
    }

    fn round(&mut self) {
        self.ctx.progress().expect("a round of the device");
    }

    fn poll_ready(&mut self, out: &mut Vec<(u64, u32)>) {
        let wcs: &[Wc] = self.ctx.poll_ready().expect("polling the CQ");
        out.extend(wcs.iter().map(|w| (w.wr_id, w.status as u32)));
    }

    fn put(&mut self, off: u64, data: &[u8]) {
        self.ctx
            .write(BASE + off, data)
            .expect("writing the buffer");
    }

    fn get(&self, off: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.ctx
            .read(BASE + off, &mut v)
            .expect("reading the buffer");
        v
    }

    fn byte(&self, off: u64) -> u8 {
        self.ctx.byte(BASE + off).expect("reading the buffer")
    }

    fn retry_timeouts(&self) -> Option<u64> {
        Some(self.ctx.dev.engine().stats().retry_timeout)
    }
}
