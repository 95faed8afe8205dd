//! A hostile sender on the wire. A raw UDP socket aims malformed,
//! truncated, wrong-QPN, bad-ICRC, bad-rkey and out-of-window-PSN RoCEv2
//! packets at a running device (B) while B and another device (A) exchange
//! RC WRITEs and SENDs. Every datagram is accounted for exactly once —
//! dropped and counted by the fabric ([`UdpStats`]) or the engine
//! ([`Stats`]) under its reason, or answered as IBTA says — the valid
//! traffic completes with the right data, no completion or event appears
//! that should not, and nothing panics.
//!
//! **How the attacker seals a packet** ([`seal`]): as a RoCEv2 sender behind
//! a UDP socket does (the engine's `Transmit::seal_for_socket`): the ICRC
//! covers the IPv4 header the kernel writes — addresses, total length, DF,
//! Identification 0 (TOS, TTL and the header checksum are masked) — and the
//! UDP header with the socket's source port, port 4791 and the length (its
//! checksum masked). The receiver recovers the Identification from the
//! ICRC, so any value would do; `attacker_sealing_matches_the_wire_crate`
//! checks [`seal`] against `vrdma_wire::frame`.
//!
//! Loopback loses nothing, so counts are exact. Both devices progress in
//! the test's thread; attacker datagrams are sent before the loop that
//! waits for what they cause, and every wait has a deadline that only turns
//! a hang into a failure.

mod common;

use std::{
    io::ErrorKind,
    net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket},
    time::{Duration, Instant},
};

use common::{BASE, End, bytes, end, fill, recv, same, send};
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;
use vrdma_engine::{
    CqHandle,
    attr::Mtu,
    event::AsyncEvent,
    qp::{QpCap, QpInitAttr, QpState, QpType},
    stats::Stats,
    wc::{Wc, WcOpcode, WcStatus},
    wr::SendOp,
};
use vrdma_fabric::udp::UdpStats;
use vrdma_testkit::setup::Connection;
use vrdma_wire::{
    Gid, Msn, Opcode, PKey, Psn, QKey, Qpn, ROCEV2_UDP_PORT, Rkey,
    aeth::{self, CreditCode, NakCode, Syndrome},
    bth, deth, frame, icrc, ipv4,
    packet::{self, ExtHeaders},
    reth, udp,
};

const MTU: Mtu = Mtu::Mtu1024;
/// Every QP's first PSN: the PSN space wraps during the test.
const PSN0: u32 = 0x00ff_fff0;
/// Half the PSN space (IBTA's window: behind is a duplicate, ahead is out
/// of sequence).
const HALF: u32 = 1 << 23;
/// A QPN no device has.
const NO_QPN: u32 = 0x00_dead;
/// The QPN the attacker claims when it plays B.q3's peer.
const PEER_QPN: u32 = 0x00_0bad;
const QKEY: QKey = QKey(0x1111_1111);

/// A round of valid traffic: a 20-packet WRITE and a 3-packet SEND.
const WLEN: usize = 20 * 1024;
const SLEN: usize = 3000;
const VALID_PACKETS: u64 = 20 + 3;
/// A's sources; B's WRITE target and receive buffer.
const A_WRITE: u64 = BASE;
const A_SEND: u64 = BASE + 0x8000;
const B_WRITE: u64 = BASE + 0x10_0000;
const B_RECV: u64 = BASE + 0x20_0000;
/// Where the attacker's packets point in B's memory.
const B_ATTACK: u64 = BASE + 0x30_0000;
const ATTACK_LEN: usize = 0x1_0000;

fn v4(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 8, last))
}

/// A QP and its own CQ (send and receive), so that completions are
/// counted per QP.
#[derive(Clone, Copy, Debug)]
struct Q {
    qpn: Qpn,
    cq: CqHandle,
}

