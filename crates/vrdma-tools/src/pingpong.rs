//! `vrdma pingpong rc|uc|ud`: rdma-core's `ibv_rc_pingpong`,
//! `ibv_uc_pingpong` and `ibv_ud_pingpong` on a vrdma device, compatible
//! with them on the wire and in the out-of-band exchange, so that either
//! side can be the real tool.
//!
//! The exchange (rdma-core v44 `libibverbs/examples/*_pingpong.c`; the
//! facts are written up in `docs/pingpong.md`): the
//! client connects to TCP port 18515 and writes its address as one 52-byte
//! message, `"%04x:%06x:%06x:%s"` (LID, QPN, PSN, the GID's 16 bytes as 32
//! hex digits) and a NUL; the server connects its QP to it, answers with
//! its own, and the client ends with `"done"` and a NUL. The C tools read
//! each message with one `read(2)` and demand the exact length, so each is
//! written with one call. Then each side sends `iters` messages, the
//! client first, a side sending again only once its last send completed
//! and a message arrived.
//!
//! Differences, all deliberate: without `-d` the device binds the address
//! the TCP connection uses (there is no device list to pick from); the GID
//! is always sent (the C tools send zeros without `-g`, which cannot work
//! on RoCE); `--timeout` bounds the wait for a completion (the C tools
//! wait forever, and a lost UC/UD message hangs them).

use std::{
    io::{Read, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpListener, TcpStream},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use vrdma_engine::{
    attr::Mtu,
    mr::Access,
    qp::{AhAttr, QpType},
    wc::{WcOpcode, WcStatus},
    wr::{SendFlags, SendOp, UdDest},
};
use vrdma_wire::{Gid, Psn, QKey, Qpn};

use vrdma_device::verbs::{BASE, Connect, Context, Remote};

use crate::{
    args::{PingpongArgs, Transport},
    common::{hex_field, random_psn},
};

/// The exchange message: 51 characters and a NUL.
pub const MSG_LEN: usize = 52;
/// wr_ids, as the C tools use them.
const RECV_WRID: u64 = 1;
const SEND_WRID: u64 = 2;
/// ibv_ud_pingpong's Q_Key.
const UD_QKEY: QKey = QKey(0x1111_1111);
/// Room for the GRH in front of a UD receive.
const GRH_LEN: usize = 40;

/// One side's address, as exchanged.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Dest {
    pub lid: u16,
    pub qpn: Qpn,
    pub psn: Psn,
    pub gid: Gid,
}

impl Dest {
    /// The 52-byte message: `LLLL:QQQQQQ:PPPPPP:` + 32 hex digits + NUL.
    pub fn to_wire(self) -> [u8; MSG_LEN] {
        let gid: String = self.gid.0.iter().map(|b| format!("{b:02x}")).collect();
        let s = format!(
            "{:04x}:{:06x}:{:06x}:{gid}",
            self.lid,
            self.qpn.value(),
            self.psn.value()
        );
        let mut out = [0u8; MSG_LEN];
        out[..s.len()].copy_from_slice(s.as_bytes());
        out
    }

    /// Parses a peer's message; anything but the expected shape is an
    /// error (the peer is a stranger on a TCP port).
    pub fn parse(msg: &[u8]) -> Result<Self> {
        let text = msg.split(|&b| b == 0).next().unwrap_or_default();
        let text = std::str::from_utf8(text).map_err(|_| anyhow!("address message is not text"))?;
        let mut parts = text.split(':');
        let mut field = |name: &str, max: u32| -> Result<u32> {
            let f = parts
                .next()
                .ok_or_else(|| anyhow!("address message has no {name}"))?;
            // max is a u32: so is the value.
            Ok(hex_field(f, name, u64::from(max))? as u32)
        };
        let lid = field("LID", 0xffff)? as u16;
        let qpn = Qpn::from_masked(field("QPN", 0xff_ffff)?);
        let psn = Psn::from_masked(field("PSN", 0xff_ffff)?);
        let g = parts
            .next()
            .ok_or_else(|| anyhow!("address message has no GID"))?;
        // Hex digits only, checked on bytes (slicing a str of multi-byte
        // characters could split one).
        ensure!(
            g.len() == 32 && g.bytes().all(|b| b.is_ascii_hexdigit()) && parts.next().is_none(),
            "bad GID {g:?} in address message"
        );
        let mut gid = [0u8; 16];
        for (b, pair) in gid.iter_mut().zip(g.as_bytes().chunks_exact(2)) {
            let hex = |c: u8| (c as char).to_digit(16).unwrap_or(0) as u8;
            *b = hex(pair[0]) << 4 | hex(pair[1]);
        }
        Ok(Dest {
            lid,
            qpn,
            psn,
            gid: Gid(gid),
        })
    }
}

