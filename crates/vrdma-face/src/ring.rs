//! Rings in guest memory, and the device's cursors over them.
//!
//! A ring is `count` entries of `stride` bytes laid over a page list, and
//! two 32-bit index words — the producer's and the consumer's — somewhere
//! in guest memory ([`GuestRing`]). How an index names a slot, when one is
//! valid and how many entries lie between two is the index scheme
//! ([`Indices`]): PVRDMA's indices carry a wrap bit ([`WrapBit`]),
//! virtio-rdma's are free-running counters ([`FreeRunning`]).
//!
//! The device consumes the rings a guest posts work into ([`Consumer`]):
//! it reads the producer index the guest wrote, checks it, copies each new
//! entry into the daemon — once: a guest that rewrites an entry after its
//! doorbell changes nothing the device took — hands the copy to a
//! [`Decoder`], and gives the slots back (publishes its consumer index) as
//! soon as their entries are copied. And it produces into the rings a
//! guest polls ([`Producer`]): an entry goes in only where the guest's
//! consumer index left room, then the producer index follows.
//!
//! Indices come from guest memory and are checked before any use; a ring
//! whose indices are impossible or whose memory is gone is broken, and
//! says so once.

use std::sync::atomic::{Ordering, fence};

use vm_memory::GuestMemory;
use zerocopy::{Immutable, IntoBytes};

use crate::{
    guest::{self, GuestError},
    pages::{PAGE_SIZE, PageList},
};

/// An index scheme: how the 32-bit indices of a ring of
/// [`count`](Indices::count) slots name slots and count entries.
pub trait Indices: Copy + std::fmt::Debug {
    /// The slots the ring's memory holds.
    fn count(&self) -> u32;
    /// Entries that may be outstanding at once.
    fn capacity(&self) -> u32;
    /// Whether `idx`, read from the guest, is an index this scheme can
    /// hold (how far it may be from the other index is
    /// [`used`](Indices::used)'s to say).
    fn valid(&self, idx: u32) -> bool;
    /// The slot of (valid) index `idx`, below [`count`](Indices::count).
    fn slot(&self, idx: u32) -> u32;
    /// The index after `idx`.
    fn next(&self, idx: u32) -> u32;
    /// Entries from consumer index `cons` to producer index `prod` (both
    /// valid); more than [`capacity`](Indices::capacity) when the two
    /// cannot belong together.
    fn used(&self, prod: u32, cons: u32) -> u32;
}

/// PVRDMA's indices (`pvrdma_ring.h`, bit for bit): an index carries one
/// wrap bit above the slot; the slot is `index & (count − 1)`; the next
/// index is `(index + 1) & (2·count − 1)`. For a power of two this is the
/// usual ring. For sizes that are not (PVRDMA's async-event and
/// CQ-notification rings, 1536 and 3072 entries), the same bit operations
/// cycle through only the lowest set bit's worth of slots (512 and 1024)
/// with a period of twice that: the device writes exactly where the
/// driver will read, and keeps to that capacity itself.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct WrapBit {
    count: u32,
}

impl WrapBit {
    /// The indices of a ring of `count` entries, 1 to 2^30.
    pub fn new(count: u32) -> Option<Self> {
        (count > 0 && count <= 1 << 30).then_some(WrapBit { count })
    }

    /// The number of distinct indices: twice the capacity.
    fn period(&self) -> u32 {
        self.capacity() * 2
    }

    /// (2·count − 1), as the driver computes it, in 32 bits.
    fn mask2(&self) -> u32 {
        self.count.wrapping_mul(2).wrapping_sub(1)
    }
}

impl Indices for WrapBit {
    fn count(&self) -> u32 {
        self.count
    }

    fn capacity(&self) -> u32 {
        1 << self.count.trailing_zeros()
    }

    /// An index the driver accepts (no bit above `2·count − 1`) and this
    /// ring can reach.
    fn valid(&self, idx: u32) -> bool {
        idx & !self.mask2() == 0 && idx < self.period()
    }

    fn slot(&self, idx: u32) -> u32 {
        idx & (self.count - 1)
    }

    /// For a power of two, the driver's `(idx + 1) & (2·count − 1)`.
    fn next(&self, idx: u32) -> u32 {
        idx.wrapping_add(1) & (self.period() - 1)
    }

