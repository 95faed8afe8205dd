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
//!
//! [`MemoryTable`] holds guest memory another library mapped — a
//! vhost-user memory table, which rust-vmm's backend maps itself — to the
//! same rules, per region, before anything touches it.

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
use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    GuestRegionMmap, MmapRegion,
};

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

impl DmaConfig {
    /// This budget for a guest of `guest` bytes of RAM when its size is
    /// configured (with memory hot-plug, the most it may have: QEMU's
    /// `maxmem`): a VMM shares its guest's RAM and nothing else with a
    /// descriptor (ROMs and option ROMs are anonymous, and a map without a
    /// descriptor holds no memory), so [`DmaConfig::max_bytes`] is at most
    /// the guest's size. Unconfigured, the budget stays as it is.
    pub fn for_guest(mut self, guest: Option<u64>) -> Self {
        if let Some(g) = guest {
            self.max_bytes = self.max_bytes.min(g);
        }
        self
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
/// can go (fields drop in order). Every guest region over the mapping
/// holds it too (`GuestRegionMmap` keeps its `MmapRegion` in an `Arc`), so
/// the mapping goes only once the last of them and this are dropped.
#[derive(Debug)]
struct Held {
    guard: Option<sigbus::Guard>,
    mapping: Arc<MmapRegion<()>>,
}

impl Held {
    fn size(&self) -> u64 {
        self.mapping.size() as u64
    }

    fn faults(&self) -> u64 {
        self.guard.as_ref().map_or(0, sigbus::Guard::faults)
    }

    /// Whether nothing but this holds the mapping (dropping it unmaps).
    fn is_last(&self) -> bool {
        Arc::strong_count(&self.mapping) == 1
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
            #[allow(unsafe_code)]
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
        let held = Held {
            guard,
            mapping: Arc::new(region),
        };
        let region = GuestRegionMmap::with_arc(held.mapping.clone(), GuestAddress(m.addr))
            .ok_or(Errno::EINVAL)?;
        self.mem = self
            .mem
            .insert_region(Arc::new(region))
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

/// Why a memory table was refused ([`MemoryTable::adopt`]).
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error("{regions} regions, more than the {max} allowed")]
    TooManyRegions { regions: usize, max: usize },
    #[error("{bytes} bytes of regions, more than the {max} allowed")]
    TooManyBytes { bytes: u64, max: u64 },
    #[error("the region at {gpa:#x} has no file")]
    NoFile { gpa: u64 },
    #[error("the region at {gpa:#x} is not a mapping of its own")]
    NotOwned { gpa: u64 },
    #[error("the region at {gpa:#x}: its file cannot be read ({errno})")]
    BadFile { gpa: u64, errno: Errno },
    #[error("the region at {gpa:#x}: not a regular file")]
    NotRegular { gpa: u64 },
    #[error(
        "the region at {gpa:#x}: its file is not sealed against shrinking \
         (memory-backend-memfd seals it)"
    )]
    Unsealed { gpa: u64 },
    #[error("the region at {gpa:#x}: {end:#x} bytes from its file of {file_len:#x}")]
    ShortFile { gpa: u64, end: u64, file_len: u64 },
    #[error("the region at {gpa:#x}: no SIGBUS guard")]
    Guard {
        gpa: u64,
        #[source]
        source: sigbus::Error,
    },
}

impl TableError {
    /// The errno a DMA map refused for the same reason gets.
    pub fn errno(&self) -> Errno {
        match self {
            TableError::TooManyRegions { .. } => Errno::ENOSPC,
            TableError::TooManyBytes { .. }
            | TableError::Guard {
                source: sigbus::Error::Full,
                ..
            } => Errno::ENOMEM,
            TableError::Unsealed { .. } => Errno::EPERM,
            _ => Errno::EINVAL,
        }
    }
}

/// Guest memory that another library mapped — rust-vmm's vhost-user
/// backend maps each region of a memory table itself, before its backend
/// hears of it — held to a DMA map's rules ([`DmaConfig`]): each region a
/// mapping of a regular file as long as the region, sealed against
/// shrinking unless unsealed memory is allowed; hugetlbfs and unsealed
/// regions registered with the [`sigbus`] guard (their lost pages read
/// zeros, counted: [`MemoryTable::faults`]); at most
/// [`DmaConfig::max_maps`] regions and [`DmaConfig::max_bytes`] bytes.
///
/// Each mapping adopted is held here with its guard until nothing else
/// holds it, as a [`DmaTable`]'s: a table replaced is retired, and its
/// mappings go (guard first) once no user of the memory — a device, a
/// payload lent on to another device — holds them.
#[derive(Debug)]
pub struct MemoryTable {
    /// The table adopted last, each of its regions' mappings.
    mem: GuestMemoryMmap<()>,
    held: Vec<Held>,
    /// Mappings of tables replaced that a user may still hold.
    retired: Vec<Held>,
    config: DmaConfig,
    /// Faults repaired in mappings since gone.
    past_faults: u64,
}

