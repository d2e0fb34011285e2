//! A table's keys in order, as slot numbers: the ordered index behind range scans.
//!
//! The slab (`index.rs`) holds each key once; this structure holds slot numbers, in runs
//! ("chunks") of at most [`CHUNK`] sorted by the keys they name, each filed under a fence key
//! in a `BTreeMap`. Keys are read through the slab (`key_of`), so a scan reaches a key's
//! versions without a hash lookup.
//!
//! Beside each slot number sit 4 bytes of its key (its *window*), so a search within a chunk
//! reads the slab only where two windows tie: with random keys, a search read a random slot
//! per step without them (a cache miss each, and loads of 1M random keys 30-50 % slower than
//! with a B-tree of keys). The window starts after the bytes that every key of the chunk
//! shares with the chunk's fence (the chunk's *skip*), not at the key's start: keys such as
//! `user:000123` or `/registry/pods/...` share their first bytes, and a window there would
//! tie everywhere. An entry is 8 bytes; a second copy of the key in a B-tree node cost 37
//! bytes a key (measured), and the 8-byte prefix this replaced cost 12.
//!
//! Invariants (checked by [`SlotOrder::check`] in the tests):
//! - every chunk is non-empty and sorted strictly ascending by key;
//! - a chunk's fence is at or below its first key and above every key of the chunk before it
//!   (a fence is a lower bound, not necessarily a present key: removing a chunk's first key
//!   leaves its fence in place);
//! - every key of a chunk with skip `s` starts with its fence's first `s` bytes, and each
//!   entry's window is [`window`]`(key, s)`;
//! - `len` is the number of slot numbers held, each slot at most once.
//!
//! Why a window orders keys: two keys that share their first `s` bytes compare as what
//! follows them. Read big-endian and padded with zeros, a smaller window means a smaller
//! remainder: at the first byte where two windows differ, either both bytes are real and
//! decide, or the smaller is padding, so that key ended there and is a prefix of the other.
//! Equal windows decide nothing, and the slab is read.
//!
//! How a skip changes: a key that joins a chunk without its fence's first `s` bytes lowers
//! the skip to what they share, and every window of the chunk is read again from the slab
//! (rare: a chunk's keys lie between its fence and the next, which share a prefix that every
//! key between them shares). A split raises each half's skip to what its bounds share, but
//! only when adjacent windows tie, because raising reads every key of the half: with keys
//! that differ early, the windows at skip 0 already decide.
//!
//! A key above every key held (ascending ids, timestamps, revisions: the common way keys
//! arrive) is appended to the last chunk after one comparison, where a B-tree descends its
//! whole height comparing keys at each level. A key elsewhere costs a descent over the fences
//! (a tree a hundredth the size of the key set) and a binary search in one chunk.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::ops::Bound;

use crate::index::Key;

/// Most entries in a chunk: a full chunk is 1 KiB, shifted by at most that much on an insert,
/// and searched in 7 comparisons.
pub(crate) const CHUNK: usize = 128;

#[derive(Debug, Default)]
pub(crate) struct SlotOrder {
    chunks: BTreeMap<Key, Chunk>,
    len: usize,
}

/// A run of entries and the number of leading bytes its keys share with its fence.
#[derive(Debug)]
struct Chunk {
    skip: usize,
    entries: Vec<Entry>,
}

