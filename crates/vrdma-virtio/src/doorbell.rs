//! Doorbell areas (spec §8): a context's summary and bitmap words in guest
//! memory, which say which of its rings moved, and the `poll` word that
//! tells its driver whether the device is looking.
//!
//! The driver sets an object's bit in the bitmap, then the bitmap word's
//! bit in the summary (atomic ORs), then — after a full barrier — reads
//! `poll` and kicks the doorbell queue when it is 0. The device swaps each
//! non-zero summary word with 0, then each bitmap word it names: a bit set
//! at any moment is either in what a swap returned or still in the word
//! for the next round, so no doorbell is ever lost, and a round reads only
//! the summary words (one per 4096 objects), never every ring.

use vrdma_device::GuestMem;
use vrdma_engine::memory::MemoryError;

use crate::abi::{PAGE_SIZE, doorbell};

/// A context's doorbell area: its pages (copied from CREATE_CONTEXT) and
/// how many doorbells it has.
#[derive(Clone, Debug)]
pub struct Area {
    pages: Vec<u64>,
    bits: u32,
}

impl Area {
    /// An area of `bits` doorbells over `pages` (their count and alignment
    /// were checked when decoded; whether they are in guest memory is
    /// found by each access).
    pub fn new(bits: u32, pages: Vec<u64>) -> Self {
        debug_assert_eq!(pages.len() as u64, doorbell::area_pages(bits));
        Area { pages, bits }
    }

    pub fn bits(&self) -> u32 {
        self.bits
    }

    pub fn pages(&self) -> &[u64] {
        &self.pages
    }

    fn addr(&self, offset: u64) -> u64 {
        self.pages[(offset / PAGE_SIZE) as usize] + offset % PAGE_SIZE
    }

    /// Says whether the device is polling this area.
    pub fn set_poll(&self, mem: &GuestMem, on: bool) -> Result<(), MemoryError> {
        mem.store_u32(self.addr(doorbell::POLL), u32::from(on))
    }

    /// Takes every doorbell rung since the last call, appending the
    /// doorbell indices to `out` (ascending). Returns how many.
    pub fn take(&self, mem: &GuestMem, out: &mut Vec<u32>) -> Result<usize, MemoryError> {
        let before = out.len();
        let words = (self.bits / 64) as u64;
        let summaries = words.div_ceil(64);
        for k in 0..summaries {
            let s_addr = self.addr(doorbell::SUMMARY + 8 * k);
            if mem.load_u64(s_addr)? == 0 {
                continue;
            }
            let mut s = mem.swap_u64(s_addr, 0)?;
            while s != 0 {
                let j = u64::from(s.trailing_zeros());
                s &= s - 1;
                let w = 64 * k + j;
                if w >= words {
                    // A summary bit past the bitmap: nothing it could name.
                    continue;
                }
                let mut b = mem.swap_u64(self.addr(doorbell::BITMAP + 8 * w), 0)?;
                while b != 0 {
                    let i = b.trailing_zeros();
                    b &= b - 1;
                    out.push((w * 64) as u32 + i);
                }
            }
        }
        Ok(out.len() - before)
    }
}

/// Which doorbell indices of a context are in use: the lowest free one is
/// given to each new QP, SRQ or CQ.
#[derive(Clone, Debug)]
pub struct Indices {
    words: Vec<u64>,
    used: u32,
}

impl Indices {
    pub fn new(bits: u32) -> Self {
        Indices {
            words: vec![0; (bits / 64) as usize],
            used: 0,
        }
    }

    /// The lowest free index, now taken; None when all are.
    #[must_use]
    pub fn take(&mut self) -> Option<u32> {
        let (w, word) = self
            .words
            .iter_mut()
            .enumerate()
            .find(|(_, w)| **w != u64::MAX)?;
        let i = (!*word).trailing_zeros();
        *word |= 1 << i;
        self.used += 1;
        Some(w as u32 * 64 + i)
    }

    /// Gives `i` back.
    pub fn give(&mut self, i: u32) {
        if let Some(word) = self.words.get_mut((i / 64) as usize)
            && *word & (1 << (i % 64)) != 0
        {
            *word &= !(1 << (i % 64));
            self.used -= 1;
        }
    }

    pub fn used(&self) -> u32 {
        self.used
    }
}

#[cfg(test)]
mod tests {
    use vrdma_engine::memory::Memory;

    use super::*;

    /// What a driver does to ring doorbell `i`.
    fn ring(mem: &mut GuestMem, area: &Area, i: u32) {
        let w = u64::from(i / 64);
        let or = |mem: &mut GuestMem, addr: u64, bit: u64| {
            let mut b = [0u8; 8];
            mem.read(addr, &mut b).unwrap();
            let v = u64::from_le_bytes(b) | bit;
            mem.write(addr, &v.to_le_bytes()).unwrap();
        };
        or(mem, area.addr(doorbell::BITMAP + 8 * w), 1 << (i % 64));
        or(
            mem,
            area.addr(doorbell::SUMMARY + 8 * (w / 64)),
            1 << (w % 64),
        );
    }

