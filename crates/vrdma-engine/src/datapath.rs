//! The data path's entry points: packets out ([`Engine::poll_transmit`]),
//! packets in ([`Engine::handle_packet`]) and time
//! ([`Engine::poll_timeout`], [`Engine::handle_timeout`]). Each looks the
//! QP up once and hands it, with the context, to the role that does the
//! work:
//!
//! | module | role |
//! |---|---|
//! | `scheduler` | which QP and which of its packets goes next |
//! | `requester` | send WQEs into request packets; local operations |
//! | `responder` | requests executed; ACKs, NAKs, READ responses, atomic acks |
//! | `completer` | ACKs and responses retire send WQEs; retries |
//! | `timers` | retransmit timeouts and the end of RNR waits |
//! | `completion` | WQEs completed; the error state's flush |
//!
//! Sans-IO: a packet is written into the caller's buffer (BTH through a
//! zeroed ICRC, which the fabric fills in because it covers the IP and UDP
//! headers) and described by a [`Transmit`]; a received packet's ICRC is
//! verified by the fabric before it arrives here. Memory is reached only
//! through the [`Memory`] trait, after the MR checks.
//!
//! What works: UD SEND (with immediate), UC and RC SEND and RDMA WRITE
//! (with immediate) of any length, segmented to the path MTU; RC ACKs
//! (coalesced, one per message or AckReq), in-order completion on ACK,
//! duplicate detection with re-ACK, one PSN-sequence NAK per gap with
//! go-back-N resend, RNR NAK when no receive is posted, and the remote
//! access / invalid request NAKs that move both sides to ERR; a send window
//! of [`MAX_UNACKED_PSNS`], forward
//! progress (the oldest unacknowledged PSN moving) restarting the retry
//! budgets and the timer, one retry at a time, a timeout's first resent
//! packet sent twice; the local ACK timeout (retry_cnt) and the RNR delay
//! (rnr_retry, 7 = forever, backing off); RC RDMA READ and atomics with
//! responder resources, replay of duplicate atomics, max_rd_atomic and
//! FENCE; the local operations LOCAL_INV, BIND_MW and REG_MR (run in queue
//! order, completed in order); SEND with invalidate.

use vrdma_wire::{
    Gid, Psn, Qpn, ServiceType,
    frame::IpRepr,
    opcode::Operation,
    packet::{self, Packet},
};

use crate::{
    completer, completion,
    deadlines::TimerKind,
    engine::Engine,
    event::AsyncEvent,
    fence::Fence,
    memory::{Memory, Payload},
    qp::{QpState, QpType},
    responder,
    rx::Rx,
    scheduler,
    stats::Stats,
    timers,
    transmit::{PayloadRef, Transmit},
};

pub use crate::{
    completer::{RNR_BACKOFF_AFTER, RNR_BACKOFF_CAP},
    window::{JUMBO_PSNS, MAX_UNACKED_PSNS, PACKETS_PER_ACK_REQ},
};

impl Engine {
    /// Data-path counters.
    pub fn stats(&self) -> Stats {
        self.cx.stats
    }

    /// A QP's sequence state, for diagnostics: the PSN its requester sends
    /// next and the PSN its responder expects.
    pub fn qp_psns(&self, qpn: Qpn) -> Option<(Psn, Psn)> {
        let q = self.qps.get(qpn.value())?;
        Some((q.req.psn, q.resp.epsn))
    }

    /// [`Engine::poll_transmit`] for a fabric that sends a packet from
    /// pieces (a gather send): where the payload of a SEND, a WRITE or a
    /// READ response lies in memory that lends it ([`Memory::lends`]), it
    /// is not copied into `buf` but lent — [`Engine::gathered`] lists its
    /// pieces by device address, and the [`Transmit`] says where they go
    /// ([`Transmit::payload_at`], [`Transmit::referenced`]). The pieces
    /// must be read before the memory changes (the caller sends them
    /// before it lets the application touch the memory again); they are
    /// valid until the next poll.
    #[must_use = "the packet written must be sent"]
    pub fn poll_transmit_gather(
        &mut self,
        now: u64,
        mem: &impl Memory,
        buf: &mut [u8],
    ) -> Option<Transmit> {
        self.cx.lent.clear();
        self.cx.lent_mrs.clear();
        self.cx.lend = true;
        let t = self.poll_transmit(now, mem, buf);
        self.cx.lend = false;
        t
    }

    /// The payload pieces of the packet the last
    /// [`Engine::poll_transmit_gather`] lent, in order.
    pub fn gathered(&self) -> &[PayloadRef] {
        &self.cx.lent
    }