fn qp(e: &mut End, ty: QpType) -> Q {
    let engine = e.dev.engine_mut();
    let (cq, _) = engine.create_cq(256, 0).unwrap();
    let (qpn, _) = engine
        .create_qp(QpInitAttr {
            pd: e.pd,
            send_cq: cq,
            recv_cq: cq,
            srq: None,
            cap: QpCap {
                max_send_wr: 64,
                max_recv_wr: 64,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ty,
            sq_sig_all: false,
        })
        .unwrap();
    Q { qpn, cq }
}

/// Brings `q` to RTS, connected to `dest` at `dgid`. No local ACK timeout:
/// loopback loses nothing, and a resend would make B's duplicate count
/// depend on timing.
fn connect(e: &mut End, q: Q, dgid: Gid, dest: Qpn) {
    Connection {
        mtu: MTU,
        psn: Psn::from_masked(PSN0),
        timeout: 0,
        max_rd_atomic: 16,
        max_dest_rd_atomic: 16,
        qkey: QKEY,
        ..Connection::default()
    }
    .join(e.dev.engine_mut(), q.qpn, dgid, dest);
}

// ---------------------------------------------------------------------
// The attacker's packets.

fn bth(opcode: Opcode, dest: Qpn, psn: Psn) -> bth::Repr {
    bth::Repr {
        opcode,
        solicited: false,
        mig_req: false,
        pad_cnt: 0,
        pkey: PKey::DEFAULT,
        fecn: false,
        becn: false,
        dest_qp: dest,
        ack_req: true,
        psn,
    }
}

/// A well-formed packet (ICRC zero until [`seal`]ed).
fn build(opcode: Opcode, dest: Qpn, psn: Psn, ext: ExtHeaders, payload: &[u8]) -> Vec<u8> {
    let r = packet::Repr::new(bth(opcode, dest, psn), ext, payload);
    let mut v = vec![0; r.buffer_len()];
    r.emit(&mut packet::Packet::new_unchecked(&mut v[..]))
        .unwrap();
    v
}

fn write_only(dest: Qpn, psn: Psn, va: u64, rkey: Rkey, payload: &[u8]) -> Vec<u8> {
    let ext = ExtHeaders {
        reth: Some(reth::Repr {
            va,
            rkey,
            dma_len: payload.len() as u32,
        }),
        ..ExtHeaders::default()
    };
    build(Opcode::RcWriteOnly, dest, psn, ext, payload)
}

fn read_request(dest: Qpn, psn: Psn, va: u64, rkey: Rkey, len: u32) -> Vec<u8> {
    let ext = ExtHeaders {
        reth: Some(reth::Repr {
            va,
            rkey,
            dma_len: len,
        }),
        ..ExtHeaders::default()
    };
    build(Opcode::RcReadRequest, dest, psn, ext, &[])
}

fn send_only(dest: Qpn, psn: Psn, payload: &[u8]) -> Vec<u8> {
    build(
        Opcode::RcSendOnly,
        dest,
        psn,
        ExtHeaders::default(),
        payload,
    )
}

/// A packet written byte by byte, whatever its opcode says: a BTH of
/// `opcode` and `flags` (SE, M, PadCnt, TVer) for `dest` / `psn`, then
/// `rest`, then room for the ICRC.
fn raw(opcode: u8, flags: u8, dest: u32, psn: u32, rest: &[u8]) -> Vec<u8> {
    let mut v = vec![opcode, flags, 0xff, 0xff, 0];
    v.extend_from_slice(&dest.to_be_bytes()[1..]);
    v.push(0x80); // AckReq
    v.extend_from_slice(&psn.to_be_bytes()[1..]);
    v.extend_from_slice(rest);
    v.extend_from_slice(&[0; 4]);
    v
}

/// Stores the ICRC of `roce` (BTH through ICRC, at least 16 bytes) as the
/// receiver will compute it for a datagram from `src` to `dst`:4791.
fn seal(roce: &mut [u8], src: SocketAddr, dst: IpAddr) {
    let (IpAddr::V4(s), IpAddr::V4(d)) = (src.ip(), dst) else {
        panic!("IPv4 only");
    };
    let udp_len = udp::HEADER_LEN + roce.len();
    let mut h = [0u8; ipv4::HEADER_LEN + udp::HEADER_LEN];
    ipv4::Repr {
        src: s,
        dst: d,
        tos: 0,
        ident: 0,
        dont_frag: true,
        ttl: 64,
        payload_len: udp_len,
    }
    .emit(&mut h[..ipv4::HEADER_LEN])
    .unwrap();
    let u = &mut h[ipv4::HEADER_LEN..];
    u[0..2].copy_from_slice(&src.port().to_be_bytes());
    u[2..4].copy_from_slice(&ROCEV2_UDP_PORT.to_be_bytes());
    u[4..6].copy_from_slice(&u16::try_from(udp_len).unwrap().to_be_bytes());
    let crc = icrc::compute(&h[..ipv4::HEADER_LEN], &h[ipv4::HEADER_LEN..], roce).unwrap();
    packet::Packet::new_unchecked(roce).set_icrc(crc);
}

/// What a device sent the attacker, its ICRC verified.
#[derive(Debug, Eq, PartialEq)]
struct Reply {
    from: SocketAddr,
    opcode: Opcode,
    dest_qp: Qpn,
    psn: Psn,
    aeth: Option<aeth::Repr>,
    payload: Vec<u8>,
}

// ---------------------------------------------------------------------
// The rig: A and B on loopback, the attacker beside them.

#[derive(Clone, Copy, Debug)]
struct Snap {
    a: Stats,
    b: Stats,
    ub: UdpStats,
}

/// The drop counters: everything but the packet totals.
fn drops(s: Stats) -> Stats {
    Stats {
        rx_packets: 0,
        tx_packets: 0,
        ..s
    }
}

struct Rig {
    a: End,
    b: End,
    attacker: UdpSocket,
    /// B's RoCEv2 port, where the attacker aims.
    victim: SocketAddr,
    /// Pair 1, A.q1 ↔ B.q1: the valid traffic.
    a1: Q,
    b1: Q,
    /// Pair 2, A.q2 ↔ B.q2: the connection a stranger attacks.
    a2: Q,
    b2: Q,
    /// B.q3, connected to the attacker's address (QPN [`PEER_QPN`]).
    b3: Q,
    /// A UD QP of B, and an RC QP of B left in RESET.
    bud: Q,
    breset: Q,
    /// The QPN of a QP B destroyed.
    stale: Qpn,
    /// Completions, per CQ, in arrival order.
    wcs_a: Vec<(CqHandle, Vec<Wc>)>,
    wcs_b: Vec<(CqHandle, Vec<Wc>)>,
    events_a: Vec<AsyncEvent>,
    events_b: Vec<AsyncEvent>,
    /// The valid traffic's expected completions: (wr_id, opcode, length).
    want_a1: Vec<(u64, WcOpcode, u32)>,
    want_b1: Vec<(u64, WcOpcode, u32)>,
    round: u8,
    valid_pending: bool,
}

impl Rig {
    /// A on 127.0.8.`last`, B on `last + 1`, the attacker on `last + 2`.
    fn new(last: u8) -> Rig {
        let mut a = end(v4(last), MTU);
        let mut b = end(v4(last + 1), MTU);
        let attacker_addr = SocketAddr::new(v4(last + 2), ROCEV2_UDP_PORT);
        // Bound to 4791 like a RoCEv2 device: where B answers B.q3's peer.
        let attacker = UdpSocket::bind(attacker_addr).expect("attacker bind");
        attacker.set_nonblocking(true).unwrap();
        let (a1, a2) = (qp(&mut a, QpType::Rc), qp(&mut a, QpType::Rc));
        let (b1, b2, b3) = (
            qp(&mut b, QpType::Rc),
            qp(&mut b, QpType::Rc),
            qp(&mut b, QpType::Rc),
        );
        let bud = qp(&mut b, QpType::Ud);
        let breset = qp(&mut b, QpType::Rc);
        let stale = qp(&mut b, QpType::Rc).qpn;
        b.dev.engine_mut().destroy_qp(stale).unwrap();
        let (ga, gb) = (a.dev.transport().gid(), b.dev.transport().gid());
        connect(&mut a, a1, gb, b1.qpn);
        connect(&mut b, b1, ga, a1.qpn);
        connect(&mut a, a2, gb, b2.qpn);
        connect(&mut b, b2, ga, a2.qpn);
        let gattacker = match attacker_addr.ip() {
            IpAddr::V4(v) => Gid::from(v),
            IpAddr::V6(v) => Gid::from(v),
        };
        connect(&mut b, b3, gattacker, Qpn::from_masked(PEER_QPN));
        connect(&mut b, bud, Gid::default(), Qpn::default());
        // A receive that must survive the stranger's attack on B.q2.
        recv(&mut b, b2.qpn, 77, B_RECV + 0x1_0000, 64);
        // The one event a new device raises.
        for e in [&mut a, &mut b] {
            let engine = e.dev.engine_mut();
            assert_eq!(
                engine.poll_event(),
                Some(AsyncEvent::PortActive { port: 1 })
            );
            assert_eq!(engine.poll_event(), None);
        }
        Rig {
            wcs_a: [a1, a2].iter().map(|q| (q.cq, Vec::new())).collect(),
            wcs_b: [b1, b2, b3, bud, breset]
                .iter()
                .map(|q| (q.cq, Vec::new()))
                .collect(),
            victim: SocketAddr::new(
                b.dev.transport().gid().to_ipv4().unwrap().into(),
                ROCEV2_UDP_PORT,
            ),
            a,
            b,
            attacker,
            a1,
            b1,
            a2,
            b2,
            b3,
            bud,
            breset,
            stale,
            events_a: Vec::new(),
            events_b: Vec::new(),
            want_a1: Vec::new(),
            want_b1: Vec::new(),
            round: 0,
            valid_pending: false,
        }
    }

    fn attacker_addr(&self) -> SocketAddr {
        self.attacker.local_addr().unwrap()
    }

    fn seal(&self, roce: &mut [u8]) {
        seal(roce, self.attacker_addr(), self.victim.ip());
    }

    fn snap(&self) -> Snap {
        Snap {
            a: self.a.dev.engine().stats(),
            b: self.b.dev.engine().stats(),
            ub: self.b.dev.transport().stats(),
        }
    }

    fn epsn(&self, q: Q) -> Psn {
        self.b.dev.engine().qp_psns(q.qpn).unwrap().1
    }

    fn state(e: &End, q: Q) -> QpState {
        e.dev.engine().query_qp(q.qpn).unwrap().0.qp_state
    }

    fn wcs(list: &[(CqHandle, Vec<Wc>)], q: Q) -> &[Wc] {
        &list.iter().find(|(cq, _)| *cq == q.cq).unwrap().1
    }

    /// One round of both devices, collecting completions and events.
    fn step(&mut self) {
        self.a.dev.progress().unwrap();
        self.b.dev.progress().unwrap();
        for (cq, got) in &mut self.wcs_a {
            self.a.dev.engine_mut().poll_cq(*cq, 64, got).unwrap();
        }
        for (cq, got) in &mut self.wcs_b {
            self.b.dev.engine_mut().poll_cq(*cq, 64, got).unwrap();
        }
        while let Some(e) = self.a.dev.engine_mut().poll_event() {
            self.events_a.push(e);
        }
        while let Some(e) = self.b.dev.engine_mut().poll_event() {
            self.events_b.push(e);
        }
    }

    /// Progresses both devices until `done` holds (a few seconds at most).
    fn drive(&mut self, what: &str, done: impl Fn(&Rig) -> bool) {
        let limit = Instant::now() + Duration::from_secs(10);
        loop {
            self.step();
            if done(self) {
                return;
            }
            assert!(
                Instant::now() < limit,
                "{what}: not done in time\nA {:?}\nB {:?}\nA {:?}\nB {:?}",
                self.a.dev.engine().stats(),
                self.b.dev.engine().stats(),
                self.a.dev.transport().stats(),
                self.b.dev.transport().stats()
            );
        }
    }

    /// Sends `datagrams` to B, at most 64 before letting B read them, then
    /// settles the phase that began at `before` ([`Rig::settle`]); their
    /// number.
    fn blast(&mut self, what: &str, before: &Snap, datagrams: &[Vec<u8>]) -> u64 {
        for chunk in datagrams.chunks(64) {
            let at = self.b.dev.transport().stats().rx_datagrams;
            for d in chunk {
                self.attacker.send_to(d, self.victim).unwrap();
            }
            let n = chunk.len() as u64;
            self.drive(what, |r| r.b.dev.transport().stats().rx_datagrams >= at + n);
        }
        let n = datagrams.len() as u64;
        self.settle(what, before, n);
        n
    }

    /// A phase whose datagrams were all dropped unanswered: B's counters
    /// as [`Rig::check_b`] wants them (queues untouched), A's unchanged,
    /// and nothing came back to the attacker.
    fn unanswered(
        &mut self,
        what: &str,
        before: &Snap,
        fabric: (u64, u64),
        want: Stats,
        reached: u64,
    ) {
        self.check_b(what, before, fabric, want, reached, true);
        self.check_a(what, before.a);
        assert_eq!(self.replies(), [], "{what}: B answered the attacker");
    }

    /// What the attacker has received so far.
    fn replies(&mut self) -> Vec<Reply> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 70_000];
        loop {
            match self.attacker.recv_from(&mut buf) {
                Ok((n, from)) => {
                    let info = frame::DatagramInfo {
                        src: from,
                        dst: self.attacker_addr().ip(),
                        traffic_class: 0,
                        hop_limit: 64,
                        flow_label: 0,
                    };
                    let u = frame::unframe_datagram(&info, &buf[..n])
                        .expect("B's reply carries a good ICRC");
                    let r = packet::Repr::parse(&packet::Packet::new_unchecked(u.roce))
                        .expect("B's reply parses");
                    out.push(Reply {
                        from,
                        opcode: r.bth.opcode,
                        dest_qp: r.bth.dest_qp,
                        psn: r.bth.psn,
                        aeth: r.ext.aeth,
                        payload: r.payload.to_vec(),
                    });
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return out,
                Err(e) => panic!("attacker recv: {e}"),
            }
        }
    }

    /// The attacker as B.q3's peer: sends `roce` (sealed here), progresses
    /// until `until` holds, and returns what B answered once `replies`
    /// answers arrived.
    fn exchange(
        &mut self,
        what: &str,
        mut roce: Vec<u8>,
        replies: usize,
        until: impl Fn(&Rig) -> bool,
    ) -> Vec<Reply> {
        self.seal(&mut roce);
        self.attacker.send_to(&roce, self.victim).unwrap();
        self.drive(what, until);
        let limit = Instant::now() + Duration::from_secs(10);
        let mut got = self.replies();
        while got.len() < replies {
            assert!(Instant::now() < limit, "{what}: replies {got:?}");
            self.step();
            got.extend(self.replies());
        }
        got
    }

    /// An ACK (or NAK) from B.q3 to the attacker.
    fn ack(&self, psn: u32, syndrome: Syndrome, msn: u32) -> Reply {
        Reply {
            from: SocketAddr::new(
                self.victim.ip(),
                0xc000 | (self.b3.qpn.value() & 0x3fff) as u16,
            ),
            opcode: Opcode::RcAcknowledge,
            dest_qp: Qpn::from_masked(PEER_QPN),
            psn: Psn::from_masked(psn),
            aeth: Some(aeth::Repr {
                syndrome,
                msn: Msn::from_masked(msn),
            }),
            payload: Vec::new(),
        }
    }

    /// Posts a round of valid traffic on pair 1 (not yet progressed).
    fn post_valid(&mut self) {
        self.round += 1;
        let r = self.round;
        let id = u64::from(r);
        fill(&mut self.a, A_WRITE, WLEN, r);
        fill(
            &mut self.a,
            A_SEND,
            SLEN,
            r.wrapping_mul(37).wrapping_add(5),
        );
        recv(&mut self.b, self.b1.qpn, 100 + id, B_RECV, SLEN as u32);
        let write = SendOp::RdmaWrite {
            remote_addr: B_WRITE,
            rkey: self.b.rkey,
        };
        send(
            &mut self.a,
            self.a1.qpn,
            200 + id,
            write,
            A_WRITE,
            WLEN as u32,
        );
        send(
            &mut self.a,
            self.a1.qpn,
            300 + id,
            SendOp::Send,
            A_SEND,
            SLEN as u32,
        );
        self.want_a1
            .push((200 + id, WcOpcode::RdmaWrite, WLEN as u32));
        self.want_a1.push((300 + id, WcOpcode::Send, SLEN as u32));
        self.want_b1.push((100 + id, WcOpcode::Recv, SLEN as u32));
        self.valid_pending = true;
    }

    fn valid_done(&self) -> bool {
        Self::wcs(&self.wcs_a, self.a1).len() >= self.want_a1.len()
            && Self::wcs(&self.wcs_b, self.b1).len() >= self.want_b1.len()
    }

    /// Pair 1's completions are exactly those expected, all successful,
    /// and the last round's data arrived intact.
    fn check_valid(&self, what: &str) {
        let got = |w: &[Wc]| -> Vec<_> {
            w.iter()
                .map(|w| (w.wr_id, w.status, w.opcode, w.byte_len))
                .collect()
        };
        let want = |v: &[(u64, WcOpcode, u32)]| -> Vec<_> {
            v.iter()
                .map(|&(id, op, len)| (id, WcStatus::Success, op, len))
                .collect()
        };
        assert_eq!(
            got(Self::wcs(&self.wcs_a, self.a1)),
            want(&self.want_a1),
            "{what}: A.q1's completions"
        );
        assert_eq!(
            got(Self::wcs(&self.wcs_b, self.b1)),
            want(&self.want_b1),
            "{what}: B.q1's completions"
        );
        same(
            bytes(&self.b, B_WRITE, WLEN),
            bytes(&self.a, A_WRITE, WLEN),
            &format!("{what}: WRITE"),
        );
        same(
            bytes(&self.b, B_RECV, SLEN),
            bytes(&self.a, A_SEND, SLEN),
            &format!("{what}: SEND"),
        );
    }

    /// Progresses until the valid traffic posted (if any) completed and B
    /// read `hostile` datagrams besides; then checks the valid traffic and
    /// that every datagram B read was counted exactly once: passed to the
    /// engine, or dropped by the fabric for a bad ICRC or as malformed.
    fn settle(&mut self, what: &str, before: &Snap, hostile: u64) {
        let valid = if self.valid_pending { VALID_PACKETS } else { 0 };
        let want_rx = before.ub.rx_datagrams + valid + hostile;
        self.drive(what, |r| {
            r.valid_done() && r.b.dev.transport().stats().rx_datagrams >= want_rx
        });
        if self.valid_pending {
            self.check_valid(what);
            self.valid_pending = false;
        }
        let (ub, eb) = (self.b.dev.transport().stats(), self.b.dev.engine().stats());
        assert_eq!(ub.rx_datagrams, want_rx, "{what}: datagrams B read");
        assert_eq!(
            ub.rx_datagrams - before.ub.rx_datagrams,
            (eb.rx_packets - before.b.rx_packets)
                + (ub.rx_bad_icrc - before.ub.rx_bad_icrc)
                + (ub.rx_malformed - before.ub.rx_malformed),
            "{what}: every datagram counted once\n{ub:?}\n{eb:?}"
        );
        // A saw nothing hostile.
        let ua = self.a.dev.transport().stats();
        assert_eq!((ua.rx_bad_icrc, ua.rx_malformed), (0, 0), "{what}: {ua:?}");
        for s in [ua, ub] {
            assert_eq!((s.tx_failed, s.src_port_fallback), (0, 0), "{what}: {s:?}");
        }
    }

    /// B's counters after a phase: the fabric's drops, the engine's (every
    /// drop counter exactly `want`), and the packets that reached the
    /// engine besides the valid traffic's.
    fn check_b(
        &self,
        what: &str,
        before: &Snap,
        (bad_icrc, malformed): (u64, u64),
        want: Stats,
        reached: u64,
        valid: bool,
    ) {
        let (ub, eb) = (self.b.dev.transport().stats(), self.b.dev.engine().stats());
        assert_eq!(
            (
                ub.rx_bad_icrc - before.ub.rx_bad_icrc,
                ub.rx_malformed - before.ub.rx_malformed
            ),
            (bad_icrc, malformed),
            "{what}: B's fabric drops (bad ICRC, malformed)"
        );
        assert_eq!(drops(eb), drops(want), "{what}: B's engine drops");
        let valid = if valid { VALID_PACKETS } else { 0 };
        assert_eq!(
            eb.rx_packets - before.b.rx_packets,
            valid + reached,
            "{what}: packets that reached B's engine"
        );
    }

    /// A's drop counters are `want`'s.
    fn check_a(&self, what: &str, want: Stats) {
        assert_eq!(
            drops(self.a.dev.engine().stats()),
            drops(want),
            "{what}: A's engine drops"
        );
    }
}