fn gid_text(g: Gid) -> String {
    Ipv6Addr::from(g.0).to_string()
}

fn mtu_from_bytes(n: u32) -> Result<Mtu> {
    Ok(match n {
        256 => Mtu::Mtu256,
        512 => Mtu::Mtu512,
        1024 => Mtu::Mtu1024,
        2048 => Mtu::Mtu2048,
        4096 => Mtu::Mtu4096,
        _ => bail!("MTU {n}: one of 256, 512, 1024, 2048, 4096"),
    })
}

pub fn run(a: &PingpongArgs) -> Result<()> {
    let (size, mtu) = check_args(a)?;
    let ud = a.transport == Transport::Ud;
    let (stream, ip) = exchange_stream(a)?;
    let buf_len = size as usize + if ud { GRH_LEN } else { 0 };
    let c = connect_attrs(a, mtu);
    let (mut dev, qpn) = open_qp(a, ip, size, buf_len, &c)?;
    let me = Dest {
        lid: 0,
        qpn,
        psn: random_psn(),
        gid: dev.gid(),
    };
    print_local(&me, ud);
    let (rem, ah) = exchange(stream, a.server.is_some(), me, |rem| {
        connect_qp(&mut dev, a, &me, rem, &c)
    })?;
    print_remote(&rem);
    let send = SendWr::new(&dev, qpn, size, ud, &rem, ah)?;
    let usec = ping_pong(a, &mut dev, &send, buf_len as u32)?;
    if a.transport == Transport::Rc {
        // The peer's last message may wait for an ACK that was lost: stay to
        // answer its resend (four of its 67 ms ACK timeouts of quiet).
        dev.linger(Duration::from_millis(270), Duration::from_secs(2))?;
    }
    print_rates(a, size, usec);
    if a.chk && a.server.is_none() {
        check_pages(&dev, size, ud)?;
    }
    let s = dev.dev.transport().stats();
    tracing::debug!(?s, engine = ?dev.dev.engine().stats(), "device counters");
    Ok(())
}

/// The arguments checked as a vrdma device needs them (one port, one GID,
/// positive counts, no `-m` for UD): the message size and the path MTU.
fn check_args(a: &PingpongArgs) -> Result<(u32, Mtu)> {
    ensure!(
        a.ib_port == 1,
        "port {}: a vrdma device has one port, 1",
        a.ib_port
    );
    if let Some(g) = a.gid_idx {
        ensure!(
            g == 0,
            "GID index {g}: a vrdma device has one GID (index 0: its address)"
        );
    }
    ensure!(
        a.iters > 0 && a.rx_depth > 0,
        "iterations and rx depth must be positive"
    );
    let ud = a.transport == Transport::Ud;
    ensure!(
        !(ud && a.mtu.is_some()),
        "-m is not an ibv_ud_pingpong option"
    );
    let size = a.size.unwrap_or(if ud { 1024 } else { 4096 });
    let mtu = mtu_from_bytes(a.mtu.unwrap_or(1024))?;
    Ok((size, mtu))
}

/// The attributes the QP is brought up with, as the C tools set them.
fn connect_attrs(a: &PingpongArgs, mtu: Mtu) -> Connect {
    Connect {
        mtu,
        sl: a.sl,
        hop_limit: 64,
        traffic_class: 0,
        min_rnr_timer: 12,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 1,
        max_dest_rd_atomic: 1,
        qkey: UD_QKEY,
        access: Access::NONE,
    }
}