    /// Writes the next packet to send into `buf` (at least
    /// [`MAX_PACKET`](crate::transmit::MAX_PACKET) bytes) and says where it
    /// goes; `None` when nothing is waiting. `now` is the caller's clock in
    /// nanoseconds (never going back).
    #[must_use = "the packet written must be sent"]
    pub fn poll_transmit(
        &mut self,
        now: u64,
        mem: &impl Memory,
        buf: &mut [u8],
    ) -> Option<Transmit> {
        self.cx.now = self.cx.now.max(now);
        let mut out = None;
        while let Some(qpn) = self.cx.ready.pop_front() {
            let Some(q) = self.qps.get_mut(qpn.value()) else {
                continue;
            };
            q.scheduled = false;
            // A QP that produced nothing is not put back: what unblocks it
            // (an ACK, a post, a timer) schedules it again. So this loop
            // ends.
            if let Some(t) = scheduler::next_packet(q, &mut self.cx, mem, buf) {
                if scheduler::has_tx_work(q, &self.cx) {
                    self.cx.schedule(q);
                }
                self.cx.stats.tx_packets += 1;
                out = Some(t);
                break;
            }
        }
        self.settle();
        out
    }

    /// The earliest time [`Engine::handle_timeout`] has work: a retransmit
    /// timeout or the end of an RNR delay. Exact: entries of the timer heap
    /// that no longer hold (a timer stopped, or restarted later) are
    /// dropped or moved on the way, so the cost does not grow with the
    /// number of QPs.
    #[must_use]
    pub fn poll_timeout(&mut self) -> Option<u64> {
        loop {
            let (at, qpn, kind) = self.cx.deadlines.peek()?;
            let Some(q) = self
                .qps
                .get_mut(qpn.value())
                .filter(|q| q.queued[kind.index()] == Some(at))
            else {
                // Stale: the QP is gone, or a newer entry stands for it.
                self.cx.deadlines.pop();
                continue;
            };
            let due = q.timer(kind);
            if due == Some(at) {
                return Some(at);
            }
            // Stopped, or restarted later: the entry moves to the real
            // time (an earlier one would have had an entry of its own).
            self.cx.deadlines.pop();
            q.queued[kind.index()] = None;
            if let Some(due) = due {
                self.cx
                    .deadlines
                    .arm(qpn, kind, &mut q.queued[kind.index()], due);
            }
        }
    }

    /// Runs the timers due at `now`: RNR delays end (the request is sent
    /// again); an unacknowledged request times out (IBTA Vol1 §9.7.6.1:
    /// resend from the oldest unacknowledged packet, up to retry_cnt
    /// times, then RETRY_EXC_ERR).
    pub fn handle_timeout(&mut self, now: u64) {
        self.cx.now = self.cx.now.max(now);
        let now = self.cx.now;
        while let Some((at, qpn, kind)) = self.cx.deadlines.peek() {
            if at > now {
                break;
            }
            self.cx.deadlines.pop();
            let Some(q) = self.qps.get_mut(qpn.value()) else {
                continue;
            };
            let slot = &mut q.queued[kind.index()];
            if *slot != Some(at) {
                continue;
            }
            *slot = None;
            match q.timer(kind) {
                None => {}
                Some(due) if due > now => {
                    // Restarted since it was queued: wait on.
                    self.cx
                        .deadlines
                        .arm(qpn, kind, &mut q.queued[kind.index()], due);
                }
                Some(_) => match kind {
                    TimerKind::Rnr => timers::rnr_wait_over(q, &mut self.cx),
                    TimerKind::Retransmit => timers::retransmit_timeout(q, &mut self.cx),
                },
            }
        }
        self.settle();
    }

    /// Handles one received RoCE packet (BTH through ICRC, ICRC already
    /// verified by the fabric); `ip` is the IP header it arrived with.
    pub fn handle_packet(&mut self, now: u64, ip: &IpRepr, roce: &[u8], mem: &mut impl Memory) {
        self.cx.now = self.cx.now.max(now);
        self.cx.stats.rx_packets += 1;
        // `Repr::parse` does every layout check `new_checked` would.
        let Ok(r) = packet::Repr::parse(&Packet::new_unchecked(roce)) else {
            self.cx.stats.rx_malformed += 1;
            return;
        };
        let jumbo = self.cx.jumbo_from(ip);
        let rx = Rx::new(&r, Payload::Bytes(r.payload), jumbo);
        self.handle_rx(ip, &rx, mem);
        self.finish_revocations();
    }

