//! The in-process verbs front end the tools (and tests) use: one device on
//! a UDP port with a PD, one CQ and one MR over all of its memory, QPs
//! brought up as rdma-core's examples and perftest do, and a completion
//! loop that busy-polls or sleeps until something happens (the `-e` /
//! event mode of those tools). Its counters are published for `vrdma
//! stat` ([`crate::publish`]).

use std::{
    io,
    net::IpAddr,
    time::{Duration, Instant},
};

use vrdma_engine::{
    CqHandle, Engine, Memory, PdHandle, VerbsError,
    attr::{DeviceAttr, Mtu, PortAttr},
    mr::{Access, MrRequest, Translation},
    qp::{AhAttr, AttrMask, QpAttr, QpCap, QpInitAttr, QpState, QpType, state},
    wc::Wc,
    wr::{Payload, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest},
};
use vrdma_fabric::{
    eth::EthPort,
    shm::Switch,
    udp::{Config, UdpPort},
};
use vrdma_wire::{Gid, Lkey, Psn, QKey, Qpn, Rkey};

use crate::{
    device::{Device, Progress, active_mtu, udp_device, udp_device_behind, with_guid},
    memory::GuestMem,
    publish::Publisher,
    transport::{SameHost, Transport},
};

/// Why a verbs front-end call failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The UDP port could not be bound.
    #[error("binding a RoCEv2 device to {addr} port 4791")]
    Bind {
        addr: IpAddr,
        #[source]
        source: io::Error,
    },
    /// The device's memory could not be mapped.
    #[error("mapping {len} bytes of device memory")]
    Map {
        len: usize,
        #[source]
        source: io::Error,
    },
    /// A verbs call of the engine failed.
    #[error("{what}")]
    Verbs {
        what: &'static str,
        #[source]
        source: VerbsError,
    },
    /// The transport failed.
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// Results of the front end.
pub type Result<T> = std::result::Result<T, Error>;

/// Attaches what was being done to an engine error.
fn verbs<T>(what: &'static str, r: std::result::Result<T, VerbsError>) -> Result<T> {
    r.map_err(|source| Error::Verbs { what, source })
}

/// Where the device's memory starts: the virtual address the tools
/// register and tell peers.
pub const BASE: u64 = 0x7f3a_0000_0000;

/// Everything an MR may be used for.
pub const ALL_ACCESS: Access = Access(
    Access::LOCAL_WRITE.0
        | Access::REMOTE_WRITE.0
        | Access::REMOTE_READ.0
        | Access::REMOTE_ATOMIC.0,
);

/// An opened device (as rdma-core's `ibv_context` is): a device on a UDP
/// port (or on same-host shared memory in front of one,
/// [`Context::open_same_host`]) with a PD, a CQ and an MR over its whole
/// memory.
#[derive(Debug)]
pub struct Context<T: Transport = UdpPort> {
    pub dev: Device<GuestMem, T>,
    /// The port's address, the device's GID 0.
    gid: Gid,
    pub pd: PdHandle,
    pub cq: CqHandle,
    pub lkey: Lkey,
    pub rkey: Rkey,
    /// Sleep in `poll(2)` when idle instead of spinning.
    pub events: bool,
    wcs: Vec<Wc>,
    /// The counters' snapshot for `vrdma stat`.
    publisher: Option<Publisher>,
    /// Bytes of an inline send, copied out of memory (kept for its
    /// allocation).
    inline: Vec<u8>,
    /// The Ethernet address every QP's packets are framed to (a device on
    /// an Ethernet port: its next hop); none over UDP.
    next_hop: Option<[u8; 6]>,
}

impl<T: Transport> Drop for Context<T> {
    fn drop(&mut self) {
        // What the device still owes goes out first, so that the last
        // snapshot counts it (dropping the device would send it too).
        let _ = self.dev.send_pending();
        if let Some(p) = &mut self.publisher {
            p.publish(self.dev.clock(), || self.dev.counters(), true);
        }
    }
}

/// The side of a connection the peer tells us about.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Remote {
    pub qpn: Qpn,
    pub psn: Psn,
    pub gid: Gid,
}

/// How a QP is brought up: the attributes the tools set (rdma-core's
/// examples and perftest set the same ones).
#[derive(Clone, Copy, Debug)]
pub struct Connect {
    pub mtu: Mtu,
    pub sl: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub min_rnr_timer: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub qkey: QKey,
    pub access: Access,
}

