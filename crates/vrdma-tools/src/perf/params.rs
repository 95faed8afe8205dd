//! What a test is: the verb and its kind (bandwidth or latency), and the
//! parameters both sides share once they are negotiated.

use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use vrdma_engine::{attr::Mtu, mr::Access};

use vrdma_device::verbs::BASE;

use crate::args::{AtomicType, Connection, PerfArgs, PerfTest};

/// perftest's buffer cycle: the page size.
pub(super) const CYCLE: u64 = 4096;

pub(super) const CACHE_LINE: u64 = 64;

/// The largest size of `-a` (and its buffers).
pub(super) const MAX_SIZE: u64 = 8 << 20;

/// Bandwidth runs longer than this report no peak (perftest's rule).
pub(super) const PEAK_MAX_ITERS: u64 = 20_000;

#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub(super) enum Verb {
    Send,
    Write,
    Read,
    Atomic,
}

impl Verb {
    pub(super) fn title(self) -> &'static str {
        match self {
            Verb::Send => "Send",
            Verb::Write => "RDMA_Write",
            Verb::Read => "RDMA_Read",
            Verb::Atomic => "Atomic",
        }
    }

    /// The QP access flags perftest sets for the verb.
    pub(super) fn access(self) -> Access {
        match self {
            Verb::Send => Access(Access::REMOTE_WRITE.0 | Access::LOCAL_WRITE.0),
            Verb::Write => Access::REMOTE_WRITE,
            Verb::Read => Access::REMOTE_READ,
            Verb::Atomic => Access::REMOTE_ATOMIC,
        }
    }

    /// Latency samples are round trips halved for ping-pong tests.
    pub(super) fn rtt_factor(self) -> f64 {
        match self {
            Verb::Read | Verb::Atomic => 1.0,
            Verb::Send | Verb::Write => 2.0,
        }
    }
}

pub(super) fn split(t: PerfTest) -> (Verb, bool) {
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

/// The arguments, checked as perftest checks them, with its defaults
/// applied: what this side asks for before it knows its peer.
#[derive(Debug)]
pub(super) struct Settings {
    pub(super) verb: Verb,
    pub(super) bw: bool,
    pub(super) client: bool,
    pub(super) sizes: Vec<u64>,
    /// Bytes of each buffer: the size, or the largest of `-a`.
    pub(super) buf_size: u64,
    pub(super) iters: u64,
    pub(super) duration: Option<Duration>,
    pub(super) tx_depth: u32,
    pub(super) rx_depth: u32,
    pub(super) cq_mod: u64,
    pub(super) inline: u32,
    pub(super) no_peak: bool,
}

impl Settings {
    pub(super) fn check(a: &PerfArgs) -> Result<Self> {
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
        Ok(Settings {
            verb,
            bw,
            client,
            sizes,
            buf_size,
            iters,
            duration,
            tx_depth,
            rx_depth,
            cq_mod,
            inline,
            no_peak,
        })
    }
}

/// The negotiated parameters: everything the tests share.
pub(super) struct Params {
    /// The test as this side's arguments asked for it (checked).
    pub(super) test: Settings,
    pub(super) qps: usize,
    pub(super) out_reads: u16,
    pub(super) atomic: AtomicType,
    pub(super) cycle: u64,
    pub(super) cache_line: u64,
    /// Bytes per region: every QP has a local region and a remote one.
    pub(super) region: u64,
    pub(super) gbits: bool,
    pub(super) timeout: Option<Duration>,
}

impl Params {
    pub(super) fn local(&self, q: usize) -> u64 {
        BASE + q as u64 * self.region
    }

    pub(super) fn remote(&self, q: usize) -> u64 {
        BASE + (self.qps + q) as u64 * self.region
    }

    /// perftest's address walk for the `k`-th message of a QP: messages of
    /// at most half a cycle step through the cycle at cache-line-rounded
    /// strides; larger ones stay put.
    pub(super) fn offset(&self, size: u64, k: u64) -> u64 {
        let inc = size.next_multiple_of(self.cache_line);
        if size > self.cycle / 2 {
            return 0;
        }
        (k % (self.cycle / inc).max(1)) * inc
    }

    pub(super) fn factor(&self) -> f64 {
        if self.gbits {
            125_000_000.0
        } else {
            1_048_576.0
        }
    }
}

pub(super) fn mtu_from_bytes(n: u32) -> Option<Mtu> {
    Some(match n {
        256 => Mtu::Mtu256,
        512 => Mtu::Mtu512,
        1024 => Mtu::Mtu1024,
        2048 => Mtu::Mtu2048,
        4096 => Mtu::Mtu4096,
        _ => return None,
    })
}

/// Tracks a run's deadline (`-D`), its measurement window and stalls.
pub(super) struct Clock {
    pub(super) start: Instant,
    /// `-D`: the window [start + margin, end - margin] and the end.
    pub(super) window: Option<(Instant, Instant, Instant)>,
    pub(super) timeout: Option<Duration>,
    pub(super) last_progress: Instant,
}

impl Clock {
    pub(super) fn new(p: &Params) -> Self {
        let start = Instant::now();
        Clock {
            start,
            window: p.test.duration.map(|d| {
                let margin = d / 4;
                (start + margin, start + d - margin, start + d)
            }),
            timeout: p.timeout,
            last_progress: start,
        }
    }

    pub(super) fn over(&self, now: Instant) -> bool {
        self.window.is_some_and(|(_, _, end)| now >= end)
    }

    pub(super) fn in_window(&self, now: Instant) -> bool {
        self.window.is_some_and(|(a, b, _)| now >= a && now < b)
    }

    pub(super) fn window_secs(&self) -> f64 {
        self.window.map_or(0.0, |(a, b, _)| (b - a).as_secs_f64())
    }

    pub(super) fn progressed(&mut self, now: Instant) {
        self.last_progress = now;
    }

    /// Fails once nothing has happened for the `--timeout`.
    pub(super) fn check_stall(&self, now: Instant, what: impl FnOnce() -> String) -> Result<()> {
        if let Some(t) = self.timeout
            && now - self.last_progress > t
        {
            bail!("no progress in {} s: {}", t.as_secs(), what());
        }
        Ok(())
    }

    pub(super) fn nanos(&self, now: Instant) -> u64 {
        (now - self.start).as_nanos() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_walk_stays_in_the_cycle() {
        let p = Params {
            test: Settings {
                verb: Verb::Write,
                bw: true,
                client: true,
                sizes: vec![],
                buf_size: 4096,
                iters: 10,
                duration: None,
                tx_depth: 1,
                rx_depth: 1,
                cq_mod: 1,
                inline: 0,
                no_peak: true,
            },
            qps: 2,
            out_reads: 1,
            atomic: AtomicType::FetchAndAdd,
            cycle: 4096,
            cache_line: 64,
            region: 4096,
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
