//! A table's keys in order, as slot numbers: the ordered index behind range scans.
//!
//! The slab (`index.rs`) holds each key once; this structure holds slot numbers, in runs
//! ("chunks") of at most [`CHUNK`] sorted by the keys they name, each filed under a fence key
//! in a `BTreeMap`. Keys are read through the slab (`key_of`), so a scan reaches a key's
//! versions without a hash lookup. Beside each slot number sit the key's first 8 bytes, so a
//! search within a chunk reads the slab only where those tie: with random keys, a search read
//! a random slot per step without them (a cache miss each, and loads of 1M random keys 30-50 %
//! slower than with a B-tree of keys). An entry is 12 bytes, where a second copy of the key in
//! a B-tree node cost 37 bytes a key (measured).
//!
//! Invariants (checked by [`SlotOrder::check`] in the tests):
//! - every chunk is non-empty and sorted strictly ascending by key;
//! - a chunk's fence is at or below its first key and above every key of the chunk before it
//!   (a fence is a lower bound, not necessarily a present key: removing a chunk's first key
//!   leaves its fence in place);
//! - `len` is the number of slot numbers held, each slot at most once.
//!
//! A key above every key held (ascending ids, timestamps, revisions: the common way keys
//! arrive) is appended to the last chunk after one comparison, where a B-tree descends its
//! whole height comparing keys at each level. A key elsewhere costs a descent over the fences
//! (a tree a hundredth the size of the key set) and a binary search in one chunk.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::ops::Bound;

use crate::index::Key;

/// Most entries in a chunk: a full chunk is 1.5 KiB, shifted by at most that much on an
/// insert, and searched in 7 comparisons.
pub(crate) const CHUNK: usize = 128;

#[derive(Debug, Default)]
pub(crate) struct SlotOrder {
    chunks: BTreeMap<Key, Vec<Entry>>,
    len: usize,
}

/// A slot number and the first 8 bytes of its key (big-endian, zero-padded), in three words:
/// 12 bytes, where a `(u64, u32)` would take 16.
#[derive(Debug, Clone, Copy)]
struct Entry {
    high: u32,
    low: u32,
    slot: u32,
}

/// A key's first 8 bytes as a big-endian number, zero-padded: keys with different prefixes
/// compare as their prefixes do; equal prefixes decide nothing (`"a"` and `"a\0"` share one).
pub(crate) fn prefix(key: &[u8]) -> u64 {
    let mut bytes = [0u8; 8];
    let n = key.len().min(8);
    if let (Some(dst), Some(src)) = (bytes.get_mut(..n), key.get(..n)) {
        dst.copy_from_slice(src);
    }
    u64::from_be_bytes(bytes)
}

impl Entry {
    fn new(key: &[u8], slot: u32) -> Entry {
        Entry::with_prefix(prefix(key), slot)
    }

    /// The entry of `slot`, whose key's [`prefix`] is `p`.
    fn with_prefix(p: u64, slot: u32) -> Entry {
        Entry { high: (p >> 32) as u32, low: p as u32, slot }
    }

    fn prefix(self) -> u64 {
        u64::from(self.high) << 32 | u64::from(self.low)
    }

    /// This entry's key against `key`, whose prefix is `p`; reads the slab only on a tie.
    #[inline]
    fn cmp<'a>(self, key: &[u8], p: u64, key_of: &impl Fn(u32) -> &'a [u8]) -> Ordering {
        self.prefix().cmp(&p).then_with(|| key_of(self.slot).cmp(key))
    }
}

/// A chunk with room for a full chunk and the one insert that makes it split.
fn new_chunk(first: Entry) -> Vec<Entry> {
    let mut chunk = Vec::with_capacity(CHUNK + 1);
    chunk.push(first);
    chunk
}

/// Room a chunk filled out of key order gains at a time. Keys inserted at random leave
/// chunks about 70% full between splits; with a full chunk's room reserved for each, the
/// order cost 17.6 bytes a key at 1M random keys, and growing them this much at a time
/// (a `realloc` every `GROW` inserts into a chunk) brings that near the 12 of its entries.
const GROW: usize = 16;

/// Inserts `entry` at `at`, growing the chunk by [`GROW`] entries (up to a full chunk and the
/// one insert that makes it split) when it has no room, instead of doubling it.
fn insert_at(chunk: &mut Vec<Entry>, at: usize, entry: Entry) {
    if chunk.len() == chunk.capacity() {
        chunk.reserve_exact(GROW.min((CHUNK + 1).saturating_sub(chunk.len())).max(1));
    }
    chunk.insert(at, entry);
}

