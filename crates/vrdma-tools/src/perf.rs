//! `vrdma perf`: perftest 4.5's `ib_{write,read,send,atomic}_{bw,lat}` on
//! a vrdma device, compatible with them on the wire and in the out-of-band
//! exchange, so that either side can be the real perftest tool.
//!
//! The exchange (perftest 4.5, `src/perftest_communication.c`; the facts
//! are written up in `docs/perftest.md`): the client connects to TCP port
//! 18515; every message is one `write(2)` that the peer reads with one
//! `read(2)` of exactly its size, the client writing first. First the
//! versions (16 bytes, `"6.06"`), the page size and cache-line size (4-byte
//! big-endian each, both sides use the larger), the MTU (`"%d"` of the
//! `ibv_mtu` code and a NUL, both use the smaller); then 108-byte key
//! messages (`lid:out_reads:qpn:psn:rkey:vaddr:gid…:srqn:`), in the order
//! and number each test uses, some of them only to keep the two sides in
//! step; at the end the bandwidth report (five 8-byte big-endian numbers)
//! and `"done"`.
//!
//! Measurements use the monotonic clock (perftest counts CPU cycles; `-F`
//! is accepted and does nothing). The statistics are perftest's: bandwidth
//! from the first post to the last completion, peak over the completion
//! windows, latency from the gaps between posts, the two slowest samples
//! dropped, percentiles as `sorted[ceil(n × q)]`. The standard deviation
//! is the exact one (perftest truncates each squared difference to an
//! integer).

use std::{
    io::{Read, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpListener, TcpStream},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use vrdma_engine::{
    attr::Mtu,
    mr::Access,
    qp::QpType,
    wc::{Wc, WcOpcode, WcStatus},
    wr::{SendFlags, SendOp},
};
use vrdma_wire::{Gid, Psn, QKey, Qpn, Rkey};

use vrdma_device::verbs::{BASE, Connect, Context, Remote};

use crate::{
    args::{AtomicType, Connection, PerfArgs, PerfTest},
    common::{hex_field, random_psn},
};

/// The version this speaks: perftest 4.5's. Peers older than 5.70 are
/// refused, as perftest refuses them.
const VERSION: &[u8] = b"6.06";
const MIN_VERSION: f64 = 5.70;
/// The key message: 107 characters and a NUL.
pub const KEY_LEN: usize = 108;
/// perftest's buffer cycle: the page size.
const CYCLE: u64 = 4096;
const CACHE_LINE: u64 = 64;
/// The largest size of `-a` (and its buffers).
const MAX_SIZE: u64 = 8 << 20;
/// perftest drops the slowest samples of a latency run.
const LAT_MEASURE_TAIL: usize = 2;
/// Bandwidth runs longer than this report no peak (perftest's rule).
const PEAK_MAX_ITERS: u64 = 20_000;

#[derive(Clone, Copy, Debug, Eq, PartialEq)]
enum Verb {
    Send,
    Write,
    Read,
    Atomic,
}

impl Verb {
    fn title(self) -> &'static str {
        match self {
            Verb::Send => "Send",
            Verb::Write => "RDMA_Write",
            Verb::Read => "RDMA_Read",
            Verb::Atomic => "Atomic",
        }
    }

    /// The QP access flags perftest sets for the verb.
    fn access(self) -> Access {
        match self {
            Verb::Send => Access(Access::REMOTE_WRITE.0 | Access::LOCAL_WRITE.0),
            Verb::Write => Access::REMOTE_WRITE,
            Verb::Read => Access::REMOTE_READ,
            Verb::Atomic => Access::REMOTE_ATOMIC,
        }
    }

    /// Latency samples are round trips halved for ping-pong tests.
    fn rtt_factor(self) -> f64 {
        match self {
            Verb::Read | Verb::Atomic => 1.0,
            Verb::Send | Verb::Write => 2.0,
        }
    }
}

fn split(t: PerfTest) -> (Verb, bool) {
    match t {
        PerfTest::WriteBw => (Verb::Write, true),
        PerfTest::WriteLat => (Verb::Write, false),
        PerfTest::ReadBw => (Verb::Read, true),
        PerfTest::ReadLat => (Verb::Read, false),
        PerfTest::SendBw => (Verb::Send, true),
        PerfTest::SendLat => (Verb::Send, false),
        PerfTest::AtomicBw => (Verb::Atomic, true),
        PerfTest::AtomicLat => (Verb::Atomic, false),
    }
}

/// One QP's key message.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Key {
    pub lid: u16,
    pub out_reads: u16,
    pub qpn: Qpn,
    pub psn: Psn,
    pub rkey: Rkey,
    pub vaddr: u64,
    pub gid: Gid,
    pub srqn: u32,
}

impl Key {
    /// `"%04x:%04x:%06x:%06x:%08x:%016llx:"`, the 16 GID bytes as
    /// `"%02x:"`, `"%08x:"` and a NUL: 108 bytes.
    pub fn to_wire(self) -> [u8; KEY_LEN] {
        let mut s = format!(
            "{:04x}:{:04x}:{:06x}:{:06x}:{:08x}:{:016x}:",
            self.lid,
            self.out_reads,
            self.qpn.value(),
            self.psn.value(),
            self.rkey.0,
            self.vaddr
        );
        for b in self.gid.0 {
            s.push_str(&format!("{b:02x}:"));
        }
        s.push_str(&format!("{:08x}:", self.srqn));
        let mut out = [0u8; KEY_LEN];
        out[..s.len()].copy_from_slice(s.as_bytes());
        out
    }

    /// Parses a peer's key message; anything but the expected shape is
    /// an error (the peer is a stranger on a TCP port).
    pub fn parse(msg: &[u8]) -> Result<Self> {
        let text = msg.split(|&b| b == 0).next().unwrap_or_default();
        let text = std::str::from_utf8(text).map_err(|_| anyhow!("key message is not text"))?;
        let fields: Vec<&str> = text.split(':').collect();
        // 6 numbers, 16 GID bytes, the SRQN and the empty tail after the
        // last ':'.
        ensure!(
            fields.len() == 24 && fields[23].is_empty(),
            "key message has {} fields, not 23 and a trailing ':'",
            fields.len().saturating_sub(1)
        );
        let num = |i: usize, name: &str, max: u64| hex_field(fields[i], name, max);
        let mut gid = [0u8; 16];
        for (k, b) in gid.iter_mut().enumerate() {
            *b = num(6 + k, "GID byte", 0xff)? as u8;
        }
        Ok(Key {
            lid: num(0, "LID", 0xffff)? as u16,
            out_reads: num(1, "out_reads", 0xffff)? as u16,
            qpn: Qpn::from_masked(num(2, "QPN", 0xff_ffff)? as u32),
            psn: Psn::from_masked(num(3, "PSN", 0xff_ffff)? as u32),
            rkey: Rkey(num(4, "rkey", 0xffff_ffff)? as u32),
            vaddr: num(5, "vaddr", u64::MAX)?,
            gid: Gid(gid),
            srqn: num(22, "SRQN", 0xffff_ffff)? as u32,
        })
    }
}

