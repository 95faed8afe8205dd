//! The tools' view of a device: one [`UdpDevice`] with a PD, one CQ and
//! one MR over all of its memory, and a completion loop that busy-polls or
//! sleeps until something happens (the `-e` / event mode of the rdma-core
//! examples and perftest).

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, ensure};
use vrdma_engine::{
    CqHandle, PdHandle, VecMemory,
    attr::Mtu,
    mr::{Access, MrRequest, Translation},
    qp::{AhAttr, AttrMask, QpAttr, QpCap, QpInitAttr, QpState, QpType, state},
    wc::Wc,
    wr::{Payload, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest},
};
use vrdma_fabric::udp::{Config, Progress, UdpDevice};
use vrdma_wire::{Gid, Lkey, Psn, QKey, Qpn, Rkey};

use crate::stat::Publisher;

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

/// A device with a PD, a CQ and an MR over its whole memory.
#[derive(Debug)]
pub struct Device {
    pub dev: UdpDevice<VecMemory>,
    pub pd: PdHandle,
    pub cq: CqHandle,
    pub lkey: Lkey,
    pub rkey: Rkey,
    /// Sleep in `poll(2)` when idle instead of spinning.
    pub events: bool,
    wcs: Vec<Wc>,
    /// The counters' snapshot for `vrdma stat`.
    publisher: Option<Publisher>,
}