fn qp_attr(local_psn: Psn, remote: Option<Remote>, c: &Connect) -> QpAttr {
    let remote = remote.unwrap_or(Remote {
        qpn: Qpn::default(),
        psn: Psn::default(),
        gid: Gid::default(),
    });
    QpAttr {
        qp_access_flags: c.access,
        ah_attr: AhAttr {
            dgid: remote.gid,
            sl: c.sl,
            hop_limit: c.hop_limit,
            traffic_class: c.traffic_class,
            port_num: 1,
            ..AhAttr::default()
        },
        path_mtu: c.mtu,
        dest_qp_num: remote.qpn,
        qkey: c.qkey,
        rq_psn: remote.psn,
        sq_psn: local_psn,
        timeout: c.timeout,
        retry_cnt: c.retry_cnt,
        rnr_retry: c.rnr_retry,
        min_rnr_timer: c.min_rnr_timer,
        max_rd_atomic: c.max_rd_atomic,
        max_dest_rd_atomic: c.max_dest_rd_atomic,
        ..QpAttr::default()
    }
}

impl Context<UdpPort> {
    /// Binds a device on `addr` with `mem_len` bytes of memory.
    /// The port's MTU comes from the interface holding `addr`.
    pub fn open(addr: IpAddr, mem_len: usize, events: bool) -> Result<Self> {
        Self::open_with_cq(addr, mem_len, events, 4096)
    }

    /// As [`Context::open`], with a CQ of `cqe` entries.
    pub fn open_with_cq(addr: IpAddr, mem_len: usize, events: bool, cqe: u32) -> Result<Self> {
        let dev = udp_device(
            Config::new(addr),
            DeviceAttr::default(),
            None,
            memory(mem_len)?,
        )
        .map_err(|source| Error::Bind { addr, source })?;
        let gid = dev.transport().gid();
        Context::with_device(dev, gid, mem_len, events, cqe)
    }
}

impl Context<EthPort> {
    /// A device on the Ethernet port `port` whose address (GID 0) is
    /// `addr`, on a network of `netdev_mtu` bytes; its packets are framed
    /// to `next_hop` (the router's or the peer's MAC, as ARP would have
    /// resolved it).
    pub fn open_eth(
        mut port: EthPort,
        addr: IpAddr,
        netdev_mtu: u32,
        next_hop: [u8; 6],
        mem_len: usize,
        events: bool,
    ) -> Result<Self> {
        let gid = Gid::from(addr);
        let mut port_attr = PortAttr::with_gids(&[gid]);
        port_attr.active_mtu = active_mtu(netdev_mtu);
        port.set_local(&[gid]);
        let dev = Device::new(
            Engine::new(with_guid(DeviceAttr::default(), addr), port_attr),
            memory(mem_len)?,
            port,
        );
        let mut c = Context::with_device(dev, gid, mem_len, events, 4096)?;
        c.next_hop = Some(next_hop);
        Ok(c)
    }
}

impl Context<SameHost<UdpPort>> {
    /// As [`Context::open_with_cq`], the device also on `switch` (when
    /// given): a peer on the same switch is reached through shared memory,
    /// any other through the UDP port.
    pub fn open_same_host(
        switch: Option<&Switch>,
        addr: IpAddr,
        mem_len: usize,
        events: bool,
        cqe: u32,
    ) -> Result<Self> {
        let attr = DeviceAttr::default();
        let mut gid = Gid::default();
        let dev = udp_device_behind(Config::new(addr), attr, None, memory(mem_len)?, |port| {
            gid = port.gid();
            SameHost::with(switch, port)
        })
        .map_err(|source| Error::Bind { addr, source })?;
        Context::with_device(dev, gid, mem_len, events, cqe)
    }
}

/// `len` bytes of anonymous memory at [`BASE`].
fn memory(len: usize) -> Result<GuestMem> {
    GuestMem::anonymous(BASE, len).map_err(|source| Error::Map { len, source })
}

impl<T: Transport> Context<T> {
    /// `dev`, whose GID 0 is `gid`, with a PD, a CQ of `cqe` entries and
    /// an MR over its `mem_len` bytes of memory.
    fn with_device(
        mut dev: Device<GuestMem, T>,
        gid: Gid,
        mem_len: usize,
        events: bool,
        cqe: u32,
    ) -> Result<Self> {
        let addr = gid.ip();
        let e = dev.engine_mut();
        let pd = verbs("allocating a PD", e.alloc_pd())?;
        let (cq, _) = verbs("creating a CQ", e.create_cq(cqe, 0))?;
        let mr = e.reg_mr(MrRequest {
            pd,
            iova: BASE,
            length: mem_len as u64,
            access: ALL_ACCESS,
            translation: Translation::Identity,
        });
        let (lkey, rkey) = verbs("registering the MR", mr)?;
        Ok(Context {
            dev,
            gid,
            pd,
            cq,
            lkey,
            rkey,
            events,
            wcs: Vec::with_capacity(64),
            publisher: Publisher::new(&addr.to_string()),
            inline: Vec::new(),
            next_hop: None,
        })
    }