impl MemoryTable {
    pub fn new(config: DmaConfig) -> Self {
        MemoryTable {
            mem: GuestMemoryMmap::default(),
            held: Vec::new(),
            retired: Vec::new(),
            config,
            past_faults: 0,
        }
    }

    pub fn config(&self) -> &DmaConfig {
        &self.config
    }

    /// The table adopted last (empty before the first).
    pub fn mem(&self) -> &GuestMemoryMmap<()> {
        &self.mem
    }

    /// `mem` becomes the table: its new regions checked (and guarded when
    /// they must be), every region counted against the budget with the
    /// mappings of earlier tables still held; the regions it no longer has
    /// retired. On an error nothing changes: the table stays the last one
    /// adopted, and nothing of `mem` is held. Nothing here touches the
    /// memory: a table is adopted before its first access.
    pub fn adopt(&mut self, mem: &GuestMemoryMmap<()>) -> Result<(), TableError> {
        self.reap();
        let regions = mem.num_regions() + self.retired.len();
        if regions > self.config.max_maps {
            return Err(TableError::TooManyRegions {
                regions,
                max: self.config.max_maps,
            });
        }
        let bytes = mem
            .iter()
            .map(GuestMemoryRegion::len)
            .chain(self.retired.iter().map(Held::size))
            .fold(0u64, u64::saturating_add);
        if bytes > self.config.max_bytes {
            return Err(TableError::TooManyBytes {
                bytes,
                max: self.config.max_bytes,
            });
        }
        // Each region: a mapping already held, or a new one checked.
        let mut next: Vec<Result<usize, Held>> = Vec::with_capacity(mem.num_regions());
        for r in mem.iter() {
            let mapping = r.get_mmap();
            match self
                .held
                .iter()
                .position(|h| Arc::ptr_eq(&h.mapping, &mapping))
            {
                Some(i) => next.push(Ok(i)),
                None => next.push(Err(self.check(r.start_addr().0, mapping)?)),
            }
        }
        let mut old: Vec<Option<Held>> = self.held.drain(..).map(Some).collect();
        for n in next {
            let held = match n {
                Ok(i) => old.get_mut(i).and_then(Option::take),
                Err(h) => Some(h),
            };
            // A mapping named twice in `mem` is held once.
            self.held.extend(held);
        }
        self.retired.extend(old.into_iter().flatten());
        self.mem = mem.clone();
        Ok(())
    }

    /// A new region's mapping, checked as a DMA map's file is, with its
    /// guard when it needs one.
    fn check(&self, gpa: u64, mapping: Arc<MmapRegion<()>>) -> Result<Held, TableError> {
        // Only a mapping of its own can be guarded: it stays mapped as
        // long as it is held (an `MmapRegion` unmaps when dropped).
        if !mapping.owned() {
            return Err(TableError::NotOwned { gpa });
        }
        let fo = mapping.file_offset().ok_or(TableError::NoFile { gpa })?;
        let kind = FileKind::of(fo.file()).map_err(|errno| match errno {
            Errno::EINVAL => TableError::NotRegular { gpa },
            errno => TableError::BadFile { gpa, errno },
        })?;
        if !kind.sealed && !self.config.allow_unsealed {
            return Err(TableError::Unsealed { gpa });
        }
        let len = mapping.size() as u64;
        let end = fo.start().saturating_add(len);
        if end > kind.len {
            return Err(TableError::ShortFile {
                gpa,
                end,
                file_len: kind.len,
            });
        }
        let guard = if kind.guarded() {
            Some(guard(&mapping, kind.page).map_err(|source| TableError::Guard { gpa, source })?)
        } else {
            None
        };
        Ok(Held { guard, mapping })
    }

    /// What the table holds now: the mappings of the table and of those
    /// replaced that are still held, and their descriptors.
    pub fn usage(&self) -> Usage {
        let held = || self.held.iter().chain(&self.retired);
        Usage {
            maps: held().count(),
            bytes: held().map(Held::size).sum(),
            fds: held().count(),
        }
    }

