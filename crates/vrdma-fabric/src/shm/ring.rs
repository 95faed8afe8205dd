//! A packet ring between two processes: a sealed memfd the consumer made,
//! mapped by both, one producer and one consumer. It carries a daemon's
//! packets to a device of another daemon on the same host.
//!
//! Neither side trusts the other with anything: the memory is reached
//! only through vm-memory's volatile slices (the other process may write
//! any byte at any time); an index read from it is checked against the
//! ring's size before it is used, and a record is copied out whole before
//! a byte of it is looked at. A consumer that finds the producer's index
//! out of range, or a record longer than a slot, marks the ring broken and
//! reads nothing more from it; a producer that finds the consumer's index
//! out of range does the same. The memfd is sealed against shrinking and
//! growing, and a side checks the seals before it maps the other's file,
//! so that neither can make the other fault on a truncated mapping.
//!
//! Layout: a page of indices — the producer's count at 0, the consumer's
//! at 64, the consumer's `armed` word at 128, each on a cache line of its
//! own — then `slots` slots of [`SLOT`] bytes, each a record header
//! ([`HEADER`] bytes: length, the route) and the packet.

use std::{
    fs::File,
    io,
    os::fd::{AsFd, OwnedFd},
    sync::atomic::Ordering,
};

use nix::{
    fcntl::{FcntlArg, SealFlag, fcntl},
    sys::memfd::{MFdFlags, memfd_create},
    unistd::ftruncate,
};
use vm_memory::{Bytes, FileOffset, MmapRegion, VolatileMemory, VolatileSlice};
use vrdma_wire::{Gid, frame::Route, packet};

use crate::{Lender, Piece};

/// Offsets of the index page's words.
const PRODUCED: usize = 0;
const CONSUMED: usize = 64;
const ARMED: usize = 128;
/// The index page.
const INDEX_PAGE: usize = 4096;

/// A record's header: the packet's length (u32), source and destination
/// GIDs, traffic class, hop limit, two bytes of padding, flow label.
pub const HEADER: usize = 4 + 16 + 16 + 1 + 1 + 2 + 4;
/// A slot: a header and the largest packet, rounded up to a cache line.
pub const SLOT: usize = (HEADER + packet::MAX_LEN).div_ceil(64) * 64;

/// Slots a ring has at most (the ring's memory: about 4 KiB each).
pub const MAX_SLOTS: u32 = 1 << 14;

/// Seals a ring's file must carry before a side maps it.
fn seals() -> SealFlag {
    SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL
}

/// The bytes of a ring of `slots` slots.
pub fn ring_len(slots: u32) -> usize {
    INDEX_PAGE + slots as usize * SLOT
}

/// [`ring_len`] as a file offset (at most 4 KiB + 2^14 slots: it fits).
fn ring_len_off(slots: u32) -> i64 {
    i64::try_from(ring_len(slots)).unwrap_or(i64::MAX)
}

/// Why a ring cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    #[error("a ring of {0} slots (1 to {MAX_SLOTS}, a power of two)")]
    Slots(u32),
    #[error("the ring's file is not sealed against resizing")]
    Unsealed,
    #[error("the ring's file holds {have} bytes, {want} expected")]
    Size { have: u64, want: u64 },
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error("mapping the ring: {0}")]
    Map(String),
}

/// A ring's memory, mapped.
#[derive(Debug)]
struct Mapping {
    region: MmapRegion<()>,
    slots: u32,
}

impl Mapping {
    fn map(file: File, slots: u32) -> Result<Self, RingError> {
        if slots == 0 || slots > MAX_SLOTS || !slots.is_power_of_two() {
            return Err(RingError::Slots(slots));
        }
        let have = file.metadata()?.len();
        let want = ring_len(slots) as u64;
        if have != want {
            return Err(RingError::Size { have, want });
        }
        let region = MmapRegion::<()>::from_file(FileOffset::new(file, 0), want as usize)
            .map_err(|e| RingError::Map(e.to_string()))?;
        Ok(Mapping { region, slots })
    }

    /// The whole ring, as the other process shares it.
    fn mem(&self) -> VolatileSlice<'_> {
        self.region.as_volatile_slice()
    }

    fn load(&self, at: usize, order: Ordering) -> u64 {
        // In bounds by construction (the index page is mapped).
        self.mem().load::<u64>(at, order).unwrap_or(0)
    }

    fn store(&self, at: usize, v: u64, order: Ordering) {
        let _ = self.mem().store(v, at, order);
    }

    fn slot(&self, index: u64) -> usize {
        INDEX_PAGE + (index % u64::from(self.slots)) as usize * SLOT
    }
}

