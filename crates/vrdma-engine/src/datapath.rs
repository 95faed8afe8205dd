//! The data path: the requester turns send WQEs into packets, the
//! responder executes incoming packets against receive WQEs and memory,
//! and the completer retires RC WQEs as ACKs arrive.
//!
//! Sans-IO: [`Engine::poll_transmit`] writes the next RoCE packet (BTH
//! through a zeroed ICRC, which the fabric fills in because it covers the
//! IP and UDP headers) into a caller's buffer; [`Engine::handle_packet`]
//! takes a packet whose ICRC the fabric has verified. Memory is reached
//! only through the [`Memory`] trait, after the MR checks.
//!
//! What works: UD SEND (with immediate), UC and RC SEND and RDMA
//! WRITE (with immediate) of any length, segmented to the path MTU; RC ACKs
//! (coalesced, one per message or AckReq), in-order completion on ACK,
//! duplicate detection with re-ACK, one PSN-sequence NAK per gap with
//! go-back-N resend, RNR NAK when no receive is posted, and the remote
//! access / invalid request NAKs that move both sides to ERR; a send window
//! of [`MAX_UNACKED_PSNS`], forward progress (the oldest unacknowledged PSN
//! moving) restarting the retry budgets and the timer, one retry at a time,
//! a timeout's first resent packet sent twice; the local ACK timeout
//! (retry_cnt) and the RNR delay (rnr_retry, 7 = forever, backing off) as
//! deadlines the caller drives with [`Engine::poll_timeout`] and
//! [`Engine::handle_timeout`]; RC RDMA READ and atomics with responder
//! resources, replay of duplicate atomics, max_rd_atomic and FENCE; the
//! local operations LOCAL_INV, BIND_MW and REG_MR (run in queue order,
//! completed in order); SEND with invalidate.

use vrdma_wire::{
    Gid, Opcode, PKey, Psn, Qpn, ServiceType,
    aeth::{self, NakCode, RnrTimer, Syndrome},
    bth,
    frame::IpRepr,
    grh, immdt,
    opcode::{Operation, Position},
    packet, reth,
};

use crate::{
    engine::Engine,
    event::AsyncEvent,
    handle::{CqHandle, PdHandle},
    memory::Memory,
    mr::{Access, AccessError, Keys, Mr},
    qp::{InMsg, QpState, QpType, Resource, RespOut},
    wc::{Wc, WcFlags, WcOpcode, WcStatus},
    wr::{SendOp, Sge},
};

/// Request packets a QP sends in a row while its responses wait.
const REQUESTS_BEFORE_RESPONSE: u32 = 16;

/// The largest RoCE packet the engine emits: BTH, the largest extension
/// headers (RETH + ImmDt, or AtomicETH), 4096 bytes of payload, pad, ICRC.
pub const MAX_PACKET: usize = 12 + 28 + vrdma_wire::MAX_PAYLOAD + 4;

/// RC: the most request PSNs in flight, unacknowledged (rxe's
/// RXE_MAX_UNACKED_PSNS). A loss then costs at most this many resent
/// packets, and a responder's reply queue stays bounded.
pub const MAX_UNACKED_PSNS: u32 = 128;

/// RC, rnr_retry 7 (retry forever): RNR NAKs in a row answered with the
/// advertised wait before the requester starts backing off.
pub const RNR_BACKOFF_AFTER: u32 = 8;

/// RC, rnr_retry 7: the longest back-off wait, ns (unless the responder
/// advertises a longer one).
pub const RNR_BACKOFF_CAP: u64 = 32_000_000;

/// RC: inside a long message every this many packets asks for an ACK, so
/// that the window keeps moving and the retransmit timer, which restarts
/// on progress, does not expire while a long message is still streaming
/// (rxe asks every 64 packets; a 64-packet burst at 25 Gb/s outlasts a
/// 16 µs timeout).
pub const PACKETS_PER_ACK_REQ: u64 = 16;

/// Where a packet from [`Engine::poll_transmit`] goes.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Transmit {
    /// Bytes written to the buffer (BTH through ICRC).
    pub len: usize,
    pub sgid: Gid,
    pub dgid: Gid,
    /// UDP source port: per QP, for ECMP entropy (0xC000 and up, as rxe).
    pub udp_src_port: u16,
    pub traffic_class: u8,
    pub hop_limit: u8,
    pub flow_label: u32,
    /// Where in the packet the payload lent by reference goes
    /// ([`Engine::poll_transmit_gather`]): the buffer holds the packet's
    /// bytes before it (the headers) and, from this offset on, the bytes
    /// after it (pad and ICRC field); `len` counts them all.
    pub payload_at: usize,
    /// Payload bytes lent by reference ([`Engine::gathered`]), not in the
    /// buffer; 0 when the buffer holds the whole packet.
    pub referenced: usize,
}

/// A piece of a packet's payload that stays in memory (a gather send):
/// `len` bytes at device address `addr`, which the engine checked against
/// the WR's SGEs, their MRs' keys, PD, rights and bounds.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct PayloadRef {
    pub addr: u64,
    pub len: usize,
}

impl Transmit {
    /// Frames the RoCE packet `roce` (this transmit's bytes) into an IP
    /// packet in `out` — IPv4 for IPv4-mapped GIDs, else IPv6 — with
    /// lengths, checksums and the ICRC: what a fabric that writes whole IP
    /// packets (a TAP device, the simulators) puts on its wire.
    pub fn frame_ip(&self, roce: &[u8], out: &mut Vec<u8>) -> Result<(), vrdma_wire::Error> {
        // The engine's packet is already laid out: the headers go in
        // front of it and the ICRC over the whole, with no second parse
        // or emit of the RoCE part (this runs for every packet a fabric
        // sends).
        let ip = self.ip_repr(roce.len(), 0)?;
        let udp_at = ip.buffer_len();
        let roce_at = udp_at + vrdma_wire::udp::HEADER_LEN;
        out.clear();
        out.resize(roce_at, 0);
        out.extend_from_slice(roce);
        ip.emit(&mut out[..udp_at])?;
        // RoCEv2 sends no UDP checksum (the ICRC covers the packet).
        vrdma_wire::udp::Repr {
            src_port: self.udp_src_port,
            checksum: false,
        }
        .emit(&mut out[udp_at..], ip.pseudo_header())?;
        let (headers, roce) = out.split_at_mut(roce_at);
        let crc = vrdma_wire::icrc::compute(&headers[..udp_at], &headers[udp_at..], roce)?;
        packet::Packet::new_unchecked(roce).set_icrc(crc);
        Ok(())
    }
}

impl Transmit {
    /// The IP header of this packet: IPv4 for IPv4-mapped GIDs (DF,
    /// Identification 0 — what Linux writes for DF datagrams from an
    /// unconnected UDP socket), else IPv6.
    fn ip_repr(&self, roce_len: usize, ident: u16) -> Result<IpRepr, vrdma_wire::Error> {
        if roce_len < packet::MIN_LEN {
            return Err(vrdma_wire::Error::Truncated {
                header: vrdma_wire::Header::Bth,
                needed: packet::MIN_LEN,
                available: roce_len,
            });
        }
        let payload_len = vrdma_wire::udp::HEADER_LEN + roce_len;
        Ok(match (self.sgid.to_ipv4(), self.dgid.to_ipv4()) {
            (Some(src), Some(dst)) => IpRepr::V4(vrdma_wire::ipv4::Repr {
                src,
                dst,
                tos: self.traffic_class,
                ident,
                dont_frag: true,
                ttl: self.hop_limit,
                payload_len,
            }),
            _ => IpRepr::V6(vrdma_wire::ipv6::Repr {
                src: self.sgid.into(),
                dst: self.dgid.into(),
                traffic_class: self.traffic_class,
                flow_label: self.flow_label,
                hop_limit: self.hop_limit,
                payload_len,
            }),
        })
    }

    /// Computes and stores the ICRC of `roce` (this transmit's bytes) for
    /// a fabric that sends the packet as the payload of a UDP socket bound
    /// to `src_port`: the ICRC covers the IP and UDP headers the kernel
    /// will write, which are predictable for an unconnected socket that
    /// sets DF (IPv4 Identification 0; TOS, TTL and the checksums are
    /// masked).
    pub fn seal_for_socket(&self, roce: &mut [u8], src_port: u16) -> Result<(), vrdma_wire::Error> {
        self.seal_for_socket_segment(roce, src_port, 0)
    }

    /// [`Transmit::seal_for_socket`] for segment `index` of a UDP GSO
    /// datagram: the kernel gives the segments consecutive IPv4
    /// Identifications from the datagram's (0), so segment `index` carries
    /// `index` (IPv6 has no Identification).
    pub fn seal_for_socket_segment(
        &self,
        roce: &mut [u8],
        src_port: u16,
        index: u16,
    ) -> Result<(), vrdma_wire::Error> {
        let needed = vrdma_wire::bth::HEADER_LEN + packet::ICRC_LEN;
        if roce.len() < needed {
            return Err(vrdma_wire::Error::Truncated {
                header: vrdma_wire::Header::Bth,
                needed,
                available: roce.len(),
            });
        }
        let (head, tail) = roce.split_at_mut(roce.len() - packet::ICRC_LEN);
        self.seal_parts(head, &[], tail, src_port, index)
    }

    /// [`Transmit::seal_for_socket_segment`] for a packet whose payload
    /// was lent ([`Engine::poll_transmit_gather`]): `head` is the buffer's
    /// bytes before [`Transmit::payload_at`], `payload` the lent bytes (in
    /// [`Engine::gathered`]'s order), `tail` the buffer's bytes after them,
    /// ending with the ICRC field this fills.
    pub fn seal_parts(
        &self,
        head: &[u8],
        payload: &[&[u8]],
        tail: &mut [u8],
        src_port: u16,
        index: u16,
    ) -> Result<(), vrdma_wire::Error> {
        let roce_len = head.len() + payload.iter().map(|p| p.len()).sum::<usize>() + tail.len();
        let ip = self.ip_repr(roce_len, index)?;
        let mut headers = [0u8; vrdma_wire::ipv6::HEADER_LEN + vrdma_wire::udp::HEADER_LEN];
        let (ip_header, udp) = headers.split_at_mut(ip.buffer_len());
        ip.emit(ip_header)?;
        let udp = &mut udp[..vrdma_wire::udp::HEADER_LEN];
        let len = vrdma_wire::udp::HEADER_LEN + roce_len;
        let udp_len = u16::try_from(len).map_err(|_| vrdma_wire::Error::OutOfRange {
            what: "a UDP length",
            value: len as u64,
        })?;
        udp[0..2].copy_from_slice(&src_port.to_be_bytes());
        udp[2..4].copy_from_slice(&vrdma_wire::ROCEV2_UDP_PORT.to_be_bytes());
        udp[4..6].copy_from_slice(&udp_len.to_be_bytes());
        let crc = vrdma_wire::icrc::compute_parts(ip_header, udp, head, payload, tail)?;
        let at = tail.len() - packet::ICRC_LEN;
        tail[at..].copy_from_slice(&crc.to_le_bytes());
        Ok(())
    }
}