// ---------------------------------------------------------------------
// The phases.

impl Rig {
    fn valid_round(&mut self, what: &str) {
        let before = self.snap();
        self.post_valid();
        self.settle(what, &before, 0);
        self.check_b(what, &before, (0, 0), before.b, 0, true);
        self.check_a(what, before.a);
    }

    /// Random bytes; reserved opcodes; a bad TVer; headers and lengths that
    /// contradict the opcode; datagrams too long for any RoCEv2 packet.
    fn malformed(&mut self) {
        let what = "malformed";
        let before = self.snap();
        self.post_valid();
        let b1 = self.b1.qpn.value();
        let psn = self.epsn(self.b1).value();
        let mut rng = XorShiftRng::seed_from_u64(0x686f_7374_696c_6501);
        let mut d: Vec<Vec<u8>> = Vec::new();
        let (mut bad_icrc, mut udp_malformed) = (0, 0);
        let mut want = before.b;
        let mut reached = 0;
        // Random bytes as they come: shorter than BTH + ICRC is not RoCEv2;
        // anything longer fails the ICRC (recovering a 16-bit
        // Identification lets 2^-16 of random ICRCs through; with this
        // seed none does).
        for _ in 0..64 {
            let len = rng.random_range(0..200usize);
            let v: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            if len < packet::MIN_LEN {
                udp_malformed += 1;
            } else {
                bad_icrc += 1;
            }
            d.push(v);
        }
        // Random bytes with a good ICRC, to a QPN that does not exist: the
        // engine drops what does not parse as malformed, the rest for the
        // QPN. (The wire parser is the oracle for which is which.)
        for _ in 0..64 {
            let len = rng.random_range(packet::MIN_LEN..200);
            let mut v: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            v[5..8].copy_from_slice(&NO_QPN.to_be_bytes()[1..]);
            self.seal(&mut v);
            if packet::Repr::parse(&packet::Packet::new_unchecked(&v[..])).is_ok() {
                want.rx_no_qp += 1;
            } else {
                want.rx_malformed += 1;
            }
            reached += 1;
            d.push(v);
        }
        // Every reserved opcode, sealed, to B.q1 at its expected PSN.
        let mut reserved = 0;
        for op in 0..=255u8 {
            if Opcode::try_from(op).is_err() {
                d.push(raw(op, 0, b1, psn, &[0; 16]));
                reserved += 1;
            }
        }
        assert!(reserved > 150, "{reserved} reserved opcodes");
        // TVer 1.
        d.push(raw(Opcode::RcSendOnly as u8, 0x01, b1, psn, &[0; 16]));
        // Headers and lengths the opcode does not allow.
        let inconsistent = [
            // RDMA WRITE ONLY cut inside its RETH.
            raw(Opcode::RcWriteOnly as u8, 0, b1, psn, &[0; 8]),
            // ACKNOWLEDGE with a payload.
            raw(Opcode::RcAcknowledge as u8, 0, b1, psn, &[0; 12]),
            // SEND ONLY whose PadCnt (3) exceeds its empty payload.
            raw(Opcode::RcSendOnly as u8, 0x30, b1, psn, &[]),
            // SEND ONLY whose payload area is not a multiple of 4.
            raw(Opcode::RcSendOnly as u8, 0, b1, psn, &[0; 5]),
            // RDMA READ request with a payload.
            raw(Opcode::RcReadRequest as u8, 0, b1, psn, &[0; 20]),
            // FETCH_ADD cut inside its AtomicETH.
            raw(Opcode::RcFetchAdd as u8, 0, b1, psn, &[0; 20]),
            // SEND ONLY with more than 4096 bytes of payload.
            raw(Opcode::RcSendOnly as u8, 0, b1, psn, &[0; 4100]),
        ];
        let n_engine = reserved + 1 + inconsistent.len() as u64;
        d.extend(inconsistent);
        for v in &mut d[128..] {
            self.seal(v);
        }
        want.rx_malformed += n_engine;
        reached += n_engine;
        // Longer than any RoCEv2 packet (the fabric's receive buffer).
        for len in [9000, 65_000] {
            d.push((0..len).map(|_| rng.random()).collect());
            udp_malformed += 1;
        }
        self.blast(what, &before, &d);
        self.unanswered(what, &before, (bad_icrc, udp_malformed), want, reached);
    }

