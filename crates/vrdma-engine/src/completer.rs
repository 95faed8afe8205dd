//! The completer: matches ACKs, NAKs, READ responses and atomic
//! acknowledgements to the RC requester's outstanding WQEs, completes them
//! in order, and starts the retries a sequence-error, implied or RNR NAK
//! calls for.

use vrdma_wire::{
    Psn,
    aeth::{NakCode, Syndrome},
};

use crate::{
    completion::{complete_front_with_error, retire_executed, retire_front},
    context::Ctx,
    memory::{Memory, Payload},
    qp::QpState,
    qpc::Qp,
    requester::seek,
    rx::Rx,
    sgl::scatter,
    timers::restart_timer,
    wc::WcStatus,
    window::JUMBO_PSNS,
    wr::SendOp,
};

/// RC, rnr_retry 7 (retry forever): RNR NAKs in a row answered with the
/// advertised wait before the requester starts backing off.
pub const RNR_BACKOFF_AFTER: u32 = 8;

/// RC, rnr_retry 7: the longest back-off wait, ns (unless the responder
/// advertises a longer one).
pub const RNR_BACKOFF_CAP: u64 = 32_000_000;

/// What started a retry (for the counters).
#[derive(Clone, Copy)]
enum Retry {
    SeqNak,
    ImpliedNak,
}

/// Requester: RDMA READ response data for the oldest WQE.
pub(crate) fn recv_read_response(q: &mut Qp, cx: &mut Ctx, r: &Rx<'_, '_>, mem: &mut impl Memory) {
    let psn = r.bth.psn;
    // Only a response to something outstanding counts: a stale or forged
    // one must not acknowledge anything.
    if !outstanding(q, psn) {
        stale(q, cx);
        return;
    }
    // A response acknowledges every earlier request.
    implicit_ack(q, cx, psn);
    if response_lost_before(q, cx, psn) {
        return;
    }
    let Some(w) = q.sq.front() else {
        stale(q, cx);
        return;
    };
    if q.req.started == 0 || !matches!(w.op, Some(SendOp::RdmaRead { .. })) {
        stale(q, cx);
        return;
    }
    let mtu = u64::from(q.attr.path_mtu.bytes());
    let expected = w.first_psn.wrapping_add((w.read_done / mtu) as u32);
    if psn != expected {
        // The answer to a READ asked again from an earlier point.
        stale(q, cx);
        return;
    }
    let Some(position) = r.bth.opcode.info().position else {
        return;
    };
    let len = r.payload.len() as u64;
    let left = w.length - w.read_done;
    // One MTU a packet, or a run of whole ones from a peer whose medium
    // takes it (a Last or Only packet ends the READ).
    let max = if r.jumbo {
        mtu * u64::from(JUMBO_PSNS)
    } else {
        mtu
    };
    let len_ok = match position {
        vrdma_wire::opcode::Position::First | vrdma_wire::opcode::Position::Middle => {
            len.is_multiple_of(mtu) && (mtu..=max).contains(&len) && left > len
        }
        vrdma_wire::opcode::Position::Last => len == left && (1..=max).contains(&len),
        vrdma_wire::opcode::Position::Only => len == left && len <= max,
    };
    if !len_ok {
        complete_front_with_error(q, cx, WcStatus::BadRespErr);
        return;
    }
    let written = scatter(&cx.keys, mem, q.init.pd, &w.sges, w.read_done, r.payload);
    if written.is_err() {
        complete_front_with_error(q, cx, WcStatus::LocProtErr);
        return;
    }
    if let Some(w) = q.sq.get_mut(0) {
        w.read_done += len;
    }
    if position.ends() {
        progress(q, cx);
    } else {
        acknowledged_before(q, cx, psn.wrapping_add((len / mtu) as u32));
    }
}

/// Requester: the acknowledgement of the oldest WQE, an atomic.
pub(crate) fn recv_atomic_ack(q: &mut Qp, cx: &mut Ctx, r: &Rx<'_, '_>, mem: &mut impl Memory) {
    let psn = r.bth.psn;
    if !outstanding(q, psn) {
        stale(q, cx);
        return;
    }
    implicit_ack(q, cx, psn);
    if response_lost_before(q, cx, psn) {
        return;
    }
    let (Some(w), Some(ack)) = (q.sq.front(), r.ext.atomic_ack_eth) else {
        cx.stats.rx_malformed += 1;
        return;
    };
    if q.req.started == 0 || !w.op.is_some_and(SendOp::is_atomic) || w.first_psn != psn {
        stale(q, cx);
        return;
    }
    // The value found goes to the local buffer in host byte order.
    if scatter(
        &cx.keys,
        mem,
        q.init.pd,
        &w.sges,
        0,
        Payload::Bytes(&ack.orig.to_le_bytes()),
    )
    .is_err()
    {
        complete_front_with_error(q, cx, WcStatus::LocProtErr);
        return;
    }
    progress(q, cx);
}

