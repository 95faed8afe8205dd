//! Guest rings: the page directories that name an object's pages, and the
//! rings laid over them (QP send and receive queues, SRQs, CQs, the async
//! event and CQ-notification rings).
//!
//! A page directory is read once, when the object is made, into a page
//! list the daemon owns: the guest may rewrite its directory afterwards,
//! the device keeps using what it was given (a page it no longer maps is
//! then a failed access, never someone else's memory: every access goes
//! through the guest's DMA maps). Ring indices come from guest memory and
//! are checked before any use; the index arithmetic is the driver's
//! (`pvrdma_ring.h`), bit for bit, also for the two device rings whose
//! sizes are not powers of two.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use zerocopy::{FromBytes, IntoBytes};

use crate::abi::{MAX_PDIR_PAGES, PAGE_SIZE, PDIR_ENTRIES};

/// What went wrong reading guest structures.
#[derive(Clone, Copy, Debug, Eq, PartialEq, thiserror::Error)]
pub enum GuestError {
    #[error("guest memory at {0:#x} is not mapped")]
    Unmapped(u64),
    #[error("page directory entry {0:#x} is not page-aligned")]
    Unaligned(u64),
    #[error("page count {0} out of range")]
    PageCount(u64),
    #[error("ring index {0:#x} is invalid")]
    BadIndex(u32),
    #[error("page {0:#x} is another ring's")]
    Shared(u64),
}

/// Reads a `T` (a copy) at `addr`.
pub fn read<T: FromBytes + IntoBytes + Default>(
    mem: &GuestMemoryMmap<()>,
    addr: u64,
) -> Result<T, GuestError> {
    let mut v = T::default();
    mem.read_slice(v.as_mut_bytes(), GuestAddress(addr))
        .map_err(|_| GuestError::Unmapped(addr))?;
    Ok(v)
}

/// Writes `v` at `addr`.
pub fn write<T: IntoBytes + zerocopy::Immutable>(
    mem: &GuestMemoryMmap<()>,
    addr: u64,
    v: &T,
) -> Result<(), GuestError> {
    mem.write_slice(v.as_bytes(), GuestAddress(addr))
        .map_err(|_| GuestError::Unmapped(addr))
}

/// Copies `buf.len()` bytes at `addr` into `buf`.
pub fn read_into(mem: &GuestMemoryMmap<()>, addr: u64, buf: &mut [u8]) -> Result<(), GuestError> {
    mem.read_slice(buf, GuestAddress(addr))
        .map_err(|_| GuestError::Unmapped(addr))
}

/// Writes `data` at `addr`.
pub fn write_bytes(mem: &GuestMemoryMmap<()>, addr: u64, data: &[u8]) -> Result<(), GuestError> {
    mem.write_slice(data, GuestAddress(addr))
        .map_err(|_| GuestError::Unmapped(addr))
}

fn read_u32(mem: &GuestMemoryMmap<()>, addr: u64) -> Result<u32, GuestError> {
    let mut b = [0u8; 4];
    mem.read_slice(&mut b, GuestAddress(addr))
        .map_err(|_| GuestError::Unmapped(addr))?;
    Ok(u32::from_le_bytes(b))
}

fn write_u32(mem: &GuestMemoryMmap<()>, addr: u64, v: u32) -> Result<(), GuestError> {
    mem.write_slice(&v.to_le_bytes(), GuestAddress(addr))
        .map_err(|_| GuestError::Unmapped(addr))
}

/// An object's pages, as its page directory named them when it was made.
#[derive(Clone, Debug, Default, Eq, PartialEq)]
pub struct PageList(Vec<u64>);

