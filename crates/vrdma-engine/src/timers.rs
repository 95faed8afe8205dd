//! What the RC requester's timers do when they expire: the local ACK
//! timeout resends from the oldest unacknowledged packet (IBTA Vol1
//! §9.7.6.1, up to retry_cnt times, then RETRY_EXC_ERR); the end of an RNR
//! wait lets the requester send again. The deadlines themselves sit in one
//! heap ([`crate::deadlines`]); the engine pops the due ones and calls
//! here.

use crate::{
    completion::complete_front_with_error, context::Ctx, qp::QpState, qpc::Qp, requester::seek,
    wc::WcStatus,
};

/// The retransmit timer of `q` expired.
pub(crate) fn retransmit_timeout(q: &mut Qp, cx: &mut Ctx) {
    q.req.timer = None;
    let sent = q.req.unacked != q.req.high;
    if !sent || !matches!(q.attr.qp_state, QpState::Rts | QpState::Sqd) {
        return;
    }
    if q.req.retry_left == 0 {
        complete_front_with_error(q, cx, WcStatus::RetryExcErr);
        return;
    }
    q.req.retry_left -= 1;
    // NAKs of packets sent before the timeout start no second retry.
    q.req.retrying = true;
    cx.stats.retry_timeout += 1;
    // Go back to the oldest unacknowledged packet (inside the oldest WQE
    // when part of it was acknowledged), and send that packet twice. After
    // a timeout nothing but the next timeout can tell that this resend was
    // lost too (the responder NAKs a gap only once, IBTA Vol1 §9.7.5.2.2),
    // so each attempt is what retry_cnt counts; two copies make an attempt
    // fail with about p² instead of p at loss rate p (and for a READ, the
    // responder restarting its response on the copy likewise doubles the
    // first response). Responders answer the copy as the duplicate it is.
    let unacked = q.req.unacked;
    q.req.send_twice = Some(unacked);
    let _ = seek(q, cx, unacked);
    restart_timer(q, cx);
}

/// The end of `q`'s RNR wait: the requester may send again.
pub(crate) fn rnr_wait_over(q: &mut Qp, cx: &mut Ctx) {
    q.req.rnr_until = None;
    cx.schedule(q);
}

/// Starts the retransmit timer afresh while requests are outstanding.
pub(crate) fn restart_timer(q: &mut Qp, cx: &mut Ctx) {
    let outstanding = q.req.unacked != q.req.high;
    let due = outstanding
        .then(|| q.ack_timeout().map(|d| cx.now.saturating_add(d)))
        .flatten();
    cx.set_retransmit_timer(q, due);
}