    #[test]
    fn rung_doorbells_are_taken_once_across_pages() {
        let bits = 1 << 16;
        let n = doorbell::area_pages(bits);
        // The area's pages scattered, in reverse order.
        let pages: Vec<u64> = (0..n)
            .rev()
            .map(|i| 0x10_0000 + 2 * i * PAGE_SIZE)
            .collect();
        let mut mem = GuestMem::anonymous(0x10_0000, 0x10_0000).unwrap();
        let area = Area::new(bits, pages);
        for i in [0, 63, 64, 4095, 4096, 30_000, 65_535] {
            ring(&mut mem, &area, i);
        }
        ring(&mut mem, &area, 64);
        let mut out = Vec::new();
        assert_eq!(area.take(&mem, &mut out), Ok(7));
        assert_eq!(out, [0, 63, 64, 4095, 4096, 30_000, 65_535]);
        out.clear();
        assert_eq!(area.take(&mem, &mut out), Ok(0), "each once");
        area.set_poll(&mem, true).unwrap();
        assert_eq!(mem.load_u32(area.addr(0)), Ok(1));
    }

    #[test]
    fn a_summary_bit_past_the_bitmap_names_nothing() {
        let mut mem = GuestMem::anonymous(0, 0x2000).unwrap();
        let area = Area::new(128, vec![0x1000]);
        mem.write(0x1000 + doorbell::SUMMARY, &u64::MAX.to_le_bytes())
            .unwrap();
        ring(&mut mem, &area, 100);
        let mut out = Vec::new();
        assert_eq!(area.take(&mem, &mut out), Ok(1));
        assert_eq!(out, [100]);
    }

    #[test]
    fn an_area_outside_memory_is_an_error_not_a_fault() {
        let mem = GuestMem::anonymous(0, 0x1000).unwrap();
        let area = Area::new(64, vec![0x8000]);
        assert!(area.take(&mem, &mut Vec::new()).is_err());
        assert!(area.set_poll(&mem, false).is_err());
    }

    #[test]
    fn indices_are_the_lowest_free() {
        let mut ix = Indices::new(128);
        for want in 0..128 {
            assert_eq!(ix.take(), Some(want));
        }
        assert_eq!(ix.take(), None);
        ix.give(70);
        ix.give(3);
        ix.give(3);
        assert_eq!(ix.used(), 126);
        assert_eq!(ix.take(), Some(3));
        assert_eq!(ix.take(), Some(70));
        ix.give(1000);
        assert_eq!(ix.used(), 128);
    }

    /// A driver thread rings doorbells while the device takes them: every
    /// ring is seen (at least once after it), none invented.
    #[test]
    fn concurrent_rings_are_never_lost() {
        use std::sync::atomic::{AtomicU64, Ordering};

        use vm_memory::{GuestMemoryBackend, VolatileMemory};
        let mem = GuestMem::anonymous(0, 0x4000).unwrap();
        let area = Area::new(4096, vec![0x1000]);
        let driver = {
            let mem = mem.clone();
            std::thread::spawn(move || {
                let or = |addr: u64, bit: u64| {
                    let s = mem
                        .map()
                        .get_slice(vm_memory::GuestAddress(addr), 8)
                        .unwrap();
                    s.get_atomic_ref::<AtomicU64>(0)
                        .unwrap()
                        .fetch_or(bit.to_le(), Ordering::SeqCst);
                };
                for round in 0..20_000u32 {
                    let i = (round * 97) % 4096;
                    let w = u64::from(i / 64);
                    or(0x1000 + doorbell::BITMAP + 8 * w, 1 << (i % 64));
                    or(0x1000 + doorbell::SUMMARY + 8 * (w / 64), 1 << (w % 64));
                }
            })
        };
        let mut seen = vec![false; 4096];
        let mut out = Vec::new();
        while !driver.is_finished() {
            out.clear();
            area.take(&mem, &mut out).unwrap();
            for &i in &out {
                seen[i as usize] = true;
            }
        }
        driver.join().unwrap();
        out.clear();
        area.take(&mem, &mut out).unwrap();
        for &i in &out {
            seen[i as usize] = true;
        }
        let rung: std::collections::BTreeSet<u32> =
            (0..20_000u32).map(|r| (r * 97) % 4096).collect();
        for (i, s) in seen.iter().enumerate() {
            assert_eq!(*s, rung.contains(&(i as u32)), "doorbell {i}");
        }
    }
}