/// Counters of what the data path dropped, by reason.
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub struct Stats {
    pub rx_packets: u64,
    pub tx_packets: u64,
    /// Malformed after the ICRC (bad opcode sequence, bad lengths…).
    pub rx_malformed: u64,
    /// For a QPN that does not exist, or a QP of another type.
    pub rx_no_qp: u64,
    /// The QP's state does not accept packets.
    pub rx_bad_state: u64,
    /// RC/UC packets from an address other than the QP's peer, or to an
    /// address other than the QP's own (as rxe's `check_addr`): dropped
    /// unanswered, so a stranger who guesses a QPN and PSN can neither
    /// execute requests nor break the connection.
    pub rx_bad_addr: u64,
    /// P_Key or Q_Key mismatch.
    pub rx_bad_key: u64,
    /// UD or UC message with no receive WQE posted.
    pub rx_no_recv: u64,
    /// Duplicates (RC: answered again; UC: dropped).
    pub rx_duplicate: u64,
    /// Out of sequence (RC: NAKed; UC: dropped).
    pub rx_out_of_sequence: u64,
    /// UD and UC messages longer than the receive buffer (dropped; the
    /// receive is kept).
    pub rx_too_long: u64,
    /// RC request packets sent again (go-back-N after a loss).
    pub tx_retransmitted: u64,
    /// RC retries started by the local ACK timeout.
    pub retry_timeout: u64,
    /// RC retries started by a PSN sequence error NAK.
    pub retry_seq_nak: u64,
    /// RC retries started by an implied NAK (a later PSN answered while a
    /// READ or atomic response is missing).
    pub retry_implied_nak: u64,
    /// RC RNR NAKs received (each waits out its delay, then resends).
    pub rnr_naks: u64,
}

impl Stats {
    /// Every counter with its name, in declaration order (for `vrdma
    /// stat` and logs). Destructured so that a new counter cannot be
    /// left out.
    pub fn fields(&self) -> [(&'static str, u64); 16] {
        let Stats {
            rx_packets,
            tx_packets,
            rx_malformed,
            rx_no_qp,
            rx_bad_state,
            rx_bad_addr,
            rx_bad_key,
            rx_no_recv,
            rx_duplicate,
            rx_out_of_sequence,
            rx_too_long,
            tx_retransmitted,
            retry_timeout,
            retry_seq_nak,
            retry_implied_nak,
            rnr_naks,
        } = *self;
        [
            ("rx_packets", rx_packets),
            ("tx_packets", tx_packets),
            ("rx_malformed", rx_malformed),
            ("rx_no_qp", rx_no_qp),
            ("rx_bad_state", rx_bad_state),
            ("rx_bad_addr", rx_bad_addr),
            ("rx_bad_key", rx_bad_key),
            ("rx_no_recv", rx_no_recv),
            ("rx_duplicate", rx_duplicate),
            ("rx_out_of_sequence", rx_out_of_sequence),
            ("rx_too_long", rx_too_long),
            ("tx_retransmitted", tx_retransmitted),
            ("retry_timeout", retry_timeout),
            ("retry_seq_nak", retry_seq_nak),
            ("retry_implied_nak", retry_implied_nak),
            ("rnr_naks", rnr_naks),
        ]
    }
}

impl Engine {
    /// Data-path counters.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// A QP's sequence state, for diagnostics: the PSN its requester sends
    /// next and the PSN its responder expects.
    pub fn qp_psns(&self, qpn: Qpn) -> Option<(Psn, Psn)> {
        let q = self.qps.get(qpn.value())?;
        Some((q.req.psn, q.resp.epsn))
    }

    pub(crate) fn schedule(&mut self, qpn: Qpn) {
        if let Some(q) = self.qps.get_mut(qpn.value())
            && !q.scheduled
        {
            q.scheduled = true;
            self.tx_ready.push_back(qpn);
        }
    }

    /// [`Engine::poll_transmit`] for a fabric that sends a packet from
    /// pieces (a gather send): where the payload of a SEND, a WRITE or a
    /// READ response can be read in place ([`Memory::slice`]), it is not copied into `buf` but
    /// lent — [`Engine::gathered`] lists its pieces, and the [`Transmit`]
    /// says where they go ([`Transmit::payload_at`],
    /// [`Transmit::referenced`]). The pieces must be read before the
    /// memory changes (the caller sends them before it lets the
    /// application touch the memory again); they are valid until the next
    /// poll.
    pub fn poll_transmit_gather(
        &mut self,
        now: u64,
        mem: &impl Memory,
        buf: &mut [u8],
    ) -> Option<Transmit> {
        self.lent.clear();
        self.lend = true;
        let t = self.poll_transmit(now, mem, buf);
        self.lend = false;
        t
    }

    /// The payload pieces of the packet the last
    /// [`Engine::poll_transmit_gather`] lent, in order.
    pub fn gathered(&self) -> &[PayloadRef] {
        &self.lent
    }

    /// Writes the next packet to send into `buf` (at least [`MAX_PACKET`]
    /// bytes) and says where it goes; `None` when nothing is waiting.
    /// `now` is the caller's clock in nanoseconds (never going back).
    pub fn poll_transmit(
        &mut self,
        now: u64,
        mem: &impl Memory,
        buf: &mut [u8],
    ) -> Option<Transmit> {
        self.now = self.now.max(now);
        while let Some(qpn) = self.tx_ready.pop_front() {
            if let Some(q) = self.qps.get_mut(qpn.value()) {
                q.scheduled = false;
            }
            // A QP that produced nothing is not put back: what unblocks it
            // (an ACK, a post, a timer) schedules it again. So this loop
            // ends.
            if let Some(t) = self.next_packet(qpn, mem, buf) {
                if self.has_tx_work(qpn) {
                    self.schedule(qpn);
                }
                self.stats.tx_packets += 1;
                return Some(t);
            }
        }
        None
    }

    fn has_tx_work(&self, qpn: Qpn) -> bool {
        let Some(q) = self.qps.get(qpn.value()) else {
            return false;
        };
        !q.resp.out.is_empty() || self.can_send_request(q)
    }

    /// The requester may send its next WQE: RTS, not waiting out an RNR
    /// delay, and neither max_rd_atomic nor a fence holds it back (IBTA
    /// Vol1 §10.8.3.3: a fenced WR waits for earlier READs and atomics).
    fn can_send_request(&self, q: &crate::qp::Qp) -> bool {
        // SQD: what was started before the drain point may still be sent
        // (finishing a message, or resending after a loss), nothing new.
        let state_ok = match q.attr.qp_state {
            QpState::Rts => true,
            QpState::Sqd => q.req.cursor < q.req.started,
            _ => false,
        };
        if !state_ok || q.req.rnr_until.is_some_and(|t| t > self.now) {
            return false;
        }
        let Some(next) = q.sq.get(q.req.cursor) else {
            return false;
        };
        if q.init.qp_type == QpType::Rc
            && q.req.unacked.forward_distance(q.req.psn) >= MAX_UNACKED_PSNS
        {
            // The send window is full: wait for an ACK (which schedules
            // the QP again) or the retransmit timer.
            return false;
        }
        if q.req.offset > 0 {
            return true;
        }
        let is_rd = next.op.is_some_and(is_read_or_atomic);
        let fenced = next.flags.contains(crate::wr::SendFlags::FENCE);
        if !is_rd && !fenced {
            // The common case needs no count of what is outstanding.
            return true;
        }
        // Count the READs and atomics sent and not yet completed, up to
        // the limit: a fence needs none, a READ or atomic fewer than
        // max_rd_atomic.
        let limit = if fenced {
            1
        } else {
            usize::from(q.attr.max_rd_atomic.max(1))
        };
        let reads = (0..q.req.cursor)
            .filter_map(|i| q.sq.get(i))
            .filter(|w| w.op.is_some_and(is_read_or_atomic))
            .take(limit)
            .count();
        reads < limit
    }

    /// The earliest time [`Engine::handle_timeout`] has work: a retransmit
    /// timeout or the end of an RNR delay.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.qps
            .iter()
            .flat_map(|(_, q)| [q.req.timer, q.req.rnr_until])
            .flatten()
            .min()
    }

    /// Runs the timers due at `now`: RNR delays end (the request is sent
    /// again); an unacknowledged request times out (IBTA Vol1 §9.7.6.1:
    /// resend from the oldest unacknowledged packet, up to retry_cnt
    /// times, then RETRY_EXC_ERR).
    pub fn handle_timeout(&mut self, now: u64) {
        self.now = self.now.max(now);
        let now = self.now;
        // A buffer kept across calls: no allocation per timer.
        let mut due = std::mem::take(&mut self.due);
        due.clear();
        due.extend(self.qps.iter().filter_map(|(h, q)| {
            let rnr = q.req.rnr_until.is_some_and(|t| t <= now);
            let rto = q.req.timer.is_some_and(|t| t <= now);
            (rnr || rto).then(|| Qpn::try_from(h).ok().map(|n| (n, rnr, rto)))?
        }));
        for &(qpn, rnr, rto) in &due {
            if rnr {
                if let Some(q) = self.qps.get_mut(qpn.value()) {
                    q.req.rnr_until = None;
                }
                self.schedule(qpn);
            }
            if rto {
                self.retransmit_timeout(qpn);
            }
        }
        self.due = due;
    }

    fn retransmit_timeout(&mut self, qpn: Qpn) {
        let Some(q) = self.qps.get_mut(qpn.value()) else {
            return;
        };
        q.req.timer = None;
        let sent = q.req.unacked != q.req.high;
        if !sent || !matches!(q.attr.qp_state, QpState::Rts | QpState::Sqd) {
            return;
        }
        if q.req.retry_left == 0 {
            self.complete_front_with_error(qpn, WcStatus::RetryExcErr);
            return;
        }
        q.req.retry_left -= 1;
        // NAKs of packets sent before the timeout start no second retry.
        q.req.retrying = true;
        self.stats.retry_timeout += 1;
        // Go back to the oldest unacknowledged packet (inside the oldest
        // WQE when part of it was acknowledged), and send that packet
        // twice. After a timeout nothing but the next timeout can tell
        // that this resend was lost too (the responder NAKs a gap only
        // once, IBTA Vol1 §9.7.5.2.2), so each attempt is what retry_cnt
        // counts; two copies make an attempt fail with about p² instead
        // of p at loss rate p (and for a READ, the responder restarting
        // its response on the copy likewise doubles the first response).
        // Responders answer the copy as the duplicate it is.
        let unacked = q.req.unacked;
        q.req.send_twice = Some(unacked);
        let _ = self.seek(qpn, unacked);
        self.restart_timer(qpn);
    }

    /// Starts the retransmit timer afresh while requests are outstanding.
    fn restart_timer(&mut self, qpn: Qpn) {
        let due = self.ack_timeout(qpn).map(|d| self.now.saturating_add(d));
        if let Some(q) = self.qps.get_mut(qpn.value()) {
            let outstanding = q.req.unacked != q.req.high;
            q.req.timer = if outstanding { due } else { None };
        }
    }

    /// Everything before `next` is acknowledged. When that moves the
    /// oldest unacknowledged PSN forward, the peer made progress: the
    /// retry budgets and the timer start again (IBTA Vol1 §9.7.6.1.3, as
    /// rxe), and the send window may have opened.
    fn acknowledged_before(&mut self, qpn: Qpn, next: Psn) {
        let Some(q) = self.qps.get_mut(qpn.value()) else {
            return;
        };
        // Only forward, and never past what was sent.
        let sent = q.req.unacked.forward_distance(q.req.high);
        let d = q.req.unacked.forward_distance(next);
        if d == 0 || d > sent {
            return;
        }
        q.req.unacked = next;
        q.req.retry_left = q.attr.retry_cnt;
        q.req.rnr_left = q.attr.rnr_retry;
        q.req.rnr_streak = 0;
        q.req.retrying = false;
        if q.req.psn.precedes(next) {
            // A resend (after a timeout or NAK) was overtaken by an ACK for
            // packets sent before it: those arrived, so the resend skips
            // ahead to what is still unacknowledged.
            if self.seek(qpn, next) {
                // Local operations the cursor passed have run: they
                // complete once at the front.
                self.retire_executed(qpn);
            }
        }
        self.restart_timer(qpn);
        self.schedule(qpn);
    }

    /// The local ACK timeout of a QP: 4.096 µs × 2^timeout, or none for 0.
    fn ack_timeout(&self, qpn: Qpn) -> Option<u64> {
        let t = self.qps.get(qpn.value())?.attr.timeout;
        (t != 0).then(|| 4096u64 << t.min(31))
    }

