//! A deterministic in-memory network for connecting engines in tests.
//!
//! Each node is an engine with its memory and one GID. [`Net::step`] moves
//! packets: every transmitted packet is framed into an IP packet with
//! `vrdma-wire` (lengths, checksums, ICRC), parsed back with the ICRC
//! verified, and handed to the node that owns the destination GID, so the
//! wire format is exercised on every hop. Time is a counter the test
//! advances; nothing sleeps. The network is in order and loses only the
//! packets a test names in [`Net::drop`] (the reliability work adds seeded
//! random faults).

use vrdma_wire::{Gid, frame, udp};

use vrdma_engine::{
    Engine,
    memory::{Memory, MemoryError, VecMemory, WithLent},
    transmit::MAX_PACKET,
};

/// One attached device.
#[derive(Debug)]
pub struct Node {
    pub engine: Engine,
    pub mem: VecMemory,
    pub gid: Gid,
}

/// Engines connected by an in-order network that loses exactly the
/// packets a test names.
#[derive(Debug, Default)]
pub struct Net {
    pub nodes: Vec<Node>,
    /// The current time, in nanoseconds.
    pub now: u64,
    /// Packets sent so far (every transmission, dropped or not), numbered
    /// from 0.
    pub sent: u64,
    /// Packets delivered so far.
    pub delivered: u64,
    /// Packets for a GID nobody owns.
    pub undeliverable: u64,
    /// Numbers (in `sent` order) of the packets to lose.
    pub drop: std::collections::BTreeSet<u64>,
    /// Packets lost to `drop`.
    pub dropped: u64,
    /// When set, every packet sent (BTH through ICRC) is recorded with the
    /// index of the node that sent it.
    pub tap: Option<Vec<(usize, Vec<u8>)>>,
    /// Poll as a gather-send fabric does ([`Engine::poll_transmit_gather`]):
    /// a lent payload is read from the sender's memory into the packet.
    pub gather: bool,
    /// A same-host medium ([`Net::jumbo`]): payloads lent on, in runs of
    /// segments.
    pub jumbo: bool,
}

/// A node's memory while it handles a packet whose payload was lent on:
/// [`Memory::write_lent`] copies from `payload`.
pub fn lent_in<'a>(mem: &'a mut VecMemory, payload: &'a [u8]) -> impl Memory + 'a {
    WithLent {
        mem,
        copy: move |mem: &mut VecMemory, addr: u64, at: usize, len: usize| {
            let err = MemoryError {
                addr,
                len: len as u64,
            };
            mem.write(addr, payload.get(at..at + len).ok_or(err)?)
        },
    }
}

/// What stopped [`Net::run`].
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Quiet {
    /// Nothing to send and no timer pending.
    Idle,
    /// Nothing to send; the next timer is at this time.
    Timer(u64),
    /// The step limit was reached with packets still flowing.
    Busy,
}

impl Net {
    /// Makes the network a same-host medium, as `vrdma_fabric::shm` is
    /// between devices of one process: each engine may send every other
    /// node a run of segments in one packet ([`Engine::set_jumbo`]), and a
    /// lent payload travels lent on — delivered with
    /// [`Engine::handle_lent_packet`], no IP framing (such a packet may be
    /// longer than a datagram). Call it once the nodes are added.
    pub fn same_host(&mut self) {
        self.gather = true;
        self.jumbo = true;
        let gids: Vec<Gid> = self.nodes.iter().map(|n| n.gid).collect();
        for n in &mut self.nodes {
            let others: Vec<Gid> = gids.iter().copied().filter(|g| *g != n.gid).collect();
            n.engine.set_jumbo(&others);
        }
    }

    /// Adds a node; returns its index.
    pub fn add(&mut self, engine: Engine, mem: VecMemory, gid: Gid) -> usize {
        self.nodes.push(Node { engine, mem, gid });
        self.nodes.len() - 1
    }