    pub fn gid(&self) -> Gid {
        self.gid
    }

    pub fn create_qp(&mut self, ty: QpType, send: u32, recv: u32, inline: u32) -> Result<Qpn> {
        let created = self.dev.engine_mut().create_qp(QpInitAttr {
            pd: self.pd,
            send_cq: self.cq,
            recv_cq: self.cq,
            srq: None,
            cap: QpCap {
                max_send_wr: send,
                max_recv_wr: recv,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: inline,
            },
            qp_type: ty,
            sq_sig_all: false,
        });
        Ok(verbs("creating a QP", created)?.0)
    }

    /// RESET → INIT (receives may be posted from INIT on).
    pub fn init_qp(&mut self, qpn: Qpn, c: &Connect) -> Result<()> {
        let a = qp_attr(Psn::default(), None, c);
        self.step(qpn, QpState::Reset, QpState::Init, a)
    }

    /// INIT → RTR → RTS towards `remote` (UD: only the Q_Key and the local
    /// PSN matter), each modify naming the attributes the transition
    /// requires for the QP's type.
    pub fn connect(&mut self, qpn: Qpn, local_psn: Psn, remote: Remote, c: &Connect) -> Result<()> {
        self.connect_rtr(qpn, local_psn, remote, c)?;
        let mut a = qp_attr(local_psn, Some(remote), c);
        a.ah_attr.dmac = self.next_hop;
        self.step(qpn, QpState::Rtr, QpState::Rts, a)
    }

    /// INIT → RTR only: a QP that answers but never requests (perftest's
    /// bandwidth server).
    pub fn connect_rtr(
        &mut self,
        qpn: Qpn,
        local_psn: Psn,
        remote: Remote,
        c: &Connect,
    ) -> Result<()> {
        let mut a = qp_attr(local_psn, Some(remote), c);
        a.ah_attr.dmac = self.next_hop;
        self.step(qpn, QpState::Init, QpState::Rtr, a)
    }

    fn step(&mut self, qpn: Qpn, from: QpState, to: QpState, a: QpAttr) -> Result<()> {
        let e = self.dev.engine_mut();
        let ty = verbs("querying the QP", e.query_qp(qpn))?.1.qp_type;
        let required = state::required(from, to, ty).ok_or(Error::Verbs {
            what: "bringing a QP up",
            source: VerbsError::Invalid {
                what: "QP state transition",
            },
        })?;
        let what = match to {
            QpState::Init => "modifying the QP to INIT",
            QpState::Rtr => "modifying the QP to RTR",
            _ => "modifying the QP to RTS",
        };
        let r = e.modify_qp(
            qpn,
            &QpAttr { qp_state: to, ..a },
            AttrMask::STATE | required,
        );
        verbs(what, r)
    }

    /// Posts `n` receives of `len` bytes at `addr`.
    pub fn post_recvs(&mut self, qpn: Qpn, wr_id: u64, addr: u64, len: u32, n: u32) -> Result<()> {
        let sge = [Sge {
            addr,
            length: len,
            lkey: self.lkey,
        }];
        for _ in 0..n {
            let r = self.dev.engine_mut().post_recv(
                qpn,
                &RecvWr {
                    wr_id,
                    sg_list: &sge,
                },
            );
            verbs("posting a receive", r)?;
        }
        Ok(())
    }

    /// Posts a send WR of `len` bytes at `addr` with `flags`; with
    /// [`SendFlags::INLINE`] the bytes are copied into the WR.
    pub fn post_send(
        &mut self,
        qpn: Qpn,
        wr_id: u64,
        op: SendOp,
        at: (u64, u32),
        flags: SendFlags,
        ud: Option<UdDest>,
    ) -> Result<()> {
        let (addr, len) = at;
        let sge = [Sge {
            addr,
            length: len,
            lkey: self.lkey,
        }];
        let (engine, mem) = self.dev.parts();
        let payload = if flags.contains(SendFlags::INLINE) {
            // Inline data is copied out of memory at post, as a provider
            // library copies it into the WQE.
            self.inline.resize(len as usize, 0);
            let read = mem.read(addr, &mut self.inline);
            verbs(
                "reading inline data",
                read.map_err(|_| VerbsError::Invalid {
                    what: "inline data address",
                }),
            )?;
            Payload::Inline(&self.inline)
        } else {
            Payload::Sges(&sge)
        };
        let r = engine.post_send(
            qpn,
            &SendWr {
                wr_id,
                op,
                payload,
                flags,
                ud,
            },
        );
        verbs("posting a send", r)
    }

