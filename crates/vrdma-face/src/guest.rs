//! Guest memory from copies: a structure, an entry or an index word is
//! copied out of guest memory (or into it) through vm-memory's volatile
//! accesses, and worked on as the copy — never through a reference into
//! memory the guest can rewrite meanwhile.
//!
//! Any vm-memory [`GuestMemory`] will do: the mapped regions of a
//! vfio-user client or a vhost-user frontend, an IOMMU's view of them.

use vm_memory::{
    Bytes, GuestAddress, GuestMemory, GuestMemoryBackend, Permissions, VolatileSlice,
    bitmap::BitmapSlice,
};
use zerocopy::{FromBytes, Immutable, IntoBytes};

/// What went wrong reading or checking guest structures.
#[derive(Clone, Copy, Debug, Eq, PartialEq, thiserror::Error)]
pub enum GuestError {
    #[error("guest memory at {0:#x} is not mapped")]
    Unmapped(u64),
    #[error("page address {0:#x} is not page-aligned")]
    Unaligned(u64),
    #[error("page count {0} out of range")]
    PageCount(u64),
    #[error("ring index {0:#x} is invalid")]
    BadIndex(u32),
    #[error("page {0:#x} is another ring's")]
    Shared(u64),
    #[error("an entry of {0} bytes does not fit its ring's slot")]
    Oversized(u64),
}

/// Whether the `len` bytes at `addr` are guest memory the device may read
/// and write.
pub fn is_mapped<M: GuestMemory + ?Sized>(mem: &M, addr: u64, len: u64) -> bool {
    usize::try_from(len)
        .is_ok_and(|n| mem.check_range(GuestAddress(addr), n, Permissions::ReadWrite))
}

/// Reads a `T` (a copy) at `addr`.
pub fn read<T, M>(mem: &M, addr: u64) -> Result<T, GuestError>
where
    T: FromBytes + IntoBytes + Default,
    M: GuestMemory + ?Sized,
{
    let mut v = T::default();
    read_into(mem, addr, v.as_mut_bytes())?;
    Ok(v)
}

/// Writes `v` at `addr`.
pub fn write<T, M>(mem: &M, addr: u64, v: &T) -> Result<(), GuestError>
where
    T: IntoBytes + Immutable + ?Sized,
    M: GuestMemory + ?Sized,
{
    write_bytes(mem, addr, v.as_bytes())
}

/// The `len` bytes at `addr` as one volatile slice, where the memory is
/// plain guest-physical memory (no IOMMU between: vm-memory's
/// `physical_memory`) and they lie in one region — nearly always for an
/// entry, a CQE or an index. The copies below take it when they can: one
/// region lookup and a copy, where the general path (any `GuestMemory`,
/// ranges across regions) goes through vm-memory's slice iterator, which
/// cost more than the copy of a 64-byte entry on the path every WQE takes
/// (the faces bench's stepped mode).
fn one_slice<M: GuestMemory + ?Sized>(
    mem: &M,
    addr: u64,
    len: usize,
) -> Option<VolatileSlice<'_, impl BitmapSlice + '_>> {
    mem.physical_memory()?
        .get_slice(GuestAddress(addr), len)
        .ok()
}

/// Copies `buf.len()` bytes at `addr` into `buf`.
pub fn read_into<M: GuestMemory + ?Sized>(
    mem: &M,
    addr: u64,
    buf: &mut [u8],
) -> Result<(), GuestError> {
    if let Some(s) = one_slice(mem, addr, buf.len()) {
        s.copy_to(buf);
        return Ok(());
    }
    mem.read_slice(buf, GuestAddress(addr))
        .map_err(|_| GuestError::Unmapped(addr))
}

/// Writes `data` at `addr`.
pub fn write_bytes<M: GuestMemory + ?Sized>(
    mem: &M,
    addr: u64,
    data: &[u8],
) -> Result<(), GuestError> {
    if let Some(s) = one_slice(mem, addr, data.len()) {
        s.copy_from(data);
        return Ok(());
    }
    mem.write_slice(data, GuestAddress(addr))
        .map_err(|_| GuestError::Unmapped(addr))
}

/// Reads the little-endian word at `addr` (a ring index): an aligned word
/// in one load, an unaligned one copied.
pub fn read_u32<M: GuestMemory + ?Sized>(mem: &M, addr: u64) -> Result<u32, GuestError> {
    if addr.is_multiple_of(4)
        && let Some(s) = one_slice(mem, addr, 4)
        && let Ok(v) = s.load::<u32>(0, std::sync::atomic::Ordering::Relaxed)
    {
        return Ok(u32::from_le(v));
    }
    let mut b = [0u8; 4];
    read_into(mem, addr, &mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// Writes `v` as a little-endian word at `addr`.
pub fn write_u32<M: GuestMemory + ?Sized>(mem: &M, addr: u64, v: u32) -> Result<(), GuestError> {
    write_bytes(mem, addr, &v.to_le_bytes())
}

#[cfg(test)]
mod tests {
    use vm_memory::GuestMemoryMmap;

    use super::*;

    #[test]
    fn copies_in_and_out_and_unmapped_addresses_are_errors() {
        let m = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0x1000), 0x1000)]).unwrap();
        write(&m, 0x1010, &0x1122_3344_5566_7788u64).unwrap();
        assert_eq!(read::<u64, _>(&m, 0x1010), Ok(0x1122_3344_5566_7788));
        assert_eq!(read_u32(&m, 0x1010), Ok(0x5566_7788));
        write_u32(&m, 0x1ffc, 7).unwrap();
        assert_eq!(read_u32(&m, 0x1ffc), Ok(7));
        // Across the end of the memory: nothing half-read.
        assert_eq!(read_u32(&m, 0x1ffe), Err(GuestError::Unmapped(0x1ffe)));
        assert_eq!(write_u32(&m, 0x0, 1), Err(GuestError::Unmapped(0)));
        let mut buf = [0u8; 8];
        assert_eq!(
            read_into(&m, 0x2000, &mut buf),
            Err(GuestError::Unmapped(0x2000))
        );
    }

    #[test]
    fn a_copy_across_two_regions_is_whole() {
        let m = GuestMemoryMmap::<()>::from_ranges(&[
            (GuestAddress(0x1000), 0x1000),
            (GuestAddress(0x2000), 0x1000),
        ])
        .unwrap();
        write(&m, 0x1ffc, &0x1122_3344_5566_7788u64).unwrap();
        assert_eq!(read::<u64, _>(&m, 0x1ffc), Ok(0x1122_3344_5566_7788));
        assert_eq!(read_u32(&m, 0x1ffc), Ok(0x5566_7788));
        assert_eq!(read_u32(&m, 0x2000), Ok(0x1122_3344));
        // Unaligned, across the boundary.
        assert_eq!(read_u32(&m, 0x1ffe), Ok(0x3344_5566));
    }
}
