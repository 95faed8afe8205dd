//! RC on the seeded simulator: the network, the workload checker, replay,
//! and the hostile network (10 % loss, 5 % duplication, 10 % reordering,
//! 1 % corruption) over a thousand seeds. The long run of a million
//! messages is `cargo run --release -p vrdma-fabric --example longrun`.

use vrdma_testkit::sim::{
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

/// The long run's network, shorter, over 1000 seeds: every seed's run is
/// checked in full (exactly once, in order, byte-exact, linearizable
/// atomics, no error), and a failure names its seed.
#[test]
fn the_hostile_network_over_a_thousand_seeds() {
    let mut lost = 0;
    let mut messages = 0;
    for seed in 0..1000 {
        let r = workload::run(&Config::hostile(seed, MESSAGES_PER_SEED))
            .unwrap_or_else(|f| panic!("{f}"));
        assert_eq!(r.messages, MESSAGES_PER_SEED);
        messages += r.messages;
        lost += r.stats.lost;
    }
    assert_eq!(messages, 1000 * MESSAGES_PER_SEED);
    assert!(lost > 0);
}

const MESSAGES_PER_SEED: u64 = 100;

/// A failing run reports its seed, and running that seed again fails the
/// same way at the same instant with the same last events.
#[test]
fn a_failing_seed_replays_to_the_same_failure() {
    let mut c = Config::hostile(3, 1000);
    // Too little time for the work: the run fails, deterministically.
    c.time_limit = 200_000;
    let a = workload::run(&c).expect_err("the time limit cuts the run short");
    let b = workload::run(&c).expect_err("and again");
    assert_eq!(a.seed, 3);
    assert!(a.to_string().contains("seed 0x3"), "{a}");
    assert_eq!((a.at_ns, &a.what, &a.recent), (b.at_ns, &b.what, &b.recent));
    assert!(!a.recent.is_empty());
}

/// The hostile network as a same-host medium (`Sim::same_host`): payloads
/// lent on in runs of up to 64 segments, each taking its PSN, through
/// loss, duplication and reordering — runs lost whole, duplicated runs
/// overlapping resends, responses overtaking each other — over 300 seeds,
/// every run checked in full. (No bit flips: nothing on the way can flip
/// one.)
#[test]
fn runs_of_segments_survive_the_hostile_network() {
    let (mut runs, mut segments) = (0, 0);
    for seed in 0..300 {
        let mut c = Config::hostile(seed, MESSAGES_PER_SEED);
        c.link.corrupt = 0.0;
        let wire = workload::run(&c).unwrap_or_else(|f| panic!("{f}"));
        c.same_host = true;
        let r = workload::run(&c).unwrap_or_else(|f| panic!("{f}"));
        assert_eq!(r.messages, MESSAGES_PER_SEED);
        assert!(r.stats.lost > 0 || seed > 0, "{:?}", r.stats);
        runs += r.engine_a.tx_packets + r.engine_b.tx_packets;
        segments += wire.engine_a.tx_packets + wire.engine_b.tx_packets;
    }
    // Messages up to 64 KiB at MTU 1024: far fewer packets than segments.
    assert!(
        runs * 2 < segments,
        "{runs} packets, {segments} over the wire"
    );
}
