//! The hash table from a key's hash to its slot number in a table's slab.
//!
//! A point read in a large table misses the cache on the hash table, on the slot and on the
//! value, one after another. A table that keeps its control bytes apart from its entries
//! (hashbrown's layout) misses twice before it reaches the slot: once on the control bytes,
//! once on the entry beside the matching byte. Here both live in one 64-byte line:
//!
//! - a group holds 12 entries: 12 one-byte tags (7 bits of the hash with the high bit set;
//!   0 means empty), an overflow count, and the 12 slot numbers;
//! - a lookup compares the tags of the key's home group at once (a word-wide zero-byte test)
//!   and reads the slot number from the same line.
//!
//! At most 10 of a group's 12 places are counted as capacity, which keeps most lookups
//! within their home group. The groups (a power of two) sit in huge pages once they reach
//! 2 MiB, as the slab does. At 1M keys that is 8 bytes a key, against hashbrown's 10.
//!
//! **Probing and its invariant.** An entry goes to the first group, counting on from its
//! home group (`hash & mask`), that has a free place. A group's overflow count is the number
//! of entries stored beyond it whose probe passed through it. So a lookup that misses in a
//! group whose count is zero can stop: no entry homed at or before that group lies beyond it.
//! Removing an entry walks its path again (the caller passes the hash) and takes it off each
//! count. A count that reaches 255 stays there: lookups then always go on past that group,
//! which costs time, never correctness, because a count may be too high but never too low.

use allocator_api2::vec::Vec as ArrayVec;

use crate::huge::HugePages;

/// Places per group.
const WIDTH: usize = 12;
/// Places per group counted as capacity.
const FILL: usize = 10;
/// Index of the overflow count in a group's metadata.
const OVERFLOW: usize = 12;
/// One in every byte of a 16-byte word, and the high bit of every byte.
const ONES: u128 = u128::from_le_bytes([1; 16]);
const HIGHS: u128 = ONES << 7;
/// The high bits of the tag bytes (the first 12 of the metadata).
const TAG_HIGHS: u128 = HIGHS & ((1u128 << (8 * WIDTH)) - 1);

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Group {
    /// Bytes 0..12: tags; byte 12: overflow count; 13..16: unused.
    meta: [u8; 16],
    slots: [u32; WIDTH],
}

impl Group {
    const EMPTY: Group = Group { meta: [0; 16], slots: [0; WIDTH] };

    /// The places whose tag is `tag` (0: the empty places).
    #[inline]
    fn places(&self, tag: u8) -> Places {
        let x = u128::from_le_bytes(self.meta) ^ ONES.wrapping_mul(u128::from(tag));
        // A byte's high bit ends up set exactly when the byte is zero: adding 0x7f to its
        // low seven bits carries into the high bit unless they are all zero (and never into
        // the next byte), and the byte's own high bit is or-ed in.
        let nonzero = ((x & !HIGHS).wrapping_add(!HIGHS)) | x;
        Places(!nonzero & TAG_HIGHS)
    }

    fn overflow(&self) -> u8 {
        self.meta.get(OVERFLOW).copied().unwrap_or(0)
    }

    fn overflow_mut(&mut self) -> Option<&mut u8> {
        self.meta.get_mut(OVERFLOW)
    }
}

/// Place numbers, lowest first, from a mask with the high bit of each chosen byte set.
struct Places(u128);

impl Iterator for Places {
    type Item = usize;
    #[inline]
    fn next(&mut self) -> Option<usize> {
        if self.0 == 0 {
            return None;
        }
        let place = self.0.trailing_zeros() as usize / 8;
        self.0 &= self.0 - 1;
        Some(place)
    }
}

/// The 7 bits of the hash a tag keeps, and its high bit (never 0, which is empty). The home
/// group takes the low bits, the tag the top ones, so they are independent.
#[inline]
fn tag(hash: u64) -> u8 {
    (hash >> 57) as u8 | 0x80
}

/// Slot numbers under their keys' hashes. It never reads a key: `find` and `remove` take a
/// test that says whether a slot holds the key sought, called only for matching tags.
pub(crate) struct SlotTable {
    groups: ArrayVec<Group, HugePages>,
    len: usize,
}

impl Default for SlotTable {
    fn default() -> Self {
        SlotTable { groups: ArrayVec::new_in(HugePages), len: 0 }
    }
}

impl std::fmt::Debug for SlotTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotTable").field("len", &self.len).field("groups", &self.groups.len()).finish()
    }
}