    /// One round of the device (receive, run the engine, send), and the
    /// counters published when their period is up.
    pub fn progress(&mut self) -> Result<Progress> {
        let p = self.dev.progress()?;
        if let Some(pb) = &mut self.publisher {
            let dev = &self.dev;
            pb.publish(dev.clock(), || dev.counters(), false);
        }
        Ok(p)
    }

    /// Keeps the device answering after the work is done, until nothing
    /// has arrived for `quiet` (at most `cap`): an RC peer whose last
    /// message's ACK was lost resends it after its local ACK timeout, and
    /// with nobody left to answer, a peer that retries for ever (rxe treats
    /// retry_cnt 7 so) never finishes.
    pub fn linger(&mut self, quiet: Duration, cap: Duration) -> Result<()> {
        let start = Instant::now();
        let mut last = start;
        let mut seen = self.dev.engine().stats().rx_packets;
        while last.elapsed() < quiet && start.elapsed() < cap {
            self.progress()?;
            let now = self.dev.engine().stats().rx_packets;
            if now != seen {
                seen = now;
                last = Instant::now();
            }
            self.dev.wait(Duration::from_millis(5))?;
        }
        Ok(())
    }

    /// Runs the device until at least one completion is there (or
    /// `limit` passes: then an empty slice) and returns them.
    pub fn poll(&mut self, limit: Duration) -> Result<&[Wc]> {
        let deadline = Instant::now() + limit;
        self.wcs.clear();
        loop {
            let p = self.progress()?;
            let polled = self.dev.engine_mut().poll_cq(self.cq, 64, &mut self.wcs);
            verbs("polling the CQ", polled)?;
            if !self.wcs.is_empty() {
                return Ok(&self.wcs);
            }
            // Errors reach the tools as completions; events are only told.
            while let Some(e) = self.dev.engine_mut().poll_event() {
                tracing::info!(event = ?e, "asynchronous event");
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(&[]);
            }
            if self.events && p.is_idle() {
                self.dev.wait(deadline - now)?;
            }
        }
    }

    /// One round of the device (receive, run the engine, send) without
    /// waiting, and the completions it produced (perhaps none).
    pub fn poll_now(&mut self) -> Result<&[Wc]> {
        self.wcs.clear();
        self.progress()?;
        let polled = self.dev.engine_mut().poll_cq(self.cq, 64, &mut self.wcs);
        verbs("polling the CQ", polled)?;
        while let Some(e) = self.dev.engine_mut().poll_event() {
            tracing::info!(event = ?e, "asynchronous event");
        }
        Ok(&self.wcs)
    }

    /// The completions there now, without a round of the device (a caller
    /// that runs the rounds itself: [`Context::progress`]).
    pub fn poll_ready(&mut self) -> Result<&[Wc]> {
        self.wcs.clear();
        let polled = self.dev.engine_mut().poll_cq(self.cq, 64, &mut self.wcs);
        verbs("polling the CQ", polled)?;
        while let Some(e) = self.dev.engine_mut().poll_event() {
            tracing::info!(event = ?e, "asynchronous event");
        }
        Ok(&self.wcs)
    }

    /// The port's active MTU.
    pub fn active_mtu(&self) -> Mtu {
        self.dev
            .engine()
            .query_port(1)
            .map_or(Mtu::Mtu256, |p| p.active_mtu)
    }

    /// Copies `data` into the device's memory at `addr`.
    pub fn write(&mut self, addr: u64, data: &[u8]) -> Result<()> {
        let r = self.dev.mem_mut().write(addr, data);
        r.map_err(|e| Error::Io(io::Error::other(e)))
    }

    /// Copies `buf.len()` bytes of the device's memory at `addr` out.
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> Result<()> {
        let r = self.dev.mem().read(addr, buf);
        r.map_err(|e| Error::Io(io::Error::other(e)))
    }

    /// The byte at `addr` of the device's memory.
    pub fn byte(&self, addr: u64) -> Result<u8> {
        let mut b = [0u8];
        self.read(addr, &mut b)?;
        Ok(b[0])
    }
}
