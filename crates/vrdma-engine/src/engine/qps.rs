//! Queue pairs: create, query, modify (the state machine's transitions)
//! and destroy them, and the fatal error a face reports on one.

use vrdma_wire::Qpn;

use super::{Engine, PORT, check_port, qp_mut};
use crate::{
    budget, completion,
    error::{Kind, Result, VerbsError, within},
    event::AsyncEvent,
    mr::Access,
    qp::{AttrMask, QpAttr, QpCap, QpInitAttr, QpState, QpType, state},
    qpc::Qp,
};

impl Engine {
    /// `ibv_create_qp`: returns the QPN and the capabilities granted.
    pub fn create_qp(&mut self, init: QpInitAttr) -> Result<(Qpn, QpCap)> {
        self.pd(init.pd)?;
        self.cq(init.send_cq)?;
        self.cq(init.recv_cq)?;
        if let Some(srq) = init.srq {
            self.cx.srqs.get(srq.0).ok_or(VerbsError::NotFound {
                kind: Kind::Srq,
                handle: srq.0,
            })?;
        }
        let a = &self.attr;
        let c = init.cap;
        within("max_send_wr", c.max_send_wr.into(), a.max_qp_wr.into())?;
        within("max_send_sge", c.max_send_sge.into(), a.max_sge.into())?;
        within(
            "max_inline_data",
            c.max_inline_data.into(),
            a.max_inline_data.into(),
        )?;
        let cap = if init.srq.is_some() {
            // Receives come from the SRQ; the QP has no receive queue.
            QpCap {
                max_recv_wr: 0,
                max_recv_sge: 0,
                ..c
            }
        } else {
            within("max_recv_wr", c.max_recv_wr.into(), a.max_qp_wr.into())?;
            within("max_recv_sge", c.max_recv_sge.into(), a.max_sge.into())?;
            c
        };
        let max = self.qps.max();
        let cost = self.qp_cost(&cap);
        self.budget.charge(Kind::Qp, cost)?;
        let made = self.insert_qp(QpInitAttr { cap, ..init }, max);
        if made.is_err() {
            self.budget.release(cost);
        }
        made.map(|qpn| (qpn, cap))
    }

    /// What a QP with capabilities `cap` holds ([`crate::budget::qp`]; its
    /// responder may be given the device's most READ/atomic resources).
    fn qp_cost(&self, cap: &QpCap) -> u64 {
        budget::qp(cap, self.attr.max_qp_rd_atom)
    }

    /// Makes the QP `init` (already checked) describes.
    fn insert_qp(&mut self, init: QpInitAttr, max: u32) -> Result<Qpn> {
        let mut qp = Qp::new(init);
        if init.qp_type.is_datagram() {
            // A UD QP has no path MTU attribute: its messages are limited
            // by the port's active MTU (rxe: port->mtu_cap).
            qp.attr.path_mtu = self.cx.port.active_mtu;
        }
        if init.qp_type == QpType::Gsi {
            // QP1, once.
            qp.qpn = Qpn::GSI;
            qp.attr.port_num = PORT;
            self.qps
                .insert_at(Qpn::GSI.value(), Box::new(qp))
                .ok_or(VerbsError::Invalid {
                    what: "GSI QP (the device has one already)",
                })?;
            return Ok(Qpn::GSI);
        }
        let (h, _) = self.qps.insert(Box::new(qp)).ok_or(VerbsError::Exhausted {
            kind: Kind::Qp,
            max,
        })?;
        let Ok(qpn) = Qpn::try_from(h) else {
            // A configured max_qp beyond the 24-bit QPN space.
            self.qps.remove(h);
            return Err(VerbsError::Exhausted {
                kind: Kind::Qp,
                max,
            });
        };
        if let Some(q) = self.qps.get_mut(h) {
            q.qpn = qpn;
        }
        Ok(qpn)
    }

    /// `ibv_query_qp`: the attributes and the creation parameters.
    pub fn query_qp(&self, qpn: Qpn) -> Result<(&QpAttr, &QpInitAttr)> {
        let q = self.qp(qpn)?;
        Ok((&q.attr, &q.init))
    }

