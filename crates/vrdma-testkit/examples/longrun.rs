//! The reliability long run: RC messages between two engines on the
//! seeded hostile network (10 % loss, 5 % duplication, 10 % reordering,
//! 1 % corruption, PMTU 1024, sizes up to 64 KiB), every message checked.
//!
//! `cargo run --release -p vrdma-fabric --example longrun -- [messages] [first seed] [seeds]`

use std::time::Instant;

use vrdma_testkit::sim::workload::{self, Config};

fn main() {
    let mut args = std::env::args().skip(1).map(|a| {
        a.parse::<u64>()
            .unwrap_or_else(|_| panic!("not a number: {a}"))
    });
    let messages = args.next().unwrap_or(1_000_000);
    let first = args.next().unwrap_or(1);
    let seeds = args.next().unwrap_or(1);
    for seed in first..first + seeds {
        let t = Instant::now();
        match workload::run(&Config::hostile(seed, messages)) {
            Ok(r) => println!(
                "seed {seed}: {} messages, {} bytes, {:.3} s simulated, {:.2} s wall; {:?}\n A {:?}\n B {:?}",
                r.messages,
                r.bytes,
                r.sim_ns as f64 / 1e9,
                t.elapsed().as_secs_f64(),
                r.stats,
                r.engine_a,
                r.engine_b
            ),
            Err(f) => {
                eprintln!("{f}");
                std::process::exit(1);
            }
        }
    }
}