impl Drop for Device {
    fn drop(&mut self) {
        // What the device still owes goes out first, so that the last
        // snapshot counts it (dropping the UdpDevice would send it too).
        let _ = self.dev.send_pending();
        if let Some(p) = &mut self.publisher {
            p.publish(&self.dev, true);
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

impl Device {
    /// Binds a device on `addr` with `mem_len` bytes of memory.
    /// The port's MTU comes from the interface holding `addr`.
    pub fn open(addr: IpAddr, mem_len: usize, events: bool) -> Result<Self> {
        Self::open_with_cq(addr, mem_len, events, 4096)
    }

    /// As [`Device::open`], with a CQ of `cqe` entries.
    pub fn open_with_cq(addr: IpAddr, mem_len: usize, events: bool, cqe: u32) -> Result<Self> {
        let config = Config::new(addr);
        let mut dev = UdpDevice::bind(config, VecMemory::new(BASE, mem_len))
            .with_context(|| format!("binding a RoCEv2 device to {addr} port 4791"))?;
        let e = dev.engine_mut();
        let pd = e.alloc_pd()?;
        let (cq, _) = e.create_cq(cqe, 0)?;
        let (lkey, rkey) = e.reg_mr(MrRequest {
            pd,
            iova: BASE,
            length: mem_len as u64,
            access: ALL_ACCESS,
            translation: Translation::Identity,
        })?;
        Ok(Device {
            dev,
            pd,
            cq,
            lkey,
            rkey,
            events,
            wcs: Vec::with_capacity(64),
            publisher: Publisher::new(addr),
        })
    }

    pub fn gid(&self) -> Gid {
        self.dev.gid()
    }

    pub fn create_qp(&mut self, ty: QpType, send: u32, recv: u32, inline: u32) -> Result<Qpn> {
        let (qpn, _) = self.dev.engine_mut().create_qp(QpInitAttr {
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
        })?;
        Ok(qpn)
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
        let a = qp_attr(local_psn, Some(remote), c);
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
        let a = qp_attr(local_psn, Some(remote), c);
        self.step(qpn, QpState::Init, QpState::Rtr, a)
    }

    fn step(&mut self, qpn: Qpn, from: QpState, to: QpState, a: QpAttr) -> Result<()> {
        let e = self.dev.engine_mut();
        let ty = e.query_qp(qpn)?.1.qp_type;
        let required = state::required(from, to, ty).context("QP transition")?;
        e.modify_qp(
            qpn,
            &QpAttr { qp_state: to, ..a },
            AttrMask::STATE | required,
        )
        .with_context(|| format!("modifying the QP to {to:?}"))?;
        Ok(())
    }

    /// Posts `n` receives of `len` bytes at `addr`.
    pub fn post_recvs(&mut self, qpn: Qpn, wr_id: u64, addr: u64, len: u32, n: u32) -> Result<()> {
        let sge = [Sge {
            addr,
            length: len,
            lkey: self.lkey,
        }];
        for _ in 0..n {
            self.dev.engine_mut().post_recv(
                qpn,
                &RecvWr {
                    wr_id,
                    sg_list: &sge,
                },
            )?;
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
            // The tools' own addresses: out of range is a bug, and panics.
            let at = (addr - BASE) as usize;
            Payload::Inline(&mem.bytes()[at..at + len as usize])
        } else {
            Payload::Sges(&sge)
        };
        engine.post_send(
            qpn,
            &SendWr {
                wr_id,
                op,
                payload,
                flags,
                ud,
            },
        )?;
        Ok(())
    }

    /// One round of the device (receive, run the engine, send), and the
    /// counters published when their period is up.
    pub fn progress(&mut self) -> Result<Progress> {
        let p = self.dev.progress()?;
        if let Some(pb) = &mut self.publisher {
            pb.publish(&self.dev, false);
        }
        Ok(p)
    }

    /// Runs the device until at least one completion is there (or
    /// `limit` passes: then an empty slice) and returns them.
    pub fn poll(&mut self, limit: Duration) -> Result<&[Wc]> {
        let deadline = Instant::now() + limit;
        self.wcs.clear();
        loop {
            let p = self.progress()?;
            self.dev.engine_mut().poll_cq(self.cq, 64, &mut self.wcs)?;
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
        self.dev.engine_mut().poll_cq(self.cq, 64, &mut self.wcs)?;
        while let Some(e) = self.dev.engine_mut().poll_event() {
            tracing::info!(event = ?e, "asynchronous event");
        }
        Ok(&self.wcs)
    }

    /// The `len` bytes at `addr` of the device's memory (the tools' own
    /// addresses: out of range is a bug, and panics).
    pub fn bytes_mut(&mut self, addr: u64, len: usize) -> &mut [u8] {
        let at = (addr - BASE) as usize;
        &mut self.dev.mem_mut().bytes_mut()[at..at + len]
    }

    pub fn bytes(&self, addr: u64, len: usize) -> &[u8] {
        let at = (addr - BASE) as usize;
        &self.dev.mem().bytes()[at..at + len]
    }
}

/// What two devices of one process tell each other before their QPs
/// connect.
#[derive(Clone, Copy, Debug)]
pub struct Hello {
    pub remote: Remote,
    pub rkey: Rkey,
}

/// How the in-process tools (`demo`, `bench`) connect: RC at MTU 4096,
/// every access, 16 READs/atomics each way.
pub fn loopback_connect() -> Connect {
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

/// One side of an in-process RC connection: a device on `addr` with
/// `mem` bytes and an RC QP (`send` / `recv` deep, 64 bytes inline),
/// connected to the peer whose [`Hello`] comes through `rx`; the peer's
/// hello is returned.
pub fn loopback_side(
    addr: IpAddr,
    mem: usize,
    (send, recv): (u32, u32),
    tx: &std::sync::mpsc::Sender<Hello>,
    rx: &std::sync::mpsc::Receiver<Hello>,
) -> Result<(Device, Qpn, Hello)> {
    let mut dev = Device::open(addr, mem, false)?;
    let c = loopback_connect();
    let qpn = dev.create_qp(QpType::Rc, send, recv, 64)?;
    dev.init_qp(qpn, &c)?;
    let psn = random_psn();
    tx.send(Hello {
        remote: Remote {
            qpn,
            psn,
            gid: dev.gid(),
        },
        rkey: dev.rkey,
    })?;
    let peer = rx.recv_timeout(Duration::from_secs(10))?;
    dev.connect(qpn, psn, peer.remote, &c)?;
    Ok((dev, qpn, peer))
}

/// Connects to the tools' TCP side channel at `host:port`, trying each
/// address the name resolves to.
pub fn tcp_connect(host: &str, port: u16) -> Result<std::net::TcpStream> {
    use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .with_context(|| format!("resolving {host}"))?
        .collect();
    let mut last = None;
    for addr in addrs {
        match TcpStream::connect(addr) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(anyhow::anyhow!(
        "Couldn't connect to {host}:{port}: {last:?}"
    ))
}

/// A hex field of a peer's exchange message: hex digits only (no sign,
/// which `from_str_radix` would take), at most `max`.
pub fn hex_field(f: &str, name: &str, max: u64) -> Result<u64> {
    ensure!(
        !f.is_empty() && f.len() <= 16 && f.bytes().all(|b| b.is_ascii_hexdigit()),
        "bad {name} {f:?} in the peer's message"
    );
    let v = u64::from_str_radix(f, 16).map_err(|_| anyhow::anyhow!("bad {name} {f:?}"))?;
    ensure!(v <= max, "{name} {v:#x} out of range");
    Ok(v)
}

/// A random 24-bit PSN, as the tools pick theirs (`lrand48() & 0xffffff`).
pub fn random_psn() -> Psn {
    Psn::from_masked(random_u32())
}

/// A random number from the OS (no generator crate for one draw).
pub fn random_u32() -> u32 {
    use std::hash::{BuildHasher, RandomState};
    // RandomState is seeded from the OS's randomness per process.
    RandomState::new().hash_one(Instant::now()) as u32
}
