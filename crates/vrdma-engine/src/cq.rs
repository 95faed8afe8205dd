//! Completion queues: a bounded ring of [`Wc`]s — the engine's own, or the
//! consumer's, written through a [`CqSink`] — arming for one notification,
//! overflow.

use std::{collections::VecDeque, fmt};

use crate::wc::{Wc, WcStatus};

/// What a CQ was armed for (`ibv_req_notify_cq`'s `solicited_only`).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Arm {
    /// The next completion of any kind.
    Next,
    /// The next solicited receive completion, or any completion in error
    /// (IBTA Vol1 §11.4.2.2, C11-?: unsuccessful completions notify too).
    Solicited,
}

/// What happened when a completion was added.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Pushed {
    /// Stored; no notification due.
    Stored,
    /// Stored, and the CQ was armed for it: one notification is due and
    /// the CQ is disarmed.
    Notify,
    /// The ring was full: the completion is lost and the CQ is in error
    /// (the caller raises the CQ error event and moves its QPs to error).
    Overflow,
}

/// Where a CQ's completions go when its ring is the consumer's, not the
/// engine's: a device face writes each one straight into the ring a guest
/// polls (in guest memory), with no copy through the engine.
pub trait CqSink: fmt::Debug + Send {
    /// Writes `wc` into the consumer's ring; false when the ring has no
    /// room (the completion is lost and the CQ overflows).
    fn push(&mut self, wc: &Wc) -> bool;

    /// [`CqSink::push`], told whether the completion was solicited (the
    /// sender set SE): a sink that arms notifications of its own (a face
    /// whose driver arms through guest memory) keeps track of it.
    fn push_with(&mut self, wc: &Wc, solicited: bool) -> bool {
        let _ = solicited;
        self.push(wc)
    }
}

/// Where a CQ keeps its completions.
#[derive(Debug)]
enum Store {
    /// The engine's own ring, polled with [`Cq::poll_into`].
    Queue(VecDeque<Wc>),
    /// The consumer's ring.
    Sink(Box<dyn CqSink>),
}

/// A completion queue.
#[derive(Debug)]
pub struct Cq {
    /// Capacity the consumer asked for (`cqe`); the engine's ring holds
    /// exactly this many (a sink's ring is the consumer's to size).
    capacity: u32,
    store: Store,
    armed: Option<Arm>,
    overflowed: bool,
    /// Completion vector the consumer chose (which notification queue).
    pub comp_vector: u32,
}

impl Cq {
    /// A CQ whose completions the engine keeps until polled.
    pub fn new(capacity: u32, comp_vector: u32) -> Self {
        Cq {
            capacity,
            store: Store::Queue(VecDeque::with_capacity(capacity as usize)),
            armed: None,
            overflowed: false,
            comp_vector,
        }
    }