/// Makes a ring of `slots` slots: its memfd (sealed) and the consumer's
/// end of it. The file is what the producer is given.
pub fn create(slots: u32, name: &str) -> Result<(Consumer, OwnedFd), RingError> {
    if slots == 0 || slots > MAX_SLOTS || !slots.is_power_of_two() {
        return Err(RingError::Slots(slots));
    }
    let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
        .map_err(io::Error::from)?;
    ftruncate(&fd, ring_len_off(slots)).map_err(io::Error::from)?;
    fcntl(&fd, FcntlArg::F_ADD_SEALS(seals())).map_err(io::Error::from)?;
    let file = File::from(fd.try_clone()?);
    let map = Mapping::map(file, slots)?;
    Ok((
        Consumer {
            map,
            consumed: 0,
            broken: false,
        },
        fd,
    ))
}

/// The producer's end of a ring another process made: refused unless the
/// file is sealed against resizing and holds exactly a ring of `slots`.
pub fn open(fd: OwnedFd, slots: u32) -> Result<Producer, RingError> {
    let sealed = fcntl(fd.as_fd(), FcntlArg::F_GET_SEALS)
        .map_err(io::Error::from)
        .map(SealFlag::from_bits_truncate)?;
    if !sealed.contains(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW) {
        return Err(RingError::Unsealed);
    }
    let map = Mapping::map(File::from(fd), slots)?;
    let produced = map.load(PRODUCED, Ordering::Acquire);
    Ok(Producer {
        map,
        produced,
        broken: false,
    })
}

/// Why a packet did not go into a ring.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum PushError {
    /// Every slot holds a packet the consumer has not taken.
    Full,
    /// The consumer's index is out of range: the ring is not used again.
    Broken,
    /// A lent piece of the payload is no longer in the sender's memory.
    Unlent,
}

/// The producer's end: packets written into slots, then the count moved.
#[derive(Debug)]
pub struct Producer {
    map: Mapping,
    /// Packets written (the shared count is written from this, never read
    /// back: the consumer may scribble on it).
    produced: u64,
    broken: bool,
}

impl Producer {
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Writes one packet (not yet visible: [`Producer::publish`]).
    pub fn push(&mut self, route: &Route, packet: &[u8]) -> Result<(), PushError> {
        self.push_gather(route, packet, packet.len(), &[], &crate::NoLender)
            .map(|_| ())
    }

    /// Writes one packet whose payload is lent, as `shm::Port::send` takes
    /// it: `head`'s bytes before `payload_at`, the pieces read from `mem`
    /// straight into the slot (volatile to volatile: the payload's one copy
    /// on this side), `head`'s rest. Returns the packet's length.
    pub fn push_gather(
        &mut self,
        route: &Route,
        head: &[u8],
        payload_at: usize,
        lent: &[Piece],
        mem: &impl Lender,
    ) -> Result<usize, PushError> {
        if self.broken {
            return Err(PushError::Broken);
        }
        let len = head.len() + lent.iter().map(|p| p.len).sum::<usize>();
        let (Some(before), Some(after)) = (head.get(..payload_at), head.get(payload_at..)) else {
            return Err(PushError::Unlent);
        };
        if len > packet::MAX_LEN {
            return Err(PushError::Unlent);
        }
        let consumed = self.map.load(CONSUMED, Ordering::Acquire);
        let outstanding = self.produced.wrapping_sub(consumed);
        if outstanding > u64::from(self.map.slots) {
            self.broken = true;
            return Err(PushError::Broken);
        }
        if outstanding == u64::from(self.map.slots) {
            return Err(PushError::Full);
        }
        let at = self.map.slot(self.produced);
        let mut rec = [0u8; HEADER];
        rec[0..4].copy_from_slice(&(len as u32).to_le_bytes());
        rec[4..20].copy_from_slice(&route.src.0);
        rec[20..36].copy_from_slice(&route.dst.0);
        rec[36] = route.traffic_class;
        rec[37] = route.hop_limit;
        rec[40..44].copy_from_slice(&route.flow_label.to_le_bytes());
        let r = self.map.mem();
        let Ok(slot) = r.get_slice(at, SLOT) else {
            self.broken = true;
            return Err(PushError::Broken);
        };
        // In bounds: the slot holds a header and the largest packet.
        let _ = slot.write_slice(&rec, 0);
        let _ = slot.write_slice(before, HEADER);
        let mut off = HEADER + before.len();
        for p in lent {
            let copied = mem
                .lend(p.addr, p.len)
                .zip(slot.get_slice(off, p.len).ok())
                .map(|(src, dst)| src.copy_to_volatile_slice(dst));
            if copied.is_none() {
                return Err(PushError::Unlent);
            }
            off += p.len;
        }
        let _ = slot.write_slice(after, off);
        self.produced = self.produced.wrapping_add(1);
        Ok(len)
    }

