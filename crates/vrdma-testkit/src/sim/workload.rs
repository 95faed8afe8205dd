//! An RC workload on the simulator, and the checker that proves it was
//! served exactly once and in order.
//!
//! Node 0 (A) posts a seeded random mix of SEND, RDMA WRITE, RDMA READ,
//! FETCH_AND_ADD and COMPARE_AND_SWAP to node 1 (B), keeping up to
//! `window` WRs outstanding, every one signaled. Sizes are log-uniform from
//! 0 B to `max_size`. The checker asserts, as completions arrive:
//!
//! - every send WR completes exactly once, successfully, in posting order,
//!   with its opcode and length;
//! - every SEND arrives exactly once, in order, into the receive posted for
//!   it, with every byte right;
//! - when a WRITE completes, its bytes are in B's memory; when a READ
//!   completes, B's bytes are in A's memory;
//! - atomics are linearizable: each FETCH_AND_ADD returns the sum of the
//!   adds before it, each COMPARE_AND_SWAP finds the value the previous one
//!   left, and at the end B's words hold exactly those totals;
//! - nothing else completes and no async event is raised.
//!
//! A failure returns a [`Failure`] that names the seed and the last
//! network events, so the run can be replayed exactly.

use std::fmt;

use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;
use vrdma_engine::{
    Memory,
    attr::Mtu,
    wc::{Wc, WcOpcode, WcStatus},
    wr::{Payload, RecvWr, SendFlags, SendOp, SendWr, Sge},
};
use vrdma_wire::{Lkey, Psn, Qpn, Rkey};

use super::{Event, Link, Sim, Stats};
use crate::setup::{Connection, EngineSpec, Ids};

/// What to run.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub seed: u64,
    pub messages: u64,
    /// The largest message, bytes (at most [`MAX_SIZE`]).
    pub max_size: u32,
    pub mtu: Mtu,
    /// Send WRs outstanding at once (at most [`SLOTS`] - 1).
    pub window: u32,
    pub link: Link,
    /// Port speed, bytes per second (`None`: infinite).
    pub bandwidth: Option<u64>,
    /// The QPs' local ACK timeout code (4.096 µs × 2^timeout).
    pub timeout: u8,
    pub retry_cnt: u8,
    /// Give up (as a failure) when simulated time passes this, ns.
    pub time_limit: u64,
    /// A same-host medium ([`Sim::same_host`]): payloads lent on in runs
    /// of segments.
    pub same_host: bool,
}

impl Config {
    /// The long-run network: 10 % loss, 5 % duplication, 10 % reordering
    /// (held back up to 10 µs, so some 30 later packets overtake), 1 %
    /// corruption, PMTU 1024, sizes up to 64 KiB, on a 25 Gb/s in-rack
    /// link (1 µs one way, up to 0.5 µs jitter). The local ACK timeout is
    /// code 2 (16.4 µs): a few round trips, the worst reordering included,
    /// as a tuned datacenter sets it; longer only idles the simulated
    /// port, and every timeout costs a window of resent packets.
    pub fn hostile(seed: u64, messages: u64) -> Self {
        Config {
            seed,
            messages,
            max_size: MAX_SIZE,
            mtu: Mtu::Mtu1024,
            window: 16,
            link: Link {
                delay: 1_000,
                jitter: 500,
                loss: 0.10,
                duplicate: 0.05,
                reorder: 0.10,
                reorder_delay: 10_000,
                corrupt: 0.01,
                rate: 0,
            },
            // 25 Gb/s.
            bandwidth: Some(25_000_000_000 / 8),
            timeout: 2,
            retry_cnt: 7,
            time_limit: 3_600 * 1_000_000_000,
            same_host: false,
        }
    }
}

/// The largest message the workload's memory layout has room for.
pub const MAX_SIZE: u32 = 64 * 1024;
/// Slots per kind of target, each [`MAX_SIZE`] bytes; more than the window,
/// so a slot is reused only after the WR that used it completed.
pub const SLOTS: u32 = 32;

