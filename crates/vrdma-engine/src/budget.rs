//! The memory a consumer's objects make the engine hold — work queue
//! slots, page lists, completion queues kept in the engine, address
//! handles — counted against a limit the device sets. One daemon serves
//! many guests: the object limits alone (`max_qp` × `max_qp_wr` …) let one
//! guest make the daemon hold gigabytes (two guest pages of page
//! directory name a 1 GiB MR, 2 MiB of page list). Past the limit a
//! create fails with ENOMEM, as a real HCA's does when its context memory
//! is full, and the refusal is counted; nothing already made is touched.
//!
//! What an object costs is computed from the sizes it was made with, by
//! the functions below, beside which the allocations they count are made
//! (`Qp::new`, `Srq::new`, `Cq::new`, the MR's page list): charged when
//! it is made, released when it goes.

use core::mem::size_of;

use crate::{
    error::{Kind, Result, VerbsError},
    mr::{Mr, MrKind, Translation},
    objects::{Ah, Srq},
    qp::QpCap,
    qpc::{MAX_RECV_SGE, Qp, Resource, RespOut},
    wc::Wc,
    wr::{RecvWqe, SendWqe, Sge},
};

/// The heap held for objects and its limit.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub(crate) struct Budget {
    /// `None`: no limit.
    pub limit: Option<u64>,
    pub held: u64,
    /// Creates refused for going past the limit.
    pub refused: u64,
}

impl Budget {
    /// Takes `bytes` for a new object of `kind`, or fails with
    /// [`VerbsError::OverBudget`] (counted) if that would pass the limit.
    pub(crate) fn charge(&mut self, kind: Kind, bytes: u64) -> Result<()> {
        let after = self.held.saturating_add(bytes);
        if let Some(limit) = self.limit
            && after > limit
        {
            self.refused += 1;
            return Err(VerbsError::OverBudget {
                kind,
                bytes,
                held: self.held,
                limit,
            });
        }
        self.held = after;
        Ok(())
    }

    /// An object charged `old` now holds `new` (a queue resized): refused
    /// (counted, nothing changed) if that would pass the limit.
    pub(crate) fn replace(&mut self, kind: Kind, old: u64, new: u64) -> Result<()> {
        let held = self.held;
        self.release(old);
        self.charge(kind, new).inspect_err(|_| self.held = held)
    }

    /// Gives back what an object that went was charged.
    pub(crate) fn release(&mut self, bytes: u64) {
        self.held = self.held.saturating_sub(bytes);
    }
}

fn bytes(n: usize) -> u64 {
    n as u64
}

/// A QP with capabilities `cap`: its send and receive slots, each with
/// room for its SGEs (and inline data), the responder's receive WQE and
/// its queues of READ/atomic responses and resources (up to `rd_atom`).
pub(crate) fn qp(cap: &QpCap, rd_atom: u32) -> u64 {
    let sge = bytes(size_of::<Sge>());
    let send = bytes(size_of::<SendWqe>())
        + u64::from(cap.max_send_sge) * sge
        + u64::from(cap.max_inline_data);
    let recv = bytes(size_of::<RecvWqe>()) + u64::from(cap.max_recv_sge) * sge;
    let responder = u64::from(rd_atom)
        * (bytes(size_of::<RespOut>()) + bytes(size_of::<Resource>()))
        + bytes(MAX_RECV_SGE) * sge;
    bytes(size_of::<Qp>())
        + u64::from(cap.max_send_wr) * send
        + u64::from(cap.max_recv_wr) * recv
        + responder
}

/// An SRQ of `max_wr` slots with room for `max_sge` SGEs each.
pub(crate) fn srq(max_wr: u32, max_sge: u32) -> u64 {
    let slot = bytes(size_of::<RecvWqe>()) + u64::from(max_sge) * bytes(size_of::<Sge>());
    bytes(size_of::<Srq>()) + u64::from(max_wr) * slot
}

/// A CQ of `cqe` entries kept in the engine; a CQ whose ring is the
/// consumer's (a sink) keeps none.
pub(crate) fn cq(cqe: u32, sink: bool) -> u64 {
    let queue = if sink {
        0
    } else {
        u64::from(cqe) * bytes(size_of::<Wc>())
    };
    bytes(size_of::<crate::cq::Cq>()) + queue
}

/// An MR: its page list; a fast-registration MR, two of `max_pages` (the
/// one mapped for the next REG_MR beside the one in force).
pub(crate) fn mr(m: &Mr) -> u64 {
    let page = bytes(size_of::<u64>());
    let pages = match (&m.kind, &m.translation) {
        (MrKind::FastReg { max_pages, .. }, _) => 2 * u64::from(*max_pages),
        (MrKind::Regular, Translation::Pages { pages, .. }) => bytes(pages.len()),
        (MrKind::Regular, Translation::Identity) => 0,
    };
    bytes(size_of::<Mr>()) + pages * page
}

/// A fast-registration MR for `max_pages` pages (before it exists).
pub(crate) fn frmr(max_pages: u32) -> u64 {
    bytes(size_of::<Mr>()) + 2 * u64::from(max_pages) * bytes(size_of::<u64>())
}

/// A regular MR over `pages` pages (before it exists).
pub(crate) fn mr_pages(pages: usize) -> u64 {
    bytes(size_of::<Mr>()) + bytes(pages) * bytes(size_of::<u64>())
}

/// An address handle.
pub(crate) fn ah() -> u64 {
    bytes(size_of::<Ah>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_refuses_what_would_pass_it_and_counts_it() {
        let mut b = Budget {
            limit: Some(100),
            ..Budget::default()
        };
        b.charge(Kind::Qp, 60).unwrap();
        let e = b.charge(Kind::Mr, 41).unwrap_err();
        assert_eq!(e.errno(), crate::error::errno::ENOMEM);
        assert_eq!((b.held, b.refused), (60, 1));
        b.charge(Kind::Mr, 40).unwrap();
        b.release(60);
        b.charge(Kind::Cq, 60).unwrap();
        assert_eq!((b.held, b.refused), (100, 1));
        // A queue grown past the limit keeps its old charge.
        assert!(b.replace(Kind::Cq, 60, 61).is_err());
        assert_eq!((b.held, b.refused), (100, 2));
        b.replace(Kind::Cq, 60, 10).unwrap();
        assert_eq!(b.held, 50);
        let mut free = Budget::default();
        free.charge(Kind::Qp, u64::MAX).unwrap();
        free.charge(Kind::Qp, 1).unwrap();
        assert_eq!(free.held, u64::MAX);
    }

    #[test]
    fn costs_grow_with_what_an_object_holds() {
        let cap = |wr, sge| QpCap {
            max_send_wr: wr,
            max_recv_wr: wr,
            max_send_sge: sge,
            max_recv_sge: sge,
            max_inline_data: 0,
        };
        assert!(qp(&cap(1024, 8), 16) > 1024 * 2 * 8 * 16);
        assert!(qp(&cap(2, 1), 1) < qp(&cap(4, 1), 1));
        assert!(srq(1024, 8) > 1024 * 8 * 16);
        assert_eq!(cq(8192, true), cq(1, true));
        assert!(cq(8192, false) > 8192 * 32);
        assert_eq!(mr_pages(262_144) - mr_pages(0), 2 << 20);
        assert_eq!(frmr(512) - frmr(0), 8 << 10);
    }
}