    /// `ibv_modify_qp`: the transition must be allowed with exactly the
    /// attributes `mask` names (IBTA Vol1 §10.3; the kernel's
    /// `ib_modify_qp_is_ok`), and every attribute must be in range.
    pub fn modify_qp(&mut self, qpn: Qpn, attr: &QpAttr, mask: AttrMask) -> Result<()> {
        let q = self.qp(qpn)?;
        let cur = q.attr.qp_state;
        let ty = q.init.qp_type;
        if mask.contains(AttrMask::CUR_STATE) && attr.cur_qp_state != cur {
            return Err(VerbsError::Invalid {
                what: "cur_qp_state (not the QP's state)",
            });
        }
        let next = if mask.contains(AttrMask::STATE) {
            attr.qp_state
        } else {
            cur
        };
        state::check_transition(cur, next, ty, mask)?;
        self.check_qp_attr(ty, attr, mask)?;

        let q = qp_mut(&mut self.qps, qpn)?;
        let m = |bit| mask.contains(bit);
        let a = &mut q.attr;
        if m(AttrMask::ACCESS_FLAGS) {
            a.qp_access_flags = attr.qp_access_flags;
        }
        if m(AttrMask::PKEY_INDEX) {
            a.pkey_index = attr.pkey_index;
        }
        if m(AttrMask::PORT) {
            a.port_num = attr.port_num;
        }
        if m(AttrMask::QKEY) {
            a.qkey = attr.qkey;
        }
        if m(AttrMask::AV) {
            a.ah_attr = attr.ah_attr.masked();
        }
        if m(AttrMask::PATH_MTU) {
            a.path_mtu = attr.path_mtu;
        }
        if m(AttrMask::TIMEOUT) {
            a.timeout = attr.timeout;
        }
        if m(AttrMask::RETRY_CNT) {
            a.retry_cnt = attr.retry_cnt;
        }
        if m(AttrMask::RNR_RETRY) {
            a.rnr_retry = attr.rnr_retry;
        }
        if m(AttrMask::RQ_PSN) {
            a.rq_psn = attr.rq_psn;
            q.resp.epsn = attr.rq_psn;
        }
        if m(AttrMask::SQ_PSN) {
            a.sq_psn = attr.sq_psn;
            q.req.psn = attr.sq_psn;
            q.req.unacked = attr.sq_psn;
            q.req.high = attr.sq_psn;
        }
        if m(AttrMask::MAX_QP_RD_ATOMIC) {
            a.max_rd_atomic = attr.max_rd_atomic;
        }
        if m(AttrMask::MAX_DEST_RD_ATOMIC) {
            a.max_dest_rd_atomic = attr.max_dest_rd_atomic;
        }
        if m(AttrMask::MIN_RNR_TIMER) {
            a.min_rnr_timer = attr.min_rnr_timer;
        }
        if m(AttrMask::DEST_QPN) {
            a.dest_qp_num = attr.dest_qp_num;
        }
        if m(AttrMask::EN_SQD_ASYNC_NOTIFY) {
            a.en_sqd_async_notify = attr.en_sqd_async_notify;
        }
        a.qp_state = next;
        a.cur_qp_state = next;
        if next == QpState::Reset {
            // Back to RESET the QP forgets its connection (IBTA Vol1
            // §10.3.1: attributes return to their initial values) and its
            // work queues, without completions.
            *a = QpAttr {
                cap: a.cap,
                ..QpAttr::default()
            };
            q.sq.clear();
            q.rq.clear();
            q.req = Default::default();
            q.resp.reset();
        }
        if next == QpState::Rts {
            q.req.retry_left = q.attr.retry_cnt;
            q.req.rnr_left = q.attr.rnr_retry;
            if q.sq.len() > q.req.cursor {
                self.cx.schedule(q);
            }
        }
        if next == QpState::Reset {
            // The QP's connection is gone: so are its type 2 windows.
            self.cx.keys.unbind_qp(qpn);
        }
        // A connected QP's path changes here, and when the GID table does
        // (Engine::set_gid).
        q.path = q.route(&self.cx.port, q.attr.ah_attr);
        if next == QpState::Err && cur != QpState::Err {
            completion::enter_error(q, &mut self.cx, true);
        }
        // IBTA Vol1 §10.3.1: entering SQD starts the drain; it ends once no
        // WR is in flight (at once if none is).
        q.attr.sq_draining = next == QpState::Sqd && (cur != QpState::Sqd || q.attr.sq_draining);
        if next == QpState::Sqd && cur != QpState::Sqd {
            completion::check_drained(q, &mut self.cx);
        }
        self.settle();
        Ok(())
    }

    /// RESET → INIT → RTR → RTS in three modifies, each naming exactly
    /// the attributes the transition requires for the QP's type (what
    /// `ibv_rc_pingpong` and most consumers do by hand); the values come
    /// from `attr`.
    pub fn bring_up_qp(&mut self, qpn: Qpn, attr: &QpAttr) -> Result<()> {
        let ty = self.qp(qpn)?.init.qp_type;
        let mut from = QpState::Reset;
        for to in [QpState::Init, QpState::Rtr, QpState::Rts] {
            let required = state::required(from, to, ty).ok_or(VerbsError::Invalid {
                what: "QP state for bring-up",
            })?;
            let step = QpAttr {
                qp_state: to,
                ..*attr
            };
            self.modify_qp(qpn, &step, AttrMask::STATE | required)?;
            from = to;
        }
        Ok(())
    }