    /// A valid RDMA WRITE ONLY cut at every length, as sent (the ICRC is
    /// then the wrong bytes) and sealed again over what is left.
    fn truncated(&mut self) {
        let what = "truncated";
        let before = self.snap();
        self.post_valid();
        let psn = self.epsn(self.b1);
        let p = {
            let mut p = write_only(self.b1.qpn, psn, B_ATTACK, self.b.rkey, &[0xaa; 40]);
            self.seal(&mut p);
            p
        };
        assert_eq!(p.len(), 12 + 16 + 40 + 4);
        let mut d = Vec::new();
        let (mut bad_icrc, mut udp_malformed) = (0, 0);
        for l in 0..p.len() {
            d.push(p[..l].to_vec());
            if l < packet::MIN_LEN {
                udp_malformed += 1;
            } else {
                bad_icrc += 1;
            }
        }
        // Sealed again, to a QPN that does not exist: the BTH and RETH
        // must be whole (28 bytes) and the payload area a multiple of 4;
        // what parses is dropped for its QPN.
        let mut body = p[..p.len() - 4].to_vec();
        body[5..8].copy_from_slice(&NO_QPN.to_be_bytes()[1..]);
        let mut want = before.b;
        let mut reached = 0;
        for l in 0..body.len() {
            let mut v = body[..l].to_vec();
            v.extend_from_slice(&[0; 4]);
            if v.len() < packet::MIN_LEN {
                udp_malformed += 1;
            } else {
                self.seal(&mut v);
                reached += 1;
                if l < 28 || (l - 28) % 4 != 0 {
                    want.rx_malformed += 1;
                } else {
                    want.rx_no_qp += 1;
                }
            }
            d.push(v);
        }
        self.blast(what, &before, &d);
        self.unanswered(what, &before, (bad_icrc, udp_malformed), want, reached);
        assert!(
            bytes(&self.b, B_ATTACK, ATTACK_LEN).iter().all(|&b| b == 0),
            "{what}: B's memory written"
        );
    }

