//! A transport that panics on demand: a bug inside a device's round, as
//! the daemon could have one, for the tests of panic isolation.

use std::{
    io,
    os::fd::BorrowedFd,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use vrdma_device::Transport;
use vrdma_engine::transmit::Transmit;
use vrdma_fabric::Lender;
use vrdma_wire::{Gid, frame::IpRepr};

/// `T` that panics in its next receive once its `trip` flag is
/// set (once per setting); otherwise `T` itself in every respect.
#[derive(Debug)]
pub struct Tripwire<T> {
    pub inner: T,
    trip: Arc<AtomicBool>,
}

impl<T> Tripwire<T> {
    /// `inner`, tripped by `trip`.
    pub fn new(inner: T, trip: Arc<AtomicBool>) -> Self {
        Tripwire { inner, trip }
    }
}

impl<T: Transport> Transport for Tripwire<T> {
    fn receive(
        &mut self,
        deliver: impl FnMut(&IpRepr, &[u8], Option<&vrdma_fabric::shm::Loan>),
    ) -> io::Result<usize> {
        if self.trip.swap(false, Ordering::Relaxed) {
            panic!("tripwire: a bug in the device's round");
        }
        self.inner.receive(deliver)
    }

    fn batch(&self) -> usize {
        self.inner.batch()
    }

    fn rx_bytes(&self) -> u64 {
        self.inner.rx_bytes()
    }

    fn has_room(&mut self) -> bool {
        self.inner.has_room()
    }

    fn slot(&mut self, mem: &impl Lender) -> (&mut [u8], usize) {
        self.inner.slot(mem)
    }

    fn queue(
        &mut self,
        t: &Transmit,
        lent: &vrdma_device::transport::Lent<'_>,
        mem: &impl Lender,
    ) -> usize {
        self.inner.queue(t, lent, mem)
    }

    fn jumbo_peers(&mut self) -> Option<Vec<vrdma_wire::Gid>> {
        self.inner.jumbo_peers()
    }

    fn flush(&mut self, mem: &impl Lender) -> usize {
        self.inner.flush(mem)
    }

    fn fd(&self) -> BorrowedFd<'_> {
        self.inner.fd()
    }

    fn arm(&mut self) {
        self.inner.arm();
    }

    fn counters(&self, out: &mut Vec<(String, u64)>) {
        self.inner.counters(out);
    }

    fn set_local(&mut self, gids: &[Gid]) {
        self.inner.set_local(gids);
    }

    fn admits_gid(&self, gid: &Gid) -> bool {
        self.inner.admits_gid(gid)
    }
}