impl SlotTable {
    /// An empty table with room for `capacity` entries without growing.
    pub fn with_capacity(capacity: usize) -> SlotTable {
        if capacity == 0 {
            return SlotTable::default();
        }
        let groups = capacity.div_ceil(FILL).next_power_of_two();
        let mut v = ArrayVec::with_capacity_in(groups, HugePages);
        v.resize(groups, Group::EMPTY);
        SlotTable { groups: v, len: 0 }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Entries the table takes before the caller should build a larger one.
    pub fn capacity(&self) -> usize {
        self.groups.len() * FILL
    }

    /// Number of bits in a home group's number (the table has `1 << home_bits()` groups).
    pub fn home_bits(&self) -> u32 {
        self.groups.len().max(1).trailing_zeros()
    }

    /// The group where the probe for `hash` starts. Inserting in home order touches the
    /// groups in order.
    pub fn home(&self, hash: u64) -> usize {
        hash as usize & self.groups.len().saturating_sub(1)
    }

    /// Reads the first byte of `hash`'s home group, so that a batch of lookups can start all
    /// their groups' cache misses before the first probe waits on one (`TableData::get_many`).
    #[inline]
    pub fn touch(&self, hash: u64) -> u8 {
        self.groups.get(self.home(hash)).map_or(0, |g| g.meta[0])
    }

    /// The first slot in `hash`'s home group whose tag matches: most likely the key's slot,
    /// for a batch to start reading before it compares keys (a hint only, never checked).
    #[inline]
    pub fn likely(&self, hash: u64) -> Option<u32> {
        let group = self.groups.get(self.home(hash))?;
        let place = group.places(tag(hash)).next()?;
        group.slots.get(place).copied()
    }

    /// The slot under `hash` for which `is` holds.
    #[inline]
    pub fn find(&self, hash: u64, is: impl FnMut(u32) -> bool) -> Option<u32> {
        let (g, place) = self.locate(hash, is)?;
        self.groups.get(g)?.slots.get(place).copied()
    }

    /// Group and place of the slot under `hash` for which `is` holds.
    #[inline]
    fn locate(&self, hash: u64, mut is: impl FnMut(u32) -> bool) -> Option<(usize, usize)> {
        let mask = self.groups.len().checked_sub(1)?;
        let t = tag(hash);
        let mut g = hash as usize & mask;
        for _ in 0..self.groups.len() {
            let group = self.groups.get(g)?;
            for place in group.places(t) {
                if group.slots.get(place).is_some_and(|&s| is(s)) {
                    return Some((g, place));
                }
            }
            if group.overflow() == 0 {
                return None;
            }
            g = (g + 1) & mask;
        }
        None
    }

    /// Adds `slot` under `hash`; the caller knows no entry for its key is present. Returns
    /// false, changing nothing, only when every place is taken (callers build a larger table
    /// once `len` reaches `capacity`, well before that).
    pub fn insert_unique(&mut self, hash: u64, slot: u32) -> bool {
        let Some(mask) = self.groups.len().checked_sub(1) else { return false };
        let home = self.home(hash);
        let mut g = home;
        let mut found = None;
        for _ in 0..self.groups.len() {
            if let Some(place) = self.groups.get(g).and_then(|group| group.places(0).next()) {
                found = Some(place);
                break;
            }
            g = (g + 1) & mask;
        }
        let Some(place) = found else { return false };
        self.walk_overflow(home, g, |count| *count = count.saturating_add(1));
        if let Some(group) = self.groups.get_mut(g) {
            if let (Some(m), Some(s)) = (group.meta.get_mut(place), group.slots.get_mut(place)) {
                *m = tag(hash);
                *s = slot;
            }
        }
        self.len += 1;
        true
    }

    /// Removes and returns the slot under `hash` for which `is` holds.
    pub fn remove(&mut self, hash: u64, is: impl FnMut(u32) -> bool) -> Option<u32> {
        let (g, place) = self.locate(hash, is)?;
        let group = self.groups.get_mut(g)?;
        let slot = group.slots.get(place).copied()?;
        *group.meta.get_mut(place)? = 0;
        self.len -= 1;
        // Saturated counts stay: they no longer know how many they stand for.
        self.walk_overflow(self.home(hash), g, |count| {
            if *count != u8::MAX {
                *count = count.saturating_sub(1);
            }
        });
        Some(slot)
    }

    /// Applies `change` to the overflow count of every group a probe passes from `home` up
    /// to (not including) group `to`, where its entry sits.
    fn walk_overflow(&mut self, home: usize, to: usize, change: impl Fn(&mut u8)) {
        let mask = self.groups.len().saturating_sub(1);
        let mut passed = home;
        while passed != to {
            if let Some(count) = self.groups.get_mut(passed).and_then(Group::overflow_mut) {
                change(count);
            }
            passed = (passed + 1) & mask;
        }
    }

    /// Checks the overflow counts against the entries (tests).
    #[cfg(test)]
    fn check(&self, hash_of: impl Fn(u32) -> u64) {
        let n = self.groups.len();
        let mut counts = vec![0usize; n];
        let mut len = 0;
        for (g, group) in self.groups.iter().enumerate() {
            for place in 0..WIDTH {
                if group.meta[place] == 0 {
                    continue;
                }
                len += 1;
                let hash = hash_of(group.slots[place]);
                assert_eq!(group.meta[place], tag(hash), "tag of the slot in group {g} place {place}");
                let mut p = self.home(hash);
                while p != g {
                    counts[p] += 1;
                    p = (p + 1) % n;
                }
            }
        }
        assert_eq!(len, self.len);
        for (g, group) in self.groups.iter().enumerate() {
            let have = group.overflow();
            // A saturated count may stand for more than remain; any other is exact.
            if have != u8::MAX {
                assert_eq!(usize::from(have), counts[g], "group {g}: overflow count");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::collections::HashMap;

    #[test]
    fn places_are_the_bytes_equal_to_the_tag() {
        let mut g = Group::EMPTY;
        g.meta = [0x81, 0, 0x81, 0x80, 0xff, 0x01, 0x81, 0, 0, 0, 0, 0x81, 0x81, 0x81, 0x81, 0x81];
        assert_eq!(g.places(0x81).collect::<Vec<_>>(), vec![0, 2, 6, 11], "not the overflow or unused bytes");
        assert_eq!(g.places(0).collect::<Vec<_>>(), vec![1, 7, 8, 9, 10]);
        assert_eq!(g.places(0xff).collect::<Vec<_>>(), vec![4]);
        assert_eq!(g.places(0x80).collect::<Vec<_>>(), vec![3]);
        assert_eq!(g.places(0x01).collect::<Vec<_>>(), vec![5]);
        for t in 0x80..=0xffu8 {
            let mut g = Group::EMPTY;
            g.meta[5] = t;
            g.meta[5 ^ 1] = t ^ 1;
            assert_eq!(g.places(t).collect::<Vec<_>>(), vec![5], "tag {t:#x}");
        }
    }

    /// Random inserts and removes against a map, with hashes drawn from few distinct values
    /// (long probes, tag collisions, saturated counts) and from many, checked throughout.
    #[test]
    fn matches_a_map_under_random_inserts_and_removes() {
        for (round, distinct_homes) in [(0u64, 4u64), (1, 64), (2, u64::MAX)] {
            let mut rng = rand::rngs::StdRng::seed_from_u64(40 + round);
            let mut hashes: Vec<u64> = Vec::new();
            let mut table = SlotTable::with_capacity(0);
            let mut live: HashMap<u32, u64> = HashMap::new();
            let mut next = 0u32;
            for step in 0..20_000 {
                if table.len() >= table.capacity() {
                    // Grow: a new table holding the same entries.
                    let mut bigger = SlotTable::with_capacity((table.len() + 1) * 2);
                    for (&s, &h) in &live {
                        assert!(bigger.insert_unique(h, s));
                    }
                    table = bigger;
                }
                if rng.gen_bool(0.6) || live.is_empty() {
                    let low =
                        if distinct_homes == u64::MAX { rng.gen::<u64>() } else { rng.gen_range(0..distinct_homes) };
                    let hash = (rng.gen::<u64>() & !0xffff_ffff) | low;
                    let slot = next;
                    next += 1;
                    hashes.push(hash);
                    assert!(table.insert_unique(hash, slot));
                    live.insert(slot, hash);
                } else {
                    let slot = *live.keys().nth(rng.gen_range(0..live.len())).unwrap();
                    let hash = live.remove(&slot).unwrap();
                    assert_eq!(table.remove(hash, |s| s == slot), Some(slot), "step {step}");
                    assert_eq!(table.remove(hash, |s| s == slot), None);
                }
                if step % 997 == 0 {
                    table.check(|s| hashes[s as usize]);
                }
                let probe = rng.gen_range(0..next);
                let expect = live.get(&probe).map(|_| probe);
                assert_eq!(table.find(hashes[probe as usize], |s| s == probe), expect, "round {round} step {step}");
            }
            table.check(|s| hashes[s as usize]);
            for (&s, &h) in &live {
                assert_eq!(table.find(h, |x| x == s), Some(s));
            }
            assert_eq!(table.len(), live.len());
        }
    }

    #[test]
    fn a_full_table_refuses_and_an_empty_one_finds_nothing() {
        let mut t = SlotTable::default();
        assert_eq!(t.find(7, |_| true), None);
        assert!(!t.insert_unique(7, 1));
        let mut t = SlotTable::with_capacity(1);
        for i in 0..WIDTH as u32 {
            assert!(t.insert_unique(u64::from(i) << 40, i));
        }
        assert!(!t.insert_unique(5, 99), "every place is taken");
        assert_eq!(t.len(), WIDTH);
        for i in 0..WIDTH as u32 {
            assert_eq!(t.find(u64::from(i) << 40, |s| s == i), Some(i));
        }
    }
}