    fn used(&self, prod: u32, cons: u32) -> u32 {
        prod.wrapping_sub(cons) & (self.period() - 1)
    }
}

/// Free-running indices (virtio-rdma's, as a virtqueue's): 32-bit
/// counters that wrap at 2^32 over a power-of-two number of entries `n`;
/// the slot is `index & (n − 1)`. Any word is an index; a producer and a
/// consumer belong together only when the producer is at most `n` ahead.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct FreeRunning {
    n: u32,
}

impl FreeRunning {
    /// The indices of a ring of `n` entries, a power of two up to 2^31.
    pub fn new(n: u32) -> Option<Self> {
        n.is_power_of_two().then_some(FreeRunning { n })
    }
}

impl Indices for FreeRunning {
    fn count(&self) -> u32 {
        self.n
    }

    fn capacity(&self) -> u32 {
        self.n
    }

    fn valid(&self, _idx: u32) -> bool {
        true
    }

    fn slot(&self, idx: u32) -> u32 {
        idx & (self.n - 1)
    }

    fn next(&self, idx: u32) -> u32 {
        idx.wrapping_add(1)
    }

    fn used(&self, prod: u32, cons: u32) -> u32 {
        prod.wrapping_sub(cons)
    }
}

/// Where a ring lives in guest memory: its two index words, and its
/// entries, `stride` bytes each over a page list.
#[derive(Clone, Debug)]
pub struct GuestRing<I> {
    indices: I,
    /// Guest addresses of the producer's and the consumer's index.
    prod_at: u64,
    cons_at: u64,
    entries: PageList,
    stride: u64,
}

impl<I: Indices> GuestRing<I> {
    /// A ring with `indices`, its entries `stride` bytes apart over
    /// `entries`, its producer index at `prod_at` and its consumer index
    /// at `cons_at`. `None` if the pages cannot hold it or an entry would
    /// cross a page.
    pub fn new(
        indices: I,
        stride: u64,
        prod_at: u64,
        cons_at: u64,
        entries: PageList,
    ) -> Option<Self> {
        if stride == 0 || !PAGE_SIZE.is_multiple_of(stride) {
            return None;
        }
        if u64::from(indices.count()) * stride > entries.len() as u64 * PAGE_SIZE {
            return None;
        }
        Some(GuestRing {
            indices,
            prod_at,
            cons_at,
            entries,
            stride,
        })
    }

    pub fn indices(&self) -> I {
        self.indices
    }

    pub fn stride(&self) -> u64 {
        self.stride
    }

    /// The producer index, checked.
    pub fn prod(&self, mem: &(impl GuestMemory + ?Sized)) -> Result<u32, GuestError> {
        self.index(mem, self.prod_at)
    }

    /// The consumer index, checked.
    pub fn cons(&self, mem: &(impl GuestMemory + ?Sized)) -> Result<u32, GuestError> {
        self.index(mem, self.cons_at)
    }

    fn index(&self, mem: &(impl GuestMemory + ?Sized), at: u64) -> Result<u32, GuestError> {
        let v = guest::read_u32(mem, at)?;
        if !self.indices.valid(v) {
            return Err(GuestError::BadIndex(v));
        }
        Ok(v)
    }

    /// Publishes producer index `v`, after the entries it covers.
    pub fn set_prod(&self, mem: &(impl GuestMemory + ?Sized), v: u32) -> Result<(), GuestError> {
        // The entry before the index: the consumer reads the index, then
        // the entry.
        fence(Ordering::Release);
        guest::write_u32(mem, self.prod_at, v)
    }

    /// Publishes consumer index `v`, after the entries it gives back were
    /// copied.
    pub fn set_cons(&self, mem: &(impl GuestMemory + ?Sized), v: u32) -> Result<(), GuestError> {
        fence(Ordering::Release);
        guest::write_u32(mem, self.cons_at, v)
    }

    /// The guest address of the entry at (valid) index `idx`.
    pub fn entry_addr(&self, idx: u32) -> u64 {
        let off = u64::from(self.indices.slot(idx)) * self.stride;
        // Inside the pages: checked at construction.
        self.entries.addr(off).unwrap_or(u64::MAX)
    }