    /// Good ICRCs, packets for QPs that do not exist or cannot take them.
    fn wrong_qpn(&mut self) {
        let what = "wrong QPN";
        let before = self.snap();
        self.post_valid();
        let psn = Psn::from_masked(PSN0);
        let q = Qpn::from_masked;
        let mut d = vec![
            send_only(q(NO_QPN), psn, &[1; 16]),
            send_only(q(0x00ff_ffff), psn, &[1; 16]),
            // QP0 and QP1 (no SMI or GSI on a RoCE device here).
            send_only(q(0), psn, &[1; 16]),
            send_only(q(1), psn, &[1; 16]),
            // A QP B destroyed.
            send_only(self.stale, psn, &[1; 16]),
            // An RC packet for a UD QP.
            send_only(self.bud.qpn, psn, &[1; 16]),
        ];
        let no_qp = d.len() as u64;
        // A UD SEND with the wrong Q_Key.
        let ext = ExtHeaders {
            deth: Some(deth::Repr {
                qkey: QKey(QKEY.0 ^ 1),
                src_qp: q(NO_QPN),
            }),
            ..ExtHeaders::default()
        };
        d.push(build(Opcode::UdSendOnly, self.bud.qpn, psn, ext, &[2; 16]));
        // A SEND for a QP still in RESET.
        d.push(send_only(self.breset.qpn, psn, &[3; 16]));
        for v in &mut d {
            self.seal(v);
        }
        let n = self.blast(what, &before, &d);
        let want = Stats {
            rx_no_qp: before.b.rx_no_qp + no_qp,
            rx_bad_key: before.b.rx_bad_key + 1,
            rx_bad_state: before.b.rx_bad_state + 1,
            ..before.b
        };
        self.unanswered(what, &before, (0, 0), want, n);
    }