    /// Completes the revocations of MRs a packet invalidated (SEND with
    /// invalidate): returns once no copy from them is under way. After
    /// [`Engine::handle_lent_packet`] the caller calls it once it let go
    /// of the sender's fences, and before it reports completions — two
    /// devices each invalidating an MR the other is copying from would
    /// otherwise wait for each other. ([`Engine::handle_packet`] calls it
    /// itself.)
    #[inline]
    pub fn finish_revocations(&mut self) {
        self.cx.keys.wait_closed();
    }

    /// Handles one received packet whose payload was lent with it rather
    /// than carried: `head` holds its bytes before the payload, up to
    /// `payload_at`, then those after it (pad, ICRC field), and the `len`
    /// payload bytes are left where the sender lent them — `mem` copies
    /// them into place ([`Memory::write_lent`]) once the checks a carried
    /// payload gets (keys, PD, rights, bounds, sequence) allow it. The one
    /// copy of a payload between two devices of one process
    /// (`vrdma_fabric::shm`). The caller then calls
    /// [`Engine::finish_revocations`].
    pub fn handle_lent_packet(
        &mut self,
        now: u64,
        ip: &IpRepr,
        head: &[u8],
        payload_at: usize,
        len: usize,
        mem: &mut impl Memory,
    ) {
        self.cx.now = self.cx.now.max(now);
        self.cx.stats.rx_packets += 1;
        // The headers parse as those of a packet with a payload of len % 4
        // bytes: the same pad, the same headers.
        let small = len % 4;
        let (Some(before), Some(after)) = (head.get(..payload_at), head.get(payload_at..)) else {
            self.cx.stats.rx_malformed += 1;
            return;
        };
        // BTH, the longest extension headers, 3 bytes, pad, ICRC: 50.
        let mut packet = [0u8; 64];
        let total = head.len() + small;
        if total > packet.len() {
            self.cx.stats.rx_malformed += 1;
            return;
        }
        packet[..payload_at].copy_from_slice(before);
        packet[payload_at + small..total].copy_from_slice(after);
        let Ok(r) = packet::Repr::parse(&Packet::new_unchecked(&packet[..total])) else {
            self.cx.stats.rx_malformed += 1;
            return;
        };
        if r.payload.len() != small {
            // The payload is not where the sender said.
            self.cx.stats.rx_malformed += 1;
            return;
        }
        let jumbo = self.cx.jumbo_from(ip);
        let rx = Rx::new(&r, Payload::Lent { at: 0, len }, jumbo);
        self.handle_rx(ip, &rx, mem);
    }

    /// Makes `peers` the addresses whose medium takes a run of up to
    /// [`JUMBO_PSNS`] segments in one packet
    /// (same-host shared memory, which a device asks its transport about):
    /// a payload lent to one of them is not cut into MTUs, and a packet
    /// from one of them may be that long. Each segment still takes its PSN,
    /// so sequence, acknowledgement and retry work as on the wire, and a
    /// peer not named here is sent MTU-sized packets as before.
    pub fn set_jumbo(&mut self, peers: &[Gid]) {
        self.cx.jumbo.clear();
        self.cx.jumbo.extend_from_slice(peers);
    }

    /// Appends to `out` the fences of the MRs the last
    /// [`Engine::poll_transmit_gather`] lent pieces of, each once: a
    /// reader of the pieces after the poll enters them for its copy
    /// ([`crate::fence`]). Asked before the engine is called again (and
    /// only by a caller that lends the pieces on: a clone is an atomic
    /// operation, which a short packet is better without). False if an MR
    /// is not there any more (then the pieces must not be lent on).
    pub fn gathered_fences(&self, out: &mut Vec<Fence>) -> bool {
        for k in &self.cx.lent_mrs {
            match self.cx.keys.fence_of(*k) {
                Some(f) => out.push(f.clone()),
                None => return false,
            }
        }
        true
    }