/// What the client reports to the server at the end of a bandwidth test.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct BwReport {
    size: u64,
    iters: u64,
    peak: f64,
    avg: f64,
    msg_rate: f64,
}

/// The TCP side channel, lock-step: the client writes first.
///
/// The device keeps running while a side waits here: a vrdma device's
/// responder is this process, so a server blocked on the socket would
/// answer nobody's READs (perftest's servers wait here while their NIC
/// serves the client).
struct Oob {
    stream: TcpStream,
    client: bool,
    /// `--timeout`: how long a read may wait for the peer.
    timeout: Option<Duration>,
}

impl Oob {
    fn new(stream: TcpStream, client: bool, timeout: Option<Duration>) -> Result<Self> {
        stream.set_nodelay(true)?;
        stream.set_nonblocking(true)?;
        Ok(Oob {
            stream,
            client,
            timeout,
        })
    }

    fn read_exact(&mut self, buf: &mut [u8], mut dev: Option<&mut Context>) -> Result<()> {
        let mut got = 0;
        // The peer may be busy with the test meanwhile: only a device
        // that moves nothing either counts as silence.
        let mut last = Instant::now();
        while got < buf.len() {
            if let Some(t) = self.timeout {
                ensure!(
                    last.elapsed() < t,
                    "no word from the peer and no traffic for {} s",
                    t.as_secs()
                );
            }
            match self.stream.read(&mut buf[got..]) {
                Ok(0) => bail!("the peer closed the connection"),
                Ok(n) => {
                    got += n;
                    last = Instant::now();
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => match dev.as_deref_mut() {
                    Some(d) => {
                        let p = d.progress()?;
                        if !p.is_idle() {
                            last = Instant::now();
                        } else if d.events {
                            d.dev.wait(Duration::from_millis(1))?;
                        }
                    }
                    None => std::thread::sleep(Duration::from_micros(200)),
                },
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Writes `msg` with one call: perftest reads each message with one
    /// `read(2)` and demands its exact length. The socket's buffer is
    /// empty in a lock-step exchange, so the call takes it all.
    fn write_one(&mut self, msg: &[u8]) -> Result<()> {
        loop {
            match self.stream.write(msg) {
                Ok(n) => {
                    ensure!(
                        n == msg.len(),
                        "short write of an exchange message ({n} of {})",
                        msg.len()
                    );
                    return Ok(());
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                    ) =>
                {
                    std::thread::sleep(Duration::from_micros(100));
                }
                Err(e) => return Err(anyhow!(e).context("Couldn't send the exchange")),
            }
        }
    }

    fn xchg(&mut self, mine: &[u8], theirs: &mut [u8], dev: Option<&mut Context>) -> Result<()> {
        if self.client {
            self.write_one(mine)?;
            self.read_exact(theirs, dev)
                .context("Couldn't read remote address")?;
        } else {
            self.read_exact(theirs, dev)
                .context("Couldn't read remote address")?;
            self.write_one(mine)?;
        }
        Ok(())
    }

    /// One `ctx_hand_shake`, the device running meanwhile.
    fn key(&mut self, my: &Key, dev: &mut Context) -> Result<Key> {
        let mut b = [0u8; KEY_LEN];
        self.xchg(&my.to_wire(), &mut b, Some(dev))?;
        Key::parse(&b)
    }

    /// `xchg_bw_reports`: size, iterations, peak, average, message rate,
    /// each an 8-byte big-endian number in its own message.
    fn reports(&mut self, mine: BwReport, dev: &mut Context) -> Result<BwReport> {
        let mut x = |v: [u8; 8]| -> Result<[u8; 8]> {
            let mut b = [0u8; 8];
            self.xchg(&v, &mut b, Some(&mut *dev))
                .context("Couldn't read reports")?;
            Ok(b)
        };
        let size = u64::from_be_bytes(x(mine.size.to_be_bytes())?);
        let iters = u64::from_be_bytes(x(mine.iters.to_be_bytes())?);
        let peak = f64::from_be_bytes(x(mine.peak.to_be_bytes())?);
        let avg = f64::from_be_bytes(x(mine.avg.to_be_bytes())?);
        let msg_rate = f64::from_be_bytes(x(mine.msg_rate.to_be_bytes())?);
        Ok(BwReport {
            size,
            iters,
            peak,
            avg,
            msg_rate,
        })
    }

    /// `ctx_close_connection`: one more key message, then `"done"` (which
    /// nobody reads).
    fn close(mut self, my: &Key, dev: &mut Context) -> Result<()> {
        self.key(my, dev)?;
        let _ = self.stream.write(b"done\0");
        Ok(())
    }
}

/// The C library's `atof` on the version string: the leading decimal
/// number, 0 if there is none.
fn version_number(b: &[u8]) -> f64 {
    let text = b.split(|&c| c == 0).next().unwrap_or_default();
    let end = text
        .iter()
        .position(|c| !(c.is_ascii_digit() || *c == b'.'))
        .unwrap_or(text.len());
    std::str::from_utf8(&text[..end])
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.0)
}

/// The negotiated parameters: everything the tests share.
struct Params {
    verb: Verb,
    bw: bool,
    client: bool,
    qps: usize,
    sizes: Vec<u64>,
    iters: u64,
    duration: Option<Duration>,
    tx_depth: u32,
    rx_depth: u32,
    cq_mod: u64,
    inline: u32,
    out_reads: u16,
    atomic: AtomicType,
    cycle: u64,
    cache_line: u64,
    /// Bytes per region: every QP has a local region and a remote one.
    region: u64,
    no_peak: bool,
    gbits: bool,
    timeout: Option<Duration>,
}

impl Params {
    fn local(&self, q: usize) -> u64 {
        BASE + q as u64 * self.region
    }

    fn remote(&self, q: usize) -> u64 {
        BASE + (self.qps + q) as u64 * self.region
    }

    /// perftest's address walk for the `k`-th message of a QP: messages of
    /// at most half a cycle step through the cycle at cache-line-rounded
    /// strides; larger ones stay put.
    fn offset(&self, size: u64, k: u64) -> u64 {
        let inc = size.next_multiple_of(self.cache_line);
        if size > self.cycle / 2 {
            return 0;
        }
        (k % (self.cycle / inc).max(1)) * inc
    }

    fn factor(&self) -> f64 {
        if self.gbits {
            125_000_000.0
        } else {
            1_048_576.0
        }
    }
}

pub fn run(a: &PerfArgs) -> Result<()> {
    let (verb, bw) = split(a.test);
    let client = a.server.is_some();
    ensure!(
        a.ib_port == 1,
        "port {}: a vrdma device has one port, 1",
        a.ib_port
    );
    if let Some(g) = a.gid_index {
        ensure!(
            g == 0,
            "GID index {g}: a vrdma device has one GID (index 0: its address)"
        );
    }
    ensure!(a.qps >= 1 && a.qps <= 1024, "number of QPs must be 1..1024");
    ensure!(bw || a.qps == 1, "Multiple QPs only available on bw tests");
    ensure!(
        !(a.connection == Connection::Uc && matches!(verb, Verb::Read | Verb::Atomic)),
        "UC connection not possible in READ/ATOMIC verbs"
    );
    ensure!(
        !(a.duration.is_some() && a.all),
        "Duration mode isn't supported when running on all sizes"
    );
    if verb == Verb::Atomic {
        ensure!(
            a.size.is_none_or(|s| s == 8) && !a.all,
            "Message size cannot be changed for Atomic tests"
        );
    }
    if matches!(verb, Verb::Read | Verb::Atomic) {
        ensure!(
            a.inline_size.is_none_or(|i| i == 0),
            "Inline feature not available on READ/ATOMIC verbs"
        );
    }
    let size = match (verb, bw) {
        (Verb::Atomic, _) => 8,
        (_, true) => a.size.unwrap_or(65536),
        (_, false) => a.size.unwrap_or(2),
    };
    ensure!(
        (1..=u64::from(u32::MAX)).contains(&size),
        "size {size} out of range"
    );
    let sizes: Vec<u64> = if a.all {
        (1..=23).map(|i| 1u64 << i).collect()
    } else {
        vec![size]
    };
    let buf_size = if a.all { MAX_SIZE } else { size };
    let default_iters = if a.test == PerfTest::WriteBw {
        5000
    } else {
        1000
    };
    let iters = a.iters.unwrap_or(default_iters);
    ensure!(
        a.duration.is_some() || (5..=100_000_000).contains(&iters),
        "Iteration num must be between 5 and 100000000"
    );
    if let Some(d) = a.duration {
        ensure!(d >= 2, "duration must be at least 2 seconds");
    }
    let duration = a.duration.map(Duration::from_secs);
    let mut tx_depth = a.tx_depth.unwrap_or(if bw { 128 } else { 1 });
    ensure!((1..=15000).contains(&tx_depth), "tx depth must be 1..15000");
    if duration.is_none() {
        tx_depth = tx_depth.min(iters as u32);
    }
    let mut rx_depth = if verb == Verb::Send {
        let r = a.rx_depth.unwrap_or(512);
        ensure!((1..=15000).contains(&r), "rx depth must be 1..15000");
        let mut r = if duration.is_none() {
            r.min(iters as u32)
        } else {
            r
        };
        if bw && r % 2 == 1 {
            r += 1;
        }
        r
    } else {
        1
    };
    if verb == Verb::Send && duration.is_none() {
        rx_depth = rx_depth.min(iters as u32);
    }
    let mut cq_mod = u64::from(a.cq_mod.unwrap_or(100));
    ensure!(cq_mod >= 1, "CQ moderation must be at least 1");
    if a.cq_mod.is_none() && size > 8192 && !a.all {
        cq_mod = 1;
    }
    if !bw {
        cq_mod = 1;
    }
    cq_mod = cq_mod.min(u64::from(tx_depth));
    let inline = a.inline_size.unwrap_or(0);
    ensure!(inline <= 256, "inline size {inline}: at most 256");
    let no_peak =
        !bw || duration.is_some() || iters > PEAK_MAX_ITERS || (verb == Verb::Send && !client);

    // The side channel decides which address the device binds.
    let (stream, local_ip) = match &a.server {
        Some(host) => {
            let stream = crate::common::tcp_connect(host, a.port)?;
            let ip = stream.local_addr()?.ip();
            (stream, ip)
        }
        None => {
            println!();
            println!("************************************");
            println!("* Waiting for client to connect... *");
            println!("************************************");
            let any: IpAddr = match a.ib_dev {
                Some(IpAddr::V6(_)) => Ipv6Addr::UNSPECIFIED.into(),
                _ => Ipv4Addr::UNSPECIFIED.into(),
            };
            let listener = TcpListener::bind((any, a.port))
                .with_context(|| format!("listening on TCP port {}", a.port))?;
            let (stream, _) = listener.accept()?;
            let ip = stream.local_addr()?.ip();
            (stream, ip)
        }
    };
    let timeout = (a.timeout > 0).then(|| Duration::from_secs(a.timeout));
    let mut oob = Oob::new(stream, client, timeout)?;

    // Versions, then page and cache-line sizes, then the MTU.
    let mut version = [0u8; 16];
    version[..VERSION.len()].copy_from_slice(VERSION);
    let mut theirs = [0u8; 16];
    oob.xchg(&version, &mut theirs, None)?;
    ensure!(
        version_number(&theirs) >= MIN_VERSION,
        "Current implementation is not compatible with versions older than 5.70 (peer: {:?})",
        String::from_utf8_lossy(theirs.split(|&c| c == 0).next().unwrap_or_default())
    );
    let mut four = [0u8; 4];
    oob.xchg(&(CYCLE as u32).to_be_bytes(), &mut four, None)?;
    let cycle = CYCLE.max(u64::from(u32::from_be_bytes(four)));
    oob.xchg(&(CACHE_LINE as u32).to_be_bytes(), &mut four, None)?;
    let cache_line = CACHE_LINE.max(u64::from(u32::from_be_bytes(four)));
    // A hostile peer could ask for absurd buffers.
    ensure!(
        cycle.is_power_of_two() && cycle <= 2 << 20,
        "peer's page size {cycle} is not a power of two up to 2 MiB"
    );
    ensure!(
        cache_line.is_power_of_two() && cache_line <= 4096,
        "peer's cache line {cache_line} is not a power of two up to 4096"
    );

    let ip = a.ib_dev.unwrap_or(local_ip);
    let region = buf_size.max(cycle).next_multiple_of(cache_line);
    let qps = a.qps as usize;
    let mem = region
        .checked_mul(2 * qps as u64)
        .filter(|m| *m <= 16 << 30)
        .ok_or_else(|| anyhow!("buffers of {qps} QPs × 2 × {region} B are too large"))?;
    let cqe = (u64::from(tx_depth) + u64::from(rx_depth)) * qps as u64;
    ensure!(
        cqe <= 32767,
        "{qps} QPs × (tx depth {tx_depth} + rx depth {rx_depth}) exceed the CQ's 32767 entries"
    );
    let mut dev = Context::open_with_cq(ip, mem as usize, a.events, cqe.max(64) as u32)?;

    let active = dev.active_mtu();
    let mut mtu = match a.mtu {
        None => active,
        Some(m) => match mtu_from_bytes(m) {
            None => {
                println!(" Invalid MTU - {m} ");
                println!(" Please choose mtu from {{256,512,1024,2048,4096}}");
                println!(" Will run with the port active mtu - {}", active.bytes());
                active
            }
            Some(m) if m > active => {
                println!(" Requested mtu is higher than active mtu ");
                println!(" Changing to active mtu - {}", active.bytes());
                active
            }
            Some(m) => m,
        },
    };
    let mut two = [0u8; 2];
    oob.xchg(&[b'0' + mtu as u8, 0], &mut two, None)?;
    if two[1] == 0
        && let Some(theirs) = (two[0] as char).to_digit(10).and_then(Mtu::from_code)
    {
        mtu = mtu.min(theirs);
    }

    let out_reads: u16 = match verb {
        Verb::Read | Verb::Atomic => {
            let max = dev.dev.engine().query_device().max_qp_rd_atom;
            a.outs.unwrap_or(max).clamp(1, max) as u16
        }
        _ => 1,
    };
    let p = Params {
        verb,
        bw,
        client,
        qps,
        sizes,
        iters,
        duration,
        tx_depth,
        rx_depth,
        cq_mod,
        inline,
        out_reads,
        atomic: a.atomic_type,
        cycle,
        cache_line,
        region,
        no_peak,
        gbits: a.report_gbits,
        timeout,
    };

    let ty = match a.connection {
        Connection::Rc => QpType::Rc,
        Connection::Uc => QpType::Uc,
    };
    let mut c = Connect {
        mtu,
        sl: 0,
        hop_limit: 0xff,
        traffic_class: a.tclass,
        min_rnr_timer: 12,
        timeout: a.qp_timeout,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 1,
        max_dest_rd_atomic: out_reads.min(255) as u8,
        qkey: QKey(0),
        access: verb.access(),
    };
    let mut my = Vec::with_capacity(qps);
    for q in 0..qps {
        let qpn = dev.create_qp(ty, tx_depth, rx_depth, inline)?;
        dev.init_qp(qpn, &c)?;
        my.push(Key {
            lid: 0,
            out_reads,
            qpn,
            psn: random_psn(),
            rkey: dev.rkey,
            vaddr: p.remote(q),
            gid: dev.gid(),
            srqn: 0,
        });
    }
    print_info(a, &p, &dev, mtu);

    // The key messages, in each test's order ("K" in docs/perftest.md).
    let first_single = !bw && verb != Verb::Send;
    if first_single {
        oob.key(&my[0], &mut dev)?;
    }
    let mut rem = Vec::with_capacity(qps);
    for k in &my {
        let r = oob.key(k, &mut dev)?;
        ensure!(
            is_v4_mapped(r.gid) == is_v4_mapped(k.gid),
            "Found Incompatibility issue with GID types."
        );
        print_key("local", verb, k);
        print_key("remote", verb, &r);
        rem.push(r);
    }
    // Both sides of a latency test and a bandwidth client request; a
    // bandwidth server only answers (perftest leaves it in RTR).
    let rts = !bw || client;
    for (k, r) in my.iter().zip(&rem) {
        c.max_rd_atomic = r.out_reads.clamp(1, out_reads.max(1)).min(255) as u8;
        let remote = Remote {
            qpn: r.qpn,
            psn: r.psn,
            gid: r.gid,
        };
        if rts {
            dev.connect(k.qpn, k.psn, remote, &c)?;
        } else {
            dev.connect_rtr(k.qpn, k.psn, remote, &c)?;
        }
    }
    if verb == Verb::Send {
        oob.key(&my[0], &mut dev)?;
        for k in &my {
            oob.key(k, &mut dev)?;
        }
    } else {
        for k in &my {
            oob.key(k, &mut dev)?;
        }
        oob.key(&my[0], &mut dev)?;
    }

    let mut t = Tester {
        dev,
        qps: my.iter().map(|k| k.qpn).collect(),
        rem,
        p,
    };
    match (verb, bw) {
        (Verb::Send, true) => {
            println!("{RESULT_LINE}{}", bw_header(t.p.gbits));
            let all = t.p.sizes.len() > 1;
            for size in t.p.sizes.clone() {
                if !client {
                    t.post_recvs_bw(size)?;
                }
                oob.key(&my[0], &mut t.dev)?;
                let r = if client {
                    t.bw_client(size)?
                } else {
                    t.bw_server(size)?
                };
                print_bw_row(&t.p, &r);
                if all {
                    oob.key(&my[0], &mut t.dev)?;
                }
            }
            println!("{RESULT_LINE}");
            oob.close(&my[0], &mut t.dev)?;
        }
        (_, true) => {
            println!("{RESULT_LINE}{}", bw_header(t.p.gbits));
            if client {
                let mut last = BwReport::default();
                for size in t.p.sizes.clone() {
                    last = t.bw_client(size)?;
                    print_bw_row(&t.p, &last);
                }
                oob.key(&my[0], &mut t.dev)?;
                oob.reports(last, &mut t.dev)?;
            } else {
                // Serve until the client says it is done; its report is
                // the row to print.
                oob.key(&my[0], &mut t.dev)?;
                let theirs = oob.reports(BwReport::default(), &mut t.dev)?;
                print_bw_row(&t.p, &theirs);
            }
            println!("{RESULT_LINE}");
            oob.close(&my[0], &mut t.dev)?;
        }
        (Verb::Write, false) => {
            println!("{RESULT_LINE}{}", lat_header(t.p.duration.is_some()));
            for size in t.p.sizes.clone() {
                let samples = t.write_lat(size)?;
                print_lat(&t.p, size, &samples);
            }
            println!("{RESULT_LINE}");
        }
        (Verb::Send, false) => {
            println!("{RESULT_LINE}{}", lat_header(t.p.duration.is_some()));
            for size in t.p.sizes.clone() {
                let n = if t.p.duration.is_some() {
                    t.p.rx_depth
                } else {
                    t.p.rx_depth.min(t.p.iters as u32)
                };
                t.dev
                    .post_recvs(t.qps[0], 0, t.p.remote(0), size as u32, n)?;
                oob.key(&my[0], &mut t.dev)?;
                let samples = t.send_lat(size)?;
                print_lat(&t.p, size, &samples);
            }
            println!("{RESULT_LINE}");
            oob.close(&my[0], &mut t.dev)?;
        }
        (_, false) => {
            if client {
                println!("{RESULT_LINE}{}", lat_header(t.p.duration.is_some()));
                for size in t.p.sizes.clone() {
                    let samples = t.op_lat(size)?;
                    print_lat(&t.p, size, &samples);
                }
            }
            println!("{RESULT_LINE}");
            oob.close(&my[0], &mut t.dev)?;
        }
    }
    let s = t.dev.dev.transport().stats();
    tracing::debug!(?s, engine = ?t.dev.dev.engine().stats(), "device counters");
    Ok(())
}

fn is_v4_mapped(g: Gid) -> bool {
    Ipv6Addr::from(g.0).to_ipv4_mapped().is_some()
}

fn mtu_from_bytes(n: u32) -> Option<Mtu> {
    Some(match n {
        256 => Mtu::Mtu256,
        512 => Mtu::Mtu512,
        1024 => Mtu::Mtu1024,
        2048 => Mtu::Mtu2048,
        4096 => Mtu::Mtu4096,
        _ => return None,
    })
}

/// The device, its QPs and the peer's keys: what a test run needs.
struct Tester {
    dev: Context,
    qps: Vec<Qpn>,
    rem: Vec<Key>,
    p: Params,
}

/// Tracks a run's deadline (`-D`), its measurement window and stalls.
struct Clock {
    start: Instant,
    /// `-D`: the window [start + margin, end - margin] and the end.
    window: Option<(Instant, Instant, Instant)>,
    timeout: Option<Duration>,
    last_progress: Instant,
}

impl Clock {
    fn new(p: &Params) -> Self {
        let start = Instant::now();
        Clock {
            start,
            window: p.duration.map(|d| {
                let margin = d / 4;
                (start + margin, start + d - margin, start + d)
            }),
            timeout: p.timeout,
            last_progress: start,
        }
    }

    fn over(&self, now: Instant) -> bool {
        self.window.is_some_and(|(_, _, end)| now >= end)
    }

    fn in_window(&self, now: Instant) -> bool {
        self.window.is_some_and(|(a, b, _)| now >= a && now < b)
    }

    fn window_secs(&self) -> f64 {
        self.window.map_or(0.0, |(a, b, _)| (b - a).as_secs_f64())
    }

    fn progressed(&mut self, now: Instant) {
        self.last_progress = now;
    }

    /// Fails once nothing has happened for the `--timeout`.
    fn check_stall(&self, now: Instant, what: impl FnOnce() -> String) -> Result<()> {
        if let Some(t) = self.timeout
            && now - self.last_progress > t
        {
            bail!("no progress in {} s: {}", t.as_secs(), what());
        }
        Ok(())
    }

    fn nanos(&self, now: Instant) -> u64 {
        (now - self.start).as_nanos() as u64
    }
}

fn check_wc(wc: &Wc, side: &str) -> Result<()> {
    if wc.status != WcStatus::Success {
        bail!(
            "Completion with error at {side}:\nFailed status {} ({:?}): wr_id {} syndrom 0x{:x}",
            wc.status as u32,
            wc.status,
            wc.wr_id,
            wc.vendor_err
        );
    }
    Ok(())
}

impl Tester {
    fn side(&self) -> &'static str {
        if self.p.client { "client" } else { "server" }
    }

    /// Completions now (busy-polling), or after a short sleep in event
    /// mode.
    /// One turn of the device and the completions it brought; in event
    /// mode a turn with none sleeps until a datagram arrives (or 1 ms):
    /// an incoming WRITE makes no completion, so waiting for one would
    /// miss it.
    fn completions(&mut self) -> Result<Vec<Wc>> {
        let events = self.dev.events;
        let wcs = self.dev.poll_now()?.to_vec();
        if events && wcs.is_empty() {
            self.dev.dev.wait(Duration::from_millis(1))?;
        }
        let side = self.side();
        for wc in &wcs {
            check_wc(wc, side)?;
        }
        Ok(wcs)
    }

    fn op(&self, q: usize, size: u64, k: u64) -> SendOp {
        // The peer's address: any value it sent (its responder checks).
        let remote_addr = self.rem[q].vaddr.wrapping_add(self.p.offset(size, k));
        let rkey = self.rem[q].rkey;
        match self.p.verb {
            Verb::Send => SendOp::Send,
            Verb::Write => SendOp::RdmaWrite { remote_addr, rkey },
            Verb::Read => SendOp::RdmaRead { remote_addr, rkey },
            Verb::Atomic => match self.p.atomic {
                AtomicType::FetchAndAdd => SendOp::FetchAdd {
                    remote_addr,
                    rkey,
                    add: 1,
                },
                AtomicType::CmpAndSwap => SendOp::CompareSwap {
                    remote_addr,
                    rkey,
                    compare: 0,
                    swap: 0,
                },
            },
        }
    }

    fn flags(&self, size: u64, signaled: bool) -> SendFlags {
        let mut f = if signaled {
            SendFlags::SIGNALED
        } else {
            SendFlags(0)
        };
        if size <= u64::from(self.p.inline) && matches!(self.p.verb, Verb::Send | Verb::Write) {
            f = f.with(SendFlags::INLINE);
        }
        f
    }

    /// The bandwidth client: every QP posts `iters` messages (or until
    /// the deadline) with at most `tx_depth` outstanding, one in `cq_mod`
    /// signaled.
    fn bw_client(&mut self, size: u64) -> Result<BwReport> {
        let p = &self.p;
        let (n, iters, cq_mod) = (p.qps, p.iters, p.cq_mod);
        let timed = p.duration.is_some();
        let total = iters * n as u64;
        let peak = !p.no_peak;
        let mut tposted = if peak {
            vec![0u64; total as usize]
        } else {
            vec![]
        };
        let mut tcompleted = if peak {
            vec![u64::MAX; total as usize]
        } else {
            vec![]
        };
        let (mut scnt, mut ccnt) = (vec![0u64; n], vec![0u64; n]);
        let (mut totscnt, mut totccnt) = (0u64, 0u64);
        let mut clock = Clock::new(p);
        let mut window = (0u64, None::<Instant>, None::<Instant>);
        let mut last_completion = clock.start;
        loop {
            let now = Instant::now();
            if timed {
                if clock.over(now) {
                    break;
                }
            } else if ccnt.iter().all(|&c| c >= iters) {
                break;
            }
            for q in 0..n {
                while (timed || scnt[q] < iters) && scnt[q] - ccnt[q] < u64::from(self.p.tx_depth) {
                    let k = scnt[q];
                    let signaled = k % cq_mod == cq_mod - 1 || (!timed && k == iters - 1);
                    let local = self.p.local(q) + self.p.offset(size, k);
                    let op = self.op(q, size, k);
                    let flags = self.flags(size, signaled);
                    if peak {
                        tposted[totscnt as usize] = clock.nanos(Instant::now());
                    }
                    self.dev.post_send(
                        self.qps[q],
                        q as u64,
                        op,
                        (local, size as u32),
                        flags,
                        None,
                    )?;
                    scnt[q] += 1;
                    totscnt += 1;
                }
            }
            let wcs = self.completions()?;
            let now = Instant::now();
            if wcs.is_empty() {
                let side = self.side();
                clock.check_stall(now, || {
                    format!("{side} has {totccnt} of {total} completions")
                })?;
                continue;
            }
            clock.progressed(now);
            last_completion = now;
            for wc in wcs {
                let q = wc.wr_id as usize;
                ensure!(q < n, "completion for unknown wr_id {}", wc.wr_id);
                let before = ccnt[q];
                ccnt[q] = if timed {
                    before + cq_mod
                } else {
                    (before + cq_mod).min(iters)
                };
                totccnt += ccnt[q] - before;
                if peak {
                    tcompleted[(totccnt.min(total) - 1) as usize] = clock.nanos(now);
                }
                if clock.in_window(now) {
                    window.0 += ccnt[q] - before;
                    window.1.get_or_insert(now);
                    window.2 = Some(now);
                }
            }
        }
        let p = &self.p;
        if timed {
            let secs = clock.window_secs();
            return Ok(report(p, size, window.0, secs, 0.0));
        }
        let secs = (last_completion - clock.start).as_secs_f64();
        let best = if peak {
            peak_delta(&tposted, &tcompleted, cq_mod)
        } else {
            None
        };
        let peak_bw = best.map_or(0.0, |ns| size as f64 * 1e9 / ns / p.factor());
        Ok(report(p, size, total, secs, peak_bw))
    }

    /// Posts the bandwidth server's receives: `rx_depth` per QP.
    fn post_recvs_bw(&mut self, size: u64) -> Result<()> {
        for q in 0..self.p.qps {
            for k in 0..u64::from(self.p.rx_depth) {
                let at = self.p.remote(q) + self.p.offset(size, k);
                self.dev
                    .post_recvs(self.qps[q], q as u64, at, size as u32, 1)?;
            }
        }
        Ok(())
    }

    /// The send_bw server: takes `iters` messages on every QP, posting a
    /// receive for each one taken while fewer than `iters` were posted.
    fn bw_server(&mut self, size: u64) -> Result<BwReport> {
        let (n, iters) = (self.p.qps, self.p.iters);
        let timed = self.p.duration.is_some();
        let mut rcnt = vec![0u64; n];
        let mut posted = vec![u64::from(self.p.rx_depth); n];
        let total = iters * n as u64;
        let mut tot = 0u64;
        let mut clock = Clock::new(&self.p);
        let (mut first, mut last) = (None::<Instant>, clock.start);
        let mut window = 0u64;
        loop {
            let now = Instant::now();
            if timed {
                if clock.over(now) {
                    break;
                }
            } else if tot >= total {
                break;
            }
            let wcs = self.completions()?;
            let now = Instant::now();
            if wcs.is_empty() {
                let side = self.side();
                clock.check_stall(now, || format!("{side} received {tot} of {total}"))?;
                continue;
            }
            clock.progressed(now);
            for wc in wcs {
                let q = wc.wr_id as usize;
                ensure!(
                    q < n && wc.opcode == WcOpcode::Recv,
                    "unexpected completion {:?} for wr_id {}",
                    wc.opcode,
                    wc.wr_id
                );
                first.get_or_insert(now);
                last = now;
                rcnt[q] += 1;
                tot += 1;
                if clock.in_window(now) {
                    window += 1;
                }
                if timed || posted[q] < iters {
                    let at = self.p.remote(q) + self.p.offset(size, posted[q]);
                    self.dev
                        .post_recvs(self.qps[q], q as u64, at, size as u32, 1)?;
                    posted[q] += 1;
                }
            }
        }
        if timed {
            return Ok(report(&self.p, size, window, clock.window_secs(), 0.0));
        }
        let secs = first.map_or(0.0, |f| (last - f).as_secs_f64());
        Ok(report(&self.p, size, total, secs, 0.0))
    }

    /// write_lat: each side writes `size` bytes to the peer and waits for
    /// the peer's write to change the last byte of its own buffer; the
    /// server writes first.
    fn write_lat(&mut self, size: u64) -> Result<Samples> {
        let timed = self.p.duration.is_some();
        let iters = if timed { u64::MAX } else { self.p.iters };
        let post_at = self.p.local(0);
        let poll_at = self.p.remote(0) + size - 1;
        let mut clock = Clock::new(&self.p);
        let mut s = Samples::new(&self.p);
        let (mut scnt, mut ccnt, mut rcnt) = (0u64, 0u64, 0u64);
        // The polled byte starts at 0: memory starts zeroed, and a smaller
        // size of `-a` never wrote it. (Not cleared here: the peer's first
        // write may already have landed while the exchange ran.)
        while scnt < iters || ccnt < iters || rcnt < iters {
            // The server writes first.
            if rcnt < iters && (self.p.client || scnt >= 1) {
                rcnt += 1;
                let want = rcnt as u8;
                while self.dev.byte(poll_at)? != want {
                    let now = Instant::now();
                    if clock.over(now) {
                        return Ok(s);
                    }
                    ccnt += self.completions()?.len() as u64;
                    clock.check_stall(now, || format!("waiting for write {rcnt}"))?;
                }
                clock.progressed(Instant::now());
            }
            if scnt < iters {
                let now = Instant::now();
                s.posted(&clock, now);
                scnt += 1;
                self.dev.write(post_at + size - 1, &[scnt as u8])?;
                let op = self.op(0, size, 0);
                let flags = self.flags(size, true);
                self.dev
                    .post_send(self.qps[0], 0, op, (post_at, size as u32), flags, None)?;
            }
            while ccnt < scnt {
                let now = Instant::now();
                if clock.over(now) {
                    return Ok(s);
                }
                ccnt += self.completions()?.len() as u64;
                clock.check_stall(now, || format!("waiting for write {scnt} to complete"))?;
            }
        }
        Ok(s)
    }

    /// send_lat: each side sends when it has received (the client
    /// first), receives re-posted while more are expected.
    fn send_lat(&mut self, size: u64) -> Result<Samples> {
        let timed = self.p.duration.is_some();
        let iters = if timed { u64::MAX } else { self.p.iters };
        let rx_depth = u64::from(self.p.rx_depth);
        let post_at = self.p.local(0);
        let recv_at = self.p.remote(0);
        let mut clock = Clock::new(&self.p);
        let mut s = Samples::new(&self.p);
        let (mut scnt, mut rcnt) = (0u64, 0u64);
        let (mut recvd, mut sent) = (0u64, 0u64);
        let count = |wcs: Vec<Wc>, recvd: &mut u64, sent: &mut u64| -> Result<()> {
            for wc in wcs {
                match wc.opcode {
                    WcOpcode::Recv => {
                        ensure!(
                            u64::from(wc.byte_len) == size,
                            "received {} bytes, expected {size}",
                            wc.byte_len
                        );
                        *recvd += 1;
                    }
                    WcOpcode::Send => *sent += 1,
                    op => bail!("unexpected completion {op:?}"),
                }
            }
            Ok(())
        };
        while scnt < iters || rcnt < iters {
            // The client sends first.
            if rcnt < iters && (!self.p.client || scnt >= 1) {
                while recvd <= rcnt {
                    let now = Instant::now();
                    if clock.over(now) {
                        return Ok(s);
                    }
                    let wcs = self.completions()?;
                    count(wcs, &mut recvd, &mut sent)?;
                    clock.check_stall(now, || format!("waiting for message {}", rcnt + 1))?;
                }
                clock.progressed(Instant::now());
                rcnt += 1;
                if timed || rcnt + rx_depth <= iters {
                    self.dev
                        .post_recvs(self.qps[0], 0, recv_at, size as u32, 1)?;
                }
            }
            if scnt < iters {
                let now = Instant::now();
                s.posted(&clock, now);
                scnt += 1;
                let signaled = scnt % self.p.cq_mod == 0 || scnt == iters;
                let op = self.op(0, size, 0);
                let flags = self.flags(size, signaled);
                self.dev
                    .post_send(self.qps[0], 0, op, (post_at, size as u32), flags, None)?;
                if signaled {
                    let want = sent + 1;
                    while sent < want {
                        let now = Instant::now();
                        if clock.over(now) {
                            return Ok(s);
                        }
                        let wcs = self.completions()?;
                        count(wcs, &mut recvd, &mut sent)?;
                        clock.check_stall(now, || format!("waiting for send {scnt}"))?;
                    }
                }
            }
        }
        Ok(s)
    }

    /// read_lat / atomic_lat (the client): one operation at a time.
    fn op_lat(&mut self, size: u64) -> Result<Samples> {
        let timed = self.p.duration.is_some();
        let iters = if timed { u64::MAX } else { self.p.iters };
        let at = self.p.local(0);
        let mut clock = Clock::new(&self.p);
        let mut s = Samples::new(&self.p);
        for k in 0..iters {
            let now = Instant::now();
            if clock.over(now) {
                break;
            }
            s.posted(&clock, now);
            let op = self.op(0, size, 0);
            let flags = self.flags(size, true);
            self.dev
                .post_send(self.qps[0], 0, op, (at, size as u32), flags, None)?;
            loop {
                let now = Instant::now();
                if !self.completions()?.is_empty() {
                    clock.progressed(now);
                    break;
                }
                clock.check_stall(now, || format!("waiting for operation {k}"))?;
            }
        }
        Ok(s)
    }
}

/// perftest's peak: the best time per message over any run of messages
/// from a post to a signaled completion (`tcompleted` holds `u64::MAX`
/// where no completion was recorded).
fn peak_delta(tposted: &[u64], tcompleted: &[u64], cq_mod: u64) -> Option<f64> {
    let total = tposted.len();
    let cq_mod = cq_mod as usize;
    let mut best: Option<f64> = None;
    let mut consider = |i: usize, j: usize| {
        let (tc, tp) = (tcompleted[j], tposted[i]);
        if tc != u64::MAX && tc >= tp {
            let t = (tc - tp) as f64 / (j - i + 1) as f64;
            if t > 0.0 && best.is_none_or(|b| t < b) {
                best = Some(t);
            }
        }
    };
    for i in 0..total {
        let mut j = (i + 1).next_multiple_of(cq_mod) - 1;
        while j < total {
            consider(i, j);
            j += cq_mod;
        }
        if !total.is_multiple_of(cq_mod) {
            consider(i, total - 1);
        }
    }
    best
}

fn report(p: &Params, size: u64, msgs: u64, secs: f64, peak: f64) -> BwReport {
    let (avg, msg_rate) = if secs > 0.0 {
        (
            size as f64 * msgs as f64 / secs / p.factor(),
            msgs as f64 / secs / 1e6,
        )
    } else {
        (0.0, 0.0)
    };
    BwReport {
        size,
        iters: msgs,
        peak,
        avg,
        msg_rate,
    }
}

/// A latency run's post times (iterations) or its count in the window
/// (`-D`).
struct Samples {
    posts: Vec<u64>,
    window_count: u64,
    window_secs: f64,
    timed: bool,
}

impl Samples {
    fn new(p: &Params) -> Self {
        Samples {
            posts: Vec::with_capacity(if p.duration.is_some() {
                0
            } else {
                p.iters as usize
            }),
            window_count: 0,
            window_secs: 0.0,
            timed: p.duration.is_some(),
        }
    }

    fn posted(&mut self, clock: &Clock, now: Instant) {
        if self.timed {
            if clock.in_window(now) {
                self.window_count += 1;
            }
            self.window_secs = clock.window_secs();
        } else {
            self.posts.push(clock.nanos(now));
        }
    }
}

/// Latency statistics in µs, as perftest computes them.
#[derive(Debug, PartialEq)]
struct LatStats {
    min: f64,
    max: f64,
    typical: f64,
    avg: f64,
    stdev: f64,
    p99: f64,
    p999: f64,
}

fn lat_stats(posts: &[u64], rtt_factor: f64) -> Option<LatStats> {
    let mut delta: Vec<f64> = posts
        .windows(2)
        .map(|w| (w[1] - w[0]) as f64 / 1000.0 / rtt_factor)
        .collect();
    if delta.len() <= LAT_MEASURE_TAIL + 1 {
        return None;
    }
    delta.sort_by(f64::total_cmp);
    let cnt = delta.len() - LAT_MEASURE_TAIL;
    let typical = if cnt.is_multiple_of(2) {
        (delta[cnt / 2 - 1] + delta[cnt / 2]) / 2.0
    } else {
        delta[cnt / 2]
    };
    let avg = delta[..cnt].iter().sum::<f64>() / cnt as f64;
    let var = delta[..cnt].iter().map(|d| (d - avg).powi(2)).sum::<f64>() / cnt as f64;
    let at = |q: f64| delta[((cnt as f64 * q).ceil() as usize).min(delta.len() - 1)];
    Some(LatStats {
        min: delta[0],
        max: delta[cnt],
        typical,
        avg,
        stdev: var.sqrt(),
        p99: at(0.99),
        p999: at(0.999),
    })
}

const RESULT_LINE: &str =
    "---------------------------------------------------------------------------------------";

fn bw_header(gbits: bool) -> &'static str {
    if gbits {
        "\n #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]"
    } else {
        "\n #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]"
    }
}

fn lat_header(timed: bool) -> &'static str {
    if timed {
        "\n #bytes        #iterations       t_avg[usec]    tps average"
    } else {
        "\n #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] "
    }
}