    /// Copies the entry at `idx` into `buf` (at most a stride).
    pub fn read_entry(
        &self,
        mem: &(impl GuestMemory + ?Sized),
        idx: u32,
        buf: &mut [u8],
    ) -> Result<(), GuestError> {
        if buf.len() as u64 > self.stride {
            return Err(GuestError::Oversized(buf.len() as u64));
        }
        guest::read_into(mem, self.entry_addr(idx), buf)
    }

    /// Writes `entry` (at most a stride) at `idx`.
    pub fn write_entry<T: IntoBytes + Immutable + ?Sized>(
        &self,
        mem: &(impl GuestMemory + ?Sized),
        idx: u32,
        entry: &T,
    ) -> Result<(), GuestError> {
        let len = entry.as_bytes().len() as u64;
        if len > self.stride {
            // Into the next slot, or past the page: never.
            return Err(GuestError::Oversized(len));
        }
        guest::write(mem, self.entry_addr(idx), entry)
    }
}

/// What a [`Consumer`] hands each entry to: a face's decoding of its
/// ABI's entries, and what the device does with them.
pub trait Decoder {
    /// Whether the device takes one more entry now (its queue has room for
    /// it, the turn's budget is not spent). Asked before each entry is
    /// copied: an entry left in the ring is taken on a later turn.
    fn room(&mut self) -> bool;
    /// One entry, copied out of the ring (`stride` bytes).
    fn decode(&mut self, entry: &[u8]) -> Decoded;
}

/// What became of an entry a [`Decoder`] was given.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Decoded {
    /// Taken as the guest meant it.
    Taken,
    /// It could not be decoded: taken all the same (its slot is given
    /// back), and counted.
    Malformed,
}

/// What a turn of taking from a ring did.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
#[must_use = "work taken must be accounted"]
pub struct Taken {
    /// Entries copied out of the ring.
    pub entries: u32,
    /// Of those, entries that could not be decoded.
    pub malformed: u32,
    /// The ring broke in this turn (an impossible index, memory gone):
    /// reported once; nothing more is taken from it until it is reset.
    pub broken: bool,
}

impl Taken {
    /// This turn and `other` together.
    pub fn and(self, other: Taken) -> Taken {
        Taken {
            entries: self.entries + other.entries,
            malformed: self.malformed + other.malformed,
            broken: self.broken || other.broken,
        }
    }
}

/// The device's cursor over a ring the guest produces into (a send,
/// receive or shared receive queue): the next entry to take, and the
/// consumer index last given back to the guest.
#[derive(Clone, Debug)]
pub struct Consumer<I> {
    ring: GuestRing<I>,
    /// The index of the next entry to take.
    next: u32,
    /// The consumer index last written to the guest.
    cons: u32,
    /// The guest broke the ring: nothing more is taken from it until
    /// [`Consumer::reset`], so the break is reported once, not on every
    /// doorbell or round.
    broken: bool,
}

impl<I: Indices> Consumer<I> {
    /// A cursor at index 0 (a new ring).
    pub fn new(ring: GuestRing<I>) -> Self {
        Consumer {
            ring,
            next: 0,
            cons: 0,
            broken: false,
        }
    }

