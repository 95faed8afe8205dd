//! Doorbell pages in shared memory: the mode with no exit per post.
//!
//! The device's BAR2 (one doorbell page per user context) is backed by a
//! memfd the client maps (a sparse mmap of the whole region): the guest's
//! doorbell writes land in memory without a trap, and the device reads
//! them each round, taking every word with an atomic swap to 0.
//!
//! What that can and cannot tell:
//!
//! - A QP doorbell (offset 0) names the QP and its rings (SEND, RECV): the
//!   device takes from what it names. A later store replaces an earlier
//!   one the device has not read, so a doorbell can be lost when two QPs
//!   of one context are rung between two looks; nothing posted is lost
//!   for it ([`Watch`]): the QPs that gave work in the last
//!   [`RECENT`] are looked at in every look, and a sweep goes over every
//!   QP, a share of them in each look, the whole every
//!   [`SWEEP_PERIOD_MIN`] or [`SWEEP_PER_QP`] per QP if that is longer
//!   (with 16 384 QPs, 262 ms: a look costs what the rung and the recent
//!   cost, not what every ring does; the sweep a QP every 16 µs, about 1 %
//!   of a core whatever the number of QPs). A WQE whose doorbell was lost and
//!   whose QP was idle waits for the sweep (counted, `pvrdma.sweep_found`,
//!   with the WQEs the sweep took before their doorbell was stored: Linux's
//!   vmw_pvrdma in a TCG guest, perftest and the pingpongs: 180 finds
//!   beside 5 538 WQEs taken in one smoke run, every exchange passing).
//! - SRQ doorbells (offset 8) are counted; every SRQ is taken from in
//!   every look (a device has few).
//! - A CQ doorbell (offset 4) is ARM, ARM_SOL or POLL for one CQ, and the
//!   provider writes POLL whenever a poll finds the CQ empty — typically
//!   right after an arm (arm, poll again, sleep). A later store replaces an
//!   earlier one the device has not read: an arm can be overwritten, and a
//!   lost arm is an application asleep for ever. So any store to a page's
//!   CQ word arms every CQ of that page for its next completion. No arm is
//!   lost; the price is a notification (an interrupt) a CQ that nobody
//!   armed may get — spurious completion events, which the verbs'
//!   arm-then-poll pattern already tolerates — and, for a busy-polling
//!   application, one interrupt per completion that finds its CQ drained.

use std::{
    collections::BTreeMap,
    fs::File,
    io,
    os::fd::OwnedFd,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
};

use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, VolatileMemory,
};
use vrdma_vfio_user::session::Mmap;

use crate::abi::PAGE_SIZE;

/// The doorbell pages, shared with the client.
#[derive(Debug)]
pub struct SharedDoorbells {
    fd: Arc<OwnedFd>,
    /// The same memory, mapped here (at address 0).
    map: GuestMemoryMmap<()>,
    pages: u32,
}

impl SharedDoorbells {
    /// `pages` zeroed doorbell pages, in a memfd sealed at that size
    /// before it is handed out: the client that maps it cannot shrink it
    /// under the device's reads (a SIGBUS in the daemon), nor grow it, nor
    /// lift the seals.
    pub fn new(pages: u32) -> io::Result<Self> {
        use nix::{
            fcntl::{FcntlArg, SealFlag, fcntl},
            sys::memfd::{MFdFlags, memfd_create},
        };
        let fd = memfd_create(
            c"vrdma-pvrdma-doorbells",
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
        )?;
        let size = u64::from(pages) * PAGE_SIZE;
        let file = File::from(fd.try_clone()?);
        file.set_len(size)?;
        let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
        fcntl(&fd, FcntlArg::F_ADD_SEALS(seals))?;
        let map = GuestMemoryMmap::<()>::from_ranges_with_files([(
            GuestAddress(0),
            size as usize,
            Some(FileOffset::new(file, 0)),
        )])
        .map_err(io::Error::other)?;
        Ok(SharedDoorbells {
            fd: Arc::new(fd),
            map,
            pages,
        })
    }

    /// What the client maps: the whole region.
    pub fn region(&self) -> Mmap {
        Mmap {
            fd: self.fd.clone(),
            offset: 0,
            areas: vec![(0, u64::from(self.pages) * PAGE_SIZE)],
        }
    }