    /// A QP's next packet. Requests go before a waiting plain ACK — a
    /// reply the application posted on seeing a message leaves ahead of
    /// that message's ACK, which its peer needs less urgently — but at
    /// most [`REQUESTS_BEFORE_RESPONSE`] in a row, so that a long message
    /// never holds back the answers to its peer's. Every other response
    /// goes first: a NAK (a class B–D NAK also ends the QP: nothing more
    /// may leave before it) and READ responses and atomic
    /// acknowledgements, which the peer's requester is waiting on.
    fn next_packet(&mut self, qpn: Qpn, mem: &impl Memory, buf: &mut [u8]) -> Option<Transmit> {
        let q = self.qps.get(qpn.value())?;
        let waiting = !q.resp.out.is_empty();
        let plain_ack = matches!(
            q.resp.out.front(),
            None | Some(RespOut::Ack {
                syndrome: Syndrome::Ack(_),
                ..
            })
        );
        if plain_ack
            && (!waiting || q.requests_in_a_row < REQUESTS_BEFORE_RESPONSE)
            && let Some(t) = self.emit_request(qpn, mem, buf)
        {
            if let Some(q) = self.qps.get_mut(qpn.value()) {
                q.requests_in_a_row = if waiting { q.requests_in_a_row + 1 } else { 0 };
            }
            return Some(t);
        }
        if let Some(t) = self.emit_response(qpn, mem, buf) {
            if let Some(q) = self.qps.get_mut(qpn.value()) {
                q.requests_in_a_row = 0;
            }
            return Some(t);
        }
        self.emit_request(qpn, mem, buf)
    }

    /// Where `qpn`'s packets go: the UD WR's address vector, else the
    /// QP's own.
    fn path(&self, qpn: Qpn, ud: Option<crate::qp::AhAttr>) -> Option<Transmit> {
        if ud.is_none() {
            return self.qps.get(qpn.value())?.path;
        }
        self.path_of(qpn, ud)
    }

    /// [`Self::path`] computed afresh.
    pub(crate) fn path_of(&self, qpn: Qpn, ud: Option<crate::qp::AhAttr>) -> Option<Transmit> {
        let q = self.qps.get(qpn.value())?;
        let av = ud.unwrap_or(q.attr.ah_attr);
        Some(Transmit {
            len: 0,
            sgid: self.port.gid(av.sgid_index)?.gid,
            dgid: av.dgid,
            udp_src_port: 0xc000 | (qpn.value() & 0x3fff) as u16,
            traffic_class: av.traffic_class,
            hop_limit: if av.hop_limit == 0 { 64 } else { av.hop_limit },
            flow_label: av.flow_label,
            payload_at: 0,
            referenced: 0,
        })
    }

    fn pkey_of(&self, index: u16) -> PKey {
        self.port.pkey(index).unwrap_or(PKey::DEFAULT)
    }

    /// The responder's next packet: an ACK/NAK, a READ response or an
    /// atomic acknowledgement, in the order the requests came.
    fn emit_response(&mut self, qpn: Qpn, mem: &impl Memory, buf: &mut [u8]) -> Option<Transmit> {
        let q = self.qps.get_mut(qpn.value())?;
        if !matches!(q.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
            q.resp.out.clear();
            return None;
        }
        let item = q.resp.out.pop_front()?;
        let msn = q.resp.msn;
        let dest = q.attr.dest_qp_num;
        let pkey = self.port.pkey(q.attr.pkey_index).unwrap_or(PKey::DEFAULT);
        let pd = q.init.pd;
        let mtu = u64::from(q.attr.path_mtu.bytes());
        // A READ response's payload lent by a gather poll.
        let (mut payload_at, mut referenced) = (0, 0);
        let bth = |opcode, psn| bth::Repr {
            opcode,
            solicited: false,
            mig_req: false,
            pad_cnt: 0,
            pkey,
            fecn: false,
            becn: false,
            dest_qp: dest,
            ack_req: false,
            psn,
        };
        let ack = |syndrome| aeth::Repr { syndrome, msn };
        let ok = Syndrome::Ack(aeth::CreditCode::INVALID);
        let len = match item {
            RespOut::Ack { psn, syndrome } => {
                let ext = packet::ExtHeaders {
                    aeth: Some(ack(syndrome)),
                    ..Default::default()
                };
                let n = emit(buf, bth(Opcode::RcAcknowledge, psn), ext);
                if let Syndrome::Nak(code) = syndrome
                    && code != NakCode::PsnSequenceError
                {
                    // Class B–D errors (IBTA Vol1 §9.9.3): the responder
                    // enters ERR once its NAK is out, and says why in an
                    // affiliated asynchronous event (IBTA Vol1 §11.6.3.2),
                    // since no completion reports it.
                    let len = n?;
                    let t = self.path(qpn, None).map(|t| Transmit { len, ..t });
                    let event = match code {
                        NakCode::RemoteAccessError => AsyncEvent::QpAccessErr { qp: qpn },
                        NakCode::RemoteOperationalError => AsyncEvent::QpFatal { qp: qpn },
                        _ => AsyncEvent::QpReqErr { qp: qpn },
                    };
                    // Affiliated errors are for what no completion reports
                    // (IBTA Vol1 §11.6.3.2); a receive completed in error
                    // already said it.
                    let reported = self
                        .qps
                        .get(qpn.value())
                        .is_some_and(|q| q.resp.failure_reported);
                    if !reported {
                        self.events.push_back(event);
                    }
                    self.flush_errored(qpn, true);
                    return t;
                }
                n?
            }
            RespOut::Atomic { psn, orig } => {
                let ext = packet::ExtHeaders {
                    aeth: Some(ack(ok)),
                    atomic_ack_eth: Some(vrdma_wire::atomic::ack::Repr { orig }),
                    ..Default::default()
                };
                emit(buf, bth(Opcode::RcAtomicAcknowledge, psn), ext)?
            }
            RespOut::Read {
                rkey,
                va,
                len,
                psn,
                sent,
            } => {
                let n = (len - sent).min(mtu);
                let first = sent == 0;
                let last = sent + n >= len;
                let (opcode, with_aeth) = match (first, last) {
                    (true, true) => (Opcode::RcReadResponseOnly, true),
                    (true, false) => (Opcode::RcReadResponseFirst, true),
                    (false, true) => (Opcode::RcReadResponseLast, true),
                    (false, false) => (Opcode::RcReadResponseMiddle, false),
                };
                let ppsn = psn.wrapping_add((sent / mtu.max(1)) as u32);
                let ext = packet::ExtHeaders {
                    aeth: with_aeth.then(|| ack(ok)),
                    ..Default::default()
                };
                // n <= mtu <= 4096.
                let n_bytes = n as usize;
                let out = buf.get_mut(..packet::packet_len(opcode, n_bytes))?;
                let at = packet::emit_headers(out, &bth(opcode, ppsn), &ext, n_bytes).ok()?;
                // The MR is checked again: it may have been deregistered
                // since the request was accepted. The data is read straight
                // into the packet.
                let read = if n == 0 {
                    // A zero-length READ touches no memory and needs no key
                    // (IBTA Vol1 §9.4.3).
                    Ok(())
                } else {
                    let lent = &mut self.lent;
                    let lend = self.lend;
                    self.keys
                        .check_remote(rkey, pd, va + sent, n, Access::REMOTE_READ, qpn)
                        .and_then(|mr| {
                            // Lent where the memory lends it (a gather
                            // poll), else copied.
                            lent.clear();
                            if lend && lend_range(mr, mem, va + sent, n, lent)? {
                                (payload_at, referenced) = (at, n_bytes);
                                Ok(())
                            } else {
                                mr.read(mem, va + sent, &mut out[at..at + n_bytes])
                            }
                        })
                };
                if read.is_err() {
                    if let Some(q) = self.qps.get_mut(qpn.value()) {
                        q.resp.out.push_front(RespOut::Ack {
                            psn: ppsn,
                            syndrome: Syndrome::Nak(NakCode::RemoteAccessError),
                        });
                    }
                    return self.emit_response(qpn, mem, buf);
                }
                let written = out.len();
                if !last && let Some(q) = self.qps.get_mut(qpn.value()) {
                    q.resp.out.push_front(RespOut::Read {
                        rkey,
                        va,
                        len,
                        psn,
                        sent: sent + n,
                    });
                }
                written
            }
        };
        self.path(qpn, None).map(|t| Transmit {
            len,
            payload_at,
            referenced,
            ..t
        })
    }

    /// The next request packet of the WQE at the requester's cursor.
    fn emit_request(&mut self, qpn: Qpn, mem: &impl Memory, buf: &mut [u8]) -> Option<Transmit> {
        self.run_local_ops(qpn);
        let q = self.qps.get(qpn.value())?;
        if !self.can_send_request(q) {
            return None;
        }
        let cursor = q.req.cursor;
        let w = q.sq.get(cursor)?;
        let op = w.op?;
        let ty = q.init.qp_type;
        let pd = q.init.pd;
        let mtu = u64::from(q.attr.path_mtu.bytes());
        let offset = q.req.offset;
        if ty == QpType::Rc && is_read_or_atomic(op) {
            return self.emit_read_or_atomic(qpn, cursor, op, offset, buf);
        }
        let n = (w.length - offset).min(mtu);
        let first = offset == 0;
        let last = offset + n >= w.length;
        let position = match (first, last) {
            (true, true) => Position::Only,
            (true, false) => Position::First,
            (false, true) => Position::Last,
            (false, false) => Position::Middle,
        };
        let qkey_of_qp = q.attr.qkey;
        let (opcode, ext, dest_qp, ah) = match (ty, op) {
            (QpType::Ud, SendOp::Send | SendOp::SendWithImm { .. }) => {
                let ud = w.ud?;
                // IBTA Vol1 §10.2.5: a WR Q_Key with the high bit set means
                // "use the QP's own Q_Key".
                let qkey = if ud.remote_qkey.is_controlled() {
                    qkey_of_qp
                } else {
                    ud.remote_qkey
                };
                let (opcode, imm) = match op {
                    SendOp::SendWithImm { imm } => (Opcode::UdSendOnlyImm, Some(imm)),
                    _ => (Opcode::UdSendOnly, None),
                };
                let ext = packet::ExtHeaders {
                    deth: Some(vrdma_wire::deth::Repr { qkey, src_qp: qpn }),
                    immdt: imm.map(|imm| immdt::Repr { imm }),
                    ..Default::default()
                };
                (opcode, ext, ud.remote_qpn, w.av)
            }
            (_, op) => {
                let (opcode, ext) = connected_request(ty, op, position, w.length)?;
                (opcode, ext, q.attr.dest_qp_num, None)
            }
        };
        let psn = q.req.psn;
        let bth = bth::Repr {
            opcode,
            solicited: last && w.flags.contains(crate::wr::SendFlags::SOLICITED),
            mig_req: false,
            pad_cnt: 0,
            pkey: self.pkey_of(q.attr.pkey_index),
            fecn: false,
            becn: false,
            dest_qp,
            // An ACK at the end of each message (as rxe) and every
            // PACKETS_PER_ACK_REQ packets inside a long one, so that the
            // send window moves.
            ack_req: ty == QpType::Rc
                && (last || (offset / mtu) % PACKETS_PER_ACK_REQ == PACKETS_PER_ACK_REQ - 1),
            psn,
        };
        // Headers first, then the payload gathered straight into the packet
        // (n <= mtu <= 4096).
        let n_bytes = n as usize;
        let out = buf.get_mut(..packet::packet_len(opcode, n_bytes))?;
        let at = packet::emit_headers(out, &bth, &ext, n_bytes).ok()?;
        let payload = &mut out[at..at + n_bytes];
        let mut referenced = 0;
        let gathered = if w.is_inline {
            let start = offset as usize;
            payload.copy_from_slice(&w.inline[start..start + n_bytes]);
            Ok(())
        } else if self.lend && n_bytes > 0 {
            // Pieces of an attempt that produced no packet are not this
            // packet's.
            self.lent.clear();
            match lend(
                &self.keys,
                mem,
                pd,
                &w.sges,
                offset,
                n_bytes,
                &mut self.lent,
            ) {
                Ok(true) => {
                    referenced = n_bytes;
                    Ok(())
                }
                // Memory that does not lend its bytes: copied.
                Ok(false) => gather(&self.keys, mem, pd, &w.sges, offset, payload),
                Err(e) => Err(e),
            }
        } else {
            gather(&self.keys, mem, pd, &w.sges, offset, payload)
        };
        if gathered.is_err() {
            // IBTA Vol1 §10.7.2.3: a bad local SGE completes the WQE with a
            // local protection error and the QP enters ERR.
            self.complete_front_with_error(qpn, WcStatus::LocProtErr);
            return None;
        }
        let len = out.len();
        let t = self.path(qpn, ah).map(|t| Transmit {
            len,
            payload_at: at,
            referenced,
            ..t
        })?;

        // Advance.
        let q = self.qps.get_mut(qpn.value())?;
        if q.req.send_twice.take() == Some(psn) {
            // The first packet after a timeout goes out twice (see
            // retransmit_timeout): the same packet again next time.
            self.stats.tx_retransmitted += 1;
            return Some(t);
        }
        q.req.started = q.req.started.max(cursor + 1);
        if first && let Some(w) = q.sq.get_mut(cursor) {
            w.first_psn = psn;
        }
        q.req.psn = psn.next();
        let resent = q.req.psn.precedes(q.req.high) || q.req.psn == q.req.high;
        if resent {
            self.stats.tx_retransmitted += 1;
        } else {
            q.req.high = q.req.psn;
        }
        if last {
            q.req.cursor += 1;
            q.req.offset = 0;
        } else {
            q.req.offset = offset + n;
        }
        if ty == QpType::Rc && q.req.timer.is_none() {
            let due = self.ack_timeout(qpn).map(|d| self.now.saturating_add(d));
            if let Some(q) = self.qps.get_mut(qpn.value()) {
                q.req.timer = due;
            }
        }
        if last && ty != QpType::Rc {
            // UC and UD complete when the last packet leaves.
            self.retire_front(qpn, WcStatus::Success);
            self.retire_executed(qpn);
        }
        Some(t)
    }