const BASE: u64 = 0x1000_0000;
/// A's layout: the source pattern (2 × MAX_SIZE of random bytes), then
/// READ result slots, then atomic result slots.
const A_SRC: u64 = 0;
const A_READ: u64 = A_SRC + 2 * MAX_SIZE as u64;
const A_ATOMIC: u64 = A_READ + SLOTS as u64 * MAX_SIZE as u64;
const A_MEM: u64 = A_ATOMIC + SLOTS as u64 * 8;
/// B's layout: receive slots, WRITE slots, the READ source pattern, the
/// two atomic words.
const B_RECV: u64 = 0;
const B_WRITE: u64 = B_RECV + SLOTS as u64 * MAX_SIZE as u64;
const B_READ: u64 = B_WRITE + SLOTS as u64 * MAX_SIZE as u64;
const B_ADD: u64 = B_READ + 2 * MAX_SIZE as u64;
const B_CAS: u64 = B_ADD + 8;
const B_MEM: u64 = B_CAS + 8;

/// What a run did.
#[derive(Clone, Copy, Debug)]
pub struct Report {
    pub messages: u64,
    /// Payload bytes of the completed messages.
    pub bytes: u64,
    /// Simulated time at the end, ns.
    pub sim_ns: u64,
    pub stats: Stats,
    pub trace_hash: u64,
    pub engine_a: vrdma_engine::stats::Stats,
    pub engine_b: vrdma_engine::stats::Stats,
}

/// Why a run failed; its `Display` is the replay recipe.
#[derive(Clone, Debug)]
pub struct Failure {
    pub seed: u64,
    pub at_ns: u64,
    pub what: String,
    pub recent: Vec<Event>,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "seed {:#x} failed at {} ns: {}",
            self.seed, self.at_ns, self.what
        )?;
        writeln!(f, "last network events:")?;
        for e in &self.recent {
            writeln!(f, "  {e}")?;
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, Eq, PartialEq)]
enum Kind {
    Send,
    Write,
    Read,
    FetchAdd,
    CmpSwap,
}

/// A posted, not yet completed send WR.
#[derive(Clone, Copy, Debug)]
struct Posted {
    kind: Kind,
    len: u32,
    /// Offset of its bytes in the source pattern (A's for SEND and WRITE,
    /// B's for READ).
    pattern_at: u64,
    slot: u32,
    /// For atomics: the value the target word must have held.
    expect_orig: u64,
}

struct Ends {
    a_qpn: Qpn,
    b_qpn: Qpn,
    a_cq: vrdma_engine::CqHandle,
    b_cq: vrdma_engine::CqHandle,
    a_lkey: Lkey,
    b_lkey: Lkey,
    b_rkey: Rkey,
}

/// Engine `n` of the workload: an RC QP with a slot per message in
/// flight, its CQ room for every completion of them.
fn device(sim: &mut Sim, n: u8, mem_len: u64) -> Ids {
    EngineSpec::new(n)
        .base(BASE)
        .mem(mem_len as usize)
        .cqe(4 * SLOTS)
        .depth(SLOTS)
        .add_to_sim(sim)
}

/// How the two QPs connect: the run's MTU and timers, 16 READs/atomics in
/// flight, PSNs starting near the top of their space so that long runs
/// wrap.
fn connection(c: &Config) -> Connection {
    Connection {
        mtu: c.mtu,
        psn: Psn::from_masked(0x00ff_ff00),
        timeout: c.timeout,
        retry_cnt: c.retry_cnt,
        rnr_retry: 7,
        min_rnr_timer: 1,
        max_rd_atomic: 16,
        max_dest_rd_atomic: 16,
        ..Connection::default()
    }
}

/// Runs the workload; `Ok` only if every check held.
pub fn run(c: &Config) -> Result<Report, Failure> {
    let mut sim = Sim::new(c.seed, c.link, c.bandwidth);
    let a = device(&mut sim, 1, A_MEM);
    let b = device(&mut sim, 2, B_MEM);
    if c.same_host {
        sim.same_host();
    }
    connection(c).pair_in_sim(&mut sim, a, b);
    let (a_cq, a_qpn, a_lkey) = (a.cq, a.qpn, a.lkey);
    let (b_cq, b_qpn, b_lkey, b_rkey) = (b.cq, b.qpn, b.lkey, b.rkey);
    let (a, b) = (a.node, b.node);
    let ends = Ends {
        a_qpn,
        b_qpn,
        a_cq,
        b_cq,
        a_lkey,
        b_lkey,
        b_rkey,
    };
    // The workload has its own generator, so that the network's draws do
    // not change which messages are sent.
    let mut rng = XorShiftRng::seed_from_u64(c.seed ^ 0x5eed_f0a1_10ad_0000);
    let mut pattern = vec![0u8; 2 * MAX_SIZE as usize];
    rng.fill(&mut pattern[..]);
    sim.node_mut(a)
        .mem
        .write(BASE + A_SRC, &pattern)
        .expect("A pattern");
    sim.node_mut(b)
        .mem
        .write(BASE + B_READ, &pattern)
        .expect("B pattern");
    let mut r = Runner {
        c: *c,
        sim,
        ends,
        rng,
        pattern,
        posted: std::collections::VecDeque::new(),
        unreceived: std::collections::VecDeque::new(),
        next_wr: 0,
        completed: 0,
        bytes: 0,
        sends_posted: 0,
        sends_received: 0,
        recvs_posted: 0,
        adds: 0,
        swaps: 0,
        wcs: Vec::with_capacity(4 * SLOTS as usize),
    };
    r.go()?;
    let a_stats = r.sim.node(a).engine.stats();
    let b_stats = r.sim.node(b).engine.stats();
    Ok(Report {
        messages: r.completed,
        bytes: r.bytes,
        sim_ns: r.sim.now(),
        stats: r.sim.stats(),
        trace_hash: r.sim.trace_hash(),
        engine_a: a_stats,
        engine_b: b_stats,
    })
}