    /// Takes the word at `offset` of doorbell page `page`: what the guest
    /// last stored there since the last take (0: nothing).
    #[must_use]
    pub fn take(&self, page: u32, offset: u64) -> u32 {
        if page >= self.pages || offset > PAGE_SIZE - 4 || !offset.is_multiple_of(4) {
            return 0;
        }
        let addr = GuestAddress(u64::from(page) * PAGE_SIZE + offset);
        self.map
            .get_slice(addr, 4)
            .ok()
            .and_then(|s| {
                s.get_atomic_ref::<AtomicU32>(0)
                    .ok()
                    .map(|w| w.swap(0, Ordering::AcqRel))
            })
            .unwrap_or(0)
    }

    /// Every page back to zero (a reset: nothing rung before it counts).
    pub fn clear(&self) {
        let zero = vec![0u8; PAGE_SIZE as usize];
        for p in 0..self.pages {
            let _ = self
                .map
                .write_slice(&zero, GuestAddress(u64::from(p) * PAGE_SIZE));
        }
    }
}

/// How long a QP that gave work stays among those looked at in every look.
pub const RECENT: u64 = 1_000_000;
/// The sweep's period: the whole of the QPs every this long at least…
pub const SWEEP_PERIOD_MIN: u64 = 4_000_000;
/// …and this long per QP where that is longer.
pub const SWEEP_PER_QP: u64 = 16_000;

/// What a look takes from beside the QPs rung: the recent, and the
/// sweep's share (see the module's doc). Times are the device clock's
/// (ns).
#[derive(Debug, Default)]
pub struct Watch {
    /// QPs that gave work (or were rung) lately, by when they last did.
    recent: BTreeMap<u32, u64>,
    /// The last QP the sweep looked at.
    cursor: u32,
    /// Where the sweep's share is counted from (none before the first
    /// look: a first look sweeps everything).
    swept_at: Option<u64>,
    /// QPs a look takes from, gathered before it takes (a look allocates
    /// nothing once it has looked at its largest set).
    scratch: Vec<u32>,
    /// The doorbell pages a look reads, gathered the same way.
    pub pages: Vec<u32>,
    /// QPs the sweep found work in: work whose doorbell was lost.
    pub sweep_found: u64,
}

impl Watch {
    /// QP `qpn` gave work, or was rung, at `now`.
    pub fn note(&mut self, qpn: u32, now: u64) {
        self.recent.insert(qpn, now);
    }

    /// The recent QPs, for a look to take from; those quiet for
    /// [`RECENT`] leave.
    pub fn recent(&mut self, now: u64) -> Vec<u32> {
        self.recent
            .retain(|_, &mut at| now.saturating_sub(at) < RECENT);
        let mut v = std::mem::take(&mut self.scratch);
        v.clear();
        v.extend(self.recent.keys().copied());
        v
    }

    /// The sweep's share at `now` of `qps` (the QPs there are, in order):
    /// as many as the time since its last share owes, after its cursor,
    /// wrapping.
    pub fn sweep(&mut self, now: u64, qps: &BTreeMap<u32, impl Sized>) -> Vec<u32> {
        let mut v = std::mem::take(&mut self.scratch);
        v.clear();
        let n = qps.len() as u64;
        if n == 0 {
            self.swept_at = Some(now);
            return v;
        }
        let period = SWEEP_PERIOD_MIN.max(n.saturating_mul(SWEEP_PER_QP));
        let share = match self.swept_at {
            None => n,
            Some(at) => (n.saturating_mul(now.saturating_sub(at)) / period).min(n),
        };
        if share == 0 {
            return v;
        }
        // The time the share stands for (what is left over counts
        // towards the next).
        self.swept_at = Some(match self.swept_at {
            Some(at) if share < n => at + share * period / n,
            _ => now,
        });
        let after = qps
            .range(self.cursor.saturating_add(1)..)
            .chain(qps.range(..=self.cursor))
            .map(|(&k, _)| k)
            .take(share as usize);
        v.extend(after);
        if let Some(&last) = v.last() {
            self.cursor = last;
        }
        v
    }

    /// A list [`Watch::recent`] or [`Watch::sweep`] gave, back for reuse.
    pub fn give_back(&mut self, v: Vec<u32>) {
        self.scratch = v;
    }