    /// An RDMA READ request (for what is still missing of the READ) or an
    /// atomic request. A READ takes one PSN per response packet.
    fn emit_read_or_atomic(
        &mut self,
        qpn: Qpn,
        cursor: usize,
        op: SendOp,
        offset: u64,
        buf: &mut [u8],
    ) -> Option<Transmit> {
        let q = self.qps.get(qpn.value())?;
        let w = q.sq.get(cursor)?;
        let mtu = u64::from(q.attr.path_mtu.bytes());
        let psn = q.req.psn;
        let (opcode, ext, span) = match op {
            SendOp::RdmaRead { remote_addr, rkey } => {
                let left = w.length - offset;
                let ext = packet::ExtHeaders {
                    reth: Some(reth::Repr {
                        va: remote_addr.wrapping_add(offset),
                        rkey,
                        // At most 2^31 (checked at post).
                        dma_len: left as u32,
                    }),
                    ..Default::default()
                };
                // ceil(left / mtu), at least 1, fits a PSN step.
                let span = left.div_ceil(mtu).max(1) as u32;
                (Opcode::RcReadRequest, ext, span)
            }
            SendOp::CompareSwap {
                remote_addr,
                rkey,
                compare,
                swap,
            } => {
                let ext = packet::ExtHeaders {
                    atomic_eth: Some(vrdma_wire::atomic::eth::Repr {
                        va: remote_addr,
                        rkey,
                        swap_add: swap,
                        compare,
                    }),
                    ..Default::default()
                };
                (Opcode::RcCompareSwap, ext, 1)
            }
            SendOp::FetchAdd {
                remote_addr,
                rkey,
                add,
            } => {
                let ext = packet::ExtHeaders {
                    atomic_eth: Some(vrdma_wire::atomic::eth::Repr {
                        va: remote_addr,
                        rkey,
                        swap_add: add,
                        compare: 0,
                    }),
                    ..Default::default()
                };
                (Opcode::RcFetchAdd, ext, 1)
            }
            _ => return None,
        };
        let bth = bth::Repr {
            opcode,
            solicited: false,
            mig_req: false,
            pad_cnt: 0,
            pkey: self.pkey_of(q.attr.pkey_index),
            fecn: false,
            becn: false,
            dest_qp: q.attr.dest_qp_num,
            ack_req: true,
            psn,
        };
        let len = emit(buf, bth, ext)?;
        let t = self.path(qpn, None).map(|t| Transmit { len, ..t })?;
        let due = self.ack_timeout(qpn).map(|d| self.now.saturating_add(d));
        let q = self.qps.get_mut(qpn.value())?;
        if q.req.send_twice.take() == Some(psn) {
            self.stats.tx_retransmitted += 1;
            return Some(t);
        }
        q.req.started = q.req.started.max(cursor + 1);
        if let Some(w) = q.sq.get_mut(cursor)
            && offset == 0
        {
            w.first_psn = psn;
        }
        q.req.psn = psn.wrapping_add(span);
        let resent = q.req.psn.precedes(q.req.high) || q.req.psn == q.req.high;
        if resent {
            self.stats.tx_retransmitted += 1;
        } else {
            q.req.high = q.req.psn;
        }
        q.req.cursor += 1;
        q.req.offset = 0;
        if q.req.timer.is_none() {
            q.req.timer = due;
        }
        Some(t)
    }

    /// Runs the local operations (LOCAL_INV, BIND_MW, REG_MR) at the
    /// requester's cursor, in queue order and subject to FENCE; each
    /// completes when it reaches the front of the queue. A failure
    /// completes it in error and takes the QP to ERR.
    fn run_local_ops(&mut self, qpn: Qpn) {
        loop {
            let Some(q) = self.qps.get(qpn.value()) else {
                return;
            };
            let cursor = q.req.cursor;
            let Some(w) = q.sq.get(cursor) else {
                return;
            };
            let Some(op) = w.op.filter(|o| o.is_local()) else {
                return;
            };
            if !self.can_send_request(q) {
                return;
            }
            if w.executed {
                // A rewind moved the cursor back over an operation that
                // already ran: it is not run again.
                if let Some(q) = self.qps.get_mut(qpn.value()) {
                    q.req.cursor += 1;
                }
                self.retire_executed(qpn);
                continue;
            }
            let pd = q.init.pd;
            let result = match op {
                SendOp::LocalInv { invalidate } => self
                    .keys
                    .invalidate(invalidate.0, pd, None)
                    .map_err(|_| WcStatus::LocQpOpErr),
                SendOp::BindMw {
                    mw,
                    key,
                    mr,
                    addr,
                    length,
                    access,
                } => self
                    .keys
                    .bind(mw, key, mr, addr, length, access, pd, qpn)
                    .map(|_| ())
                    .map_err(|_| WcStatus::MwBindErr),
                SendOp::RegMr {
                    mr,
                    key,
                    iova,
                    length,
                    access,
                } => self
                    .keys
                    .fast_register(mr, pd, key, iova, length, access)
                    .map_err(|_| WcStatus::LocQpOpErr),
                _ => Ok(()),
            };
            let Some(q) = self.qps.get_mut(qpn.value()) else {
                return;
            };
            if let Some(w) = q.sq.get_mut(cursor) {
                w.executed = true;
                w.status = result.err();
            }
            q.req.cursor += 1;
            q.req.offset = 0;
            q.req.started = q.req.started.max(q.req.cursor);
            if result.is_err() {
                self.flush_errored(qpn, true);
                return;
            }
            self.retire_executed(qpn);
        }
    }

    /// A QP draining in SQD whose started WRs have all completed has
    /// drained: SQ Drained is raised once if the consumer asked for it
    /// (EN_SQD_ASYNC_NOTIFY, IBTA Vol1 §11.6.3.1).
    pub(crate) fn check_drained(&mut self, qpn: Qpn) {
        let Some(q) = self.qps.get_mut(qpn.value()) else {
            return;
        };
        if q.attr.qp_state != QpState::Sqd || !q.attr.sq_draining || q.req.started > 0 {
            return;
        }
        q.attr.sq_draining = false;
        if q.attr.en_sqd_async_notify {
            self.events.push_back(AsyncEvent::SqDrained { qp: qpn });
        }
    }

    /// Completes the executed local operations at the front of the queue.
    fn retire_executed(&mut self, qpn: Qpn) {
        while let Some(q) = self.qps.get(qpn.value())
            && q.req.cursor > 0
            && q.sq.front().is_some_and(|w| w.executed)
        {
            self.retire_front(qpn, WcStatus::Success);
        }
    }

    /// Completes the oldest send WQE (signaled, or any error) and removes
    /// it.
    fn retire_front(&mut self, qpn: Qpn, status: WcStatus) {
        let Some(q) = self.qps.get_mut(qpn.value()) else {
            return;
        };
        let Some(w) = q.sq.front() else {
            return;
        };
        let post = w.signaled || status != WcStatus::Success;
        let mut wc = Wc::new(
            w.wr_id,
            status,
            w.op.map_or(WcOpcode::Send, SendOp::wc_opcode),
            qpn.value(),
        );
        if status == WcStatus::Success {
            // ibv_wc byte_len of a send completion: the message length.
            wc.byte_len = u32::try_from(w.length).unwrap_or(u32::MAX);
        }
        let cq = q.init.send_cq;
        q.sq.pop_front();
        q.req.cursor = q.req.cursor.saturating_sub(1);
        q.req.started = q.req.started.saturating_sub(1);
        if post {
            self.post_cqe(cq, wc, false);
        }
        self.check_drained(qpn);
    }

    /// A requester-side error: the oldest WQE completes with `status` and
    /// the QP enters ERR (flushing the rest).
    fn complete_front_with_error(&mut self, qpn: Qpn, status: WcStatus) {
        self.retire_front(qpn, status);
        self.flush_errored(qpn, true);
    }

    /// Adds a completion; an overflow raises the CQ error and takes the
    /// CQ's QPs to ERR.
    pub(crate) fn post_cqe(&mut self, cq: CqHandle, wc: Wc, solicited: bool) {
        let Some(c) = self.cqs.get_mut(cq.0) else {
            return;
        };
        let was = c.overflowed();
        match c.push(wc, solicited) {
            crate::cq::Pushed::Stored => {}
            crate::cq::Pushed::Notify => self.notifications.push_back(cq),
            crate::cq::Pushed::Overflow => {
                if !was {
                    self.cq_overflowed(cq);
                }
            }
        }
    }