    /// Faults repaired in guarded regions (pages their files lost, or huge
    /// pages the pool could not supply).
    pub fn faults(&self) -> u64 {
        let held = self.held.iter().chain(&self.retired);
        self.past_faults + held.map(Held::faults).sum::<u64>()
    }

    /// Lets go of the mappings of replaced tables that nothing else holds
    /// any more (their guards first).
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

impl Drop for MemoryTable {
    fn drop(&mut self) {
        self.mem = GuestMemoryMmap::default();
        let held = self.held.drain(..);
        self.retired.extend(held);
        self.reap();
        if !self.retired.is_empty() {
            // Still held by a user that outlives the table: the guards
            // stay until the mappings go.
            let mut orphans = ORPHANS.lock().unwrap_or_else(|p| p.into_inner());
            orphans.append(&mut self.retired);
        }
    }
}

/// Registers the whole of `mapping` with the SIGBUS guard, in pages of
/// `page` bytes (the kernel maps whole pages: a hugetlbfs file's in huge
/// ones, the last page rounded up).
fn guard(mapping: &Arc<MmapRegion<()>>, page: usize) -> Result<sigbus::Guard, sigbus::Error> {
    let bad = sigbus::Error::BadRange {
        start: mapping.as_ptr() as usize,
        len: mapping.size(),
        page,
    };
    let len = mapping.size().checked_next_multiple_of(page).ok_or(bad)?;
    // SAFETY: the range is `mapping`'s, which vm-memory mapped and owns
    // (checked: `owned`) and unmaps only when its last holder drops it; the
    // guard goes into the `Held` that holds `mapping`, whose field order
    // (and `reap`, which drops a `Held` only as the mapping's last holder)
    // withdraws the guard before the mapping can go. A page whose access
    // faulted had no contents left (past a shrunk file's end, or a huge
    // page the pool could not supply), so a zero page in its place loses
    // nothing.
    #[allow(unsafe_code)]
    unsafe {
        sigbus::register(mapping.as_ptr() as usize, len, page)
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

    // --- memory tables mapped elsewhere ---------------------------------

    /// One region at `gpa` over `fd` (its first `len` bytes), mapped as
    /// rust-vmm's vhost-user handler maps a memory table's region.
    fn table_of(regions: &[(u64, u64, &OwnedFd)]) -> GuestMemoryMmap<()> {
        GuestMemoryMmap::<()>::from_ranges_with_files(regions.iter().map(|&(gpa, len, fd)| {
            let f = File::from(fd.try_clone().unwrap());
            (GuestAddress(gpa), len as usize, Some(FileOffset::new(f, 0)))
        }))
        .unwrap()
    }

    /// A hugetlbfs memfd of `len` bytes sealed as QEMU seals guest RAM,
    /// if this kernel makes one (`MFD_HUGETLB`).
    pub(crate) fn hugetlb(len: u64) -> Option<OwnedFd> {
        let flags = MFdFlags::MFD_ALLOW_SEALING | MFdFlags::MFD_HUGETLB;
        let fd = memfd_create(c"vrdma-dma-hugetlb", flags).ok()?;
        nix::unistd::ftruncate(&fd, i64::try_from(len).unwrap()).ok()?;
        fcntl(&fd, FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK)).unwrap();
        Some(fd)
    }

    /// Whether the huge page pool is empty, so that a hugetlbfs page
    /// touched faults (nothing reserved it: vm-memory maps NORESERVE).
    pub(crate) fn no_huge_pages() -> bool {
        std::fs::read_to_string("/proc/meminfo")
            .unwrap()
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["HugePages_Free:", "0"])
    }

    /// A guest of 16 KiB: its VMM maps 16 KiB, no more, however much the
    /// process-wide budget allows; unconfigured, that budget stands.
    #[test]
    fn a_configured_guest_size_caps_the_bytes_a_vmm_maps() {
        assert_eq!(
            DmaConfig::default().for_guest(None).max_bytes,
            DEFAULT_MAX_BYTES
        );
        let c = DmaConfig::default().for_guest(Some(0x4000));
        assert_eq!((c.max_bytes, c.max_maps), (0x4000, DEFAULT_MAX_MAPS));
        let small = DmaConfig {
            max_bytes: 0x2000,
            ..DmaConfig::default()
        };
        assert_eq!(
            small.for_guest(Some(0x4000)).max_bytes,
            0x2000,
            "the smaller"
        );
        let mut t = DmaTable::new(c);
        t.map(&map(0x10000, 0x4000), Some(memfd(0x4000))).unwrap();
        assert_eq!(
            t.map(&map(0x20000, 0x1000), Some(memfd(0x1000))),
            Err(Errno::ENOMEM)
        );
    }

