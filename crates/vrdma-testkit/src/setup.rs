//! Builders for what tests set up again and again: an engine with one
//! port GID, a PD, a CQ and an MR over all of its memory, and a QP
//! ([`EngineSpec`]); and the attributes QPs are connected with, brought up from
//! RESET to RTS ([`Connection`]).
//!
//! ```
//! use vrdma_testkit::{net::Net, setup::{Connection, EngineSpec}};
//! use vrdma_engine::qp::QpType;
//!
//! let mut net = Net::default();
//! let a = EngineSpec::new(1).qp_type(QpType::Uc).add_to(&mut net);
//! let b = EngineSpec::new(2).qp_type(QpType::Uc).add_to(&mut net);
//! Connection::default().join(&mut net.nodes[a.node].engine, a.qpn, b.gid, b.qpn);
//! ```

use std::net::Ipv4Addr;

use vrdma_engine::{
    CqHandle, Engine, PdHandle, VecMemory,
    attr::{DeviceAttr, Mtu, PortAttr},
    mr::{Access, MrRequest, Translation},
    qp::{AhAttr, QpAttr, QpCap, QpInitAttr, QpType},
};
use vrdma_wire::{Gid, Lkey, Psn, QKey, Qpn, Rkey};

use crate::{net::Net, sim::Sim};

/// Where a test engine's memory starts.
pub const BASE: u64 = 0x10_0000;

/// Every right an MR can grant that a data path uses.
pub const ALL_ACCESS: Access = Access(
    Access::LOCAL_WRITE.0
        | Access::REMOTE_WRITE.0
        | Access::REMOTE_READ.0
        | Access::REMOTE_ATOMIC.0,
);

/// The GID of test host `n`: 127.0.0.n, IPv4-mapped.
pub fn gid(n: u8) -> Gid {
    Gid::from(Ipv4Addr::new(127, 0, 0, n))
}

/// How a test engine is made.
#[derive(Clone, Debug)]
pub struct EngineSpec {
    gid: Gid,
    attr: DeviceAttr,
    active_mtu: Mtu,
    base: u64,
    mem: usize,
    cqe: u32,
    qp_type: QpType,
    cap: QpCap,
    sig_all: bool,
}

/// What a built [`EngineSpec`] is made of.
#[derive(Clone, Copy, Debug)]
pub struct Ids {
    /// Its index in the network it was added to (0 when built alone).
    pub node: usize,
    pub gid: Gid,
    pub pd: PdHandle,
    pub cq: CqHandle,
    pub qpn: Qpn,
    /// The MR over all of its memory.
    pub lkey: Lkey,
    pub rkey: Rkey,
}

impl EngineSpec {
    /// Host `n` (GID 127.0.0.n): default device limits, 64 KiB of memory
    /// at [`BASE`], a CQ of 64, an RC QP 16 deep with 4 SGEs and 64 bytes
    /// inline, signaling only the WRs that ask.
    pub fn new(n: u8) -> Self {
        EngineSpec {
            gid: gid(n),
            attr: DeviceAttr::default(),
            active_mtu: Mtu::Mtu1024,
            base: BASE,
            mem: 64 * 1024,
            cqe: 64,
            qp_type: QpType::Rc,
            cap: QpCap {
                max_send_wr: 16,
                max_recv_wr: 16,
                max_send_sge: 4,
                max_recv_sge: 4,
                max_inline_data: 64,
            },
            sig_all: false,
        }
    }

    pub fn gid(mut self, gid: Gid) -> Self {
        self.gid = gid;
        self
    }

    pub fn attr(mut self, attr: DeviceAttr) -> Self {
        self.attr = attr;
        self
    }

    /// The port's active MTU (a UD QP's message limit).
    pub fn active_mtu(mut self, mtu: Mtu) -> Self {
        self.active_mtu = mtu;
        self
    }

    /// `len` bytes of memory (at [`BASE`] unless [`EngineSpec::base`] says).
    pub fn mem(mut self, len: usize) -> Self {
        self.mem = len;
        self
    }

    /// The memory starts at `base` (the MR's start too).
    pub fn base(mut self, base: u64) -> Self {
        self.base = base;
        self
    }

    pub fn cqe(mut self, cqe: u32) -> Self {
        self.cqe = cqe;
        self
    }

    pub fn qp_type(mut self, ty: QpType) -> Self {
        self.qp_type = ty;
        self
    }

    pub fn cap(mut self, cap: QpCap) -> Self {
        self.cap = cap;
        self
    }

    /// Send and receive queues `depth` deep, one SGE each, no inline data.
    pub fn depth(self, depth: u32) -> Self {
        self.cap(QpCap {
            max_send_wr: depth,
            max_recv_wr: depth,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        })
    }

    /// Every send WR completes signaled.
    pub fn sig_all(mut self, on: bool) -> Self {
        self.sig_all = on;
        self
    }