    /// Handles one received RoCE packet (BTH through ICRC, ICRC already
    /// verified by the fabric); `ip` is the IP header it arrived with.
    pub fn handle_packet(&mut self, now: u64, ip: &IpRepr, roce: &[u8], mem: &mut impl Memory) {
        self.now = self.now.max(now);
        self.stats.rx_packets += 1;
        // `Repr::parse` does every layout check `new_checked` would.
        let Ok(r) = packet::Repr::parse(&packet::Packet::new_unchecked(roce)) else {
            self.stats.rx_malformed += 1;
            return;
        };
        let qpn = r.bth.dest_qp;
        let Some(q) = self.qps.get(qpn.value()) else {
            self.stats.rx_no_qp += 1;
            return;
        };
        let service = r.bth.opcode.service();
        let matches = matches!(
            (q.init.qp_type, service),
            (QpType::Rc, ServiceType::Rc)
                | (QpType::Uc, ServiceType::Uc)
                | (QpType::Ud, ServiceType::Ud)
        );
        if !matches {
            self.stats.rx_no_qp += 1;
            return;
        }
        // IBTA Vol1 §9.6.1.1: packets are accepted in RTR, RTS and SQD.
        if !matches!(q.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
            self.stats.rx_bad_state += 1;
            return;
        }
        // A connection's packets come from its peer to its own address.
        if q.init.qp_type != QpType::Ud {
            let from_peer = q
                .path
                .is_some_and(|p| Gid::from(ip.src()) == p.dgid && Gid::from(ip.dst()) == p.sgid);
            if !from_peer {
                self.stats.rx_bad_addr += 1;
                return;
            }
        }
        if !r.bth.pkey.matches(self.pkey_of(q.attr.pkey_index)) {
            self.stats.rx_bad_key += 1;
            return;
        }
        let op = r.bth.opcode.info().operation;
        let request = matches!(
            op,
            Operation::Send
                | Operation::RdmaWrite
                | Operation::RdmaReadRequest
                | Operation::CompareSwap
                | Operation::FetchAdd
        );
        if q.resp.failed && request {
            // The responder has failed (its NAK is on the way and ERR
            // follows): nothing more executes.
            self.stats.rx_bad_state += 1;
            return;
        }
        match (q.init.qp_type, op) {
            (QpType::Ud, _) => self.recv_ud(qpn, ip, &r, mem),
            (QpType::Rc, Operation::Acknowledge) => self.recv_ack(qpn, &r),
            (QpType::Rc | QpType::Uc, Operation::Send | Operation::RdmaWrite) => {
                self.recv_request(qpn, &r, mem)
            }
            (
                QpType::Rc,
                Operation::RdmaReadRequest | Operation::CompareSwap | Operation::FetchAdd,
            ) => self.recv_read_or_atomic(qpn, &r, mem),
            (QpType::Rc, Operation::RdmaReadResponse) => self.recv_read_response(qpn, &r, mem),
            (QpType::Rc, Operation::AtomicAcknowledge) => self.recv_atomic_ack(qpn, &r, mem),
            _ => self.stats.rx_malformed += 1,
        }
    }

    fn recv_ud(&mut self, qpn: Qpn, ip: &IpRepr, r: &packet::Repr<'_>, mem: &mut impl Memory) {
        let Some(q) = self.qps.get(qpn.value()) else {
            return;
        };
        let Some(deth) = r.ext.deth else {
            self.stats.rx_malformed += 1;
            return;
        };
        // IBTA Vol1 §10.2.5 (C10-16): the Q_Key must match.
        if deth.qkey != q.attr.qkey {
            self.stats.rx_bad_key += 1;
            return;
        }
        let total = (grh::HEADER_LEN + r.payload.len()) as u64;
        match self.peek_recv_len(qpn) {
            None => {
                self.stats.rx_no_recv += 1;
                return;
            }
            Some(room) if room < total => {
                // Too long for the next receive: dropped, the receive kept
                // and the QP left up (a datagram service; rxe does the same).
                self.stats.rx_too_long += 1;
                return;
            }
            Some(_) => {}
        }
        if !self.take_recv(qpn) {
            self.stats.rx_no_recv += 1;
            return;
        }
        let Some(q) = self.qps.get(qpn.value()) else {
            return;
        };
        let pd = q.init.pd;
        let cq = q.init.recv_cq;
        let wqe = &q.resp.recv;
        let mut g = [0u8; grh::HEADER_LEN];
        let grh_ok = grh::emit(ip, &mut grh::Packet::new_unchecked(&mut g[..])).is_ok();
        let mut wc = Wc::new(wqe.wr_id, WcStatus::Success, WcOpcode::Recv, qpn.value());
        let status = if !grh_ok {
            WcStatus::GeneralErr
        } else {
            let a = scatter(&self.keys, mem, pd, &wqe.sges, 0, &g)
                .and_then(|()| scatter(&self.keys, mem, pd, &wqe.sges, 40, r.payload));
            match a {
                Ok(()) => WcStatus::Success,
                Err(_) => WcStatus::LocProtErr,
            }
        };
        wc.status = status;
        if status == WcStatus::Success {
            wc.byte_len = total as u32;
            wc.src_qp = deth.src_qp.value();
            wc.wc_flags = WcFlags::GRH;
            if let Some(i) = r.ext.immdt {
                wc.imm_data = i.imm;
                wc.wc_flags = wc.wc_flags.with(WcFlags::WITH_IMM);
            }
            wc.pkey_index = q.attr.pkey_index;
        }
        if let Some(q) = self.qps.get_mut(qpn.value()) {
            q.resp.has_recv = false;
        }
        self.post_cqe(cq, wc, r.bth.solicited);
        if status != WcStatus::Success {
            self.flush_errored(qpn, true);
        }
    }

    /// The size of the receive WQE the next message would take.
    fn peek_recv_len(&self, qpn: Qpn) -> Option<u64> {
        let q = self.qps.get(qpn.value())?;
        let rq = match q.init.srq {
            Some(s) => &self.srqs.get(s.0)?.rq,
            None => &q.rq,
        };
        rq.front().map(|w| w.length)
    }

    /// Takes the next receive WQE (RQ or SRQ) into the responder.
    fn take_recv(&mut self, qpn: Qpn) -> bool {
        let Some(q) = self.qps.get_mut(qpn.value()) else {
            return false;
        };
        let src = match q.init.srq {
            Some(s) => match self.srqs.get_mut(s.0) {
                Some(srq) => &mut srq.rq,
                None => return false,
            },
            None => &mut q.rq,
        };
        let Some(w) = src.front() else {
            return false;
        };
        q.resp.recv.wr_id = w.wr_id;
        q.resp.recv.length = w.length;
        q.resp.recv.sges.clear();
        q.resp.recv.sges.extend_from_slice(&w.sges);
        src.pop_front();
        q.resp.has_recv = true;
        // IBTA Vol1 §10.2.9.3: an armed SRQ that drops below its limit
        // raises the limit event once and disarms.
        if let Some(s) = q
            .init
            .srq
            .and_then(|s| self.srqs.get_mut(s.0).map(|srq| (s, srq)))
            .and_then(|(h, srq)| {
                let below = srq.attr.srq_limit != 0
                    && (srq.rq.len() as u64) < u64::from(srq.attr.srq_limit);
                if below {
                    srq.attr.srq_limit = 0;
                }
                below.then_some(h)
            })
        {
            self.events
                .push_back(crate::event::AsyncEvent::SrqLimitReached { srq: s });
        }
        true
    }

    fn nak(&mut self, qpn: Qpn, psn: Psn, code: NakCode) {
        if let Some(q) = self.qps.get_mut(qpn.value()) {
            q.resp.push_ack(psn, Syndrome::Nak(code));
            if code != NakCode::PsnSequenceError {
                q.resp.failed = true;
            }
        }
        self.schedule(qpn);
    }

    fn ack(&mut self, qpn: Qpn, psn: Psn) {
        if let Some(q) = self.qps.get_mut(qpn.value()) {
            q.resp
                .push_ack(psn, Syndrome::Ack(aeth::CreditCode::INVALID));
        }
        self.schedule(qpn);
    }

    /// UC and RC SEND and RDMA WRITE packets.
    fn recv_request(&mut self, qpn: Qpn, r: &packet::Repr<'_>, mem: &mut impl Memory) {
        let Some(q) = self.qps.get(qpn.value()) else {
            return;
        };
        let rc = q.init.qp_type == QpType::Rc;
        let psn = r.bth.psn;
        let epsn = q.resp.epsn;
        let info = r.bth.opcode.info();
        let Some(position) = info.position else {
            self.stats.rx_malformed += 1;
            return;
        };
        if psn != epsn {
            if rc {
                if psn.precedes(epsn) {
                    // A duplicate: the ACK may have been lost; acknowledge
                    // again with the current MSN (IBTA Vol1 §9.7.5.1.2).
                    self.stats.rx_duplicate += 1;
                    self.ack(qpn, epsn.wrapping_sub(1));
                } else {
                    self.stats.rx_out_of_sequence += 1;
                    let sent = self.qps.get(qpn.value()).is_some_and(|q| q.resp.nak_sent);
                    if !sent {
                        if let Some(q) = self.qps.get_mut(qpn.value()) {
                            q.resp.nak_sent = true;
                        }
                        self.nak(qpn, epsn, NakCode::PsnSequenceError);
                    }
                }
                return;
            }
            // UC: a gap loses the message in progress; resynchronise on the
            // first packet of the next one (IBTA Vol1 §9.7.5.1.3).
            self.stats.rx_out_of_sequence += 1;
            let Some(q) = self.qps.get_mut(qpn.value()) else {
                return;
            };
            // A receive WQE the lost message had started to fill stays
            // held (has_recv) and is reused, from its start, by the next
            // SEND: the lost message never completes, the buffer does.
            if !position.starts() {
                q.resp.msg = InMsg::Dropping;
                q.resp.epsn = psn.next();
                return;
            }
            q.resp.msg = InMsg::Idle;
            q.resp.epsn = psn;
        }
        if let Some(q) = self.qps.get_mut(qpn.value()) {
            q.resp.nak_sent = false;
        }
        match self.execute(qpn, r, position, mem) {
            Ok(()) => {}
            Err(Failure::Nak(code)) if rc => self.nak(qpn, psn, code),
            Err(Failure::Rnr) if rc => {
                let timer = self
                    .qps
                    .get(qpn.value())
                    .map_or(0, |q| q.attr.min_rnr_timer);
                if let Some(q) = self.qps.get_mut(qpn.value()) {
                    q.resp
                        .push_ack(psn, Syndrome::RnrNak(RnrTimer::from_masked(timer)));
                }
                self.schedule(qpn);
            }
            Err(Failure::Nak(_) | Failure::Rnr) => {
                // UC: drop the rest of the message.
                self.stats.rx_no_recv += 1;
                if let Some(q) = self.qps.get_mut(qpn.value()) {
                    q.resp.msg = if position.ends() {
                        InMsg::Idle
                    } else {
                        InMsg::Dropping
                    };
                    q.resp.epsn = psn.next();
                }
            }
            Err(Failure::Local(WcStatus::LocLenErr)) if !rc => {
                // UC: a message too long for the receive buffer is dropped;
                // the receive WQE is kept for the next message.
                self.stats.rx_too_long += 1;
                if let Some(q) = self.qps.get_mut(qpn.value()) {
                    q.resp.msg = if position.ends() {
                        InMsg::Idle
                    } else {
                        InMsg::Dropping
                    };
                    q.resp.epsn = psn.next();
                }
            }
            Err(Failure::Local(status)) => {
                // The receive WQE completes in error and the QP enters ERR,
                // on RC after a NAK: invalid request for a too-long message
                // (class C), remote operational error for a local
                // protection fault (IBTA Vol1 §9.9.3).
                if let Some(q) = self.qps.get_mut(qpn.value()) {
                    let cq = q.init.recv_cq;
                    let wc = Wc::new(q.resp.recv.wr_id, status, WcOpcode::Recv, qpn.value());
                    q.resp.has_recv = false;
                    q.resp.failure_reported = true;
                    self.post_cqe(cq, wc, false);
                }
                if rc {
                    let code = if status == WcStatus::LocLenErr {
                        NakCode::InvalidRequest
                    } else {
                        NakCode::RemoteOperationalError
                    };
                    self.nak(qpn, psn, code);
                } else {
                    self.flush_errored(qpn, true);
                }
            }
        }
    }