/// A response to a later request (`psn`) while the oldest WQE, a READ or
/// an atomic, still waits for a response at an earlier PSN: that response
/// was lost (IBTA Vol1 §9.7.5.1.4, the implied NAK; rxe's completer
/// retries at once too). Asks again from what is missing, counted like a
/// NAK, instead of waiting for the local ACK timeout; true when it did.
/// The responses after the lost one that are still coming, possibly a
/// long queue of them, are dropped, but they show the responder working.
fn response_lost_before(q: &mut Qp, cx: &mut Ctx, psn: Psn) -> bool {
    let Some(w) = q.sq.front() else {
        return false;
    };
    if q.req.started == 0 || !w.op.is_some_and(SendOp::is_read_or_atomic) {
        return false;
    }
    let mtu = u64::from(q.attr.path_mtu.bytes());
    let missing = w.first_psn.wrapping_add((w.read_done / mtu) as u32);
    if !missing.precedes(psn) {
        return false;
    }
    cx.stats.rx_out_of_sequence += 1;
    retry_from_unacked(q, cx, Retry::ImpliedNak);
    responder_alive(q, cx);
    true
}

/// Completes the oldest WQE, acknowledged, successfully: its PSNs are
/// forward progress.
fn progress(q: &mut Qp, cx: &mut Ctx) {
    let Some(last) = q.sq.front().map(|w| w.last_psn(q.attr.path_mtu.bytes())) else {
        return;
    };
    retire_front(q, cx, WcStatus::Success);
    retire_executed(q, cx);
    acknowledged_before(q, cx, last.next());
    // A READ or atomic slot may have freed a stalled WQE.
    cx.schedule(q);
}

/// Completes the SENDs and WRITEs sent before `psn` (a response to a later
/// request acknowledges them).
fn implicit_ack(q: &mut Qp, cx: &mut Ctx, psn: Psn) {
    while let Some(w) = q.sq.front() {
        let last = w.last_psn(q.attr.path_mtu.bytes());
        if q.req.started == 0 || w.op.is_some_and(SendOp::is_read_or_atomic) || !last.precedes(psn)
        {
            return;
        }
        progress(q, cx);
    }
}

/// The completer: an ACK or NAK for this QP's requests.
pub(crate) fn recv_ack(q: &mut Qp, cx: &mut Ctx, r: &Rx<'_, '_>) {
    let Some(a) = r.ext.aeth else {
        cx.stats.rx_malformed += 1;
        return;
    };
    let psn = r.bth.psn;
    // ACKs and NAKs only count for what is outstanding; a stale one
    // acknowledges nothing and spends no retries.
    if !outstanding(q, psn) {
        stale(q, cx);
        return;
    }
    match a.syndrome {
        Syndrome::Ack(_) => acked_through(q, cx, psn),
        Syndrome::Nak(NakCode::PsnSequenceError) => {
            // Everything before `psn` arrived; resend from `psn` (go-back-N,
            // IBTA Vol1 §9.7.5.1.3), counted against retry_cnt like a
            // timeout.
            acked_through(q, cx, psn.wrapping_sub(1));
            retry_from_unacked(q, cx, Retry::SeqNak);
        }
        Syndrome::RnrNak(timer) => {
            // IBTA Vol1 §9.7.5.2.8: wait the advertised time, then resend.
            acked_through(q, cx, psn.wrapping_sub(1));
            cx.stats.rnr_naks += 1;
            let mut wait = u64::from(timer.micros()) * 1000;
            if q.attr.rnr_retry == 7 {
                // Forever, but backing off: past RNR_BACKOFF_AFTER NAKs in
                // a row the wait doubles each time, up to RNR_BACKOFF_CAP
                // (or the advertised wait if longer), so a receiver that
                // never posts costs a bounded trickle of packets, never a
                // spin.
                q.req.rnr_streak = q.req.rnr_streak.saturating_add(1);
                let doublings = q.req.rnr_streak.saturating_sub(RNR_BACKOFF_AFTER);
                if doublings > 0 {
                    let backed = wait.saturating_mul(1u64 << doublings.min(32));
                    wait = backed.min(RNR_BACKOFF_CAP.max(wait));
                }
            } else {
                if q.req.rnr_left == 0 {
                    complete_front_with_error(q, cx, WcStatus::RnrRetryExcErr);
                    return;
                }
                q.req.rnr_left -= 1;
            }
            let until = cx.now.saturating_add(wait);
            // acked_through may already have gone back further (to a READ
            // whose response never came); the delay holds either way.
            let _ = seek(q, cx, psn);
            if matches!(q.attr.qp_state, QpState::Rts | QpState::Sqd) {
                cx.set_retransmit_timer(q, None);
                cx.set_rnr_until(q, Some(until));
            }
        }
        Syndrome::Nak(code) => {
            acked_through(q, cx, psn.wrapping_sub(1));
            let status = match code {
                NakCode::RemoteAccessError => WcStatus::RemAccessErr,
                NakCode::RemoteOperationalError => WcStatus::RemOpErr,
                NakCode::InvalidRdRequest => WcStatus::RemInvRdReqErr,
                _ => WcStatus::RemInvReqErr,
            };
            complete_front_with_error(q, cx, status);
        }
    }
}

