//! Guest memory as QEMU's `memory-backend-memfd` makes it: a memfd sealed
//! against shrinking, mapped here (the test's view, as the guest sees it)
//! and handed to the device in SET_MEM_TABLE; pages handed out by a bump
//! allocator, never reused, so a page the device was told about keeps that
//! use for the test's life.

use std::{
    fs::File,
    os::fd::OwnedFd,
    sync::{
        Mutex,
        atomic::{AtomicU32, AtomicU64, Ordering},
    },
};

use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    VolatileMemory,
};
use zerocopy::{FromBytes, IntoBytes};

/// The page size of rings, doorbell areas and page lists.
pub const PAGE: u64 = 4096;

/// A memfd of `len` bytes sealed as QEMU's `memory-backend-memfd` seals
/// guest RAM (it can neither shrink nor grow).
pub fn sealed_memfd(name: &std::ffi::CStr, len: u64) -> OwnedFd {
    use nix::fcntl::{FcntlArg, SealFlag, fcntl};
    let fd = nix::sys::memfd::memfd_create(name, nix::sys::memfd::MFdFlags::MFD_ALLOW_SEALING)
        .expect("memfd_create");
    nix::unistd::ftruncate(&fd, i64::try_from(len).expect("a memfd's size")).expect("ftruncate");
    let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
    fcntl(&fd, FcntlArg::F_ADD_SEALS(seals)).expect("F_ADD_SEALS");
    fd
}

/// A guest's memory: one region at GPA `base`, backed by a sealed memfd.
#[derive(Debug)]
pub struct Ram {
    pub file: File,
    pub mem: GuestMemoryMmap<()>,
    pub base: u64,
    pub size: u64,
    next: AtomicU64,
    /// Ring headers are handed out 64 to a page of their own: (next, end).
    headers: Mutex<(u64, u64)>,
}

impl Ram {
    /// `size` bytes at GPA `base` (page 0 of it is never handed out: an
    /// address 0 stays "nothing").
    pub fn new(base: u64, size: u64) -> Self {
        let fd: OwnedFd = sealed_memfd(c"vrdma-virtio-guest", size);
        Self::from_file(File::from(fd), base, size)
    }

    /// The same memory file mapped again (a VMM that reconnects brings the
    /// guest's memory back).
    pub fn from_file(file: File, base: u64, size: u64) -> Self {
        let mem = GuestMemoryMmap::<()>::from_ranges_with_files([(
            GuestAddress(base),
            usize::try_from(size).expect("a mappable size"),
            Some(FileOffset::new(file.try_clone().expect("dup"), 0)),
        )])
        .expect("mapping the guest's memory");
        Ram {
            file,
            mem,
            base,
            size,
            next: AtomicU64::new(base + PAGE),
            headers: Mutex::new((0, 0)),
        }
    }

    /// The one region (for SET_MEM_TABLE).
    pub fn region(&self) -> &vm_memory::GuestRegionMmap<()> {
        self.mem.iter().next().expect("one region")
    }

    /// The first address past the memory.
    pub fn end(&self) -> u64 {
        self.base + self.region().len()
    }

