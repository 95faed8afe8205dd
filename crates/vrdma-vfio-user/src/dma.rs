//! The client's DMA maps: guest RAM that QEMU shares by file descriptor
//! (`memory-backend-memfd,share=on`), mapped into this process with
//! `vm-memory` and reached only through it. A map without a descriptor
//! (anonymous RAM, ROM, another device's BAR) or without write access is
//! recorded but not accessible: the device never reads ROM, and nothing it
//! writes may land in read-only memory.
//!
//! A descriptor must be a regular file (a memfd, a tmpfs or hugetlbfs
//! file): a FIFO, a socket or a device is never mapped. A shared mapping
//! faults with SIGBUS past its file's end, and a file the client can shrink
//! after the map would kill the daemon at the device's next access, so the
//! file must be sealed against shrinking (`F_SEAL_SHRINK`, which QEMU's
//! `memory-backend-memfd` sets by default) unless
//! [`DmaConfig::allow_unsealed`] says otherwise; then its mapping is
//! registered with the [`sigbus`] guard, whose faults read zeros (counted:
//! [`DmaTable::faults`]). A hugetlbfs file is guarded too, sealed or not:
//! a hole the client punches may find no huge page left when touched.
//!
//! The maps are budgeted ([`DmaConfig`]): their number (each holds a
//! descriptor and a mapping: `RLIMIT_NOFILE` and `vm.max_map_count` are the
//! process's) and the bytes mapped (the address space is the process's).
//! A mapping the client took back is still held while the function holds
//! it; it counts until it goes (see [`DmaTable::reap`]).

use std::{
    fs::File,
    os::fd::OwnedFd,
    sync::{Arc, Mutex},
};

use nix::{
    errno::Errno,
    fcntl::{FcntlArg, fcntl},
    sys::{
        stat::fstat,
        statfs::{HUGETLBFS_MAGIC, fstatfs},
    },
};
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use crate::{
    proto::{self, DmaMap, DmaUnmap},
    sigbus,
};

/// The page size maps must be aligned to.
const PAGE: u64 = 4096;

/// The default [`DmaConfig::max_maps`]. QEMU maps each section of guest
/// RAM (RAM below and above 4 GiB, ROMs, hot-plugged DIMMs, at most 256 of
/// them): a few, rarely dozens. 64 guests at this budget stay under the
/// kernel's default `vm.max_map_count` (65530).
pub const DEFAULT_MAX_MAPS: usize = 1024;

/// The default [`DmaConfig::max_bytes`]: 1 TiB. A guest maps its RAM
/// once; no guest this serves has more, and a hundred at the budget fit in
/// the 128 TiB of a process's address space (x86-64, 4-level paging).
pub const DEFAULT_MAX_BYTES: u64 = 1 << 40;

/// What a client may map.
#[derive(Clone, Debug)]
pub struct DmaConfig {
    /// Take memory whose file is not sealed against shrinking, guarded by
    /// [`sigbus`] (its lost pages read zeros); off by default: such a map
    /// is refused with EPERM.
    pub allow_unsealed: bool,
    /// Maps held at most (ENOSPC beyond; announced as `max_dma_maps`).
    pub max_maps: usize,
    /// Bytes mapped into this process at most (ENOMEM beyond).
    pub max_bytes: u64,
}

impl Default for DmaConfig {
    fn default() -> Self {
        DmaConfig {
            allow_unsealed: false,
            max_maps: DEFAULT_MAX_MAPS,
            max_bytes: DEFAULT_MAX_BYTES,
        }
    }
}

/// What a table holds of the process's resources.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct Usage {
    /// Maps, accessible or not, and those taken back but still held.
    pub maps: usize,
    /// Bytes mapped into this process.
    pub bytes: u64,
    /// Descriptors held: one per mapping.
    pub fds: usize,
}

/// A mapping of the client's memory (which holds its file open), with its
/// guard when it has one. The guard is withdrawn first, before the mapping
/// can go (fields drop in order).
#[derive(Debug)]
struct Held {
    guard: Option<sigbus::Guard>,
    region: Arc<GuestRegionMmap<()>>,
}

impl Held {
    fn size(&self) -> u64 {
        self.region.size() as u64
    }

    fn faults(&self) -> u64 {
        self.guard.as_ref().map_or(0, sigbus::Guard::faults)
    }

