//! The scheduler: which of a QP's packets goes next — a request of its
//! requester or a response of its responder — and whether the QP has more
//! to send after it. The QPs with something to send wait in the context's
//! transmit queue, each once.

use vrdma_wire::aeth::Syndrome;

use crate::{
    context::Ctx,
    memory::Memory,
    qpc::{Qp, RespOut},
    requester::{can_send_request, emit_request},
    responder::emit_response,
    transmit::Transmit,
};

/// Request packets a QP sends in a row while its responses wait.
const REQUESTS_BEFORE_RESPONSE: u32 = 16;

/// A QP's next packet. Requests go before a waiting plain ACK — a reply
/// the application posted on seeing a message leaves ahead of that
/// message's ACK, which its peer needs less urgently — but at most
/// [`REQUESTS_BEFORE_RESPONSE`] in a row, so that a long message never
/// holds back the answers to its peer's. Every other response goes first:
/// a NAK (a class B–D NAK also ends the QP: nothing more may leave before
/// it) and READ responses and atomic acknowledgements, which the peer's
/// requester is waiting on.
pub(crate) fn next_packet(
    q: &mut Qp,
    cx: &mut Ctx,
    mem: &impl Memory,
    buf: &mut [u8],
) -> Option<Transmit> {
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
        && let Some(t) = emit_request(q, cx, mem, buf)
    {
        q.requests_in_a_row = if waiting { q.requests_in_a_row + 1 } else { 0 };
        return Some(t);
    }
    if let Some(t) = emit_response(q, cx, mem, buf) {
        q.requests_in_a_row = 0;
        return Some(t);
    }
    emit_request(q, cx, mem, buf)
}

/// Whether `q` has another packet to send now.
pub(crate) fn has_tx_work(q: &Qp, cx: &Ctx) -> bool {
    !q.resp.out.is_empty() || can_send_request(q, cx.now)
}