    /// Makes the packets written visible; whether the consumer asked to be
    /// woken (it sleeps, or is about to).
    pub fn publish(&mut self) -> bool {
        self.map.store(PRODUCED, self.produced, Ordering::SeqCst);
        self.map.load(ARMED, Ordering::SeqCst) != 0
    }
}

/// A record taken from a ring: its route and its packet's length (the
/// bytes are in the caller's buffer).
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Record {
    pub route: Route,
    pub len: usize,
}

/// Why nothing was taken.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum PopError {
    Empty,
    /// The producer's index or a record is out of range: the ring is not
    /// read again.
    Broken,
}

/// The consumer's end.
#[derive(Debug)]
pub struct Consumer {
    map: Mapping,
    consumed: u64,
    broken: bool,
}

impl Consumer {
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Packets waiting (0 for a broken ring).
    pub fn pending(&self) -> u64 {
        if self.broken {
            return 0;
        }
        let produced = self.map.load(PRODUCED, Ordering::Acquire);
        let n = produced.wrapping_sub(self.consumed);
        // A count past the ring's size is the producer's lie: it is found
        // (and the ring broken) by the next pop.
        n.min(u64::from(self.map.slots) + 1)
    }

    /// Copies the next packet into `buf` (at least [`packet::MAX_LEN`]
    /// bytes) and returns its record; the slot is freed by
    /// [`Consumer::release`].
    pub fn pop(&mut self, buf: &mut [u8]) -> Result<Record, PopError> {
        if self.broken {
            return Err(PopError::Broken);
        }
        let produced = self.map.load(PRODUCED, Ordering::Acquire);
        let n = produced.wrapping_sub(self.consumed);
        if n == 0 {
            return Err(PopError::Empty);
        }
        if n > u64::from(self.map.slots) {
            self.broken = true;
            return Err(PopError::Broken);
        }
        let at = self.map.slot(self.consumed);
        let mut head = [0u8; HEADER];
        let r = self.map.mem();
        if r.read_slice(&mut head, at).is_err() {
            self.broken = true;
            return Err(PopError::Broken);
        }
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        if len > packet::MAX_LEN || len > buf.len() {
            self.broken = true;
            return Err(PopError::Broken);
        }
        if r.read_slice(&mut buf[..len], at + HEADER).is_err() {
            self.broken = true;
            return Err(PopError::Broken);
        }
        let gid = |b: &[u8]| {
            let mut g = [0u8; 16];
            g.copy_from_slice(b);
            Gid(g)
        };
        let route = Route {
            src: gid(&head[4..20]),
            dst: gid(&head[20..36]),
            traffic_class: head[36],
            hop_limit: head[37],
            flow_label: u32::from_le_bytes([head[40], head[41], head[42], head[43]]) & 0xf_ffff,
        };
        self.consumed = self.consumed.wrapping_add(1);
        Ok(Record { route, len })
    }

    /// Gives the slots taken back to the producer.
    pub fn release(&mut self) {
        self.map.store(CONSUMED, self.consumed, Ordering::Release);
    }

    /// Asks the producer to wake the consumer for the next packet (it is
    /// about to sleep); whether packets already wait (then it must not).
    pub fn arm(&self) -> bool {
        self.map.store(ARMED, 1, Ordering::SeqCst);
        self.pending() > 0
    }

    /// The consumer is awake: the producer may spare the wake-ups.
    pub fn disarm(&self) {
        self.map.store(ARMED, 0, Ordering::Relaxed);
    }

