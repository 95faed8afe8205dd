//! A fence between a memory grant and the copies that use it later, on
//! another thread: what hardware does when deregistration waits for (or
//! fences) the DMA in flight.
//!
//! A payload lent by reference ([`crate::transmit::PayloadRef`]) may be
//! read after the poll that lent it — by a receiving device in the same
//! process, which copies it straight from the sender's memory into its own
//! MR (one copy, `vrdma_fabric::shm`). Between the two, the sender's guest
//! can deregister or invalidate the MR and reuse its pages, or its VMM can
//! unmap the memory. Each MR (and each memory map, in the device) has a
//! fence; the payload carries it; a reader [`Fence::enter`]s it for the
//! length of its copy, and a revocation ([`Fence::revoke`]) marks it and
//! waits for the copies under way — so once a deregistration returns, no
//! byte of the MR moves again, and a payload still in flight is refused
//! (its packet is dropped as a network would drop it, and the sender's
//! retry finds the MR gone).
//!
//! One atomic word: a reader count and a revoked bit, so that a reader
//! that comes after the revocation sees it (both are read-modify-writes of
//! the same word, ordered by it), and a revoker sees every reader that
//! came before. Written here, not taken from a crate: a read-write lock
//! whose writer never unlocks is all it is, and it must be cheap to clone
//! into every packet.

use std::sync::{
    Arc,
    atomic::{AtomicU32, Ordering},
};

const REVOKED: u32 = 1 << 31;

/// A shared fence (cloning gives another handle on the same one).
#[derive(Clone, Debug, Default)]
pub struct Fence(Arc<AtomicU32>);

/// A copy under way: the fence cannot complete a revocation until it is
/// dropped.
#[derive(Debug)]
#[must_use]
pub struct Entered<'a>(&'a Fence);

impl Fence {
    pub fn new() -> Self {
        Fence::default()
    }

    /// Starts a copy under the fence, or `None` if it was revoked.
    pub fn enter(&self) -> Option<Entered<'_>> {
        let before = self.0.fetch_add(1, Ordering::SeqCst);
        if before & REVOKED != 0 {
            self.0.fetch_sub(1, Ordering::Release);
            return None;
        }
        Some(Entered(self))
    }

    /// Revokes the grant: no copy starts from now on, and this returns
    /// once the copies under way ended. The wait is one copy long (a copy
    /// holds the fence for nothing else); a reader descheduled mid-copy
    /// makes it longer, so the waiter yields its core.
    pub fn revoke(&self) {
        self.close();
        self.wait();
    }

    /// The first half of [`Fence::revoke`]: no copy starts from now on.
    /// For a revoker that itself holds other fences entered (a device
    /// handling a lent payload that invalidates one of its own MRs): it
    /// waits ([`Fence::wait`]) once it let them go, or two such devices
    /// could wait for each other.
    pub fn close(&self) {
        self.0.fetch_or(REVOKED, Ordering::SeqCst);
    }

    /// The second half of [`Fence::revoke`]: returns once the copies that
    /// started before [`Fence::close`] ended.
    pub fn wait(&self) {
        let mut spins = 0u32;
        while self.0.load(Ordering::Acquire) & !REVOKED != 0 {
            if spins < 64 {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
        }
    }

    pub fn is_revoked(&self) -> bool {
        self.0.load(Ordering::Acquire) & REVOKED != 0
    }

    /// Whether `other` is a handle on the same fence.
    pub fn same(&self, other: &Fence) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl PartialEq for Fence {
    fn eq(&self, other: &Self) -> bool {
        self.same(other)
    }
}

impl Eq for Fence {}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        (self.0).0.fetch_sub(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn a_revoked_fence_admits_no_copy() {
        let f = Fence::new();
        let g = f.enter().expect("open");
        drop(g);
        f.revoke();
        assert!(f.is_revoked());
        assert!(f.enter().is_none());
        assert!(f.clone().enter().is_none());
    }

    #[test]
    fn revocation_waits_for_the_copy_under_way() {
        let f = Fence::new();
        let copying = Arc::new(AtomicBool::new(true));
        let entered = f.enter().expect("open");
        let (f2, c2) = (f.clone(), Arc::clone(&copying));
        let revoker = std::thread::spawn(move || {
            f2.revoke();
            // The copy must have ended before the revocation returned.
            !c2.load(Ordering::SeqCst)
        });
        // The revoker is waiting on this copy; it cannot have returned.
        while !f.is_revoked() {
            std::thread::yield_now();
        }
        assert!(!revoker.is_finished());
        copying.store(false, Ordering::SeqCst);
        drop(entered);
        assert!(revoker.join().unwrap(), "revoke returned during a copy");
    }
}