    /// A WRITE that B.q1 would execute (its expected PSN, B's rkey), with
    /// one bit flipped, for every bit but those of BTH byte 4 (FECN, BECN
    /// and reserved bits, which the ICRC masks): each is a bad ICRC and
    /// none reaches the engine. Sent while pair 1 is idle, so that the PSN
    /// is current.
    fn bad_icrc(&mut self) {
        let what = "bad ICRC";
        let before = self.snap();
        let psn = self.epsn(self.b1);
        let mut p = write_only(self.b1.qpn, psn, B_ATTACK, self.b.rkey, &[0x5a; 40]);
        self.seal(&mut p);
        let mut d = Vec::new();
        for i in (0..p.len()).filter(|&i| i != bth::ICRC_MASKED_BYTE) {
            for bit in 0..8 {
                let mut v = p.clone();
                v[i] ^= 1 << bit;
                d.push(v);
            }
        }
        let n = self.blast(what, &before, &d);
        self.check_b(what, &before, (n, 0), before.b, 0, false);
        assert_eq!(self.epsn(self.b1), psn, "{what}: B.q1 moved");
        assert!(
            bytes(&self.b, B_ATTACK, ATTACK_LEN).iter().all(|&b| b == 0),
            "{what}: B's memory written"
        );
        // Valid traffic right after.
        self.valid_round("after bad ICRC");
    }

    /// The attacker as B.q3's connected peer: a valid WRITE, PSNs ahead of
    /// the expected one (one PSN sequence error NAK, then silence), PSNs
    /// behind it (duplicates: re-ACKed, not executed), then in order again,
    /// and a READ.
    fn psn_window(&mut self) {
        let what = "PSN window";
        let before = self.snap();
        self.post_valid();
        let b3 = self.b3.qpn;
        let rkey = self.b.rkey;
        let ok = Syndrome::Ack(CreditCode::INVALID);
        let p0 = PSN0;
        let p1 = (p0 + 1) & 0xff_ffff;
        let psn = Psn::from_masked;
        let data1 = [0x11u8; 64];

        // In order: executed and acknowledged (to the attacker).
        let r = self.exchange(
            what,
            write_only(b3, psn(p0), B_ATTACK + 0x1000, rkey, &data1),
            1,
            move |r| r.epsn(r.b3) == psn(p1),
        );
        assert_eq!(r, [self.ack(p0, ok, 1)], "{what}: in order");
        same(bytes(&self.b, B_ATTACK + 0x1000, 64), data1, what);

        // Ahead of the expected PSN, as far as half the PSN space: out of
        // sequence, NAKed once (with the expected PSN), never executed.
        let ahead = [
            write_only(b3, psn(p1 + 1), B_ATTACK + 0x2000, rkey, &[0x22; 64]),
            write_only(b3, psn(p1 + 1000), B_ATTACK + 0x2000, rkey, &[0x22; 64]),
            write_only(b3, psn(p1 + HALF - 1), B_ATTACK + 0x2000, rkey, &[0x22; 64]),
            read_request(b3, psn(p1 + 7), B_ATTACK + 0x1000, rkey, 64),
        ];
        for (i, p) in ahead.into_iter().enumerate() {
            let oos = before.b.rx_out_of_sequence + i as u64 + 1;
            let want = if i == 0 {
                vec![self.ack(p1, Syndrome::Nak(NakCode::PsnSequenceError), 1)]
            } else {
                vec![]
            };
            let r = self.exchange(what, p, want.len(), move |r| {
                r.b.dev.engine().stats().rx_out_of_sequence == oos
            });
            assert_eq!(r, want, "{what}: ahead #{i}");
            assert_eq!(self.epsn(self.b3), psn(p1), "{what}: ahead #{i}");
        }

        // Behind it, as far as half the PSN space: duplicates, ACKed
        // again with the last PSN executed and the current MSN, not
        // executed again. A duplicate READ that matches no responder
        // resource is dropped without an answer.
        let behind = [
            (
                write_only(b3, psn(p0), B_ATTACK + 0x1000, rkey, &[0x33; 64]),
                1,
            ),
            (
                write_only(
                    b3,
                    psn(p1.wrapping_sub(HALF - 1)),
                    B_ATTACK + 0x1000,
                    rkey,
                    &[0x33; 64],
                ),
                1,
            ),
            (read_request(b3, psn(p0), B_ATTACK + 0x1000, rkey, 64), 0),
        ];
        for (i, (p, answers)) in behind.into_iter().enumerate() {
            let dup = before.b.rx_duplicate + i as u64 + 1;
            let r = self.exchange(what, p, answers, move |r| {
                r.b.dev.engine().stats().rx_duplicate == dup
            });
            let want: Vec<_> = (0..answers).map(|_| self.ack(p0, ok, 1)).collect();
            assert_eq!(r, want, "{what}: behind #{i}");
            assert_eq!(self.epsn(self.b3), psn(p1), "{what}: behind #{i}");
        }
        same(
            bytes(&self.b, B_ATTACK + 0x1000, 64),
            data1,
            "duplicates executed",
        );
        assert!(
            bytes(&self.b, B_ATTACK + 0x2000, 64)
                .iter()
                .all(|&b| b == 0),
            "{what}: a PSN ahead was executed"
        );

        // In order again: executed and ACKed; then a READ of what the first
        // WRITE left.
        let data2 = [0x44u8; 64];
        let p2 = (p1 + 1) & 0xff_ffff;
        let r = self.exchange(
            what,
            write_only(b3, psn(p1), B_ATTACK + 0x3000, rkey, &data2),
            1,
            move |r| r.epsn(r.b3) == psn(p2),
        );
        assert_eq!(r, [self.ack(p1, ok, 2)], "{what}: in order again");
        same(bytes(&self.b, B_ATTACK + 0x3000, 64), data2, what);
        let r = self.exchange(
            what,
            read_request(b3, psn(p2), B_ATTACK + 0x1000, rkey, 64),
            1,
            move |r| r.epsn(r.b3) == psn(p2 + 1),
        );
        let response = Reply {
            opcode: Opcode::RcReadResponseOnly,
            payload: data1.to_vec(),
            ..self.ack(p2, ok, 3)
        };
        assert_eq!(r, [response], "{what}: READ");

        self.settle(what, &before, 10);
        let want = Stats {
            rx_out_of_sequence: before.b.rx_out_of_sequence + 4,
            rx_duplicate: before.b.rx_duplicate + 3,
            ..before.b
        };
        self.check_b(what, &before, (0, 0), want, 10, true);
        self.check_a(what, before.a);
        assert_eq!(Self::state(&self.b, self.b3), QpState::Rts);
    }