    /// The engine, its memory and what was made in it.
    pub fn build(&self) -> (Engine, VecMemory, Ids) {
        let mut port = PortAttr::with_gids(&[self.gid]);
        port.active_mtu = self.active_mtu;
        let mut e = Engine::new(self.attr.clone(), port);
        let pd = e.alloc_pd().expect("a PD");
        let (cq, _) = e.create_cq(self.cqe, 0).expect("a CQ");
        let (lkey, rkey) = e
            .reg_mr(MrRequest {
                pd,
                iova: self.base,
                length: self.mem as u64,
                access: ALL_ACCESS,
                translation: Translation::Identity,
            })
            .expect("the MR");
        let (qpn, _) = e
            .create_qp(self.qp_init(pd, cq))
            .expect("a QP within the device's limits");
        let ids = Ids {
            node: 0,
            gid: self.gid,
            pd,
            cq,
            qpn,
            lkey,
            rkey,
        };
        (e, VecMemory::new(self.base, self.mem), ids)
    }

    /// What `create_qp` is asked for this side's QP in `pd` on `cq`.
    pub fn qp_init(&self, pd: PdHandle, cq: CqHandle) -> QpInitAttr {
        QpInitAttr {
            pd,
            send_cq: cq,
            recv_cq: cq,
            srq: None,
            cap: self.cap,
            qp_type: self.qp_type,
            sq_sig_all: self.sig_all,
        }
    }

    /// Builds the side and attaches it to a test network.
    pub fn add_to(&self, net: &mut Net) -> Ids {
        let (e, mem, ids) = self.build();
        let node = net.add(e, mem, self.gid);
        Ids { node, ..ids }
    }

    /// Builds the side and attaches it to a simulated network.
    pub fn add_to_sim(&self, sim: &mut Sim) -> Ids {
        let (e, mem, ids) = self.build();
        let node = sim.add(e, mem, self.gid);
        Ids { node, ..ids }
    }
}

/// The attributes a QP is brought up with, from RESET to RTS (the
/// defaults are what perftest and rdma-core's examples set, at MTU 1024).
#[derive(Clone, Copy, Debug)]
pub struct Connection {
    pub mtu: Mtu,
    /// Both directions' first PSN.
    pub psn: Psn,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub qkey: QKey,
    pub access: Access,
    pub hop_limit: u8,
}

impl Default for Connection {
    fn default() -> Self {
        Connection {
            mtu: Mtu::Mtu1024,
            psn: Psn::from_masked(0),
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 1,
            max_dest_rd_atomic: 1,
            qkey: QKey(0x1111_1111),
            access: Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
            hop_limit: 64,
        }
    }
}

impl Connection {
    /// The QP attributes aimed at `dest_qpn` on `dgid` (UD: only the Q_Key
    /// and the PSN matter).
    pub fn attr(&self, dgid: Gid, dest_qpn: Qpn) -> QpAttr {
        QpAttr {
            port_num: 1,
            qkey: self.qkey,
            qp_access_flags: self.access,
            ah_attr: AhAttr {
                dgid,
                port_num: 1,
                hop_limit: self.hop_limit,
                ..AhAttr::default()
            },
            path_mtu: self.mtu,
            dest_qp_num: dest_qpn,
            rq_psn: self.psn,
            sq_psn: self.psn,
            timeout: self.timeout,
            retry_cnt: self.retry_cnt,
            rnr_retry: self.rnr_retry,
            min_rnr_timer: self.min_rnr_timer,
            max_rd_atomic: self.max_rd_atomic,
            max_dest_rd_atomic: self.max_dest_rd_atomic,
            ..QpAttr::default()
        }
    }

    /// Brings `qpn` of `e` from RESET to RTS aimed at `dest_qpn` on
    /// `dgid`; the bring-up must succeed.
    pub fn join(&self, e: &mut Engine, qpn: Qpn, dgid: Gid, dest_qpn: Qpn) {
        e.bring_up_qp(qpn, &self.attr(dgid, dest_qpn))
            .expect("the QP comes up");
    }

    /// Connects two sides of `net` to each other.
    pub fn pair(&self, net: &mut Net, a: Ids, b: Ids) {
        self.join(&mut net.nodes[a.node].engine, a.qpn, b.gid, b.qpn);
        self.join(&mut net.nodes[b.node].engine, b.qpn, a.gid, a.qpn);
    }

    /// Connects two sides of `sim` to each other.
    pub fn pair_in_sim(&self, sim: &mut Sim, a: Ids, b: Ids) {
        self.join(&mut sim.node_mut(a.node).engine, a.qpn, b.gid, b.qpn);
        self.join(&mut sim.node_mut(b.node).engine, b.qpn, a.gid, a.qpn);
    }
}