fn print_bw_row(p: &Params, r: &BwReport) {
    if p.gbits && r.avg < 0.1 {
        println!(
            " {:<7}    {}           {:<7.6}            {:<7.6}            {:<7.6}",
            r.size, r.iters, r.peak, r.avg, r.msg_rate
        );
    } else {
        println!(
            " {:<7}    {:<10}       {:<7.2}            {:<7.2}\t\t   {:<7.6}",
            r.size, r.iters, r.peak, r.avg, r.msg_rate
        );
    }
}

fn print_lat(p: &Params, size: u64, s: &Samples) {
    let factor = p.verb.rtt_factor();
    if s.timed {
        let (n, secs) = (s.window_count, s.window_secs);
        let (avg, tps) = if n > 0 && secs > 0.0 {
            (secs * 1e6 / factor / n as f64, n as f64 / secs)
        } else {
            (0.0, 0.0)
        };
        println!(" {size:<7}       {n}            {avg:<7.2}        {tps:<7.2}");
        return;
    }
    match lat_stats(&s.posts, factor) {
        Some(l) => println!(
            " {:<7} {}          {:<7.2}        {:<7.2}      {:<7.2}  \t       {:<7.2}     \t{:<7.2}\t\t{:<7.2} \t\t{:<7.2}",
            size, p.iters, l.min, l.max, l.typical, l.avg, l.stdev, l.p99, l.p999
        ),
        None => println!(" {size:<7} {}          (too few samples)", p.iters),
    }
}