    fn handle_rx(&mut self, ip: &IpRepr, r: &Rx<'_, '_>, mem: &mut impl Memory) {
        let cx = &mut self.cx;
        let Some(q) = self.qps.get_mut(r.bth.dest_qp.value()) else {
            cx.stats.rx_no_qp += 1;
            return;
        };
        let matches = matches!(
            (q.init.qp_type, r.bth.opcode.service()),
            (QpType::Rc, ServiceType::Rc)
                | (QpType::Uc, ServiceType::Uc)
                | (QpType::Ud | QpType::Gsi, ServiceType::Ud)
        );
        if !matches {
            cx.stats.rx_no_qp += 1;
            return;
        }
        // IBTA Vol1 §9.6.1.1: packets are accepted in RTR, RTS and SQD.
        if !matches!(q.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
            cx.stats.rx_bad_state += 1;
            return;
        }
        // A connection's packets come from its peer to its own address.
        if !q.init.qp_type.is_datagram() && !responder::from_peer(q, ip) {
            cx.stats.rx_bad_addr += 1;
            return;
        }
        if !r.bth.pkey.matches(cx.pkey_of(q.attr.pkey_index)) {
            cx.stats.rx_bad_key += 1;
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
            cx.stats.rx_bad_state += 1;
            return;
        }
        match (q.init.qp_type, op) {
            (QpType::Ud | QpType::Gsi, _) => responder::recv_ud(q, cx, ip, r, mem),
            (QpType::Rc, Operation::Acknowledge) => completer::recv_ack(q, cx, r),
            (QpType::Rc | QpType::Uc, Operation::Send | Operation::RdmaWrite) => {
                responder::recv_request(q, cx, r, mem)
            }
            (
                QpType::Rc,
                Operation::RdmaReadRequest | Operation::CompareSwap | Operation::FetchAdd,
            ) => responder::recv_read_or_atomic(q, cx, r, mem),
            (QpType::Rc, Operation::RdmaReadResponse) => {
                completer::recv_read_response(q, cx, r, mem)
            }
            (QpType::Rc, Operation::AtomicAcknowledge) => completer::recv_atomic_ack(q, cx, r, mem),
            _ => cx.stats.rx_malformed += 1,
        }
        self.settle();
    }

