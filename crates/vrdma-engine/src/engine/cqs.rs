//! Completion queues: create, resize and destroy them, arm their
//! notifications, and poll their completions.

use super::{Engine, count};
use crate::{
    budget,
    cq::{Arm, Cq, CqSink},
    error::{Kind, Result, VerbsError, within},
    handle::CqHandle,
};

impl Engine {
    /// `ibv_create_cq`: returns the handle and the capacity granted. The
    /// engine keeps the completions until [`Engine::poll_cq`].
    pub fn create_cq(&mut self, cqe: u32, comp_vector: u32) -> Result<(CqHandle, u32)> {
        let max = u64::from(self.attr.max_cqe);
        self.insert_cq(cqe, max, |cqe| Cq::new(cqe, comp_vector))
    }

    /// A CQ whose completions are written straight into the consumer's
    /// ring through `sink` (a device face's CQ in guest memory); `cqe` is
    /// the ring's size. Returns the handle and the capacity granted.
    pub fn create_cq_with_sink(
        &mut self,
        cqe: u32,
        comp_vector: u32,
        sink: Box<dyn CqSink>,
    ) -> Result<(CqHandle, u32)> {
        let max = self.sink_cqe_max();
        self.insert_cq(cqe, max, |cqe| Cq::with_sink(cqe, comp_vector, sink))
    }

    /// The largest ring a sink CQ may have: a consumer's ring is a power
    /// of two holding its request, which may be `max_cqe` (65 535 CQEs ask
    /// for a ring of 65 536).
    fn sink_cqe_max(&self) -> u64 {
        u64::from(self.attr.max_cqe).next_power_of_two()
    }

    fn insert_cq(
        &mut self,
        cqe: u32,
        max_cqe: u64,
        make: impl FnOnce(u32) -> Cq,
    ) -> Result<(CqHandle, u32)> {
        if cqe == 0 {
            return Err(VerbsError::Invalid { what: "CQ size 0" });
        }
        within("CQ size", u64::from(cqe), max_cqe)?;
        let max = self.cx.cqs.max();
        let c = make(cqe);
        let cost = budget::cq(cqe, c.has_sink());
        self.budget.charge(Kind::Cq, cost)?;
        let Some((h, _)) = self.cx.cqs.insert(c) else {
            self.budget.release(cost);
            return Err(VerbsError::Exhausted {
                kind: Kind::Cq,
                max,
            });
        };
        Ok((CqHandle(h), cqe))
    }

    /// Resizes a CQ whose ring is the consumer's: its completions go to
    /// `sink` (a ring of `cqe` entries, into which the face moved what
    /// waited in the old one) from now on.
    pub fn resize_cq_sink(&mut self, cq: CqHandle, cqe: u32, sink: Box<dyn CqSink>) -> Result<u32> {
        if cqe == 0 {
            return Err(VerbsError::Invalid { what: "CQ size 0" });
        }
        within("CQ size", u64::from(cqe), self.sink_cqe_max())?;
        let c = self.cq_mut(cq)?;
        if !c.has_sink() {
            return Err(VerbsError::Invalid {
                what: "CQ (its ring is the engine's, not a sink)",
            });
        }
        c.replace_sink(cqe, sink);
        Ok(cqe)
    }

    /// `ibv_resize_cq`: EINVAL when more completions wait than fit.
    pub fn resize_cq(&mut self, cq: CqHandle, cqe: u32) -> Result<u32> {
        if cqe == 0 {
            return Err(VerbsError::Invalid { what: "CQ size 0" });
        }
        within("CQ size", u64::from(cqe), u64::from(self.attr.max_cqe))?;
        let c = self.cq_mut(cq)?;
        if c.has_sink() {
            return Err(VerbsError::Invalid {
                what: "CQ (its ring is the consumer's: resize_cq_sink)",
            });
        }
        let was = c.capacity();
        c.resize(cqe).map_err(|_| VerbsError::Invalid {
            what: "CQ size (below the completions waiting)",
        })?;
        let (old, new) = (budget::cq(was, false), budget::cq(cqe, false));
        if let Err(e) = self.budget.replace(Kind::Cq, old, new) {
            // Back to the size it had: its completions fitted there.
            let _ = self.cq_mut(cq)?.resize(was);
            return Err(e);
        }
        Ok(cqe)
    }

    /// `ibv_destroy_cq`: EBUSY while a QP uses it.
    pub fn destroy_cq(&mut self, cq: CqHandle) -> Result<()> {
        self.cq(cq)?;
        let users = count(&self.qps, |q| q.init.send_cq == cq || q.init.recv_cq == cq);
        if users > 0 {
            return Err(VerbsError::Busy {
                kind: Kind::Cq,
                handle: cq.0,
                users,
            });
        }
        if let Some(c) = self.cx.cqs.remove(cq.0) {
            self.budget.release(budget::cq(c.capacity(), c.has_sink()));
        }
        Ok(())
    }

    /// `ibv_req_notify_cq`.
    pub fn req_notify_cq(&mut self, cq: CqHandle, solicited_only: bool) -> Result<()> {
        let arm = if solicited_only {
            Arm::Solicited
        } else {
            Arm::Next
        };
        self.cq_mut(cq)?.arm(arm);
        Ok(())
    }

    /// Withdraws `cq`'s arming: a face that notified the consumer itself
    /// (a completion it wanted was already there when it armed) ends the
    /// request there, so that an earlier, merged arm fires no second
    /// notification for it.
    pub fn disarm_cq(&mut self, cq: CqHandle) -> Result<()> {
        self.cq_mut(cq)?.disarm();
        Ok(())
    }

    /// `ibv_poll_cq`: up to `max` completions into `out`; returns how many.
    pub fn poll_cq(
        &mut self,
        cq: CqHandle,
        max: usize,
        out: &mut Vec<crate::wc::Wc>,
    ) -> Result<usize> {
        Ok(self.cq_mut(cq)?.poll_into(max, out))
    }
}