    /// The same file mapped as a producer (tests: both ends in one
    /// process).
    #[cfg(test)]
    fn producer_for_test(fd: OwnedFd, slots: u32) -> Producer {
        open(fd, slots).expect("a ring of our own")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn route(n: u8) -> Route {
        Route {
            src: Ipv4Addr::new(127, 0, 0, n).into(),
            dst: Ipv4Addr::new(127, 0, 0, 100).into(),
            traffic_class: n,
            hop_limit: 64,
            flow_label: 0x12345,
        }
    }

    /// A view of the ring's file as the other process has it: writes
    /// anything anywhere.
    fn scribbler(fd: &OwnedFd, slots: u32) -> Mapping {
        let f = File::from(fd.try_clone().unwrap());
        Mapping::map(f, slots).unwrap()
    }

    #[test]
    fn packets_go_through_in_order_and_the_ring_fills() {
        let (mut c, fd) = create(4, "test").unwrap();
        let mut p = Consumer::producer_for_test(fd, 4);
        let mut buf = vec![0u8; packet::MAX_LEN];
        assert_eq!(c.pop(&mut buf), Err(PopError::Empty));
        for round in 0..3u8 {
            for i in 0..4u8 {
                p.push(&route(i), &[i + round; 100]).unwrap();
            }
            assert_eq!(p.push(&route(9), &[0; 10]), Err(PushError::Full));
            assert_eq!(c.pending(), 0, "not visible before publish");
            assert!(!p.publish(), "nobody armed");
            assert_eq!(c.pending(), 4);
            for i in 0..4u8 {
                let r = c.pop(&mut buf).unwrap();
                assert_eq!(
                    r,
                    Record {
                        route: route(i),
                        len: 100
                    }
                );
                assert_eq!(&buf[..100], &[i + round; 100]);
            }
            assert_eq!(
                p.push(&route(9), &[0; 10]),
                Err(PushError::Full),
                "not released"
            );
            c.release();
        }
        assert!(!c.arm());
        p.push(&route(1), &[1; 1]).unwrap();
        assert!(p.publish(), "armed: wake it");
        c.disarm();
        assert!(c.arm(), "a packet waits");
    }

    #[test]
    fn a_lying_producer_breaks_its_ring_and_nothing_else() {
        let (mut c, fd) = create(8, "test").unwrap();
        let w = scribbler(&fd, 8);
        let mut buf = vec![0u8; packet::MAX_LEN];
        // A count from nowhere.
        w.store(PRODUCED, 1u64 << 40, Ordering::SeqCst);
        assert_eq!(c.pop(&mut buf), Err(PopError::Broken));
        assert!(c.is_broken());
        assert_eq!(c.pending(), 0);
        // A record longer than a slot.
        let (mut c, fd) = create(8, "test").unwrap();
        let w = scribbler(&fd, 8);
        w.mem()
            .write_slice(&u32::MAX.to_le_bytes(), INDEX_PAGE)
            .unwrap();
        w.store(PRODUCED, 1, Ordering::SeqCst);
        assert_eq!(c.pop(&mut buf), Err(PopError::Broken));
        // Every count within the ring is a slot of it, whatever it holds.
        let (mut c, fd) = create(8, "test").unwrap();
        let w = scribbler(&fd, 8);
        for i in 0..8usize {
            w.mem()
                .write_slice(&[0xff; 64], INDEX_PAGE + i * SLOT + 4)
                .unwrap();
            w.mem()
                .write_slice(&60u32.to_le_bytes(), INDEX_PAGE + i * SLOT)
                .unwrap();
        }
        w.store(PRODUCED, 8, Ordering::SeqCst);
        for _ in 0..8 {
            assert_eq!(c.pop(&mut buf).unwrap().len, 60);
        }
        assert_eq!(c.pop(&mut buf), Err(PopError::Empty));
    }

    #[test]
    fn a_lying_consumer_breaks_its_ring() {
        let (_c, fd) = create(8, "test").unwrap();
        let w = scribbler(&fd, 8);
        let mut p = Consumer::producer_for_test(fd, 8);
        p.push(&route(1), &[1; 10]).unwrap();
        p.publish();
        // The consumer claims to have taken packets never produced.
        w.store(CONSUMED, 5, Ordering::SeqCst);
        assert_eq!(p.push(&route(1), &[1; 10]), Err(PushError::Broken));
        assert!(p.is_broken());
    }

    #[test]
    fn a_file_not_sealed_or_of_another_size_is_refused() {
        let fd = memfd_create("x", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING).unwrap();
        ftruncate(&fd, ring_len_off(8)).unwrap();
        assert!(matches!(
            open(fd.try_clone().unwrap(), 8),
            Err(RingError::Unsealed)
        ));
        fcntl(&fd, FcntlArg::F_ADD_SEALS(seals())).unwrap();
        assert!(matches!(
            open(fd.try_clone().unwrap(), 16),
            Err(RingError::Size { .. })
        ));
        assert!(matches!(
            open(fd.try_clone().unwrap(), 3),
            Err(RingError::Slots(3))
        ));
        assert!(open(fd, 8).is_ok());
        // Sealed: the file cannot be cut under a mapping.
        let (_c, fd) = create(8, "test").unwrap();
        assert!(ftruncate(&fd, 4096).is_err());
    }
}