/// The device at `ip` with memory for a buffer of `buf_len` bytes, filled
/// as the C tools fill it, and its QP in INIT with `a.rx_depth` receives
/// posted.
fn open_qp(
    a: &PingpongArgs,
    ip: IpAddr,
    size: u32,
    buf_len: usize,
    c: &Connect,
) -> Result<(Context, Qpn)> {
    let ud = a.transport == Transport::Ud;
    let mem = buf_len.next_multiple_of(4096).max(4096);
    let mut dev = Context::open(ip, mem, a.events)?;
    let port_mtu = dev.active_mtu();
    if ud {
        // ibv_ud_pingpong's limit: the port's active MTU.
        ensure!(
            size <= port_mtu.bytes(),
            "Requested size larger than port MTU ({})",
            port_mtu.bytes()
        );
    }
    let ty = match a.transport {
        Transport::Rc => QpType::Rc,
        Transport::Uc => QpType::Uc,
        Transport::Ud => QpType::Ud,
    };
    let qpn = dev.create_qp(ty, 1, a.rx_depth, 0)?;
    dev.init_qp(qpn, c)?;
    // The C tools fill the buffer with 0x7b.
    dev.write(BASE, &vec![0x7b; buf_len])?;
    post_recvs(&mut dev, qpn, buf_len as u32, a.rx_depth)?;
    Ok((dev, qpn))
}

/// Posts `n` receives of `len` bytes into the buffer.
fn post_recvs(dev: &mut Context, qpn: Qpn, len: u32, n: u32) -> Result<()> {
    Ok(dev.post_recvs(qpn, RECV_WRID, BASE, len, n)?)
}

/// Brings this side's QP (`me`) up towards the peer's address `rem` and,
/// for UD, makes the address handle its sends go through.
fn connect_qp(
    dev: &mut Context,
    a: &PingpongArgs,
    me: &Dest,
    rem: &Dest,
    c: &Connect,
) -> Result<Option<vrdma_engine::AhHandle>> {
    ensure!(
        rem.gid != Gid::default(),
        "the peer sent no GID: RoCE needs one (give the rdma-core tool -g)"
    );
    let remote = Remote {
        qpn: rem.qpn,
        psn: rem.psn,
        gid: rem.gid,
    };
    dev.connect(me.qpn, me.psn, remote, c)?;
    if a.transport != Transport::Ud {
        return Ok(None);
    }
    let ah = dev.dev.engine_mut().create_ah(
        dev.pd,
        AhAttr {
            dgid: rem.gid,
            sl: a.sl,
            hop_limit: 64,
            port_num: 1,
            ..AhAttr::default()
        },
    )?;
    Ok(Some(ah))
}

/// The SEND each message is: from the buffer (past the GRH's room for
/// UD), inline when the QP takes that much inline, and for UD to the
/// peer's QP through the address handle.
struct SendWr {
    qpn: Qpn,
    at: u64,
    size: u32,
    flags: SendFlags,
    ud_dest: Option<UdDest>,
}

impl SendWr {
    /// The SEND of `size` bytes on QP `qpn`, to the peer `rem` (through
    /// `ah` for UD).
    fn new(
        dev: &Context,
        qpn: Qpn,
        size: u32,
        ud: bool,
        rem: &Dest,
        ah: Option<vrdma_engine::AhHandle>,
    ) -> Result<Self> {
        let at = if ud { BASE + GRH_LEN as u64 } else { BASE };
        let (_, cap) = dev
            .dev
            .engine()
            .query_qp(qpn)
            .map(|(attr, init)| (attr, init.cap))?;
        let flags = if cap.max_inline_data >= size {
            SendFlags::SIGNALED.with(SendFlags::INLINE)
        } else {
            SendFlags::SIGNALED
        };
        let ud_dest = ah.map(|ah| UdDest {
            av: vrdma_engine::wr::Av::Handle(ah),
            remote_qpn: rem.qpn,
            remote_qkey: UD_QKEY,
        });
        Ok(SendWr {
            qpn,
            at,
            size,
            flags,
            ud_dest,
        })
    }

    /// Posts it, signaled.
    fn post(&self, dev: &mut Context) -> Result<()> {
        Ok(dev.post_send(
            self.qpn,
            SEND_WRID,
            SendOp::Send,
            (self.at, self.size),
            self.flags,
            self.ud_dest,
        )?)
    }
}

