//! The engine's timers in one heap, so that finding the next deadline and
//! running the due ones cost the same whether one QP or ten thousand
//! exist (idle QPs have no entry).
//!
//! A QP's deadline itself lives in the QP (its retransmit timer and the
//! end of its RNR wait, which the data path reads); the heap holds at
//! most one live entry per QP and timer, the earliest pushed, recorded in
//! the QP's `queued` slot. A deadline that moves later (every ACK restarts
//! the retransmit timer) does not touch the heap: when its entry comes up
//! the engine pushes it again at the real time. One that moves earlier
//! pushes a new entry; entries that no longer match their QP's slot are
//! stale and dropped when they reach the top.

use std::{cmp::Reverse, collections::BinaryHeap};

use vrdma_wire::Qpn;

/// Which of a QP's timers an entry is for.
#[derive(Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd)]
pub(crate) enum TimerKind {
    /// The local ACK timeout (`Requester::timer`).
    Retransmit = 0,
    /// The end of an RNR NAK's wait (`Requester::rnr_until`).
    Rnr = 1,
}

impl TimerKind {
    pub(crate) const fn index(self) -> usize {
        self as usize
    }
}

/// Deadlines of every QP, earliest first.
#[derive(Debug, Default)]
pub(crate) struct Deadlines {
    heap: BinaryHeap<Reverse<(u64, u32, TimerKind)>>,
}

impl Deadlines {
    /// Makes sure a heap entry for `qpn`'s `kind` timer comes up no later
    /// than `at`: pushes one unless `queued` (the QP's earliest entry for
    /// that timer) already does.
    pub(crate) fn arm(&mut self, qpn: Qpn, kind: TimerKind, queued: &mut Option<u64>, at: u64) {
        if queued.is_none_or(|q| at < q) {
            self.heap.push(Reverse((at, qpn.value(), kind)));
            *queued = Some(at);
        }
    }

    /// The earliest entry: its time, QP and timer.
    pub(crate) fn peek(&self) -> Option<(u64, Qpn, TimerKind)> {
        let Reverse((at, qpn, kind)) = *self.heap.peek()?;
        // Entries are pushed with valid QPNs only.
        Some((at, Qpn::from_masked(qpn), kind))
    }

    /// Drops the earliest entry.
    pub(crate) fn pop(&mut self) {
        self.heap.pop();
    }

    /// Entries in the heap, stale ones included.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.heap.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_later_deadline_does_not_push_and_an_earlier_one_does() {
        let mut d = Deadlines::default();
        let q = Qpn::from_masked(17);
        let mut queued = None;
        d.arm(q, TimerKind::Retransmit, &mut queued, 100);
        d.arm(q, TimerKind::Retransmit, &mut queued, 200);
        assert_eq!(d.len(), 1);
        assert_eq!(queued, Some(100));
        d.arm(q, TimerKind::Retransmit, &mut queued, 50);
        assert_eq!(d.len(), 2);
        assert_eq!(queued, Some(50));
        assert_eq!(d.peek(), Some((50, q, TimerKind::Retransmit)));
        d.pop();
        assert_eq!(d.peek(), Some((100, q, TimerKind::Retransmit)));
    }
}