/// Splits an overfull chunk: returns the upper half, leaving the lower one in place, each
/// with [`GROW`] entries of room.
fn split_if_full(chunk: &mut Vec<Entry>) -> Option<Vec<Entry>> {
    if chunk.len() <= CHUNK {
        return None;
    }
    let mut upper = chunk.split_off(chunk.len() / 2);
    upper.reserve_exact(GROW);
    chunk.shrink_to(chunk.len() + GROW);
    Some(upper)
}

impl SlotOrder {
    pub fn len(&self) -> usize {
        self.len
    }

    /// An order holding `slots`, given with their keys' [`prefix`]es, which must already be
    /// in strictly ascending key order. The prefixes come from the caller (a sort had them),
    /// so the slab is read once per chunk for its fence, not once per slot in key order: a
    /// random read each, a cache miss per key when the table is large.
    pub fn from_sorted<'a>(slots: impl IntoIterator<Item = (u64, u32)>, key_of: impl Fn(u32) -> &'a [u8]) -> SlotOrder {
        let mut runs: Vec<Vec<Entry>> = Vec::new();
        let mut len = 0;
        for (p, slot) in slots {
            let entry = Entry::with_prefix(p, slot);
            match runs.last_mut() {
                Some(run) if run.len() < CHUNK => run.push(entry),
                _ => runs.push(new_chunk(entry)),
            }
            len += 1;
        }
        // Ascending fences: the map is built bottom up, without a search per chunk.
        let chunks = runs.into_iter().filter_map(|run| Some((Key::new(key_of(run.first()?.slot)), run))).collect();
        SlotOrder { chunks, len }
    }

    /// Adds `slot`, whose key is `key`. Returns false, changing nothing, if a slot with an
    /// equal key is already held.
    pub fn insert<'a>(&mut self, key: &[u8], slot: u32, key_of: impl Fn(u32) -> &'a [u8]) -> bool {
        let (entry, p) = (Entry::new(key, slot), prefix(key));
        // Above every key held: append, after one comparison.
        match self.chunks.last_entry() {
            None => {
                // A table's first key: room for a few, not a full chunk (1.5 KiB), so a store
                // of many small tables does not pay a chunk per table. It grows by doubling.
                let mut first = Vec::with_capacity(4);
                first.push(entry);
                self.chunks.insert(Key::new(key), first);
                self.len = 1;
                return true;
            }
            Some(mut last) => {
                let chunk = last.get_mut();
                if chunk.last().is_some_and(|top| top.cmp(key, p, &key_of) == Ordering::Less) {
                    if chunk.len() < CHUNK {
                        chunk.push(entry);
                    } else {
                        // Ascending keys leave full chunks behind, not half-full ones.
                        self.chunks.insert(Key::new(key), new_chunk(entry));
                    }
                    self.len += 1;
                    return true;
                }
            }
        }
        let upper = match self.chunks.range_mut::<[u8], _>((Bound::Unbounded, Bound::Included(key))).next_back() {
            Some((_, chunk)) => {
                let at = chunk.partition_point(|e| e.cmp(key, p, &key_of) == Ordering::Less);
                if chunk.get(at).is_some_and(|e| e.cmp(key, p, &key_of) == Ordering::Equal) {
                    return false;
                }
                insert_at(chunk, at, entry);
                split_if_full(chunk)
            }
            None => {
                // Below every fence, so below every key: the first chunk takes it, filed
                // under the new key as its fence.
                let mut chunk = match self.chunks.pop_first() {
                    Some((_, mut chunk)) => {
                        insert_at(&mut chunk, 0, entry);
                        chunk
                    }
                    None => new_chunk(entry),
                };
                let upper = split_if_full(&mut chunk);
                self.chunks.insert(Key::new(key), chunk);
                upper
            }
        };
        self.len += 1;
        if let Some(upper) = upper {
            if let Some(first) = upper.first() {
                self.chunks.insert(Key::new(key_of(first.slot)), upper);
            }
        }
        true
    }

    /// Removes the slot whose key is `key`; returns it, or `None` if no slot has that key.
    pub fn remove<'a>(&mut self, key: &[u8], key_of: impl Fn(u32) -> &'a [u8]) -> Option<u32> {
        let (fence, chunk) = self.chunks.range_mut::<[u8], _>((Bound::Unbounded, Bound::Included(key))).next_back()?;
        let p = prefix(key);
        let at = chunk.partition_point(|e| e.cmp(key, p, &key_of) == Ordering::Less);
        if chunk.get(at).is_none_or(|e| e.cmp(key, p, &key_of) != Ordering::Equal) {
            return None;
        }
        let slot = chunk.remove(at).slot;
        self.len -= 1;
        let (fence, left) = (fence.clone(), chunk.len());
        if left == 0 {
            self.chunks.remove(fence.as_slice());
        } else if left < CHUNK / 4 {
            self.merge_with_neighbour(&fence);
        }
        Some(slot)
    }

    /// Joins the chunk filed under `fence` with its neighbour before or after it, if the two
    /// fit in one chunk: deletes (of the oldest keys first, as often as at random) leave no
    /// long trail of nearly empty chunks.
    fn merge_with_neighbour(&mut self, fence: &Key) {
        let here = self.chunks.get(fence.as_slice()).map_or(usize::MAX, Vec::len);
        let fits = |(f, c): (&Key, &Vec<Entry>)| (here.saturating_add(c.len()) <= CHUNK).then(|| f.clone());
        let before = self.chunks.range::<[u8], _>((Bound::Unbounded, Bound::Excluded(fence.as_slice()))).next_back();
        // Into the chunk before (this fence goes); or the chunk after into this one.
        let (into, from) = match before.and_then(fits) {
            Some(prev) => (prev, fence.clone()),
            None => {
                let after = self.chunks.range::<[u8], _>((Bound::Excluded(fence.as_slice()), Bound::Unbounded)).next();
                match after.and_then(fits) {
                    Some(next) => (fence.clone(), next),
                    None => return,
                }
            }
        };
        if let Some(moved) = self.chunks.remove(from.as_slice()) {
            if let Some(chunk) = self.chunks.get_mut(into.as_slice()) {
                chunk.reserve_exact(moved.len());
                chunk.extend(moved);
            }
        }
    }

    /// Calls `visit` with each slot whose key lies within `start`..`end`, ascending (or
    /// descending with `reverse`), until it returns false.
    pub fn scan<'a>(
        &self,
        (start, end): (Bound<&[u8]>, Bound<&[u8]>),
        reverse: bool,
        key_of: impl Fn(u32) -> &'a [u8],
        mut visit: impl FnMut(u32) -> bool,
    ) {
        let above_start = |k: &[u8]| match start {
            Bound::Included(s) => k >= s,
            Bound::Excluded(s) => k > s,
            Bound::Unbounded => true,
        };
        let below_end = |k: &[u8]| match end {
            Bound::Included(e) => k <= e,
            Bound::Excluded(e) => k < e,
            Bound::Unbounded => true,
        };
        if !reverse {
            // From the chunk that would hold `start` (keys below it there are skipped).
            let from = match start {
                Bound::Unbounded => Bound::Unbounded,
                Bound::Included(s) | Bound::Excluded(s) => self
                    .chunks
                    .range::<[u8], _>((Bound::Unbounded, Bound::Included(s)))
                    .next_back()
                    .map_or(Bound::Unbounded, |(f, _)| Bound::Included(f.as_slice())),
            };
            let mut first = true;
            for chunk in self.chunks.range::<[u8], _>((from, Bound::Unbounded)).map(|(_, c)| c) {
                let begin = if first { chunk.partition_point(|e| !above_start(key_of(e.slot))) } else { 0 };
                first = false;
                for &Entry { slot, .. } in chunk.get(begin..).unwrap_or_default() {
                    if !below_end(key_of(slot)) || !visit(slot) {
                        return;
                    }
                }
            }
        } else {
            // From the last chunk that may hold a key within `end`: a chunk filed under an
            // excluded end holds only keys at or above it.
            let mut first = true;
            for chunk in self.chunks.range::<[u8], _>((Bound::Unbounded, end)).rev().map(|(_, c)| c) {
                let stop = if first { chunk.partition_point(|e| below_end(key_of(e.slot))) } else { chunk.len() };
                first = false;
                for &Entry { slot, .. } in chunk.get(..stop).unwrap_or_default().iter().rev() {
                    if !above_start(key_of(slot)) || !visit(slot) {
                        return;
                    }
                }
            }
        }
    }

    /// Every slot held, in key order.
    #[cfg(test)]
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.chunks.values().flatten().map(|e| e.slot)
    }

    /// Every slot with its key's [`prefix`], in key order.
    pub fn entries(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.chunks.values().flatten().map(|e| (e.prefix(), e.slot))
    }

    /// Checks every invariant in the module comment.
    #[cfg(test)]
    pub fn check<'a>(&self, key_of: impl Fn(u32) -> &'a [u8]) {
        let mut previous: Option<&[u8]> = None;
        let mut count = 0;
        let mut seen = std::collections::HashSet::new();
        for (fence, chunk) in &self.chunks {
            assert!(!chunk.is_empty() && chunk.len() <= CHUNK, "chunk of {}", chunk.len());
            if let Some(p) = previous {
                assert!(fence.as_slice() > p, "fence {fence:?} not above the previous key {p:?}");
            }
            for &Entry { high, low, slot } in chunk {
                let key = key_of(slot);
                assert_eq!(u64::from(high) << 32 | u64::from(low), prefix(key), "a stale prefix");
                assert!(key >= fence.as_slice(), "key {key:?} below its fence {fence:?}");
                assert!(previous.is_none_or(|p| key > p), "keys out of order at {key:?}");
                assert!(seen.insert(slot), "slot {slot} held twice");
                previous = Some(key);
                count += 1;
            }
        }
        assert_eq!(count, self.len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// A model: slot numbers name keys in `names`; the order is checked against a `BTreeSet`
    /// of the same keys after every operation mix, including every kind of scan bound.
    #[test]
    fn matches_an_ordered_set_under_random_inserts_removes_and_scans() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x9e37_79b9);
        let mut next = move || rng.gen::<u64>();
        for round in 0..6u64 {
            let mut names: Vec<Vec<u8>> = Vec::new();
            let mut slot_of = std::collections::HashMap::new();
            let mut order = SlotOrder::default();
            let mut model = BTreeSet::new();
            let universe = [50u64, 400, 3_000, 20_000, 1_000, 100_000][round as usize];
            let steps = [2_000, 6_000, 20_000, 40_000, 4_000, 60_000][round as usize];
            for step in 0..steps {
                let r = next();
                // Some rounds mostly ascending (the append path), some random.
                let n = if round % 2 == 1 && r % 4 != 0 { step as u64 } else { r % universe };
                let key = if n % 5 == 0 {
                    // Keys that differ only in trailing zero bytes share a prefix.
                    let mut k = vec![b'k', (n >> 8) as u8];
                    k.resize(2 + (n % 4) as usize, 0);
                    k
                } else if n % 3 == 0 {
                    format!("long-key-kept-on-the-heap-{n:08}").into_bytes()
                } else {
                    format!("k{n:08}").into_bytes()
                };
                if r % 3 == 0 {
                    let names_ref = &names;
                    let got = order.remove(&key, |s| names_ref[s as usize].as_slice());
                    let expected = model.remove(&key);
                    assert_eq!(got.is_some(), expected, "remove {key:?}");
                    if let Some(s) = got {
                        assert_eq!(slot_of.remove(&key), Some(s));
                    }
                } else {
                    let slot = *slot_of.entry(key.clone()).or_insert_with(|| {
                        names.push(key.clone());
                        (names.len() - 1) as u32
                    });
                    let names_ref = &names;
                    let inserted = order.insert(&key, slot, |s| names_ref[s as usize].as_slice());
                    assert_eq!(inserted, model.insert(key.clone()), "insert {key:?}");
                }
                if step % 997 == 0 || step + 1 == steps {
                    let key_of = |s: u32| names[s as usize].as_slice();
                    order.check(key_of);
                    let all: Vec<&[u8]> = order.iter().map(key_of).collect();
                    assert_eq!(all, model.iter().map(Vec::as_slice).collect::<Vec<_>>());
                    let a = format!("k{:08}", next() % universe).into_bytes();
                    let b = format!("k{:08}", next() % universe).into_bytes();
                    let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
                    let bounds = [
                        (Bound::Included(lo.as_slice()), Bound::Included(hi.as_slice())),
                        (Bound::Excluded(lo.as_slice()), Bound::Excluded(hi.as_slice())),
                        (Bound::Included(lo.as_slice()), Bound::Excluded(hi.as_slice())),
                        (Bound::Excluded(lo.as_slice()), Bound::Included(hi.as_slice())),
                        (Bound::Unbounded, Bound::Included(lo.as_slice())),
                        (Bound::Excluded(hi.as_slice()), Bound::Unbounded),
                        (Bound::Included(b"".as_slice()), Bound::Excluded(b"l".as_slice())),
                        (Bound::Unbounded, Bound::Unbounded),
                    ];
                    for range in bounds {
                        if lo == hi && matches!(range, (Bound::Excluded(_), Bound::Excluded(_))) {
                            continue; // An empty range, which `BTreeSet::range` refuses.
                        }
                        let expected: Vec<&[u8]> = model.range::<[u8], _>(range).map(Vec::as_slice).collect();
                        for reverse in [false, true] {
                            for limit in [usize::MAX, 3] {
                                let mut got = Vec::new();
                                order.scan(range, reverse, key_of, |s| {
                                    got.push(key_of(s));
                                    got.len() < limit
                                });
                                let mut want = expected.clone();
                                if reverse {
                                    want.reverse();
                                }
                                want.truncate(limit);
                                assert_eq!(got, want, "{range:?} reverse {reverse}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// Keys in random order leave chunks part full; each keeps at most [`GROW`] entries of
    /// room beyond what it holds (a full chunk's room each cost 17.6 bytes a key).
    #[test]
    fn random_inserts_keep_little_room_per_chunk() {
        let names: Vec<Vec<u8>> =
            (0..20_000u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes().to_vec()).collect();
        let key_of = |s: u32| names[s as usize].as_slice();
        let mut order = SlotOrder::default();
        for s in 0..names.len() as u32 {
            assert!(order.insert(key_of(s), s, key_of));
        }
        order.check(key_of);
        let (held, room): (usize, usize) =
            order.chunks.values().map(|c| (c.len(), c.capacity())).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        assert_eq!(held, names.len());
        assert!(order.chunks.values().all(|c| c.capacity() <= c.len() + GROW), "a chunk has more than GROW spare");
        assert!(room * 100 < held * 115, "{room} entries of room for {held} held");
    }

    #[test]
    fn a_sorted_build_holds_full_chunks_and_appends_after_it() {
        let names: Vec<Vec<u8>> = (0..1_000u32).map(|i| format!("k{i:05}").into_bytes()).collect();
        let key_of = |s: u32| names[s as usize].as_slice();
        let mut order = SlotOrder::from_sorted((0..900).map(|s| (prefix(key_of(s)), s)), key_of);
        order.check(key_of);
        assert_eq!(order.chunks.len(), 900usize.div_ceil(CHUNK));
        for s in 900..1_000 {
            assert!(order.insert(key_of(s), s, key_of));
        }
        // A key already held is refused; one below every key lowers the first fence.
        assert!(!order.insert(key_of(5), 5, key_of));
        order.check(key_of);
        assert_eq!(order.iter().collect::<Vec<_>>(), (0..1_000).collect::<Vec<_>>());
        assert!(order.entries().all(|(p, s)| p == prefix(key_of(s))), "entries carry their keys' prefixes");
        assert_eq!(SlotOrder::from_sorted(std::iter::empty(), key_of).len(), 0);
        // A small table's one chunk is small; grown past a full chunk and split, it is not
        // left with the doubled room.
        let mut small = SlotOrder::default();
        assert!(small.insert(key_of(500), 500, key_of));
        assert!(small.chunks.values().all(|c| c.capacity() < 16));
        for s in (0..CHUNK as u32 + 1).rev() {
            assert!(small.insert(key_of(s), s, key_of));
        }
        small.check(key_of);
        assert!(small.chunks.values().all(|c| c.capacity() <= CHUNK + 1), "a chunk kept its doubled room");
        // Deleting nine keys in ten merges the thinned chunks: 100 keys, not 8 chunks of 12.
        for s in (0..1_000).filter(|s| s % 10 != 0) {
            assert_eq!(order.remove(key_of(s), key_of), Some(s));
        }
        order.check(key_of);
        assert_eq!(order.len(), 100);
        assert!(order.chunks.len() <= 2, "{} chunks for 100 keys", order.chunks.len());
        assert_eq!(order.remove(b"k00001", key_of), None);
    }
}