impl PageList {
    /// Reads `npages` page addresses through the directory at `pdir`: the
    /// directory page holds table addresses, each table page 512 page
    /// addresses. Every address must be page-aligned.
    pub fn read(mem: &GuestMemoryMmap<()>, pdir: u64, npages: u64) -> Result<Self, GuestError> {
        if npages == 0 || npages > MAX_PDIR_PAGES {
            return Err(GuestError::PageCount(npages));
        }
        if !pdir.is_multiple_of(PAGE_SIZE) {
            return Err(GuestError::Unaligned(pdir));
        }
        let tables = npages.div_ceil(PDIR_ENTRIES);
        let mut dir = vec![0u64; tables as usize];
        mem.read_slice(dir.as_mut_bytes(), GuestAddress(pdir))
            .map_err(|_| GuestError::Unmapped(pdir))?;
        let mut pages = Vec::with_capacity(npages as usize);
        for (t, &table) in dir.iter().enumerate() {
            let table = u64::from_le(table);
            if table % PAGE_SIZE != 0 {
                return Err(GuestError::Unaligned(table));
            }
            let n = (npages - t as u64 * PDIR_ENTRIES).min(PDIR_ENTRIES) as usize;
            let mut entries = vec![0u64; n];
            mem.read_slice(entries.as_mut_bytes(), GuestAddress(table))
                .map_err(|_| GuestError::Unmapped(table))?;
            for e in entries {
                let e = u64::from_le(e);
                if e % PAGE_SIZE != 0 {
                    return Err(GuestError::Unaligned(e));
                }
                pages.push(e);
            }
        }
        Ok(PageList(pages))
    }

    /// The page addresses, taken.
    pub fn into_pages(self) -> Vec<u64> {
        self.0
    }

    /// A list of the given pages (tests).
    pub fn from_pages(pages: Vec<u64>) -> Self {
        PageList(pages)
    }

    pub fn pages(&self) -> &[u64] {
        &self.0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The guest address of byte `offset` of the object (its pages laid
    /// end to end), if inside.
    pub fn addr(&self, offset: u64) -> Option<u64> {
        let page = self.0.get(usize::try_from(offset / PAGE_SIZE).ok()?)?;
        Some(page + offset % PAGE_SIZE)
    }

    /// The pages from `first` on (a ring's data after its state page, a
    /// QP's receive queue after its send queue).
    pub fn skip(&self, first: usize) -> PageList {
        PageList(self.0.get(first..).unwrap_or_default().to_vec())
    }

    /// The first `n` pages.
    pub fn take(&self, n: usize) -> PageList {
        PageList(self.0[..n.min(self.0.len())].to_vec())
    }
}

/// Who holds a ring page.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Owner {
    /// The async-event and CQ-notification rings.
    Device,
    Cq(u32),
    Qp(u32),
    Srq(u32),
}

/// The guest pages that hold rings, each page one object's. The driver
/// gives every ring pages of its own; a guest that does not could make
/// the device feed itself — a CQ's entries or indices landing on a queue's
/// producer index, each completion taking a WQE that completes again,
/// forever — so an object whose pages are another's (or listed twice) is
/// refused.
#[derive(Clone, Debug, Default)]
pub struct RingPages(std::collections::BTreeMap<u64, Owner>);

impl RingPages {
    /// The first of `pages` that is taken or listed twice, if any.
    pub fn conflict(&self, pages: &[u64]) -> Option<u64> {
        let mut seen = std::collections::BTreeSet::new();
        pages
            .iter()
            .copied()
            .find(|&p| self.0.contains_key(&p) || !seen.insert(p))
    }

    /// Takes `pages` (with no [`RingPages::conflict`]) for `owner`.
    pub fn claim(&mut self, owner: Owner, pages: &[u64]) {
        for &p in pages {
            self.0.insert(p, owner);
        }
    }

    /// Gives back `owner`'s pages.
    pub fn release(&mut self, owner: Owner) {
        self.0.retain(|_, o| *o != owner);
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }
}

/// Ring index arithmetic over `count` elements, as the driver does it: an
/// index carries one extra (wrap) bit above the slot; the slot is
/// `index & (count − 1)`; the next index is `(index + 1) & (2·count − 1)`.
/// For a power of two this is the usual ring. For the device's async
/// (1536) and CQ-notification (3072) rings, whose sizes are not, the same
/// bit operations cycle through only the lowest set bit's worth of slots
/// (512 and 1024) with a period of twice that: the device writes exactly
/// where the driver will read, and keeps to that capacity itself
/// ([`Ring::capacity`]).
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Ring {
    count: u32,
}

impl Ring {
    pub fn new(count: u32) -> Self {
        assert!(count > 0 && count <= 1 << 30, "ring size");
        Ring { count }
    }

    pub fn count(&self) -> u32 {
        self.count
    }

    /// Entries that may be outstanding at once.
    pub fn capacity(&self) -> u32 {
        1 << self.count.trailing_zeros()
    }

