//! How the engine reaches memory: a small trait over device (bus)
//! addresses. The device implements it over guest memory mapped with
//! vm-memory (volatile access only); tests over a `Vec<u8>`. Bounds, keys, PDs and access rights are the
//! MR layer's job (`mr.rs`); an implementation only says whether an
//! address range exists.

/// An address range the memory does not hold.
#[derive(Clone, Copy, Debug, Eq, PartialEq, thiserror::Error)]
#[error("no memory at {addr:#x}+{len}")]
pub struct MemoryError {
    pub addr: u64,
    pub len: u64,
}

/// Byte-addressed memory the device may touch.
pub trait Memory {
    /// Copies `buf.len()` bytes at `addr` into `buf`.
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError>;

    /// Copies `data` to `addr`.
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemoryError>;

    /// Atomically replaces the little-endian u64 at `addr` with `swap` if it
    /// equals `compare`; returns the value found.
    fn compare_swap(&mut self, addr: u64, compare: u64, swap: u64) -> Result<u64, MemoryError>;

    /// Atomically adds `add` (wrapping) to the little-endian u64 at `addr`;
    /// returns the value found.
    fn fetch_add(&mut self, addr: u64, add: u64) -> Result<u64, MemoryError>;

    /// Whether the `len` bytes at `addr` may be lent to a gather send: the
    /// engine then names them by address ([`crate::Engine::gathered`]) and
    /// the fabric reads them in place when it sends, through its own,
    /// volatile view of the memory (never a Rust reference to memory
    /// another party can write). False (the default) makes the engine copy
    /// them into the packet with [`Memory::read`].
    fn lends(&self, addr: u64, len: usize) -> bool {
        let _ = (addr, len);
        false
    }

    /// Copies `len` bytes, from `at` on, of the payload lent with the
    /// packet being handled ([`crate::Engine::handle_lent_packet`]) to
    /// `addr`: the one copy of a same-host payload, from its sender's
    /// memory. Memory that was given no such payload holds none (the
    /// default).
    fn write_lent(&mut self, addr: u64, at: usize, len: usize) -> Result<(), MemoryError> {
        let _ = at;
        Err(MemoryError {
            addr,
            len: len as u64,
        })
    }
}

/// A memory while it handles a packet whose payload was lent on
/// ([`crate::Engine::handle_lent_packet`]): everything goes to `mem`, and
/// [`Memory::write_lent`] to `copy`, which knows where the payload is (the
/// sender's memory, for a device; a buffer, for a test network).
#[allow(missing_debug_implementations)] // `copy` is a closure.
pub struct WithLent<'a, M, F> {
    pub mem: &'a mut M,
    pub copy: F,
}

impl<M, F> Memory for WithLent<'_, M, F>
where
    M: Memory,
    F: FnMut(&mut M, u64, usize, usize) -> Result<(), MemoryError>,
{
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        self.mem.read(addr, buf)
    }

    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemoryError> {
        self.mem.write(addr, data)
    }

    fn compare_swap(&mut self, addr: u64, compare: u64, swap: u64) -> Result<u64, MemoryError> {
        self.mem.compare_swap(addr, compare, swap)
    }

    fn fetch_add(&mut self, addr: u64, add: u64) -> Result<u64, MemoryError> {
        self.mem.fetch_add(addr, add)
    }

    fn lends(&self, addr: u64, len: usize) -> bool {
        self.mem.lends(addr, len)
    }

    fn write_lent(&mut self, addr: u64, at: usize, len: usize) -> Result<(), MemoryError> {
        (self.copy)(self.mem, addr, at, len)
    }
}

/// A received packet's payload: its bytes, or `len` bytes lent with it and
/// still in the sender's memory ([`Memory::write_lent`]), from `at` on.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Payload<'a> {
    Bytes(&'a [u8]),
    Lent { at: usize, len: usize },
}

impl<'a> Payload<'a> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Payload::Bytes(b) => b.len(),
            Payload::Lent { len, .. } => *len,
        }
    }

    /// The `n` bytes from `from` on (within the payload: the callers walk
    /// it in order).
    pub(crate) fn part(&self, from: usize, n: usize) -> Payload<'a> {
        match *self {
            Payload::Bytes(b) => Payload::Bytes(&b[from..from + n]),
            Payload::Lent { at, .. } => Payload::Lent {
                at: at + from,
                len: n,
            },
        }
    }
}

/// Memory backed by a vector, mapped at `base`: for tests and tools.
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct VecMemory {
    base: u64,
    bytes: Vec<u8>,
}

impl VecMemory {
    /// `len` zero bytes at addresses `base..base + len`.
    pub fn new(base: u64, len: usize) -> Self {
        VecMemory {
            base,
            bytes: vec![0; len],
        }
    }

    /// The bytes, from `base` on.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The bytes, mutably.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }

    fn range(&self, addr: u64, len: usize) -> Result<core::ops::Range<usize>, MemoryError> {
        let err = MemoryError {
            addr,
            len: len as u64,
        };
        let start = addr.checked_sub(self.base).ok_or(err)?;
        let start = usize::try_from(start).map_err(|_| err)?;
        let end = start.checked_add(len).ok_or(err)?;
        if end > self.bytes.len() {
            return Err(err);
        }
        Ok(start..end)
    }

    fn word(&mut self, addr: u64) -> Result<&mut [u8], MemoryError> {
        let r = self.range(addr, 8)?;
        Ok(&mut self.bytes[r])
    }
}

impl Memory for VecMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        let r = self.range(addr, buf.len())?;
        buf.copy_from_slice(&self.bytes[r]);
        Ok(())
    }

    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemoryError> {
        let r = self.range(addr, data.len())?;
        self.bytes[r].copy_from_slice(data);
        Ok(())
    }

    fn compare_swap(&mut self, addr: u64, compare: u64, swap: u64) -> Result<u64, MemoryError> {
        let w = self.word(addr)?;
        let old = u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
        if old == compare {
            w.copy_from_slice(&swap.to_le_bytes());
        }
        Ok(old)
    }

    fn fetch_add(&mut self, addr: u64, add: u64) -> Result<u64, MemoryError> {
        let w = self.word(addr)?;
        let old = u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
        w.copy_from_slice(&old.wrapping_add(add).to_le_bytes());
        Ok(old)
    }

    /// A vector's bytes are lent wherever they exist (the test network
    /// reads them with [`Memory::read`]).
    fn lends(&self, addr: u64, len: usize) -> bool {
        self.range(addr, len).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_enforced_without_overflow() {
        let mut m = VecMemory::new(0x1000, 16);
        assert!(m.write(0x1000, &[1; 16]).is_ok());
        assert_eq!(
            m.write(0x1008, &[1; 9]),
            Err(MemoryError {
                addr: 0x1008,
                len: 9
            })
        );
        assert!(m.read(0xfff, &mut [0; 1]).is_err());
        assert!(m.read(u64::MAX, &mut [0; 2]).is_err());
        assert!(m.fetch_add(0x100c, 1).is_err());
    }

    #[test]
    fn atomics_are_little_endian() {
        let mut m = VecMemory::new(0, 16);
        assert_eq!(m.fetch_add(8, 5), Ok(0));
        assert_eq!(m.bytes()[8], 5);
        assert_eq!(m.compare_swap(8, 4, 9), Ok(5), "no swap on mismatch");
        assert_eq!(m.compare_swap(8, 5, 9), Ok(5));
        assert_eq!(m.fetch_add(8, u64::MAX), Ok(9), "wraps");
        assert_eq!(m.bytes()[8], 8);
    }
}
