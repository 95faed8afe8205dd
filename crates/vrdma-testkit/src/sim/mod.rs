//! A seeded, simulated network of engines: every fault a real network has,
//! on a virtual clock.
//!
//! Each node is an [`Engine`] with its memory and one GID, attached by one
//! port of a given bandwidth. A packet the engine transmits is framed into
//! an IP/UDP datagram with `vrdma-wire` (lengths, checksums, ICRC), leaves
//! the port after the packets before it (serialization at line rate), and
//! crosses a directed link that may queue it behind earlier packets (a link
//! slower than the port: a bottleneck or a slow receiver), lose it,
//! duplicate it, delay it (fixed delay plus uniform jitter), hold it back
//! past later packets (bounded reordering), flip one of its bits (which the
//! receiver's ICRC or IP checksum must catch), or drop everything while the
//! link is partitioned.
//! The receiver parses the frame, verifies the ICRC and hands the RoCE
//! packet to its engine.
//!
//! Time moves only when the simulator moves it, to the next event: a
//! packet arriving, a port free to send, an engine deadline
//! ([`Engine::poll_timeout`]). Nothing sleeps, so an hour of simulated
//! time costs only the events in it. Every random choice comes from one
//! generator seeded by the caller, and every event feeds a running trace
//! hash: the same seed and the same calls give the same trace, bit for bit
//! ([`Sim::trace_hash`]), and [`Sim::recent`] shows the last events when a
//! check fails.

pub mod workload;

use std::{
    cmp::Reverse,
    collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque},
    fmt,
};

use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;
use vrdma_engine::{
    Engine, Memory, VecMemory,
    transmit::{MAX_PACKET, Transmit},
};
use vrdma_wire::{
    Gid,
    frame::{self, IpRepr},
};

use crate::net::lent_in;

/// How one directed link treats each packet. Probabilities are per packet
/// and independent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Propagation delay, ns.
    pub delay: u64,
    /// Extra delay drawn uniformly from `0..=jitter` ns per packet.
    pub jitter: u64,
    /// Lost.
    pub loss: f64,
    /// Delivered twice (the copy with its own delay).
    pub duplicate: f64,
    /// Held back by up to `reorder_delay` ns more, so that later packets
    /// overtake it.
    pub reorder: f64,
    pub reorder_delay: u64,
    /// One bit flipped somewhere in the frame.
    pub corrupt: f64,
    /// The link's own rate, bytes per second (0: as fast as the sending
    /// port). Frames queue behind one another and leave one at a time, so
    /// a rate below the port's is a bottleneck with an unbounded queue: a
    /// congested hop, or a receiver that takes its packets in slower than
    /// they come (the kernel's rxe in a TCG guest handles some thousand
    /// 4 KiB packets a second).
    pub rate: u64,
}

impl Link {
    /// 2 µs, no faults.
    pub const PERFECT: Link = Link {
        delay: 2_000,
        jitter: 0,
        loss: 0.0,
        duplicate: 0.0,
        reorder: 0.0,
        reorder_delay: 0,
        corrupt: 0.0,
        rate: 0,
    };
}

impl Default for Link {
    fn default() -> Self {
        Self::PERFECT
    }
}

/// Counters of what the network did.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct Stats {
    /// Frames the engines transmitted.
    pub sent: u64,
    /// Frames handed to an engine (duplicates included).
    pub delivered: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub reordered: u64,
    /// Frames on the wire with a flipped bit (a duplicate of one counts
    /// again).
    pub corrupted: u64,
    /// Corrupted frames the receiver rejected (bad ICRC or checksum).
    pub corrupt_rejected: u64,
    /// Corrupted frames that still parsed: the flipped bit was one the
    /// ICRC masks and no checksum covers (the UDP checksum field, unused
    /// on RoCEv2). Their RoCE packet is intact.
    pub corrupt_accepted: u64,
    /// Dropped on a partitioned link.
    pub partitioned: u64,
    /// For a GID no node owns.
    pub undeliverable: u64,
    /// Engine timer runs.
    pub timeouts: u64,
}

/// One thing that happened, for [`Sim::recent`].
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Event {
    pub at: u64,
    pub kind: EventKind,
}

