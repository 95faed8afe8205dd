//! RC on the seeded simulator: the network, the workload checker and
//! replay. (The hostile long run belongs to the reliability work.)

use vrdma_fabric::sim::{
    Link,
    workload::{self, Config},
};

#[test]
fn a_perfect_network_delivers_everything() {
    let mut c = Config::hostile(1, 300);
    c.link = Link::PERFECT;
    let r = workload::run(&c).unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(r.messages, 300);
    assert_eq!(
        (r.stats.lost, r.stats.duplicated, r.stats.corrupted),
        (0, 0, 0)
    );
    assert_eq!(r.stats.sent, r.stats.delivered);
}

fn lossy(seed: u64) -> Config {
    let mut c = Config::hostile(seed, 200);
    c.link = Link {
        loss: 0.01,
        duplicate: 0.01,
        corrupt: 0.01,
        jitter: 0,
        reorder: 0.0,
        ..c.link
    };
    c
}

#[test]
fn loss_duplication_and_corruption_are_survived() {
    for seed in 0..10 {
        let r = workload::run(&lossy(seed)).unwrap_or_else(|f| panic!("{f}"));
        assert_eq!(r.messages, 200);
        assert!(r.stats.lost > 0 && r.stats.duplicated > 0, "{:?}", r.stats);
        // Every flipped bit was caught, or hit a field nothing covers.
        assert_eq!(
            r.stats.corrupt_rejected + r.stats.corrupt_accepted,
            r.stats.corrupted
        );
    }
}

#[test]
fn a_seed_replays_to_the_same_trace() {
    let a = workload::run(&lossy(7)).unwrap_or_else(|f| panic!("{f}"));
    let b = workload::run(&lossy(7)).unwrap_or_else(|f| panic!("{f}"));
    let c = workload::run(&lossy(8)).unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(a.trace_hash, b.trace_hash);
    assert_eq!(a.stats, b.stats);
    assert_eq!(a.sim_ns, b.sim_ns);
    assert_ne!(a.trace_hash, c.trace_hash, "another seed, another run");
}
