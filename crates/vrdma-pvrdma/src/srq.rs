//! SRQs as the guest sees them: a ring of receive WQEs in guest memory
//! (a user context's only; the kernel driver makes none), taken into the
//! engine's SRQ by the face core ([`SrqQueue`]) as it has room, each WQE
//! decoded as a QP's receive WQE is.

use vrdma_engine::SrqHandle;
use vrdma_face::{
    Malformed, RingSrq,
    ring::WrapBit,
    wq::{RecvWqe, SrqQueue},
};

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
}

/// A WQE with more SGEs than the SRQ takes is taken with no buffer (the
/// message it receives ends in a local length error on its wr_id).
impl RingSrq for SrqFace {
    type Indices = WrapBit;
    /// The SRQ's SGE limit.
    type Shape = u32;

    fn queue(&mut self) -> &mut SrqQueue<WrapBit> {
        &mut self.queue
    }

    fn shape(&self) -> u32 {
        self.max_sge
    }

    fn decode_recv(max_sge: &u32, entry: &[u8]) -> Result<RecvWqe, Malformed> {
        decode_recv(entry, *max_sge)
    }
}
