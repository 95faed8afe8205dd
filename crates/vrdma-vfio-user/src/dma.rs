//! The client's DMA maps: guest RAM that QEMU shares by file descriptor
//! (`memory-backend-memfd,share=on`), mapped into this process with
//! `vm-memory` and reached only through it. A map without a descriptor
//! (anonymous RAM, ROM, another device's BAR) or without write access is
//! recorded but not accessible: the device never reads ROM, and nothing it
//! writes may land in read-only memory.

use std::{fs::File, os::fd::OwnedFd, sync::Arc};

use nix::errno::Errno;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use crate::proto::{self, DmaMap, DmaUnmap};

/// Maps at most (what the server announces as `max_dma_maps`).
pub const MAX_MAPS: usize = 65535;

/// The page size maps must be aligned to.
const PAGE: u64 = 4096;

#[derive(Debug)]
struct Entry {
    addr: u64,
    size: u64,
    /// Mapped into this process (shared, readable and writable).
    accessible: bool,
}

/// Every map the client made, and the accessible ones as one guest memory.
#[derive(Debug, Default)]
pub struct DmaTable {
    /// Sorted by address, never overlapping.
    entries: Vec<Entry>,
    mem: GuestMemoryMmap<()>,
}

impl DmaTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// The accessible maps (a cheap clone shares the mappings).
    pub fn mem(&self) -> &GuestMemoryMmap<()> {
        &self.mem
    }

    /// Maps, accessible or not.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// `DMA_MAP`: `size` bytes at `addr`, from `fd` at `offset` if one came.
    pub fn map(&mut self, m: &DmaMap, fd: Option<OwnedFd>) -> Result<(), Errno> {
        if m.flags & !(proto::dma::READ | proto::dma::WRITE) != 0 || m.flags & proto::dma::READ == 0
        {
            return Err(Errno::EINVAL);
        }
        if m.size == 0
            || !m.addr.is_multiple_of(PAGE)
            || !m.size.is_multiple_of(PAGE)
            || !m.offset.is_multiple_of(PAGE)
            || m.addr.checked_add(m.size).is_none()
            || usize::try_from(m.size).is_err()
        {
            return Err(Errno::EINVAL);
        }
        let at = self.entries.partition_point(|e| e.addr < m.addr);
        let end = m.addr + m.size;
        let before = at.checked_sub(1).map(|i| &self.entries[i]);
        let after = self.entries.get(at);
        if before.is_some_and(|e| e.addr + e.size > m.addr) || after.is_some_and(|e| e.addr < end) {
            return Err(Errno::EEXIST);
        }
        if self.entries.len() >= MAX_MAPS {
            return Err(Errno::ENOSPC);
        }
        let writable = m.flags & proto::dma::WRITE != 0;
        let accessible = match fd {
            Some(fd) if writable => {
                let file = File::from(fd);
                // The file must hold the whole range: a page past its end
                // would fault (SIGBUS) on the first access, so a short
                // file is refused here. The mapping is shared, so the
                // guest's stores and ours meet in the same pages.
                let len = file.metadata().map_err(|_| Errno::EBADF)?.len();
                if m.offset.checked_add(m.size).is_none_or(|end| end > len) {
                    return Err(Errno::EINVAL);
                }
                let region = MmapRegion::<()>::from_file(
                    FileOffset::new(file, m.offset),
                    m.size as usize,
                )
                .map_err(|e| {
                    tracing::warn!(addr = m.addr, size = m.size, error = %e, "DMA map: mmap failed");
                    Errno::EINVAL
                })?;
                let region =
                    GuestRegionMmap::new(region, GuestAddress(m.addr)).ok_or(Errno::EINVAL)?;
                self.mem = self
                    .mem
                    .insert_region(Arc::new(region))
                    .map_err(|_| Errno::EEXIST)?;
                true
            }
            // Read-only memory is never the device's to write, and it
            // never needs to read it; memory without a descriptor cannot
            // be reached from here at all.
            _ => false,
        };
        self.entries.insert(
            at,
            Entry {
                addr: m.addr,
                size: m.size,
                accessible,
            },
        );
        Ok(())
    }

    /// `DMA_UNMAP`: the map made at exactly `addr`/`size`, or all of them.
    /// The mappings go when the last user of [`DmaTable::mem`] lets go.
    pub fn unmap(&mut self, u: &DmaUnmap) -> Result<(), Errno> {
        if u.flags & proto::dma::UNMAP_GET_DIRTY_BITMAP != 0 {
            return Err(Errno::ENOTSUP);
        }
        if u.flags & !proto::dma::UNMAP_ALL != 0 {
            return Err(Errno::EINVAL);
        }
        if u.flags & proto::dma::UNMAP_ALL != 0 {
            if u.addr != 0 || u.size != 0 {
                return Err(Errno::EINVAL);
            }
            self.clear();
            return Ok(());
        }
        let i = self
            .entries
            .iter()
            .position(|e| e.addr == u.addr && e.size == u.size)
            .ok_or(Errno::ENOENT)?;
        let e = self.entries.remove(i);
        if e.accessible {
            self.mem = self
                .mem
                .remove_region(GuestAddress(e.addr), e.size)
                .map(|(m, _)| m)
                .map_err(|_| Errno::EINVAL)?;
        }
        Ok(())
    }

    /// Forgets every map (the client went away).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.mem = GuestMemoryMmap::default();
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use vm_memory::{Bytes, GuestMemoryBackend};

    use super::*;

    fn memfd(len: u64) -> OwnedFd {
        let fd =
            nix::sys::memfd::memfd_create(c"vrdma-dma-test", nix::sys::memfd::MFdFlags::empty())
                .unwrap();
        let mut f = File::from(fd);
        f.set_len(len).unwrap();
        f.flush().unwrap();
        f.into()
    }

    fn map(addr: u64, size: u64) -> DmaMap {
        DmaMap {
            argsz: 32,
            flags: proto::dma::READ | proto::dma::WRITE,
            offset: 0,
            addr,
            size,
        }
    }

    #[test]
    fn maps_are_reached_at_their_address_and_never_overlap() {
        let mut t = DmaTable::new();
        t.map(&map(0x10000, 0x2000), Some(memfd(0x2000))).unwrap();
        t.mem()
            .write_obj(0xdead_beef_u32, GuestAddress(0x11ffc))
            .unwrap();
        assert_eq!(
            t.mem().read_obj::<u32>(GuestAddress(0x11ffc)).unwrap(),
            0xdead_beef
        );
        assert!(t.mem().read_obj::<u32>(GuestAddress(0x12000)).is_err());
        for (addr, size) in [(0x10000, 0x1000), (0xf000, 0x2000), (0x11000, 0x4000)] {
            assert_eq!(
                t.map(&map(addr, size), Some(memfd(size))),
                Err(Errno::EEXIST)
            );
        }
        t.map(&map(0x12000, 0x1000), Some(memfd(0x1000))).unwrap();
        assert_eq!(t.mem().num_regions(), 2);
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn a_file_shorter_than_the_map_or_unaligned_fields_are_refused() {
        let mut t = DmaTable::new();
        assert_eq!(
            t.map(&map(0x10000, 0x2000), Some(memfd(0x1000))),
            Err(Errno::EINVAL)
        );
        assert_eq!(
            t.map(&map(0x10001, 0x1000), Some(memfd(0x2000))),
            Err(Errno::EINVAL)
        );
        assert_eq!(
            t.map(&map(0x10000, 0), Some(memfd(0x2000))),
            Err(Errno::EINVAL)
        );
        assert_eq!(
            t.map(&map(u64::MAX - 0xfff, 0x2000), Some(memfd(0x2000))),
            Err(Errno::EINVAL)
        );
        assert!(t.is_empty());
    }

    #[test]
    fn maps_without_a_file_or_write_access_are_kept_but_not_reachable() {
        let mut t = DmaTable::new();
        t.map(&map(0x0, 0x1000), None).unwrap();
        let ro = DmaMap {
            flags: proto::dma::READ,
            ..map(0x1000, 0x1000)
        };
        t.map(&ro, Some(memfd(0x1000))).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t.mem().num_regions(), 0);
        assert!(t.mem().read_obj::<u8>(GuestAddress(0x1000)).is_err());
    }

    #[test]
    fn unmap_takes_an_exact_map_or_all() {
        let mut t = DmaTable::new();
        t.map(&map(0x10000, 0x2000), Some(memfd(0x2000))).unwrap();
        t.map(&map(0x20000, 0x1000), Some(memfd(0x1000))).unwrap();
        let u = |addr, size, flags| DmaUnmap {
            argsz: 24,
            flags,
            addr,
            size,
        };
        assert_eq!(t.unmap(&u(0x10000, 0x1000, 0)), Err(Errno::ENOENT));
        t.unmap(&u(0x10000, 0x2000, 0)).unwrap();
        assert!(t.mem().read_obj::<u8>(GuestAddress(0x10000)).is_err());
        assert!(t.mem().read_obj::<u8>(GuestAddress(0x20000)).is_ok());
        assert_eq!(
            t.unmap(&u(0, 0, proto::dma::UNMAP_GET_DIRTY_BITMAP)),
            Err(Errno::ENOTSUP)
        );
        t.unmap(&u(0, 0, proto::dma::UNMAP_ALL)).unwrap();
        assert!(t.is_empty());
        assert_eq!(t.mem().num_regions(), 0);
    }
}