/// A slot number and its key's [`window`] at its chunk's skip: 8 bytes.
#[derive(Debug, Clone, Copy)]
struct Entry {
    window: u32,
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

/// The 4 bytes of `key` from `skip` on, big-endian and zero-padded.
fn window(key: &[u8], skip: usize) -> u32 {
    (prefix(key.get(skip..).unwrap_or_default()) >> 32) as u32
}

/// Whether `key` starts with the first `skip` bytes of `fence`, as every key of a run with
/// that fence and skip does.
fn within_skip(fence: &[u8], key: &[u8], skip: usize) -> bool {
    fence.get(..skip) == key.get(..skip)
}

/// How many leading bytes `a` and `b` share.
pub(crate) fn shared(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A key's leading bytes as known to an ordered build: its [`prefix`], of which the first
/// `known` bytes (at least 4) are exact and the rest zero. Two keys whose known bytes differ
/// compare as those bytes do; otherwise the slab decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Prefix {
    bits: u64,
    known: u8,
}

impl Prefix {
    /// A whole 8-byte prefix.
    pub fn of(key: &[u8]) -> Prefix {
        Prefix::exact(prefix(key))
    }

    /// An 8-byte [`prefix`] computed elsewhere.
    pub fn exact(bits: u64) -> Prefix {
        Prefix { bits, known: 8 }
    }

    /// The order of two keys from their known bytes, or `None` when those tie.
    pub fn order(self, other: Prefix) -> Option<Ordering> {
        let known = self.known.min(other.known).min(8);
        let mask = if known >= 8 { u64::MAX } else { !(u64::MAX >> (8 * u32::from(known))) };
        match (self.bits & mask).cmp(&(other.bits & mask)) {
            Ordering::Equal => None,
            o => Some(o),
        }
    }

    /// The key's window at `skip`, if the known bytes cover it.
    fn window(self, skip: usize) -> Option<u32> {
        (skip + 4 <= usize::from(self.known)).then(|| ((self.bits << (8 * skip)) >> 32) as u32)
    }
}

impl Entry {
    /// This entry's key against `key`, whose window at the chunk's skip is `w` (both share
    /// the chunk's skipped bytes); reads the slab only on a tie.
    #[inline]
    fn cmp<'a>(self, key: &[u8], w: u32, key_of: &impl Fn(u32) -> &'a [u8]) -> Ordering {
        self.window.cmp(&w).then_with(|| key_of(self.slot).cmp(key))
    }
}

impl Chunk {
    fn len(&self) -> usize {
        self.entries.len()
    }

    /// A chunk of one key, with room for a full chunk and the one insert that makes it split
    /// (ascending keys fill it).
    fn starting(key: &[u8], slot: u32, skip: usize) -> Chunk {
        let mut entries = Vec::with_capacity(CHUNK + 1);
        entries.push(Entry { window: window(key, skip), slot });
        Chunk { skip, entries }
    }

    /// Sets the skip to `skip` and reads every window again from the slab.
    fn reskip<'a>(&mut self, skip: usize, key_of: &impl Fn(u32) -> &'a [u8]) {
        self.skip = skip;
        for e in &mut self.entries {
            e.window = window(key_of(e.slot), skip);
        }
    }

    /// Makes room in the skip for `key`, about to join this chunk filed under `fence`: lowers
    /// the skip to what the two share, if that is less.
    fn admit<'a>(&mut self, fence: &[u8], key: &[u8], key_of: &impl Fn(u32) -> &'a [u8]) {
        let skip = self.skip;
        if !within_skip(fence, key, skip) {
            self.reskip(shared(fence, key).min(skip), key_of);
        }
    }

    /// Where `key` is or would go, and whether it is there. `key` must share the skip.
    fn search<'a>(&self, key: &[u8], key_of: &impl Fn(u32) -> &'a [u8]) -> (usize, bool) {
        let w = window(key, self.skip);
        let at = self.entries.partition_point(|e| e.cmp(key, w, key_of) == Ordering::Less);
        (at, self.entries.get(at).is_some_and(|e| e.cmp(key, w, key_of) == Ordering::Equal))
    }

    /// Whether two neighbouring windows tie (searches here read the slab).
    fn ties(&self) -> bool {
        self.entries.windows(2).any(|pair| matches!(pair, [a, b] if a.window == b.window))
    }

    /// Raises the skip to `skip` (what every key between this chunk's bounds shares) when
    /// that helps: neighbouring windows tie now, and `skip` is higher.
    fn sharpen<'a>(&mut self, skip: usize, key_of: &impl Fn(u32) -> &'a [u8]) {
        if skip > self.skip && self.ties() {
            self.reskip(skip, key_of);
        }
    }

    /// Inserts `entry` at `at`, growing the chunk by [`GROW`] entries (up to a full chunk and
    /// the one insert that makes it split) when it has no room, instead of doubling it.
    fn insert_at(&mut self, at: usize, entry: Entry) {
        let entries = &mut self.entries;
        if entries.len() == entries.capacity() {
            entries.reserve_exact(GROW.min((CHUNK + 1).saturating_sub(entries.len())).max(1));
        }
        entries.insert(at, entry);
    }

    /// Splits an overfull chunk: returns the upper half (with the same skip), leaving the
    /// lower one in place, each with [`GROW`] entries of room.
    fn split_if_full(&mut self) -> Option<Chunk> {
        if self.len() <= CHUNK {
            return None;
        }
        let mut upper = self.entries.split_off(self.len() / 2);
        upper.reserve_exact(GROW);
        self.entries.shrink_to(self.len() + GROW);
        Some(Chunk { skip: self.skip, entries: upper })
    }
}

