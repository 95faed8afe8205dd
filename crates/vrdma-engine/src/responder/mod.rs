//! The responder: checks each incoming request's PSN (duplicate, in
//! order, out of order), opcode sequence, keys, rights and bounds, and
//! receive queue; executes SEND, WRITE, READ and atomics; keeps the
//! responder resources that answer a duplicate READ or atomic without
//! running it twice; and sends its ACKs, NAKs, READ responses and atomic
//! acknowledgements in request order ([`emit_response`]).

use vrdma_wire::{
    Gid, Opcode, Psn,
    aeth::{self, NakCode, RnrTimer, Syndrome},
    frame::IpRepr,
    grh,
    opcode::{Operation, Position},
};

use crate::{
    completion::enter_error,
    context::Ctx,
    event::AsyncEvent,
    memory::{Memory, Payload},
    mr::Access,
    qp::QpType,
    qpc::{InMsg, Qp, Resource, RespOut},
    rx::Rx,
    sgl::scatter,
    wc::{NetworkHdr, Wc, WcFlags, WcOpcode, WcStatus},
    window::JUMBO_PSNS,
};

mod responses;

pub(crate) use responses::emit_response;

/// Why an incoming request could not be executed.
enum Failure {
    /// Answer with this NAK (RC) or drop the message (UC).
    Nak(NakCode),
    /// No receive WQE: RNR NAK (RC) or drop (UC).
    Rnr,
    /// A local error on the receive WQE: complete it in error.
    Local(WcStatus),
}

/// A UD datagram.
pub(crate) fn recv_ud(
    q: &mut Qp,
    cx: &mut Ctx,
    ip: &IpRepr,
    r: &Rx<'_, '_>,
    mem: &mut impl Memory,
) {
    let Some(deth) = r.ext.deth else {
        cx.stats.rx_malformed += 1;
        return;
    };
    // IBTA Vol1 §10.2.5 (C10-16): the Q_Key must match.
    if deth.qkey != q.attr.qkey {
        cx.stats.rx_bad_key += 1;
        return;
    }
    let total = (grh::HEADER_LEN + r.payload.len()) as u64;
    match peek_recv_len(q, cx) {
        None => {
            cx.stats.rx_no_recv += 1;
            return;
        }
        Some(room) if room < total => {
            // Too long for the next receive: dropped, the receive kept and
            // the QP left up (a datagram service; rxe does the same).
            cx.stats.rx_too_long += 1;
            return;
        }
        Some(_) => {}
    }
    if !take_recv(q, cx) {
        cx.stats.rx_no_recv += 1;
        return;
    }
    let pd = q.init.pd;
    let cq = q.init.recv_cq;
    let wqe = &q.resp.recv;
    let mut g = [0u8; grh::HEADER_LEN];
    let grh_ok = grh::emit(ip, &mut grh::Packet::new_unchecked(&mut g[..])).is_ok();
    let mut wc = Wc::new(wqe.wr_id, WcStatus::Success, WcOpcode::Recv, q.qpn.value());
    let status = if !grh_ok {
        WcStatus::GeneralErr
    } else {
        let a = scatter(&cx.keys, mem, pd, &wqe.sges, 0, Payload::Bytes(&g))
            .and_then(|()| scatter(&cx.keys, mem, pd, &wqe.sges, 40, r.payload));
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
        wc.network_hdr = Some(match ip {
            IpRepr::V4(_) => NetworkHdr::Ipv4,
            IpRepr::V6(_) => NetworkHdr::Ipv6,
        });
        if let Some(i) = r.ext.immdt {
            wc.imm_data = i.imm;
            wc.wc_flags = wc.wc_flags.with(WcFlags::WITH_IMM);
        }
        wc.pkey_index = q.attr.pkey_index;
    }
    q.resp.has_recv = false;
    cx.post_cqe(cq, wc, r.bth.solicited);
    if status != WcStatus::Success {
        enter_error(q, cx, true);
    }
}