    /// B.q3's peer (the attacker) WRITEs with a wrong rkey (B's MR index,
    /// another key byte) at the expected PSN: NAK remote access error to
    /// the peer, B.q3 enters ERR with the QP access error event (IBTA Vol1
    /// §9.9.3 class C, §11.6.3.2); what follows is dropped for the state.
    fn bad_rkey_from_the_peer(&mut self) {
        let what = "bad rkey from the peer";
        let before = self.snap();
        self.post_valid();
        let b3 = self.b3;
        let p3 = self.epsn(b3).value();
        let wrong = Rkey(self.b.rkey.0 ^ 0xff);
        let r = self.exchange(
            what,
            write_only(
                b3.qpn,
                Psn::from_masked(p3),
                B_ATTACK + 0x4000,
                wrong,
                &[0x55; 64],
            ),
            1,
            move |r| r.events_b.contains(&AsyncEvent::QpAccessErr { qp: b3.qpn }),
        );
        let nak = self.ack(p3, Syndrome::Nak(NakCode::RemoteAccessError), 3);
        assert_eq!(r, [nak], "{what}");
        assert_eq!(Self::state(&self.b, b3), QpState::Err, "{what}");
        // Then a good WRITE: dropped, B.q3 being in ERR.
        let bad_state = before.b.rx_bad_state + 1;
        let r = self.exchange(
            what,
            write_only(
                b3.qpn,
                Psn::from_masked(p3 + 1),
                B_ATTACK + 0x4000,
                self.b.rkey,
                &[0x55; 64],
            ),
            0,
            move |r| r.b.dev.engine().stats().rx_bad_state == bad_state,
        );
        assert_eq!(r, [], "{what}: answered in ERR");
        self.settle(what, &before, 2);
        let want = Stats {
            rx_bad_state: bad_state,
            ..before.b
        };
        self.check_b(what, &before, (0, 0), want, 2, true);
        self.check_a(what, before.a);
        assert!(
            bytes(&self.b, B_ATTACK + 0x4000, 64)
                .iter()
                .all(|&b| b == 0),
            "{what}: B's memory written"
        );
    }

    /// A stranger (not B.q2's peer) WRITEs to B.q2 at its expected PSN,
    /// once with B's real rkey and once with a wrong one. A connection's
    /// packets must come from its peer to its own address (as rxe's
    /// `check_addr`): both are dropped unanswered as `rx_bad_addr`, so the
    /// stranger neither writes B's memory nor takes B.q2 to ERR, and B.q2
    /// and its real peer carry on.
    fn stranger_on_a_connection(&mut self) {
        let what = "stranger on a connection";
        let before = self.snap();
        self.post_valid();
        let b2 = self.b2;
        let psn = self.epsn(b2);
        let mut d = vec![
            write_only(b2.qpn, psn, B_ATTACK + 0x5000, self.b.rkey, &[0x66; 64]),
            write_only(
                b2.qpn,
                psn,
                B_ATTACK + 0x5000,
                Rkey(self.b.rkey.0 ^ 0xff),
                &[0x66; 64],
            ),
        ];
        for v in &mut d {
            self.seal(v);
        }
        self.blast(what, &before, &d);
        assert_eq!(self.replies(), [], "{what}: the stranger got an answer");
        assert!(
            bytes(&self.b, B_ATTACK + 0x5000, 64)
                .iter()
                .all(|&b| b == 0),
            "{what}: the stranger wrote B's memory"
        );
        assert_eq!(self.epsn(b2), psn, "{what}: B.q2's PSN moved");
        assert_eq!(Self::state(&self.b, b2), QpState::Rts, "{what}");
        self.check_b(
            what,
            &before,
            (0, 0),
            Stats {
                rx_bad_addr: before.b.rx_bad_addr + 2,
                ..before.b
            },
            2,
            true,
        );
        self.check_a(what, before.a);

        // B.q2's real peer still WRITEs through it.
        fill(&mut self.a, A_WRITE, 64, 9);
        let write = SendOp::RdmaWrite {
            remote_addr: B_ATTACK + 0x5100,
            rkey: self.b.rkey,
        };
        send(&mut self.a, self.a2.qpn, 5, write, A_WRITE, 64);
        let a2 = self.a2;
        self.drive(what, move |r| !Rig::wcs(&r.wcs_a, a2).is_empty());
        let wc = &Rig::wcs(&self.wcs_a, a2)[0];
        assert_eq!((wc.wr_id, wc.status), (5, WcStatus::Success), "{what}");
        same(
            bytes(&self.b, B_ATTACK + 0x5100, 64),
            bytes(&self.a, A_WRITE, 64),
            what,
        );
    }
}

