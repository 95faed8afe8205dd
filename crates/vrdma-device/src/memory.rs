//! The device's memory: address ranges mapped into this process with
//! rust-vmm's `vm-memory` — a guest's RAM that the VMM shares (file-backed
//! regions), or anonymous memory for a device in a process of its own —
//! and reached only through volatile slices: never a Rust reference to
//! bytes a guest may be writing at the same moment.
//!
//! It serves the engine ([`Memory`]: copies in and out, atomics) and the
//! fabric ([`Lender`]: payload pieces a gather send reads in place).
//! Atomics are the CPU's own on the mapped word (`lock cmpxchg` /
//! `lock xadd` on x86), so they stay atomic against another process that
//! maps the same memory.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use vm_memory::{
    Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, VolatileMemory,
    VolatileSlice,
};
use vrdma_engine::{
    fence::Fence,
    memory::{Memory, MemoryError},
};
use vrdma_fabric::Lender;

/// Device memory over a `vm-memory` map.
#[derive(Clone, Debug, Default)]
pub struct GuestMem {
    shared: Lease,
}

/// A handle on a device's memory map that outlives the device's use of
/// it, and the fence revoked before that use ends ([`GuestMem::revoke`]):
/// what a payload lent on to another device of the process carries, so
/// that its receiver reads the sender's memory only while the sender
/// still may (`vrdma_engine::fence`).
#[derive(Clone, Debug, Default)]
pub struct Lease(Arc<Shared>);

#[derive(Debug, Default)]
struct Shared {
    map: GuestMemoryMmap<()>,
    fence: Fence,
}

impl Lease {
    pub fn map(&self) -> &GuestMemoryMmap<()> {
        &self.0.map
    }

    pub fn fence(&self) -> &Fence {
        &self.0.fence
    }
}

impl GuestMem {
    /// `len` bytes of anonymous memory at device addresses `base..base +
    /// len` (a device of the process's own).
    pub fn anonymous(base: u64, len: usize) -> std::io::Result<Self> {
        let map = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(base), len)])
            .map_err(std::io::Error::other)?;
        Ok(GuestMem::from_map(map))
    }

    /// Memory over an existing map (a guest's regions).
    pub fn from_map(map: GuestMemoryMmap<()>) -> Self {
        GuestMem {
            shared: Lease(Arc::new(Shared {
                map,
                fence: Fence::new(),
            })),
        }
    }

    /// The map, to add or remove regions (a new map replaces the old one
    /// with [`GuestMem::from_map`]).
    pub fn map(&self) -> &GuestMemoryMmap<()> {
        &self.shared.0.map
    }

    /// A handle on the map for a payload lent on ([`Lease`]).
    pub fn lease(&self) -> &Lease {
        &self.shared
    }

    /// Ends every lease on this map: no payload lent from it is read from
    /// now on, and this returns once the copies under way ended. The owner
    /// calls it before the memory stops being the device's (replaced by
    /// another map, unmapped, the device gone).
    pub fn revoke(&self) {
        self.shared.0.fence.revoke();
    }

    /// Bytes mapped, over all regions.
    pub fn size(&self) -> u64 {
        self.map().iter().map(|r| r.len()).sum()
    }

    /// Runs `f` on the 8 bytes at `addr` as an atomic word: they must lie
    /// in one region, 8-byte aligned.
    fn with_word<R>(&self, addr: u64, f: impl FnOnce(&AtomicU64) -> R) -> Result<R, MemoryError> {
        let err = MemoryError { addr, len: 8 };
        let slice = self
            .map()
            .get_slice(GuestAddress(addr), 8)
            .map_err(|_| err)?;
        let word = slice.get_atomic_ref::<AtomicU64>(0).map_err(|_| err)?;
        Ok(f(word))
    }

    /// Takes the little-endian word at `addr` and leaves `v` in its place,
    /// in one atomic step (sequentially consistent): a doorbell word the
    /// guest sets bits in concurrently loses none.
    pub fn swap_u64(&self, addr: u64, v: u64) -> Result<u64, MemoryError> {
        self.with_word(addr, |w| u64::from_le(w.swap(v.to_le(), Ordering::SeqCst)))
    }

    /// Reads the little-endian word at `addr` atomically (sequentially
    /// consistent): after a store the guest made before it, or not at all.
    pub fn load_u64(&self, addr: u64) -> Result<u64, MemoryError> {
        self.with_word(addr, |w| u64::from_le(w.load(Ordering::SeqCst)))
    }

    /// Writes the little-endian 32-bit word at `addr` atomically
    /// (sequentially consistent: ordered against every load after it, as a
    /// full barrier between a device's flag and its next scan needs).
    pub fn store_u32(&self, addr: u64, v: u32) -> Result<(), MemoryError> {
        let err = MemoryError { addr, len: 4 };
        let slice = self
            .map()
            .get_slice(GuestAddress(addr), 4)
            .map_err(|_| err)?;
        let word = slice
            .get_atomic_ref::<std::sync::atomic::AtomicU32>(0)
            .map_err(|_| err)?;
        word.store(v.to_le(), Ordering::SeqCst);
        Ok(())
    }

    /// Reads the little-endian 32-bit word at `addr` atomically.
    pub fn load_u32(&self, addr: u64) -> Result<u32, MemoryError> {
        let err = MemoryError { addr, len: 4 };
        let slice = self
            .map()
            .get_slice(GuestAddress(addr), 4)
            .map_err(|_| err)?;
        let word = slice
            .get_atomic_ref::<std::sync::atomic::AtomicU32>(0)
            .map_err(|_| err)?;
        Ok(u32::from_le(word.load(Ordering::SeqCst)))
    }
}