    /// `bytes` of fresh memory (zero: never handed out before), aligned to
    /// `align` (a power of two).
    pub fn alloc(&self, bytes: u64, align: u64) -> u64 {
        let mut at = 0;
        self.next
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                at = n.next_multiple_of(align);
                Some(at + bytes)
            })
            .expect("fetch_update with Some");
        assert!(
            at + bytes <= self.end(),
            "guest memory exhausted: {bytes} bytes at {at:#x}, memory ends at {:#x}",
            self.end()
        );
        at
    }

    /// `n` fresh pages, contiguous.
    pub fn pages(&self, n: u64) -> u64 {
        self.alloc(n * PAGE, PAGE)
    }

    /// A fresh 64-byte ring header, on a page that holds only headers.
    pub fn header(&self) -> u64 {
        let mut h = self
            .headers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if h.0 == h.1 {
            let p = self.pages(1);
            *h = (p, p + PAGE);
        }
        let at = h.0;
        h.0 += 64;
        at
    }

    /// The page addresses of `n` fresh pages, each allocated on its own
    /// (they need not be contiguous; here they are).
    pub fn page_list(&self, n: u64) -> Vec<u64> {
        let at = self.pages(n);
        (0..n).map(|i| at + i * PAGE).collect()
    }

    /// Memory left to hand out.
    pub fn left(&self) -> u64 {
        self.end() - self.next.load(Ordering::Relaxed)
    }

    pub fn write<T: IntoBytes + zerocopy::Immutable + ?Sized>(&self, addr: u64, v: &T) {
        self.mem
            .write_slice(v.as_bytes(), GuestAddress(addr))
            .unwrap_or_else(|e| panic!("writing guest memory at {addr:#x}: {e}"));
    }

    pub fn read<T: FromBytes + IntoBytes>(&self, addr: u64) -> T {
        let mut v = T::new_zeroed();
        self.mem
            .read_slice(v.as_mut_bytes(), GuestAddress(addr))
            .unwrap_or_else(|e| panic!("reading guest memory at {addr:#x}: {e}"));
        v
    }

    pub fn read_bytes(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.mem
            .read_slice(&mut v, GuestAddress(addr))
            .unwrap_or_else(|e| panic!("reading guest memory at {addr:#x}: {e}"));
        v
    }

    pub fn fill(&self, addr: u64, len: usize, byte: u8) {
        self.write(addr, &vec![byte; len][..]);
    }

    fn word64<R>(&self, addr: u64, f: impl FnOnce(&AtomicU64) -> R) -> R {
        let s = self
            .mem
            .get_slice(GuestAddress(addr), 8)
            .unwrap_or_else(|e| panic!("guest word at {addr:#x}: {e}"));
        f(s.get_atomic_ref::<AtomicU64>(0)
            .unwrap_or_else(|e| panic!("guest word at {addr:#x}: {e}")))
    }

    fn word32<R>(&self, addr: u64, f: impl FnOnce(&AtomicU32) -> R) -> R {
        let s = self
            .mem
            .get_slice(GuestAddress(addr), 4)
            .unwrap_or_else(|e| panic!("guest word at {addr:#x}: {e}"));
        f(s.get_atomic_ref::<AtomicU32>(0)
            .unwrap_or_else(|e| panic!("guest word at {addr:#x}: {e}")))
    }

    /// A 32-bit index word, loaded with acquire ordering.
    pub fn load_acquire(&self, addr: u64) -> u32 {
        self.word32(addr, |w| u32::from_le(w.load(Ordering::Acquire)))
    }

    /// A 32-bit index word, stored with release ordering.
    pub fn store_release(&self, addr: u64, v: u32) {
        self.word32(addr, |w| w.store(v.to_le(), Ordering::Release));
    }

    pub fn load_u64(&self, addr: u64) -> u64 {
        self.word64(addr, |w| u64::from_le(w.load(Ordering::Acquire)))
    }

    pub fn store_u64(&self, addr: u64, v: u64) {
        self.word64(addr, |w| w.store(v.to_le(), Ordering::Release));
    }

    /// An atomic OR on a 64-bit word (a doorbell bit).
    pub fn or_u64(&self, addr: u64, bits: u64) {
        self.word64(addr, |w| w.fetch_or(bits.to_le(), Ordering::SeqCst));
    }

    /// A 16-bit little-endian word (virtqueue indices), with the ordering
    /// given.
    pub fn store_u16(&self, addr: u64, v: u16, order: Ordering) {
        self.mem
            .store(v.to_le(), GuestAddress(addr), order)
            .unwrap_or_else(|e| panic!("guest word at {addr:#x}: {e}"));
    }

    pub fn load_u16(&self, addr: u64, order: Ordering) -> u16 {
        u16::from_le(
            self.mem
                .load(GuestAddress(addr), order)
                .unwrap_or_else(|e| panic!("guest word at {addr:#x}: {e}")),
        )
    }
}
