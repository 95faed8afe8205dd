//! What the tools share beyond the device's verbs front end: the
//! in-process RC connection of `demo` and `bench`, the TCP side channel of
//! `perf` and `pingpong`, and their random PSNs.

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use vrdma_device::verbs::{ALL_ACCESS, Connect, Context, Remote};
use vrdma_engine::{attr::Mtu, qp::QpType};
use vrdma_wire::{Psn, QKey, Qpn, Rkey};

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
) -> Result<(Context, Qpn, Hello)> {
    let mut dev = Context::open(addr, mem, false)?;
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