    pub fn ring(&self) -> &GuestRing<I> {
        &self.ring
    }

    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Back to index 0, whole again (the guest zeroed the ring: a QP back
    /// in RESET).
    pub fn reset(&mut self) {
        self.next = 0;
        self.cons = 0;
        self.broken = false;
    }

    /// Takes the entries the guest produced, as far as `decoder` has
    /// room: each is copied out of the ring once and handed to the
    /// decoder, and the slots taken are given back at once (the consumer
    /// index published). Not later, when the work is done: a guest posts
    /// into a slot as soon as its ring has room, and a one-slot ring would
    /// find none between the completion it just polled and an index
    /// published a moment after. The decoder takes only as much as its
    /// queue holds, so a guest has at most a ring of entries waiting
    /// beside those in flight.
    pub fn take<M, D>(&mut self, mem: &M, decoder: &mut D) -> Taken
    where
        M: GuestMemory + ?Sized,
        D: Decoder + ?Sized,
    {
        let mut t = Taken::default();
        if self.broken {
            return t;
        }
        let i = self.ring.indices;
        let prod = match self.ring.prod(mem) {
            // The guest produces only into slots the device gave back: it
            // is never more than a ring ahead of the consumer index last
            // published. A producer further on would have the device take
            // slots again that it has not given back.
            Ok(p) if i.used(p, self.cons) <= i.capacity() => p,
            _ => {
                self.break_ring(&mut t);
                return t;
            }
        };
        // The entries after the index: the guest wrote them before it
        // published the producer (its release pairs with this acquire).
        fence(Ordering::Acquire);
        if self.next != prod {
            let mut entry = vec![0u8; self.ring.stride as usize];
            // At most a ring's worth: the entries between the consumer
            // index and the producer's.
            while self.next != prod && t.entries < i.capacity() {
                if !decoder.room() {
                    break;
                }
                if self.ring.read_entry(mem, self.next, &mut entry).is_err() {
                    self.break_ring(&mut t);
                    break;
                }
                self.next = i.next(self.next);
                t.entries += 1;
                if decoder.decode(&entry) == Decoded::Malformed {
                    t.malformed += 1;
                }
            }
        }
        self.publish(mem);
        t
    }

    /// Breaks the ring for what its entries said (a malformed entry
    /// whose queue cannot go on): nothing more is taken from it until it
    /// is reset. Whether it was whole until now.
    pub fn fail(&mut self) -> bool {
        !std::mem::replace(&mut self.broken, true)
    }

    /// The ring is broken: says so once.
    fn break_ring(&mut self, t: &mut Taken) {
        t.broken = !self.broken;
        self.broken = true;
    }

    /// Gives back the slots taken: the consumer index the guest reads
    /// moves to the next entry to take (again, if writing it failed
    /// before).
    pub fn publish<M: GuestMemory + ?Sized>(&mut self, mem: &M) {
        if self.next != self.cons && self.ring.set_cons(mem, self.next).is_ok() {
            self.cons = self.next;
        }
    }

    /// Whether the guest produced entries the device has not taken (never
    /// for a broken ring).
    pub fn pending<M: GuestMemory + ?Sized>(&self, mem: &M) -> bool {
        !self.broken && self.ring.prod(mem).is_ok_and(|p| p != self.next)
    }
}

/// The device's cursor over a ring it produces into and the guest
/// consumes (completions, events, notifications): the next entry it
/// writes.
#[derive(Clone, Debug)]
pub struct Producer<I> {
    ring: GuestRing<I>,
    /// The index of the next entry the device writes.
    tail: u32,
}

impl<I: Indices> Producer<I> {
    /// A cursor that writes its next entry at index `tail`.
    pub fn new(ring: GuestRing<I>, tail: u32) -> Self {
        Producer { ring, tail }
    }

    pub fn ring(&self) -> &GuestRing<I> {
        &self.ring
    }