/// The messages, `a.iters` each way, the client first, a side sending
/// again only once its last send completed and a message arrived (the
/// receives, of `recv_len` bytes, topped up as they are used): the
/// microseconds it took.
fn ping_pong(a: &PingpongArgs, dev: &mut Context, send: &SendWr, recv_len: u32) -> Result<f64> {
    let mut routs = a.rx_depth;
    let mut pending = RECV_WRID;
    if a.server.is_some() {
        if a.chk {
            // The C client zeroes the first byte of each page once.
            for off in (0..send.size as usize).step_by(4096) {
                dev.write(send.at + off as u64, &[0])?;
            }
        }
        send.post(dev)?;
        pending |= SEND_WRID;
    }
    let start = Instant::now();
    let (mut rcnt, mut scnt) = (0u32, 0u32);
    // No limit (0) waits as the C tools do: forever.
    let limit = (a.timeout > 0).then(|| Duration::from_secs(a.timeout));
    while rcnt < a.iters || scnt < a.iters {
        let wcs = dev
            .poll(limit.unwrap_or(Duration::from_secs(3600)))?
            .to_vec();
        if wcs.is_empty() {
            ensure!(
                limit.is_none(),
                "no completion in {} s (sent {scnt}, received {rcnt})",
                a.timeout
            );
            continue;
        }
        for wc in wcs {
            if wc.status != WcStatus::Success {
                // rdma-core's words, then the counts: a server's last SEND
                // can fail only because the client, having received it,
                // left before its ACK survived a lossy link (scripts/lossy.sh
                // tells that race from a lost message by them).
                bail!(
                    "Failed status {:?} ({}) for wr_id {} (sent {scnt} of {}, received {rcnt})",
                    wc.status,
                    wc.status as u32,
                    wc.wr_id,
                    a.iters
                );
            }
            match (wc.wr_id, wc.opcode) {
                (SEND_WRID, WcOpcode::Send) => scnt += 1,
                (RECV_WRID, WcOpcode::Recv) => {
                    routs -= 1;
                    if routs <= 1 {
                        post_recvs(dev, send.qpn, recv_len, a.rx_depth - routs)?;
                        routs = a.rx_depth;
                    }
                    rcnt += 1;
                }
                (id, op) => bail!("Completion for unknown wr_id {id} ({op:?})"),
            }
            pending &= !wc.wr_id;
            if scnt < a.iters && pending == 0 {
                send.post(dev)?;
                pending = RECV_WRID | SEND_WRID;
            }
        }
    }
    Ok(start.elapsed().as_secs_f64() * 1e6)
}

/// The C tools' two lines of results: bytes and iterations in `usec`
/// microseconds.
fn print_rates(a: &PingpongArgs, size: u32, usec: f64) {
    let bytes = u64::from(size) * u64::from(a.iters) * 2;
    println!(
        "{bytes} bytes in {:.2} seconds = {:.2} Mbit/sec",
        usec / 1e6,
        bytes as f64 * 8.0 / usec
    );
    println!(
        "{} iters in {:.2} seconds = {:.2} usec/iter",
        a.iters,
        usec / 1e6,
        usec / f64::from(a.iters)
    );
}

/// The server's `-c` check: the first byte of each page the client
/// zeroed came in zero.
fn check_pages(dev: &Context, size: u32, ud: bool) -> Result<()> {
    let recv_at = if ud { BASE + GRH_LEN as u64 } else { BASE };
    for (page, off) in (0..size as usize).step_by(4096).enumerate() {
        if dev.byte(recv_at + off as u64)? != 0 {
            println!("invalid data in page {page}");
        }
    }
    Ok(())
}

/// This side's address, as the C tools print it (UD's line has a colon
/// before the GID).
fn print_local(me: &Dest, ud: bool) {
    let sep = if ud { ":" } else { "," };
    println!(
        "  local address:  LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}{sep} GID {}",
        me.lid,
        me.qpn.value(),
        me.psn.value(),
        gid_text(me.gid)
    );
}

fn print_remote(rem: &Dest) {
    println!(
        "  remote address: LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}, GID {}",
        rem.lid,
        rem.qpn.value(),
        rem.psn.value(),
        gid_text(rem.gid)
    );
}