#[test]
fn hostile_stream_at_a_running_device() {
    let mut rig = Rig::new(1);
    rig.valid_round("before");
    rig.malformed();
    rig.truncated();
    rig.wrong_qpn();
    rig.bad_icrc();
    rig.psn_window();
    rig.bad_rkey_from_the_peer();
    rig.stranger_on_a_connection();
    rig.valid_round("after");

    // Pair 1 never noticed.
    assert_eq!(Rig::state(&rig.a, rig.a1), QpState::Rts);
    assert_eq!(Rig::state(&rig.b, rig.b1), QpState::Rts);
    // No completion that should not be: pair 1's were checked round by
    // round, A.q2's one WRITE in its phase; B.q2 kept its receive.
    assert_eq!(Rig::wcs(&rig.wcs_a, rig.a2).len(), 1, "A.q2");
    for (side, list, q) in [
        ("B.q2", &rig.wcs_b, rig.b2),
        ("B.q3", &rig.wcs_b, rig.b3),
        ("B's UD QP", &rig.wcs_b, rig.bud),
        ("B's RESET QP", &rig.wcs_b, rig.breset),
    ] {
        assert_eq!(Rig::wcs(list, q), [], "{side}");
    }
    // The only event: the peer's bad rkey took B.q3 to ERR.
    assert_eq!(rig.events_a, []);
    assert_eq!(rig.events_b, [AsyncEvent::QpAccessErr { qp: rig.b3.qpn }]);
    assert_eq!(rig.replies(), [], "late replies to the attacker");
}

#[test]
fn attacker_sealing_matches_the_wire_crate() {
    let src = SocketAddr::new(v4(31), ROCEV2_UDP_PORT);
    let dst = v4(32);
    let payload = [7u8; 37];
    let ext = ExtHeaders {
        reth: Some(reth::Repr {
            va: 0x1234,
            rkey: Rkey(0x0101),
            dma_len: 37,
        }),
        ..ExtHeaders::default()
    };
    let psn = Psn::from_masked(5);
    let mut sealed = build(
        Opcode::RcWriteOnly,
        Qpn::from_masked(17),
        psn,
        ext,
        &payload,
    );
    seal(&mut sealed, src, dst);

    // The same packet framed whole by the wire crate, with the IPv4 header
    // the kernel writes for a DF datagram from an unconnected socket.
    let (IpAddr::V4(s), IpAddr::V4(d)) = (src.ip(), dst) else {
        unreachable!()
    };
    let f = frame::Repr {
        ethernet: None,
        ip: frame::IpRepr::V4(ipv4::Repr {
            src: s,
            dst: d,
            tos: 0,
            ident: 0,
            dont_frag: true,
            ttl: 64,
            payload_len: 0,
        }),
        udp: udp::Repr {
            src_port: src.port(),
            checksum: false,
        },
        roce: packet::Repr::new(
            bth(Opcode::RcWriteOnly, Qpn::from_masked(17), psn),
            ext,
            &payload,
        ),
    };
    let mut whole = vec![0; f.buffer_len()];
    f.emit(&mut whole).unwrap();
    assert_eq!(&whole[28..], &sealed[..]);

    // What the victim's socket path accepts, whatever TOS and TTL the
    // datagram arrived with (both masked).
    let info = frame::DatagramInfo {
        src,
        dst,
        traffic_class: 0x02,
        hop_limit: 17,
        flow_label: 0,
    };
    let u = frame::unframe_datagram(&info, &sealed).unwrap();
    assert_eq!(u.roce, &sealed[..]);
    // One flipped bit is not.
    sealed[30] ^= 4;
    assert!(matches!(
        frame::unframe_datagram(&info, &sealed),
        Err(vrdma_wire::Error::BadIcrc { .. })
    ));
}

/// Random garbage of every length at a device in the middle of a long
/// WRITE and while the attacker also replays sealed fragments of pair 1's
/// own packets: nothing panics and the WRITE lands.
#[test]
fn garbage_during_a_long_write() {
    let mut rig = Rig::new(21);
    let before = rig.snap();
    let len = 1 << 20;
    fill(&mut rig.a, A_WRITE, len, 3);
    let write = SendOp::RdmaWrite {
        remote_addr: B_WRITE,
        rkey: rig.b.rkey,
    };
    send(&mut rig.a, rig.a1.qpn, 1, write, A_WRITE, len as u32);
    let mut rng = XorShiftRng::seed_from_u64(21);
    let mut sent = 0u64;
    let a1 = rig.a1;
    let limit = Instant::now() + Duration::from_secs(20);
    while Rig::wcs(&rig.wcs_a, a1).is_empty() {
        // A few datagrams per round: random bytes, and random bytes with a
        // good ICRC aimed at a QPN that does not exist.
        for _ in 0..4 {
            let n = rng.random_range(0..300usize);
            let mut v: Vec<u8> = (0..n).map(|_| rng.random()).collect();
            if n >= packet::MIN_LEN && rng.random::<bool>() {
                v[5..8].copy_from_slice(&NO_QPN.to_be_bytes()[1..]);
                rig.seal(&mut v);
            }
            rig.attacker.send_to(&v, rig.victim).unwrap();
            sent += 1;
        }
        rig.step();
        assert!(Instant::now() < limit, "the WRITE never completed");
    }
    let wc = &Rig::wcs(&rig.wcs_a, a1)[0];
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::Success));
    same(
        bytes(&rig.b, B_WRITE, len),
        bytes(&rig.a, A_WRITE, len),
        "WRITE",
    );
    // Every datagram B read is accounted for (the engine's share includes
    // the WRITE's 1024 packets).
    let wrote = (len / 1024) as u64;
    rig.settle("garbage", &before, sent + wrote);
    let eb = rig.b.dev.engine().stats();
    assert_eq!(
        drops(eb),
        drops(Stats {
            rx_malformed: eb.rx_malformed,
            rx_no_qp: eb.rx_no_qp,
            ..before.b
        }),
        "only malformed and unknown-QPN drops"
    );
}
