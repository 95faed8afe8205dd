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

use vrdma_face::{GuestRing, PageList, pages, ring::WrapBit};

use crate::abi::{MAX_PDIR_PAGES, PAGE_SIZE, PDIR_ENTRIES};

// A `pvrdma_page_dir` is the face core's page directory
// (`PageList::read_directory`).
const _: () = assert!(
    PAGE_SIZE == vrdma_face::PAGE_SIZE
        && PDIR_ENTRIES == pages::DIRECTORY_ENTRIES
        && MAX_PDIR_PAGES == pages::MAX_DIRECTORY_PAGES
);

/// A PVRDMA ring.
pub type Ring = GuestRing<WrapBit>;

/// A ring of `count` entries of `stride` bytes over `data`, with its
/// `pvrdma_ring` at `state`. `None` if the pages cannot hold it or an
/// entry would cross a page.
pub fn ring(count: u32, stride: u64, state: u64, data: PageList) -> Option<Ring> {
    GuestRing::new(WrapBit::new(count)?, stride, state, state + 4, data)
}

#[cfg(test)]
mod tests {
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
    use vrdma_face::GuestError;

    use vrdma_face::Indices;

    use super::*;

    fn mem() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0x10_0000), 0x10_0000)]).unwrap()
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
