//! Object tables: the numbers a guest uses to name PDs, CQs, QPs, SRQs,
//! AHs, and the 24-bit indexes inside memory keys.
//!
//! A slot freed is reused before the table grows, so handles stay small —
//! except in a cycling table ([`Table::cycling`], the QPs'), which hands
//! out its numbers in turn and comes back to a freed one only after all
//! the others. Each slot keeps an 8-bit generation that changes every time
//! the slot is filled: memory keys carry it as their key byte, so a stale
//! key never names the object that replaced its MR (IBTA Vol1 §10.6.3.1).

/// A table of at most `max` objects, numbered from `base`.
#[derive(Debug)]
pub(crate) struct Table<T> {
    slots: Vec<Slot<T>>,
    /// Indexes of empty slots, lowest last (so `pop` reuses the lowest).
    free: Vec<u32>,
    base: u32,
    max: u32,
    len: u32,
    /// Slots below this index are never handed out by [`Table::insert`],
    /// only filled by [`Table::insert_at`] (the special QPs).
    reserved: u32,
    /// A cycling table's next candidate slot ([`Table::cycling`]); `None`:
    /// the lowest free slot is reused.
    cursor: Option<usize>,
}

#[derive(Debug)]
struct Slot<T> {
    value: Option<T>,
    generation: u8,
}

impl<T> Table<T> {
    /// A table whose handles run from `base` to `base + max - 1`.
    pub(crate) fn new(base: u32, max: u32) -> Self {
        Self::with_reserved(base, 0, max)
    }

    /// A table whose first `reserved` handles (from `base`) are kept for
    /// [`Table::insert_at`]; [`Table::insert`] hands out the rest, at most
    /// `max` of them.
    pub(crate) fn with_reserved(base: u32, reserved: u32, max: u32) -> Self {
        Table {
            slots: (0..reserved)
                .map(|_| Slot {
                    value: None,
                    generation: 0,
                })
                .collect(),
            free: Vec::new(),
            base,
            max,
            len: 0,
            reserved,
            cursor: None,
        }
    }

    /// Makes [`Table::insert`] hand out handles in turn, wrapping after
    /// the last of its `max`, so a freed handle comes back only after every
    /// other one has been used. QPNs are handed out this way, as rxe and
    /// RDMA NICs do: a peer's connection manager keeps a torn-down
    /// connection's remote QPN until its time-wait ends, and rejects a new
    /// connection from the same QPN as stale (IBTA Vol1 §12.9.8.3.3, Linux's
    /// `cm_insert_remote_qpn`) — a number reused at once would have a
    /// process's reconnect refused. The slots grow to `max` over time:
    /// keep large values boxed.
    pub(crate) fn cycling(mut self) -> Self {
        self.cursor = Some(self.reserved as usize);
        self
    }

    /// Stores `value` at a reserved `handle`, if that slot is empty;
    /// reserved slots do not count against `max`.
    pub(crate) fn insert_at(&mut self, handle: u32, value: T) -> Option<u8> {
        let i = self.index(handle)?;
        if i >= self.reserved as usize {
            return None;
        }
        let slot = self.slots.get_mut(i)?;
        if slot.value.is_some() {
            return None;
        }
        slot.generation = slot.generation.wrapping_add(1);
        slot.value = Some(value);
        Some(slot.generation)
    }

    /// Stores `value`, returning its handle and the slot's new generation,
    /// or `None` when the table is full.
    pub(crate) fn insert(&mut self, value: T) -> Option<(u32, u8)> {
        if self.len >= self.max {
            return None;
        }
        let index = match self.cursor {
            Some(_) => self.next_in_turn()?,
            None => match self.free.pop() {
                Some(i) => i,
                None => self.grow()?,
            },
        };
        let slot = self.slots.get_mut(index as usize)?;
        slot.generation = slot.generation.wrapping_add(1);
        slot.value = Some(value);
        self.len += 1;
        Some((self.base + index, slot.generation))
    }

    /// A new empty slot at the end; its index.
    fn grow(&mut self) -> Option<u32> {
        let i = u32::try_from(self.slots.len()).ok()?;
        self.slots.push(Slot {
            value: None,
            generation: 0,
        });
        Some(i)
    }

    /// A cycling table's next empty slot from its cursor, wrapping from
    /// the last usable slot to the first past the reserved ones; the
    /// cursor moves past it. The caller has checked that one is free.
    fn next_in_turn(&mut self) -> Option<u32> {
        let first = self.reserved as usize;
        let end = first + self.max as usize;
        let mut i = self.cursor?;
        // The cursor never passes the slots' end (it moves one past a slot
        // in use), so a slot not yet made is exactly the next one.
        for _ in 0..self.max {
            if i >= end {
                i = first;
            }
            let free = match self.slots.get(i) {
                Some(s) => s.value.is_none(),
                None => self.grow()? as usize == i,
            };
            if free {
                self.cursor = Some(i + 1);
                return u32::try_from(i).ok();
            }
            i += 1;
        }
        None
    }

    fn index(&self, handle: u32) -> Option<usize> {
        handle.checked_sub(self.base).map(|i| i as usize)
    }

    pub(crate) fn get(&self, handle: u32) -> Option<&T> {
        self.slots.get(self.index(handle)?)?.value.as_ref()
    }

    pub(crate) fn get_mut(&mut self, handle: u32) -> Option<&mut T> {
        let i = self.index(handle)?;
        self.slots.get_mut(i)?.value.as_mut()
    }