    /// One round: each node sends at most one packet, which is delivered
    /// at once. Returns the number of packets moved.
    pub fn step(&mut self) -> usize {
        let mut buf = vec![0u8; MAX_PACKET];
        let mut assembled = Vec::new();
        let mut moved = 0;
        for i in 0..self.nodes.len() {
            let node = &mut self.nodes[i];
            let t = if self.gather {
                node.engine
                    .poll_transmit_gather(self.now, &node.mem, &mut buf)
            } else {
                node.engine.poll_transmit(self.now, &node.mem, &mut buf)
            };
            let Some(t) = t else {
                continue;
            };
            let packet = if t.referenced > 0 {
                let lent = node.engine.gathered();
                assert_eq!(
                    lent.iter().map(|r| r.len).sum::<usize>(),
                    t.referenced,
                    "the pieces lent are the payload"
                );
                assembled.clear();
                assembled.extend_from_slice(&buf[..t.payload_at]);
                for r in lent {
                    let at = assembled.len();
                    assembled.resize(at + r.len, 0);
                    node.mem
                        .read(r.addr, &mut assembled[at..])
                        .expect("the engine lends what memory has");
                }
                // The engine put the bytes after the payload right after
                // the headers.
                assembled.extend_from_slice(&buf[t.payload_at..t.len - t.referenced]);
                &assembled[..]
            } else {
                &buf[..t.len]
            };
            moved += 1;
            let n = self.sent;
            self.sent += 1;
            if let Some(tap) = &mut self.tap {
                tap.push((i, packet.to_vec()));
            }
            if self.jumbo && t.referenced > 0 {
                if self.drop.contains(&n) {
                    self.dropped += 1;
                    continue;
                }
                let head: Vec<u8> = [
                    &packet[..t.payload_at],
                    &packet[t.payload_at + t.referenced..],
                ]
                .concat();
                let payload = packet[t.payload_at..t.payload_at + t.referenced].to_vec();
                let ip = t.route().ip(t.len, 0).expect("a route");
                let Some(to) = self.nodes.iter_mut().find(|n| n.gid == t.dgid) else {
                    self.undeliverable += 1;
                    continue;
                };
                let mut lent = lent_in(&mut to.mem, &payload);
                to.engine.handle_lent_packet(
                    self.now,
                    &ip,
                    &head,
                    t.payload_at,
                    t.referenced,
                    &mut lent,
                );
                to.engine.finish_revocations();
                self.delivered += 1;
                continue;
            }
            let mut bytes = Vec::new();
            let ip = t.route().ip(packet.len(), 0);
            ip.and_then(|ip| frame::emit_ip_packet(&ip, t.udp_src_port, packet, &mut bytes))
                .expect("the engine emits valid packets");
            if self.drop.contains(&n) {
                self.dropped += 1;
                continue;
            }
            self.deliver(&bytes);
        }
        moved
    }

    /// Steps until nothing moves (or `max_steps` rounds), then reports
    /// whether a timer is pending.
    pub fn run(&mut self, max_steps: usize) -> Quiet {
        for _ in 0..max_steps {
            if self.step() == 0 {
                return self.next_timer().map_or(Quiet::Idle, Quiet::Timer);
            }
        }
        Quiet::Busy
    }

    /// The earliest pending timer of any node.
    pub fn next_timer(&mut self) -> Option<u64> {
        self.nodes
            .iter_mut()
            .filter_map(|n| n.engine.poll_timeout())
            .min()
    }

    /// Moves time to `t` and runs every node's due timers.
    pub fn advance_to(&mut self, t: u64) {
        self.now = self.now.max(t);
        for n in &mut self.nodes {
            n.engine.handle_timeout(self.now);
        }
    }

    fn deliver(&mut self, ip_packet: &[u8]) {
        let d = match frame::Repr::parse_ip(ip_packet) {
            Ok(d) => d,
            Err(e) => panic!("the engine emitted a packet that does not parse: {e}"),
        };
        let dgid = d.ip.dgid();
        let Some(node) = self.nodes.iter_mut().find(|n| n.gid == dgid) else {
            self.undeliverable += 1;
            return;
        };
        let roce = &ip_packet[d.ip.buffer_len() + udp::HEADER_LEN..];
        node.engine
            .handle_packet(self.now, &d.ip, roce, &mut node.mem);
        self.delivered += 1;
    }
}