    /// Writes `entry` at the producer's slot if the guest's consumer index
    /// (checked) leaves room, then publishes the producer index; false if
    /// there was no room or the ring's memory is gone (nothing published).
    pub fn push<M, T>(&mut self, mem: &M, entry: &T) -> bool
    where
        M: GuestMemory + ?Sized,
        T: IntoBytes + Immutable + ?Sized,
    {
        let i = self.ring.indices;
        let Ok(head) = self.ring.cons(mem) else {
            return false;
        };
        if i.used(self.tail, head) >= i.capacity() {
            return false;
        }
        // The slot is the guest's no more once its consumer index says so:
        // its last reads of it come before our write (its release, our
        // acquire).
        fence(Ordering::Acquire);
        if self.ring.write_entry(mem, self.tail, entry).is_err() {
            return false;
        }
        let next = i.next(self.tail);
        if self.ring.set_prod(mem, next).is_err() {
            return false;
        }
        self.tail = next;
        true
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    use super::*;

    const BASE: u64 = 0x10_0000;
    /// The index words' page, then entry pages.
    const PROD: u64 = BASE;
    const CONS: u64 = BASE + 4;

    fn mem() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(BASE), 0x10_000)]).unwrap()
    }

    /// Entries of 16 bytes on the page after the index words.
    fn ring<I: Indices>(indices: I) -> GuestRing<I> {
        GuestRing::new(
            indices,
            16,
            PROD,
            CONS,
            PageList::new(vec![BASE + 0x1000]).unwrap(),
        )
        .unwrap()
    }

    /// Takes entries into a list while it has room; an entry whose first
    /// byte is 0xff is malformed.
    #[derive(Debug, Default)]
    struct Take {
        room: usize,
        got: Vec<u64>,
    }

    impl Decoder for Take {
        fn room(&mut self) -> bool {
            self.got.len() < self.room
        }

        fn decode(&mut self, entry: &[u8]) -> Decoded {
            self.got
                .push(u64::from_le_bytes(entry[..8].try_into().unwrap()));
            if entry[0] == 0xff {
                Decoded::Malformed
            } else {
                Decoded::Taken
            }
        }
    }

    fn room(n: usize) -> Take {
        Take {
            room: n,
            got: Vec::new(),
        }
    }

    /// The guest posts `value` at index `idx` (and moves its producer).
    fn post<I: Indices>(m: &GuestMemoryMmap<()>, r: &GuestRing<I>, idx: u32, value: u64) {
        m.write_obj(value, GuestAddress(r.entry_addr(idx))).unwrap();
        m.write_obj(r.indices().next(idx), GuestAddress(PROD))
            .unwrap();
    }

    fn cons(m: &GuestMemoryMmap<()>) -> u32 {
        m.read_obj(GuestAddress(CONS)).unwrap()
    }

    #[test]
    fn the_wrap_bit_arithmetic_is_the_drivers_for_powers_of_two_and_the_device_rings() {
        let r = WrapBit::new(4).unwrap();
        assert!(r.valid(7) && !r.valid(8));
        assert_eq!(r.slot(5), 1);
        assert_eq!(r.next(7), 0);
        assert_eq!(r.used(1, 6), 3);
        assert_eq!(r.capacity(), 4);
        // PVRDMA's async ring: 3 pages of 8-byte events.
        let a = WrapBit::new(1536).unwrap();
        assert_eq!(a.capacity(), 512);
        let mut i = 0;
        let mut slots = BTreeSet::new();
        for _ in 0..5000 {
            assert!(a.valid(i));
            slots.insert(a.slot(i));
            i = a.next(i);
        }
        assert_eq!(slots.len(), 512, "only the first 512 slots are ever used");
        assert_eq!(*slots.last().unwrap(), 511);
        let c = WrapBit::new(3072).unwrap();
        assert_eq!(c.capacity(), 1024);
        // Across the wrap: 1024 written, head at 1024, tail back at 0.
        assert_eq!(c.used(0, 1024), 1024);
        assert_eq!(c.used(1024, 0), 1024);
        assert_eq!(c.next(2047), 0);
        assert!(!c.valid(2048) && !c.valid(4096));
        assert_eq!(WrapBit::new(0), None);
        assert_eq!(WrapBit::new((1 << 30) + 1), None);
    }

    #[test]
    fn free_running_indices_wrap_at_2_to_the_32() {
        let r = FreeRunning::new(8).unwrap();
        assert!(r.valid(u32::MAX));
        assert_eq!(r.next(u32::MAX), 0);
        assert_eq!(r.slot(u32::MAX), 7);
        assert_eq!(r.used(2, u32::MAX - 1), 4);
        assert_eq!(r.used(u32::MAX - 1, 2), u32::MAX - 3, "behind: wild");
        assert_eq!(FreeRunning::new(6), None);
        assert_eq!(FreeRunning::new(0), None);
    }

    #[test]
    fn a_ring_must_fit_its_pages_and_no_entry_crosses_a_page() {
        let one = || PageList::new(vec![0x1000]).unwrap();
        let w = |n| WrapBit::new(n).unwrap();
        assert!(GuestRing::new(w(64), 64, 0, 4, one()).is_some());
        assert!(GuestRing::new(w(128), 64, 0, 4, one()).is_none());
        assert!(GuestRing::new(w(8), 48, 0, 4, one()).is_none());
        assert!(GuestRing::new(w(8), 0, 0, 4, one()).is_none());
        let r = GuestRing::new(w(8), 64, 0, 4, one()).unwrap();
        assert_eq!(r.entry_addr(9), 0x1040);
    }

    #[test]
    fn indices_from_the_guest_are_checked() {
        let m = mem();
        let r = ring(WrapBit::new(8).unwrap());
        m.write_obj(15u32, GuestAddress(PROD)).unwrap();
        assert_eq!(r.prod(&m), Ok(15));
        m.write_obj(16u32, GuestAddress(PROD)).unwrap();
        assert_eq!(r.prod(&m), Err(GuestError::BadIndex(16)));
        let far = GuestRing::new(
            WrapBit::new(8).unwrap(),
            16,
            0x9000_0000,
            CONS,
            PageList::default(),
        );
        assert!(far.is_none(), "no pages for the entries");
    }

    /// Entries are taken in order, each slot given back as it is copied,
    /// as far as the decoder has room; the rest wait for the next turn.
    fn takes_in_order_with_room<I: Indices>(indices: I, start: u32) {
        let m = mem();
        let r = ring(indices);
        m.write_obj(start, GuestAddress(PROD)).unwrap();
        let mut c = Consumer::new(r.clone());
        // Start both cursors at `start` (the guest's indices too).
        c.next = start;
        c.cons = start;
        let mut idx = start;
        for v in 0..6u64 {
            post(&m, &r, idx, 100 + v);
            idx = indices.next(idx);
        }
        assert!(c.pending(&m));
        let mut d = room(4);
        let t = c.take(&m, &mut d);
        assert_eq!(
            t,
            Taken {
                entries: 4,
                malformed: 0,
                broken: false
            }
        );
        assert_eq!(d.got, vec![100, 101, 102, 103]);
        let mut four = start;
        for _ in 0..4 {
            four = indices.next(four);
        }
        assert_eq!(cons(&m), four, "the slots taken are given back");
        let mut d = room(8);
        assert_eq!(c.take(&m, &mut d).entries, 2);
        assert_eq!(d.got, vec![104, 105]);
        assert_eq!(cons(&m), idx);
        assert!(!c.pending(&m));
        assert_eq!(c.take(&m, &mut room(8)), Taken::default());
    }

    #[test]
    fn a_consumer_takes_in_order_as_far_as_it_has_room() {
        takes_in_order_with_room(WrapBit::new(8).unwrap(), 0);
        // Across the wrap bit.
        takes_in_order_with_room(WrapBit::new(8).unwrap(), 13);
        takes_in_order_with_room(FreeRunning::new(8).unwrap(), 0);
        // Across 2^32.
        takes_in_order_with_room(FreeRunning::new(8).unwrap(), u32::MAX - 2);
    }

    /// `n` entries on from `idx`.
    fn ahead<I: Indices>(indices: I, mut idx: u32, n: u32) -> u32 {
        for _ in 0..n {
            idx = indices.next(idx);
        }
        idx
    }

    fn full_ring<I: Indices>(indices: I) {
        let m = mem();
        let r = ring(indices);
        let mut c = Consumer::new(r.clone());
        for v in 0..8 {
            post(&m, &r, v, v.into());
        }
        let mut d = room(100);
        assert_eq!(c.take(&m, &mut d).entries, 8, "a full ring");
        assert_eq!(d.got, (0..8).collect::<Vec<_>>());
        assert_eq!(cons(&m), ahead(indices, 0, 8));
        // Nine ahead of the consumer index given back: impossible.
        m.write_obj(ahead(indices, 0, 17), GuestAddress(PROD))
            .unwrap();
        let t = c.take(&m, &mut room(100));
        assert_eq!((t.entries, t.broken), (0, true));
    }

    #[test]
    fn a_full_ring_is_taken_whole_and_one_past_full_breaks_it() {
        full_ring(WrapBit::new(8).unwrap());
        full_ring(FreeRunning::new(8).unwrap());
    }

    #[test]
    fn wild_indices_break_the_ring_once_and_reset_makes_it_whole() {
        let wild = [
            // Not an index the driver could write.
            (16, 32u32, true),
            (16, 0xdead_beef, true),
            // A valid index more than a ring ahead: 17 in a ring of 16.
            (16, 17, true),
            // Exactly a ring ahead: fine.
            (16, 16, false),
        ];
        for (n, prod, broken) in wild {
            let m = mem();
            let r = GuestRing::new(
                WrapBit::new(n).unwrap(),
                16,
                PROD,
                CONS,
                PageList::new(vec![BASE + 0x1000]).unwrap(),
            )
            .unwrap();
            let mut c = Consumer::new(r);
            m.write_obj(prod, GuestAddress(PROD)).unwrap();
            let mut d = room(100);
            let t = c.take(&m, &mut d);
            assert_eq!(t.broken, broken, "{prod:#x}");
            assert_eq!(c.is_broken(), broken);
            if broken {
                assert_eq!(t.entries, 0);
                assert!(!c.pending(&m), "a broken ring has nothing pending");
                // Once: the next turns say nothing and take nothing.
                for _ in 0..3 {
                    assert_eq!(c.take(&m, &mut d), Taken::default());
                }
                assert!(d.got.is_empty());
                c.reset();
                m.write_obj(0u32, GuestAddress(PROD)).unwrap();
                assert!(!c.is_broken());
                assert_eq!(c.take(&m, &mut d), Taken::default());
            }
        }
        // Free-running: behind the consumer index, or more than n ahead.
        for prod in [u32::MAX, 9, 0x8000_0000] {
            let m = mem();
            let mut c = Consumer::new(ring(FreeRunning::new(8).unwrap()));
            m.write_obj(prod, GuestAddress(PROD)).unwrap();
            assert!(c.take(&m, &mut room(100)).broken, "{prod:#x}");
            assert!(!c.take(&m, &mut room(100)).broken, "once");
        }
    }

    #[test]
    fn memory_gone_under_an_entry_breaks_the_ring_after_what_was_taken() {
        let m = mem();
        // The second entry page is past the end of guest memory.
        let r = GuestRing::new(
            WrapBit::new(8).unwrap(),
            1024,
            PROD,
            CONS,
            PageList::new(vec![BASE + 0x1000, 0x9000_0000]).unwrap(),
        )
        .unwrap();
        let mut c = Consumer::new(r.clone());
        for v in 0..4 {
            m.write_obj(u64::from(v), GuestAddress(r.entry_addr(v)))
                .unwrap();
        }
        m.write_obj(6u32, GuestAddress(PROD)).unwrap();
        let mut d = room(100);
        let t = c.take(&m, &mut d);
        assert_eq!((t.entries, t.broken), (4, true));
        assert_eq!(cons(&m), 4, "what was taken is given back");
        assert!(!c.take(&m, &mut d).broken, "once");
    }

    #[test]
    fn an_entry_rewritten_after_it_was_taken_is_read_once_only() {
        let m = mem();
        let r = ring(FreeRunning::new(4).unwrap());
        let mut c = Consumer::new(r.clone());
        post(&m, &r, 0, 7);
        let mut d = room(100);
        assert_eq!(c.take(&m, &mut d).entries, 1);
        // The guest rewrites the entry (and its producer index, the same)
        // after the doorbell: the device took it already.
        m.write_obj(666u64, GuestAddress(r.entry_addr(0))).unwrap();
        assert!(!c.pending(&m));
        assert_eq!(c.take(&m, &mut d).entries, 0);
        assert_eq!(d.got, vec![7]);
    }

    #[test]
    fn malformed_entries_are_taken_and_counted() {
        let m = mem();
        let r = ring(WrapBit::new(4).unwrap());
        let mut c = Consumer::new(r.clone());
        post(&m, &r, 0, 1);
        post(&m, &r, 1, 0xff);
        post(&m, &r, 2, 3);
        let t = c.take(&m, &mut room(100));
        assert_eq!(
            t,
            Taken {
                entries: 3,
                malformed: 1,
                broken: false
            }
        );
        assert_eq!(cons(&m), 3);
    }

    #[test]
    fn a_consumer_index_that_cannot_be_written_is_published_again() {
        let m = mem();
        // The consumer's index word is not in guest memory.
        let r = GuestRing::new(
            FreeRunning::new(4).unwrap(),
            16,
            PROD,
            0x9000_0000,
            PageList::new(vec![BASE + 0x1000]).unwrap(),
        )
        .unwrap();
        let mut c = Consumer::new(r.clone());
        post(&m, &r, 0, 1);
        post(&m, &r, 1, 2);
        assert_eq!(c.take(&m, &mut room(100)).entries, 2);
        assert_eq!(c.cons, 0, "not given back");
        // Three more would be more than a ring ahead of what was given
        // back: broken.
        for i in 2..5 {
            post(&m, &r, i, 3);
        }
        assert!(c.take(&m, &mut room(100)).broken);
    }

    #[test]
    fn a_producer_writes_where_the_consumer_left_room() {
        let m = mem();
        let r = ring(WrapBit::new(4).unwrap());
        let mut p = Producer::new(r.clone(), 0);
        for v in 0..4u64 {
            assert!(p.push(&m, &v));
        }
        assert!(!p.push(&m, &4u64), "full");
        assert_eq!(m.read_obj::<u32>(GuestAddress(PROD)).unwrap(), 4);
        assert_eq!(m.read_obj::<u64>(GuestAddress(r.entry_addr(3))).unwrap(), 3);
        // The guest consumes two: room for two more, wrapping.
        m.write_obj(2u32, GuestAddress(CONS)).unwrap();
        assert!(p.push(&m, &5u64));
        assert_eq!(m.read_obj::<u64>(GuestAddress(r.entry_addr(0))).unwrap(), 5);
        // A consumer index the driver could never have written.
        m.write_obj(9u32, GuestAddress(CONS)).unwrap();
        assert!(!p.push(&m, &6u64));
        // An entry larger than a slot never goes in.
        m.write_obj(5u32, GuestAddress(CONS)).unwrap();
        assert!(!p.push(&m, &[0u8; 17]));
        assert!(p.push(&m, &[1u8; 16]));
    }

    #[test]
    fn a_free_running_producer_wraps_at_2_to_the_32_and_refuses_a_wild_consumer() {
        let m = mem();
        let r = ring(FreeRunning::new(4).unwrap());
        let start = u32::MAX - 1;
        m.write_obj(start, GuestAddress(CONS)).unwrap();
        let mut p = Producer::new(r.clone(), start);
        for v in 0..4u64 {
            assert!(p.push(&m, &v));
        }
        assert!(!p.push(&m, &9u64), "full");
        assert_eq!(m.read_obj::<u32>(GuestAddress(PROD)).unwrap(), 2);
        // The guest consumes one.
        m.write_obj(u32::MAX, GuestAddress(CONS)).unwrap();
        assert!(p.push(&m, &4u64));
        // Ahead of the producer: wild.
        m.write_obj(7u32, GuestAddress(CONS)).unwrap();
        assert!(!p.push(&m, &5u64));
    }

    /// A guest that posts up to `post_n` entries into the room it was
    /// given back, then a device turn with `room`, for each step.
    fn interleaved<I: Indices>(
        indices: I,
        start: u32,
        steps: &[(u32, usize)],
    ) -> Result<(), TestCaseError> {
        let m = mem();
        let r = ring(indices);
        m.write_obj(start, GuestAddress(PROD)).unwrap();
        m.write_obj(start, GuestAddress(CONS)).unwrap();
        let mut c = Consumer::new(r.clone());
        (c.next, c.cons) = (start, start);
        let (mut prod, mut posted) = (start, 0u64);
        let mut d = room(0);
        for &(post_n, turn) in steps.iter().chain(&[(0, usize::MAX)]) {
            let given_back = cons(&m);
            for _ in 0..post_n {
                if indices.used(prod, given_back) >= indices.capacity() {
                    break;
                }
                post(&m, &r, prod, posted);
                posted += 1;
                prod = indices.next(prod);
            }
            d.room = d.got.len().saturating_add(turn);
            prop_assert!(!c.take(&m, &mut d).broken);
        }
        prop_assert_eq!(d.got, (0..posted).collect::<Vec<_>>());
        prop_assert_eq!(cons(&m), prod);
        prop_assert!(!c.pending(&m));
        Ok(())
    }

    proptest! {
        /// A guest that posts and a device that takes with any room, in
        /// any interleaving, from any starting index: every entry is taken
        /// once, in order, the ring never breaks, and the consumer index
        /// the guest reads ends at its producer index.
        #[test]
        fn every_entry_is_taken_once_in_order(
            start in any::<u32>(),
            steps in prop::collection::vec((0u32..10, 0usize..10), 1..40),
        ) {
            interleaved(WrapBit::new(8).unwrap(), start % 16, &steps)?;
            interleaved(FreeRunning::new(8).unwrap(), start, &steps)?;
            // Near 2^32.
            interleaved(FreeRunning::new(8).unwrap(), u32::MAX - start % 64, &steps)?;
        }
    }
}