/// Completes, in order, every sent WQE whose last packet is at or before
/// `psn`.
fn acked_through(q: &mut Qp, cx: &mut Ctx, psn: Psn) {
    while let Some(w) = q.sq.front() {
        if q.req.started == 0 || w.op.is_some_and(SendOp::is_local) {
            return;
        }
        // The oldest WQE is done when its last packet is acknowledged, even
        // if a rewind has the cursor resending it.
        let mtu = q.attr.path_mtu.bytes();
        let last = w.last_psn(mtu);
        if !(last == psn || last.precedes(psn)) {
            // Part of a multi-packet SEND or WRITE is acknowledged.
            if !w.op.is_some_and(SendOp::is_read_or_atomic) {
                acknowledged_before(q, cx, psn.next());
            }
            return;
        }
        if w.op.is_some_and(SendOp::is_read_or_atomic) {
            // A later PSN is acknowledged but this READ or atomic's response
            // never came: it was lost. Ask again from what is missing (IBTA
            // Vol1 §9.7.5.1.4, implicit NAK).
            let missing = w
                .first_psn
                .wrapping_add((w.read_done / u64::from(mtu)) as u32);
            acknowledged_before(q, cx, missing);
            retry_from_unacked(q, cx, Retry::ImpliedNak);
            return;
        }
        progress(q, cx);
    }
}

/// Everything before `next` is acknowledged. When that moves the oldest
/// unacknowledged PSN forward, the peer made progress: the retry budgets
/// and the timer start again (IBTA Vol1 §9.7.6.1.3, as rxe), and the send
/// window may have opened.
fn acknowledged_before(q: &mut Qp, cx: &mut Ctx, next: Psn) {
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
    // A resend (after a timeout or NAK) was overtaken by an ACK for packets
    // sent before it: those arrived, so the resend skips ahead to what is
    // still unacknowledged. Local operations the cursor passed have run:
    // they complete once at the front.
    if q.req.psn.precedes(next) && seek(q, cx, next) {
        retire_executed(q, cx);
    }
    restart_timer(q, cx);
    cx.schedule(q);
}

/// A retry after a sequence-error NAK or an implied one (a later PSN
/// answered first): resend from the oldest unacknowledged PSN, counted
/// against retry_cnt like a timeout (IBTA Vol1 §9.7.5.1.3), so that a peer
/// that keeps answering out of order ends in RETRY_EXC_ERR instead of a
/// storm. While a retry is under way and nothing new is acknowledged, more
/// NAKs (stale ones still on the wire, or ones the resent packets'
/// reordering causes) start no other (as rxe's started_retry).
fn retry_from_unacked(q: &mut Qp, cx: &mut Ctx, why: Retry) {
    if q.req.retrying {
        return;
    }
    q.req.retrying = true;
    match why {
        Retry::SeqNak => cx.stats.retry_seq_nak += 1,
        Retry::ImpliedNak => cx.stats.retry_implied_nak += 1,
    }
    if q.req.retry_left == 0 {
        complete_front_with_error(q, cx, WcStatus::RetryExcErr);
        return;
    }
    q.req.retry_left -= 1;
    let unacked = q.req.unacked;
    let _ = seek(q, cx, unacked);
}

/// A response for nothing outstanding: the answer to a duplicate, or one
/// overtaken on the wire. It acknowledges nothing and spends no retries,
/// but the responder sent it (see [`responder_alive`]).
fn stale(q: &mut Qp, cx: &mut Ctx) {
    cx.stats.rx_duplicate += 1;
    responder_alive(q, cx);
}

/// A response that acknowledged nothing new still shows that the responder
/// is alive and working through what it was sent: while requests are
/// outstanding and the retransmit timer runs, the timer starts again (as
/// rxe's completer re-arms its timer after every response it takes in). A
/// responder slower than the wire, answering a backlog of duplicates that
/// earlier resends queued up, then is neither given up on after retry_cnt
/// timeouts its own backlog caused nor sent yet another window of
/// duplicates each time; one that answers nothing still times out as
/// before. The retry budget is refilled only by progress.
fn responder_alive(q: &mut Qp, cx: &mut Ctx) {
    // Not while an RNR wait holds the requester (its timer is stopped),
    // nor outside RTS and SQD.
    if q.req.timer.is_some() && matches!(q.attr.qp_state, QpState::Rts | QpState::Sqd) {
        restart_timer(q, cx);
    }
}

/// True when `psn` belongs to a request sent and not yet acknowledged (from
/// the oldest unacknowledged PSN up to the last PSN ever sent, also when a
/// resend has the cursor further back). A response or NAK for anything
/// earlier is stale: a duplicate, or overtaken on the wire.
fn outstanding(q: &Qp, psn: Psn) -> bool {
    let oldest = q.req.unacked;
    oldest.forward_distance(psn) < oldest.forward_distance(q.req.high)
}
