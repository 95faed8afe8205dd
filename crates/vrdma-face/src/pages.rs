//! Page lists: the guest pages an object (a ring, an MR) was made on,
//! copied into the daemon when the object is made and checked then. The
//! guest may rewrite its list afterwards; the device keeps using what it
//! was given (a page it no longer maps is then a failed access, never
//! someone else's memory: every access goes through vm-memory).
//!
//! And which object holds which ring page, area and header ([`Claims`]):
//! rings never share pages.

use std::collections::{BTreeMap, BTreeSet};

use vm_memory::GuestMemory;
use zerocopy::IntoBytes;

use crate::{
    guest::{self, GuestError},
    status::Refused,
};

/// The page size of the guest structures a face reads: page lists name
/// pages of this size, and no ring entry crosses one.
pub const PAGE_SIZE: u64 = 4096;

/// Page addresses one page of a page directory holds (le64 each).
pub const DIRECTORY_ENTRIES: u64 = PAGE_SIZE / 8;

/// The most pages a page directory names: a directory page of tables,
/// each a page of page addresses.
pub const MAX_DIRECTORY_PAGES: u64 = DIRECTORY_ENTRIES * DIRECTORY_ENTRIES;

/// An object's guest pages, in order, each page-aligned: a copy the
/// daemon owns.
#[derive(Clone, Debug, Default, Eq, PartialEq)]
pub struct PageList(Vec<u64>);

impl PageList {
    /// A list of `pages`, checked: every address page-aligned.
    pub fn new(pages: Vec<u64>) -> Result<Self, GuestError> {
        match pages.iter().find(|p| !p.is_multiple_of(PAGE_SIZE)) {
            Some(&p) => Err(GuestError::Unaligned(p)),
            None => Ok(PageList(pages)),
        }
    }

    /// Copies `n` page addresses (little-endian, 8 bytes each) from the
    /// array at `at`, and checks them. The caller bounds `n`: it sizes
    /// the copy.
    pub fn read<M: GuestMemory + ?Sized>(mem: &M, at: u64, n: usize) -> Result<Self, GuestError> {
        let mut pages = vec![0u64; n];
        guest::read_into(mem, at, pages.as_mut_bytes())?;
        for p in &mut pages {
            *p = u64::from_le(*p);
        }
        PageList::new(pages)
    }

    /// Reads `npages` page addresses through the two-level page directory
    /// at `dir` (a page of table addresses, each table a page of page
    /// addresses: PVRDMA's `pvrdma_page_dir`). Every address must be
    /// page-aligned; the count is checked before anything is read.
    pub fn read_directory<M: GuestMemory + ?Sized>(
        mem: &M,
        dir: u64,
        npages: u64,
    ) -> Result<Self, GuestError> {
        if npages == 0 || npages > MAX_DIRECTORY_PAGES {
            return Err(GuestError::PageCount(npages));
        }
        if !dir.is_multiple_of(PAGE_SIZE) {
            return Err(GuestError::Unaligned(dir));
        }
        let tables = npages.div_ceil(DIRECTORY_ENTRIES);
        let mut table_addrs = vec![0u64; tables as usize];
        guest::read_into(mem, dir, table_addrs.as_mut_bytes())?;
        let mut pages = PageList::default();
        for (t, &table) in table_addrs.iter().enumerate() {
            let table = u64::from_le(table);
            if !table.is_multiple_of(PAGE_SIZE) {
                return Err(GuestError::Unaligned(table));
            }
            let n = (npages - t as u64 * DIRECTORY_ENTRIES).min(DIRECTORY_ENTRIES) as usize;
            pages.extend(PageList::read(mem, table, n)?);
        }
        Ok(pages)
    }

    /// The page addresses.
    pub fn pages(&self) -> &[u64] {
        &self.0
    }