    /// What a role left for the engine: IBTA Vol1 §11.4.2.1, an overflowed
    /// CQ raises the CQ error, and the QPs that complete into it can no
    /// longer report: they enter ERR (whose flush may overflow another CQ
    /// in turn; each QP enters ERR once, so this ends).
    pub(crate) fn settle(&mut self) {
        while let Some(cq) = self.cx.overflowed.pop() {
            self.cx.events.push_back(AsyncEvent::CqErr { cq });
            for (_, q) in self.qps.iter_mut() {
                if (q.init.send_cq == cq || q.init.recv_cq == cq) && q.attr.qp_state != QpState::Err
                {
                    completion::enter_error(q, &mut self.cx, true);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use vrdma_wire::{Gid, Psn, Qpn, ipv4};

    use super::*;
    use crate::{
        attr::{DeviceAttr, Mtu, PortAttr},
        handle::CqHandle,
        memory::VecMemory,
        mr::{Access, MrRequest, Translation},
        qp::{AhAttr, QpAttr, QpCap, QpInitAttr},
        transmit::MAX_PACKET,
        wc::WcStatus,
        wr::{Payload, SendFlags, SendOp, SendWr, Sge},
    };

    const BASE: u64 = 0x1_0000;

    struct End {
        e: Engine,
        mem: VecMemory,
        qpn: Qpn,
        cq: CqHandle,
        lkey: vrdma_wire::Lkey,
        ip: IpRepr,
    }

    fn end(n: u8, idle_qps: u32) -> End {
        let gid = Gid::from(Ipv4Addr::new(127, 0, 0, n));
        let mut e = Engine::new(DeviceAttr::default(), PortAttr::with_gids(&[gid]));
        let pd = e.alloc_pd().unwrap();
        let (cq, _) = e.create_cq(4096, 0).unwrap();
        let (lkey, _) = e
            .reg_mr(MrRequest {
                pd,
                iova: BASE,
                length: 4096,
                access: Access::LOCAL_WRITE,
                translation: Translation::Identity,
            })
            .unwrap();
        let init = QpInitAttr {
            pd,
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
            qp_type: QpType::Rc,
            sq_sig_all: true,
        };
        let (qpn, _) = e.create_qp(init).unwrap();
        for _ in 0..idle_qps {
            e.create_qp(init).unwrap();
        }
        let ip = IpRepr::V4(ipv4::Repr {
            src: Ipv4Addr::new(127, 0, 0, 3 - n),
            dst: Ipv4Addr::new(127, 0, 0, n),
            tos: 0,
            ident: 0,
            dont_frag: true,
            ttl: 64,
            payload_len: 0,
        });
        End {
            e,
            mem: VecMemory::new(BASE, 4096),
            qpn,
            cq,
            lkey,
            ip,
        }
    }

    fn connect(x: &mut End, peer: u8, dest: Qpn) {
        let a = QpAttr {
            port_num: 1,
            ah_attr: AhAttr {
                dgid: Gid::from(Ipv4Addr::new(127, 0, 0, peer)),
                port_num: 1,
                ..AhAttr::default()
            },
            path_mtu: Mtu::Mtu1024,
            dest_qp_num: dest,
            rq_psn: Psn::from_masked(1),
            sq_psn: Psn::from_masked(1),
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
            max_dest_rd_atomic: 1,
            ..QpAttr::default()
        };
        x.e.bring_up_qp(x.qpn, &a).unwrap();
    }

    fn pair() -> (End, End) {
        let (mut a, mut b) = (end(1, 0), end(2, 0));
        let (qa, qb) = (a.qpn, b.qpn);
        connect(&mut a, 2, qb);
        connect(&mut b, 1, qa);
        (a, b)
    }

    /// Moves one packet from `from` to `to`, if `from` has one.
    fn hop(from: &mut End, to: &mut End, buf: &mut [u8]) -> bool {
        let now = from.e.cx.now;
        let Some(t) = from.e.poll_transmit(now, &from.mem, buf) else {
            return false;
        };
        to.e.handle_packet(now, &to.ip, &buf[..t.len], &mut to.mem);
        true
    }

    /// Posts a signaled 64-byte SEND on `a`.
    fn send(a: &mut End, wr_id: u64) {
        let sge = [Sge {
            addr: BASE,
            length: 64,
            lkey: a.lkey,
        }];
        a.e.post_send(
            a.qpn,
            &SendWr {
                wr_id,
                op: SendOp::Send,
                payload: Payload::Sges(&sge),
                flags: SendFlags::SIGNALED,
                ud: None,
            },
        )
        .unwrap();
    }

    #[test]
    fn a_restarted_timer_keeps_one_heap_entry_and_a_stopped_one_none() {
        let (mut a, mut b) = pair();
        let mut buf = vec![0u8; MAX_PACKET];
        for i in 0..1000u64 {
            a.e.cx.now += 1_000;
            send(&mut a, i);
            assert!(hop(&mut a, &mut b, &mut buf), "the SEND leaves");
            assert!(a.e.poll_timeout().is_some(), "armed while unacknowledged");
            // B has no receive posted: it answers with an RNR NAK, which
            // stops the retransmit timer and starts the RNR wait.
            assert!(hop(&mut b, &mut a, &mut buf));
            let wait = a.e.poll_timeout().expect("the RNR wait");
            a.e.handle_timeout(wait);
            b.e.cx.now = wait;
            // Received this time.
            let rsge = [Sge {
                addr: BASE,
                length: 64,
                lkey: b.lkey,
            }];
            b.e.post_recv(
                b.qpn,
                &crate::wr::RecvWr {
                    wr_id: i,
                    sg_list: &rsge,
                },
            )
            .unwrap();
            while hop(&mut a, &mut b, &mut buf) || hop(&mut b, &mut a, &mut buf) {}
            let mut wcs = Vec::new();
            a.e.poll_cq(a.cq, 8, &mut wcs).unwrap();
            assert_eq!(wcs.len(), 1);
            assert_eq!(wcs[0].status, WcStatus::Success);
            // Every timer is stopped: nothing is due, and the heap holds
            // no entry that poll_timeout would report.
            assert_eq!(a.e.poll_timeout(), None, "round {i}");
            assert!(
                a.e.cx.deadlines.len() <= 2,
                "{} entries",
                a.e.cx.deadlines.len()
            );
        }
    }

    #[test]
    fn the_timer_heap_ignores_destroyed_qps() {
        let (mut a, _b) = pair();
        send(&mut a, 1);
        let mut buf = vec![0u8; MAX_PACKET];
        assert!(a.e.poll_transmit(0, &a.mem, &mut buf).is_some());
        assert!(a.e.poll_timeout().is_some());
        a.e.modify_qp(
            a.qpn,
            &QpAttr {
                qp_state: QpState::Reset,
                ..QpAttr::default()
            },
            crate::qp::AttrMask::STATE,
        )
        .unwrap();
        a.e.destroy_qp(a.qpn).unwrap();
        assert_eq!(a.e.poll_timeout(), None);
        a.e.handle_timeout(u64::MAX);
    }

    #[test]
    fn idle_qps_add_no_timer_work() {
        let mut a = end(1, 4000);
        let mut b = end(2, 0);
        let (qa, qb) = (a.qpn, b.qpn);
        connect(&mut a, 2, qb);
        connect(&mut b, 1, qa);
        send(&mut a, 1);
        let mut buf = vec![0u8; MAX_PACKET];
        assert!(hop(&mut a, &mut b, &mut buf));
        assert_eq!(a.e.cx.deadlines.len(), 1, "one armed timer, one entry");
        assert!(a.e.poll_timeout().is_some());
    }
}
