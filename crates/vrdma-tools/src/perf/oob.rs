//! The out-of-band exchange with the peer (perftest 4.5,
//! `src/perftest_communication.c`; `docs/perftest.md`): versions, page and
//! cache-line sizes, the MTU, the 108-byte key messages, the bandwidth
//! report and `"done"`, over a lock-step TCP side channel that keeps the
//! device running while it waits.

use std::{
    io::{Read, Write},
    net::TcpStream,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use vrdma_wire::{Gid, Psn, Qpn, Rkey};

use vrdma_device::verbs::Context;

use super::params::{CACHE_LINE, CYCLE};
use crate::common::hex_field;

/// The version this speaks: perftest 4.5's. Peers older than 5.70 are
/// refused, as perftest refuses them.
pub(super) const VERSION: &[u8] = b"6.06";

pub(super) const MIN_VERSION: f64 = 5.70;

/// The key message: 107 characters and a NUL.
pub const KEY_LEN: usize = 108;

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
pub(super) struct BwReport {
    pub(super) size: u64,
    pub(super) iters: u64,
    pub(super) peak: f64,
    pub(super) avg: f64,
    pub(super) msg_rate: f64,
}

/// The TCP side channel, lock-step: the client writes first.
///
/// The device keeps running while a side waits here: a vrdma device's
/// responder is this process, so a server blocked on the socket would
/// answer nobody's READs (perftest's servers wait here while their NIC
/// serves the client).
pub(super) struct Oob {
    pub(super) stream: TcpStream,
    pub(super) client: bool,
    /// `--timeout`: how long a read may wait for the peer.
    pub(super) timeout: Option<Duration>,
}

impl Oob {
    pub(super) fn new(stream: TcpStream, client: bool, timeout: Option<Duration>) -> Result<Self> {
        stream.set_nodelay(true)?;
        stream.set_nonblocking(true)?;
        Ok(Oob {
            stream,
            client,
            timeout,
        })
    }

    pub(super) fn read_exact(
        &mut self,
        buf: &mut [u8],
        mut dev: Option<&mut Context>,
    ) -> Result<()> {
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
    pub(super) fn write_one(&mut self, msg: &[u8]) -> Result<()> {
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

    pub(super) fn xchg(
        &mut self,
        mine: &[u8],
        theirs: &mut [u8],
        dev: Option<&mut Context>,
    ) -> Result<()> {
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
    pub(super) fn key(&mut self, my: &Key, dev: &mut Context) -> Result<Key> {
        let mut b = [0u8; KEY_LEN];
        self.xchg(&my.to_wire(), &mut b, Some(dev))?;
        Key::parse(&b)
    }

    /// `xchg_bw_reports`: size, iterations, peak, average, message rate,
    /// each an 8-byte big-endian number in its own message.
    pub(super) fn reports(&mut self, mine: BwReport, dev: &mut Context) -> Result<BwReport> {
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

    /// The versions (a peer older than 5.70 is refused, as perftest
    /// refuses it), then the page and cache-line sizes, each the larger of
    /// the two sides': `(cycle, cache line)`.
    pub(super) fn agree_sizes(&mut self) -> Result<(u64, u64)> {
        let mut version = [0u8; 16];
        version[..VERSION.len()].copy_from_slice(VERSION);
        let mut theirs = [0u8; 16];
        self.xchg(&version, &mut theirs, None)?;
        ensure!(
            version_number(&theirs) >= MIN_VERSION,
            "Current implementation is not compatible with versions older than 5.70 (peer: {:?})",
            String::from_utf8_lossy(theirs.split(|&c| c == 0).next().unwrap_or_default())
        );
        let mut four = [0u8; 4];
        self.xchg(&(CYCLE as u32).to_be_bytes(), &mut four, None)?;
        let cycle = CYCLE.max(u64::from(u32::from_be_bytes(four)));
        self.xchg(&(CACHE_LINE as u32).to_be_bytes(), &mut four, None)?;
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
        Ok((cycle, cache_line))
    }

    /// `ctx_close_connection`: one more key message, then `"done"` (which
    /// nobody reads).
    pub(super) fn close(mut self, my: &Key, dev: &mut Context) -> Result<()> {
        self.key(my, dev)?;
        let _ = self.stream.write(b"done\0");
        Ok(())
    }
}

/// The C library's `atof` on the version string: the leading decimal
/// number, 0 if there is none.
pub(super) fn version_number(b: &[u8]) -> f64 {
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

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

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
}