    /// The page addresses, taken.
    pub fn into_pages(self) -> Vec<u64> {
        self.0
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

    /// The pages from `first` on (a ring's entries after its index page, a
    /// QP's receive queue after its send queue).
    pub fn skip(&self, first: usize) -> PageList {
        PageList(self.0.get(first..).unwrap_or_default().to_vec())
    }

    /// The first `n` pages.
    #[must_use]
    pub fn take(&self, n: usize) -> PageList {
        PageList(self.0[..n.min(self.0.len())].to_vec())
    }

    /// The pages of `more` after these.
    pub fn extend(&mut self, more: PageList) {
        self.0.extend(more.0);
    }
}

/// What owns guest pages the device writes or reads as structures.
#[derive(Clone, Copy, Debug, Eq, Ord, PartialEq, PartialOrd)]
pub enum Owner {
    /// The device's own rings (events, notifications).
    Device,
    /// A context's doorbell area.
    Context(u32),
    Cq(u32),
    Qp(u32),
    Srq(u32),
}

/// The pages of every live ring and doorbell area, and every live ring
/// header, with their owners: each ring on pages of its own, so that a
/// device write (a CQE, a consumer index) never lands on a producer index
/// or WQE the device reads. A guest whose objects shared pages could make
/// the device feed itself — a CQ's entries landing on a queue's producer
/// index, each completion taking a WQE that completes again, forever — so
/// an object whose pages are another's (or listed twice), or that holds
/// another's header, is refused. Both faces keep one (PVRDMA's rings have
/// no headers of their own: its ring state is on the rings' first page).
#[derive(Clone, Debug, Default)]
pub struct Claims {
    pages: BTreeMap<u64, Owner>,
    headers: BTreeMap<u64, Owner>,
    /// What each owner claimed, to give it back without a scan.
    by_owner: BTreeMap<Owner, (Vec<u64>, Vec<u64>)>,
}

impl Claims {
    /// The first of `pages` that is taken, listed twice or holds a live
    /// header, if any.
    pub fn conflict(&self, pages: &[u64]) -> Option<u64> {
        let mut seen = BTreeSet::new();
        pages.iter().copied().find(|&p| {
            !seen.insert(p)
                || self.pages.contains_key(&p)
                || self.headers.range(p..p + PAGE_SIZE).next().is_some()
        })
    }

    /// Whether `pages` and `headers` may be claimed (by `owner`, whose own
    /// headers may be given again: a CQ resized in place).
    pub fn check(
        &self,
        pages: &[u64],
        headers: &[u64],
        owner: Option<Owner>,
    ) -> Result<(), Refused> {
        let clash = Refused::invalid("pages or a header another ring or area uses");
        let mut new = BTreeSet::new();
        for &p in pages {
            if !new.insert(p) || self.pages.contains_key(&p) {
                return Err(clash);
            }
            let held = self
                .headers
                .range(p..p + PAGE_SIZE)
                .any(|(_, o)| Some(*o) != owner);
            if held {
                return Err(clash);
            }
        }
        let mut seen = BTreeSet::new();
        for &h in headers {
            let page = h & !(PAGE_SIZE - 1);
            let taken = self.headers.get(&h).is_some_and(|o| Some(*o) != owner);
            if !seen.insert(h) || taken || new.contains(&page) || self.pages.contains_key(&page) {
                return Err(clash);
            }
        }
        Ok(())
    }

    /// Takes `pages` and `headers` (checked) for `owner`.
    pub fn claim(&mut self, owner: Owner, pages: &[u64], headers: &[u64]) {
        for &p in pages {
            self.pages.insert(p, owner);
        }
        for &h in headers {
            self.headers.insert(h, owner);
        }
        let e = self.by_owner.entry(owner).or_default();
        e.0.extend_from_slice(pages);
        e.1.extend_from_slice(headers);
    }

    /// Gives back what `owner` claimed.
    pub fn release(&mut self, owner: Owner) {
        let Some((pages, headers)) = self.by_owner.remove(&owner) else {
            return;
        };
        for p in pages {
            self.pages.remove(&p);
        }
        for h in headers {
            if self.headers.get(&h) == Some(&owner) {
                self.headers.remove(&h);
            }
        }
    }