    /// Range checks of each attribute a modify names.
    fn check_qp_attr(&self, ty: QpType, attr: &QpAttr, mask: AttrMask) -> Result<()> {
        let m = |bit| mask.contains(bit);
        if m(AttrMask::PORT) {
            check_port(attr.port_num)?;
        }
        if m(AttrMask::PKEY_INDEX) && self.cx.port.pkey(attr.pkey_index).is_none() {
            return Err(VerbsError::Invalid {
                what: "P_Key index",
            });
        }
        if m(AttrMask::ACCESS_FLAGS) {
            let allowed = Access::LOCAL_WRITE
                | Access::REMOTE_WRITE
                | Access::REMOTE_READ
                | Access::REMOTE_ATOMIC;
            if attr.qp_access_flags.0 & !allowed.0 != 0 {
                return Err(VerbsError::Invalid {
                    what: "QP access flags",
                });
            }
        }
        if m(AttrMask::AV) {
            self.check_av(&attr.ah_attr)?;
        }
        if m(AttrMask::PATH_MTU) && attr.path_mtu > self.cx.port.max_mtu {
            return Err(VerbsError::Invalid {
                what: "path MTU (above the port's)",
            });
        }
        if m(AttrMask::TIMEOUT) && attr.timeout > 31 {
            return Err(VerbsError::Invalid { what: "timeout" });
        }
        if m(AttrMask::RETRY_CNT) && attr.retry_cnt > 7 {
            return Err(VerbsError::Invalid { what: "retry_cnt" });
        }
        if m(AttrMask::RNR_RETRY) && attr.rnr_retry > 7 {
            return Err(VerbsError::Invalid { what: "rnr_retry" });
        }
        if m(AttrMask::MIN_RNR_TIMER) && attr.min_rnr_timer > 31 {
            return Err(VerbsError::Invalid {
                what: "min_rnr_timer",
            });
        }
        if m(AttrMask::MAX_QP_RD_ATOMIC) {
            within(
                "max_rd_atomic",
                attr.max_rd_atomic.into(),
                self.attr.max_qp_init_rd_atom.into(),
            )?;
        }
        if m(AttrMask::MAX_DEST_RD_ATOMIC) {
            within(
                "max_dest_rd_atomic",
                attr.max_dest_rd_atomic.into(),
                self.attr.max_qp_rd_atom.into(),
            )?;
        }
        if m(AttrMask::QKEY) && ty == QpType::Ud && attr.qkey.is_controlled() {
            // IBTA Vol1 §10.2.5 (C10-15): consumers may not set a
            // controlled Q_Key; only privileged ones (not supported here).
            return Err(VerbsError::Invalid {
                what: "Q_Key (controlled: high bit set)",
            });
        }
        if m(AttrMask::CAP) {
            return Err(VerbsError::NotSupported {
                what: "resizing a QP's queues",
            });
        }
        if m(AttrMask::ALT_PATH) {
            // A RoCE port has no alternate path: Linux refuses the bit with
            // EINVAL before a driver sees it ("ban them in roce mode").
            return Err(VerbsError::Invalid {
                what: "alternate path on a RoCE port",
            });
        }
        if m(AttrMask::PATH_MIG_STATE) {
            return Err(VerbsError::NotSupported {
                what: "automatic path migration",
            });
        }
        if m(AttrMask::RATE_LIMIT) {
            return Err(VerbsError::NotSupported {
                what: "rate limiting",
            });
        }
        Ok(())
    }

    /// `ibv_destroy_qp`. Type 2 windows bound to the QP are unbound (its
    /// QPN may name another QP next).
    pub fn destroy_qp(&mut self, qpn: Qpn) -> Result<()> {
        if self.qps.get(qpn.value()).is_some() {
            self.cx.keys.unbind_qp(qpn);
        }
        let q = self.qps.remove(qpn.value()).ok_or(VerbsError::NotFound {
            kind: Kind::Qp,
            handle: qpn.value(),
        })?;
        self.budget.release(self.qp_cost(&q.init.cap));
        Ok(())
    }

    /// Send WQEs a QP holds (posted and not yet retired).
    pub fn sq_len(&self, qpn: Qpn) -> Option<u32> {
        self.qps.get(qpn.value()).map(|q| q.sq.len() as u32)
    }

    /// Receive WQEs a QP holds.
    pub fn rq_len(&self, qpn: Qpn) -> Option<u32> {
        self.qps.get(qpn.value()).map(|q| q.rq.len() as u32)
    }

    /// The QP failed outside any completion (a face found its rings broken,
    /// or a WQE it could not take): it enters ERR, flushing its WRs, and a
    /// QP_FATAL event is raised (IBTA Vol1 §11.6.3, local work queue
    /// catastrophic error).
    pub fn qp_fatal(&mut self, qpn: Qpn) -> Result<()> {
        let q = qp_mut(&mut self.qps, qpn)?;
        if q.attr.qp_state == QpState::Reset {
            return Err(VerbsError::Invalid {
                what: "QP state (RESET)",
            });
        }
        if q.attr.qp_state != QpState::Err {
            completion::enter_error(q, &mut self.cx, true);
        }
        self.cx.events.push_back(AsyncEvent::QpFatal { qp: qpn });
        self.settle();
        Ok(())
    }
}