    /// Runs one in-sequence SEND or WRITE packet.
    fn execute(
        &mut self,
        qpn: Qpn,
        r: &packet::Repr<'_>,
        position: Position,
        mem: &mut impl Memory,
    ) -> Result<(), Failure> {
        let q = self
            .qps
            .get(qpn.value())
            .ok_or(Failure::Nak(NakCode::InvalidRequest))?;
        let mtu = q.attr.path_mtu.bytes() as usize;
        let len = r.payload.len();
        // IBTA Vol1 §9.7.5.2.5 / C9-?: First and Middle carry exactly one
        // MTU, Last 1..=MTU, Only 0..=MTU.
        let len_ok = match position {
            Position::First | Position::Middle => len == mtu,
            Position::Last => (1..=mtu).contains(&len),
            Position::Only => len <= mtu,
        };
        let op = r.bth.opcode.info().operation;
        let in_msg = q.resp.msg;
        // Opcode sequence (IBTA Vol1 §9.7.5.2.3).
        let seq_ok = matches!(
            (in_msg, op, position.starts()),
            (InMsg::Idle | InMsg::Dropping, _, true)
                | (InMsg::Send { .. }, Operation::Send, false)
                | (InMsg::Write { .. }, Operation::RdmaWrite, false)
        );
        if in_msg == InMsg::Dropping && !position.starts() {
            // UC, still dropping a lost message.
            if let Some(q) = self.qps.get_mut(qpn.value()) {
                q.resp.epsn = r.bth.psn.next();
                if position.ends() {
                    q.resp.msg = InMsg::Idle;
                }
            }
            return Ok(());
        }
        if !len_ok || !seq_ok {
            self.stats.rx_malformed += 1;
            return Err(Failure::Nak(NakCode::InvalidRequest));
        }
        let pd = q.init.pd;
        let qp_access = q.attr.qp_access_flags;
        let recv_cq = q.init.recv_cq;
        let rc = q.init.qp_type == QpType::Rc;

        match op {
            Operation::Send => {
                let offset = match in_msg {
                    // A message under way holds its receive WQE; without
                    // one (completed in error) nothing may be written.
                    InMsg::Send { .. } if !q.resp.has_recv => {
                        return Err(Failure::Nak(NakCode::InvalidRequest));
                    }
                    InMsg::Send { offset } => offset,
                    _ => {
                        let held = self.qps.get(qpn.value()).is_some_and(|q| q.resp.has_recv);
                        if !held && !self.take_recv(qpn) {
                            return Err(Failure::Rnr);
                        }
                        0
                    }
                };
                let q = self.qps.get(qpn.value()).ok_or(Failure::Rnr)?;
                let wqe = &q.resp.recv;
                if offset + len as u64 > wqe.length {
                    return Err(Failure::Local(WcStatus::LocLenErr));
                }
                scatter(&self.keys, mem, pd, &wqe.sges, offset, r.payload)
                    .map_err(|_| Failure::Local(WcStatus::LocProtErr))?;
                let end = offset + len as u64;
                if position.ends()
                    && let Some(inv) = r.ext.ieth
                    && self.keys.invalidate(inv.rkey.0, pd, Some(qpn)).is_err()
                {
                    // IBTA Vol1 §9.4.1.2: the rkey named must be a
                    // fast-registered MR of this PD or a type 2 window
                    // bound to this QP.
                    return Err(Failure::Nak(NakCode::InvalidRequest));
                }
                let q = self.qps.get_mut(qpn.value()).ok_or(Failure::Rnr)?;
                q.resp.msg = InMsg::Send { offset: end };
                if position.ends() {
                    let mut wc = Wc::new(
                        q.resp.recv.wr_id,
                        WcStatus::Success,
                        WcOpcode::Recv,
                        qpn.value(),
                    );
                    wc.byte_len = end as u32;
                    if let Some(i) = r.ext.immdt {
                        wc.imm_data = i.imm;
                        wc.wc_flags = WcFlags::WITH_IMM;
                    }
                    if let Some(inv) = r.ext.ieth {
                        wc.imm_data = inv.rkey.0;
                        wc.wc_flags = WcFlags::WITH_INV;
                    }
                    q.resp.has_recv = false;
                    q.resp.msg = InMsg::Idle;
                    q.resp.msn = q.resp.msn.wrapping_add(1);
                    self.post_cqe(recv_cq, wc, r.bth.solicited);
                }
            }
            Operation::RdmaWrite => {
                if position.ends() && r.ext.immdt.is_some() {
                    // WRITE with immediate consumes a receive WQE: make sure
                    // there is one before anything changes, so that an RNR
                    // NAK leaves the message where it was (rxe's
                    // check_resource).
                    let held = self.qps.get(qpn.value()).is_some_and(|q| q.resp.has_recv);
                    if !held && !self.take_recv(qpn) {
                        return Err(Failure::Rnr);
                    }
                }
                let (rkey, va, left, total) = match (in_msg, r.ext.reth) {
                    (
                        InMsg::Write {
                            rkey,
                            va,
                            left,
                            total,
                        },
                        None,
                    ) => (rkey, va, left, total),
                    (_, Some(reth)) => {
                        // IBTA Vol1 §9.7.4.1.2: the QP must allow remote
                        // writes and the rkey must grant them over the
                        // whole DMA length, in this QP's PD.
                        let total = u64::from(reth.dma_len);
                        if !qp_access.contains(Access::REMOTE_WRITE) {
                            return Err(Failure::Nak(NakCode::RemoteAccessError));
                        }
                        if total > 0 {
                            self.keys
                                .check_remote(
                                    reth.rkey,
                                    pd,
                                    reth.va,
                                    total,
                                    Access::REMOTE_WRITE,
                                    qpn,
                                )
                                .map_err(|_| Failure::Nak(NakCode::RemoteAccessError))?;
                        }
                        (reth.rkey, reth.va, total, total)
                    }
                    _ => return Err(Failure::Nak(NakCode::InvalidRequest)),
                };
                if len as u64 > left || (position.ends() && len as u64 != left) {
                    // More (or less) data than the RETH announced.
                    return Err(Failure::Nak(NakCode::InvalidRequest));
                }
                if len > 0 {
                    let mr = self
                        .keys
                        .check_remote(rkey, pd, va, len as u64, Access::REMOTE_WRITE, qpn)
                        .map_err(|_| Failure::Nak(NakCode::RemoteAccessError))?;
                    mr.write(mem, va, r.payload)
                        .map_err(|_| Failure::Nak(NakCode::RemoteAccessError))?;
                }
                let q = self.qps.get_mut(qpn.value()).ok_or(Failure::Rnr)?;
                q.resp.msg = InMsg::Write {
                    rkey,
                    va: va + len as u64,
                    left: left - len as u64,
                    total,
                };
                if position.ends() {
                    q.resp.msg = InMsg::Idle;
                    q.resp.msn = q.resp.msn.wrapping_add(1);
                    if let Some(i) = r.ext.immdt {
                        // The receive WQE taken above.
                        let q = self.qps.get_mut(qpn.value()).ok_or(Failure::Rnr)?;
                        let mut wc = Wc::new(
                            q.resp.recv.wr_id,
                            WcStatus::Success,
                            WcOpcode::RecvRdmaWithImm,
                            qpn.value(),
                        );
                        wc.byte_len = total as u32;
                        wc.imm_data = i.imm;
                        wc.wc_flags = WcFlags::WITH_IMM;
                        q.resp.has_recv = false;
                        self.post_cqe(recv_cq, wc, r.bth.solicited);
                    }
                }
            }
            _ => return Err(Failure::Nak(NakCode::InvalidRequest)),
        }
        if let Some(q) = self.qps.get_mut(qpn.value()) {
            q.resp.epsn = r.bth.psn.next();
        }
        if rc && (r.bth.ack_req || position.ends()) {
            self.ack(qpn, r.bth.psn);
        }
        Ok(())
    }

    /// RC responder: an RDMA READ request or an atomic.
    fn recv_read_or_atomic(&mut self, qpn: Qpn, r: &packet::Repr<'_>, mem: &mut impl Memory) {
        let Some(q) = self.qps.get(qpn.value()) else {
            return;
        };
        let psn = r.bth.psn;
        let epsn = q.resp.epsn;
        if psn.precedes(epsn) {
            self.stats.rx_duplicate += 1;
            self.duplicate_read_or_atomic(qpn, r);
            return;
        }
        if psn != epsn {
            self.stats.rx_out_of_sequence += 1;
            if !q.resp.nak_sent {
                self.nak(qpn, epsn, NakCode::PsnSequenceError);
            }
            return;
        }
        let pd = q.init.pd;
        let mtu = u64::from(q.attr.path_mtu.bytes());
        let access = q.attr.qp_access_flags;
        let depth = usize::from(q.attr.max_dest_rd_atomic).max(1);
        if q.resp.msg != InMsg::Idle {
            // A new request in the middle of a SEND or WRITE.
            self.nak(qpn, psn, NakCode::InvalidRequest);
            return;
        }
        // Responder resources (IBTA Vol1 §9.7.5.2.6): more outstanding
        // READs/atomics than max_dest_rd_atomic is an invalid request.
        if q.resp.queued_responses() >= depth {
            self.nak(qpn, psn, NakCode::InvalidRequest);
            return;
        }
        let (resource, out, span) = if let Some(reth) = r.ext.reth {
            // IBTA Vol1 §9.7.4.1.2: REMOTE_READ on the QP and the MR.
            let len = u64::from(reth.dma_len);
            let allowed = access.contains(Access::REMOTE_READ)
                && (len == 0
                    || self
                        .keys
                        .check_remote(reth.rkey, pd, reth.va, len, Access::REMOTE_READ, qpn)
                        .is_ok());
            if !allowed {
                self.nak(qpn, psn, NakCode::RemoteAccessError);
                return;
            }
            let read = RespOut::Read {
                rkey: reth.rkey,
                va: reth.va,
                len,
                psn,
                sent: 0,
            };
            let res = Resource::Read {
                psn,
                rkey: reth.rkey,
                va: reth.va,
                len,
            };
            (res, read, len.div_ceil(mtu).max(1) as u32)
        } else {
            let Some(at) = r.ext.atomic_eth else {
                self.stats.rx_malformed += 1;
                return;
            };
            // IBTA Vol1 §9.4.5: an aligned 8-byte target, REMOTE_ATOMIC on
            // the QP and the MR.
            if at.va % 8 != 0 {
                self.nak(qpn, psn, NakCode::InvalidRequest);
                return;
            }
            let result = if access.contains(Access::REMOTE_ATOMIC) {
                self.keys
                    .check_remote(at.rkey, pd, at.va, 8, Access::REMOTE_ATOMIC, qpn)
                    .and_then(|mr| mr.atomic_addr(at.va))
                    .ok()
                    .and_then(|addr| match r.bth.opcode {
                        Opcode::RcCompareSwap => {
                            mem.compare_swap(addr, at.compare, at.swap_add).ok()
                        }
                        _ => mem.fetch_add(addr, at.swap_add).ok(),
                    })
            } else {
                None
            };
            let Some(orig) = result else {
                self.nak(qpn, psn, NakCode::RemoteAccessError);
                return;
            };
            (
                Resource::Atomic { psn, orig },
                RespOut::Atomic { psn, orig },
                1,
            )
        };
        let Some(q) = self.qps.get_mut(qpn.value()) else {
            return;
        };
        if q.resp.resources.len() >= depth {
            q.resp.resources.pop_front();
        }
        q.resp.resources.push_back(resource);
        q.resp.out.push_back(out);
        q.resp.epsn = psn.wrapping_add(span);
        q.resp.msn = q.resp.msn.wrapping_add(1);
        q.resp.nak_sent = false;
        self.schedule(qpn);
    }

