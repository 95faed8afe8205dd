//! How send WQEs leave the queue, and what entering ERR does: the
//! bookkeeping the requester, the completer, the responder and the timers
//! share.

use crate::{
    context::Ctx,
    event::AsyncEvent,
    qp::QpState,
    qpc::Qp,
    wc::{Wc, WcOpcode, WcStatus},
    wr::SendOp,
};

/// Completes the oldest send WQE (signaled, or any error) and removes it.
pub(crate) fn retire_front(q: &mut Qp, cx: &mut Ctx, status: WcStatus) {
    let Some(w) = q.sq.front() else {
        return;
    };
    let post = w.signaled || status != WcStatus::Success;
    let mut wc = Wc::new(
        w.wr_id,
        status,
        w.op.map_or(WcOpcode::Send, SendOp::wc_opcode),
        q.qpn.value(),
    );
    if status == WcStatus::Success {
        // ibv_wc byte_len of a send completion: the message length.
        wc.byte_len = u32::try_from(w.length).unwrap_or(u32::MAX);
    }
    let cq = q.init.send_cq;
    q.sq.pop_front();
    q.req.retired = q.req.retired.wrapping_add(1);
    wc.sq_retired = q.req.retired;
    q.req.cursor = q.req.cursor.saturating_sub(1);
    q.req.started = q.req.started.saturating_sub(1);
    if post {
        cx.post_cqe(cq, wc, false);
    }
    check_drained(q, cx);
}

/// Completes the executed local operations at the front of the queue.
pub(crate) fn retire_executed(q: &mut Qp, cx: &mut Ctx) {
    while q.req.cursor > 0 && q.sq.front().is_some_and(|w| w.executed) {
        retire_front(q, cx, WcStatus::Success);
    }
}

/// A requester-side error: the oldest WQE completes with `status` and the
/// QP enters ERR (flushing the rest).
pub(crate) fn complete_front_with_error(q: &mut Qp, cx: &mut Ctx, status: WcStatus) {
    retire_front(q, cx, status);
    enter_error(q, cx, true);
}

/// Completes every WR of a QP in ERR with WR_FLUSH_ERR, in order (IBTA
/// Vol1 §10.3.1 / C10-26: errors always complete, signaled or not); a QP
/// on an SRQ gets the last-WQE-reached event instead of having the shared
/// queue flushed. A CQ that overflows on the way is recorded in the
/// context; the engine takes its other QPs to ERR in turn. Each QP enters
/// ERR once, so that ends.
///
/// `entering` says whether `q` has just entered ERR (rather than being in
/// ERR already, when a WR is posted to it).
pub(crate) fn enter_error(q: &mut Qp, cx: &mut Ctx, entering: bool) {
    q.attr.qp_state = QpState::Err;
    q.attr.cur_qp_state = QpState::Err;
    // Nothing is retried, and nothing more answered, in ERR.
    q.req.timer = None;
    q.req.rnr_until = None;
    q.req.cursor = 0;
    q.req.offset = 0;
    q.req.started = 0;
    q.resp.out.clear();
    let qpn = q.qpn;
    if q.init.srq.is_some() && entering {
        // IBTA Vol1 §11.6.3: a QP on an SRQ that enters ERR will consume
        // no more of the SRQ's WQEs; raised once.
        cx.events
            .push_back(AsyncEvent::QpLastWqeReached { qp: qpn });
    }
    loop {
        let (cq, wc) = if q.resp.has_recv {
            // The receive WQE the responder was filling (taken from the RQ
            // or the SRQ) was posted and never completed.
            q.resp.has_recv = false;
            let wc = Wc::new(
                q.resp.recv.wr_id,
                WcStatus::WrFlushErr,
                WcOpcode::Recv,
                qpn.value(),
            );
            (q.init.recv_cq, wc)
        } else if let Some(w) = q.sq.front() {
            let op = w.op.map_or(WcOpcode::Send, SendOp::wc_opcode);
            // A local operation that ran reports what happened (it took
            // effect: a REG_MR's MR is registered); what never ran is
            // flushed.
            let status = match (w.executed, w.status) {
                (true, Some(e)) => e,
                (true, None) => WcStatus::Success,
                _ => WcStatus::WrFlushErr,
            };
            let mut wc = Wc::new(w.wr_id, status, op, qpn.value());
            q.sq.pop_front();
            q.req.retired = q.req.retired.wrapping_add(1);
            wc.sq_retired = q.req.retired;
            (q.init.send_cq, wc)
        } else if let Some(w) = q.rq.front() {
            let wc = Wc::new(w.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, qpn.value());
            q.rq.pop_front();
            (q.init.recv_cq, wc)
        } else {
            return;
        };
        cx.post_cqe(cq, wc, false);
    }
}

/// A QP draining in SQD whose started WRs have all completed has drained:
/// SQ Drained is raised once if the consumer asked for it
/// (EN_SQD_ASYNC_NOTIFY, IBTA Vol1 §11.6.3.1).
pub(crate) fn check_drained(q: &mut Qp, cx: &mut Ctx) {
    if q.attr.qp_state != QpState::Sqd || !q.attr.sq_draining || q.req.started > 0 {
        return;
    }
    q.attr.sq_draining = false;
    if q.attr.en_sqd_async_notify {
        cx.events.push_back(AsyncEvent::SqDrained { qp: q.qpn });
    }
}
