//! The requester: turns the send queue's WQEs into request packets —
//! segmented to the path MTU, PSNs assigned, the send window, max_rd_atomic
//! and FENCE honoured — and runs the local operations (LOCAL_INV, BIND_MW,
//! REG_MR) in queue order. It also moves its cursor when the completer
//! asks for a resend ([`seek`]).

use vrdma_wire::{
    Opcode, Psn, Qpn,
    opcode::Position,
    packet::{self, ExtHeaders},
    {bth, immdt, reth},
};

use crate::{
    completion::{complete_front_with_error, enter_error, retire_executed, retire_front},
    context::Ctx,
    memory::Memory,
    mr::AccessError,
    qp::{AhAttr, QpState, QpType},
    qpc::Qp,
    sgl::{gather, lend},
    transmit::{Transmit, emit_bare, emit_lent},
    wc::WcStatus,
    window::{MAX_UNACKED_PSNS, PACKETS_PER_ACK_REQ},
    wr::{SendFlags, SendOp, SendWqe},
};

/// The requester may send its next WQE: RTS, not waiting out an RNR
/// delay, and neither max_rd_atomic nor a fence holds it back (IBTA Vol1
/// §10.8.3.3: a fenced WR waits for earlier READs and atomics).
pub(crate) fn can_send_request(q: &Qp, now: u64) -> bool {
    // SQD: what was started before the drain point may still be sent
    // (finishing a message, or resending after a loss), nothing new.
    let state_ok = match q.attr.qp_state {
        QpState::Rts => true,
        QpState::Sqd => q.req.cursor < q.req.started,
        _ => false,
    };
    if !state_ok || q.req.rnr_until.is_some_and(|t| t > now) {
        return false;
    }
    let Some(next) = q.sq.get(q.req.cursor) else {
        return false;
    };
    if q.init.qp_type == QpType::Rc && q.req.unacked.forward_distance(q.req.psn) >= MAX_UNACKED_PSNS
    {
        // The send window is full: wait for an ACK (which schedules the
        // QP again) or the retransmit timer.
        return false;
    }
    if q.req.offset > 0 {
        return true;
    }
    let is_rd = next.op.is_some_and(SendOp::is_read_or_atomic);
    let fenced = next.flags.contains(SendFlags::FENCE);
    if !is_rd && !fenced {
        // The common case needs no count of what is outstanding.
        return true;
    }
    // Count the READs and atomics sent and not yet completed, up to the
    // limit: a fence needs none, a READ or atomic fewer than
    // max_rd_atomic.
    let limit = if fenced {
        1
    } else {
        usize::from(q.attr.max_rd_atomic.max(1))
    };
    let reads = (0..q.req.cursor)
        .filter_map(|i| q.sq.get(i))
        .filter(|w| w.op.is_some_and(SendOp::is_read_or_atomic))
        .take(limit)
        .count();
    reads < limit
}

/// The next request packet of the WQE at the requester's cursor.
pub(crate) fn emit_request(
    q: &mut Qp,
    cx: &mut Ctx,
    mem: &impl Memory,
    buf: &mut [u8],
) -> Option<Transmit> {
    run_local_ops(q, cx);
    if !can_send_request(q, cx.now) {
        return None;
    }
    let cursor = q.req.cursor;
    let w = q.sq.get(cursor)?;
    let op = w.op?;
    let ty = q.init.qp_type;
    let offset = q.req.offset;
    if ty == QpType::Rc && op.is_read_or_atomic() {
        return emit_read_or_atomic(q, cx, cursor, op, offset, buf);
    }
    let (t, segment) = emit_send_or_write(q, cx, mem, buf, cursor, op)?;
    Some(advance(q, cx, segment, t))
}

/// Where a SEND or WRITE packet stands in its message.
struct Segment {
    /// The WQE's place in the send queue.
    cursor: usize,
    /// The message's bytes before the packet.
    offset: u64,
    /// The packet's payload bytes.
    n: u64,
    first: bool,
    last: bool,
    psn: Psn,
    /// The segments (one PSN each) the packet covers, first and last,
    /// counted from the message's start.
    seg_first: u64,
    seg_last: u64,
}