impl Memory for GuestMem {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        // A range in one region (nearly every one) is one slice and one
        // copy; vm-memory's walk over regions serves the rest.
        if let Some(s) = self.lend(addr, buf.len())
            && s.read_slice(buf, 0).is_ok()
        {
            return Ok(());
        }
        self.map()
            .read_slice(buf, GuestAddress(addr))
            .map_err(|_| MemoryError {
                addr,
                len: buf.len() as u64,
            })
    }

    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemoryError> {
        if let Some(s) = self.lend(addr, data.len())
            && s.write_slice(data, 0).is_ok()
        {
            return Ok(());
        }
        self.map()
            .write_slice(data, GuestAddress(addr))
            .map_err(|_| MemoryError {
                addr,
                len: data.len() as u64,
            })
    }

    fn compare_swap(&mut self, addr: u64, compare: u64, swap: u64) -> Result<u64, MemoryError> {
        // The word is little-endian in memory, as the engine defines a
        // responder's atomics (and as x86 and Arm hosts store it).
        self.with_word(addr, |w| {
            let found = match w.compare_exchange(
                compare.to_le(),
                swap.to_le(),
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(v) | Err(v) => v,
            };
            u64::from_le(found)
        })
    }

    fn fetch_add(&mut self, addr: u64, add: u64) -> Result<u64, MemoryError> {
        self.with_word(addr, |w| {
            if cfg!(target_endian = "little") {
                return w.fetch_add(add, Ordering::SeqCst);
            }
            // A big-endian host adds to the little-endian word in a loop.
            let mut cur = w.load(Ordering::SeqCst);
            loop {
                let next = u64::from_le(cur).wrapping_add(add).to_le();
                match w.compare_exchange_weak(cur, next, Ordering::SeqCst, Ordering::SeqCst) {
                    Ok(_) => return u64::from_le(cur),
                    Err(v) => cur = v,
                }
            }
        })
    }

    fn lends(&self, addr: u64, len: usize) -> bool {
        self.lend(addr, len).is_some()
    }
}

/// Memory whose lent payloads a device may lend on to another device of
/// the process ([`crate::loan`]): the lease they carry, and its end.
pub trait Leased {
    /// The lease, if the memory has one (without, payloads are copied).
    fn lease(&self) -> Option<&Lease> {
        None
    }

    /// Ends the lease ([`GuestMem::revoke`]).
    fn revoke(&self) {}
}

