//! SRQs as the guest sees them: a ring of receive WQEs in guest memory
//! (a user context's only; the kernel driver makes none), taken into the
//! engine's SRQ as it has room, its consumer index following what the
//! engine consumed.

use vm_memory::GuestMemoryMmap;
use vrdma_engine::{Engine, SrqHandle, wr::RecvWr};

use crate::{
    qp::{Taken, decode_recv},
    ring::GuestRing,
};

#[derive(Debug)]
pub struct SrqFace {
    pub handle: SrqHandle,
    /// The doorbell page that may ring it.
    pub uar: u32,
    pub ring: GuestRing,
    pub max_sge: u32,
    pub depth: u32,
    next: u32,
    cons: u32,
    /// WQEs with more SGEs than the SRQ takes.
    pub malformed: u64,
    /// The guest broke the ring (a bad index, unmapped memory): nothing
    /// more is taken from it, and it is counted once.
    broken: bool,
}

impl SrqFace {
    pub fn new(handle: SrqHandle, uar: u32, ring: GuestRing, max_sge: u32, depth: u32) -> Self {
        SrqFace {
            handle,
            uar,
            ring,
            max_sge,
            depth,
            next: 0,
            cons: 0,
            malformed: 0,
            broken: false,
        }
    }

    /// Takes the WQEs the guest posted, as far as the engine has room.
    pub fn take(&mut self, mem: &GuestMemoryMmap<()>, engine: &mut Engine) -> Taken {
        let mut t = Taken::default();
        if self.broken {
            return t;
        }
        let ring = self.ring.ring;
        // Never more than a ring ahead of the consumer index last given
        // back (see QpFace::take_sends).
        let prod = match self.ring.prod_tail(mem) {
            Ok(p) if ring.used(p, self.cons) <= ring.capacity() => p,
            _ => {
                self.broken = true;
                t.broken = true;
                return t;
            }
        };
        while self.next != prod {
            if engine.srq_len(self.handle).unwrap_or(u32::MAX) >= self.depth {
                break;
            }
            let addr = self.ring.element(self.next);
            let Ok(wqe) = decode_recv(mem, addr, self.max_sge, self.ring.stride()) else {
                self.broken = true;
                t.broken = true;
                break;
            };
            self.next = self.ring.ring.next(self.next);
            t.wqes += 1;
            match wqe {
                Ok((wr_id, sges)) => {
                    let _ = engine.post_srq_recv(
                        self.handle,
                        &RecvWr {
                            wr_id,
                            sg_list: &sges,
                        },
                    );
                }
                Err(wr_id) => {
                    // Taken with no buffer: the message it receives ends in
                    // a local length error on this wr_id (an SRQ has no QP
                    // of its own to fail).
                    self.malformed += 1;
                    t.malformed += 1;
                    let _ = engine.post_srq_recv(
                        self.handle,
                        &RecvWr {
                            wr_id,
                            sg_list: &[],
                        },
                    );
                }
            }
        }
        t
    }

    /// Moves the guest's consumer index to what the engine consumed.
    /// Moves the guest's consumer index to what the device has taken (see
    /// `QpFace::publish`).
    pub fn publish(&mut self, mem: &GuestMemoryMmap<()>) {
        if self.next != self.cons && self.ring.set_cons_head(mem, self.next).is_ok() {
            self.cons = self.next;
        }
    }

    pub fn pending(&self, mem: &GuestMemoryMmap<()>) -> bool {
        !self.broken && self.ring.prod_tail(mem).is_ok_and(|p| p != self.next)
    }
}
