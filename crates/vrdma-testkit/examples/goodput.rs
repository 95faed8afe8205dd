//! RC goodput under loss, in simulated time: the reliability workload
//! (SEND/WRITE/READ/atomics, sizes log-uniform up to 64 KiB, PMTU 1024,
//! 16 WRs outstanding) on a 25 Gb/s link, 1 µs one way, at 0, 0.1, 1 and
//! 5 % loss each way, same seed and messages; goodput as a fraction of the
//! lossless run's.
//!
//! `cargo run --release -p vrdma-fabric --example goodput -- [messages] [seed]`

use vrdma_testkit::sim::{
    Link,
    workload::{self, Config},
};

fn main() {
    let mut args = std::env::args().skip(1).map(|a| {
        a.parse::<u64>()
            .unwrap_or_else(|_| panic!("not a number: {a}"))
    });
    let messages = args.next().unwrap_or(20_000);
    let seed = args.next().unwrap_or(1);
    println!("{messages} messages, seed {seed}, 25 Gb/s, 1 µs + up to 0.5 µs one way");
    println!(
        "| loss each way | payload goodput, both ways (Gb/s) | of lossless | request packets resent | timeouts |"
    );
    println!("|---|---|---|---|---|");
    let mut lossless = None;
    for loss in [0.0, 0.001, 0.01, 0.05] {
        let mut c = Config::hostile(seed, messages);
        c.link = Link {
            loss,
            duplicate: 0.0,
            reorder: 0.0,
            corrupt: 0.0,
            ..c.link
        };
        let r = workload::run(&c).unwrap_or_else(|f| panic!("{f}"));
        let gbps = r.bytes as f64 * 8.0 / r.sim_ns as f64;
        let base = *lossless.get_or_insert(gbps);
        println!(
            "| {:.1} % | {gbps:.2} | {:.3} | {} | {} |",
            loss * 100.0,
            gbps / base,
            r.engine_a.tx_retransmitted,
            r.stats.timeouts,
        );
    }
}
