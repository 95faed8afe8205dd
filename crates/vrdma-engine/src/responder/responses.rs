//! The responder's packets: ACKs and NAKs, READ responses and atomic
//! acknowledgements, sent in the order their requests came
//! ([`emit_response`]).

use core::ops::ControlFlow;

use vrdma_wire::{
    Msn, Opcode, PKey, Psn, Qpn, Rkey,
    aeth::{self, NakCode, Syndrome},
    bth,
    packet::{self, ExtHeaders},
};

use crate::{
    completion::enter_error,
    context::Ctx,
    event::AsyncEvent,
    memory::Memory,
    mr::Access,
    qp::QpState,
    qpc::{Qp, RespOut},
    requester::path,
    sgl::lend_range,
    transmit::{Transmit, emit_bare, emit_lent},
};

/// The responder's next packet: an ACK/NAK, a READ response or an atomic
/// acknowledgement, in the order the requests came.
pub(crate) fn emit_response(
    q: &mut Qp,
    cx: &mut Ctx,
    mem: &impl Memory,
    buf: &mut [u8],
) -> Option<Transmit> {
    loop {
        if !matches!(q.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
            q.resp.out.clear();
            return None;
        }
        let item = q.resp.out.pop_front()?;
        match response(q, cx, item, mem, buf) {
            Response::Packet(t) => return t,
            // A READ response whose MR went away: the NAK goes out instead.
            Response::Retry => {}
        }
    }
}

/// What one queued response item became.
enum Response {
    Packet(Option<Transmit>),
    /// It was replaced at the front of the queue: take it again.
    Retry,
}

/// The packet one queued response item becomes, written into `buf`.
fn response(
    q: &mut Qp,
    cx: &mut Ctx,
    item: RespOut,
    mem: &impl Memory,
    buf: &mut [u8],
) -> Response {
    let headers = ResponseHeaders {
        msn: q.resp.msn,
        dest: q.attr.dest_qp_num,
        pkey: cx.pkey_of(q.attr.pkey_index),
    };
    let written = match item {
        RespOut::Ack { psn, syndrome } => ack_response(q, cx, &headers, psn, syndrome, buf),
        RespOut::Atomic { psn, orig } => atomic_response(&headers, psn, orig, buf),
        RespOut::Read {
            rkey,
            va,
            len,
            psn,
            sent,
        } => {
            let read = ReadUnderWay {
                rkey,
                va,
                len,
                psn,
                sent,
            };
            read_response(q, cx, &headers, read, mem, buf)
        }
    };
    let written = match written {
        ControlFlow::Continue(written) => written,
        ControlFlow::Break(done) => return done,
    };
    Response::Packet(path(q, cx, None).map(|t| Transmit {
        len: written.len,
        payload_at: written.payload_at,
        referenced: written.referenced,
        ..t
    }))
}

/// The header fields every response of one QP carries, as they stand
/// when its next item is taken.
struct ResponseHeaders {
    msn: Msn,
    dest: Qpn,
    pkey: PKey,
}

impl ResponseHeaders {
    /// The BTH of a response with this opcode and PSN.
    fn bth(&self, opcode: Opcode, psn: Psn) -> bth::Repr {
        bth::Repr {
            opcode,
            solicited: false,
            mig_req: false,
            pad_cnt: 0,
            pkey: self.pkey,
            fecn: false,
            becn: false,
            dest_qp: self.dest,
            ack_req: false,
            psn,
        }
    }

    /// The AETH with this syndrome and the responder's MSN.
    fn ack(&self, syndrome: Syndrome) -> aeth::Repr {
        aeth::Repr {
            syndrome,
            msn: self.msn,
        }
    }
}

/// A response packet written into the buffer: its whole length, and where
/// a payload lent by a gather poll goes and how long it is (0 and 0 when
/// the buffer holds the whole packet).
struct Written {
    len: usize,
    payload_at: usize,
    referenced: usize,
}

impl Written {
    /// A packet the buffer holds whole.
    fn whole(len: usize) -> Self {
        Written {
            len,
            payload_at: 0,
            referenced: 0,
        }
    }
}

/// A queued READ response: `len` bytes at `va` under `rkey`, the first
/// packet at `psn`; `sent` bytes so far.
struct ReadUnderWay {
    rkey: Rkey,
    va: u64,
    len: u64,
    psn: Psn,
    sent: u64,
}

/// Writes an ACK or NAK; after a NAK of class B to D, the QP enters ERR
/// and the response is final (`Break`).
fn ack_response(
    q: &mut Qp,
    cx: &mut Ctx,
    headers: &ResponseHeaders,
    psn: Psn,
    syndrome: Syndrome,
    buf: &mut [u8],
) -> ControlFlow<Response, Written> {
    let qpn = q.qpn;
    let ext = ExtHeaders {
        aeth: Some(headers.ack(syndrome)),
        ..Default::default()
    };
    let n = emit_bare(buf, headers.bth(Opcode::RcAcknowledge, psn), ext);
    if let Syndrome::Nak(code) = syndrome
        && code != NakCode::PsnSequenceError
    {
        // Class B–D errors (IBTA Vol1 §9.9.3): the responder enters
        // ERR once its NAK is out, and says why in an affiliated
        // asynchronous event (IBTA Vol1 §11.6.3.2), since no
        // completion reports it.
        let Some(len) = n else {
            return ControlFlow::Break(Response::Packet(None));
        };
        let t = path(q, cx, None).map(|t| Transmit { len, ..t });
        let event = match code {
            NakCode::RemoteAccessError => AsyncEvent::QpAccessErr { qp: qpn },
            NakCode::RemoteOperationalError => AsyncEvent::QpFatal { qp: qpn },
            _ => AsyncEvent::QpReqErr { qp: qpn },
        };
        // Affiliated errors are for what no completion reports; a
        // receive completed in error already said it.
        if !q.resp.failure_reported {
            cx.events.push_back(event);
        }
        enter_error(q, cx, true);
        return ControlFlow::Break(Response::Packet(t));
    }
    match n {
        Some(n) => ControlFlow::Continue(Written::whole(n)),
        None => ControlFlow::Break(Response::Packet(None)),
    }
}

