//! A peer daemon as this daemon's devices see it ([`Link`]: gone or not,
//! the addresses it holds), and the two ends of a ring a device uses: the
//! writing end into a peer's device ([`Outbound`]) and the reading end of
//! one it gave a peer ([`InRing`]), whose packets it checks.

use std::{
    collections::HashSet,
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use nix::sys::eventfd::EventFd;
use vrdma_wire::{Gid, frame::Route};

use crate::{
    Lender, Piece,
    shm::{Dropped, NetId, Stats, lock, ring},
};

/// A daemon on the other side of a connection, as the devices that read
/// its rings and write into them see it.
#[derive(Debug)]
pub(super) struct Link {
    /// Its connection is gone: its rings are read to their end, then
    /// dropped.
    pub(super) gone: AtomicBool,
    /// The addresses it holds, by network (its devices' accepted
    /// announcements).
    pub(super) allowed: Mutex<Arc<HashSet<(NetId, Gid)>>>,
    /// Bumped with `allowed`.
    pub(super) generation: AtomicU64,
}

impl Link {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Link {
            gone: AtomicBool::new(false),
            allowed: Mutex::new(Arc::new(HashSet::new())),
            generation: AtomicU64::new(0),
        })
    }
}

/// The writing end of a ring of a peer's device.
#[derive(Debug)]
pub(in crate::shm) struct Outbound {
    pub(in crate::shm) id: u64,
    pub(super) producer: Mutex<ring::Producer>,
    /// The peer device's eventfd (checked to be one).
    pub(super) wake: OwnedFd,
    pub(super) link: Arc<Link>,
}

impl Outbound {
    /// Writes a packet (as `Port::send` describes it) into the ring;
    /// visible at [`Outbound::publish`].
    pub(in crate::shm) fn push(
        &self,
        route: &Route,
        head: &[u8],
        payload_at: usize,
        lent: &[Piece],
        mem: &impl Lender,
    ) -> Result<usize, Dropped> {
        if self.link.gone.load(Ordering::Relaxed) {
            return Err(Dropped::Gone);
        }
        let mut p = lock(&self.producer);
        p.push_gather(route, head, payload_at, lent, mem)
            .map_err(|e| match e {
                ring::PushError::Full => Dropped::Full,
                ring::PushError::Broken => Dropped::Gone,
                ring::PushError::Unlent => Dropped::Unlent,
            })
    }

    /// Makes what was pushed visible, and wakes the peer's device if it
    /// asked to be.
    pub(in crate::shm) fn publish(&self) {
        if lock(&self.producer).publish() {
            // An eventfd (checked when the ring came): 8 bytes, never
            // blocking (non-blocking, and a full counter only refuses).
            let _ = nix::unistd::write(&self.wake, &1u64.to_ne_bytes());
        }
    }
}

/// The reading end of a ring this daemon gave a peer for one device.
#[derive(Debug)]
pub(in crate::shm) struct InRing {
    pub(super) consumer: ring::Consumer,
    /// The network of the device it was made for.
    pub(super) net: NetId,
    /// Written by the peer (or by the device itself when it arms with
    /// packets waiting); in the device's epoll.
    pub(super) event: EventFd,
    pub(super) link: Arc<Link>,
    /// The peer's addresses as last read, and the generation read.
    pub(super) allowed: (u64, Arc<HashSet<(NetId, Gid)>>),
    /// The last source found in `allowed` (a ring's packets mostly come
    /// from one address: no hash per packet), forgotten with it.
    pub(super) last_src: Option<Gid>,
}

/// Records one [`InRing::receive`] looks at beyond its budget of delivered
/// packets, as multiples of it: refused records (a peer's junk) do not eat
/// the device's batch, but cannot keep it reading one ring for ever.
const REFUSED_PER_BUDGET: usize = 4;

impl InRing {
    /// Whether the ring is done with: broken, or its peer gone and every
    /// packet read.
    pub(in crate::shm) fn finished(&self) -> bool {
        self.consumer.is_broken()
            || (self.link.gone.load(Ordering::Acquire) && self.consumer.pending() == 0)
    }

    pub(in crate::shm) fn event(&self) -> BorrowedFd<'_> {
        self.event.as_fd()
    }

    pub(in crate::shm) fn disarm(&self) {
        self.consumer.disarm();
    }

    /// Before the device sleeps: the peer must wake it; if packets wait
    /// already, the device's descriptor is made readable now. The
    /// eventfd's count is drained first, so that a peer that writes it
    /// without sending wakes the device once per write, not for ever.
    pub(in crate::shm) fn arm(&self) {
        let _ = self.event.read();
        if self.consumer.arm() {
            let _ = self.event.write(1);
        }
    }

    /// Delivers up to `budget` packets, each copied into `buf` and handed
    /// to `deliver` if its source is an address the peer holds on the
    /// ring's network and its destination one of `local`; the others are
    /// counted and do not count against `budget` (at most
    /// [`REFUSED_PER_BUDGET`] × `budget` of them a call). Returns the
    /// packets delivered.
    pub(in crate::shm) fn receive(
        &mut self,
        buf: &mut [u8],
        local: &[Gid],
        stats: &mut Stats,
        budget: usize,
        deliver: &mut impl FnMut(&Route, &[u8]),
    ) -> usize {
        let generation = self.link.generation.load(Ordering::Acquire);
        if generation != self.allowed.0 {
            self.allowed = (generation, Arc::clone(&lock(&self.link.allowed)));
            self.last_src = None;
        }
        let (mut n, mut refused, mut taken) = (0, 0, false);
        while n < budget && refused < REFUSED_PER_BUDGET * budget {
            match self.consumer.pop(buf) {
                Ok(r) => {
                    taken = true;
                    let src = r.route.src;
                    let allowed = self.last_src == Some(src)
                        || self.allowed.1.contains(&(self.net, src)) && {
                            self.last_src = Some(src);
                            true
                        };
                    if !allowed || !local.contains(&r.route.dst) {
                        stats.rx_refused += 1;
                        refused += 1;
                        continue;
                    }
                    n += 1;
                    stats.rx_packets += 1;
                    stats.rx_bytes += r.len as u64;
                    deliver(&r.route, &buf[..r.len]);
                }
                Err(ring::PopError::Empty) => break,
                Err(ring::PopError::Broken) => {
                    stats.rx_broken += 1;
                    break;
                }
            }
        }
        if taken {
            self.consumer.release();
        }
        n
    }
}