    /// The number of distinct indices: twice the capacity.
    fn period(&self) -> u32 {
        self.capacity() * 2
    }

    fn mask2(&self) -> u32 {
        // (2·count − 1) as the driver computes it, in 32 bits.
        self.count.wrapping_mul(2).wrapping_sub(1)
    }

    /// An index the driver accepts (no bit above `2·count − 1`) and this
    /// ring can reach.
    pub fn valid(&self, idx: u32) -> bool {
        idx & !self.mask2() == 0 && idx < self.period()
    }

    pub fn slot(&self, idx: u32) -> u32 {
        idx & (self.count - 1)
    }

    pub fn next(&self, idx: u32) -> u32 {
        self.advance(idx, 1)
    }

    /// Entries from `head` to `tail` (both valid).
    pub fn used(&self, tail: u32, head: u32) -> u32 {
        tail.wrapping_sub(head) & (self.period() - 1)
    }

    /// `idx` moved `n` entries on (for a power of two, the driver's
    /// `(idx + n) & (2·count − 1)`).
    pub fn advance(&self, idx: u32, n: u32) -> u32 {
        idx.wrapping_add(n) & (self.period() - 1)
    }

    /// `idx` moved `n` entries back.
    pub fn back(&self, idx: u32, n: u32) -> u32 {
        idx.wrapping_sub(n) & (self.period() - 1)
    }
}

/// Where a ring's two indices live in guest memory (a `pvrdma_ring`), and
/// its elements: `stride` bytes each over `data` pages.
#[derive(Clone, Debug)]
pub struct GuestRing {
    pub ring: Ring,
    /// Guest address of `prod_tail`; `cons_head` follows it.
    state: u64,
    data: PageList,
    stride: u64,
}

impl GuestRing {
    /// A ring of `count` elements of `stride` bytes over `data`, with its
    /// indices at `state`. `None` if the pages cannot hold it or an
    /// element would cross a page.
    pub fn new(count: u32, stride: u64, state: u64, data: PageList) -> Option<Self> {
        if stride == 0 || !PAGE_SIZE.is_multiple_of(stride) || count == 0 || count > 1 << 30 {
            return None;
        }
        let ring = Ring::new(count);
        let bytes = u64::from(count) * stride;
        if bytes > data.len() as u64 * PAGE_SIZE {
            return None;
        }
        Some(GuestRing {
            ring,
            state,
            data,
            stride,
        })
    }

    /// The guest's producer index, checked.
    pub fn prod_tail(&self, mem: &GuestMemoryMmap<()>) -> Result<u32, GuestError> {
        let v = read_u32(mem, self.state)?;
        if !self.ring.valid(v) {
            return Err(GuestError::BadIndex(v));
        }
        Ok(v)
    }

    /// The guest's consumer index, checked.
    pub fn cons_head(&self, mem: &GuestMemoryMmap<()>) -> Result<u32, GuestError> {
        let v = read_u32(mem, self.state + 4)?;
        if !self.ring.valid(v) {
            return Err(GuestError::BadIndex(v));
        }
        Ok(v)
    }

    pub fn set_prod_tail(&self, mem: &GuestMemoryMmap<()>, v: u32) -> Result<(), GuestError> {
        // The element before the index: the consumer reads the index, then
        // the element.
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        write_u32(mem, self.state, v)
    }

    pub fn set_cons_head(&self, mem: &GuestMemoryMmap<()>, v: u32) -> Result<(), GuestError> {
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        write_u32(mem, self.state + 4, v)
    }

    /// The guest address of the element at (valid) index `idx`.
    pub fn element(&self, idx: u32) -> u64 {
        let off = u64::from(self.ring.slot(idx)) * self.stride;
        // Inside the pages: checked at construction.
        self.data.addr(off).unwrap_or(u64::MAX)
    }

    pub fn stride(&self) -> u64 {
        self.stride
    }
}

#[cfg(test)]
mod tests {
    use vm_memory::GuestMemoryBackend;

    use super::*;