/// `%#0Nx`: `0x` and zero-padding to N characters in all, no prefix for 0.
fn c_alt_hex(v: u64, width: usize) -> String {
    if v == 0 {
        format!("{:0width$}", 0)
    } else {
        format!("{v:#0width$x}")
    }
}

fn print_key(side: &str, verb: Verb, k: &Key) {
    let mut line = format!(
        " {side} address: LID {} QPN {} PSN {}",
        c_alt_hex(u64::from(k.lid), 4),
        c_alt_hex(u64::from(k.qpn.value()), 6),
        c_alt_hex(u64::from(k.psn.value()), 6)
    );
    if verb == Verb::Read {
        line.push_str(&format!(" OUT {}", c_alt_hex(u64::from(k.out_reads), 4)));
    }
    if matches!(verb, Verb::Read | Verb::Write) {
        line.push_str(&format!(
            " RKey {} VAddr {}",
            c_alt_hex(u64::from(k.rkey.0), 8),
            c_alt_hex(k.vaddr, 16)
        ));
    }
    println!("{line}");
    let gid: Vec<String> = k.gid.0.iter().map(|b| format!("{b:02}")).collect();
    println!(" GID: {}", gid.join(":"));
}

fn print_info(a: &PerfArgs, p: &Params, dev: &Context, mtu: Mtu) {
    let mut title = format!("{} ", p.verb.title());
    if p.verb == Verb::Atomic {
        title.push_str(match p.atomic {
            AtomicType::FetchAndAdd => "FETCH_AND_ADD ",
            AtomicType::CmpAndSwap => "CMP_AND_SWAP ",
        });
    }
    title.push_str(if p.bw { "BW Test" } else { "Latency Test" });
    let conn = match a.connection {
        Connection::Rc => "RC",
        Connection::Uc => "UC",
    };
    let name = dev
        .dev
        .transport()
        .local_addr()
        .map_or_else(|_| "vrdma".into(), |a| format!("vrdma({})", a.ip()));
    println!("{RESULT_LINE}");
    println!("                    {title}");
    if p.duration.is_none() && dev.events {
        println!(" Test with events.");
    }
    println!(" Dual-port       : OFF\t\tDevice         : {name}");
    println!(" Number of qps   : {}\t\tTransport type : IB", p.qps);
    println!(" Connection type : {conn}\t\tUsing SRQ      : OFF");
    println!(" PCIe relax order: OFF");
    println!(" ibv_wr* API     : OFF");
    if p.client {
        println!(" TX depth        : {}", p.tx_depth);
    }
    if p.verb == Verb::Send && !p.client {
        println!(" RX depth        : {}", p.rx_depth);
    }
    if p.bw {
        println!(" CQ Moderation   : {}", p.cq_mod);
    }
    println!(" Mtu             : {}[B]", mtu.bytes());
    println!(" Link type       : Ethernet");
    println!(" GID index       : 0");
    if matches!(p.verb, Verb::Read | Verb::Atomic) {
        println!(" Outstand reads  : {}", p.out_reads);
    } else {
        println!(" Max inline data : {}[B]", p.inline);
    }
    println!(" rdma_cm QPs\t : OFF");
    println!(" Data ex. method : Ethernet");
    println!("{RESULT_LINE}");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> Key {
        Key {
            lid: 0,
            out_reads: 0x80,
            qpn: Qpn::from_masked(0x11),
            psn: Psn::from_masked(0x3a4b5c),
            rkey: Rkey(0x1234),
            vaddr: 0x5633_1e6d_d000,
            gid: Gid::from(Ipv4Addr::new(10, 47, 91, 11)),
            srqn: 0,
        }
    }

    #[test]
    fn key_message_matches_perftest() {
        let w = key().to_wire();
        let text = b"0000:0080:000011:3a4b5c:00001234:000056331e6dd000:\
00:00:00:00:00:00:00:00:00:00:ff:ff:0a:2f:5b:0b:00000000:";
        assert_eq!(text.len(), 107);
        assert_eq!(&w[..107], &text[..]);
        assert_eq!(w[107], 0);
        assert_eq!(Key::parse(&w).unwrap(), key());
    }

    #[test]
    fn hostile_key_messages_are_refused() {
        let good = String::from_utf8(key().to_wire()[..107].to_vec()).unwrap();
        let bad = [
            String::new(),
            good[..106].to_string(),
            good.replace("000011", "1000000"),
            good.replace(":ff:ff:", ":fff:ff:"),
            good.replace("0080", "+080"),
            good.replace("0000:0080", "0000:0080:0"),
            format!("{good}0:"),
            good.replace("3a4b5c", "3a4b\u{e9}"),
            good.replace("000056331e6dd000", "1000056331e6dd000"),
        ];
        for b in &bad {
            assert!(Key::parse(b.as_bytes()).is_err(), "{b:?}");
        }
    }

    #[test]
    fn versions_read_as_atof() {
        assert_eq!(version_number(b"6.06\0\0\0\0\0\0\0\0\0\0\0\0"), 6.06);
        assert_eq!(version_number(b"5.70"), 5.70);
        assert_eq!(version_number(b"x5.9"), 0.0);
        assert_eq!(version_number(b""), 0.0);
        assert!(version_number(b"5.69abc") < MIN_VERSION);
    }

    #[test]
    fn c_alt_hex_is_printf_alternate_form() {
        assert_eq!(c_alt_hex(0, 4), "0000");
        assert_eq!(c_alt_hex(0x11, 6), "0x0011");
        assert_eq!(c_alt_hex(0x3a4b5c, 6), "0x3a4b5c");
        assert_eq!(c_alt_hex(0x203, 8), "0x000203");
    }

    #[test]
    fn latency_statistics_follow_perftest() {
        // Posts 10, 20, ... µs apart: deltas 10..=100 µs (ns here).
        let mut posts = vec![0u64];
        for d in 1..=10u64 {
            posts.push(posts.last().unwrap() + d * 10_000);
        }
        let l = lat_stats(&posts, 2.0).unwrap();
        // Halved: 5..=50 µs; the two largest dropped: 8 samples 5..=40.
        assert_eq!(l.min, 5.0);
        assert_eq!(l.max, 45.0);
        assert_eq!(l.typical, 22.5);
        assert_eq!(l.avg, 22.5);
        // ceil(8 × 0.99) = 8: the first dropped sample, as perftest.
        assert_eq!(l.p99, 45.0);
        assert!(lat_stats(&posts[..3], 1.0).is_none());
    }

    #[test]
    fn peak_is_the_best_window() {
        // Four messages, one signaled completion every two.
        let tposted = [0, 10, 20, 30];
        let tcompleted = [u64::MAX, 100, u64::MAX, 110];
        // Windows end at a signaled completion: 0..=1 takes 100 / 2,
        // 0..=3 110 / 4 (the best), 1..=3 100 / 3, 2..=3 90 / 2.
        assert_eq!(peak_delta(&tposted, &tcompleted, 2), Some(27.5));
        // Without the completion of message 3, 0..=1 is the best.
        let tcompleted = [u64::MAX, 100, u64::MAX, u64::MAX];
        assert_eq!(peak_delta(&tposted, &tcompleted, 2), Some(50.0));
    }

    #[test]
    fn address_walk_stays_in_the_cycle() {
        let p = Params {
            verb: Verb::Write,
            bw: true,
            client: true,
            qps: 2,
            sizes: vec![],
            iters: 10,
            duration: None,
            tx_depth: 1,
            rx_depth: 1,
            cq_mod: 1,
            inline: 0,
            out_reads: 1,
            atomic: AtomicType::FetchAndAdd,
            cycle: 4096,
            cache_line: 64,
            region: 4096,
            no_peak: true,
            gbits: false,
            timeout: None,
        };
        for size in [1u64, 2, 8, 100, 2000, 2048, 2049, 4096, 65536] {
            for k in 0..200 {
                let off = p.offset(size, k);
                assert!(off + size <= size.max(4096), "size {size} k {k}");
            }
        }
        assert_eq!(p.offset(2, 1), 64);
        assert_eq!(p.offset(2, 64), 0);
        assert_eq!(p.remote(1), BASE + 3 * 4096);
    }
}
