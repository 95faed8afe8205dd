//! Shared receive queues: create, modify, query and destroy them.

use super::{Engine, count};
use crate::{
    budget,
    error::{Kind, Result, VerbsError, within},
    handle::{PdHandle, SrqHandle},
    objects::{Srq, SrqAttr, SrqAttrMask},
};

impl Engine {
    /// `ibv_create_srq`: returns the handle and the attributes granted.
    pub fn create_srq(&mut self, pd: PdHandle, attr: SrqAttr) -> Result<(SrqHandle, SrqAttr)> {
        self.pd(pd)?;
        if attr.max_wr == 0 {
            return Err(VerbsError::Invalid {
                what: "SRQ max_wr 0",
            });
        }
        within(
            "SRQ max_wr",
            attr.max_wr.into(),
            self.attr.max_srq_wr.into(),
        )?;
        within(
            "SRQ max_sge",
            attr.max_sge.into(),
            self.attr.max_srq_sge.into(),
        )?;
        // IBTA: the limit is armed later, with modify_srq.
        let granted = SrqAttr {
            srq_limit: 0,
            max_sge: attr.max_sge.max(1),
            ..attr
        };
        let max = self.cx.srqs.max();
        let cost = budget::srq(granted.max_wr, granted.max_sge);
        self.budget.charge(Kind::Srq, cost)?;
        let Some((h, _)) = self.cx.srqs.insert(Srq::new(pd, granted)) else {
            self.budget.release(cost);
            return Err(VerbsError::Exhausted {
                kind: Kind::Srq,
                max,
            });
        };
        Ok((SrqHandle(h), granted))
    }

    /// `ibv_modify_srq`: `MAX_WR` resizes the queue (never below the WRs
    /// waiting), `LIMIT` arms the limit event (at most the WRs waiting, as
    /// rxe checks; 0 disarms). Returns the attributes now in force.
    pub fn modify_srq(
        &mut self,
        srq: SrqHandle,
        attr: SrqAttr,
        mask: SrqAttrMask,
    ) -> Result<SrqAttr> {
        let max_wr = self.attr.max_srq_wr;
        let s = self.cx.srqs.get_mut(srq.0).ok_or(VerbsError::NotFound {
            kind: Kind::Srq,
            handle: srq.0,
        })?;
        if mask.0 & !(SrqAttrMask::MAX_WR.0 | SrqAttrMask::LIMIT.0) != 0 {
            return Err(VerbsError::Invalid {
                what: "SRQ attribute mask",
            });
        }
        let waiting = s.rq.len() as u64;
        if mask.contains(SrqAttrMask::MAX_WR) {
            within("SRQ max_wr", attr.max_wr.into(), max_wr.into())?;
            if u64::from(attr.max_wr) < waiting || attr.max_wr == 0 {
                return Err(VerbsError::Invalid {
                    what: "SRQ max_wr (below the WRs waiting)",
                });
            }
        }
        // A limit below the SRQ's size (after a resize in the same call):
        // as rxe, whatever is waiting now — one above the WRs waiting
        // fires at the next receive that consumes one (the responder's
        // take_recv).
        let size = if mask.contains(SrqAttrMask::MAX_WR) {
            attr.max_wr
        } else {
            s.attr.max_wr
        };
        if mask.contains(SrqAttrMask::LIMIT) && attr.srq_limit >= size {
            return Err(VerbsError::Invalid {
                what: "SRQ limit (not below the SRQ's size)",
            });
        }
        if mask.contains(SrqAttrMask::MAX_WR) {
            let old = budget::srq(s.attr.max_wr, s.attr.max_sge);
            let new = budget::srq(attr.max_wr, s.attr.max_sge);
            self.budget.replace(Kind::Srq, old, new)?;
            s.resize(attr.max_wr);
        }
        if mask.contains(SrqAttrMask::LIMIT) {
            s.attr.srq_limit = attr.srq_limit;
        }
        Ok(s.attr)
    }

    /// `ibv_query_srq`.
    pub fn query_srq(&self, srq: SrqHandle) -> Result<SrqAttr> {
        self.cx
            .srqs
            .get(srq.0)
            .map(|s| s.attr)
            .ok_or(VerbsError::NotFound {
                kind: Kind::Srq,
                handle: srq.0,
            })
    }

    /// `ibv_destroy_srq`: EBUSY while a QP uses it.
    pub fn destroy_srq(&mut self, srq: SrqHandle) -> Result<()> {
        self.cx.srqs.get(srq.0).ok_or(VerbsError::NotFound {
            kind: Kind::Srq,
            handle: srq.0,
        })?;
        let users = count(&self.qps, |q| q.init.srq == Some(srq));
        if users > 0 {
            return Err(VerbsError::Busy {
                kind: Kind::Srq,
                handle: srq.0,
                users,
            });
        }
        if let Some(s) = self.cx.srqs.remove(srq.0) {
            self.budget
                .release(budget::srq(s.attr.max_wr, s.attr.max_sge));
        }
        Ok(())
    }

    /// Receive WQEs an SRQ holds.
    pub fn srq_len(&self, srq: SrqHandle) -> Option<u32> {
        self.cx.srqs.get(srq.0).map(|s| s.rq.len() as u32)
    }
}