const ADD: u64 = 3;
const A: usize = 0;
const B: usize = 1;

struct Runner {
    c: Config,
    sim: Sim,
    ends: Ends,
    rng: XorShiftRng,
    pattern: Vec<u8>,
    posted: std::collections::VecDeque<Posted>,
    /// SENDs posted and not yet received: (length, pattern offset).
    unreceived: std::collections::VecDeque<(u32, u64)>,
    next_wr: u64,
    completed: u64,
    bytes: u64,
    sends_posted: u64,
    sends_received: u64,
    recvs_posted: u64,
    adds: u64,
    swaps: u64,
    wcs: Vec<Wc>,
}

impl Runner {
    fn fail(&self, what: String) -> Failure {
        Failure {
            seed: self.c.seed,
            at_ns: self.sim.now(),
            what,
            recent: self.sim.recent().copied().collect(),
        }
    }

    fn go(&mut self) -> Result<(), Failure> {
        // One receive per slot, each for the SEND with its number.
        for _ in 0..SLOTS {
            self.post_recv()?;
        }
        let mut last_now = 0;
        let mut same_instant = 0u32;
        while self.completed < self.c.messages {
            while self.posted.len() < self.c.window as usize && self.next_wr < self.c.messages {
                self.post_next()?;
            }
            if self.sim.now() == last_now {
                // Steps that never move time would be a livelock.
                same_instant += 1;
                if same_instant > 1_000_000 {
                    return Err(self.fail("livelock: time does not advance".into()));
                }
            } else {
                last_now = self.sim.now();
                same_instant = 0;
            }
            if !self.sim.step() {
                return Err(self.fail(format!(
                    "stalled: nothing pending with {} WRs outstanding",
                    self.posted.len()
                )));
            }
            if self.sim.now() > self.c.time_limit {
                return Err(self.fail(format!(
                    "no completion of {} WRs within the time limit",
                    self.posted.len()
                )));
            }
            self.poll_a()?;
            self.poll_b()?;
            for n in [A, B] {
                while let Some(e) = self.sim.poll_event(n) {
                    if e != (vrdma_engine::event::AsyncEvent::PortActive { port: 1 }) {
                        return Err(self.fail(format!("node {n}: async event {e:?}")));
                    }
                }
            }
        }
        // Let the last ACKs and duplicates settle, then check the words.
        self.sim.run_until(self.sim.now() + 10_000_000);
        self.poll_b()?;
        let mut word = [0u8; 8];
        let b_mem = &self.sim.node(B).mem;
        b_mem.read(BASE + B_ADD, &mut word).expect("B add word");
        let add_total = u64::from_le_bytes(word);
        b_mem.read(BASE + B_CAS, &mut word).expect("B cas word");
        let cas_total = u64::from_le_bytes(word);
        if add_total != self.adds * ADD || cas_total != self.swaps {
            return Err(self.fail(format!(
                "atomic words: add {add_total} (want {}), cas {cas_total} (want {})",
                self.adds * ADD,
                self.swaps
            )));
        }
        if self.sends_received != self.sends_posted {
            return Err(self.fail(format!(
                "{} SENDs arrived of {}",
                self.sends_received, self.sends_posted
            )));
        }
        self.sim.check_counters().map_err(|e| self.fail(e))
    }