    /// A duplicate READ or atomic (its response was lost): answered again
    /// only if it repeats a request still held as a responder resource —
    /// a READ for the same range or the rest of it, an atomic by its PSN,
    /// never executed twice — and only while response room is left;
    /// anything else is dropped (the requester times out and retries).
    fn duplicate_read_or_atomic(&mut self, qpn: Qpn, r: &packet::Repr<'_>) {
        let psn = r.bth.psn;
        let Some(q) = self.qps.get_mut(qpn.value()) else {
            return;
        };
        // The requester went back to `psn` and will ask again for
        // everything after it: responses still queued from there on are
        // superseded (they would go out twice and hold the room meant for
        // new requests).
        let mtu = u64::from(q.attr.path_mtu.bytes());
        // A queued READ response covers PSNs p..p+span-1: it is kept only
        // if it ends before `psn` (one that merely starts before it would
        // send `psn` twice and hold a second slot for one READ).
        q.resp.out.retain(|o| match *o {
            RespOut::Ack { .. } => true,
            RespOut::Read { psn: p, len, .. } => {
                let span = len.div_ceil(mtu.max(1)).max(1) as u32;
                p.wrapping_add(span - 1).precedes(psn)
            }
            RespOut::Atomic { psn: p, .. } => p.precedes(psn),
        });
        let depth = usize::from(q.attr.max_dest_rd_atomic).max(1);
        if q.resp.queued_responses() >= depth {
            return;
        }
        let out = q
            .resp
            .resources
            .iter()
            .find_map(|res| match (*res, r.ext.reth) {
                (
                    Resource::Read {
                        psn: p0,
                        rkey,
                        va,
                        len,
                    },
                    Some(reth),
                ) => {
                    let span = len.div_ceil(mtu).max(1) as u32;
                    let d = p0.forward_distance(psn);
                    let skip = u64::from(d) * mtu;
                    let same = d < span
                        && reth.rkey == rkey
                        && reth.va == va.wrapping_add(skip)
                        && u64::from(reth.dma_len) == len.saturating_sub(skip);
                    same.then_some(RespOut::Read {
                        rkey,
                        va: reth.va,
                        len: u64::from(reth.dma_len),
                        psn,
                        sent: 0,
                    })
                }
                (Resource::Atomic { psn: p0, orig }, None)
                    if p0 == psn && r.ext.atomic_eth.is_some() =>
                {
                    Some(RespOut::Atomic { psn, orig })
                }
                _ => None,
            });
        if let Some(out) = out
            && let Some(q) = self.qps.get_mut(qpn.value())
        {
            q.resp.out.push_back(out);
            self.schedule(qpn);
        }
    }

    /// Requester: RDMA READ response data for the oldest WQE.
    fn recv_read_response(&mut self, qpn: Qpn, r: &packet::Repr<'_>, mem: &mut impl Memory) {
        let psn = r.bth.psn;
        // Only a response to something outstanding counts: a stale or
        // forged one must not acknowledge anything.
        if !self.outstanding(qpn, psn) {
            self.stats.rx_duplicate += 1;
            return;
        }
        // A response acknowledges every earlier request.
        self.implicit_ack(qpn, psn);
        let Some(q) = self.qps.get(qpn.value()) else {
            return;
        };
        let Some(w) = q.sq.front() else {
            self.stats.rx_duplicate += 1;
            return;
        };
        if q.req.started == 0 || !matches!(w.op, Some(SendOp::RdmaRead { .. })) {
            self.stats.rx_duplicate += 1;
            return;
        }
        let mtu = u64::from(q.attr.path_mtu.bytes());
        let expected = w.first_psn.wrapping_add((w.read_done / mtu) as u32);
        if psn != expected {
            if expected.precedes(psn) {
                // A response was lost: ask for the rest again (an implied
                // NAK, counted like one).
                self.stats.rx_out_of_sequence += 1;
                self.retry_from_unacked(qpn, Retry::ImpliedNak);
            } else {
                self.stats.rx_duplicate += 1;
            }
            return;
        }
        let Some(position) = r.bth.opcode.info().position else {
            return;
        };
        let len = r.payload.len() as u64;
        let left = w.length - w.read_done;
        let len_ok = match position {
            Position::First | Position::Middle => len == mtu && left > mtu,
            Position::Last => len == left && len > 0,
            Position::Only => len == left,
        };
        let pd = q.init.pd;
        if !len_ok {
            self.complete_front_with_error(qpn, WcStatus::BadRespErr);
            return;
        }
        let written = scatter(&self.keys, mem, pd, &w.sges, w.read_done, r.payload);
        if written.is_err() {
            self.complete_front_with_error(qpn, WcStatus::LocProtErr);
            return;
        }
        let Some(q) = self.qps.get_mut(qpn.value()) else {
            return;
        };
        if let Some(w) = q.sq.get_mut(0) {
            w.read_done += len;
        }
        if position.ends() {
            self.progress(qpn);
        } else {
            self.acknowledged_before(qpn, psn.next());
        }
    }

    /// Requester: the acknowledgement of the oldest WQE, an atomic.
    fn recv_atomic_ack(&mut self, qpn: Qpn, r: &packet::Repr<'_>, mem: &mut impl Memory) {
        let psn = r.bth.psn;
        if !self.outstanding(qpn, psn) {
            self.stats.rx_duplicate += 1;
            return;
        }
        self.implicit_ack(qpn, psn);
        let Some(q) = self.qps.get(qpn.value()) else {
            return;
        };
        let (Some(w), Some(ack)) = (q.sq.front(), r.ext.atomic_ack_eth) else {
            self.stats.rx_malformed += 1;
            return;
        };
        if q.req.started == 0 || !w.op.is_some_and(SendOp::is_atomic) || w.first_psn != psn {
            self.stats.rx_duplicate += 1;
            return;
        }
        // The value found goes to the local buffer in host byte order.
        let pd = q.init.pd;
        if scatter(&self.keys, mem, pd, &w.sges, 0, &ack.orig.to_le_bytes()).is_err() {
            self.complete_front_with_error(qpn, WcStatus::LocProtErr);
            return;
        }
        self.progress(qpn);
    }

    /// Completes the oldest WQE, acknowledged, successfully: its PSNs
    /// are forward progress.
    fn progress(&mut self, qpn: Qpn) {
        let Some(last) = self
            .qps
            .get(qpn.value())
            .and_then(|q| Some(last_psn(q.sq.front()?, q.attr.path_mtu.bytes())))
        else {
            return;
        };
        self.retire_front(qpn, WcStatus::Success);
        self.retire_executed(qpn);
        self.acknowledged_before(qpn, last.next());
        // A READ or atomic slot may have freed a stalled WQE.
        self.schedule(qpn);
    }

    /// Completes the SENDs and WRITEs sent before `psn` (a response to a
    /// later request acknowledges them).
    fn implicit_ack(&mut self, qpn: Qpn, psn: Psn) {
        loop {
            let Some(q) = self.qps.get(qpn.value()) else {
                return;
            };
            let Some(w) = q.sq.front() else {
                return;
            };
            let last = last_psn(w, q.attr.path_mtu.bytes());
            if q.req.started == 0 || w.op.is_some_and(is_read_or_atomic) || !last.precedes(psn) {
                return;
            }
            self.progress(qpn);
        }
    }

    /// The completer: an ACK or NAK for this QP's requests.
    fn recv_ack(&mut self, qpn: Qpn, r: &packet::Repr<'_>) {
        let Some(a) = r.ext.aeth else {
            self.stats.rx_malformed += 1;
            return;
        };
        let psn = r.bth.psn;
        // ACKs and NAKs only count for what is outstanding; a stale or
        // forged one is ignored (it must not stop the retransmit timer or
        // spend retries).
        if !self.outstanding(qpn, psn) {
            self.stats.rx_duplicate += 1;
            return;
        }
        match a.syndrome {
            Syndrome::Ack(_) => self.acked_through(qpn, psn),
            Syndrome::Nak(NakCode::PsnSequenceError) => {
                // Everything before `psn` arrived; resend from `psn`
                // (go-back-N, IBTA Vol1 §9.7.5.1.3), counted against
                // retry_cnt like a timeout.
                self.acked_through(qpn, psn.wrapping_sub(1));
                self.retry_from_unacked(qpn, Retry::SeqNak);
            }
            Syndrome::RnrNak(timer) => {
                // IBTA Vol1 §9.7.5.2.8: wait the advertised time, then
                // resend.
                self.acked_through(qpn, psn.wrapping_sub(1));
                self.stats.rnr_naks += 1;
                let Some(q) = self.qps.get_mut(qpn.value()) else {
                    return;
                };
                let mut wait = u64::from(timer.micros()) * 1000;
                if q.attr.rnr_retry == 7 {
                    // Forever, but backing off: past RNR_BACKOFF_AFTER
                    // NAKs in a row the wait doubles each time, up to
                    // RNR_BACKOFF_CAP (or the advertised wait if longer),
                    // so a receiver that never posts costs a bounded
                    // trickle of packets, never a spin.
                    q.req.rnr_streak = q.req.rnr_streak.saturating_add(1);
                    let doublings = q.req.rnr_streak.saturating_sub(RNR_BACKOFF_AFTER);
                    if doublings > 0 {
                        let backed = wait.saturating_mul(1u64 << doublings.min(32));
                        wait = backed.min(RNR_BACKOFF_CAP.max(wait));
                    }
                } else {
                    if q.req.rnr_left == 0 {
                        self.complete_front_with_error(qpn, WcStatus::RnrRetryExcErr);
                        return;
                    }
                    q.req.rnr_left -= 1;
                }
                let until = self.now.saturating_add(wait);
                // acked_through may already have gone back further (to a
                // READ whose response never came); the delay holds either
                // way.
                let _ = self.seek(qpn, psn);
                if let Some(q) = self.qps.get_mut(qpn.value())
                    && matches!(q.attr.qp_state, QpState::Rts | QpState::Sqd)
                {
                    q.req.timer = None;
                    q.req.rnr_until = Some(until);
                }
            }
            Syndrome::Nak(code) => {
                self.acked_through(qpn, psn.wrapping_sub(1));
                let status = match code {
                    NakCode::RemoteAccessError => WcStatus::RemAccessErr,
                    NakCode::RemoteOperationalError => WcStatus::RemOpErr,
                    NakCode::InvalidRdRequest => WcStatus::RemInvRdReqErr,
                    _ => WcStatus::RemInvReqErr,
                };
                self.complete_front_with_error(qpn, status);
            }
        }
    }

    /// Completes, in order, every sent WQE whose last packet is at or
    /// before `psn`.
    fn acked_through(&mut self, qpn: Qpn, psn: Psn) {
        loop {
            let Some(q) = self.qps.get(qpn.value()) else {
                return;
            };
            let Some(w) = q.sq.front() else {
                return;
            };
            if q.req.started == 0 || w.op.is_some_and(SendOp::is_local) {
                return;
            }
            // The oldest WQE is done when its last packet is acknowledged,
            // even if a rewind has the cursor resending it.
            let last = last_psn(w, q.attr.path_mtu.bytes());
            if !(last == psn || last.precedes(psn)) {
                // Part of a multi-packet SEND or WRITE is acknowledged.
                if !w.op.is_some_and(is_read_or_atomic) {
                    self.acknowledged_before(qpn, psn.next());
                }
                return;
            }
            if w.op.is_some_and(is_read_or_atomic) {
                // A later PSN is acknowledged but this READ or atomic's
                // response never came: it was lost. Ask again from what is
                // missing (IBTA Vol1 §9.7.5.1.4, implicit NAK).
                let missing = w
                    .first_psn
                    .wrapping_add((w.read_done / u64::from(q.attr.path_mtu.bytes())) as u32);
                self.acknowledged_before(qpn, missing);
                self.retry_from_unacked(qpn, Retry::ImpliedNak);
                return;
            }
            self.progress(qpn);
        }
    }

    /// A retry after a sequence-error NAK or an implied one (a later PSN
    /// answered first): resend from the oldest unacknowledged PSN, counted
    /// against retry_cnt like a timeout (IBTA Vol1 §9.7.5.1.3), so that a
    /// peer that keeps answering out of order ends in RETRY_EXC_ERR
    /// instead of a storm. While a retry is under way and nothing new is
    /// acknowledged, more NAKs (stale ones still on the wire, or ones the
    /// resent packets' reordering causes) start no other (as rxe's
    /// started_retry).
    fn retry_from_unacked(&mut self, qpn: Qpn, why: Retry) {
        let Some(q) = self.qps.get_mut(qpn.value()) else {
            return;
        };
        if q.req.retrying {
            return;
        }
        q.req.retrying = true;
        match why {
            Retry::SeqNak => self.stats.retry_seq_nak += 1,
            Retry::ImpliedNak => self.stats.retry_implied_nak += 1,
        }
        if q.req.retry_left == 0 {
            self.complete_front_with_error(qpn, WcStatus::RetryExcErr);
            return;
        }
        q.req.retry_left -= 1;
        let unacked = q.req.unacked;
        let _ = self.seek(qpn, unacked);
    }

