//! Posting work requests: sends (with the checks rxe's post_send makes)
//! and receives, to a QP's own queues or to an SRQ.

use vrdma_wire::Qpn;

use super::{Engine, protection::check_pages, qp_mut};
use crate::{
    completion,
    error::{Kind, Result, VerbsError, within},
    handle::SrqHandle,
    mr::Translation,
    qp::{AhAttr, QpCap, QpState, QpType},
    qpc::Qp,
    wr::{Av, Payload, RecvWqe, RecvWr, SendFlags, SendOp, SendWqe, SendWr},
};

impl Engine {
    /// `ibv_post_send`: validates the WR and queues it. The QP must be in
    /// RTS or SQD (or ERR, where the WR completes at once with
    /// WR_FLUSH_ERR); a full send queue is ENOMEM, anything malformed
    /// EINVAL, as rxe's post_send returns.
    pub fn post_send(&mut self, qpn: Qpn, wr: &SendWr<'_>) -> Result<()> {
        self.post_send_with(qpn, wr, None)
    }

    /// A REG_MR work request that carries its page list, as a device
    /// ABI's fast-register WQE does (PVRDMA's): the pages are mapped into
    /// the MR when the REG_MR runs, in its turn, and only if the MR is then
    /// free — not when it is posted, when the MR may still be in use or be
    /// what an earlier REG_MR in the queue registers.
    pub fn post_reg_mr(&mut self, qpn: Qpn, wr: &SendWr<'_>, pages: Translation) -> Result<()> {
        if !matches!(wr.op, SendOp::RegMr { .. }) {
            return Err(VerbsError::Invalid {
                what: "a page list for an operation other than REG_MR",
            });
        }
        if !matches!(pages, Translation::Pages { .. }) {
            return Err(VerbsError::Invalid {
                what: "fast-registration mapping (a page list is required)",
            });
        }
        check_pages(&pages)?;
        self.post_send_with(qpn, wr, Some(pages))
    }

    /// Checks a send WR against its QP and queues it, with the page list a
    /// REG_MR carries (`post_send` and `post_reg_mr`).
    fn post_send_with(
        &mut self,
        qpn: Qpn,
        wr: &SendWr<'_>,
        reg_pages: Option<Translation>,
    ) -> Result<()> {
        let q = self.qp(qpn)?;
        let state = q.attr.qp_state;
        if !matches!(state, QpState::Rts | QpState::Sqd | QpState::Err) {
            return Err(VerbsError::Invalid {
                what: "QP state for posting sends (not RTS, SQD or ERR)",
            });
        }
        if !wr.flags.known() {
            return Err(VerbsError::Invalid { what: "send flags" });
        }
        let ty = q.init.qp_type;
        check_send_op(ty, wr.op)?;
        let cap = q.attr.cap;
        let length = send_length(wr, &cap)?;
        check_atomic(wr, length)?;
        let ud_av = self.send_destination(q, wr, length)?;
        // Local operations move no data.
        let length = if wr.op.is_local() { 0 } else { length };
        let signaled = q.init.sq_sig_all || wr.flags.contains(SendFlags::SIGNALED);

        let q = qp_mut(&mut self.qps, qpn)?;
        let Some(slot) = q.sq.next_free() else {
            return Err(VerbsError::QueueFull {
                what: "send queue",
                depth: cap.max_send_wr,
            });
        };
        fill_send(slot, wr, length, signaled, ud_av, reg_pages);
        q.sq.commit();
        match state {
            QpState::Err => completion::enter_error(q, &mut self.cx, false),
            QpState::Rts => self.cx.schedule(q),
            // SQD: queued until the QP is back in RTS.
            _ => {}
        }
        self.settle();
        Ok(())
    }