    /// Nothing claimed (a reset).
    pub fn clear(&mut self) {
        *self = Claims::default();
    }

    /// Whether nothing is claimed.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty() && self.headers.is_empty() && self.by_owner.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

    use super::*;

    #[test]
    fn a_page_directory_is_copied_and_checked() {
        let m =
            GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0x10_0000), 0x10_0000)]).unwrap();
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
        let p = PageList::read_directory(&m, dir, 3).unwrap();
        assert_eq!(p.pages(), &[0x10_4000, 0x10_5000, 0x10_6000]);
        assert_eq!(p.addr(0x1010), Some(0x10_5010));
        assert_eq!(p.addr(0x3000), None);
        // Rewriting the directory afterwards changes nothing.
        m.write_obj(0u64, GuestAddress(table)).unwrap();
        assert_eq!(p.pages()[0], 0x10_4000);
        m.write_obj(0x10_4008u64.to_le(), GuestAddress(table))
            .unwrap();
        assert_eq!(
            PageList::read_directory(&m, dir, 3),
            Err(GuestError::Unaligned(0x10_4008))
        );
        assert_eq!(
            PageList::read_directory(&m, dir, 0),
            Err(GuestError::PageCount(0))
        );
        assert_eq!(
            PageList::read_directory(&m, dir, MAX_DIRECTORY_PAGES + 1),
            Err(GuestError::PageCount(MAX_DIRECTORY_PAGES + 1))
        );
        assert_eq!(
            PageList::read_directory(&m, 0x1000, 1),
            Err(GuestError::Unmapped(0x1000))
        );
        assert_eq!(m.num_regions(), 1);
    }

    #[test]
    fn a_directory_of_more_than_one_table() {
        let m =
            GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0x10_0000), 0x10_0000)]).unwrap();
        let (dir, t0, t1) = (0x10_0000u64, 0x10_1000u64, 0x10_2000u64);
        m.write_obj(t0.to_le(), GuestAddress(dir)).unwrap();
        m.write_obj(t1.to_le(), GuestAddress(dir + 8)).unwrap();
        for i in 0..DIRECTORY_ENTRIES {
            m.write_obj((i << 12).to_le(), GuestAddress(t0 + 8 * i))
                .unwrap();
        }
        m.write_obj(0x7777_7000u64.to_le(), GuestAddress(t1))
            .unwrap();
        let p = PageList::read_directory(&m, dir, DIRECTORY_ENTRIES + 1).unwrap();
        assert_eq!(p.len() as u64, DIRECTORY_ENTRIES + 1);
        assert_eq!(p.pages()[511], 511 << 12);
        assert_eq!(p.pages()[512], 0x7777_7000);
        // A table address that is no page.
        m.write_obj((t1 + 8).to_le(), GuestAddress(dir + 8))
            .unwrap();
        assert_eq!(
            PageList::read_directory(&m, dir, DIRECTORY_ENTRIES + 1),
            Err(GuestError::Unaligned(t1 + 8))
        );
    }

    #[test]
    fn a_page_list_is_copied_checked_and_addressed() {
        let m = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0x10_0000), 0x1000)]).unwrap();
        for (i, p) in [0x10_4000u64, 0x10_5000, 0x10_6000].iter().enumerate() {
            m.write_obj(p.to_le(), GuestAddress(0x10_0000 + 8 * i as u64))
                .unwrap();
        }
        let p = PageList::read(&m, 0x10_0000, 3).unwrap();
        assert_eq!(p.pages(), &[0x10_4000, 0x10_5000, 0x10_6000]);
        assert_eq!(p.addr(0x1010), Some(0x10_5010));
        assert_eq!(p.addr(0x3000), None);
        assert_eq!(p.skip(1).pages(), &[0x10_5000, 0x10_6000]);
        assert_eq!(p.skip(4), PageList::default());
        assert_eq!(p.take(1).pages(), &[0x10_4000]);
        assert_eq!(p.take(9), p);
        // Rewriting the array afterwards changes nothing.
        m.write_obj(0x10_4008u64.to_le(), GuestAddress(0x10_0000))
            .unwrap();
        assert_eq!(p.pages()[0], 0x10_4000);
        assert_eq!(
            PageList::read(&m, 0x10_0000, 3),
            Err(GuestError::Unaligned(0x10_4008))
        );
        assert_eq!(
            PageList::read(&m, 0x10_0ff8, 2),
            Err(GuestError::Unmapped(0x10_0ff8))
        );
        let mut q = PageList::new(vec![0x1000]).unwrap();
        q.extend(PageList::new(vec![0x3000]).unwrap());
        assert_eq!(q.pages(), &[0x1000, 0x3000]);
        assert_eq!(
            PageList::new(vec![0x1000, 1]),
            Err(GuestError::Unaligned(1))
        );
    }

    #[test]
    fn ring_pages_are_one_objects_each() {
        let mut r = Claims::default();
        assert_eq!(r.conflict(&[0x1000, 0x2000]), None);
        assert_eq!(r.conflict(&[0x1000, 0x1000]), Some(0x1000), "listed twice");
        r.claim(Owner::Cq(1), &[0x1000, 0x2000], &[]);
        assert_eq!(r.conflict(&[0x3000, 0x2000]), Some(0x2000));
        r.claim(Owner::Qp(17), &[0x3000], &[0x9040]);
        assert_eq!(r.conflict(&[0x9000]), Some(0x9000), "a page with a header");
        r.release(Owner::Cq(1));
        assert_eq!(r.conflict(&[0x1000, 0x2000]), None);
        assert_eq!(r.conflict(&[0x3000]), Some(0x3000));
        r.clear();
        assert_eq!(r.conflict(&[0x3000]), None);
        assert!(r.is_empty());
    }

    #[test]
    fn rings_and_areas_keep_to_pages_of_their_own() {
        let mut c = Claims::default();
        let ok = |r: Result<(), Refused>| r.is_ok();
        // A page twice in one command; a header inside the command's pages;
        // two equal headers.
        assert!(!ok(c.check(&[0x1000, 0x1000], &[], None)));
        assert!(!ok(c.check(&[0x1000], &[0x1040], None)));
        assert!(!ok(c.check(&[0x1000], &[0x9000, 0x9000], None)));
        assert!(ok(c.check(&[0x1000, 0x2000], &[0x9000, 0x9040], None)));
        c.claim(Owner::Qp(17), &[0x1000, 0x2000], &[0x9000, 0x9040]);
        // Another's page, a header on another's page, another's header, a
        // page holding another's header.
        assert!(!ok(c.check(&[0x2000], &[0xa000], None)));
        assert!(!ok(c.check(&[0x3000], &[0x1080], None)));
        assert!(!ok(c.check(&[0x3000], &[0x9040], None)));
        assert!(!ok(c.check(&[0x9000], &[0xa000], None)));
        // Headers share a page with each other.
        assert!(ok(c.check(&[0x3000], &[0x9080], None)));
        c.claim(Owner::Cq(1), &[0x3000], &[0x9080]);
        // A CQ resized keeps its header; its pages are new ones.
        assert!(ok(c.check(&[0x4000], &[0x9080], Some(Owner::Cq(1)))));
        assert!(!ok(c.check(&[0x4000], &[0x9080], Some(Owner::Cq(2)))));
        // Given back, taken again.
        c.release(Owner::Qp(17));
        assert!(ok(c.check(&[0x2000], &[0x9000], None)));
        assert!(!ok(c.check(&[0x3000], &[], None)));
        c.release(Owner::Cq(1));
        assert!(c.is_empty());
    }
}