impl Leased for GuestMem {
    fn lease(&self) -> Option<&Lease> {
        Some(&self.shared)
    }

    fn revoke(&self) {
        GuestMem::revoke(self);
    }
}

impl Lender for GuestMem {
    fn lend(&self, addr: u64, len: usize) -> Option<VolatileSlice<'_>> {
        self.map().lend(addr, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_and_atomics_stay_in_bounds_and_are_little_endian() {
        let mut m = GuestMem::anonymous(0x1000, 0x2000).unwrap();
        m.write(0x1ff8, &5u64.to_le_bytes()).unwrap();
        assert_eq!(m.fetch_add(0x1ff8, 3), Ok(5));
        assert_eq!(m.compare_swap(0x1ff8, 7, 1), Ok(8), "no swap on mismatch");
        assert_eq!(m.compare_swap(0x1ff8, 8, 1), Ok(8));
        let mut b = [0u8; 8];
        m.read(0x1ff8, &mut b).unwrap();
        assert_eq!(u64::from_le_bytes(b), 1);
        assert!(m.read(0x2ffc, &mut [0; 8]).is_err(), "past the end");
        assert!(m.write(0xfff, &[0]).is_err(), "before the start");
        assert!(m.fetch_add(0x1ffc, 1).is_err(), "unaligned");
        assert!(m.fetch_add(0x2ffc, 1).is_err(), "past the end");
        assert!(m.lends(0x2000, 0x1000));
        assert!(!m.lends(0x2001, 0x1000));
        assert_eq!(m.size(), 0x2000);
    }

    #[test]
    fn doorbell_words_are_swapped_loaded_and_stored_whole() {
        let mut m = GuestMem::anonymous(0x1000, 0x1000).unwrap();
        m.write(0x1010, &0x8000_0000_0000_0005u64.to_le_bytes())
            .unwrap();
        assert_eq!(m.swap_u64(0x1010, 0), Ok(0x8000_0000_0000_0005));
        assert_eq!(m.load_u64(0x1010), Ok(0));
        m.store_u32(0x1004, 0x0102_0304).unwrap();
        let mut b = [0u8; 4];
        m.read(0x1004, &mut b).unwrap();
        assert_eq!(b, [4, 3, 2, 1]);
        assert_eq!(m.load_u32(0x1004), Ok(0x0102_0304));
        assert!(m.swap_u64(0x1004, 0).is_err(), "unaligned");
        assert!(m.store_u32(0x1ffe, 0).is_err(), "unaligned");
        assert!(m.load_u64(0x2000,).is_err(), "past the end");
    }

    /// Two mappings of one file (as a guest's RAM is mapped by QEMU and by
    /// the daemon): atomics through either stay atomic against the other.
    /// A read-modify-write through copies would lose increments here.
    #[test]
    fn atomics_stay_atomic_across_two_mappings_of_one_memory() {
        use vm_memory::FileOffset;
        let path = std::env::temp_dir().join(format!("vrdma-atomics-{}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        file.set_len(4096).unwrap();
        let file = std::sync::Arc::new(file);
        let map = |base: u64| {
            GuestMem::from_map(
                GuestMemoryMmap::<()>::from_ranges_with_files([(
                    GuestAddress(base),
                    4096,
                    Some(FileOffset::from_arc(file.clone(), 0)),
                )])
                .unwrap(),
            )
        };
        let (one, two) = (map(0x1_0000), map(0x8_0000));
        const N: u64 = 200_000;
        let run = |mut m: GuestMem, addr: u64| {
            std::thread::spawn(move || {
                for _ in 0..N {
                    m.fetch_add(addr, 1).unwrap();
                }
            })
        };
        let (a, b) = (run(one.clone(), 0x1_0008), run(two, 0x8_0008));
        a.join().unwrap();
        b.join().unwrap();
        let mut word = [0u8; 8];
        one.read(0x1_0008, &mut word).unwrap();
        assert_eq!(u64::from_le_bytes(word), 2 * N);
    }
}
