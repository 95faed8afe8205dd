//! Doorbell pages in shared memory: the mode with no exit per post.
//!
//! The device's BAR2 (one doorbell page per user context) is backed by a
//! memfd the client maps (a sparse mmap of the whole region): the guest's
//! doorbell writes land in memory without a trap, and the device reads
//! them each round, taking every word with an atomic swap to 0.
//!
//! What that can and cannot tell:
//!
//! - QP and SRQ doorbells (offsets 0 and 8) only say that something was
//!   posted; in this mode the device takes from every ring each round, so
//!   a doorbell overwritten before the device saw it loses nothing.
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

#[cfg(test)]
mod tests {
    use super::*;

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