    fn post_recv(&mut self) -> Result<(), Failure> {
        let n = self.recvs_posted;
        let slot = (n % u64::from(SLOTS)) as u32;
        let sge = [Sge {
            addr: BASE + B_RECV + u64::from(slot) * u64::from(MAX_SIZE),
            length: MAX_SIZE,
            lkey: self.ends.b_lkey,
        }];
        let qpn = self.ends.b_qpn;
        self.sim
            .node_mut(B)
            .engine
            .post_recv(
                qpn,
                &RecvWr {
                    wr_id: n,
                    sg_list: &sge,
                },
            )
            .map_err(|e| self.fail(format!("post_recv: {e}")))?;
        self.recvs_posted += 1;
        Ok(())
    }

    fn size(&mut self) -> u32 {
        // Log-uniform: a power-of-two band, then uniform inside it.
        let top = 32 - self.c.max_size.max(1).leading_zeros();
        let band = self.rng.random_range(0..=top);
        if band == 0 {
            return 0;
        }
        let lo = 1u32 << (band - 1);
        let hi = ((1u64 << band) - 1).min(u64::from(self.c.max_size)) as u32;
        self.rng.random_range(lo..=hi.max(lo))
    }

    fn post_next(&mut self) -> Result<(), Failure> {
        let i = self.next_wr;
        let slot = (i % u64::from(SLOTS)) as u32;
        let kind = match self.rng.random_range(0..100) {
            0..40 => Kind::Send,
            40..70 => Kind::Write,
            70..90 => Kind::Read,
            90..95 => Kind::FetchAdd,
            _ => Kind::CmpSwap,
        };
        let len = match kind {
            Kind::FetchAdd | Kind::CmpSwap => 8,
            _ => self.size(),
        };
        let pattern_at = self.rng.random_range(0..=u64::from(MAX_SIZE));
        let slot_at = u64::from(slot) * u64::from(MAX_SIZE);
        let (op, local_at) = match kind {
            Kind::Send => (SendOp::Send, A_SRC + pattern_at),
            Kind::Write => (
                SendOp::RdmaWrite {
                    remote_addr: BASE + B_WRITE + slot_at,
                    rkey: self.ends.b_rkey,
                },
                A_SRC + pattern_at,
            ),
            Kind::Read => (
                SendOp::RdmaRead {
                    remote_addr: BASE + B_READ + pattern_at,
                    rkey: self.ends.b_rkey,
                },
                A_READ + slot_at,
            ),
            Kind::FetchAdd => (
                SendOp::FetchAdd {
                    remote_addr: BASE + B_ADD,
                    rkey: self.ends.b_rkey,
                    add: ADD,
                },
                A_ATOMIC + u64::from(slot) * 8,
            ),
            Kind::CmpSwap => (
                SendOp::CompareSwap {
                    remote_addr: BASE + B_CAS,
                    rkey: self.ends.b_rkey,
                    compare: self.swaps_posted(),
                    swap: self.swaps_posted() + 1,
                },
                A_ATOMIC + u64::from(slot) * 8,
            ),
        };
        let expect_orig = match kind {
            Kind::FetchAdd => self.adds_posted() * ADD,
            Kind::CmpSwap => self.swaps_posted(),
            _ => 0,
        };
        let sge = [Sge {
            addr: BASE + local_at,
            length: len,
            lkey: self.ends.a_lkey,
        }];
        let qpn = self.ends.a_qpn;
        self.sim
            .node_mut(A)
            .engine
            .post_send(
                qpn,
                &SendWr {
                    wr_id: i,
                    op,
                    payload: Payload::Sges(&sge),
                    flags: SendFlags::SIGNALED,
                    ud: None,
                },
            )
            .map_err(|e| self.fail(format!("post_send {i}: {e}")))?;
        if kind == Kind::Send {
            self.sends_posted += 1;
            self.unreceived.push_back((len, pattern_at));
        }
        self.posted.push_back(Posted {
            kind,
            len,
            pattern_at,
            slot,
            expect_orig,
        });
        self.next_wr += 1;
        Ok(())
    }

    /// Atomics of each kind posted so far (completed + outstanding): the
    /// value the next one must find, since one QP executes in order.
    fn adds_posted(&self) -> u64 {
        self.adds + self.outstanding(Kind::FetchAdd)
    }

    fn swaps_posted(&self) -> u64 {
        self.swaps + self.outstanding(Kind::CmpSwap)
    }

    fn outstanding(&self, kind: Kind) -> u64 {
        self.posted.iter().filter(|p| p.kind == kind).count() as u64
    }

