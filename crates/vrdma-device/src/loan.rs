//! One copy between two devices of a process: a payload the sender's
//! engine lent by reference is not copied into the same-host medium but
//! lent on ([`vrdma_fabric::shm::Loan`]), and the receiving device copies
//! it straight from the sender's memory into the MR its engine's checks
//! allow ([`vrdma_engine::Engine::handle_lent_packet`]).
//!
//! The copy happens later than the sender's checks, on another thread. A
//! [`Token`] holds what makes that safe: a handle on the sender's memory
//! map (it stays mapped while the token lives), the map's fence (revoked
//! before the map stops being the sender's: replaced, unmapped, the device
//! gone) and the fences of the MRs the pieces lie in (revoked by
//! deregistration and invalidation). The receiver enters every fence for
//! the length of its copy; a fence already revoked drops the packet —
//! counted, as a lost packet, which RC's retry resends, and the sender's
//! engine then finds the MR gone. A revocation waits for the copies under
//! way, so once a DEREG_MR (or an unmap) returns, no byte of that memory
//! moves again: the guarantee hardware gives by fencing its DMA.

use vm_memory::VolatileSlice;
use vrdma_engine::{
    Engine,
    fence::{Entered, Fence},
    memory::{Memory, MemoryError, WithLent},
};
use vrdma_fabric::{Lender, Piece, shm::Loan};
use vrdma_wire::frame::IpRepr;

use crate::memory::Lease;

/// What a lent-on payload carries from its sender to its receiver.
#[derive(Debug)]
pub struct Token {
    pub lease: Lease,
    /// The fences of the MRs the pieces lie in.
    pub fences: Vec<Fence>,
    /// The payload's pieces, in order, by the sender's device address.
    pub pieces: Vec<Piece>,
}

/// Why a lent-on packet was not handled.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Refused {
    /// Its sender's memory or MR was revoked since it was sent.
    Revoked,
    /// It carried something that is not a [`Token`] (no device sends such).
    Foreign,
}

/// Handles a packet whose payload `loan` lent on: with the sender's fences
/// entered, the engine checks it as any packet and copies the payload
/// from the sender's memory into `mem`.
pub fn receive<M: Memory + Lender>(
    engine: &mut Engine,
    now: u64,
    ip: &IpRepr,
    head: &[u8],
    loan: &Loan,
    mem: &mut M,
) -> Result<(), Refused> {
    let Some(token) = loan.token.downcast_ref::<Token>() else {
        return Err(Refused::Foreign);
    };
    let mut held: Vec<Entered<'_>> = Vec::with_capacity(1 + token.fences.len());
    for f in std::iter::once(token.lease.fence()).chain(&token.fences) {
        match f.enter() {
            Some(e) => held.push(e),
            None => return Err(Refused::Revoked),
        }
    }
    let mut cursor = (0, 0);
    let mut lent = WithLent {
        mem,
        // The destination was checked by the engine (an MR's bounds, keys,
        // rights); the memory says whether it is there in one piece.
        copy: |mem: &mut M, addr: u64, at: usize, len: usize| {
            let err = MemoryError {
                addr,
                len: len as u64,
            };
            let dst = mem.lend(addr, len).ok_or(err)?;
            copy(token, &mut cursor, at, dst).ok_or(err)
        },
    };
    engine.handle_lent_packet(now, ip, head, loan.payload_at, loan.len, &mut lent);
    drop(held);
    // An MR of this device the packet invalidated is revoked whole only
    // now that this device holds no other's fence.
    engine.finish_revocations();
    Ok(())
}

/// Copies payload bytes `at..at + dst.len()` of `token` into `dst`,
/// resuming the walk of its pieces at `cursor`.
fn copy(
    token: &Token,
    cursor: &mut (usize, usize),
    at: usize,
    dst: VolatileSlice<'_>,
) -> Option<()> {
    let pieces = &token.pieces;
    let (mut i, mut start) = *cursor;
    if at < start {
        (i, start) = (0, 0);
    }
    let mut done = 0;
    while done < dst.len() {
        let p = pieces.get(i)?;
        let within = at + done - start;
        if within >= p.len {
            start += p.len;
            i += 1;
            continue;
        }
        let n = (p.len - within).min(dst.len() - done);
        let src = token.lease.map().lend(p.addr + within as u64, n)?;
        src.copy_to_volatile_slice(dst.subslice(done, n).ok()?);
        done += n;
    }
    *cursor = (i, start);
    Some(())
}
