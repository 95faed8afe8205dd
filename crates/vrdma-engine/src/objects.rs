//! The small objects: protection domains, shared receive queues, address
//! handles.

use crate::{
    handle::PdHandle,
    qp::AhAttr,
    wr::{RecvWqe, WorkQueue},
};

/// A protection domain. Its users are counted by the engine's tables.
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub struct Pd;

/// Shared receive queue attributes (`struct ibv_srq_attr`).
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub struct SrqAttr {
    pub max_wr: u32,
    pub max_sge: u32,
    /// Limit below which the SRQ limit event fires once armed (0 =
    /// disarmed).
    pub srq_limit: u32,
}

/// Which SRQ attributes a modify names (`enum ibv_srq_attr_mask`).
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub struct SrqAttrMask(pub u32);

impl SrqAttrMask {
    pub const MAX_WR: Self = Self(1 << 0);
    pub const LIMIT: Self = Self(1 << 1);

    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }
}

/// A shared receive queue.
#[derive(Clone, Debug)]
pub struct Srq {
    pub pd: PdHandle,
    pub attr: SrqAttr,
    pub(crate) rq: WorkQueue<RecvWqe>,
}

impl Srq {
    pub(crate) fn new(pd: PdHandle, attr: SrqAttr) -> Self {
        Srq {
            pd,
            attr,
            rq: WorkQueue::new(attr.max_wr, || RecvWqe {
                sges: Vec::with_capacity(attr.max_sge as usize),
                ..RecvWqe::default()
            }),
        }
    }

    /// A deeper (or shallower, but not below what waits) queue, keeping
    /// the waiting WRs in order.
    pub(crate) fn resize(&mut self, max_wr: u32) {
        let sge = self.attr.max_sge as usize;
        let mut rq = WorkQueue::new(max_wr, || RecvWqe {
            sges: Vec::with_capacity(sge),
            ..RecvWqe::default()
        });
        while let Some(w) = self.rq.front() {
            if let Some(slot) = rq.next_free() {
                slot.clone_from(w);
                rq.commit();
            }
            self.rq.pop_front();
        }
        self.rq = rq;
        self.attr.max_wr = max_wr;
    }

    /// Receive WRs waiting.
    pub fn len(&self) -> usize {
        self.rq.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rq.len() == 0
    }
}

/// An address handle: where UD sends go.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Ah {
    pub pd: PdHandle,
    pub attr: AhAttr,
}
