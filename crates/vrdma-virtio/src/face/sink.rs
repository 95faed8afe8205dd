//! The CQ sink: the engine's completions written into the driver's CQ
//! ring by the face core's [`GuestCq`], counted as they go so that an arm
//! (`doorbells`) knows what the ring has received. It knows nothing of
//! the device: the objects that own sinks (`objects`) make them.

use std::sync::{
    Arc,
    atomic::{AtomicU32, Ordering},
};

use vrdma_engine::{
    cq::CqSink,
    wc::{Wc, WcStatus},
};
use vrdma_face::{
    GuestRing, OrRefuse, Refused,
    cq::{GuestCq, SharedMem},
    ring::FreeRunning,
};

use crate::{abi, decode};

/// What the driver's CQ ring has received, for arming: the producer index
/// after the last completion, and after the last one a solicited-only arm
/// wakes for (solicited, or in error).
#[derive(Debug, Default)]
pub(super) struct Track {
    pub(super) tail: AtomicU32,
    pub(super) due: AtomicU32,
}

/// The engine's sink for a CQ ring: the face core's, counting as it goes.
#[derive(Debug)]
pub(super) struct Sink {
    pub(super) inner: GuestCq<FreeRunning, abi::Cqe>,
    pub(super) track: Arc<Track>,
}

impl CqSink for Sink {
    fn push(&mut self, wc: &Wc) -> bool {
        self.push_with(wc, false)
    }

    fn push_with(&mut self, wc: &Wc, solicited: bool) -> bool {
        if !self.inner.push(wc) {
            return false;
        }
        let tail = self.track.tail.load(Ordering::Relaxed).wrapping_add(1);
        self.track.tail.store(tail, Ordering::Relaxed);
        if solicited || wc.status != WcStatus::Success {
            self.track.due.store(tail, Ordering::Relaxed);
        }
        true
    }
}

impl Sink {
    /// A sink for CQ ring `ring` in `shared` memory whose producer index is
    /// `tail`, and its track.
    pub(super) fn new(
        shared: SharedMem,
        ring: GuestRing<FreeRunning>,
        tail: u32,
    ) -> Result<(Sink, Arc<Track>), Refused> {
        let track = Arc::new(Track {
            tail: AtomicU32::new(tail),
            due: AtomicU32::new(tail),
        });
        let inner = GuestCq::new(shared, ring, decode::cqe).or_refuse("CQ ring")?;
        Ok((
            Sink {
                inner,
                track: track.clone(),
            },
            track,
        ))
    }
}