    /// The address vector a UD send goes to (from its AH, which must be of
    /// the QP's PD, or carried in the WR), once the message's length fits
    /// the QP's type; `None` for a connected QP or a local operation.
    fn send_destination(&self, q: &Qp, wr: &SendWr<'_>, length: u64) -> Result<Option<AhAttr>> {
        let mut ud_av = None;
        match q.init.qp_type {
            // Local operations go nowhere.
            _ if wr.op.is_local() => {}
            QpType::Ud | QpType::Gsi => {
                let Some(ud) = wr.ud else {
                    return Err(VerbsError::Invalid {
                        what: "UD send without a destination",
                    });
                };
                ud_av = Some(match ud.av {
                    Av::Handle(h) => {
                        let ah = self.ahs.get(h.0).ok_or(VerbsError::NotFound {
                            kind: Kind::Ah,
                            handle: h.0,
                        })?;
                        if ah.pd != q.init.pd {
                            return Err(VerbsError::Invalid {
                                what: "address handle of another PD",
                            });
                        }
                        ah.attr
                    }
                    Av::Inline(attr) => attr.masked(),
                });
                // A UD message is one packet.
                within("UD message", length, q.attr.path_mtu.bytes().into())?;
            }
            QpType::Rc | QpType::Uc => {
                // IBTA Vol1 §9.7.5: messages up to 2^31 bytes.
                within("message length", length, 1 << 31)?;
            }
        }
        Ok(ud_av)
    }

    /// `ibv_post_recv`: the QP must be past RESET and have its own receive
    /// queue (EINVAL with an SRQ); in ERR the WR is flushed at once.
    pub fn post_recv(&mut self, qpn: Qpn, wr: &RecvWr<'_>) -> Result<()> {
        let q = self.qp(qpn)?;
        let state = q.attr.qp_state;
        if state == QpState::Reset {
            return Err(VerbsError::Invalid {
                what: "QP state for posting receives (RESET)",
            });
        }
        if q.init.srq.is_some() {
            return Err(VerbsError::Invalid {
                what: "receive on a QP that uses an SRQ",
            });
        }
        let cap = q.attr.cap;
        within(
            "SGE count",
            wr.sg_list.len() as u64,
            cap.max_recv_sge.into(),
        )?;
        let q = qp_mut(&mut self.qps, qpn)?;
        fill_recv(q.rq.next_free(), wr, cap.max_recv_wr)?;
        q.rq.commit();
        if state == QpState::Err {
            completion::enter_error(q, &mut self.cx, false);
        }
        self.settle();
        Ok(())
    }

    /// `ibv_post_srq_recv`.
    pub fn post_srq_recv(&mut self, srq: SrqHandle, wr: &RecvWr<'_>) -> Result<()> {
        let s = self.cx.srqs.get_mut(srq.0).ok_or(VerbsError::NotFound {
            kind: Kind::Srq,
            handle: srq.0,
        })?;
        within("SGE count", wr.sg_list.len() as u64, s.attr.max_sge.into())?;
        fill_recv(s.rq.next_free(), wr, s.attr.max_wr)?;
        s.rq.commit();
        Ok(())
    }
}

/// Copies a receive WR into a free slot (`None`: the queue is full).
fn fill_recv(slot: Option<&mut RecvWqe>, wr: &RecvWr<'_>, depth: u32) -> Result<()> {
    let Some(slot) = slot else {
        return Err(VerbsError::QueueFull {
            what: "receive queue",
            depth,
        });
    };
    slot.wr_id = wr.wr_id;
    slot.sges.clear();
    slot.sges.extend_from_slice(wr.sg_list);
    slot.length = wr.sg_list.iter().map(|s| u64::from(s.length)).sum();
    Ok(())
}

