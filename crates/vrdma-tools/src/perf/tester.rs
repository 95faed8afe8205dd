//! The tests themselves: one device's QPs posting, polling and timing each
//! test's messages (bandwidth client and server, the latency ping-pongs).

use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use vrdma_engine::{
    wc::{Wc, WcOpcode, WcStatus},
    wr::{SendFlags, SendOp},
};
use vrdma_wire::Qpn;

use vrdma_device::verbs::Context;

use super::{
    oob::{BwReport, Key},
    params::{Clock, Params, Verb},
    report::{Samples, peak_delta, report},
};

use crate::args::AtomicType;

/// The device, its QPs and the peer's keys: what a test run needs.
pub(super) struct Tester {
    pub(super) dev: Context,
    pub(super) qps: Vec<Qpn>,
    pub(super) rem: Vec<Key>,
    pub(super) p: Params,
}

pub(super) fn check_wc(wc: &Wc, side: &str) -> Result<()> {
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
    pub(super) fn side(&self) -> &'static str {
        if self.p.test.client {
            "client"
        } else {
            "server"
        }
    }

    /// Completions now (busy-polling), or after a short sleep in event
    /// mode.
    /// One turn of the device and the completions it brought; in event
    /// mode a turn with none sleeps until a datagram arrives (or 1 ms):
    /// an incoming WRITE makes no completion, so waiting for one would
    /// miss it.
    pub(super) fn completions(&mut self) -> Result<Vec<Wc>> {
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

    pub(super) fn op(&self, q: usize, size: u64, k: u64) -> SendOp {
        // The peer's address: any value it sent (its responder checks).
        let remote_addr = self.rem[q].vaddr.wrapping_add(self.p.offset(size, k));
        let rkey = self.rem[q].rkey;
        match self.p.test.verb {
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

    pub(super) fn flags(&self, size: u64, signaled: bool) -> SendFlags {
        let mut f = if signaled {
            SendFlags::SIGNALED
        } else {
            SendFlags(0)
        };
        if size <= u64::from(self.p.test.inline)
            && matches!(self.p.test.verb, Verb::Send | Verb::Write)
        {
            f = f.with(SendFlags::INLINE);
        }
        f
    }

    /// The bandwidth client: every QP posts `iters` messages (or until
    /// the deadline) with at most `tx_depth` outstanding, one in `cq_mod`
    /// signaled.
    pub(super) fn bw_client(&mut self, size: u64) -> Result<BwReport> {
        let p = &self.p;
        let (n, iters, cq_mod) = (p.qps, p.test.iters, p.test.cq_mod);
        let timed = p.test.duration.is_some();
        let total = iters * n as u64;
        let peak = !p.test.no_peak;
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
                while (timed || scnt[q] < iters)
                    && scnt[q] - ccnt[q] < u64::from(self.p.test.tx_depth)
                {
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
    pub(super) fn post_recvs_bw(&mut self, size: u64) -> Result<()> {
        for q in 0..self.p.qps {
            for k in 0..u64::from(self.p.test.rx_depth) {
                let at = self.p.remote(q) + self.p.offset(size, k);
                self.dev
                    .post_recvs(self.qps[q], q as u64, at, size as u32, 1)?;
            }
        }
        Ok(())
    }

    /// The send_bw server: takes `iters` messages on every QP, posting a
    /// receive for each one taken while fewer than `iters` were posted.
    pub(super) fn bw_server(&mut self, size: u64) -> Result<BwReport> {
        let (n, iters) = (self.p.qps, self.p.test.iters);
        let timed = self.p.test.duration.is_some();
        let mut rcnt = vec![0u64; n];
        let mut posted = vec![u64::from(self.p.test.rx_depth); n];
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
    pub(super) fn write_lat(&mut self, size: u64) -> Result<Samples> {
        let timed = self.p.test.duration.is_some();
        let iters = if timed { u64::MAX } else { self.p.test.iters };
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
            if rcnt < iters && (self.p.test.client || scnt >= 1) {
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
    pub(super) fn send_lat(&mut self, size: u64) -> Result<Samples> {
        let timed = self.p.test.duration.is_some();
        let iters = if timed { u64::MAX } else { self.p.test.iters };
        let rx_depth = u64::from(self.p.test.rx_depth);
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
            if rcnt < iters && (!self.p.test.client || scnt >= 1) {
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
                let signaled = scnt % self.p.test.cq_mod == 0 || scnt == iters;
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
    pub(super) fn op_lat(&mut self, size: u64) -> Result<Samples> {
        let timed = self.p.test.duration.is_some();
        let iters = if timed { u64::MAX } else { self.p.test.iters };
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
