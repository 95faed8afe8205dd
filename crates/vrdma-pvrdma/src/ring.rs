//! PVRDMA's page directories and ring layout, on the face core's page
//! lists and rings.
//!
//! A page directory (`pvrdma_page_dir`) is read once, when the object is
//! made, into a page list the daemon owns: a directory page of table
//! addresses, each table page 512 page addresses. A ring's indices are a
//! `pvrdma_ring` (the producer's `prod_tail`, then the consumer's
//! `cons_head`) in the object's first page; its indices carry a wrap bit
//! (the driver's `pvrdma_ring.h` arithmetic, [`WrapBit`]), also for the
//! two device rings whose sizes are not powers of two.

use vm_memory::GuestMemory;
use vrdma_face::{GuestError, GuestRing, PageList, guest, ring::WrapBit};
use zerocopy::IntoBytes;

use crate::abi::{MAX_PDIR_PAGES, PAGE_SIZE, PDIR_ENTRIES};

const _: () = assert!(PAGE_SIZE == vrdma_face::PAGE_SIZE);

/// A PVRDMA ring.
pub type Ring = GuestRing<WrapBit>;

/// Reads `npages` page addresses through the directory at `pdir`. Every
/// address must be page-aligned.
pub fn read_pdir<M: GuestMemory + ?Sized>(
    mem: &M,
    pdir: u64,
    npages: u64,
) -> Result<PageList, GuestError> {
    if npages == 0 || npages > MAX_PDIR_PAGES {
        return Err(GuestError::PageCount(npages));
    }
    if !pdir.is_multiple_of(PAGE_SIZE) {
        return Err(GuestError::Unaligned(pdir));
    }
    let tables = npages.div_ceil(PDIR_ENTRIES);
    let mut dir = vec![0u64; tables as usize];
    guest::read_into(mem, pdir, dir.as_mut_bytes())?;
    let mut pages = PageList::default();
    for (t, &table) in dir.iter().enumerate() {
        let table = u64::from_le(table);
        if !table.is_multiple_of(PAGE_SIZE) {
            return Err(GuestError::Unaligned(table));
        }
        let n = (npages - t as u64 * PDIR_ENTRIES).min(PDIR_ENTRIES) as usize;
        pages.extend(PageList::read(mem, table, n)?);
    }
    Ok(pages)
}

/// A ring of `count` entries of `stride` bytes over `data`, with its
/// `pvrdma_ring` at `state`. `None` if the pages cannot hold it or an
/// entry would cross a page.
pub fn ring(count: u32, stride: u64, state: u64, data: PageList) -> Option<Ring> {
    GuestRing::new(WrapBit::new(count)?, stride, state, state + 4, data)
}

#[cfg(test)]
mod tests {
    use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

    use vrdma_face::Indices;

    use super::*;

    fn mem() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0x10_0000), 0x10_0000)]).unwrap()
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
        let p = read_pdir(&m, dir, 3).unwrap();
        assert_eq!(p.pages(), &[0x10_4000, 0x10_5000, 0x10_6000]);
        assert_eq!(p.addr(0x1010), Some(0x10_5010));
        assert_eq!(p.addr(0x3000), None);
        // Rewriting the directory afterwards changes nothing.
        m.write_obj(0u64, GuestAddress(table)).unwrap();
        assert_eq!(p.pages()[0], 0x10_4000);
        m.write_obj(0x10_4008u64.to_le(), GuestAddress(table))
            .unwrap();
        assert_eq!(read_pdir(&m, dir, 3), Err(GuestError::Unaligned(0x10_4008)));
        assert_eq!(read_pdir(&m, dir, 0), Err(GuestError::PageCount(0)));
        assert_eq!(
            read_pdir(&m, dir, MAX_PDIR_PAGES + 1),
            Err(GuestError::PageCount(MAX_PDIR_PAGES + 1))
        );
        assert_eq!(read_pdir(&m, 0x1000, 1), Err(GuestError::Unmapped(0x1000)));
        assert_eq!(m.num_regions(), 1);
    }

    #[test]
    fn a_directory_of_more_than_one_table() {
        let m = mem();
        let (dir, t0, t1) = (0x10_0000u64, 0x10_1000u64, 0x10_2000u64);
        m.write_obj(t0.to_le(), GuestAddress(dir)).unwrap();
        m.write_obj(t1.to_le(), GuestAddress(dir + 8)).unwrap();
        for i in 0..PDIR_ENTRIES {
            m.write_obj((i << 12).to_le(), GuestAddress(t0 + 8 * i))
                .unwrap();
        }
        m.write_obj(0x7777_7000u64.to_le(), GuestAddress(t1))
            .unwrap();
        let p = read_pdir(&m, dir, PDIR_ENTRIES + 1).unwrap();
        assert_eq!(p.len() as u64, PDIR_ENTRIES + 1);
        assert_eq!(p.pages()[511], 511 << 12);
        assert_eq!(p.pages()[512], 0x7777_7000);
        // A table address that is no page.
        m.write_obj((t1 + 8).to_le(), GuestAddress(dir + 8))
            .unwrap();
        assert_eq!(
            read_pdir(&m, dir, PDIR_ENTRIES + 1),
            Err(GuestError::Unaligned(t1 + 8))
        );
    }

    #[test]
    fn ring_indices_from_the_guest_are_checked() {
        let m = mem();
        let r = ring(8, 64, 0x10_0000, PageList::new(vec![0x10_1000]).unwrap()).unwrap();
        m.write_obj(15u32, GuestAddress(0x10_0000)).unwrap();
        assert_eq!(r.prod(&m), Ok(15));
        m.write_obj(16u32, GuestAddress(0x10_0000)).unwrap();
        assert_eq!(r.prod(&m), Err(GuestError::BadIndex(16)));
        m.write_obj(3u32, GuestAddress(0x10_0004)).unwrap();
        assert_eq!(r.cons(&m), Ok(3));
        assert_eq!(r.entry_addr(9), 0x10_1040);
        assert_eq!(r.indices().capacity(), 8);
        let one = || PageList::new(vec![0x1000]).unwrap();
        assert!(ring(128, 64, 0, one()).is_none());
        assert!(ring(8, 48, 0, one()).is_none());
        assert!(ring(0, 64, 0, one()).is_none());
    }
}