    /// Removes the object at `handle` whose key byte was `last_key`: the
    /// slot's next object gets `last_key + 1`, so no key the consumer has
    /// seen for this slot names the next object (keys can change after
    /// insertion: fast registration and binding choose their own byte).
    pub(crate) fn remove_keyed(&mut self, handle: u32, last_key: u8) -> Option<T> {
        let i = self.index(handle)?;
        if let Some(slot) = self.slots.get_mut(i)
            && slot.value.is_some()
        {
            slot.generation = last_key;
        }
        self.remove(handle)
    }

    pub(crate) fn remove(&mut self, handle: u32) -> Option<T> {
        let i = self.index(handle)?;
        let v = self.slots.get_mut(i)?.value.take()?;
        if i < self.reserved as usize {
            return Some(v);
        }
        self.len -= 1;
        if self.cursor.is_some() {
            return Some(v);
        }
        // Keep `free` sorted high-to-low so the lowest index is reused first.
        let i = i as u32;
        let at = self.free.partition_point(|&f| f > i);
        self.free.insert(at, i);
        Some(v)
    }

    pub(crate) fn len(&self) -> u32 {
        self.len
    }

    pub(crate) fn max(&self) -> u32 {
        self.max
    }

    /// Live objects with their handles, mutably.
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (u32, &mut T)> {
        let base = self.base;
        self.slots
            .iter_mut()
            .enumerate()
            .filter_map(move |(i, s)| s.value.as_mut().map(|v| (base + i as u32, v)))
    }

    /// Live objects with their handles.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.value.as_ref().map(|v| (self.base + i as u32, v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_start_at_base_and_reuse_the_lowest_free_slot() {
        let mut t = Table::new(17, 4);
        let a = t.insert('a').unwrap();
        let b = t.insert('b').unwrap();
        let c = t.insert('c').unwrap();
        assert_eq!((a.0, b.0, c.0), (17, 18, 19));
        assert_eq!(t.remove(18), Some('b'));
        assert_eq!(t.remove(17), Some('a'));
        assert_eq!(t.insert('d').unwrap().0, 17);
        assert_eq!(t.insert('e').unwrap().0, 18);
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn a_cycling_table_comes_back_to_a_freed_handle_only_after_all_the_others() {
        let mut t = Table::with_reserved(1, 16, 4).cycling();
        let a = t.insert('a').unwrap().0;
        assert_eq!(a, 17, "past the reserved 1..=16");
        assert_eq!(t.remove(a), Some('a'));
        let got: Vec<u32> = ['b', 'c', 'd', 'e'].map(|v| t.insert(v).unwrap().0).into();
        assert_eq!(got, [18, 19, 20, 17], "17 again only after 18..=20");
        assert_eq!(t.insert('f'), None, "full");
        assert_eq!(t.remove(19), Some('c'));
        assert_eq!(t.remove(18), Some('b'));
        let (h, generation) = t.insert('g').unwrap();
        assert_eq!(h, 18, "the next in turn after 17, not the first freed");
        assert_eq!(generation, 2, "the slot's second object");
        assert_eq!(t.insert('h').unwrap().0, 19);
        assert!(
            t.insert_at(1, 'x').is_some(),
            "the reserved slots still fill by name"
        );
        assert_eq!(t.len(), 4);
        let held: Vec<u32> = t.iter().map(|(h, _)| h).collect();
        assert_eq!(held, [1, 17, 18, 19, 20]);
    }

    #[test]
    fn reserved_handles_are_filled_only_by_name_and_never_handed_out() {
        let mut t = Table::with_reserved(1, 16, 2);
        assert_eq!(t.insert('a').unwrap().0, 17, "past the reserved 1..=16");
        assert!(t.insert_at(1, 'g').is_some());
        assert!(t.insert_at(1, 'h').is_none(), "taken");
        assert!(t.insert_at(17, 'x').is_none(), "not reserved");
        assert!(t.insert_at(0, 'x').is_none(), "below the base");
        assert_eq!(t.insert('b').unwrap().0, 18, "reserved slots do not count");
        assert_eq!(t.insert('c'), None);
        assert_eq!(t.remove(1), Some('g'));
        assert_eq!(t.len(), 2);
        assert!(
            t.insert('c').is_none(),
            "a freed reserved slot is not reused"
        );
        assert!(t.insert_at(1, 'g').is_some());
        assert_eq!(t.iter().map(|(h, _)| h).collect::<Vec<_>>(), [1, 17, 18]);
    }

    #[test]
    fn the_limit_is_enforced() {
        let mut t = Table::new(1, 2);
        assert!(t.insert(1).is_some());
        assert!(t.insert(2).is_some());
        assert_eq!(t.insert(3), None);
        t.remove(1);
        assert!(t.insert(3).is_some());
    }

    #[test]
    fn generations_change_on_reuse() {
        let mut t = Table::new(1, 8);
        let (h, g1) = t.insert("first").unwrap();
        t.remove(h);
        let (h2, g2) = t.insert("second").unwrap();
        assert_eq!(h2, h);
        assert_ne!(g1, g2, "a new key byte for the reused slot");
        assert_eq!(t.get(h), Some(&"second"));
    }

    #[test]
    fn handles_below_base_or_unknown_are_none() {
        let mut t = Table::new(10, 8);
        t.insert(()).unwrap();
        assert!(t.get(9).is_none());
        assert!(t.get(11).is_none());
        assert!(t.get(u32::MAX).is_none());
        assert!(t.remove(0).is_none());
    }
}