/// The next packet of the SEND or WRITE WQE at `cursor`, its payload lent
/// or copied in, and where it stands in its message; a bad local SGE
/// completes the WQE in error instead.
fn emit_send_or_write(
    q: &mut Qp,
    cx: &mut Ctx,
    mem: &impl Memory,
    buf: &mut [u8],
    cursor: usize,
    op: SendOp,
) -> Option<(Transmit, Segment)> {
    let w = q.sq.get(cursor)?;
    let ty = q.init.qp_type;
    let pd = q.init.pd;
    let mtu = u64::from(q.attr.path_mtu.bytes());
    let offset = q.req.offset;
    let (n, lent) = lend_payload(q, w, cx, mem, offset);
    let first = offset == 0;
    let last = offset + n >= w.length;
    let position = match (first, last) {
        (true, true) => Position::Only,
        (true, false) => Position::First,
        (false, true) => Position::Last,
        (false, false) => Position::Middle,
    };
    let (opcode, ext, dest_qp, ah) = request_headers(q, w, op, position)?;
    let psn = q.req.psn;
    // The segments the packet covers (one PSN each).
    let (seg_first, seg_last) = (offset / mtu, (offset + n.max(1) - 1) / mtu);
    let bth = bth::Repr {
        opcode,
        solicited: last && w.flags.contains(SendFlags::SOLICITED),
        mig_req: false,
        pad_cnt: 0,
        pkey: cx.pkey_of(q.attr.pkey_index),
        fecn: false,
        becn: false,
        dest_qp,
        // An ACK at the end of each message (as rxe) and every
        // PACKETS_PER_ACK_REQ segments inside a long one, so that the send
        // window moves.
        ack_req: ty == QpType::Rc
            && (last || (seg_last + 1) / PACKETS_PER_ACK_REQ > seg_first / PACKETS_PER_ACK_REQ),
        psn,
    };
    let n_bytes = n as usize;
    let emitted = match lent {
        Ok(true) => emit_lent(buf, &bth, &ext, n_bytes).map(|(at, len)| Ok((at, len, n_bytes))),
        Err(e) => Some(Err(e)),
        Ok(false) => {
            // Headers first, then the payload gathered straight into the
            // packet (n <= mtu <= 4096).
            let out = buf.get_mut(..packet::packet_len(opcode, n_bytes))?;
            let at = packet::emit_headers(out, &bth, &ext, n_bytes).ok()?;
            let payload = &mut out[at..at + n_bytes];
            let gathered = if w.is_inline {
                let start = offset as usize;
                payload.copy_from_slice(&w.inline[start..start + n_bytes]);
                Ok(())
            } else {
                gather(&cx.keys, mem, pd, &w.sges, offset, payload)
            };
            Some(gathered.map(|()| (at, out.len(), 0)))
        }
    };
    let (at, len, referenced) = match emitted? {
        Ok(e) => e,
        Err(_) => {
            // IBTA Vol1 §10.7.2.3: a bad local SGE completes the WQE with
            // a local protection error and the QP enters ERR.
            complete_front_with_error(q, cx, WcStatus::LocProtErr);
            return None;
        }
    };
    let Some(t) = path(q, cx, ah) else {
        no_route(q, cx);
        return None;
    };
    let t = Transmit {
        len,
        payload_at: at,
        referenced,
        ..t
    };
    let segment = Segment {
        cursor,
        offset,
        n,
        first,
        last,
        psn,
        seg_first,
        seg_last,
    };
    Some((t, segment))
}

/// The payload bytes of the next packet of WQE `w` from `offset`, and
/// whether the memory lends them (the pieces then in `cx.lent`).
fn lend_payload(
    q: &Qp,
    w: &SendWqe,
    cx: &mut Ctx,
    mem: &impl Memory,
    offset: u64,
) -> (u64, Result<bool, AccessError>) {
    let pd = q.init.pd;
    let mtu = u64::from(q.attr.path_mtu.bytes());
    // A payload the memory lends stays where it is (a gather poll) and
    // may be a run of segments long ([`Ctx::segment`]); one copied into
    // the packet is an MTU at most.
    let mut n = (w.length - offset).min(cx.segment(q));
    let mut lent = Ok(false);
    if n > 0 && !w.is_inline && cx.lend {
        // Pieces of an attempt that produced no packet are not this
        // packet's.
        cx.lent.clear();
        cx.lent_mrs.clear();
        lent = lend(
            &cx.keys,
            mem,
            pd,
            &w.sges,
            offset,
            n as usize,
            &mut cx.lent,
            &mut cx.lent_mrs,
        );
    }
    if lent == Ok(false) {
        n = n.min(mtu);
    }
    (n, lent)
}