    /// Moves the requester's cursor to the packet with `psn`, in a WQE
    /// already started, and schedules sending from there: back to resend
    /// (go-back-N), or forward past packets an ACK proved arrived. False
    /// when no started WQE holds `psn`.
    fn seek(&mut self, qpn: Qpn, psn: Psn) -> bool {
        let Some(q) = self.qps.get_mut(qpn.value()) else {
            return false;
        };
        let mtu = q.attr.path_mtu.bytes();
        let started = q.req.started.min(q.sq.len());
        let mut found = None;
        for i in 0..started {
            let Some(w) = q.sq.get(i) else {
                break;
            };
            if w.op.is_some_and(SendOp::is_local) {
                // Ran locally; carries no PSN.
                continue;
            }
            let span = psn_span(w, mtu);
            let d = w.first_psn.forward_distance(psn);
            if d < span {
                found = Some((i, u64::from(d) * u64::from(mtu)));
                break;
            }
        }
        if found.is_none() && psn == q.req.high {
            // Just past the last packet ever sent: after every WQE
            // started (local operations among them have run).
            found = Some((started, 0));
        }
        let Some((cursor, offset)) = found else {
            return false;
        };
        q.req.cursor = cursor;
        q.req.offset = offset;
        q.req.psn = psn;
        self.schedule(qpn);
        true
    }

    /// True when `psn` belongs to a request sent and not yet acknowledged
    /// (from the oldest unacknowledged PSN up to the last PSN ever sent,
    /// also when a resend has the cursor further back). A response or NAK
    /// for anything earlier is stale: a duplicate, or overtaken on the
    /// wire.
    fn outstanding(&self, qpn: Qpn, psn: Psn) -> bool {
        let Some(q) = self.qps.get(qpn.value()) else {
            return false;
        };
        let oldest = q.req.unacked;
        oldest.forward_distance(psn) < oldest.forward_distance(q.req.high)
    }

    /// IBTA Vol1 §11.4.2.1: an overflowed CQ raises the CQ error, and the
    /// QPs that complete into it can no longer report: they enter ERR.
    fn cq_overflowed(&mut self, cq: CqHandle) {
        self.events.push_back(AsyncEvent::CqErr { cq });
        let users: Vec<Qpn> = self
            .qps
            .iter()
            .filter(|(_, q)| {
                (q.init.send_cq == cq || q.init.recv_cq == cq) && q.attr.qp_state != QpState::Err
            })
            .filter_map(|(h, _)| Qpn::try_from(h).ok())
            .collect();
        for qpn in users {
            self.flush_errored(qpn, true);
        }
    }
}

/// What started a retry (for the counters).
#[derive(Clone, Copy)]
enum Retry {
    SeqNak,
    ImpliedNak,
}

/// Why an incoming request could not be executed.
enum Failure {
    /// Answer with this NAK (RC) or drop the message (UC).
    Nak(NakCode),
    /// No receive WQE: RNR NAK (RC) or drop (UC).
    Rnr,
    /// A local error on the receive WQE: complete it in error.
    Local(WcStatus),
}

/// The PSNs a send WQE takes: one per packet (an RDMA READ takes one per
/// response packet; an atomic one).
fn psn_span(w: &crate::wr::SendWqe, mtu: u32) -> u32 {
    match w.op {
        Some(op) if op.is_atomic() => 1,
        // At most 2^31 bytes: fits.
        _ => w.length.div_ceil(u64::from(mtu)).max(1) as u32,
    }
}

/// The last PSN of a started send WQE.
fn last_psn(w: &crate::wr::SendWqe, mtu: u32) -> Psn {
    w.first_psn.wrapping_add(psn_span(w, mtu) - 1)
}

fn is_read_or_atomic(op: SendOp) -> bool {
    matches!(op, SendOp::RdmaRead { .. }) || op.is_atomic()
}

/// The opcode and headers of a UC/RC request packet.
fn connected_request(
    ty: QpType,
    op: SendOp,
    position: Position,
    length: u64,
) -> Option<(Opcode, packet::ExtHeaders)> {
    use Opcode as O;
    use Position as P;
    let rc = ty == QpType::Rc;
    let pick = |rc_op: Opcode, uc_op: Opcode| if rc { rc_op } else { uc_op };
    let mut ext = packet::ExtHeaders::default();
    let imm = match op {
        SendOp::SendWithImm { imm } | SendOp::RdmaWriteWithImm { imm, .. } => Some(imm),
        _ => None,
    };
    if let SendOp::SendWithInv { invalidate } = op {
        if !rc {
            return None;
        }
        let opcode = match position {
            P::First => O::RcSendFirst,
            P::Middle => O::RcSendMiddle,
            P::Last => O::RcSendLastInv,
            P::Only => O::RcSendOnlyInv,
        };
        if position.ends() {
            ext.ieth = Some(vrdma_wire::ieth::Repr { rkey: invalidate });
        }
        return Some((opcode, ext));
    }
    let opcode = match (op, position) {
        (SendOp::Send | SendOp::SendWithImm { .. }, P::First) => {
            pick(O::RcSendFirst, O::UcSendFirst)
        }
        (SendOp::Send | SendOp::SendWithImm { .. }, P::Middle) => {
            pick(O::RcSendMiddle, O::UcSendMiddle)
        }
        (SendOp::Send, P::Last) => pick(O::RcSendLast, O::UcSendLast),
        (SendOp::Send, P::Only) => pick(O::RcSendOnly, O::UcSendOnly),
        (SendOp::SendWithImm { .. }, P::Last) => pick(O::RcSendLastImm, O::UcSendLastImm),
        (SendOp::SendWithImm { .. }, P::Only) => pick(O::RcSendOnlyImm, O::UcSendOnlyImm),
        (SendOp::RdmaWrite { .. } | SendOp::RdmaWriteWithImm { .. }, P::First) => {
            pick(O::RcWriteFirst, O::UcWriteFirst)
        }
        (SendOp::RdmaWrite { .. } | SendOp::RdmaWriteWithImm { .. }, P::Middle) => {
            pick(O::RcWriteMiddle, O::UcWriteMiddle)
        }
        (SendOp::RdmaWrite { .. }, P::Last) => pick(O::RcWriteLast, O::UcWriteLast),
        (SendOp::RdmaWrite { .. }, P::Only) => pick(O::RcWriteOnly, O::UcWriteOnly),
        (SendOp::RdmaWriteWithImm { .. }, P::Last) => pick(O::RcWriteLastImm, O::UcWriteLastImm),
        (SendOp::RdmaWriteWithImm { .. }, P::Only) => pick(O::RcWriteOnlyImm, O::UcWriteOnlyImm),
        // READ, atomics, SEND with invalidate and LOCAL_INV are not sent
        // by this part of the data path yet.
        _ => return None,
    };
    if let SendOp::RdmaWrite { remote_addr, rkey }
    | SendOp::RdmaWriteWithImm {
        remote_addr, rkey, ..
    } = op
        && position.starts()
    {
        ext.reth = Some(reth::Repr {
            va: remote_addr,
            rkey,
            // Messages are at most 2^31 bytes (checked at post).
            dma_len: length as u32,
        });
    }
    if position.ends() {
        ext.immdt = imm.map(|imm| immdt::Repr { imm });
    }
    Some((opcode, ext))
}

/// Emits a packet without payload; `None` if `buf` is too small.
fn emit(buf: &mut [u8], bth: bth::Repr, ext: packet::ExtHeaders) -> Option<usize> {
    let n = packet::packet_len(bth.opcode, 0);
    packet::emit_headers(buf.get_mut(..n)?, &bth, &ext, 0).ok()?;
    Some(n)
}

/// Reads `out.len()` bytes starting `offset` bytes into the SGE list, each
/// SGE checked against its lkey and `pd`.
/// Lends `len` bytes starting `offset` bytes into the SGE list: checks
/// each piece as [`gather`] does and appends its device address to `out`.
/// False (and `out` as it was) when the memory does not lend a piece.
fn lend(
    keys: &Keys,
    mem: &impl Memory,
    pd: PdHandle,
    sges: &[Sge],
    offset: u64,
    len: usize,
    out: &mut Vec<PayloadRef>,
) -> Result<bool, AccessError> {
    let start = out.len();
    let mut lendable = true;
    walk(sges, offset, len, |sge, at, _, n| {
        let mr = keys.check_local(sge.lkey, pd, sge.addr + at, n as u64, Access::NONE)?;
        if lendable {
            lendable = lend_range(mr, mem, sge.addr + at, n as u64, out)?;
        }
        Ok(())
    })?;
    if !lendable {
        out.truncate(start);
    }
    Ok(lendable)
}

/// Appends the device addresses of `va..va + len` of the (checked) `mr`
/// to `out` if `mem` lends every piece; else leaves `out` as it was.
/// Whether it did.
fn lend_range(
    mr: &Mr,
    mem: &impl Memory,
    va: u64,
    len: u64,
    out: &mut Vec<PayloadRef>,
) -> Result<bool, AccessError> {
    let start = out.len();
    let mut lendable = true;
    mr.for_each_chunk(va, len, |addr, n| {
        // n <= len, which is at most a packet's payload.
        let n = n as usize;
        if lendable && mem.slice(addr, n).is_some() {
            out.push(PayloadRef { addr, len: n });
        } else {
            lendable = false;
        }
        Ok(())
    })?;
    if !lendable {
        out.truncate(start);
    }
    Ok(lendable)
}

fn gather(
    keys: &Keys,
    mem: &impl Memory,
    pd: PdHandle,
    sges: &[Sge],
    offset: u64,
    out: &mut [u8],
) -> Result<(), AccessError> {
    walk(sges, offset, out.len(), |sge, at, done, n| {
        let mr = keys.check_local(sge.lkey, pd, sge.addr + at, n as u64, Access::NONE)?;
        mr.read(mem, sge.addr + at, &mut out[done..done + n])
    })
}

/// Writes `data` starting `offset` bytes into the SGE list (LOCAL_WRITE
/// needed on every MR).
fn scatter(
    keys: &Keys,
    mem: &mut impl Memory,
    pd: PdHandle,
    sges: &[Sge],
    offset: u64,
    data: &[u8],
) -> Result<(), AccessError> {
    walk(sges, offset, data.len(), |sge, at, done, n| {
        let mr = keys.check_local(sge.lkey, pd, sge.addr + at, n as u64, Access::LOCAL_WRITE)?;
        mr.write(mem, sge.addr + at, &data[done..done + n])
    })
}

/// Calls `f(sge, offset_in_sge, bytes_done, n)` for each piece of
/// `len` bytes starting `offset` bytes into the SGE list.
fn walk(
    sges: &[Sge],
    offset: u64,
    len: usize,
    mut f: impl FnMut(&Sge, u64, usize, usize) -> Result<(), AccessError>,
) -> Result<(), AccessError> {
    let mut skip = offset;
    let mut done = 0usize;
    for sge in sges {
        if done == len {
            break;
        }
        let sl = u64::from(sge.length);
        if skip >= sl {
            skip -= sl;
            continue;
        }
        let n = ((sl - skip) as usize).min(len - done);
        f(sge, skip, done, n)?;
        done += n;
        skip = 0;
    }
    if done < len {
        return Err(AccessError::OutOfBounds {
            va: offset,
            len: len as u64,
            start: 0,
            length: sges.iter().map(|s| u64::from(s.length)).sum(),
        });
    }
    Ok(())
}