    fn mem() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0x10_0000), 0x10_0000)]).unwrap()
    }

    #[test]
    fn the_drivers_arithmetic_for_powers_of_two_and_the_device_rings() {
        let r = Ring::new(4);
        assert!(r.valid(7) && !r.valid(8));
        assert_eq!(r.slot(5), 1);
        assert_eq!(r.next(7), 0);
        assert_eq!(r.used(1, 6), 3);
        assert_eq!(r.capacity(), 4);
        // The async ring: 3 pages of 8-byte events.
        let a = Ring::new(1536);
        assert_eq!(a.capacity(), 512);
        let mut i = 0;
        let mut slots = std::collections::BTreeSet::new();
        for _ in 0..5000 {
            assert!(a.valid(i));
            slots.insert(a.slot(i));
            i = a.next(i);
        }
        assert_eq!(slots.len(), 512, "only the first 512 slots are ever used");
        assert_eq!(*slots.last().unwrap(), 511);
        let c = Ring::new(3072);
        assert_eq!(c.capacity(), 1024);
        // Across the wrap: 1024 written, head at 1024, tail back at 0.
        assert_eq!(c.used(0, 1024), 1024);
        assert_eq!(c.used(1024, 0), 1024);
        assert_eq!(c.next(2047), 0);
        assert!(!c.valid(2048) && !c.valid(4096));
        assert_eq!(r.back(1, 3), 6);
    }

    #[test]
    fn a_page_directory_is_copied_and_checked() {
        let m = mem();
        let dir = 0x10_0000u64;
        let table = 0x10_1000u64;
        m.write_obj(table.to_le(), GuestAddress(dir)).unwrap();
        for i in 0..3u64 {
            m.write_obj(
                (0x10_4000 + i * 0x1000).to_le(),
                GuestAddress(table + 8 * i),
            )
            .unwrap();
        }
        let p = PageList::read(&m, dir, 3).unwrap();
        assert_eq!(p.pages(), &[0x10_4000, 0x10_5000, 0x10_6000]);
        assert_eq!(p.addr(0x1010), Some(0x10_5010));
        assert_eq!(p.addr(0x3000), None);
        // Rewriting the directory afterwards changes nothing.
        m.write_obj(0u64, GuestAddress(table)).unwrap();
        assert_eq!(p.pages()[0], 0x10_4000);
        m.write_obj(0x10_4008u64.to_le(), GuestAddress(table))
            .unwrap();
        assert_eq!(
            PageList::read(&m, dir, 3),
            Err(GuestError::Unaligned(0x10_4008))
        );
        assert_eq!(PageList::read(&m, dir, 0), Err(GuestError::PageCount(0)));
        assert_eq!(
            PageList::read(&m, dir, MAX_PDIR_PAGES + 1),
            Err(GuestError::PageCount(MAX_PDIR_PAGES + 1))
        );
        assert_eq!(
            PageList::read(&m, 0x1000, 1),
            Err(GuestError::Unmapped(0x1000))
        );
        assert_eq!(m.num_regions(), 1);
    }

    #[test]
    fn ring_pages_are_one_objects_each() {
        let mut r = RingPages::default();
        assert_eq!(r.conflict(&[0x1000, 0x2000]), None);
        assert_eq!(r.conflict(&[0x1000, 0x1000]), Some(0x1000), "listed twice");
        r.claim(Owner::Cq(1), &[0x1000, 0x2000]);
        assert_eq!(r.conflict(&[0x3000, 0x2000]), Some(0x2000));
        r.claim(Owner::Qp(17), &[0x3000]);
        r.release(Owner::Cq(1));
        assert_eq!(r.conflict(&[0x1000, 0x2000]), None);
        assert_eq!(r.conflict(&[0x3000]), Some(0x3000));
    }

    #[test]
    fn ring_indices_from_the_guest_are_checked() {
        let m = mem();
        let r = GuestRing::new(8, 64, 0x10_0000, PageList::from_pages(vec![0x10_1000])).unwrap();
        m.write_obj(15u32, GuestAddress(0x10_0000)).unwrap();
        assert_eq!(r.prod_tail(&m), Ok(15));
        m.write_obj(16u32, GuestAddress(0x10_0000)).unwrap();
        assert_eq!(r.prod_tail(&m), Err(GuestError::BadIndex(16)));
        assert_eq!(r.element(9), 0x10_1040);
        assert!(GuestRing::new(128, 64, 0, PageList::from_pages(vec![0x1000])).is_none());
        assert!(GuestRing::new(8, 48, 0, PageList::from_pages(vec![0x1000])).is_none());
    }
}