/// Room a chunk filled out of key order gains at a time. Keys inserted at random leave
/// chunks about 70% full between splits; with a full chunk's room reserved for each, the
/// order cost 17.6 bytes a key at 1M random keys, and growing them this much at a time
/// (a `realloc` every `GROW` inserts into a chunk) brings that near the size of its entries.
const GROW: usize = 16;

/// A key's known leading bytes, from its chunk's fence (the skipped bytes) and its window.
fn known_prefix(fence: &[u8], skip: usize, window: u32) -> Prefix {
    let head = prefix(fence.get(..skip.min(8)).unwrap_or_default());
    if skip >= 8 {
        return Prefix::exact(head);
    }
    Prefix { bits: head | ((u64::from(window) << 32) >> (8 * skip)), known: (skip + 4).min(8) as u8 }
}

impl SlotOrder {
    pub fn len(&self) -> usize {
        self.len
    }

    /// An order holding `slots`, given with their keys' known [`Prefix`]es, which must already
    /// be in strictly ascending key order. The windows come from the prefixes (a sort had
    /// them), so the slab is read once per chunk for its fence, not once per slot in key
    /// order: a random read each, a cache miss per key when the table is large. Only chunks
    /// whose windows tie (keys with a long shared prefix) are read again, at a higher skip.
    pub fn from_sorted<'a>(
        slots: impl IntoIterator<Item = (Prefix, u32)>,
        key_of: impl Fn(u32) -> &'a [u8],
    ) -> SlotOrder {
        let mut order = SlotOrder::default();
        let mut slots = slots.into_iter();
        // Each run is filed once the next one's fence is known: what two fences share, every
        // key between them shares.
        let mut held: Option<(Key, Vec<(Prefix, u32)>)> = None;
        loop {
            let run: Vec<(Prefix, u32)> = slots.by_ref().take(CHUNK).collect();
            let Some(&(_, first)) = run.first() else { break };
            let fence = Key::new(key_of(first));
            if let Some((previous, previous_run)) = held.take() {
                let bound = shared(previous.as_slice(), fence.as_slice());
                order.push_built(previous, &previous_run, bound, &key_of);
            }
            held = Some((fence, run));
        }
        if let Some((fence, run)) = held {
            let last = run.last().map_or(&[][..], |&(_, s)| key_of(s));
            let bound = shared(fence.as_slice(), last);
            order.push_built(fence, &run, bound, &key_of);
        }
        order
    }

    /// Files a built run under `fence`, above every chunk held. Every key of the run shares
    /// its first `bound` bytes with the fence.
    fn push_built<'a>(&mut self, fence: Key, run: &[(Prefix, u32)], bound: usize, key_of: &impl Fn(u32) -> &'a [u8]) {
        let known = run.iter().map(|(p, _)| usize::from(p.known)).min().unwrap_or(8);
        let skip = bound.min(known.saturating_sub(4));
        let mut entries = Vec::with_capacity(run.len());
        entries.extend(
            run.iter()
                .map(|&(p, slot)| Entry { window: p.window(skip).unwrap_or_else(|| window(key_of(slot), skip)), slot }),
        );
        let mut chunk = Chunk { skip, entries };
        chunk.sharpen(bound, key_of);
        self.len += chunk.len();
        self.chunks.insert(fence, chunk);
    }

    /// Adds `slot`, whose key is `key`. Returns false, changing nothing, if a slot with an
    /// equal key is already held.
    pub fn insert<'a>(&mut self, key: &[u8], slot: u32, key_of: impl Fn(u32) -> &'a [u8]) -> bool {
        // Above every key held: append, after one comparison.
        match self.chunks.iter_mut().next_back() {
            None => {
                // A table's first key: room for a few, not a full chunk (1 KiB), so a store
                // of many small tables does not pay a chunk per table. It grows by doubling.
                let mut entries = Vec::with_capacity(4);
                entries.push(Entry { window: window(key, 0), slot });
                self.chunks.insert(Key::new(key), Chunk { skip: 0, entries });
                self.len = 1;
                return true;
            }
            Some((fence, chunk)) => {
                let skip = chunk.skip;
                let above = if within_skip(fence.as_slice(), key, skip) {
                    let w = window(key, skip);
                    chunk.entries.last().is_some_and(|top| top.cmp(key, w, &key_of) == Ordering::Less)
                } else {
                    // The key differs from the fence within the bytes every key here shares,
                    // so it lies above them all exactly when it lies above the fence.
                    key > fence.as_slice()
                };
                if above {
                    if chunk.len() < CHUNK {
                        chunk.admit(fence.as_slice(), key, &key_of);
                        chunk.entries.push(Entry { window: window(key, chunk.skip), slot });
                    } else {
                        // Ascending keys leave full chunks behind, not half-full ones. The
                        // new chunk skips what the key shares with the last fence: the keys
                        // that follow it most likely share that much too.
                        let skip = shared(fence.as_slice(), key);
                        self.chunks.insert(Key::new(key), Chunk::starting(key, slot, skip));
                    }
                    self.len += 1;
                    return true;
                }
            }
        }
        let upper = match self.chunks.range_mut::<[u8], _>((Bound::Unbounded, Bound::Included(key))).next_back() {
            Some((fence, chunk)) => {
                let skip = chunk.skip;
                if within_skip(fence.as_slice(), key, skip) {
                    let (at, found) = chunk.search(key, &key_of);
                    if found {
                        return false;
                    }
                    chunk.insert_at(at, Entry { window: window(key, skip), slot });
                } else {
                    // Above the fence and apart from it within the skip: above every key of
                    // the chunk, and not held.
                    chunk.admit(fence.as_slice(), key, &key_of);
                    chunk.insert_at(chunk.len(), Entry { window: window(key, chunk.skip), slot });
                }
                chunk.split_if_full().map(|upper| (upper, fence.clone()))
            }
            None => {
                // Below every fence, so below every key: the first chunk takes it, filed
                // under the new key as its fence.
                let mut chunk = match self.chunks.pop_first() {
                    Some((fence, mut chunk)) => {
                        chunk.admit(fence.as_slice(), key, &key_of);
                        chunk.insert_at(0, Entry { window: window(key, chunk.skip), slot });
                        chunk
                    }
                    None => Chunk::starting(key, slot, 0),
                };
                let fence = Key::new(key);
                let upper = chunk.split_if_full().map(|upper| (upper, fence.clone()));
                self.chunks.insert(fence, chunk);
                upper
            }
        };
        self.len += 1;
        if let Some((upper, lower_fence)) = upper {
            self.file_split(lower_fence, upper, &key_of);
        }
        true
    }

    /// Files the upper half of a split chunk, and sharpens both halves' skips to what their
    /// bounds share.
    fn file_split<'a>(&mut self, lower_fence: Key, mut upper: Chunk, key_of: &impl Fn(u32) -> &'a [u8]) {
        let Some(first) = upper.entries.first() else { return };
        let fence = Key::new(key_of(first.slot));
        if let Some(lower) = self.chunks.get_mut(lower_fence.as_slice()) {
            lower.sharpen(shared(lower_fence.as_slice(), fence.as_slice()), key_of);
        }
        let bound = match self.chunks.range::<[u8], _>((Bound::Excluded(fence.as_slice()), Bound::Unbounded)).next() {
            Some((next, _)) => shared(fence.as_slice(), next.as_slice()),
            None => upper.entries.last().map_or(0, |e| shared(fence.as_slice(), key_of(e.slot))),
        };
        upper.sharpen(bound, key_of);
        self.chunks.insert(fence, upper);
    }

    /// Removes the slot whose key is `key`; returns it, or `None` if no slot has that key.
    pub fn remove<'a>(&mut self, key: &[u8], key_of: impl Fn(u32) -> &'a [u8]) -> Option<u32> {
        let (fence, chunk) = self.chunks.range_mut::<[u8], _>((Bound::Unbounded, Bound::Included(key))).next_back()?;
        if !within_skip(fence.as_slice(), key, chunk.skip) {
            return None; // Every key held here starts with those bytes.
        }
        let (at, found) = chunk.search(key, &key_of);
        if !found {
            return None;
        }
        let slot = chunk.entries.remove(at).slot;
        self.len -= 1;
        let (fence, left) = (fence.clone(), chunk.len());
        if left == 0 {
            self.chunks.remove(fence.as_slice());
        } else if left < CHUNK / 4 {
            self.merge_with_neighbour(&fence, &key_of);
        }
        Some(slot)
    }

    /// Joins the chunk filed under `fence` with its neighbour before or after it, if the two
    /// fit in one chunk: deletes (of the oldest keys first, as often as at random) leave no
    /// long trail of nearly empty chunks.
    fn merge_with_neighbour<'a>(&mut self, fence: &Key, key_of: &impl Fn(u32) -> &'a [u8]) {
        let here = self.chunks.get(fence.as_slice()).map_or(usize::MAX, Chunk::len);
        let fits = |(f, c): (&Key, &Chunk)| (here.saturating_add(c.len()) <= CHUNK).then(|| f.clone());
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
        if let Some(mut moved) = self.chunks.remove(from.as_slice()) {
            if let Some(chunk) = self.chunks.get_mut(into.as_slice()) {
                // Both halves' keys share what the two fences share, within each skip.
                let skip = chunk.skip.min(moved.skip).min(shared(into.as_slice(), from.as_slice()));
                if skip < chunk.skip {
                    chunk.reskip(skip, key_of);
                }
                if skip < moved.skip {
                    moved.reskip(skip, key_of);
                }
                chunk.entries.reserve_exact(moved.len());
                chunk.entries.extend(moved.entries);
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
            for chunk in self.chunks.range::<[u8], _>((from, Bound::Unbounded)).map(|(_, c)| &c.entries) {
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
            for chunk in self.chunks.range::<[u8], _>((Bound::Unbounded, end)).rev().map(|(_, c)| &c.entries) {
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
        self.chunks.values().flat_map(|c| &c.entries).map(|e| e.slot)
    }

    /// Every slot with what this order knows of its key's [`Prefix`], in key order.
    pub fn entries(&self) -> impl Iterator<Item = (Prefix, u32)> + '_ {
        self.chunks.iter().flat_map(|(fence, c)| {
            c.entries.iter().map(move |e| (known_prefix(fence.as_slice(), c.skip, e.window), e.slot))
        })
    }

    /// Checks every invariant in the module comment.
    #[cfg(test)]
    pub fn check<'a>(&self, key_of: impl Fn(u32) -> &'a [u8]) {
        let mut previous: Option<&[u8]> = None;
        let mut count = 0;
        let mut seen = std::collections::HashSet::new();
        for (fence, chunk) in &self.chunks {
            assert!(chunk.len() > 0 && chunk.len() <= CHUNK, "chunk of {}", chunk.len());
            if let Some(p) = previous {
                assert!(fence.as_slice() > p, "fence {fence:?} not above the previous key {p:?}");
            }
            let skip = chunk.skip;
            for &Entry { window: w, slot } in &chunk.entries {
                let key = key_of(slot);
                assert_eq!(
                    key.get(..skip),
                    fence.as_slice().get(..skip),
                    "key {key:?} apart from fence {fence:?} within skip {skip}"
                );
                assert_eq!(w, window(key, skip), "a stale window");
                let known = known_prefix(fence.as_slice(), skip, w);
                assert_eq!(known.order(Prefix::of(key)), None, "entries() misstates {key:?}");
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
            order.chunks.values().map(|c| (c.len(), c.entries.capacity())).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        assert_eq!(held, names.len());
        assert!(
            order.chunks.values().all(|c| c.entries.capacity() <= c.len() + GROW),
            "a chunk has more than GROW spare"
        );
        assert!(room * 100 < held * 115, "{room} entries of room for {held} held");
    }

    /// Slab reads per insert (a cache miss each in a large table) with keys that share long
    /// prefixes: the skips rise past them, so a search reads about as little as with keys that
    /// differ early (measured: 0.03 for big-endian ids below 2^40, whose first 3 bytes are zero;
    /// 0.91 `user:`; 0.73 `/registry/`). Kept at skip 0, every window of those keys ties, and an
    /// insert read the slab at each of its ~7 steps (7.2 measured for the ids).
    #[test]
    fn keys_with_a_long_shared_prefix_are_searched_past_it() {
        use std::cell::Cell;
        let mix = |i: u64| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 24;
        let families = ["ids", "user", "registry"];
        for family in families {
            let make = |i: u64| match family {
                "ids" => mix(i).to_be_bytes().to_vec(),
                "user" => format!("user:{:012}", mix(i)).into_bytes(),
                _ => format!("/registry/pods/default/pod-{:010}", mix(i)).into_bytes(),
            };
            let names: Vec<Vec<u8>> = (0..20_000u64).map(make).collect();
            let reads = Cell::new(0u64);
            let key_of = |s: u32| {
                reads.set(reads.get() + 1);
                names[s as usize].as_slice()
            };
            let mut order = SlotOrder::default();
            for s in 0..names.len() as u32 {
                assert!(order.insert(&names[s as usize], s, key_of), "{family}");
            }
            let per_insert = reads.get() as f64 / names.len() as f64;
            order.check(|s: u32| names[s as usize].as_slice());
            assert!(per_insert < 1.5, "{family}: {per_insert:.2} slab reads an insert");
            // A remove reads the slab to confirm the key it found (twice, as the search and
            // the match both compare it) and little more; the merges break no invariant.
            reads.set(0);
            for s in (0..names.len() as u32).rev() {
                assert_eq!(order.remove(&names[s as usize], key_of), Some(s), "{family}");
                if s % 1_999 == 0 {
                    order.check(|s: u32| names[s as usize].as_slice());
                }
            }
            let per_remove = reads.get() as f64 / names.len() as f64;
            assert!(per_remove < 3.5, "{family}: {per_remove:.2} slab reads a remove");
            assert_eq!(order.len(), 0);
        }
    }

    /// A key that joins a chunk without the bytes its skip stands for lowers the skip: below
    /// every fence, after a long run of ascending keys, and when two chunks merge.
    #[test]
    fn a_key_apart_from_a_chunk_s_shared_bytes_lowers_its_skip() {
        let mut names: Vec<Vec<u8>> =
            (0..3 * CHUNK as u32).map(|i| format!("order/2026/{i:06}").into_bytes()).collect();
        names.extend([b"order/".to_vec(), b"a".to_vec(), b"order/2026/000100x".to_vec(), b"zz".to_vec()]);
        let key_of = |s: u32| names[s as usize].as_slice();
        let mut order = SlotOrder::default();
        for s in 0..3 * CHUNK as u32 {
            assert!(order.insert(key_of(s), s, key_of));
        }
        assert!(order.chunks.values().skip(1).all(|c| c.skip >= 11), "ascending chunks skip their shared bytes");
        for s in 3 * CHUNK as u32..names.len() as u32 {
            assert!(order.insert(key_of(s), s, key_of), "{:?}", names[s as usize]);
            order.check(key_of);
        }
        assert!(!order.insert(key_of(7), 7, key_of));
        for s in (0..3 * CHUNK as u32).filter(|s| s % 8 != 0) {
            assert_eq!(order.remove(key_of(s), key_of), Some(s));
        }
        order.check(key_of);
        let mut sorted: Vec<&[u8]> =
            (0..names.len() as u32).filter(|s| *s >= 3 * CHUNK as u32 || s % 8 == 0).map(key_of).collect();
        sorted.sort();
        assert_eq!(order.iter().map(key_of).collect::<Vec<_>>(), sorted);
        // A sorted build of the same keys, from prefixes known to 4 bytes only (as a merge
        // passes on what an order knew), holds the same keys under the same invariants.
        let known4 = |k: &[u8]| {
            let whole = Prefix::of(k);
            Prefix { bits: whole.bits & !(u64::MAX >> 32), known: 4 }
        };
        let rebuilt = SlotOrder::from_sorted(order.iter().map(|s| (known4(key_of(s)), s)), key_of);
        rebuilt.check(key_of);
        assert_eq!(rebuilt.iter().collect::<Vec<_>>(), order.iter().collect::<Vec<_>>());
    }

    #[test]
    fn a_sorted_build_holds_full_chunks_and_appends_after_it() {
        let names: Vec<Vec<u8>> = (0..1_000u32).map(|i| format!("k{i:05}").into_bytes()).collect();
        let key_of = |s: u32| names[s as usize].as_slice();
        let mut order = SlotOrder::from_sorted((0..900).map(|s| (Prefix::of(key_of(s)), s)), key_of);
        order.check(key_of);
        assert_eq!(order.chunks.len(), 900usize.div_ceil(CHUNK));
        for s in 900..1_000 {
            assert!(order.insert(key_of(s), s, key_of));
        }
        // A key already held is refused; one below every key lowers the first fence.
        assert!(!order.insert(key_of(5), 5, key_of));
        order.check(key_of);
        assert_eq!(order.iter().collect::<Vec<_>>(), (0..1_000).collect::<Vec<_>>());
        assert!(
            order.entries().all(|(p, s)| p.order(Prefix::of(key_of(s))).is_none()),
            "entries agree with their keys"
        );
        assert_eq!(SlotOrder::from_sorted(std::iter::empty(), key_of).len(), 0);
        // A small table's one chunk is small; grown past a full chunk and split, it is not
        // left with the doubled room.
        let mut small = SlotOrder::default();
        assert!(small.insert(key_of(500), 500, key_of));
        assert!(small.chunks.values().all(|c| c.entries.capacity() < 16));
        for s in (0..CHUNK as u32 + 1).rev() {
            assert!(small.insert(key_of(s), s, key_of));
        }
        small.check(key_of);
        assert!(small.chunks.values().all(|c| c.entries.capacity() <= CHUNK + 1), "a chunk kept its doubled room");
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