/// Checks that a QP of type `ty` may post the operation `op`.
fn check_send_op(ty: QpType, op: SendOp) -> Result<()> {
    let allowed = match (ty, op) {
        // A malformed WQE completes in error on any QP.
        (_, SendOp::Malformed { .. }) => true,
        (
            QpType::Ud | QpType::Gsi,
            SendOp::Send
            | SendOp::SendWithImm { .. }
            | SendOp::LocalInv { .. }
            | SendOp::RegMr { .. },
        ) => true,
        (QpType::Ud | QpType::Gsi, _) => false,
        (
            QpType::Uc,
            SendOp::Send
            | SendOp::SendWithImm { .. }
            | SendOp::RdmaWrite { .. }
            | SendOp::RdmaWriteWithImm { .. }
            | SendOp::LocalInv { .. }
            | SendOp::BindMw { .. }
            | SendOp::RegMr { .. },
        ) => true,
        (QpType::Uc, _) => false,
        (QpType::Rc, _) => true,
    };
    // SEND with invalidate exists on RC only (IBTA Table 38 has no UC
    // or UD opcode for it); binding type 2 windows needs a connected
    // QP; local operations carry no payload.
    let bad = match op {
        SendOp::SendWithInv { .. } => ty != QpType::Rc,
        SendOp::BindMw { .. } => ty.is_datagram(),
        _ => false,
    };
    if bad {
        return Err(VerbsError::Invalid {
            what: "operation for this QP type",
        });
    }
    if !allowed {
        return Err(VerbsError::Invalid {
            what: "operation for this QP type",
        });
    }
    Ok(())
}

/// The bytes a send WR's payload holds, once its SGE count or inline data
/// fits the QP's capabilities.
fn send_length(wr: &SendWr<'_>, cap: &QpCap) -> Result<u64> {
    let length: u64 = match wr.payload {
        Payload::Sges(sges) => {
            within("SGE count", sges.len() as u64, cap.max_send_sge.into())?;
            sges.iter().map(|s| u64::from(s.length)).sum()
        }
        Payload::Inline(data) => {
            if !wr.flags.contains(SendFlags::INLINE) {
                return Err(VerbsError::Invalid {
                    what: "inline data without the INLINE flag",
                });
            }
            if matches!(wr.op, SendOp::RdmaRead { .. }) || wr.op.is_atomic() {
                return Err(VerbsError::Invalid {
                    what: "inline data for a READ or atomic",
                });
            }
            within("inline data", data.len() as u64, cap.max_inline_data.into())?;
            data.len() as u64
        }
    };
    Ok(length)
}

/// Checks that an atomic's local buffer (`length` bytes) and remote
/// address fit the one word it targets; other operations pass.
fn check_atomic(wr: &SendWr<'_>, length: u64) -> Result<()> {
    if wr.op.is_atomic() {
        // IBTA Vol1 §9.4.5: an atomic targets one naturally aligned
        // 8-byte word and returns it into an 8-byte local buffer.
        if length != 8 {
            return Err(VerbsError::Invalid {
                what: "atomic local length (not 8 bytes)",
            });
        }
        if wr.op.remote_addr().is_some_and(|a| a % 8 != 0) {
            return Err(VerbsError::Invalid {
                what: "atomic remote address (not 8-byte aligned)",
            });
        }
    }
    Ok(())
}

/// Copies a checked send WR into its free slot of the send queue.
fn fill_send(
    slot: &mut SendWqe,
    wr: &SendWr<'_>,
    length: u64,
    signaled: bool,
    ud_av: Option<AhAttr>,
    reg_pages: Option<Translation>,
) {
    slot.wr_id = wr.wr_id;
    slot.op = Some(wr.op);
    slot.flags = wr.flags;
    slot.ud = wr.ud;
    slot.length = length;
    slot.signaled = signaled;
    slot.read_done = 0;
    slot.av = ud_av;
    slot.executed = false;
    slot.status = None;
    slot.reg_pages = reg_pages;
    slot.sges.clear();
    slot.inline.clear();
    match wr.payload {
        Payload::Sges(sges) => {
            slot.sges.extend_from_slice(sges);
            slot.is_inline = false;
        }
        Payload::Inline(data) => {
            slot.inline.extend_from_slice(data);
            slot.is_inline = true;
        }
    }
}
