//! Completions into a guest's CQ ring: the engine's [`CqSink`] for a CQ
//! whose ring is in guest memory. A face says how its ABI encodes a
//! completion; the sink writes each at the device's producer slot when
//! the guest's consumer index (read and checked each time) leaves room,
//! then publishes the producer index. A ring the guest broke (a bad
//! index, pages gone) or let fill up takes no more: the CQ overflows, and
//! the engine raises CQ_ERR and takes the CQ's QPs to ERR.

use std::fmt;

use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vrdma_engine::{cq::CqSink, wc::Wc};
use zerocopy::{Immutable, IntoBytes};

use crate::{
    guest::GuestError,
    ring::{GuestRing, Indices, Producer},
};

/// Guest memory as the current maps give it; the sinks load it on every
/// completion, so a map change reaches them at once (the face replaces
/// what it holds).
pub type SharedMem = GuestMemoryAtomic<GuestMemoryMmap<()>>;

/// A CQ whose ring is in guest memory, its entries encoded by `encode`.
pub struct GuestCq<I, E> {
    mem: SharedMem,
    producer: Producer<I>,
    encode: fn(&Wc) -> E,
}

impl<I: Indices, E> GuestCq<I, E> {
    /// A CQ over `ring`, whose producer index starts where the guest set
    /// it up (0 for a new ring; checked).
    pub fn new(
        mem: SharedMem,
        ring: GuestRing<I>,
        encode: fn(&Wc) -> E,
    ) -> Result<Self, GuestError> {
        let tail = ring.prod(&*mem.memory())?;
        Ok(GuestCq {
            mem,
            producer: Producer::new(ring, tail),
            encode,
        })
    }
}

impl<I: Indices, E> fmt::Debug for GuestCq<I, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuestCq")
            .field("producer", &self.producer)
            .finish_non_exhaustive()
    }
}

impl<I, E> CqSink for GuestCq<I, E>
where
    I: Indices + Send,
    E: IntoBytes + Immutable,
{
    fn push(&mut self, wc: &Wc) -> bool {
        let mem = self.mem.memory();
        self.producer.push(&*mem, &(self.encode)(wc))
    }
}

#[cfg(test)]
mod tests {
    use vm_memory::{Bytes, GuestAddress};
    use vrdma_engine::wc::{WcOpcode, WcStatus};

    use super::*;
    use crate::{pages::PageList, ring::FreeRunning};

    /// An entry of the test's own format: the wr_id and the QP.
    fn encode(wc: &Wc) -> [u64; 2] {
        [wc.wr_id, u64::from(wc.qp_num)]
    }

    #[test]
    fn completions_land_in_order_and_a_full_ring_overflows() {
        let mem = SharedMem::new(
            GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0x10_0000), 0x2000)]).unwrap(),
        );
        let m = mem.memory();
        // A header elsewhere: producer at 0x10_0100, consumer at 0x10_0200.
        m.write_obj(u32::MAX, GuestAddress(0x10_0100)).unwrap();
        m.write_obj(u32::MAX, GuestAddress(0x10_0200)).unwrap();
        let ring = GuestRing::new(
            FreeRunning::new(4).unwrap(),
            16,
            0x10_0100,
            0x10_0200,
            PageList::new(vec![0x10_1000]).unwrap(),
        )
        .unwrap();
        let mut cq = GuestCq::new(mem.clone(), ring.clone(), encode).unwrap();
        for i in 0..4 {
            assert!(cq.push(&Wc::new(i, WcStatus::Success, WcOpcode::Send, 17)));
        }
        assert!(
            !cq.push(&Wc::new(4, WcStatus::Success, WcOpcode::Send, 17)),
            "full"
        );
        assert_eq!(m.read_obj::<u32>(GuestAddress(0x10_0100)).unwrap(), 3);
        let e: [u64; 2] = m.read_obj(GuestAddress(ring.entry_addr(2))).unwrap();
        assert_eq!(e, [3, 17]);
        // The guest consumes one: room for one more.
        m.write_obj(0u32, GuestAddress(0x10_0200)).unwrap();
        assert!(cq.push(&Wc::new(5, WcStatus::Success, WcOpcode::Send, 17)));
        assert!(!cq.push(&Wc::new(6, WcStatus::Success, WcOpcode::Send, 17)));
        // A memory map change reaches the sink at once: the ring's page
        // gone, nothing more goes in.
        mem.lock().unwrap().replace(
            GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0x10_0000), 0x1000)]).unwrap(),
        );
        let now = mem.memory();
        now.write_obj(3u32, GuestAddress(0x10_0200)).unwrap();
        assert!(!cq.push(&Wc::new(7, WcStatus::Success, WcOpcode::Send, 17)));
    }
}