    fn poll_a(&mut self) -> Result<(), Failure> {
        let mut wcs = std::mem::take(&mut self.wcs);
        wcs.clear();
        let (qpn, cq) = (self.ends.a_qpn, self.ends.a_cq);
        let _ = self.sim.poll_cq(A, cq, usize::MAX, &mut wcs);
        for w in &wcs {
            self.check_send_wc(w, qpn)?;
        }
        self.wcs = wcs;
        Ok(())
    }

    fn check_send_wc(&mut self, w: &Wc, qpn: Qpn) -> Result<(), Failure> {
        let want_id = self.completed;
        let Some(p) = self.posted.pop_front() else {
            return Err(self.fail(format!("completion with nothing outstanding: {w:?}")));
        };
        let opcode = match p.kind {
            Kind::Send => WcOpcode::Send,
            Kind::Write => WcOpcode::RdmaWrite,
            Kind::Read => WcOpcode::RdmaRead,
            Kind::FetchAdd => WcOpcode::FetchAdd,
            Kind::CmpSwap => WcOpcode::CompSwap,
        };
        let mut want = Wc::new(want_id, WcStatus::Success, opcode, qpn.value());
        want.byte_len = p.len;
        // Every WR is signaled: this one is the (want_id + 1)th retired.
        want.sq_retired = (want_id as u32).wrapping_add(1);
        if *w != want {
            return Err(self.fail(format!("send completion {w:?}, want {want:?}")));
        }
        let n = p.len as usize;
        let slot_at = u64::from(p.slot) * u64::from(MAX_SIZE);
        let at = p.pattern_at as usize;
        match p.kind {
            Kind::Send => {}
            Kind::Write => {
                let mut got = vec![0; n];
                let mem = &self.sim.node(B).mem;
                mem.read(BASE + B_WRITE + slot_at, &mut got)
                    .expect("B write slot");
                if got != self.pattern[at..at + n] {
                    return Err(self.fail(format!("WRITE {want_id}: B's bytes differ")));
                }
            }
            Kind::Read => {
                let mut got = vec![0; n];
                let mem = &self.sim.node(A).mem;
                mem.read(BASE + A_READ + slot_at, &mut got)
                    .expect("A read slot");
                if got != self.pattern[at..at + n] {
                    return Err(self.fail(format!("READ {want_id}: A's bytes differ")));
                }
            }
            Kind::FetchAdd | Kind::CmpSwap => {
                let mut word = [0u8; 8];
                let mem = &self.sim.node(A).mem;
                mem.read(BASE + A_ATOMIC + u64::from(p.slot) * 8, &mut word)
                    .expect("A atomic slot");
                let orig = u64::from_le_bytes(word);
                if orig != p.expect_orig {
                    return Err(self.fail(format!(
                        "{:?} {want_id} returned {orig}, want {} (not linearizable)",
                        p.kind, p.expect_orig
                    )));
                }
                if p.kind == Kind::FetchAdd {
                    self.adds += 1;
                } else {
                    self.swaps += 1;
                }
            }
        }
        self.completed += 1;
        self.bytes += u64::from(p.len);
        Ok(())
    }

    fn poll_b(&mut self) -> Result<(), Failure> {
        let mut wcs = std::mem::take(&mut self.wcs);
        wcs.clear();
        let (qpn, cq) = (self.ends.b_qpn, self.ends.b_cq);
        let _ = self.sim.poll_cq(B, cq, usize::MAX, &mut wcs);
        for w in &wcs {
            self.check_recv_wc(w, qpn)?;
        }
        self.wcs = wcs;
        Ok(())
    }

    fn check_recv_wc(&mut self, w: &Wc, qpn: Qpn) -> Result<(), Failure> {
        let k = self.sends_received;
        // The oldest SEND not yet received must be this one.
        let Some((len, at)) = self.unreceived.pop_front() else {
            return Err(self.fail(format!("receive completion {w:?} for no SEND")));
        };
        let mut want = Wc::new(k, WcStatus::Success, WcOpcode::Recv, qpn.value());
        want.byte_len = len;
        if *w != want {
            return Err(self.fail(format!("receive completion {w:?}, want {want:?}")));
        }
        let slot_at = (k % u64::from(SLOTS)) * u64::from(MAX_SIZE);
        let mut got = vec![0; len as usize];
        self.sim
            .node(B)
            .mem
            .read(BASE + B_RECV + slot_at, &mut got)
            .expect("B recv slot");
        let at = at as usize;
        if got != self.pattern[at..at + len as usize] {
            return Err(self.fail(format!("SEND {k}: received bytes differ")));
        }
        self.sends_received += 1;
        self.post_recv()
    }
}
