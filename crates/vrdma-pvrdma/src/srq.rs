//! SRQs as the guest sees them: a ring of receive WQEs in guest memory
//! (a user context's only; the kernel driver makes none), taken into the
//! engine's SRQ by the face core ([`SrqQueue`]) as it has room, each WQE
//! decoded as a QP's receive WQE is.

use vm_memory::GuestMemory;
use vrdma_engine::{Engine, SrqHandle};
use vrdma_face::{Refusals, Taken, refusals::Kind, ring::WrapBit, wq::SrqQueue};

use crate::{qp::decode_recv, ring::Ring};

#[derive(Debug)]
pub struct SrqFace {
    pub queue: SrqQueue<WrapBit>,
    /// The doorbell page that may ring it.
    pub uar: u32,
    pub max_sge: u32,
}

impl SrqFace {
    pub fn new(handle: SrqHandle, uar: u32, ring: Ring, max_sge: u32, depth: u32) -> Self {
        SrqFace {
            queue: SrqQueue::new(handle, ring, depth),
            uar,
            max_sge,
        }
    }

    /// Takes the WQEs the guest posted, as far as the engine has room: a
    /// WQE with more SGEs than the SRQ takes is taken with no buffer (the
    /// message it receives ends in a local length error on its wr_id),
    /// and noted in `refusals` (`now`: the device clock).
    pub fn take<M: GuestMemory + ?Sized>(
        &mut self,
        mem: &M,
        engine: &mut Engine,
        refusals: &mut Refusals,
        now: u64,
    ) -> Taken {
        let max_sge = self.max_sge;
        let srq = self.queue.handle().0;
        self.queue.take(mem, engine, |wqe| {
            decode_recv(wqe, max_sge)
                .map_err(|m| refusals.note_wqe(now, "pvrdma", Kind::RecvWqe, srq, &m).0)
        })
    }
}