    /// Whether nothing but this holds the mapping (dropping it unmaps).
    fn is_last(&self) -> bool {
        Arc::strong_count(&self.region) == 1
    }
}

#[derive(Debug)]
struct Entry {
    addr: u64,
    size: u64,
    /// Mapped into this process (shared, readable and writable).
    held: Option<Held>,
}

/// Mappings of dropped tables that something still held: any table's
/// [`DmaTable::reap`] lets them go once nothing does.
static ORPHANS: Mutex<Vec<Held>> = Mutex::new(Vec::new());

/// Every map the client made, and the accessible ones as one guest memory.
#[derive(Debug)]
pub struct DmaTable {
    /// Sorted by address, never overlapping.
    entries: Vec<Entry>,
    mem: GuestMemoryMmap<()>,
    /// Mappings taken back that a user of [`DmaTable::mem`] may still hold.
    retired: Vec<Held>,
    config: DmaConfig,
    /// Faults repaired in mappings since gone.
    past_faults: u64,
}

impl DmaTable {
    pub fn new(config: DmaConfig) -> Self {
        DmaTable {
            entries: Vec::new(),
            mem: GuestMemoryMmap::default(),
            retired: Vec::new(),
            config,
            past_faults: 0,
        }
    }

    pub fn config(&self) -> &DmaConfig {
        &self.config
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

    /// What the table holds now: at most [`DmaConfig::max_maps`] maps and
    /// descriptors, and [`DmaConfig::max_bytes`] bytes.
    pub fn usage(&self) -> Usage {
        let held = || {
            self.entries
                .iter()
                .filter_map(|e| e.held.as_ref())
                .chain(&self.retired)
        };
        Usage {
            maps: self.entries.len() + self.retired.len(),
            bytes: held().map(Held::size).sum(),
            fds: held().count(),
        }
    }

    /// Faults repaired in guarded maps (pages the client's files lost).
    pub fn faults(&self) -> u64 {
        let held = self.entries.iter().filter_map(|e| e.held.as_ref());
        self.past_faults + held.chain(&self.retired).map(Held::faults).sum::<u64>()
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
        self.reap();
        if self.usage().maps >= self.config.max_maps {
            return Err(Errno::ENOSPC);
        }
        let writable = m.flags & proto::dma::WRITE != 0;
        let held = match fd {
            Some(fd) if writable => Some(self.map_file(m, File::from(fd))?),
            // Read-only memory is never the device's to write, and it
            // never needs to read it; memory without a descriptor cannot
            // be reached from here at all.
            _ => None,
        };
        self.entries.insert(
            at,
            Entry {
                addr: m.addr,
                size: m.size,
                held,
            },
        );
        Ok(())
    }

    /// Maps `file` for `m` (checked but for the file) into [`DmaTable::mem`].
    fn map_file(&mut self, m: &DmaMap, file: File) -> Result<Held, Errno> {
        let kind = FileKind::of(&file)?;
        if !kind.sealed && !self.config.allow_unsealed {
            tracing::debug!(
                addr = m.addr,
                "DMA map: the file is not sealed against shrinking"
            );
            return Err(Errno::EPERM);
        }
        // The file must hold the whole range: a page past its end would
        // fault (SIGBUS) on the first access, so a short file is refused
        // here (and a sealed one cannot shrink later).
        if m.offset
            .checked_add(m.size)
            .is_none_or(|end| end > kind.len)
        {
            return Err(Errno::EINVAL);
        }
        if self.usage().bytes.saturating_add(m.size) > self.config.max_bytes {
            return Err(Errno::ENOMEM);
        }
        // The mapping is shared, so the guest's stores and ours meet in the
        // same pages.
        let region = MmapRegion::<()>::from_file(FileOffset::new(file, m.offset), m.size as usize)
            .map_err(|e| {
                tracing::warn!(addr = m.addr, size = m.size, error = %e, "DMA map: mmap failed");
                Errno::EINVAL
            })?;
        let guard = if kind.guarded() {
            // SAFETY: the range is the mapping just made, which `Held`
            // keeps (and unmaps only after dropping the guard: its field
            // order, and `reap`, which drops a mapping only once nothing
            // else holds it); a page of client memory that faulted had no
            // contents left, so a zero page in its place loses nothing.
            let g = unsafe { sigbus::register(region.as_ptr() as usize, region.size(), kind.page) };
            Some(g.map_err(|e| {
                tracing::warn!(addr = m.addr, error = %e, "DMA map: no SIGBUS guard");
                match e {
                    sigbus::Error::Full => Errno::ENOMEM,
                    _ => Errno::EINVAL,
                }
            })?)
        } else {
            None
        };
        let region = GuestRegionMmap::new(region, GuestAddress(m.addr)).ok_or(Errno::EINVAL)?;
        let held = Held {
            guard,
            region: Arc::new(region),
        };
        self.mem = self
            .mem
            .insert_region(held.region.clone())
            .map_err(|_| Errno::EEXIST)?;
        Ok(held)
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
        if self.entries[i].held.is_some() {
            self.mem = self
                .mem
                .remove_region(GuestAddress(u.addr), u.size)
                .map(|(m, _)| m)
                .map_err(|_| Errno::EINVAL)?;
        }
        let e = self.entries.remove(i);
        self.retired.extend(e.held);
        self.reap();
        Ok(())
    }

    /// Forgets every map (the client went away).
    pub fn clear(&mut self) {
        self.mem = GuestMemoryMmap::default();
        let held = self.entries.drain(..).filter_map(|e| e.held);
        self.retired.extend(held);
        self.reap();
    }

    /// Lets go of the mappings taken back that nothing else holds any more
    /// (their guards first). Call it once the users of the memory were
    /// told it changed.
    pub fn reap(&mut self) {
        let mut gone = 0;
        self.retired.retain(|h| {
            let last = h.is_last();
            if last {
                gone += h.faults();
            }
            !last
        });
        self.past_faults += gone;
        let mut orphans = ORPHANS.lock().unwrap_or_else(|p| p.into_inner());
        orphans.retain(|h| !h.is_last());
    }
}

impl Drop for DmaTable {
    fn drop(&mut self) {
        self.clear();
        if !self.retired.is_empty() {
            // Still held by a user that outlives the table: the guards
            // stay until the mappings go.
            let mut orphans = ORPHANS.lock().unwrap_or_else(|p| p.into_inner());
            orphans.append(&mut self.retired);
        }
    }
}

/// What a DMA map's file is, as far as mapping it goes.
#[derive(Debug)]
struct FileKind {
    len: u64,
    /// Sealed against shrinking.
    sealed: bool,
    hugetlb: bool,
    /// Its page size.
    page: usize,
}

impl FileKind {
    /// A regular file's kind; EINVAL for anything else.
    fn of(file: &File) -> Result<Self, Errno> {
        let st = fstat(file).map_err(|_| Errno::EBADF)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            tracing::debug!(mode = st.st_mode, "DMA map: not a regular file");
            return Err(Errno::EINVAL);
        }
        // A file that cannot be sealed (not on tmpfs or hugetlbfs) says
        // EINVAL: it has no seals.
        let seals = fcntl(file, FcntlArg::F_GET_SEALS).unwrap_or(0);
        let hugetlb = fstatfs(file).is_ok_and(|s| s.filesystem_type() == HUGETLBFS_MAGIC);
        let page = if hugetlb {
            usize::try_from(st.st_blksize).map_err(|_| Errno::EINVAL)?
        } else {
            sigbus::page_size()
        };
        Ok(FileKind {
            len: u64::try_from(st.st_size).map_err(|_| Errno::EINVAL)?,
            sealed: seals & libc::F_SEAL_SHRINK != 0,
            hugetlb,
            page,
        })
    }

