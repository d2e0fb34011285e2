//! The in-memory MVCC index: tables of version chains.
//!
//! Each table keeps a hash map from key to version chain (point reads cost one hash lookup,
//! whatever the table size) and the same keys' slots in key order (range scans). A chain is
//! newest-first, so a reader at the latest snapshot stops at the head: read cost does not grow
//! with chain depth. Versions no live snapshot can see are pruned when a key is written and by
//! the background collector.
//!
//! The index never does I/O and never decides visibility on its own: callers pass the snapshot
//! timestamp, and only the group-commit leader (or recovery) applies writes.

use std::borrow::Borrow;
use std::hash::{Hash, Hasher};
use std::ops::Bound;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::digest::StateDigest;
use crate::huge::HugePages;
use crate::order::{prefix, shared, Prefix, SlotOrder};
use crate::slot_table::SlotTable;
use crate::value_arena::{ValueArena, ValueRef};

const INLINE: usize = 22;

/// Keys per stage of [`TableData::get_many`]: about as many cache misses as a core keeps in
/// flight.
const MULTI_GET_BATCH: usize = 16;

/// Runs of at least this many writes are applied in the hash table's home-group order
/// ([`TableData::apply_run`]).
pub(crate) const RUN_SORT_MIN: usize = 64;

/// Writes of a sorted run whose home groups are touched together before they are applied.
const APPLY_STAGE: usize = 16;

/// A key, stored inline when short (no heap allocation for keys up to 22 bytes).
#[derive(Clone)]
pub(crate) enum Key {
    Inline { len: u8, bytes: [u8; INLINE] },
    Heap(Box<[u8]>),
}

impl Key {
    pub fn new(k: &[u8]) -> Key {
        if k.len() <= INLINE {
            let mut bytes = [0u8; INLINE];
            if let Some(dst) = bytes.get_mut(..k.len()) {
                dst.copy_from_slice(k);
            }
            Key::Inline { len: k.len() as u8, bytes }
        } else {
            Key::Heap(k.into())
        }
    }
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Key::Inline { len, bytes } => bytes.get(..*len as usize).unwrap_or_default(),
            Key::Heap(b) => b,
        }
    }
}

impl Borrow<[u8]> for Key {
    fn borrow(&self) -> &[u8] {
        self.as_slice()
    }
}

impl AsRef<[u8]> for Key {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}
/// The inline bytes as three big-endian words (8 + 8 + 6 bytes). The bytes past `len` are
/// always zero ([`Key::new`] never writes them), so comparing the words and then the lengths
/// orders two inline keys exactly as comparing their slices does: a key that is a prefix of
/// another pads with zeros, which no byte sorts below, and ties only where the rest of the
/// longer key is zeros, which the length then breaks the way slice order does.
#[inline]
fn inline_words(bytes: &[u8; INLINE]) -> (u64, u64, u64) {
    let mut w = [[0u8; 8]; 3];
    w[0].copy_from_slice(&bytes[..8]);
    w[1].copy_from_slice(&bytes[8..16]);
    w[2][..6].copy_from_slice(&bytes[16..]);
    (u64::from_be_bytes(w[0]), u64::from_be_bytes(w[1]), u64::from_be_bytes(w[2]))
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Key::Inline { len: a, bytes: x }, Key::Inline { len: b, bytes: y }) => a == b && x == y,
            _ => self.as_slice() == other.as_slice(),
        }
    }
}
impl Eq for Key {}
impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Key {
    /// Byte order. Two inline keys (the common case: keys up to 22 bytes) compare as three
    /// words and a length instead of through `memcmp`; fence lookups and sorts spend most of
    /// their time here.
    #[inline]
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        match (self, other) {
            (Key::Inline { len: a, bytes: x }, Key::Inline { len: b, bytes: y }) => {
                inline_words(x).cmp(&inline_words(y)).then(a.cmp(b))
            }
            _ => self.as_slice().cmp(other.as_slice()),
        }
    }
}
impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_slice().hash(state);
    }
}
impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.as_slice())
    }
}

/// `a == b`, without a call to `memcmp` for keys of 8 to 16 bytes (the usual ids and
/// hashed keys): their first and last 8 bytes, which overlap, cover them. A hash probe
/// compares the key sought with its slot's key once per tag match.
#[inline]
fn same_key(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    if (8..=16).contains(&a.len()) {
        let words = |s: &[u8]| (s.first_chunk::<8>().copied(), s.last_chunk::<8>().copied());
        return words(a) == words(b);
    }
    a == b
}

/// An older version of a key. `value == None` is a tombstone (deleted at `ts`). The value's
/// bytes live in the table's [`ValueArena`], which the table frees them from when it drops the
/// version ([`free_chain`]): a version dropped any other way keeps its block until the table
/// goes. The newest version of each key is not one of these: it lives in the key's [`Slot`].
#[derive(Debug)]
pub(crate) struct Version {
    pub ts: u64,
    pub value: Option<ValueRef>,
    pub older: Option<Box<Version>>,
}

/// A chain of versions goes one link at a time: the derived drop would recurse once per
/// version, and a key with history keeps thousands of them (a table dropped by a snapshot
/// install overflowed a runtime worker's stack that way).
impl Drop for Version {
    fn drop(&mut self) {
        let mut next = self.older.take();
        while let Some(mut v) = next {
            next = v.older.take();
        }
    }
}

/// Drops `v` and every older version, giving their values back to `values`.
fn free_chain(values: &mut ValueArena, v: Version) {
    let mut next = Some(v);
    while let Some(mut v) = next {
        if let Some(r) = v.value.take() {
            values.free(r);
        }
        next = v.older.take().map(|b| *b);
    }
}

/// A horizon no collection reaches: the chain has no second version (timestamps stay below
/// it: [`MAX_TS`]).
const GC_NEVER: u64 = (1 << 63) - 1;

/// The largest commit timestamp a store accepts. Recovery refuses a checkpoint or log frame
/// above it as corrupt: a slot keeps the collector's flag in the bit above it (`QUEUED`), and
/// `GC_NEVER` must stay out of reach. The sequencer counts up by one from 0, so it would take
/// 2^63 commits to get here.
pub(crate) const MAX_TS: u64 = GC_NEVER - 1;

/// The largest timestamp an installed checkpoint may start a store's log at. Commits after an
/// install count up by one from its timestamp, so the argument above needs room: from here it
/// would take 2^62 commits (millennia at millions a second) to reach [`MAX_TS`]. A received
/// stream or an install past it is an invalid argument.
pub(crate) const MAX_INSTALL_TS: u64 = 1 << 62;

impl Version {
    /// The version visible at `snapshot`: the newest with `ts <= snapshot`.
    pub fn visible(&self, snapshot: u64) -> Option<&Version> {
        let mut v = self;
        loop {
            if v.ts <= snapshot {
                return Some(v);
            }
            v = v.older.as_deref()?;
        }
    }

    /// Drops every version older than the one visible at `horizon`, where `newer_ts` is the
    /// timestamp of the version just newer than this one. Returns the chain's new
    /// [`History::prunable_at`]: the timestamp of its second-oldest version (pruning frees
    /// something only once the horizon reaches it).
    fn prune(&mut self, horizon: u64, mut newer_ts: u64, values: &mut ValueArena) -> u64 {
        let mut v = self;
        loop {
            if v.ts <= horizon {
                if let Some(rest) = v.older.take() {
                    free_chain(values, *rest);
                }
                return newer_ts;
            }
            match v.older.as_deref_mut() {
                Some(next) => {
                    newer_ts = v.ts;
                    v = next;
                }
                None => return newer_ts,
            }
        }
    }

    #[cfg(test)]
    fn depth(&self) -> usize {
        let mut n = 1;
        let mut v = self;
        while let Some(next) = v.older.as_deref() {
            n += 1;
            v = next;
        }
        n
    }
}

pub(crate) use crate::types::FastMap;

/// Copied-out `(key, value)` pairs, in scan order.
pub(crate) type Entries = Vec<(Vec<u8>, Vec<u8>)>;

/// The slot slab and the hash table over it: the arrays a point read misses on, kept in huge
/// pages once they reach 2 MiB (`huge.rs`).
#[derive(Debug)]
struct Slots(allocator_api2::vec::Vec<Slot, HugePages>);
type SlotIndex = SlotTable;

impl Default for Slots {
    fn default() -> Self {
        Slots(allocator_api2::vec::Vec::new_in(HugePages))
    }
}