#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum EventKind {
    /// A frame left `from` for `to` (`to` is `usize::MAX` when nobody owns
    /// the destination GID).
    Sent {
        from: usize,
        to: usize,
        opcode: u8,
        psn: u32,
        len: usize,
    },
    Lost {
        from: usize,
        to: usize,
        psn: u32,
    },
    Duplicated {
        from: usize,
        to: usize,
        psn: u32,
    },
    Corrupted {
        from: usize,
        to: usize,
        bit: usize,
    },
    Delivered {
        to: usize,
        opcode: u8,
        psn: u32,
    },
    Rejected {
        to: usize,
    },
    Timeout {
        node: usize,
    },
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:>14} ns  ", self.at)?;
        match self.kind {
            EventKind::Sent {
                from,
                to,
                opcode,
                psn,
                len,
            } => write!(f, "sent {from}->{to} op {opcode:#04x} psn {psn} len {len}"),
            EventKind::Lost { from, to, psn } => write!(f, "lost {from}->{to} psn {psn}"),
            EventKind::Duplicated { from, to, psn } => {
                write!(f, "duplicated {from}->{to} psn {psn}")
            }
            EventKind::Corrupted { from, to, bit } => {
                write!(f, "corrupted {from}->{to} bit {bit}")
            }
            EventKind::Delivered { to, opcode, psn } => {
                write!(f, "delivered to {to} op {opcode:#04x} psn {psn}")
            }
            EventKind::Rejected { to } => write!(f, "rejected by {to}"),
            EventKind::Timeout { node } => write!(f, "timers of {node}"),
        }
    }
}

/// One attached device.
#[derive(Debug)]
pub struct Node {
    pub engine: Engine,
    pub mem: VecMemory,
    pub gid: Gid,
    /// When the port has finished sending the last packet.
    tx_free_at: u64,
    /// The engine had a packet last time it was asked: ask again when the
    /// port is free.
    tx_active: bool,
    /// The engine's next deadline, as last asked (the engine scans its
    /// QPs for it; the simulator needs it every step).
    timer: Option<u64>,
    /// The engine was called since: ask for `timer` again before using it.
    timer_stale: bool,
}

impl Node {
    fn refresh_timer(&mut self) {
        self.timer = self.engine.poll_timeout();
        self.timer_stale = false;
    }
}

/// A frame on a link.
#[derive(Debug, Eq, PartialEq)]
struct Flight {
    at: u64,
    /// Tie-break in sending order: deterministic and FIFO at equal times.
    seq: u64,
    to: usize,
    /// A bit of it was flipped on the way.
    corrupted: bool,
    bytes: Vec<u8>,
    /// On a same-host medium ([`Sim::same_host`]), a packet whose payload
    /// was lent on: `bytes` is the RoCE packet (no IP framing), with the
    /// IP header it stands for, where its payload starts and its length.
    lent: Option<(IpRepr, usize, usize)>,
}

impl Ord for Flight {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

impl PartialOrd for Flight {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// How many events [`Sim::recent`] keeps.
const RECENT: usize = 64;

/// The simulated network.
#[derive(Debug)]
pub struct Sim {
    /// Virtual time, ns.
    now: u64,
    nodes: Vec<Node>,
    rng: XorShiftRng,
    seed: u64,
    /// Port speed, bytes per second; `None` for infinitely fast ports.
    bandwidth: Option<u64>,
    default_link: Link,
    links: BTreeMap<(usize, usize), Link>,
    /// Directed links that drop everything.
    cut: BTreeSet<(usize, usize)>,
    /// Packets to lose on purpose (a test's scenario), first match wins.
    drops: Vec<DropRule>,
    /// Per directed link, the latest in-order arrival so far.
    fifo: BTreeMap<(usize, usize), u64>,
    /// Per directed link with a rate of its own, when it has finished
    /// passing on the frames queued so far.
    drained_at: BTreeMap<(usize, usize), u64>,
    flights: BinaryHeap<Reverse<Flight>>,
    seq: u64,
    /// Frame buffers to reuse.
    pool: Vec<Vec<u8>>,
    buf: Vec<u8>,
    stats: Stats,
    trace: u64,
    recent: VecDeque<Event>,
    /// A same-host medium ([`Sim::same_host`]).
    same_host: bool,
}

/// Packets a test wants lost: the next `count` packets from `from` to
/// `to` with this opcode (any, if `None`) and PSN (any, if `None`).
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct DropRule {
    pub from: usize,
    pub to: usize,
    pub opcode: Option<u8>,
    pub psn: Option<u32>,
    pub count: u32,
}

/// What stopped a run.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Quiet {
    /// No packet in flight, no port busy, no timer pending.
    Idle,
    /// The time limit was reached with events still pending.
    TimeLimit,
}

impl Sim {
    /// An empty network whose random choices all come from `seed`, with
    /// `link` on every link and ports of `bandwidth` bytes per second
    /// (`None`: infinitely fast).
    pub fn new(seed: u64, link: Link, bandwidth: Option<u64>) -> Self {
        Sim {
            now: 0,
            nodes: Vec::new(),
            rng: XorShiftRng::seed_from_u64(seed),
            seed,
            bandwidth,
            default_link: link,
            links: BTreeMap::new(),
            cut: BTreeSet::new(),
            drops: Vec::new(),
            fifo: BTreeMap::new(),
            drained_at: BTreeMap::new(),
            flights: BinaryHeap::new(),
            seq: 0,
            pool: Vec::new(),
            buf: vec![0; MAX_PACKET],
            stats: Stats::default(),
            // FNV-1a offset basis.
            trace: 0xcbf2_9ce4_8422_2325,
            recent: VecDeque::with_capacity(RECENT),
            same_host: false,
        }
    }