/// A SEND or WRITE packet's opcode, extension headers, destination QP and
/// (UD) address vector.
fn request_headers(
    q: &Qp,
    w: &SendWqe,
    op: SendOp,
    position: Position,
) -> Option<(Opcode, ExtHeaders, Qpn, Option<AhAttr>)> {
    let ty = q.init.qp_type;
    let qpn = q.qpn;
    let headers = match (ty, op) {
        (QpType::Ud | QpType::Gsi, SendOp::Send | SendOp::SendWithImm { .. }) => {
            let ud = w.ud?;
            // IBTA Vol1 §10.2.5: a WR Q_Key with the high bit set means
            // "use the QP's own Q_Key".
            let qkey = if ud.remote_qkey.is_controlled() {
                q.attr.qkey
            } else {
                ud.remote_qkey
            };
            let (opcode, imm) = match op {
                SendOp::SendWithImm { imm } => (Opcode::UdSendOnlyImm, Some(imm)),
                _ => (Opcode::UdSendOnly, None),
            };
            let ext = ExtHeaders {
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
    Some(headers)
}

/// Moves the requester past a SEND or WRITE packet that leaves (PSN,
/// cursor, offset, retransmit timer), and completes a UC or UD message
/// once its last packet is out.
fn advance(q: &mut Qp, cx: &mut Ctx, segment: Segment, t: Transmit) -> Transmit {
    let Segment {
        cursor,
        offset,
        n,
        first,
        last,
        psn,
        seg_first,
        seg_last,
    } = segment;
    let ty = q.init.qp_type;
    if q.req.send_twice.take() == Some(psn) {
        // The first packet after a timeout goes out twice (see
        // timers::retransmit_timeout): the same packet again next time.
        cx.stats.tx_retransmitted += 1;
        return t;
    }
    q.req.started = q.req.started.max(cursor + 1);
    if first && let Some(w) = q.sq.get_mut(cursor) {
        w.first_psn = psn;
    }
    q.req.psn = psn.wrapping_add((seg_last - seg_first + 1) as u32);
    let resent = q.req.psn.precedes(q.req.high) || q.req.psn == q.req.high;
    if resent {
        cx.stats.tx_retransmitted += 1;
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
        let due = q.ack_timeout().map(|d| cx.now.saturating_add(d));
        cx.set_retransmit_timer(q, due);
    }
    if last && ty != QpType::Rc {
        // UC and UD complete when the last packet leaves.
        retire_front(q, cx, WcStatus::Success);
        retire_executed(q, cx);
    }
    t
}

/// An RDMA READ request (for what is still missing of the READ) or an
/// atomic request. A READ takes one PSN per response packet.
fn emit_read_or_atomic(
    q: &mut Qp,
    cx: &mut Ctx,
    cursor: usize,
    op: SendOp,
    offset: u64,
    buf: &mut [u8],
) -> Option<Transmit> {
    let w = q.sq.get(cursor)?;
    let mtu = u64::from(q.attr.path_mtu.bytes());
    let psn = q.req.psn;
    let (opcode, ext, span) = match op {
        SendOp::RdmaRead { remote_addr, rkey } => {
            let left = w.length - offset;
            let ext = ExtHeaders {
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
            let ext = ExtHeaders {
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
            let ext = ExtHeaders {
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
        pkey: cx.pkey_of(q.attr.pkey_index),
        fecn: false,
        becn: false,
        dest_qp: q.attr.dest_qp_num,
        ack_req: true,
        psn,
    };
    let len = emit_bare(buf, bth, ext)?;
    let Some(t) = path(q, cx, None) else {
        no_route(q, cx);
        return None;
    };
    let t = Transmit { len, ..t };
    let due = q.ack_timeout().map(|d| cx.now.saturating_add(d));
    if q.req.send_twice.take() == Some(psn) {
        cx.stats.tx_retransmitted += 1;
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
        cx.stats.tx_retransmitted += 1;
    } else {
        q.req.high = q.req.psn;
    }
    q.req.cursor += 1;
    q.req.offset = 0;
    if q.req.timer.is_none() {
        cx.set_retransmit_timer(q, due);
    }
    Some(t)
}

/// Runs the local operations (LOCAL_INV, BIND_MW, REG_MR) at the
/// requester's cursor, in queue order and subject to FENCE; each completes
/// when it reaches the front of the queue. A failure completes it in error
/// and takes the QP to ERR.
fn run_local_ops(q: &mut Qp, cx: &mut Ctx) {
    loop {
        let cursor = q.req.cursor;
        let Some(w) = q.sq.get(cursor) else {
            return;
        };
        let Some(op) = w.op.filter(|o| o.is_local()) else {
            return;
        };
        if !can_send_request(q, cx.now) {
            return;
        }
        if w.executed {
            // A rewind moved the cursor back over an operation that
            // already ran: it is not run again.
            q.req.cursor += 1;
            retire_executed(q, cx);
            continue;
        }
        let pd = q.init.pd;
        let reg_pages = q.sq.get_mut(cursor).and_then(|w| w.reg_pages.take());
        let result = match op {
            SendOp::LocalInv { invalidate } => cx
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
            } => cx
                .keys
                .bind(mw, key, mr, addr, length, access, pd, q.qpn)
                .map(|_| ())
                .map_err(|_| WcStatus::MwBindErr),
            SendOp::RegMr {
                mr,
                key,
                iova,
                length,
                access,
            } => cx
                .keys
                .fast_register(mr, pd, key, iova, length, access, reg_pages)
                .map_err(|_| WcStatus::LocQpOpErr),
            SendOp::Malformed { status } => Err(status),
            _ => Ok(()),
        };
        if let Some(w) = q.sq.get_mut(cursor) {
            w.executed = true;
            w.status = result.err();
        }
        q.req.cursor += 1;
        q.req.offset = 0;
        q.req.started = q.req.started.max(q.req.cursor);
        if result.is_err() {
            enter_error(q, cx, true);
            return;
        }
        retire_executed(q, cx);
    }
}

/// Moves the requester's cursor to the packet with `psn`, in a WQE
/// already started, and schedules sending from there: back to resend
/// (go-back-N), or forward past packets an ACK proved arrived. False when
/// no started WQE holds `psn`.
pub(crate) fn seek(q: &mut Qp, cx: &mut Ctx, psn: Psn) -> bool {
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
        let span = w.psn_span(mtu);
        let d = w.first_psn.forward_distance(psn);
        if d < span {
            found = Some((i, u64::from(d) * u64::from(mtu)));
            break;
        }
    }
    if found.is_none() && psn == q.req.high {
        // Just past the last packet ever sent: after every WQE started
        // (local operations among them have run).
        found = Some((started, 0));
    }
    let Some((cursor, offset)) = found else {
        return false;
    };
    q.req.cursor = cursor;
    q.req.offset = offset;
    q.req.psn = psn;
    cx.schedule(q);
    true
}

/// Where `q`'s packets go: the UD WR's address vector, else the QP's own
/// (kept up to date by modify).
/// The QP's address vector names a source GID the port does not have
/// (unbound since, or a consumer's vector with a bad index): nothing can
/// be sent. As rxe does, the WQE fails with a local QP operation error and
/// the QP enters ERR, rather than waiting for a GID that may never come.
fn no_route(q: &mut Qp, cx: &mut Ctx) {
    cx.lent.clear();
    cx.lent_mrs.clear();
    complete_front_with_error(q, cx, WcStatus::LocQpOpErr);
}

pub(crate) fn path(q: &Qp, cx: &Ctx, ud: Option<crate::qp::AhAttr>) -> Option<Transmit> {
    match ud {
        None => q.path,
        Some(av) => q.route(&cx.port, av),
    }
}

/// The opcode and headers of a UC/RC request packet.
fn connected_request(
    ty: QpType,
    op: SendOp,
    position: Position,
    length: u64,
) -> Option<(Opcode, ExtHeaders)> {
    use Opcode as O;
    use Position as P;
    let rc = ty == QpType::Rc;
    let pick = |rc_op: Opcode, uc_op: Opcode| if rc { rc_op } else { uc_op };
    let mut ext = ExtHeaders::default();
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
        // READ and atomics go through emit_read_or_atomic; local
        // operations send nothing.
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