    /// Whether its mapping needs the SIGBUS guard: an unsealed file can
    /// shrink, and a hugetlbfs file can lack a page for a hole punched in
    /// it.
    fn guarded(&self) -> bool {
        !self.sealed || self.hugetlb
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::{io::Write, os::fd::AsFd};

    use nix::{
        fcntl::SealFlag,
        sys::memfd::{MFdFlags, memfd_create},
    };
    use vm_memory::{Bytes, GuestMemoryBackend};

    use super::*;

    /// A memfd of `len` bytes, unsealed.
    pub(crate) fn unsealed(len: u64) -> OwnedFd {
        let fd = memfd_create(c"vrdma-dma-test", MFdFlags::MFD_ALLOW_SEALING).unwrap();
        let mut f = File::from(fd);
        f.set_len(len).unwrap();
        f.flush().unwrap();
        f.into()
    }

    /// A memfd of `len` bytes sealed as QEMU seals guest RAM.
    pub(crate) fn memfd(len: u64) -> OwnedFd {
        let fd = unsealed(len);
        let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
        fcntl(&fd, FcntlArg::F_ADD_SEALS(seals)).unwrap();
        fd
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

    fn table() -> DmaTable {
        DmaTable::new(DmaConfig::default())
    }

    #[test]
    fn only_regular_files_sealed_against_shrinking_are_mapped() {
        let mut t = table();
        assert_eq!(
            t.map(&map(0x10000, 0x1000), Some(unsealed(0x1000))),
            Err(Errno::EPERM)
        );
        // Other kinds, refused whatever the seals policy.
        let mut lax = DmaTable::new(DmaConfig {
            allow_unsealed: true,
            ..DmaConfig::default()
        });
        let kinds = || -> Vec<OwnedFd> {
            let (pipe_r, pipe_w) = nix::unistd::pipe().unwrap();
            let (sock, _) = std::os::unix::net::UnixStream::pair().unwrap();
            vec![
                pipe_r,
                pipe_w,
                sock.into(),
                File::open("/dev/null").unwrap().into(),
                File::open("/dev/zero").unwrap().into(),
                File::open("/").unwrap().into(),
                nix::sys::eventfd::EventFd::new().unwrap().into(),
            ]
        };
        for t in [&mut t, &mut lax] {
            for fd in kinds() {
                let what = format!("{fd:?}");
                let r = t.map(&map(0x10000, 0x1000), Some(fd));
                assert_eq!(r, Err(Errno::EINVAL), "{what}");
            }
        }
        assert!(t.is_empty() && lax.is_empty());
        // A sealed memfd is taken, and the client can no longer shrink it.
        let fd = memfd(0x1000);
        let client = fd.try_clone().unwrap();
        t.map(&map(0x10000, 0x1000), Some(fd)).unwrap();
        assert_eq!(nix::unistd::ftruncate(client.as_fd(), 0), Err(Errno::EPERM));
        assert_eq!(
            t.usage(),
            Usage {
                maps: 1,
                bytes: 0x1000,
                fds: 1
            }
        );
    }

    #[test]
    fn maps_are_budgeted_by_count_and_bytes() {
        let mut t = DmaTable::new(DmaConfig {
            allow_unsealed: false,
            max_maps: 3,
            max_bytes: 0x3000,
        });
        t.map(&map(0x10000, 0x1000), Some(memfd(0x1000))).unwrap();
        t.map(&map(0x20000, 0x1000), Some(memfd(0x1000))).unwrap();
        assert_eq!(
            t.map(&map(0x30000, 0x2000), Some(memfd(0x2000))),
            Err(Errno::ENOMEM),
            "bytes"
        );
        // A map without a file holds no memory, but counts.
        t.map(&map(0x40000, 0x100000), None).unwrap();
        assert_eq!(
            t.map(&map(0x30000, 0x1000), Some(memfd(0x1000))),
            Err(Errno::ENOSPC),
            "count"
        );
        assert_eq!(
            t.usage(),
            Usage {
                maps: 3,
                bytes: 0x2000,
                fds: 2
            }
        );
        // A map taken back still counts while a user holds its memory.
        let user = t.mem().clone();
        let u = DmaUnmap {
            argsz: 24,
            flags: 0,
            addr: 0x10000,
            size: 0x1000,
        };
        t.unmap(&u).unwrap();
        assert_eq!(
            t.usage(),
            Usage {
                maps: 3,
                bytes: 0x2000,
                fds: 2
            }
        );
        assert_eq!(
            t.map(&map(0x30000, 0x1000), Some(memfd(0x1000))),
            Err(Errno::ENOSPC)
        );
        assert_eq!(
            user.read_obj::<u8>(GuestAddress(0x10000)).unwrap(),
            0,
            "still mapped"
        );
        drop(user);
        t.reap();
        assert_eq!(
            t.usage(),
            Usage {
                maps: 2,
                bytes: 0x1000,
                fds: 1
            }
        );
        t.map(&map(0x30000, 0x1000), Some(memfd(0x1000))).unwrap();
        t.clear();
        assert_eq!(t.usage(), Usage::default());
    }

    #[test]
    fn maps_are_reached_at_their_address_and_never_overlap() {
        let mut t = table();
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
        let mut t = table();
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
        let mut t = table();
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
        let mut t = table();
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