/// The exchange's TCP connection (to `a.server`, or the first client on
/// `a.port`) and the address the device binds: `-d`'s, or the one the
/// connection uses.
pub fn exchange_stream(a: &PingpongArgs) -> Result<(TcpStream, IpAddr)> {
    let stream = match &a.server {
        Some(host) => crate::common::tcp_connect(host, a.port)?,
        None => {
            let any: IpAddr = match a.ib_dev {
                Some(IpAddr::V6(_)) => Ipv6Addr::UNSPECIFIED.into(),
                _ => Ipv4Addr::UNSPECIFIED.into(),
            };
            let listener = TcpListener::bind((any, a.port))
                .with_context(|| format!("listening on TCP port {}", a.port))?;
            listener.accept()?.0
        }
    };
    let ip = match a.ib_dev {
        Some(ip) => ip,
        None => stream.local_addr()?.ip(),
    };
    Ok((stream, ip))
}

/// The exchange of addresses on `stream`, as the C tools do it (the
/// client writes first; the server connects its QP before it answers):
/// `connect` brings the QP up towards the peer. Returns the peer's
/// address and what `connect` made; the connection is closed.
pub fn exchange<R>(
    mut stream: TcpStream,
    client: bool,
    me: Dest,
    connect: impl FnOnce(&Dest) -> Result<R>,
) -> Result<(Dest, R)> {
    let mut msg = [0u8; MSG_LEN];
    if client {
        write_one(&mut stream, &me.to_wire())?;
        stream
            .read_exact(&mut msg)
            .context("reading the server's address")?;
        write_one(&mut stream, b"done\0")?;
        let rem = Dest::parse(&msg)?;
        let made = connect(&rem)?;
        Ok((rem, made))
    } else {
        stream
            .read_exact(&mut msg)
            .context("reading the client's address")?;
        let rem = Dest::parse(&msg)?;
        let made = connect(&rem).context("Couldn't connect to remote QP")?;
        write_one(&mut stream, &me.to_wire())?;
        let mut done = [0u8; 5];
        stream.read_exact(&mut done).context("reading \"done\"")?;
        ensure!(&done == b"done\0", "the client did not say done");
        Ok((rem, made))
    }
}

/// Writes `msg` with one call: the C tools read each message with one
/// `read(2)` and demand its exact length.
fn write_one(stream: &mut TcpStream, msg: &[u8]) -> Result<()> {
    stream.set_nodelay(true)?;
    let n = stream.write(msg)?;
    ensure!(
        n == msg.len(),
        "short write of the exchange message ({n} of {})",
        msg.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_message_matches_rdma_core() {
        let d = Dest {
            lid: 0,
            qpn: Qpn::from_masked(0x11),
            psn: Psn::from_masked(0x3a4b5c),
            gid: Gid::from(Ipv4Addr::new(10, 47, 91, 11)),
        };
        let w = d.to_wire();
        assert_eq!(
            &w[..51],
            b"0000:000011:3a4b5c:00000000000000000000ffff0a2f5b0b"
        );
        assert_eq!(w[51], 0);
        assert_eq!(Dest::parse(&w).unwrap(), d);
        assert_eq!(gid_text(d.gid), "::ffff:10.47.91.11");
    }

    #[test]
    fn hostile_address_messages_are_refused() {
        for bad in [
            &b""[..],
            b"0000:000011:3a4b5c",
            b"0000:1000000:3a4b5c:00000000000000000000ffff0a2f5b0b",
            b"0000:000011:3a4b5c:00000000000000000000ffff0a2f5b0",
            b"0000:000011:3a4b5c:00000000000000000000ffff0a2f5b0bzz",
            b"0000:000011:3a4b5c:0000000000000000000\xffffff0a2f5b0b",
            b"0000:000011:3a4b5c:00000000000000000000ffff0a2f5b0b:1",
            b"zzzz:000011:3a4b5c:00000000000000000000ffff0a2f5b0b",
            b"0000:+00011:3a4b5c:00000000000000000000ffff0a2f5b0b",
            // 32 bytes of valid UTF-8 whose characters straddle the pairs.
            "0000:000011:3a4b5c:0\u{e9}00000000000000000ffff0a2f5b0b".as_bytes(),
        ] {
            assert!(
                Dest::parse(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