/// The size of the receive WQE the next message would take.
fn peek_recv_len(q: &Qp, cx: &Ctx) -> Option<u64> {
    let rq = match q.init.srq {
        Some(s) => &cx.srqs.get(s.0)?.rq,
        None => &q.rq,
    };
    rq.front().map(|w| w.length)
}

/// Takes the next receive WQE (RQ or SRQ) into the responder.
fn take_recv(q: &mut Qp, cx: &mut Ctx) -> bool {
    let src = match q.init.srq {
        Some(s) => match cx.srqs.get_mut(s.0) {
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
    // IBTA Vol1 §10.2.9.3: an armed SRQ that drops below its limit raises
    // the limit event once and disarms.
    if let Some(s) = q.init.srq
        && let Some(srq) = cx.srqs.get_mut(s.0)
        && srq.attr.srq_limit != 0
        && (srq.rq.len() as u64) < u64::from(srq.attr.srq_limit)
    {
        srq.attr.srq_limit = 0;
        cx.events.push_back(AsyncEvent::SrqLimitReached { srq: s });
    }
    true
}

fn nak(q: &mut Qp, cx: &mut Ctx, psn: Psn, code: NakCode) {
    q.resp.push_ack(psn, Syndrome::Nak(code));
    if code != NakCode::PsnSequenceError {
        q.resp.failed = true;
    }
    cx.schedule(q);
}

fn ack(q: &mut Qp, cx: &mut Ctx, psn: Psn) {
    q.resp
        .push_ack(psn, Syndrome::Ack(aeth::CreditCode::INVALID));
    cx.schedule(q);
}

/// UC and RC SEND and RDMA WRITE packets.
pub(crate) fn recv_request(q: &mut Qp, cx: &mut Ctx, r: &Rx<'_, '_>, mem: &mut impl Memory) {
    let rc = q.init.qp_type == QpType::Rc;
    let psn = r.bth.psn;
    let epsn = q.resp.epsn;
    let info = r.bth.opcode.info();
    let Some(position) = info.position else {
        cx.stats.rx_malformed += 1;
        return;
    };
    if psn != epsn {
        if rc {
            if psn.precedes(epsn) {
                // A duplicate: the ACK may have been lost; acknowledge
                // again with the current MSN (IBTA Vol1 §9.7.5.1.2).
                cx.stats.rx_duplicate += 1;
                ack(q, cx, epsn.wrapping_sub(1));
            } else {
                cx.stats.rx_out_of_sequence += 1;
                if !q.resp.nak_sent {
                    q.resp.nak_sent = true;
                    nak(q, cx, epsn, NakCode::PsnSequenceError);
                }
            }
            return;
        }
        // UC: a gap loses the message in progress; resynchronise on the
        // first packet of the next one (IBTA Vol1 §9.7.5.1.3).
        cx.stats.rx_out_of_sequence += 1;
        // A receive WQE the lost message had started to fill stays held
        // (has_recv) and is reused, from its start, by the next SEND: the
        // lost message never completes, the buffer does.
        if !position.starts() {
            q.resp.msg = InMsg::Dropping;
            q.resp.epsn = psn.wrapping_add(span(r, q));
            return;
        }
        q.resp.msg = InMsg::Idle;
        q.resp.epsn = psn;
    }
    q.resp.nak_sent = false;
    match execute(q, cx, r, position, mem) {
        Ok(()) => {}
        Err(Failure::Nak(code)) if rc => nak(q, cx, psn, code),
        Err(Failure::Rnr) if rc => {
            let timer = q.attr.min_rnr_timer;
            q.resp
                .push_ack(psn, Syndrome::RnrNak(RnrTimer::from_masked(timer)));
            cx.schedule(q);
        }
        Err(Failure::Nak(_) | Failure::Rnr) => {
            // UC: drop the rest of the message.
            cx.stats.rx_no_recv += 1;
            q.resp.msg = if position.ends() {
                InMsg::Idle
            } else {
                InMsg::Dropping
            };
            q.resp.epsn = psn.wrapping_add(span(r, q));
        }
        Err(Failure::Local(WcStatus::LocLenErr)) if !rc => {
            // UC: a message too long for the receive buffer is dropped; the
            // receive WQE is kept for the next message.
            cx.stats.rx_too_long += 1;
            q.resp.msg = if position.ends() {
                InMsg::Idle
            } else {
                InMsg::Dropping
            };
            q.resp.epsn = psn.wrapping_add(span(r, q));
        }
        Err(Failure::Local(status)) => {
            // The receive WQE completes in error and the QP enters ERR, on
            // RC after a NAK: invalid request for a too-long message (class
            // C), remote operational error for a local protection fault
            // (IBTA Vol1 §9.9.3).
            let cq = q.init.recv_cq;
            let wc = Wc::new(q.resp.recv.wr_id, status, WcOpcode::Recv, q.qpn.value());
            q.resp.has_recv = false;
            q.resp.failure_reported = true;
            cx.post_cqe(cq, wc, false);
            if rc {
                let code = if status == WcStatus::LocLenErr {
                    NakCode::InvalidRequest
                } else {
                    NakCode::RemoteOperationalError
                };
                nak(q, cx, psn, code);
            } else {
                enter_error(q, cx, true);
            }
        }
    }
}

/// Runs one in-sequence SEND or WRITE packet.
fn execute(
    q: &mut Qp,
    cx: &mut Ctx,
    r: &Rx<'_, '_>,
    position: Position,
    mem: &mut impl Memory,
) -> Result<(), Failure> {
    let mtu = q.attr.path_mtu.bytes() as usize;
    let len = r.payload.len();
    // IBTA Vol1 §9.7.5.2.5: First and Middle carry exactly one MTU, Last
    // 1..=MTU, Only 0..=MTU — or, from a peer whose medium takes a run of
    // segments, whole MTUs up to the run, and the rest.
    let max = if r.jumbo {
        mtu * JUMBO_PSNS as usize
    } else {
        mtu
    };
    let len_ok = match position {
        Position::First | Position::Middle => len.is_multiple_of(mtu) && (mtu..=max).contains(&len),
        Position::Last => (1..=max).contains(&len),
        Position::Only => len <= max,
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
        q.resp.epsn = r.bth.psn.wrapping_add(span(r, q));
        if position.ends() {
            q.resp.msg = InMsg::Idle;
        }
        return Ok(());
    }
    if !len_ok || !seq_ok {
        cx.stats.rx_malformed += 1;
        return Err(Failure::Nak(NakCode::InvalidRequest));
    }
    let rc = q.init.qp_type == QpType::Rc;

    match op {
        Operation::Send => execute_send(q, cx, r, position, in_msg, mem)?,
        Operation::RdmaWrite => execute_write(q, cx, r, position, in_msg, mem)?,
        _ => return Err(Failure::Nak(NakCode::InvalidRequest)),
    }
    let covered = span(r, q);
    q.resp.epsn = r.bth.psn.wrapping_add(covered);
    if rc && (r.bth.ack_req || position.ends()) {
        // The packet's last PSN: a run of segments is acknowledged whole.
        ack(q, cx, r.bth.psn.wrapping_add(covered - 1));
    }
    Ok(())
}

/// Scatters a checked SEND packet into the receive WQE and, at the
/// message's end, completes the WQE.
fn execute_send(
    q: &mut Qp,
    cx: &mut Ctx,
    r: &Rx<'_, '_>,
    position: Position,
    in_msg: InMsg,
    mem: &mut impl Memory,
) -> Result<(), Failure> {
    let len = r.payload.len();
    let pd = q.init.pd;
    let recv_cq = q.init.recv_cq;
    let qpn = q.qpn;
    let offset = match in_msg {
        // A message under way holds its receive WQE; without one
        // (completed in error) nothing may be written.
        InMsg::Send { .. } if !q.resp.has_recv => {
            return Err(Failure::Nak(NakCode::InvalidRequest));
        }
        InMsg::Send { offset } => offset,
        _ => {
            if !q.resp.has_recv && !take_recv(q, cx) {
                return Err(Failure::Rnr);
            }
            0
        }
    };
    let wqe = &q.resp.recv;
    if offset + len as u64 > wqe.length {
        return Err(Failure::Local(WcStatus::LocLenErr));
    }
    scatter(&cx.keys, mem, pd, &wqe.sges, offset, r.payload)
        .map_err(|_| Failure::Local(WcStatus::LocProtErr))?;
    let end = offset + len as u64;
    if position.ends()
        && let Some(inv) = r.ext.ieth
        && cx.keys.invalidate(inv.rkey.0, pd, Some(qpn)).is_err()
    {
        // IBTA Vol1 §9.4.1.2: the rkey named must be a
        // fast-registered MR of this PD or a type 2 window bound to
        // this QP.
        return Err(Failure::Nak(NakCode::InvalidRequest));
    }
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
        cx.post_cqe(recv_cq, wc, r.bth.solicited);
    }
    Ok(())
}

/// Writes a checked RDMA WRITE packet where its rkey points and, at the
/// end of a WRITE with immediate, completes the receive WQE it consumes.
fn execute_write(
    q: &mut Qp,
    cx: &mut Ctx,
    r: &Rx<'_, '_>,
    position: Position,
    in_msg: InMsg,
    mem: &mut impl Memory,
) -> Result<(), Failure> {
    let len = r.payload.len();
    let pd = q.init.pd;
    let qp_access = q.attr.qp_access_flags;
    let recv_cq = q.init.recv_cq;
    let qpn = q.qpn;
    if position.ends() && r.ext.immdt.is_some() {
        // WRITE with immediate consumes a receive WQE: make sure
        // there is one before anything changes, so that an RNR NAK
        // leaves the message where it was (rxe's check_resource).
        if !q.resp.has_recv && !take_recv(q, cx) {
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
            // IBTA Vol1 §9.7.4.1.2: the QP must allow remote writes
            // and the rkey must grant them over the whole DMA
            // length, in this QP's PD.
            let total = u64::from(reth.dma_len);
            if !qp_access.contains(Access::REMOTE_WRITE) {
                return Err(Failure::Nak(NakCode::RemoteAccessError));
            }
            if total > 0 {
                cx.keys
                    .check_remote(reth.rkey, pd, reth.va, total, Access::REMOTE_WRITE, qpn)
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
        let mr = cx
            .keys
            .check_remote(rkey, pd, va, len as u64, Access::REMOTE_WRITE, qpn)
            .map_err(|_| Failure::Nak(NakCode::RemoteAccessError))?;
        mr.write_payload(mem, va, r.payload)
            .map_err(|_| Failure::Nak(NakCode::RemoteAccessError))?;
    }
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
            cx.post_cqe(recv_cq, wc, r.bth.solicited);
        }
    }
    Ok(())
}

/// The PSNs a SEND or WRITE packet takes: one, or one per MTU of a run of
/// segments — only from a peer that may send runs (a longer packet from
/// any other is refused, or, on UC while dropping, still one packet).
fn span(r: &Rx<'_, '_>, q: &Qp) -> u32 {
    if !r.jumbo {
        return 1;
    }
    let mtu = q.attr.path_mtu.bytes() as usize;
    r.payload.len().div_ceil(mtu).max(1) as u32
}

/// RC responder: an RDMA READ request or an atomic.
pub(crate) fn recv_read_or_atomic(q: &mut Qp, cx: &mut Ctx, r: &Rx<'_, '_>, mem: &mut impl Memory) {
    let psn = r.bth.psn;
    let epsn = q.resp.epsn;
    if psn.precedes(epsn) {
        cx.stats.rx_duplicate += 1;
        duplicate_read_or_atomic(q, cx, r);
        return;
    }
    if psn != epsn {
        cx.stats.rx_out_of_sequence += 1;
        if !q.resp.nak_sent {
            nak(q, cx, epsn, NakCode::PsnSequenceError);
        }
        return;
    }
    let pd = q.init.pd;
    let mtu = u64::from(q.attr.path_mtu.bytes());
    let access = q.attr.qp_access_flags;
    let depth = usize::from(q.attr.max_dest_rd_atomic).max(1);
    let qpn = q.qpn;
    if q.resp.msg != InMsg::Idle {
        // A new request in the middle of a SEND or WRITE.
        nak(q, cx, psn, NakCode::InvalidRequest);
        return;
    }
    // Responder resources (IBTA Vol1 §9.7.5.2.6): more outstanding
    // READs/atomics than max_dest_rd_atomic is an invalid request.
    if q.resp.queued_responses() >= depth {
        nak(q, cx, psn, NakCode::InvalidRequest);
        return;
    }
    let (resource, out, span) = if let Some(reth) = r.ext.reth {
        // IBTA Vol1 §9.7.4.1.2: REMOTE_READ on the QP and the MR.
        let len = u64::from(reth.dma_len);
        let allowed = access.contains(Access::REMOTE_READ)
            && (len == 0
                || cx
                    .keys
                    .check_remote(reth.rkey, pd, reth.va, len, Access::REMOTE_READ, qpn)
                    .is_ok());
        if !allowed {
            nak(q, cx, psn, NakCode::RemoteAccessError);
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
            cx.stats.rx_malformed += 1;
            return;
        };
        // IBTA Vol1 §9.4.5: an aligned 8-byte target, REMOTE_ATOMIC on the
        // QP and the MR.
        if at.va % 8 != 0 {
            nak(q, cx, psn, NakCode::InvalidRequest);
            return;
        }
        let result = if access.contains(Access::REMOTE_ATOMIC) {
            cx.keys
                .check_remote(at.rkey, pd, at.va, 8, Access::REMOTE_ATOMIC, qpn)
                .and_then(|mr| mr.atomic_addr(at.va))
                .ok()
                .and_then(|addr| match r.bth.opcode {
                    Opcode::RcCompareSwap => mem.compare_swap(addr, at.compare, at.swap_add).ok(),
                    _ => mem.fetch_add(addr, at.swap_add).ok(),
                })
        } else {
            None
        };
        let Some(orig) = result else {
            nak(q, cx, psn, NakCode::RemoteAccessError);
            return;
        };
        (
            Resource::Atomic { psn, orig },
            RespOut::Atomic { psn, orig },
            1,
        )
    };
    if q.resp.resources.len() >= depth {
        q.resp.resources.pop_front();
    }
    q.resp.resources.push_back(resource);
    q.resp.out.push_back(out);
    q.resp.epsn = psn.wrapping_add(span);
    q.resp.msn = q.resp.msn.wrapping_add(1);
    q.resp.nak_sent = false;
    cx.schedule(q);
}

/// A duplicate READ or atomic (its response was lost): answered again only
/// if it repeats a request still held as a responder resource — a READ for
/// the same range or the rest of it, an atomic by its PSN, never executed
/// twice — and only while response room is left; anything else is dropped
/// (the requester times out and retries).
fn duplicate_read_or_atomic(q: &mut Qp, cx: &mut Ctx, r: &Rx<'_, '_>) {
    let psn = r.bth.psn;
    // The requester went back to `psn` and will ask again for everything
    // after it: responses still queued from there on are superseded (they
    // would go out twice and hold the room meant for new requests).
    let mtu = u64::from(q.attr.path_mtu.bytes());
    // A queued READ response covers PSNs p..p+span-1: it is kept only if it
    // ends before `psn` (one that merely starts before it would send `psn`
    // twice and hold a second slot for one READ).
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
    if let Some(out) = out {
        q.resp.out.push_back(out);
        cx.schedule(q);
    }
}

/// Whether a packet that claims to be from `q`'s peer is: a connection's
/// packets come from its peer's address to its own (rxe's `check_addr`).
pub(crate) fn from_peer(q: &Qp, ip: &IpRepr) -> bool {
    q.path
        .is_some_and(|p| Gid::from(ip.src()) == p.dgid && Gid::from(ip.dst()) == p.sgid)
}