    /// Makes the network a same-host medium, as `vrdma_fabric::shm` is
    /// between the devices of one process: each engine may send every
    /// other node a run of segments in one packet
    /// ([`Engine::set_jumbo`](vrdma_engine::Engine::set_jumbo)), and a lent
    /// payload travels lent on, handed over with
    /// [`Engine::handle_lent_packet`](vrdma_engine::Engine::handle_lent_packet)
    /// (no IP framing: such a packet may be longer than a datagram). The
    /// links' loss, duplication, reordering and delays still apply; a bit
    /// flip does not (nothing on the way can flip one). Call it once the
    /// nodes are added.
    pub fn same_host(&mut self) {
        self.same_host = true;
        let gids: Vec<Gid> = self.nodes.iter().map(|n| n.gid).collect();
        for n in &mut self.nodes {
            let others: Vec<Gid> = gids.iter().copied().filter(|g| *g != n.gid).collect();
            n.engine.set_jumbo(&others);
        }
    }

    /// Adds a node; returns its index.
    pub fn add(&mut self, engine: Engine, mem: VecMemory, gid: Gid) -> usize {
        self.nodes.push(Node {
            engine,
            mem,
            gid,
            tx_free_at: 0,
            tx_active: true,
            timer: None,
            timer_stale: true,
        });
        self.nodes.len() - 1
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn now(&self) -> u64 {
        self.now
    }

    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// A hash of every event so far: equal for equal runs.
    pub fn trace_hash(&self) -> u64 {
        self.trace
    }

    /// The last events, oldest first.
    pub fn recent(&self) -> impl Iterator<Item = &Event> {
        self.recent.iter()
    }

    /// Sets the link from `from` to `to`.
    pub fn set_link(&mut self, from: usize, to: usize, link: Link) {
        self.links.insert((from, to), link);
    }

    /// Sets every link.
    pub fn set_all_links(&mut self, link: Link) {
        self.links.clear();
        self.default_link = link;
    }

    /// Cuts both directions between `a` and `b`: everything sent is lost
    /// until [`Sim::heal`]. Packets already on the wire still arrive.
    pub fn partition(&mut self, a: usize, b: usize) {
        self.cut.insert((a, b));
        self.cut.insert((b, a));
    }

    /// Loses the packets `drop` describes (counted in [`Stats::lost`]).
    pub fn drop_packets(&mut self, drop: DropRule) {
        self.drops.push(drop);
    }

    /// Restores both directions between `a` and `b`.
    pub fn heal(&mut self, a: usize, b: usize) {
        self.cut.remove(&(a, b));
        self.cut.remove(&(b, a));
    }

    /// Node `i`. Panics if there is none (a test's own mistake).
    pub fn node(&self, i: usize) -> &Node {
        &self.nodes[i]
    }

    /// Node `i`, to call verbs on its engine or touch its memory; the
    /// simulator then asks the engine for packets at the next step.
    pub fn node_mut(&mut self, i: usize) -> &mut Node {
        let n = &mut self.nodes[i];
        n.tx_active = true;
        n.timer_stale = true;
        n
    }

    /// `ibv_poll_cq` on node `i` (which gives its engine nothing to send,
    /// so unlike [`Sim::node_mut`] it does not wake the port).
    pub fn poll_cq(
        &mut self,
        i: usize,
        cq: vrdma_engine::CqHandle,
        max: usize,
        out: &mut Vec<vrdma_engine::wc::Wc>,
    ) -> Result<usize, vrdma_engine::VerbsError> {
        self.nodes[i].engine.poll_cq(cq, max, out)
    }

    /// The next asynchronous event of node `i`'s engine.
    pub fn poll_event(&mut self, i: usize) -> Option<vrdma_engine::event::AsyncEvent> {
        self.nodes[i].engine.poll_event()
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    fn record(&mut self, kind: EventKind) {
        let e = Event { at: self.now, kind };
        // FNV-1a over the event's Debug form would allocate; hash the
        // fields that identify it instead.
        let words: [u64; 4] = match kind {
            EventKind::Sent {
                from,
                to,
                opcode,
                psn,
                len,
            } => [
                1,
                pack(from, to),
                u64::from(opcode) << 32 | u64::from(psn),
                len as u64,
            ],
            EventKind::Lost { from, to, psn } => [2, pack(from, to), u64::from(psn), 0],
            EventKind::Duplicated { from, to, psn } => [3, pack(from, to), u64::from(psn), 0],
            EventKind::Corrupted { from, to, bit } => [4, pack(from, to), bit as u64, 0],
            EventKind::Delivered { to, opcode, psn } => {
                [5, to as u64, u64::from(opcode) << 32 | u64::from(psn), 0]
            }
            EventKind::Rejected { to } => [6, to as u64, 0, 0],
            EventKind::Timeout { node } => [7, node as u64, 0, 0],
        };
        // A word at a time (FNV-1a's step on 64-bit words, with a rotate
        // so that high bits reach low ones): the trace is hashed for
        // every packet, byte-wise hashing was a tenth of the run.
        for w in [self.now].into_iter().chain(words) {
            self.trace = (self.trace ^ w)
                .wrapping_mul(0x0000_0100_0000_01b3)
                .rotate_left(29);
        }
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(e);
    }

    /// The time of the next event, if any.
    fn next_event(&mut self) -> Option<u64> {
        for n in &mut self.nodes {
            if n.timer_stale {
                n.refresh_timer();
            }
        }
        let flight = self.flights.peek().map(|Reverse(f)| f.at);
        let tx = self
            .nodes
            .iter()
            .filter(|n| n.tx_active)
            .map(|n| n.tx_free_at.max(self.now))
            .min();
        let timer = self
            .nodes
            .iter()
            .filter_map(|n| n.timer)
            .map(|t| t.max(self.now))
            .min();
        [flight, tx, timer].into_iter().flatten().min()
    }

    /// Runs the next instant at which anything happens: deliveries, then
    /// timers, then each free port sends what its engine has. Returns
    /// false when nothing is pending at all.
    pub fn step(&mut self) -> bool {
        let Some(t) = self.next_event() else {
            return false;
        };
        self.now = self.now.max(t);
        while self
            .flights
            .peek()
            .is_some_and(|Reverse(f)| f.at <= self.now)
        {
            let Some(Reverse(f)) = self.flights.pop() else {
                break;
            };
            self.deliver(f);
        }
        for i in 0..self.nodes.len() {
            if self.nodes[i].timer_stale {
                self.nodes[i].refresh_timer();
            }
            if self.nodes[i].timer.is_some_and(|d| d <= self.now) {
                self.stats.timeouts += 1;
                self.record(EventKind::Timeout { node: i });
                let now = self.now;
                let node = &mut self.nodes[i];
                node.engine.handle_timeout(now);
                node.refresh_timer();
                node.tx_active = true;
            }
        }
        for i in 0..self.nodes.len() {
            self.transmit(i);
        }
        true
    }

    /// Steps until nothing is pending, or until virtual time would pass
    /// `deadline` (then time stops at `deadline`).
    pub fn run_until(&mut self, deadline: u64) -> Quiet {
        loop {
            match self.next_event() {
                None => return Quiet::Idle,
                Some(t) if t > deadline => {
                    self.now = self.now.max(deadline);
                    return Quiet::TimeLimit;
                }
                Some(_) => {
                    self.step();
                }
            }
        }
    }

    /// Sends from node `i` while its port is free at this instant.
    fn transmit(&mut self, i: usize) {
        loop {
            let now = self.now;
            let node = &mut self.nodes[i];
            if !node.tx_active || node.tx_free_at > now {
                return;
            }
            let t = if self.same_host {
                node.engine
                    .poll_transmit_gather(now, &node.mem, &mut self.buf)
            } else {
                node.engine.poll_transmit(now, &node.mem, &mut self.buf)
            };
            let Some(t) = t else {
                node.tx_active = false;
                node.timer_stale = true;
                return;
            };
            node.timer_stale = true;
            let mut bytes = self.pool.pop().unwrap_or_default();
            let mut lent = None;
            if t.referenced > 0 {
                // Lent on: the packet whole, its payload read from the
                // sender's memory (the receiver would read it there).
                bytes.clear();
                bytes.extend_from_slice(&self.buf[..t.payload_at]);
                for r in node.engine.gathered() {
                    let at = bytes.len();
                    bytes.resize(at + r.len, 0);
                    node.mem
                        .read(r.addr, &mut bytes[at..])
                        .expect("the engine lends what memory has");
                }
                bytes.extend_from_slice(&self.buf[t.payload_at..t.len - t.referenced]);
                let ip = t.route().ip(t.len, 0).expect("a route");
                lent = Some((ip, t.payload_at, t.referenced));
            } else {
                // The engine emits only packets that parse: checked, not
                // assumed, since a framing failure would silently lose
                // data.
                let roce = &self.buf[..t.len];
                t.route()
                    .ip(roce.len(), 0)
                    .and_then(|ip| frame::emit_ip_packet(&ip, t.udp_src_port, roce, &mut bytes))
                    .expect("the engine emitted a malformed packet");
            }
            if let Some(bw) = self.bandwidth {
                // Serialization: the port is busy for the frame's bits.
                let ns = (bytes.len() as u64 * 1_000_000_000).div_ceil(bw.max(1));
                node.tx_free_at = now + ns;
            }
            self.send(i, &t, bytes, lent);
        }
    }

    /// Puts a frame from `from` on its link, with the link's faults.
    fn send(
        &mut self,
        from: usize,
        t: &Transmit,
        mut bytes: Vec<u8>,
        lent: Option<(IpRepr, usize, usize)>,
    ) {
        self.stats.sent += 1;
        let roce_at = bytes.len() - t.len;
        let (opcode, psn) = bth_of(&bytes[roce_at..]);
        let to = self
            .nodes
            .iter()
            .position(|n| n.gid == t.dgid)
            .unwrap_or(usize::MAX);
        self.record(EventKind::Sent {
            from,
            to,
            opcode,
            psn,
            len: bytes.len(),
        });
        if to == usize::MAX {
            self.stats.undeliverable += 1;
            self.pool.push(bytes);
            return;
        }
        if self.cut.contains(&(from, to)) {
            self.stats.partitioned += 1;
            self.record(EventKind::Lost { from, to, psn });
            self.pool.push(bytes);
            return;
        }
        let link = self
            .links
            .get(&(from, to))
            .copied()
            .unwrap_or(self.default_link);
        let targeted = self.drops.iter_mut().find(|d| {
            d.count > 0
                && (d.from, d.to) == (from, to)
                && d.opcode.is_none_or(|o| o == opcode)
                && d.psn.is_none_or(|p| p == psn)
        });
        let targeted = targeted.map(|d| d.count -= 1).is_some();
        if targeted || self.rng.random_bool(link.loss) {
            self.stats.lost += 1;
            self.record(EventKind::Lost { from, to, psn });
            self.pool.push(bytes);
            return;
        }
        let corrupted = lent.is_none() && self.rng.random_bool(link.corrupt);
        if corrupted {
            let bit = self.rng.random_range(0..bytes.len() * 8);
            bytes[bit / 8] ^= 1 << (bit % 8);
            self.stats.corrupted += 1;
            self.record(EventKind::Corrupted { from, to, bit });
        }
        if self.rng.random_bool(link.duplicate) {
            self.stats.duplicated += 1;
            // The copy carries the same flipped bit.
            self.stats.corrupted += u64::from(corrupted);
            self.record(EventKind::Duplicated { from, to, psn });
            let mut copy = self.pool.pop().unwrap_or_default();
            copy.clear();
            copy.extend_from_slice(&bytes);
            let at = self.arrival(from, to, &link, copy.len());
            self.fly(at, to, corrupted, copy, lent);
        }
        let at = self.arrival(from, to, &link, bytes.len());
        self.fly(at, to, corrupted, bytes, lent);
    }

    /// When a packet of `len` bytes sent now from `from` to `to` over
    /// `link` arrives. A link is FIFO: a rate-limited link passes it on
    /// after the packets queued before it, and jitter delays a packet and
    /// those behind it, never lets them pass; only a packet held back
    /// (`reorder`) is overtaken.
    fn arrival(&mut self, from: usize, to: usize, link: &Link, len: usize) -> u64 {
        let mut start = self.now;
        if link.rate > 0 {
            let drained = self.drained_at.entry((from, to)).or_insert(0);
            let ns = (len as u64 * 1_000_000_000).div_ceil(link.rate);
            *drained = (*drained).max(start) + ns;
            start = *drained;
        }
        let mut at = start + link.delay;
        if link.jitter > 0 {
            at += self.rng.random_range(0..=link.jitter);
        }
        let fifo = self.fifo.entry((from, to)).or_insert(0);
        at = at.max(*fifo);
        *fifo = at;
        if link.reorder_delay > 0 && self.rng.random_bool(link.reorder) {
            self.stats.reordered += 1;
            at += self.rng.random_range(1..=link.reorder_delay);
        }
        at
    }

    fn fly(
        &mut self,
        at: u64,
        to: usize,
        corrupted: bool,
        bytes: Vec<u8>,
        lent: Option<(IpRepr, usize, usize)>,
    ) {
        let seq = self.seq;
        self.seq += 1;
        self.flights.push(Reverse(Flight {
            at,
            seq,
            to,
            corrupted,
            bytes,
            lent,
        }));
    }

    fn deliver(&mut self, f: Flight) {
        let to = f.to;
        if let Some((ip, payload_at, len)) = f.lent {
            let (opcode, psn) = bth_of(&f.bytes);
            self.stats.delivered += 1;
            self.record(EventKind::Delivered { to, opcode, psn });
            let head = [&f.bytes[..payload_at], &f.bytes[payload_at + len..]].concat();
            let now = self.now;
            let node = &mut self.nodes[to];
            let mut mem = lent_in(&mut node.mem, &f.bytes[payload_at..payload_at + len]);
            node.engine
                .handle_lent_packet(now, &ip, &head, payload_at, len, &mut mem);
            drop(mem);
            node.engine.finish_revocations();
            node.timer_stale = true;
            node.tx_active = true;
            self.pool.push(f.bytes);
            return;
        }
        // What a NIC checks (IP and UDP headers, the ICRC); the engine
        // parses the RoCE packet.
        let parsed = frame::unframe_ip(&f.bytes);
        match parsed {
            Ok(d) => {
                let (opcode, psn) = bth_of(d.roce);
                self.stats.delivered += 1;
                if f.corrupted {
                    self.stats.corrupt_accepted += 1;
                }
                self.record(EventKind::Delivered { to, opcode, psn });
                let now = self.now;
                let node = &mut self.nodes[to];
                node.engine.handle_packet(now, &d.ip, d.roce, &mut node.mem);
                node.timer_stale = true;
                node.tx_active = true;
            }
            Err(e) => {
                // Only a flipped bit can make a frame the engine emitted
                // unparseable.
                assert!(f.corrupted, "an intact frame was rejected: {e}");
                self.stats.corrupt_rejected += 1;
                self.record(EventKind::Rejected { to });
            }
        }
        self.pool.push(f.bytes);
    }

    /// Checks that the counters add up: every frame sent was lost,
    /// dropped, rejected, delivered or is still in flight, and every
    /// corrupted frame was rejected or (a masked bit) accepted.
    pub fn check_counters(&self) -> Result<(), String> {
        let s = self.stats;
        let resolved = s.delivered + s.corrupt_rejected;
        let in_flight = self.flights.len() as u64;
        let expected = s.sent + s.duplicated - s.lost - s.partitioned - s.undeliverable;
        if resolved + in_flight != expected {
            return Err(format!(
                "frames: {resolved} resolved + {in_flight} in flight != {expected} expected ({s:?})"
            ));
        }
        if s.corrupt_rejected + s.corrupt_accepted > s.corrupted {
            return Err(format!("more corrupt frames arrived than were made: {s:?}"));
        }
        Ok(())
    }
}

fn pack(a: usize, b: usize) -> u64 {
    (a as u64) << 32 | (b as u64 & 0xffff_ffff)
}

/// The opcode and PSN of a RoCE packet (for the trace), without parsing.
fn bth_of(roce: &[u8]) -> (u8, u32) {
    match roce {
        [op, _, _, _, _, _, _, _, a, b, c, d, ..] => {
            (*op, u32::from_be_bytes([*a, *b, *c, *d]) & 0x00ff_ffff)
        }
        _ => (0, 0),
    }
}
