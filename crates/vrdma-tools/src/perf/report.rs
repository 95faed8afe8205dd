//! perftest's statistics and its output: bandwidth reports, peak windows,
//! latency samples and their percentiles, the tables and the key lines.

use std::time::Instant;

use vrdma_engine::attr::Mtu;

use vrdma_device::verbs::Context;

use super::{
    oob::{BwReport, Key},
    params::{Clock, Params, Verb},
};

use crate::args::{AtomicType, Connection, PerfArgs};

/// perftest drops the slowest samples of a latency run.
pub(super) const LAT_MEASURE_TAIL: usize = 2;

/// perftest's peak: the best time per message over any run of messages
/// from a post to a signaled completion (`tcompleted` holds `u64::MAX`
/// where no completion was recorded).
pub(super) fn peak_delta(tposted: &[u64], tcompleted: &[u64], cq_mod: u64) -> Option<f64> {
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

pub(super) fn report(p: &Params, size: u64, msgs: u64, secs: f64, peak: f64) -> BwReport {
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
pub(super) struct Samples {
    pub(super) posts: Vec<u64>,
    pub(super) window_count: u64,
    pub(super) window_secs: f64,
    pub(super) timed: bool,
}

impl Samples {
    pub(super) fn new(p: &Params) -> Self {
        Samples {
            posts: Vec::with_capacity(if p.test.duration.is_some() {
                0
            } else {
                p.test.iters as usize
            }),
            window_count: 0,
            window_secs: 0.0,
            timed: p.test.duration.is_some(),
        }
    }

    pub(super) fn posted(&mut self, clock: &Clock, now: Instant) {
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
pub(super) struct LatStats {
    pub(super) min: f64,
    pub(super) max: f64,
    pub(super) typical: f64,
    pub(super) avg: f64,
    pub(super) stdev: f64,
    pub(super) p99: f64,
    pub(super) p999: f64,
}

pub(super) fn lat_stats(posts: &[u64], rtt_factor: f64) -> Option<LatStats> {
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

pub(super) const RESULT_LINE: &str =
    "---------------------------------------------------------------------------------------";

pub(super) fn bw_header(gbits: bool) -> &'static str {
    if gbits {
        "\n #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]"
    } else {
        "\n #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]"
    }
}

pub(super) fn lat_header(timed: bool) -> &'static str {
    if timed {
        "\n #bytes        #iterations       t_avg[usec]    tps average"
    } else {
        "\n #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] "
    }
}

pub(super) fn print_bw_row(p: &Params, r: &BwReport) {
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

pub(super) fn print_lat(p: &Params, size: u64, s: &Samples) {
    let factor = p.test.verb.rtt_factor();
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
            size, p.test.iters, l.min, l.max, l.typical, l.avg, l.stdev, l.p99, l.p999
        ),
        None => println!(" {size:<7} {}          (too few samples)", p.test.iters),
    }
}

/// `%#0Nx`: `0x` and zero-padding to N characters in all, no prefix for 0.
pub(super) fn c_alt_hex(v: u64, width: usize) -> String {
    if v == 0 {
        format!("{:0width$}", 0)
    } else {
        format!("{v:#0width$x}")
    }
}

pub(super) fn print_key(side: &str, verb: Verb, k: &Key) {
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

pub(super) fn print_info(a: &PerfArgs, p: &Params, dev: &Context, mtu: Mtu) {
    let mut title = format!("{} ", p.test.verb.title());
    if p.test.verb == Verb::Atomic {
        title.push_str(match p.atomic {
            AtomicType::FetchAndAdd => "FETCH_AND_ADD ",
            AtomicType::CmpAndSwap => "CMP_AND_SWAP ",
        });
    }
    title.push_str(if p.test.bw { "BW Test" } else { "Latency Test" });
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
    if p.test.duration.is_none() && dev.events {
        println!(" Test with events.");
    }
    println!(" Dual-port       : OFF\t\tDevice         : {name}");
    println!(" Number of qps   : {}\t\tTransport type : IB", p.qps);
    println!(" Connection type : {conn}\t\tUsing SRQ      : OFF");
    println!(" PCIe relax order: OFF");
    println!(" ibv_wr* API     : OFF");
    if p.test.client {
        println!(" TX depth        : {}", p.test.tx_depth);
    }
    if p.test.verb == Verb::Send && !p.test.client {
        println!(" RX depth        : {}", p.test.rx_depth);
    }
    if p.test.bw {
        println!(" CQ Moderation   : {}", p.test.cq_mod);
    }
    println!(" Mtu             : {}[B]", mtu.bytes());
    println!(" Link type       : Ethernet");
    println!(" GID index       : 0");
    if matches!(p.test.verb, Verb::Read | Verb::Atomic) {
        println!(" Outstand reads  : {}", p.out_reads);
    } else {
        println!(" Max inline data : {}[B]", p.test.inline);
    }
    println!(" rdma_cm QPs\t : OFF");
    println!(" Data ex. method : Ethernet");
    println!("{RESULT_LINE}");
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