    #[test]
    fn a_memory_table_takes_sealed_files_as_long_as_their_regions() {
        let mut t = MemoryTable::new(DmaConfig::default());
        let good = memfd(0x4000);
        let m = table_of(&[(0x10000, 0x4000, &good)]);
        t.adopt(&m).unwrap();
        assert_eq!(t.mem().num_regions(), 1);
        let before = t.usage();
        assert_eq!(
            before,
            Usage {
                maps: 1,
                bytes: 0x4000,
                fds: 1
            }
        );
        let refused = |t: &mut MemoryTable, m: &GuestMemoryMmap<()>| {
            let e = t.adopt(m).unwrap_err();
            // Nothing changed: the last table stays, nothing new is held.
            assert_eq!(t.usage(), before, "{e}");
            assert_eq!(t.mem().num_regions(), 1);
            e
        };
        let open = unsealed(0x4000);
        let e = refused(&mut t, &table_of(&[(0x10000, 0x4000, &open)]));
        assert!(matches!(e, TableError::Unsealed { gpa: 0x10000 }), "{e}");
        assert_eq!(e.errno(), Errno::EPERM);
        // A sealed file shorter than its region (mapped past its end).
        let short = memfd(0x1000);
        let e = refused(&mut t, &table_of(&[(0x10000, 0x4000, &short)]));
        assert!(
            matches!(
                e,
                TableError::ShortFile {
                    end: 0x4000,
                    file_len: 0x1000,
                    ..
                }
            ),
            "{e}"
        );
        // Anonymous memory has no file a guest could share.
        let anon = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x1000)]).unwrap();
        let e = refused(&mut t, &anon);
        assert!(matches!(e, TableError::NoFile { gpa: 0 }), "{e}");
        // A regular file on a filesystem that cannot seal has no seals.
        let path = std::env::temp_dir().join(format!("vrdma-dma-table-{}", std::process::id()));
        let plain = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        plain.set_len(0x1000).unwrap();
        let plain: OwnedFd = plain.into();
        let e = refused(&mut t, &table_of(&[(0, 0x1000, &plain)]));
        assert!(matches!(e, TableError::Unsealed { .. }), "{e}");
        // The table adopted last still reads and writes.
        t.mem().write_obj(7u64, GuestAddress(0x13ff8)).unwrap();
        assert_eq!(m.read_obj::<u64>(GuestAddress(0x13ff8)).unwrap(), 7);
    }

    #[test]
    fn a_memory_table_is_budgeted_by_regions_and_bytes() {
        let mut t = MemoryTable::new(DmaConfig {
            allow_unsealed: false,
            max_maps: 2,
            max_bytes: 0x3000,
        });
        let (a, b, c) = (memfd(0x1000), memfd(0x1000), memfd(0x3000));
        let ab = table_of(&[(0, 0x1000, &a), (0x1000, 0x1000, &b)]);
        t.adopt(&ab).unwrap();
        // A region more (ADD_MEM_REG: the same mappings and a new one).
        let f = File::from(c.try_clone().unwrap());
        let r = MmapRegion::<()>::from_file(FileOffset::new(f, 0), 0x1000).unwrap();
        let r = Arc::new(GuestRegionMmap::new(r, GuestAddress(0x10000)).unwrap());
        let abc = ab.insert_region(r).unwrap();
        let e = t.adopt(&abc).unwrap_err();
        assert!(
            matches!(e, TableError::TooManyRegions { regions: 3, max: 2 }),
            "{e}"
        );
        assert_eq!(e.errno(), Errno::ENOSPC);
        drop(abc);
        // A region taken back (REM_MEM_REG) that a user still holds
        // counts until it goes.
        let (rest, _) = ab.remove_region(GuestAddress(0x1000), 0x1000).unwrap();
        let holder = ab.clone();
        t.adopt(&rest).unwrap();
        let held = Usage {
            maps: 2,
            bytes: 0x2000,
            fds: 2,
        };
        assert_eq!(t.usage(), held, "the removed one, still held");
        // A table of 0x3000 bytes, with the 0x1000 still held: more than
        // the limit.
        let big = table_of(&[(0x10000, 0x3000, &c)]);
        let e = t.adopt(&big).unwrap_err();
        assert!(
            matches!(
                e,
                TableError::TooManyBytes {
                    bytes: 0x4000,
                    max: 0x3000
                }
            ),
            "{e}"
        );
        assert_eq!(e.errno(), Errno::ENOMEM);
        assert_eq!(t.usage(), held);
        // Let go of, the removed region goes, and the table fits.
        drop((holder, ab));
        t.adopt(&big).unwrap();
        assert_eq!(
            t.usage(),
            Usage {
                maps: 2,
                bytes: 0x4000,
                fds: 2
            },
            "the table and the one it replaced, held by `rest`"
        );
        drop(rest);
        t.reap();
        assert_eq!(
            t.usage(),
            Usage {
                maps: 1,
                bytes: 0x3000,
                fds: 1
            }
        );
        // A sparse terabyte, refused before anything reads it.
        let huge = memfd(1 << 40);
        let e = t
            .adopt(&table_of(&[(1 << 40, 1 << 40, &huge)]))
            .unwrap_err();
        assert!(matches!(e, TableError::TooManyBytes { .. }), "{e}");
    }

    #[test]
    fn hugetlbfs_and_allowed_unsealed_regions_are_guarded_even_from_other_threads() {
        const NAME: &str = "dma::tests::hugetlbfs_and_allowed_unsealed_regions_are_guarded_even_from_other_threads";
        if !crate::child::is(NAME) {
            let s = crate::child::run(NAME);
            assert!(s.success(), "the child: {s:?}");
            return;
        }
        let mut t = MemoryTable::new(DmaConfig {
            allow_unsealed: true,
            ..DmaConfig::default()
        });
        let open = unsealed(0x3000);
        let mut regions = vec![(0x10000, 0x3000, &open)];
        let huge = hugetlb(2 << 20);
        if let Some(h) = &huge {
            regions.push((0x200000, 2 << 20, h));
        } else {
            eprintln!("no MFD_HUGETLB here: the hugetlbfs half is not run");
        }
        let m = table_of(&regions);
        let guards = sigbus::registered();
        t.adopt(&m).unwrap();
        assert_eq!(
            sigbus::registered(),
            guards + regions.len(),
            "each one guarded"
        );
        m.write_obj(0x1111u64, GuestAddress(0x10000)).unwrap();
        // The VMM shrinks the unsealed file; a thread that is not the one
        // that adopted the table (a receiving device reading a payload
        // lent on) reads what it lost.
        nix::unistd::ftruncate(&open, 0x1000).unwrap();
        let reader = m.clone();
        let read = std::thread::spawn(move || {
            let lost = reader.read_obj::<u64>(GuestAddress(0x12000)).unwrap();
            let huge = (reader.num_regions() > 1).then(|| {
                reader
                    .read_obj::<u64>(GuestAddress(0x200000 + 4096))
                    .unwrap()
            });
            (lost, huge)
        });
        let (lost, huge_read) = read.join().unwrap();
        assert_eq!(lost, 0);
        assert_eq!(
            m.read_obj::<u64>(GuestAddress(0x10000)).unwrap(),
            0x1111,
            "still in the file"
        );
        let mut want = 1;
        if let Some(v) = huge_read {
            assert_eq!(v, 0);
            if no_huge_pages() {
                want += 1;
            }
        }
        assert_eq!(t.faults(), want, "each lost page counted");
        // Replaced and let go of, the guards go with the mappings.
        drop((m, regions));
        t.adopt(&GuestMemoryMmap::default()).unwrap();
        t.reap();
        assert_eq!(sigbus::registered(), guards);
        assert_eq!(t.usage(), Usage::default());
        assert_eq!(t.faults(), want, "faults of mappings gone");
    }

    /// The stand-in is real: an empty huge page pool makes a hugetlbfs
    /// page fault when touched, and the fault kills the process unless
    /// its mapping is guarded.
    #[test]
    fn an_unguarded_hugetlbfs_region_kills_when_the_pool_is_empty() {
        const NAME: &str = "dma::tests::an_unguarded_hugetlbfs_region_kills_when_the_pool_is_empty";
        if !no_huge_pages() || hugetlb(2 << 20).is_none() {
            eprintln!("huge pages in the pool, or no MFD_HUGETLB: nothing faults here");
            return;
        }
        if !crate::child::is(NAME) {
            let s = crate::child::run(NAME);
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(s.signal(), Some(libc::SIGBUS), "the child: {s:?}");
            return;
        }
        let h = hugetlb(2 << 20).unwrap();
        let m = table_of(&[(0, 2 << 20, &h)]);
        let _ = m.read_obj::<u64>(GuestAddress(0));
        unreachable!("the read faults");
    }
}