    /// Everything forgotten (a reset).
    pub fn clear(&mut self) {
        self.recent.clear();
        self.cursor = 0;
        self.swept_at = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qps(n: u32) -> BTreeMap<u32, ()> {
        (1..=n).map(|k| (k, ())).collect()
    }

    #[test]
    fn the_sweep_goes_over_every_qp_once_a_period_in_shares() {
        let mut w = Watch::default();
        let q = qps(4096);
        // The first look: everything.
        let first = w.sweep(0, &q);
        assert_eq!(first.len(), 4096);
        w.give_back(first);
        // 4096 QPs: a period of 65.5 ms, 16 µs a QP.
        let period = 4096 * SWEEP_PER_QP;
        let mut seen = std::collections::BTreeSet::new();
        let mut looks = 0;
        let mut now = 0;
        while now < period {
            now += 40_000;
            let share = w.sweep(now, &q);
            // 40 µs: two or three QPs, never the whole.
            assert!(share.len() <= 3, "{}", share.len());
            seen.extend(share.iter().copied());
            w.give_back(share);
            looks += 1;
        }
        assert_eq!(looks, 1639);
        assert_eq!(seen.len(), 4096, "every QP within a period");
        // Few QPs: the period is the minimum, and a look long after the
        // last takes every QP once, not more.
        let q = qps(3);
        let all = w.sweep(now + 10 * SWEEP_PERIOD_MIN, &q);
        assert_eq!(all.len(), 3);
        let mut sorted = all.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 3);
    }

    #[test]
    fn a_recent_qp_leaves_after_a_quiet_while() {
        let mut w = Watch::default();
        w.note(7, 0);
        w.note(9, 500_000);
        assert_eq!(w.recent(900_000), vec![7, 9]);
        assert_eq!(w.recent(RECENT), vec![9]);
        w.note(7, RECENT + 1);
        assert_eq!(w.recent(RECENT + 500_000), vec![7]);
        w.clear();
        assert!(w.recent(RECENT + 500_000).is_empty());
    }

    #[test]
    fn a_store_through_another_mapping_is_taken_once() {
        let d = SharedDoorbells::new(4).unwrap();
        let r = d.region();
        assert_eq!(r.areas, vec![(0, 4 * PAGE_SIZE)]);
        // The client's mapping of the same descriptor.
        let file = File::from(r.fd.try_clone().unwrap());
        let client = GuestMemoryMmap::<()>::from_ranges_with_files([(
            GuestAddress(0x9000_0000),
            4 * PAGE_SIZE as usize,
            Some(FileOffset::new(file, 0)),
        )])
        .unwrap();
        client
            .write_obj(
                0x4000_0007u32,
                GuestAddress(0x9000_0000 + 2 * PAGE_SIZE + 4),
            )
            .unwrap();
        assert_eq!(d.take(2, 4), 0x4000_0007);
        assert_eq!(d.take(2, 4), 0, "taken once");
        assert_eq!(d.take(2, 0), 0);
        // Out of range: nothing, no panic.
        assert_eq!(d.take(4, 0), 0);
        assert_eq!(d.take(0, PAGE_SIZE), 0);
        client
            .write_obj(1u32, GuestAddress(0x9000_0000 + 8))
            .unwrap();
        d.clear();
        assert_eq!(d.take(0, 8), 0);
    }

    #[test]
    fn the_pages_are_sealed_before_they_are_handed_out() {
        use nix::fcntl::{FcntlArg, SealFlag, fcntl};
        let d = SharedDoorbells::new(2).unwrap();
        let fd = d.region().fd;
        let seals = SealFlag::from_bits_truncate(fcntl(&*fd, FcntlArg::F_GET_SEALS).unwrap());
        assert!(
            seals.contains(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL)
        );
        // The client (with the descriptor) can neither shrink nor grow it.
        let file = File::from(fd.try_clone().unwrap());
        for len in [0, PAGE_SIZE, 4 * PAGE_SIZE] {
            let e = file.set_len(len).unwrap_err();
            assert_eq!(
                e.raw_os_error(),
                Some(nix::errno::Errno::EPERM as i32),
                "{len}"
            );
        }
        assert_eq!(file.metadata().unwrap().len(), 2 * PAGE_SIZE);
    }
}