impl std::ops::Deref for Slots {
    type Target = allocator_api2::vec::Vec<Slot, HugePages>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Slots {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

/// A key and its versions, newest first: the newest (the head) inline, the older ones in a
/// boxed [`History`] that most keys never have. Free slots have an empty key and no value.
///
/// 48 bytes (key 24, head timestamp and the collector's flag 8, head value 8, history 8): the
/// slab is most of a key's fixed memory, so every field is here only because a read or a
/// write of most keys needs it. What only chains with history need (the collector's horizon)
/// lives in the history's box. In this order (`repr(C)`), what a read touches (key, timestamp,
/// value) is the first 40 bytes.
#[derive(Debug)]
#[repr(C)]
struct Slot {
    key: Key,
    /// The head's commit timestamp, and in the top bit ([`QUEUED`]) whether the key is on the
    /// collector's candidate list (each key is on it at most once). Timestamps stay below
    /// [`GC_NEVER`], so the bit is never a timestamp's.
    stamp: u64,
    /// The head's value; `None` is a tombstone.
    value: Option<ValueRef>,
    older: Option<Box<History>>,
}

/// The collector's flag in [`Slot::stamp`].
const QUEUED: u64 = 1 << 63;

/// The versions of a key below its head, and what the collector needs without walking them:
/// without `prunable_at` every write (and every collector visit) walked the whole chain, and
/// with history kept, chains are long and writes became quadratic.
#[derive(Debug)]
struct History {
    /// The timestamp of the chain's second-oldest version (the head counts): pruning frees
    /// something only once the horizon reaches it.
    prunable_at: u64,
    /// The version just below the head.
    newest: Version,
}

impl Slot {
    fn new(key: &[u8], ts: u64, value: Option<ValueRef>) -> Slot {
        debug_assert!(ts <= GC_NEVER, "a timestamp in the collector's flag bit");
        Slot { key: Key::new(key), stamp: ts & !QUEUED, value, older: None }
    }

    /// The head's commit timestamp.
    #[inline]
    fn ts(&self) -> u64 {
        self.stamp & !QUEUED
    }

    fn set_ts(&mut self, ts: u64) {
        debug_assert!(ts <= GC_NEVER, "a timestamp in the collector's flag bit");
        self.stamp = (self.stamp & QUEUED) | (ts & !QUEUED);
    }

    /// Whether the key is on the collector's candidate list.
    fn queued(&self) -> bool {
        self.stamp & QUEUED != 0
    }

    fn set_queued(&mut self, queued: bool) {
        self.stamp = if queued { self.stamp | QUEUED } else { self.stamp & !QUEUED };
    }

    fn vacant() -> Slot {
        Slot::new(&[], 0, None)
    }

    /// The value visible at `snapshot`: `None` when no version is visible or the visible
    /// one is a tombstone.
    #[inline]
    fn visible_value(&self, snapshot: u64) -> Option<ValueRef> {
        if self.ts() <= snapshot {
            return self.value;
        }
        self.older.as_deref()?.newest.visible(snapshot)?.value
    }

    /// See [`History::prunable_at`]; [`GC_NEVER`] without history.
    fn prunable_at(&self) -> u64 {
        self.older.as_deref().map_or(GC_NEVER, |h| h.prunable_at)
    }

    /// The lowest horizon at which collecting this chain frees something: pruning from the
    /// second-oldest version's timestamp on, or removing a lone tombstone from its own.
    fn gc_due_at(&self) -> u64 {
        if self.value.is_none() && self.older.is_none() {
            self.ts()
        } else {
            self.prunable_at()
        }
    }

    /// Makes `(ts, value)` the head; the old head becomes the newest older version. Called
    /// with the old head's value already accounted for by the caller; frees nothing.
    fn push_head(&mut self, ts: u64, value: Option<ValueRef>) {
        let below = Version { ts: self.ts(), value: self.value, older: None };
        match self.older.as_deref_mut() {
            // Two versions now: the new head is the second-oldest.
            None => self.older = Some(Box::new(History { prunable_at: ts, newest: below })),
            Some(history) => {
                let older = std::mem::replace(&mut history.newest, below);
                history.newest.older = Some(Box::new(older));
            }
        }
        self.set_ts(ts);
        self.value = value;
    }

    /// Drops every version older than the one visible at `horizon`.
    fn prune(&mut self, horizon: u64, values: &mut ValueArena) {
        let ts = self.ts();
        if ts <= horizon {
            if let Some(history) = self.older.take() {
                free_chain(values, history.newest);
            }
        } else if let Some(history) = self.older.as_deref_mut() {
            history.prunable_at = history.newest.prune(horizon, ts, values);
        }
    }

    /// Gives every version's value back to `values`.
    fn free_values(self, values: &mut ValueArena) {
        if let Some(r) = self.value {
            values.free(r);
        }
        if let Some(history) = self.older {
            free_chain(values, history.newest);
        }
    }

    #[cfg(test)]
    fn depth(&self) -> usize {
        1 + self.older.as_deref().map_or(0, |h| h.newest.depth())
    }
}

/// The keys and versions of one table.
///
/// Layout, chosen for memory per key and cache misses per point read: the chains live in a
/// dense slab (`slots`), a hash table maps a key to its slot number (a 1-byte tag and a 4-byte
/// slot number per entry, in one cache line per probe: `slot_table.rs`; it stays
/// cache-resident far longer than one holding whole entries), and the slot numbers
/// in key order ([`SlotOrder`]) serve range scans.
#[derive(Debug, Default)]
pub(crate) struct TableData {
    slots: Slots,
    /// The versions' value bytes.
    values: ValueArena,
    free: Vec<u32>,
    index: SlotIndex,
    hasher: foldhash::fast::RandomState,
    order: SlotOrder,
    /// Keys whose head is a tombstone or that have older versions: the collector's work list.
    gc_candidates: Vec<Key>,
    /// The collector visits the list in passes. Keys the current pass has still to visit
    /// (0: no pass under way).
    gc_pass_left: usize,
    /// Lowest [`Slot::gc_due_at`] among the keys the current pass kept on the list.
    gc_pass_min: u64,
    /// Lowest `gc_due_at` among the keys the last complete pass kept: below that horizon a new
    /// pass could free nothing (0, the default, means "unknown": always due).
    gc_next: u64,
    /// Lowest `gc_due_at` of keys queued or changed by writes since the current or last pass
    /// began (0: unknown).
    gc_written_min: u64,
    /// While recovery replays the log: slots of keys inserted since [`TableData::defer_order`],
    /// not yet in `order` (some may have been removed again). `None` outside recovery.
    order_pending: Option<Vec<u32>>,
    /// A key was removed from the index while `order_pending` was kept: the pending list may
    /// name slots that are free or reused, or a slot twice (recovery removes none).
    order_pending_removed: bool,
    /// Live (non-tombstone head) keys and their key+value bytes, at the newest applied version.
    live_keys: u64,
    live_bytes: u64,
}

/// A range for scans, already validated (start <= end).
#[derive(Debug, Clone)]
pub(crate) struct KeyRange {
    pub start: Bound<Vec<u8>>,
    pub end: Bound<Vec<u8>>,
}

impl KeyRange {
    /// True when no key can fall inside.
    pub fn is_empty(&self) -> bool {
        match (&self.start, &self.end) {
            (Bound::Included(s), Bound::Included(e)) => s > e,
            (Bound::Included(s), Bound::Excluded(e))
            | (Bound::Excluded(s), Bound::Included(e))
            | (Bound::Excluded(s), Bound::Excluded(e)) => s >= e,
            _ => false,
        }
    }

    pub fn contains(&self, key: &[u8]) -> bool {
        let after_start = match &self.start {
            Bound::Included(s) => key >= s.as_slice(),
            Bound::Excluded(s) => key > s.as_slice(),
            Bound::Unbounded => true,
        };
        let before_end = match &self.end {
            Bound::Included(e) => key <= e.as_slice(),
            Bound::Excluded(e) => key < e.as_slice(),
            Bound::Unbounded => true,
        };
        after_start && before_end
    }

    fn as_refs(&self) -> (Bound<&[u8]>, Bound<&[u8]>) {
        (as_ref(&self.start), as_ref(&self.end))
    }
}

pub(crate) fn as_ref(b: &Bound<Vec<u8>>) -> Bound<&[u8]> {
    match b {
        Bound::Included(v) => Bound::Included(v.as_slice()),
        Bound::Excluded(v) => Bound::Excluded(v.as_slice()),
        Bound::Unbounded => Bound::Unbounded,
    }
}

impl TableData {
    fn hash(&self, key: &[u8]) -> u64 {
        use std::hash::BuildHasher;
        self.hasher.hash_one(key)
    }

    /// Reads the home hash group of `key` (a byte of it, for the caller to consume), so that
    /// its cache miss is under way before the key is looked up: see
    /// `StateBuilder::touch_writes`.
    pub fn touch_key(&self, key: &[u8]) -> u8 {
        self.index.touch(self.hash(key))
    }

    fn find(&self, key: &[u8]) -> Option<&Slot> {
        let slots = &self.slots;
        let slot = self
            .index
            .find(self.hash(key), |i| slots.get(i as usize).is_some_and(|s| same_key(s.key.as_slice(), key)))?;
        self.slots.get(slot as usize)
    }

    fn slot_of(&self, key: &[u8]) -> Option<usize> {
        let slots = &self.slots;
        self.index
            .find(self.hash(key), |i| slots.get(i as usize).is_some_and(|s| same_key(s.key.as_slice(), key)))
            .map(|i| i as usize)
    }

    /// Replaces a full hash table by one twice its size, built from the slab: slots read in
    /// order, inserted in the order [`fill_index`] picks. The table never reads a
    /// key, so it cannot rehash in place; the slab's keys are read in order instead of from
    /// random slots. Twice the capacity, not twice the keys: one more key than the capacity
    /// would round up to four times as many groups.
    fn grow_index(&mut self) {
        let live = self.index.len();
        self.rebuild_index(self.index.capacity().saturating_mul(2).max(live + 1).max(16));
    }

    /// Replaces the hash table by one sized for `capacity` keys (at least the live ones).
    fn rebuild_index(&mut self, capacity: usize) {
        let live = self.index.len();
        let hashes: Vec<u64> = self.slots.iter().map(|s| self.hash(s.key.as_slice())).collect();
        let mut free = vec![false; if self.free.is_empty() { 0 } else { self.slots.len() }];
        for &n in &self.free {
            if let Some(f) = free.get_mut(n as usize) {
                *f = true;
            }
        }
        let mut index = SlotIndex::default();
        fill_index(&mut index, &self.slots, &hashes, capacity.max(live), &free);
        debug_assert_eq!(index.len(), live, "the rebuilt table holds a different number of keys");
        self.index = index;
    }

    /// Adds `key`, which the table does not hold, under its `hash`; returns its slot.
    fn insert_new(&mut self, hash: u64, key: &[u8], ts: u64, value: Option<ValueRef>) -> u32 {
        if self.index.len() >= self.index.capacity() {
            self.grow_index();
        }
        let slot = Slot::new(key, ts, value);
        let n = match self.free.pop() {
            Some(n) => {
                if let Some(s) = self.slots.get_mut(n as usize) {
                    *s = slot;
                }
                n
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        };
        let inserted = self.index.insert_unique(hash, n);
        debug_assert!(inserted, "the hash table grows before it fills");
        n
    }

    fn remove(&mut self, key: &[u8]) {
        // Out of the order first: finding it there reads the keys of its neighbours' slots.
        let slots = &self.slots;
        self.order.remove(key, |i| key_of(slots, i));
        let hash = self.hash(key);
        if let Some(n) =
            self.index.remove(hash, |i| slots.get(i as usize).is_some_and(|s| same_key(s.key.as_slice(), key)))
        {
            if let Some(s) = self.slots.get_mut(n as usize) {
                std::mem::replace(s, Slot::vacant()).free_values(&mut self.values);
                self.free.push(n);
            }
        }
        self.order_pending_removed |= self.order_pending.is_some();
    }

    /// Stops keeping the ordered set in step with inserts until [`TableData::finish_order`]:
    /// recovery replays many inserts in random key order, and one sort at the end costs far
    /// less than a tree descent per key. Scans are wrong until then; recovery runs none.
    pub fn defer_order(&mut self) {
        self.order_pending.get_or_insert_with(Vec::new);
    }

    /// Brings the ordered set back in step: exactly the keys the hash index holds.
    pub fn finish_order(&mut self) {
        let Some(pending) = self.order_pending.take() else { return };
        let removed = std::mem::take(&mut self.order_pending_removed);
        if pending.is_empty() {
            return;
        }
        let slots = &self.slots;
        let live: Vec<u32> = if removed {
            // A slot freed since it was listed, or freed and reused (listed twice), is either
            // gone from the table or named again by a later entry: keep each live slot once.
            let mut free = vec![false; slots.len()];
            for &n in &self.free {
                if let Some(f) = free.get_mut(n as usize) {
                    *f = true;
                }
            }
            let mut live: Vec<u32> = pending.into_iter().filter(|&n| free.get(n as usize) == Some(&false)).collect();
            live.sort_unstable();
            live.dedup();
            live
        } else {
            // Only new keys were inserted, each once: the list is exactly the missing slots,
            // and in slot order, so their keys are read front to back.
            pending
        };
        let keyed = sort_slots_by_key(live, |i| key_of(slots, i));
        if keyed.len() < self.order.len() / 16 {
            for (_, n) in keyed {
                self.order.insert(key_of(slots, n), n, |i| key_of(slots, i));
            }
        } else {
            // Two sorted runs, merged into a new order built front to back. Both carry their
            // keys' leading bytes: the slab is read only where those tie.
            let old = std::mem::take(&mut self.order);
            let mut held = old.entries().peekable();
            let mut added = keyed.into_iter().map(|(p, n)| (Prefix::exact(p), n)).peekable();
            let merged = std::iter::from_fn(|| match (held.peek(), added.peek()) {
                (Some(&(ph, h)), Some(&(pn, n)))
                    if ph.order(pn).unwrap_or_else(|| key_of(slots, h).cmp(key_of(slots, n)))
                        == std::cmp::Ordering::Less =>
                {
                    held.next()
                }
                (Some(_), Some(_)) | (None, _) => added.next(),
                (Some(_), None) => held.next(),
            });
            self.order = SlotOrder::from_sorted(merged, |i| key_of(slots, i));
        }
    }

    pub fn get(&self, key: &[u8], snapshot: u64) -> Option<Vec<u8>> {
        self.find(key)?.visible_value(snapshot).map(|r| self.values.get(r).to_vec())
    }

    /// [`TableData::get`] into the caller's buffer: replaces `out`'s contents with the value
    /// and returns true, or empties `out` and returns false. A reused buffer makes a read
    /// allocate nothing.
    pub fn get_into(&self, key: &[u8], snapshot: u64, out: &mut Vec<u8>) -> bool {
        out.clear();
        match self.find(key).and_then(|slot| slot.visible_value(snapshot)) {
            Some(r) => {
                out.extend_from_slice(self.values.get(r));
                true
            }
            None => false,
        }
    }

    /// [`TableData::get`] of each of `keys`, appended to `out` in order. The lookups go in
    /// batches of [`MULTI_GET_BATCH`], stage by stage: every key's hash-table group is read
    /// first, then the slot each group most likely points to, then the lookups proper (now in
    /// the cache), then every value, so that the cache misses of a stage (independent loads)
    /// overlap instead of each read's misses waiting for the one before.
    pub fn get_many<K: AsRef<[u8]>>(&self, keys: &[K], snapshot: u64, out: &mut Vec<Option<Vec<u8>>>) {
        out.reserve(keys.len());
        for batch in keys.chunks(MULTI_GET_BATCH) {
            let mut hashes = [0u64; MULTI_GET_BATCH];
            let mut touched = 0u8;
            for (h, key) in hashes.iter_mut().zip(batch) {
                *h = self.hash(key.as_ref());
                touched ^= self.index.touch(*h);
            }
            for &h in hashes.iter().take(batch.len()) {
                if let Some(slot) = self.index.likely(h).and_then(|n| self.slots.get(n as usize)) {
                    touched ^= slot.stamp as u8;
                }
            }
            let mut found = [None::<ValueRef>; MULTI_GET_BATCH];
            for ((f, key), &h) in found.iter_mut().zip(batch).zip(&hashes) {
                let key = key.as_ref();
                let slots = &self.slots;
                *f = self
                    .index
                    .find(h, |i| slots.get(i as usize).is_some_and(|s| same_key(s.key.as_slice(), key)))
                    .and_then(|n| slots.get(n as usize))
                    .and_then(|s| s.visible_value(snapshot));
            }
            for f in found.iter().take(batch.len()) {
                if let Some(r) = *f {
                    touched ^= self.values.get(r).first().copied().unwrap_or(0);
                }
            }
            std::hint::black_box(touched);
            out.extend(found.iter().take(batch.len()).map(|f| f.map(|r| self.values.get(r).to_vec())));
        }
    }

    /// Newest commit timestamp that wrote `key`, visible or not.
    #[cfg(test)]
    pub fn head_ts(&self, key: &[u8]) -> Option<u64> {
        self.find(key).map(Slot::ts)
    }

    /// Up to `limit` visible entries of `range` at `snapshot`, in order (or reverse order).
    /// Returns the entries and whether the range may hold more.
    pub fn scan_chunk(&self, range: &KeyRange, reverse: bool, snapshot: u64, limit: usize) -> (Entries, bool) {
        let mut out = Vec::new();
        if range.is_empty() {
            return (out, false);
        }
        let (slots, values) = (&self.slots, &self.values);
        let mut more = false;
        self.order.scan(
            range.as_refs(),
            reverse,
            |i| key_of(slots, i),
            |i| {
                let Some(slot) = slots.get(i as usize) else { return true };
                if let Some(r) = slot.visible_value(snapshot) {
                    if out.len() >= limit {
                        more = true;
                        return false;
                    }
                    out.push((slot.key.as_slice().to_vec(), values.get(r).to_vec()));
                }
                true
            },
        );
        (out, more)
    }

    /// Applies one write at `ts` (which must exceed every earlier write's), pruning versions no
    /// snapshot at or after `horizon` can see. Keeps the digest in step.
    pub fn apply(
        &mut self,
        table: &str,
        key: &[u8],
        value: Option<&[u8]>,
        ts: u64,
        horizon: u64,
        digest: &mut StateDigest,
    ) {
        self.apply_with(table, key, value, ts, horizon, digest, true);
    }

    /// [`TableData::apply`]; with `add` false, for a caller that has already added the new
    /// value's entry to `digest` (recovery hashes a run of a commit's new entries first: see
    /// `StateBuilder::apply_all`). The entry of a value it replaces is removed here either way.
    #[allow(clippy::too_many_arguments)]
    pub fn apply_with(
        &mut self,
        table: &str,
        key: &[u8],
        value: Option<&[u8]>,
        ts: u64,
        horizon: u64,
        digest: &mut StateDigest,
        add: bool,
    ) {
        let hash = self.hash(key);
        self.apply_value(table, key, hash, value, ts, horizon, digest, add);
    }

    /// Applies one commit's writes of a run of distinct keys, for recovery (`add` as in
    /// [`TableData::apply_with`]). The result equals applying them one by one in any order, as
    /// the keys are distinct; a long run is applied in the order of the home groups its keys
    /// probe, after growing the table once for all of them, so the probes sweep the table
    /// instead of missing the cache at a random place per key (a third of a WAL replay).
    #[allow(clippy::too_many_arguments)]
    pub fn apply_run(
        &mut self,
        table: &str,
        run: &[(&[u8], Option<&[u8]>)],
        ts: u64,
        horizon: u64,
        digest: &mut StateDigest,
        add: bool,
    ) {
        if run.len() < RUN_SORT_MIN {
            for &(key, value) in run {
                self.apply_with(table, key, value, ts, horizon, digest, add);
            }
            return;
        }
        let additional = run.iter().filter(|(_, v)| v.is_some()).count();
        if self.index.capacity() - self.index.len() < additional {
            self.rebuild_index(self.index.capacity().saturating_mul(2).max(self.index.len() + additional));
        }
        let mut order: Vec<(u64, u32)> =
            run.iter().enumerate().map(|(i, (key, _))| (self.hash(key), i as u32)).collect();
        order.sort_unstable_by_key(|&(hash, _)| self.index.home(hash));
        // In stages, as `get_many` reads: the home groups of a stage are touched first, so
        // their cache misses overlap instead of each probe waiting on its own.
        for stage in order.chunks(APPLY_STAGE) {
            let mut touched = 0u8;
            for &(hash, _) in stage {
                touched ^= self.index.touch(hash);
            }
            std::hint::black_box(touched);
            for &(hash, i) in stage {
                if let Some(&(key, value)) = run.get(i as usize) {
                    self.apply_value(table, key, hash, value, ts, horizon, digest, add);
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn apply_value(
        &mut self,
        table: &str,
        key: &[u8],
        hash: u64,
        value: Option<&[u8]>,
        ts: u64,
        horizon: u64,
        digest: &mut StateDigest,
        add: bool,
    ) {
        if let Some(v) = value {
            if add {
                digest.add(table, key, v);
            }
            self.live_keys += 1;
            self.live_bytes += (key.len() + v.len()) as u64;
        }
        let slots = &self.slots;
        let found = self.index.find(hash, |i| slots.get(i as usize).is_some_and(|s| same_key(s.key.as_slice(), key)));
        let mut pushed_candidate = false;
        match found.and_then(|n| self.slots.get_mut(n as usize)) {
            Some(slot) => {
                debug_assert!(slot.ts() < ts, "versions applied out of order");
                if let Some(old) = slot.value {
                    digest.remove(table, key, self.values.get(old));
                    self.live_keys -= 1;
                    self.live_bytes -= (key.len() + self.values.get(old).len()) as u64;
                }
                let value = value.map(|v| self.values.alloc(v));
                if slot.value.is_none() && slot.ts() <= horizon {
                    // A deleted key collected as far as anyone can see: no need to keep it.
                    if let Some(history) = slot.older.take() {
                        free_chain(&mut self.values, history.newest);
                    }
                    slot.set_ts(ts);
                    slot.value = value;
                } else {
                    slot.push_head(ts, value);
                    if horizon >= slot.prunable_at() {
                        slot.prune(horizon, &mut self.values);
                    }
                }
                // Each key is on the candidate list at most once.
                pushed_candidate = (slot.older.is_some() || slot.value.is_none()) && !slot.queued();
                if pushed_candidate {
                    slot.set_queued(true);
                }
                if slot.queued() {
                    self.gc_written_min = self.gc_written_min.min(slot.gc_due_at());
                }
            }
            None => {
                let Some(value) = value else {
                    return; // Deleting an absent key changes nothing.
                };
                let value = Some(self.values.alloc(value));
                let n = self.insert_new(hash, key, ts, value);
                match &mut self.order_pending {
                    Some(pending) => pending.push(n),
                    None => {
                        let slots = &self.slots;
                        self.order.insert(key, n, |i| key_of(slots, i));
                    }
                }
            }
        }
        if pushed_candidate {
            self.gc_candidates.push(Key::new(key));
        }
    }

    /// Makes `value` (`None`: absence) the key's only version, at timestamp 0, dropping every
    /// version it had. For recovery alone: it rewinds a key a checkpoint holds at its newest
    /// state to its value at the history floor, before the changes after the floor are
    /// applied again. Keeps the digest and the live counts in step.
    pub fn reset(&mut self, table: &str, key: &[u8], value: Option<&[u8]>, digest: &mut StateDigest) {
        if let Some(n) = self.slot_of(key) {
            if let Some(old) = self.slots.get(n).and_then(|s| s.value) {
                let old = self.values.get(old);
                digest.remove(table, key, old);
                self.live_keys -= 1;
                self.live_bytes -= (key.len() + old.len()) as u64;
            }
            self.remove(key);
        }
        if value.is_some() {
            let hash = self.hash(key);
            self.apply_value(table, key, hash, value, 0, 0, digest, true);
        }
    }

    /// Prunes the collector's candidates against `horizon`; removes keys whose only visible
    /// state is a tombstone nobody can see past. Returns how many candidates were processed.
    pub fn collect(&mut self, horizon: u64, budget: usize) -> usize {
        if self.gc_pass_left == 0 {
            // A new pass visits every key now on the list, including those written since the
            // last one began.
            self.gc_pass_left = self.gc_candidates.len();
            self.gc_pass_min = GC_NEVER;
            self.gc_written_min = GC_NEVER;
        }
        let take = self.gc_candidates.len().min(budget).min(self.gc_pass_left);
        let batch: Vec<Key> = self.gc_candidates.drain(..take).collect();
        let mut keep = Vec::new();
        for key in batch {
            let remove = match self.slot_of(key.as_slice()).and_then(|n| self.slots.get_mut(n)) {
                None => false,
                Some(slot) => {
                    slot.set_queued(false);
                    if horizon >= slot.prunable_at() {
                        slot.prune(horizon, &mut self.values);
                    }
                    if slot.value.is_none() && slot.older.is_none() && slot.ts() <= horizon {
                        true
                    } else {
                        if slot.older.is_some() || slot.value.is_none() {
                            slot.set_queued(true);
                            self.gc_pass_min = self.gc_pass_min.min(slot.gc_due_at());
                            keep.push(key.clone());
                        }
                        false
                    }
                }
            };
            if remove {
                self.remove(key.as_slice());
            }
        }
        // Chains still too young to prune go back on the list (each key is on it at most once).
        self.gc_candidates.extend(keep);
        self.gc_pass_left -= take;
        if self.gc_pass_left == 0 {
            self.gc_next = self.gc_pass_min;
        }
        take
    }

    /// Whether [`TableData::collect`] at `horizon` could free anything. False when the last
    /// complete pass found every listed chain too young for `horizon` and no write has queued
    /// or changed one since: a store keeping history (the cluster's state machine, where the
    /// horizon stays put until a compaction) then pays nothing per tick instead of revisiting
    /// every key it ever overwrote under the table's write lock.
    pub fn gc_due(&self, horizon: u64) -> bool {
        !self.gc_candidates.is_empty() && (self.gc_pass_left > 0 || horizon >= self.gc_next.min(self.gc_written_min))
    }

    #[cfg(test)]
    pub fn pending_gc(&self) -> usize {
        self.gc_candidates.len()
    }

    pub fn live_keys(&self) -> u64 {
        self.live_keys
    }

    pub fn live_bytes(&self) -> u64 {
        self.live_bytes
    }

    /// Every live entry at the newest version (used to update the digest when dropping).
    pub fn for_each_live(&self, mut f: impl FnMut(&[u8], &[u8])) {
        for slot in self.slots.iter() {
            if let Some(r) = slot.value {
                f(slot.key.as_slice(), self.values.get(r));
            }
        }
    }

    /// Depth of the chain for `key`.
    #[cfg(test)]
    pub fn chain_depth(&self, key: &[u8]) -> usize {
        self.find(key).map_or(0, Slot::depth)
    }
}

/// Builds a table from entries in strictly ascending key order, the order a checkpoint holds
/// them in, every version at timestamp 0. Ascending keys are distinct, so each one is new: no
/// lookup per key. The slab fills in order, which is already the ordered index's order; the
/// hash table (sized once) is built at the end by inserting in the order of the home groups
/// the keys land in, so its memory is written front to back instead of at a random place per key.
#[derive(Debug)]
pub(crate) struct SortedLoad {
    data: TableData,
    hashes: Vec<u64>,
}

/// A key that was not above the one loaded before it.
#[derive(Debug)]
pub(crate) struct OutOfOrder;

impl SortedLoad {
    /// A load of about `entries` entries (a hint: more are accepted).
    pub fn with_capacity(entries: usize) -> SortedLoad {
        let mut data = TableData::default();
        data.slots.reserve_exact(entries);
        SortedLoad { data, hashes: Vec::with_capacity(entries) }
    }

    /// Adds `key` with `value`. Refuses, adding nothing, a key not above the previous one.
    pub fn push(&mut self, key: &[u8], value: &[u8]) -> Result<(), OutOfOrder> {
        let data = &mut self.data;
        if data.slots.last().is_some_and(|last| last.key.as_slice() >= key) {
            return Err(OutOfOrder);
        }
        self.hashes.push(data.hash(key));
        let value_ref = data.values.alloc(value);
        data.slots.push(Slot::new(key, 0, Some(value_ref)));
        data.live_keys += 1;
        data.live_bytes += (key.len() + value.len()) as u64;
        Ok(())
    }

    /// Builds the hash table over everything pushed so far (pushing more after this is a bug).
    pub fn build_index(&mut self) {
        let TableData { slots, index, .. } = &mut self.data;
        fill_index(index, slots, &self.hashes, self.hashes.len(), &[]);
        self.hashes = Vec::new();
    }

    /// The table: the same as applying every pushed entry at timestamp 0 to an empty one. The
    /// slab is in key order, so the ordered index is its slot numbers counted up.
    pub fn finish(self) -> TableData {
        let SortedLoad { mut data, hashes } = self;
        let TableData { slots, index, order, .. } = &mut data;
        if index.len() != slots.len() {
            fill_index(index, slots, &hashes, hashes.len(), &[]);
        }
        let n = u32::try_from(slots.len()).unwrap_or(u32::MAX);
        *order = SlotOrder::from_sorted((0..n).map(|i| (Prefix::of(key_of(slots, i)), i)), |i| key_of(slots, i));
        data
    }
}

/// The key in slot `i` (empty for a slot past the end, which the callers never name).
fn key_of(slots: &[Slot], i: u32) -> &[u8] {
    slots.get(i as usize).map_or(&[], |s| s.key.as_slice())
}

/// Tables of at most `1 << SMALL_TABLE_BITS` groups (2 MiB) are filled in slot order.
const SMALL_TABLE_BITS: u32 = 15;

/// Fills `index` with slot `i` under `hashes[i]` for every slot not marked in `free` (which
/// is empty or one flag per slot), replacing it by a table sized for `capacity` keys (at
/// least those). Inserts into a table larger than the cache go in the order of the groups they
/// start probing at, so consecutive inserts touch neighbouring memory; any order gives an
/// equally good table.
fn fill_index(index: &mut SlotIndex, slots: &[Slot], hashes: &[u64], capacity: usize, free: &[bool]) {
    debug_assert!(slots.len() >= hashes.len(), "a hash for a slot past the slab");
    *index = SlotIndex::with_capacity(capacity.max(hashes.len() - free.iter().filter(|&&f| f).count()));
    let bits = index.home_bits();
    let is_free = |i: usize| free.get(i).copied().unwrap_or(false);
    if bits <= SMALL_TABLE_BITS {
        // A table of 2 MiB or less stays in the cache while it fills: the order costs more
        // than it saves.
        for (i, &hash) in hashes.iter().enumerate().filter(|&(i, _)| !is_free(i)) {
            let inserted = index.insert_unique(hash, i as u32);
            debug_assert!(inserted, "sized for every key");
        }
        return;
    }
    // (home << 32) | slot, sorted by home.
    let mut order: Vec<u64> = hashes
        .iter()
        .enumerate()
        .filter(|&(i, _)| !is_free(i))
        .map(|(i, &h)| ((index.home(h) as u64) << 32) | (i as u64 & 0xFFFF_FFFF))
        .collect();
    radix_sort_high(&mut order, bits);
    for entry in order {
        let i = entry as u32;
        if let Some(&hash) = hashes.get(i as usize) {
            let inserted = index.insert_unique(hash, i);
            debug_assert!(inserted, "sized for every key");
        }
    }
}

/// Slot numbers of distinct keys, sorted by key. Each is sorted as the 8 bytes of its key
/// that follow the prefix every one of the keys shares (a number: comparisons are one
/// instruction, not a key comparison, which made the sort a quarter of a WAL replay of 300k
/// one-put commits); only slots whose 8 bytes tie are then ordered by whole keys.
///
/// Why the 8 bytes order the keys: all share the first `common` bytes, so two keys compare
/// as their remainders do. Read big-endian and padded with zeros, a smaller window means a
/// smaller remainder: at the first byte where the windows differ, either both bytes are real
/// and decide, or the smaller is padding, so that key ended there and is a prefix of the
/// other. Equal windows decide nothing, hence the second pass.
fn sort_slots_by_key<'a>(slots: Vec<u32>, key_of: impl Fn(u32) -> &'a [u8]) -> Vec<(u64, u32)> {
    let mut keys = slots.iter().map(|&n| key_of(n));
    let Some(first) = keys.next() else { return Vec::new() };
    let common = keys.fold(first.len(), |c, k| c.min(shared(first, k)));
    let window = |key: &[u8]| prefix(key.get(common..).unwrap_or_default());
    let mut keyed: Vec<(u64, u32)> = slots.iter().map(|&n| (window(key_of(n)), n)).collect();
    sort_keys(&mut keyed);
    for tied in keyed.chunk_by_mut(|a, b| a.0 == b.0).filter(|run| run.len() > 1) {
        tied.sort_unstable_by(|a, b| key_of(a.1).cmp(key_of(b.1)));
    }
    // Each key's own prefix: the bytes all keys share, then its window's first bytes.
    let shared = prefix(first.get(..common.min(8)).unwrap_or_default());
    let whole = |window: u64| match common {
        0 => window,
        1..=7 => shared | window >> (8 * common),
        _ => shared,
    };
    keyed.into_iter().map(|(window, n)| (whole(window), n)).collect()
}

/// Sorts distinct keys; a long list on two threads (each half, then one merge pass).
fn sort_keys<T: Ord + Send>(keys: &mut [T]) {
    const TWO_THREADS_MIN: usize = 1 << 16;
    if keys.len() < TWO_THREADS_MIN {
        keys.sort_unstable();
        return;
    }
    let (low, high) = keys.split_at_mut(keys.len() / 2);
    let halves_sorted = std::thread::scope(|scope| {
        let other = std::thread::Builder::new().name("keeldb-sort".into()).spawn_scoped(scope, || low.sort_unstable());
        high.sort_unstable();
        other.is_ok_and(|h| h.join().is_ok())
    });
    if halves_sorted {
        // Two sorted runs: the stable sort finds them and merges once.
        keys.sort();
    } else {
        // The second thread could not start: sort it all here.
        keys.sort_unstable();
    }
}

/// Sorts by bits `32..32 + bits` (stable, least significant byte first).
fn radix_sort_high(values: &mut Vec<u64>, bits: u32) {
    let mut scratch = vec![0u64; values.len()];
    let mut shift = 32;
    while shift < 32 + bits {
        let mut counts = [0usize; 256];
        for v in values.iter() {
            if let Some(c) = counts.get_mut(((v >> shift) & 0xFF) as usize) {
                *c += 1;
            }
        }
        let mut next = [0usize; 256];
        let mut at = 0;
        for (n, c) in next.iter_mut().zip(counts) {
            *n = at;
            at += c;
        }
        for &v in values.iter() {
            if let Some(n) = next.get_mut(((v >> shift) & 0xFF) as usize) {
                if let Some(dst) = scratch.get_mut(*n) {
                    *dst = v;
                }
                *n += 1;
            }
        }
        std::mem::swap(values, &mut scratch);
        shift += 8;
    }
}

/// A table: an id, a name and its data, with the commit timestamps that created and dropped it.
#[derive(Debug)]
pub(crate) struct Table {
    pub id: u32,
    pub name: Arc<str>,
    pub created_ts: u64,
    pub dropped_ts: AtomicU64,
    pub data: RwLock<TableData>,
}

impl Table {
    pub fn new(id: u32, name: Arc<str>, created_ts: u64) -> Table {
        Table { id, name, created_ts, dropped_ts: AtomicU64::new(u64::MAX), data: RwLock::new(TableData::default()) }
    }
    pub fn visible_at(&self, snapshot: u64) -> bool {
        self.created_ts <= snapshot && snapshot < self.dropped_ts.load(Ordering::Acquire)
    }
}

/// The table catalog as applied to the index. Dropped tables stay until no snapshot can see
/// them, so old snapshots keep reading a dropped table's data.
#[derive(Debug, Default)]
pub(crate) struct Catalog {
    by_id: FastMap<u32, Arc<Table>>,
    /// Each name's tables, oldest first (a dropped table stays beside its successor until no
    /// snapshot can see it). The tables themselves, not ids: a read by name is one probe.
    by_name: FastMap<Arc<str>, Vec<Arc<Table>>>,
}

impl Catalog {
    pub fn table_at(&self, name: &str, snapshot: u64) -> Option<&Arc<Table>> {
        self.by_name.get(name)?.iter().rev().find(|t| t.visible_at(snapshot))
    }

    pub fn by_id(&self, id: u32) -> Option<&Arc<Table>> {
        self.by_id.get(&id)
    }

    /// Adds `table`; one already under its id is replaced in both maps.
    pub fn insert(&mut self, table: Arc<Table>) {
        if let Some(old) = self.by_id.insert(table.id, Arc::clone(&table)) {
            if let Some(tables) = self.by_name.get_mut(&old.name) {
                tables.retain(|t| !Arc::ptr_eq(t, &old));
                if tables.is_empty() {
                    self.by_name.remove(&old.name);
                }
            }
        }
        self.by_name.entry(Arc::clone(&table.name)).or_default().push(table);
    }

    /// Names of the user tables visible at `snapshot`, sorted (the engine's own are hidden).
    pub fn names_at(&self, snapshot: u64) -> Vec<String> {
        let mut names: Vec<String> = self
            .by_id
            .values()
            .filter(|t| t.visible_at(snapshot) && !crate::types::is_reserved(&t.name))
            .map(|t| t.name.to_string())
            .collect();
        names.sort();
        names
    }

    /// Tables live at the newest version.
    pub fn live(&self) -> Vec<Arc<Table>> {
        let mut tables: Vec<Arc<Table>> =
            self.by_id.values().filter(|t| t.dropped_ts.load(Ordering::Acquire) == u64::MAX).cloned().collect();
        tables.sort_by_key(|t| t.id);
        tables
    }

    pub fn all(&self) -> Vec<Arc<Table>> {
        self.by_id.values().cloned().collect()
    }

    /// Forgets dropped tables no snapshot at or after `horizon` can see.
    pub fn collect(&mut self, horizon: u64) {
        let gone: Vec<u32> =
            self.by_id.values().filter(|t| t.dropped_ts.load(Ordering::Acquire) <= horizon).map(|t| t.id).collect();
        for id in gone {
            if let Some(t) = self.by_id.remove(&id) {
                if let Some(tables) = self.by_name.get_mut(&t.name) {
                    tables.retain(|x| x.id != id);
                    if tables.is_empty() {
                        self.by_name.remove(&t.name);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn apply(t: &mut TableData, key: &[u8], value: Option<&[u8]>, ts: u64, horizon: u64) {
        let mut d = StateDigest::default();
        t.apply("t", key, value, ts, horizon, &mut d);
    }

    #[test]
    fn a_sorted_load_equals_applying_the_same_entries() {
        let keys: Vec<Vec<u8>> = (0..2_000u32)
            .map(|i| if i % 3 == 0 { format!("key-long-enough-for-the-heap-{i:06}") } else { format!("k{i:06}") })
            .map(String::into_bytes)
            .collect();
        let mut sorted = keys.clone();
        sorted.sort();
        let mut load = SortedLoad::with_capacity(10); // a low hint: the load grows past it
        let mut applied = TableData::default();
        for (i, k) in sorted.iter().enumerate() {
            let value = vec![i as u8; i % 50];
            load.push(k, &value).unwrap();
            apply(&mut applied, k, Some(&value), 0, 0);
        }
        // With the hash table built first, as recovery does.
        let mut again = SortedLoad::with_capacity(0);
        for k in &sorted {
            again.push(k, b"v").unwrap();
        }
        again.build_index();
        let again = again.finish();
        again.order.check(|i| key_of(&again.slots, i));
        assert_eq!(again.order.len(), sorted.len());
        assert!(sorted.iter().all(|k| again.get(k, 0).is_some()));
        // A key not above the last one is refused and changes nothing.
        assert!(load.push(sorted.last().unwrap(), b"x").is_err());
        assert!(load.push(b"", b"x").is_err());
        let loaded = load.finish();
        assert_eq!((loaded.live_keys(), loaded.live_bytes()), (applied.live_keys(), applied.live_bytes()));
        for k in &keys {
            assert_eq!(loaded.get(k, 0), applied.get(k, 0));
        }
        assert_eq!(loaded.get(b"absent", 0), None);
        let all = KeyRange { start: Bound::Unbounded, end: Bound::Unbounded };
        for reverse in [false, true] {
            assert_eq!(
                loaded.scan_chunk(&all, reverse, 0, usize::MAX),
                applied.scan_chunk(&all, reverse, 0, usize::MAX)
            );
        }
        // Later writes behave as on any table.
        let mut loaded = loaded;
        apply(&mut loaded, &sorted[5], None, 1, 1);
        apply(&mut loaded, b"new", Some(b"v"), 2, 2);
        assert_eq!(loaded.get(&sorted[5], 2), None);
        assert_eq!(loaded.get(b"new", 2).as_deref(), Some(&b"v"[..]));
        assert_eq!(loaded.live_keys(), applied.live_keys());
    }

    #[test]
    fn slots_sort_as_their_keys_do_whatever_prefix_they_share() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(40);
        let mut next = move || rng.gen::<u64>();
        for case in 0..40 {
            let shared: Vec<u8> = (0..case % 13).map(|i| b'a' + i as u8).collect();
            let mut keys: std::collections::BTreeSet<Vec<u8>> = std::collections::BTreeSet::new();
            for _ in 0..(1 + next() % 300) {
                let mut k = shared.clone();
                // Short tails, zero bytes, and tails equal for their first 8 bytes.
                match next() % 4 {
                    0 => k.extend((0..next() % 4).map(|_| (next() % 3) as u8)),
                    1 => k.extend(b"same8byt"),
                    _ => {}
                }
                k.extend((0..next() % 12).map(|_| (next() % 4) as u8 * 60));
                keys.insert(k);
            }
            let names: Vec<Vec<u8>> = keys.iter().rev().cloned().collect();
            let sorted = sort_slots_by_key((0..names.len() as u32).collect(), |i| names[i as usize].as_slice());
            let got: Vec<&Vec<u8>> = sorted.iter().map(|&(_, i)| &names[i as usize]).collect();
            assert_eq!(got, keys.iter().collect::<Vec<_>>(), "case {case}");
            for &(p, i) in &sorted {
                assert_eq!(p, prefix(&names[i as usize]), "case {case}: the prefix of {:?}", names[i as usize]);
            }
        }
        assert!(sort_slots_by_key(Vec::new(), |_| &[][..]).is_empty());
    }

    #[test]
    fn radix_sort_orders_by_the_high_bits_and_keeps_ties_in_order() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut values: Vec<u64> = (0..5_000u64)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x & 0xF_FFFF) << 32) | i
            })
            .collect();
        let mut expected = values.clone();
        expected.sort_by_key(|v| v >> 32); // stable: ties keep their order
        radix_sort_high(&mut values, 20);
        assert_eq!(values, expected);
        let mut low_only = vec![(3u64 << 32) | 7, (1 << 32) | 9, 5];
        radix_sort_high(&mut low_only, 0); // no bits: unchanged
        assert_eq!(low_only, vec![(3u64 << 32) | 7, (1 << 32) | 9, 5]);
    }

    #[test]
    fn a_deferred_ordered_set_ends_up_as_if_kept_in_step() {
        // Before deferring: none, a few, or many keys already in order (a checkpoint); then
        // few or many inserts in random order, with deletes and re-inserts among them.
        // Without removals the pending keys are sorted without a check against the table, on
        // two threads past 65,536 of them.
        let cases = [
            (0u64, 3_000u64, true),
            (2_000, 50, true),
            (2_000, 3_000, true),
            (0, 0, true),
            (500, 3_000, false),
            (1_000, 70_000, false),
        ];
        for (before, replayed, removals) in cases {
            let mut kept = TableData::default();
            let mut deferred = TableData::default();
            let mut ts = 0;
            let op = |t: &mut TableData, key: &[u8], value: Option<&[u8]>, ts: u64| apply(t, key, value, ts, ts);
            for i in 0..before {
                ts += 1;
                op(&mut kept, format!("c{i:05}").as_bytes(), Some(b"v"), ts);
                op(&mut deferred, format!("c{i:05}").as_bytes(), Some(b"v"), ts);
            }
            deferred.defer_order();
            let mut x = 0x2545_f491_4f6c_dd1du64;
            for _ in 0..replayed {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let key = if removals {
                    if x.is_multiple_of(2) {
                        format!("c{:05}", x % (before + 1))
                    } else {
                        format!("r{:05}", x % 997)
                    }
                } else if x.is_multiple_of(10) {
                    format!("c{:05}", x % (before + 1))
                } else {
                    format!("r{:08}", x % 10_000_019)
                };
                let value: Option<&[u8]> = if x.is_multiple_of(5) { None } else { Some(b"w") };
                ts += 1;
                op(&mut kept, key.as_bytes(), value, ts);
                op(&mut deferred, key.as_bytes(), value, ts);
                if removals && x.is_multiple_of(7) {
                    // A key removed from the index altogether, as the collector does.
                    kept.remove(key.as_bytes());
                    deferred.remove(key.as_bytes());
                }
            }
            assert_eq!(deferred.order_pending_removed, removals && replayed > 0, "{before} then {replayed}");
            let pending = deferred.order_pending.as_ref().map_or(0, Vec::len);
            if !removals && replayed > 90_000 {
                assert!(pending >= 1 << 16, "only {pending} keys pending: the two-thread sort is not reached");
            }
            deferred.finish_order();
            let all = KeyRange { start: Bound::Unbounded, end: Bound::Unbounded };
            for reverse in [false, true] {
                assert_eq!(
                    deferred.scan_chunk(&all, reverse, ts, usize::MAX),
                    kept.scan_chunk(&all, reverse, ts, usize::MAX),
                    "{before} then {replayed}"
                );
            }
            deferred.order.check(|i| key_of(&deferred.slots, i));
            let keys = |t: &TableData| t.order.iter().map(|i| key_of(&t.slots, i).to_vec()).collect::<Vec<_>>();
            assert_eq!(keys(&deferred), keys(&kept), "{before} then {replayed}");
            // And it stays in step afterwards.
            op(&mut deferred, b"zz-after", Some(b"v"), ts + 1);
            assert_eq!(keys(&deferred).last().map(Vec::as_slice), Some(&b"zz-after"[..]));
        }
    }

    #[test]
    fn the_catalog_finds_a_name_s_table_visible_at_a_snapshot_and_forgets_collected_ones() {
        let mut c = Catalog::default();
        let first = Arc::new(Table::new(1, Arc::from("t"), 5));
        first.dropped_ts.store(10, Ordering::Release);
        c.insert(Arc::clone(&first));
        c.insert(Arc::new(Table::new(2, Arc::from("t"), 10)));
        assert_eq!(c.table_at("t", 4).map(|t| t.id), None);
        assert_eq!(c.table_at("t", 7).map(|t| t.id), Some(1));
        assert_eq!(c.table_at("t", 10).map(|t| t.id), Some(2));
        // An id inserted again replaces its table under the old name too.
        c.insert(Arc::new(Table::new(2, Arc::from("u"), 10)));
        assert_eq!(c.table_at("t", 10).map(|t| t.id), None);
        assert_eq!(c.table_at("u", 10).map(|t| t.id), Some(2));
        c.collect(10);
        assert_eq!(c.table_at("t", 7).map(|t| t.id), None);
        assert!(c.by_name.get("t").is_none() && c.by_id(1).is_none());
    }

    #[test]
    fn snapshots_see_their_version() {
        let mut t = TableData::default();
        apply(&mut t, b"k", Some(b"v1"), 1, 0);
        apply(&mut t, b"k", Some(b"v2"), 2, 0);
        apply(&mut t, b"k", None, 3, 0);
        assert_eq!(t.get(b"k", 0), None);
        assert_eq!(t.get(b"k", 1).as_deref(), Some(&b"v1"[..]));
        assert_eq!(t.get(b"k", 2).as_deref(), Some(&b"v2"[..]));
        assert_eq!(t.get(b"k", 3), None);
        assert_eq!(t.head_ts(b"k"), Some(3));
    }

    #[test]
    fn writes_prune_versions_below_the_horizon() {
        let mut t = TableData::default();
        for ts in 1..=50 {
            apply(&mut t, b"k", Some(&[ts as u8]), ts, 0);
        }
        assert_eq!(t.chain_depth(b"k"), 50);
        apply(&mut t, b"k", Some(b"x"), 51, 51);
        assert_eq!(t.chain_depth(b"k"), 1);
    }

    #[test]
    fn long_chains_are_walked_only_when_the_horizon_passes_their_second_oldest_version() {
        let mut t = TableData::default();
        // History kept from ts 0: nothing is prunable, the key is a candidate once.
        for ts in 1..=100 {
            apply(&mut t, b"k", Some(&[ts as u8]), ts, 0);
        }
        assert_eq!(t.chain_depth(b"k"), 100);
        assert_eq!(t.pending_gc(), 1, "a key is on the collector's list at most once");
        let slot = t.slot_of(b"k").and_then(|n| t.slots.get(n)).map(Slot::prunable_at);
        assert_eq!(slot, Some(2), "the second-oldest version's timestamp");
        // The collector visits it without freeing anything while the horizon stays below 2.
        t.collect(1, 10);
        assert_eq!((t.chain_depth(b"k"), t.pending_gc()), (100, 1));
        // The horizon rises to 60: versions 1..59 go, 60 is the oldest, 61 the second-oldest.
        t.collect(60, 10);
        assert_eq!(t.chain_depth(b"k"), 41);
        let slot = t.slot_of(b"k").and_then(|n| t.slots.get(n)).map(Slot::prunable_at);
        assert_eq!(slot, Some(61));
        apply(&mut t, b"k", Some(b"x"), 101, 100);
        assert_eq!(t.chain_depth(b"k"), 2, "a write at horizon 100 keeps 100 (visible there) and 101");
    }

    #[test]
    fn a_collector_pass_that_can_free_nothing_is_not_repeated_until_the_horizon_or_a_write_allows() {
        let mut t = TableData::default();
        // 50 keys overwritten at ts 11..60 with history kept from ts 5 (the horizon stays 5).
        for i in 0..50u8 {
            apply(&mut t, &[i], Some(b"a"), 1 + u64::from(i) / 10, 0);
        }
        for i in 0..50u8 {
            apply(&mut t, &[i], Some(b"b"), 11 + u64::from(i), 5);
        }
        assert_eq!(t.pending_gc(), 50);
        assert!(t.gc_due(5), "nothing is known about the list before a pass");
        // One pass, in budgets of 20: it frees nothing (every second-oldest version is > 5).
        let mut visits = 0;
        while t.gc_due(5) {
            visits += t.collect(5, 20);
            assert!(visits <= 50, "a pass visits each key once, then stops");
        }
        assert_eq!((visits, t.pending_gc()), (50, 50));
        // Until the horizon reaches the lowest second-oldest version (11), nothing is due.
        assert!(!t.gc_due(10));
        assert!(t.gc_due(11));
        // A chain queued by a write after the pass counts too: "new" is prunable from 62.
        apply(&mut t, b"new", Some(b"a"), 61, 5);
        apply(&mut t, b"new", None, 62, 5);
        t.gc_next = GC_NEVER; // as if the pass had kept nothing below 62
        assert!(!t.gc_due(61));
        assert!(t.gc_due(62), "a chain written after the pass is not forgotten");
        t.gc_next = 11;
        // The horizon rises to 35: the next pass prunes keys 0..24 (second-oldest 11..35).
        while t.gc_due(35) {
            t.collect(35, 20);
        }
        assert_eq!(t.chain_depth(&[0]), 1);
        assert_eq!(t.chain_depth(&[24]), 1);
        assert_eq!(t.chain_depth(&[25]), 2);
        assert!(!t.gc_due(35) && t.gc_due(36));
    }

    #[test]
    fn collector_removes_invisible_tombstones() {
        let mut t = TableData::default();
        apply(&mut t, b"k", Some(b"v"), 1, 0);
        apply(&mut t, b"k", None, 2, 1);
        assert_eq!(t.get(b"k", 1).as_deref(), Some(&b"v"[..]));
        t.collect(1, 100);
        assert_eq!(t.get(b"k", 1).as_deref(), Some(&b"v"[..]), "snapshot 1 still sees the value");
        t.collect(2, 100);
        assert_eq!(t.chain_depth(b"k"), 0);
        let (entries, _) = t.scan_chunk(&KeyRange { start: Bound::Unbounded, end: Bound::Unbounded }, false, 5, 10);
        assert!(entries.is_empty());
    }

    /// Each way a version leaves a chain gives its value's block back: pruned by a write,
    /// pruned by the collector, a collected tombstone's chain replaced by a new value, a
    /// tombstone removed with its key. Without that the arena grows by a block per round.
    #[test]
    fn dropped_versions_give_their_value_blocks_back() {
        let mut t = TableData::default();
        let value = |i: u64| vec![i as u8; 1000];
        let mut ts = 0;
        for round in 0..300u64 {
            // Pruned by the write that follows.
            ts += 1;
            apply(&mut t, b"a", Some(&value(round)), ts, ts - 1);
            // History kept, then pruned by the collector.
            ts += 1;
            apply(&mut t, b"b", Some(&value(round)), ts, 0);
            // A value, its tombstone, then a new value once the tombstone is collectable.
            ts += 1;
            apply(&mut t, b"c", Some(&value(round)), ts, 0);
            ts += 1;
            apply(&mut t, b"c", None, ts, 0);
            ts += 1;
            apply(&mut t, b"c", Some(&value(round + 1)), ts, ts - 1);
            // A value and its tombstone, both collected with the key.
            ts += 1;
            apply(&mut t, b"d", Some(&value(round)), ts, 0);
            ts += 1;
            apply(&mut t, b"d", None, ts, 0);
            while t.gc_due(ts) {
                t.collect(ts, 100);
            }
            assert_eq!(t.chain_depth(b"d"), 0);
        }
        assert_eq!(t.get(b"a", ts).as_deref(), Some(&value(299)[..]));
        assert_eq!(t.get(b"b", ts).as_deref(), Some(&value(299)[..]));
        assert_eq!(t.get(b"c", ts).as_deref(), Some(&value(300)[..]));
        assert!(t.values.reserved() <= 32 << 10, "{} bytes reserved for a few live values", t.values.reserved());
    }

    #[test]
    fn inverted_ranges_are_empty_not_a_panic() {
        let mut t = TableData::default();
        apply(&mut t, b"a", Some(b"1"), 1, 0);
        let r = KeyRange { start: Bound::Excluded(b"b".to_vec()), end: Bound::Excluded(b"b".to_vec()) };
        assert!(r.is_empty());
        assert!(t.scan_chunk(&r, false, 1, 10).0.is_empty());
        let r = KeyRange { start: Bound::Included(b"z".to_vec()), end: Bound::Excluded(b"a".to_vec()) };
        assert!(t.scan_chunk(&r, true, 1, 10).0.is_empty());
    }

    #[test]
    fn inline_and_heap_keys_compare_as_bytes() {
        let short = Key::new(b"abc");
        let long = Key::new(&[b'a'; 40]);
        assert!(matches!(short, Key::Inline { .. }));
        assert!(matches!(long, Key::Heap(_)));
        assert!(short > long);
        assert_eq!(std::mem::size_of::<Key>(), 24);
    }

    /// A key's fixed memory is mostly its slot: a change that grows it shows up here first.
    #[test]
    fn a_slot_is_48_bytes_and_a_value_reference_needs_no_tag() {
        assert_eq!(std::mem::size_of::<Option<ValueRef>>(), 8);
        assert_eq!(std::mem::size_of::<Slot>(), 48);
    }

    /// The hash table grows by a rebuild from the slab, which must skip the slots freed by
    /// collected deletes (an empty key there would otherwise be found) and keep every live
    /// key reachable, through several growths with slots reused in between.
    #[test]
    fn growing_the_hash_table_keeps_live_keys_and_skips_freed_slots() {
        let mut t = TableData::default();
        let key = |i: u32| format!("k{i}").into_bytes();
        let mut ts = 0;
        let mut live = std::collections::BTreeSet::new();
        for round in 0..6u32 {
            for i in round * 1000..(round + 1) * 1000 {
                ts += 1;
                apply(&mut t, &key(i), Some(b"v"), ts, ts);
                live.insert(i);
            }
            // Delete every third live key and collect, which frees their slots.
            let doomed: Vec<u32> = live.iter().copied().filter(|i| i % 3 == round % 3).collect();
            for i in doomed {
                ts += 1;
                apply(&mut t, &key(i), None, ts, ts);
                live.remove(&i);
            }
            t.collect(ts, usize::MAX);
            assert!(!t.free.is_empty(), "round {round}: the deletes freed no slot");
            // Inserts reuse freed slots before growing, so a growth with slots free is rare
            // in this loop: force one.
            t.grow_index();
            assert_eq!(t.index.len(), live.len(), "round {round}");
            assert!(t.slot_of(b"").is_none(), "round {round}: a freed slot is in the table");
        }
        for i in 0..6000u32 {
            assert_eq!(t.get(&key(i), ts).is_some(), live.contains(&i), "key {i}");
        }
        // The table grew past its first sizes, so rebuilds ran with slots free.
        assert!(t.index.capacity() >= live.len());
    }

    /// Both ways of filling the hash table: in slot order (small tables) and sorted by home
    /// group (larger than the cache), each with free slots left out.
    #[test]
    fn fill_index_in_either_order_holds_exactly_the_live_slots() {
        use std::hash::BuildHasher;
        let hasher = foldhash::fast::RandomState::default();
        let n = 5_000usize;
        let slots: Vec<Slot> = (0..n).map(|i| Slot::new(format!("key-{i}").as_bytes(), 1, None)).collect();
        let hashes: Vec<u64> = slots.iter().map(|s| hasher.hash_one(s.key.as_slice())).collect();
        let free: Vec<bool> = (0..n).map(|i| i % 7 == 3).collect();
        for capacity in [n, 1 << 20] {
            let mut index = SlotIndex::default();
            fill_index(&mut index, &slots, &hashes, capacity, &free);
            assert_eq!(index.home_bits() > SMALL_TABLE_BITS, capacity > n, "the capacity picks the path");
            assert_eq!(index.len(), free.iter().filter(|f| !**f).count());
            for i in 0..n {
                let found = index.find(hashes[i], |s| s as usize == i);
                assert_eq!(found.is_some(), !free[i], "capacity {capacity}, slot {i}");
            }
        }
    }

    /// `same_key` must see a difference in any one byte, at every length (its word path
    /// covers 8 to 16 bytes with two overlapping words), and never call keys of different
    /// lengths equal, even when one is the other zero-padded.
    #[test]
    fn same_key_is_slice_equality() {
        for len in 0..=24usize {
            let a: Vec<u8> = (0..len as u8).map(|i| i.wrapping_mul(37).wrapping_add(1)).collect();
            assert!(same_key(&a, &a.clone()), "len {len}");
            for at in 0..len {
                for flip in [1u8, 0x80, 0xff] {
                    let mut b = a.clone();
                    b[at] ^= flip;
                    assert!(!same_key(&a, &b), "len {len}: byte {at} differs by {flip:#x}");
                }
            }
            let mut longer = a.clone();
            longer.push(0);
            assert!(!same_key(&a, &longer) && !same_key(&longer, &a), "len {len} and its zero-padded self");
        }
    }

    /// The word comparison of inline keys must agree with slice order everywhere it could
    /// differ: prefixes, trailing zero bytes (which pad too), 0xff bytes, every length up to
    /// the inline limit and across it.
    #[test]
    fn key_order_and_equality_are_slice_order_and_equality() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        let mut keys: Vec<Vec<u8>> =
            vec![vec![], vec![0], vec![0, 0], vec![0xff], vec![0xff; 22], vec![0; 22], vec![0; 23]];
        for len in 0..=26 {
            for _ in 0..40 {
                // Few distinct bytes, so shared prefixes and zeros are common.
                keys.push((0..len).map(|_| [0u8, 1, 0x7f, 0x80, 0xff][rng.gen_range(0..5)]).collect());
            }
        }
        for a in &keys {
            for b in &keys {
                let (ka, kb) = (Key::new(a), Key::new(b));
                assert_eq!(ka.cmp(&kb), a.as_slice().cmp(b.as_slice()), "{a:?} vs {b:?}");
                assert_eq!(ka == kb, a == b, "{a:?} vs {b:?}");
            }
        }
    }

    /// A million versions of one key dropped on a 256 KiB stack: the derived, recursive drop
    /// overflows it.
    #[test]
    fn a_long_version_chain_drops_without_recursion() {
        let dropped = std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(|| {
                let mut chain: Option<Box<Version>> = None;
                for ts in 0..1_000_000u64 {
                    chain = Some(Box::new(Version { ts, value: None, older: chain }));
                }
                drop(chain);
            })
            .unwrap()
            .join();
        assert!(dropped.is_ok());
    }
}