/// Writes an atomic acknowledgement with the value the atomic found.
fn atomic_response(
    headers: &ResponseHeaders,
    psn: Psn,
    orig: u64,
    buf: &mut [u8],
) -> ControlFlow<Response, Written> {
    let ok = Syndrome::Ack(aeth::CreditCode::INVALID);
    let ext = ExtHeaders {
        aeth: Some(headers.ack(ok)),
        atomic_ack_eth: Some(vrdma_wire::atomic::ack::Repr { orig }),
        ..Default::default()
    };
    match emit_bare(buf, headers.bth(Opcode::RcAtomicAcknowledge, psn), ext) {
        Some(n) => ControlFlow::Continue(Written::whole(n)),
        None => ControlFlow::Break(Response::Packet(None)),
    }
}

/// Writes the next packet of a READ response and queues what is left of
/// it; an MR that fails its check again queues a NAK in its place
/// (`Break` with a retry).
fn read_response(
    q: &mut Qp,
    cx: &mut Ctx,
    headers: &ResponseHeaders,
    read: ReadUnderWay,
    mem: &impl Memory,
    buf: &mut [u8],
) -> ControlFlow<Response, Written> {
    let ReadUnderWay {
        rkey,
        va,
        len,
        psn,
        sent,
    } = read;
    let pd = q.init.pd;
    let qpn = q.qpn;
    let mtu = u64::from(q.attr.path_mtu.bytes());
    // A READ response's payload lent by a gather poll.
    let (mut payload_at, mut referenced) = (0, 0);
    let ok = Syndrome::Ack(aeth::CreditCode::INVALID);
    // The MR is checked again: it may have been deregistered since
    // the request was accepted. A payload the memory lends stays
    // there (a gather poll) and may be a run of segments long
    // ([`Ctx::segment`]); one read into the packet is an MTU at
    // most. A zero-length READ touches no memory and needs no key
    // (IBTA Vol1 §9.4.3).
    let mut n = (len - sent).min(cx.segment(q));
    let mut lent = Ok(false);
    if n > 0 && cx.lend {
        let (lent_refs, fences) = (&mut cx.lent, &mut cx.lent_mrs);
        lent_refs.clear();
        fences.clear();
        lent = cx
            .keys
            .check_remote(rkey, pd, va + sent, n, Access::REMOTE_READ, qpn)
            .and_then(|mr| lend_range(mr, mem, va + sent, n, lent_refs, fences));
    }
    if lent == Ok(false) {
        n = n.min(mtu);
    }
    let first = sent == 0;
    let last = sent + n >= len;
    let (opcode, with_aeth) = match (first, last) {
        (true, true) => (Opcode::RcReadResponseOnly, true),
        (true, false) => (Opcode::RcReadResponseFirst, true),
        (false, true) => (Opcode::RcReadResponseLast, true),
        (false, false) => (Opcode::RcReadResponseMiddle, false),
    };
    let ppsn = psn.wrapping_add((sent / mtu.max(1)) as u32);
    let ext = ExtHeaders {
        aeth: with_aeth.then(|| headers.ack(ok)),
        ..Default::default()
    };
    let n_bytes = n as usize;
    let read = match lent {
        Ok(true) => {
            let Some((at, total)) = emit_lent(buf, &headers.bth(opcode, ppsn), &ext, n_bytes)
            else {
                return ControlFlow::Break(Response::Packet(None));
            };
            (payload_at, referenced) = (at, n_bytes);
            Ok(total)
        }
        Err(e) => Err(e),
        Ok(false) => {
            // n <= mtu <= 4096.
            let Some(out) = buf.get_mut(..packet::packet_len(opcode, n_bytes)) else {
                return ControlFlow::Break(Response::Packet(None));
            };
            let Ok(at) = packet::emit_headers(out, &headers.bth(opcode, ppsn), &ext, n_bytes)
            else {
                return ControlFlow::Break(Response::Packet(None));
            };
            let total = out.len();
            if n == 0 {
                Ok(total)
            } else {
                cx.keys
                    .check_remote(rkey, pd, va + sent, n, Access::REMOTE_READ, qpn)
                    .and_then(|mr| mr.read(mem, va + sent, &mut out[at..at + n_bytes]))
                    .map(|()| total)
            }
        }
    };
    let Ok(written) = read else {
        q.resp.out.push_front(RespOut::Ack {
            psn: ppsn,
            syndrome: Syndrome::Nak(NakCode::RemoteAccessError),
        });
        return ControlFlow::Break(Response::Retry);
    };
    if !last {
        q.resp.out.push_front(RespOut::Read {
            rkey,
            va,
            len,
            psn,
            sent: sent + n,
        });
    }
    ControlFlow::Continue(Written {
        len: written,
        payload_at,
        referenced,
    })
}