    /// A CQ whose completions go to the consumer's ring through `sink`.
    pub fn with_sink(capacity: u32, comp_vector: u32, sink: Box<dyn CqSink>) -> Self {
        Cq {
            capacity,
            store: Store::Sink(sink),
            armed: None,
            overflowed: false,
            comp_vector,
        }
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Completions waiting to be polled from the engine's ring (0 for a
    /// sink: the consumer's ring holds them).
    pub fn len(&self) -> u32 {
        match &self.store {
            Store::Queue(ring) => ring.len() as u32,
            Store::Sink(_) => 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when the completions go to a sink.
    pub fn has_sink(&self) -> bool {
        matches!(self.store, Store::Sink(_))
    }

    /// True once a completion was lost to a full ring.
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// Adds a completion; `solicited` says the sender set SE (receive
    /// completions only).
    pub fn push(&mut self, wc: Wc, solicited: bool) -> Pushed {
        if self.overflowed {
            return Pushed::Overflow;
        }
        let stored = match &mut self.store {
            Store::Queue(ring) if ring.len() < self.capacity as usize => {
                ring.push_back(wc);
                true
            }
            Store::Queue(_) => false,
            Store::Sink(sink) => sink.push_with(&wc, solicited),
        };
        if !stored {
            self.overflowed = true;
            return Pushed::Overflow;
        }
        let due = match self.armed {
            Some(Arm::Next) => true,
            Some(Arm::Solicited) => solicited || wc.status != WcStatus::Success,
            None => false,
        };
        if due {
            self.armed = None;
            Pushed::Notify
        } else {
            Pushed::Stored
        }
    }

    /// Takes up to `max` completions, oldest first (none from a sink).
    pub fn poll(&mut self, max: usize) -> impl Iterator<Item = Wc> + '_ {
        let ring = match &mut self.store {
            Store::Queue(ring) => Some(ring),
            Store::Sink(_) => None,
        };
        ring.into_iter().flat_map(move |ring| {
            let n = max.min(ring.len());
            ring.drain(..n)
        })
    }

    /// Moves up to `max` completions, oldest first, to the end of `out`;
    /// returns how many (none from a sink). (Two slice copies: extending
    /// from `poll`'s drain goes element by element.)
    #[must_use = "the completions taken are counted by the result"]
    pub fn poll_into(&mut self, max: usize, out: &mut Vec<Wc>) -> usize {
        let Store::Queue(ring) = &mut self.store else {
            return 0;
        };
        let n = max.min(ring.len());
        let (a, b) = ring.as_slices();
        let from_a = n.min(a.len());
        out.extend_from_slice(&a[..from_a]);
        out.extend_from_slice(&b[..n - from_a]);
        ring.drain(..n);
        n
    }

    /// Arms the CQ for one notification. Arming again before it fires
    /// keeps the wider request (Next wins over Solicited).
    pub fn arm(&mut self, how: Arm) {
        self.armed = match (self.armed, how) {
            (Some(Arm::Next), _) | (_, Arm::Next) => Some(Arm::Next),
            _ => Some(Arm::Solicited),
        };
    }

    /// No notification wanted any more (one that a face gave at once
    /// satisfied the request).
    pub fn disarm(&mut self) {
        self.armed = None;
    }

    pub fn armed(&self) -> Option<Arm> {
        self.armed
    }

    /// Changes the capacity; fails (keeping the CQ as it is) when more
    /// completions are waiting than the new size holds.
    pub fn resize(&mut self, capacity: u32) -> Result<(), u32> {
        if let Store::Queue(ring) = &mut self.store {
            if (ring.len() as u64) > u64::from(capacity) {
                return Err(ring.len() as u32);
            }
            let extra = (capacity as usize).saturating_sub(ring.capacity());
            ring.reserve(extra);
        }
        self.capacity = capacity;
        Ok(())
    }

    /// Moves the completions to a new consumer ring of `capacity` entries
    /// (a resize of a CQ whose ring is the consumer's: the face has copied
    /// what waited in the old ring into the new one).
    pub fn replace_sink(&mut self, capacity: u32, sink: Box<dyn CqSink>) {
        self.capacity = capacity;
        self.store = Store::Sink(sink);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wc::WcOpcode;

    fn wc(id: u64) -> Wc {
        Wc::new(id, WcStatus::Success, WcOpcode::Send, 17)
    }

    #[test]
    fn order_is_kept_and_polling_is_bounded() {
        let mut cq = Cq::new(4, 0);
        for i in 0..3 {
            assert_eq!(cq.push(wc(i), false), Pushed::Stored);
        }
        let got: Vec<u64> = cq.poll(2).map(|w| w.wr_id).collect();
        assert_eq!(got, [0, 1]);
        let got: Vec<u64> = cq.poll(10).map(|w| w.wr_id).collect();
        assert_eq!(got, [2]);
        assert!(cq.is_empty());
    }

    #[test]
    fn poll_into_keeps_order_across_the_ring_wrap() {
        let mut cq = Cq::new(4, 0);
        let mut out = Vec::new();
        let mut next = 0;
        // Push and poll in uneven steps so that the ring's storage wraps
        // (its two slices are both non-empty at some polls).
        for (push, take) in [(3, 2), (3, 1), (1, 10), (4, 3), (3, 10)] {
            for _ in 0..push {
                assert_eq!(cq.push(wc(next), false), Pushed::Stored);
                next += 1;
            }
            let before = out.len();
            let n = cq.poll_into(take, &mut out);
            assert_eq!(n, out.len() - before);
        }
        assert!(cq.is_empty());
        let ids: Vec<u64> = out.iter().map(|w| w.wr_id).collect();
        assert_eq!(ids, (0..next).collect::<Vec<_>>());
    }

    #[test]
    fn arming_yields_exactly_one_notification() {
        let mut cq = Cq::new(8, 0);
        cq.arm(Arm::Next);
        assert_eq!(cq.push(wc(1), false), Pushed::Notify);
        assert_eq!(cq.push(wc(2), false), Pushed::Stored, "disarmed after one");
        cq.arm(Arm::Solicited);
        assert_eq!(cq.push(wc(3), false), Pushed::Stored);
        assert_eq!(cq.push(wc(4), true), Pushed::Notify);
        cq.arm(Arm::Solicited);
        let mut bad = wc(5);
        bad.status = WcStatus::RemAccessErr;
        assert_eq!(cq.push(bad, false), Pushed::Notify, "errors notify");
        cq.arm(Arm::Solicited);
        cq.arm(Arm::Next);
        assert_eq!(cq.armed(), Some(Arm::Next));
    }

    #[test]
    fn overflow_is_sticky_and_loses_nothing_already_stored() {
        let mut cq = Cq::new(2, 0);
        cq.push(wc(1), false);
        cq.push(wc(2), false);
        assert_eq!(cq.push(wc(3), false), Pushed::Overflow);
        assert!(cq.overflowed());
        let got: Vec<u64> = cq.poll(8).map(|w| w.wr_id).collect();
        assert_eq!(got, [1, 2]);
        assert_eq!(cq.push(wc(4), false), Pushed::Overflow, "stays in error");
    }

    #[test]
    fn resize_refuses_to_drop_completions() {
        let mut cq = Cq::new(4, 0);
        for i in 0..3 {
            cq.push(wc(i), false);
        }
        assert_eq!(cq.resize(2), Err(3));
        assert_eq!(cq.capacity(), 4);
        assert_eq!(cq.resize(16), Ok(()));
        for i in 3..16 {
            assert_eq!(cq.push(wc(i), false), Pushed::Stored);
        }
        assert_eq!(cq.push(wc(99), false), Pushed::Overflow);
    }

    /// A consumer ring of `room` entries that records what it got.
    #[derive(Debug)]
    struct Ring {
        got: std::sync::Arc<std::sync::Mutex<Vec<u64>>>,
        room: usize,
    }

    impl CqSink for Ring {
        fn push(&mut self, wc: &Wc) -> bool {
            let mut got = self.got.lock().unwrap();
            if got.len() >= self.room {
                return false;
            }
            got.push(wc.wr_id);
            true
        }
    }

    #[test]
    fn a_sink_takes_every_completion_and_its_fullness_is_an_overflow() {
        let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut cq = Cq::with_sink(
            8,
            0,
            Box::new(Ring {
                got: got.clone(),
                room: 2,
            }),
        );
        cq.arm(Arm::Next);
        assert_eq!(cq.push(wc(1), false), Pushed::Notify);
        assert_eq!(cq.push(wc(2), false), Pushed::Stored);
        assert!(cq.is_empty(), "nothing waits in the engine");
        assert_eq!(cq.poll_into(8, &mut Vec::new()), 0);
        assert_eq!(cq.push(wc(3), false), Pushed::Overflow, "the ring is full");
        assert!(cq.overflowed());
        assert_eq!(*got.lock().unwrap(), [1, 2]);
        cq.replace_sink(
            16,
            Box::new(Ring {
                got: got.clone(),
                room: 16,
            }),
        );
        assert_eq!(
            cq.push(wc(4), false),
            Pushed::Overflow,
            "overflow is sticky"
        );
    }
}
