//! One table's writes in a transaction: key to new value (`None` deletes), in key order.
//!
//! Most transactions write a few keys, or many keys in ascending order (loads, appends, a
//! log's sequential ids). For those a sorted vector is the whole structure: appending a key
//! greater than the last is one comparison and a push, a lookup is a binary search, and the
//! commit walks a slice. A `BTreeMap` cost each put a descent with a `memcmp` per level and a
//! node allocation (about 700 instructions per put in a 100-put commit, callgrind).
//!
//! A key that lands inside a vector of up to `SMALL` entries is inserted in place; inside a
//! longer one, the set turns into a `BTreeMap` for good, so a large transaction written in
//! random order costs what it did before, plus one conversion.
//!
//! Values live in one buffer per set, appended in the order they are put; an entry holds
//! where its value is. A put therefore allocates nothing once the buffer has room, and the
//! commit frees one buffer, where a `Vec` per value cost a `malloc` on put and a `free` after
//! apply (about 300 instructions per put in a 100-put commit, callgrind). A key written twice
//! leaves its first value's bytes behind, unreferenced, until the set is cleared; the
//! transaction's byte limit counts every put, so that waste stays within it.
//!
//! Invariants: in `Sorted`, keys are strictly ascending (so distinct), which makes iteration,
//! `range` and `get` agree with the map the set replaces; every `Span` lies within `buf`.

use std::collections::{btree_map, BTreeMap};
use std::ops::Bound;

use crate::index::{as_ref, Key};

/// Where a value's bytes are in the set's buffer; `None` in its place is a delete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    at: usize,
    len: u32,
}

/// Keys are the index's own type: up to 22 bytes inline, so a put allocates nothing for its
/// key (a `Vec<u8>` key was an allocation and a free per put).
type Entry = (Key, Option<Span>);

/// Longest sorted vector that takes an insertion in its middle.
const SMALL: usize = 64;

#[derive(Debug, Clone)]
enum Entries {
    Sorted(Vec<Entry>),
    Tree(BTreeMap<Key, Option<Span>>),
}

#[derive(Debug, Clone)]
pub(crate) struct WriteSet {
    entries: Entries,
    buf: Vec<u8>,
}

impl Default for WriteSet {
    fn default() -> Self {
        WriteSet { entries: Entries::Sorted(Vec::new()), buf: Vec::new() }
    }
}

/// Where `key` is, or would go, in a strictly ascending vector.
fn search(v: &[Entry], key: &[u8]) -> Result<usize, usize> {
    v.binary_search_by(|(k, _)| k.as_slice().cmp(key))
}

/// The bytes `span` names in `buf` (empty if it lay outside, which the invariant rules out).
fn bytes(buf: &[u8], span: Option<Span>) -> Option<&[u8]> {
    span.map(|s| buf.get(s.at..s.at + s.len as usize).unwrap_or_default())
}

impl WriteSet {
    /// Sets `key`'s new value (`None` deletes), replacing an earlier write of the same key.
    /// Values longer than `u32::MAX` bytes are beyond the engine's limit and never reach here.
    pub fn insert(&mut self, key: &[u8], value: Option<&[u8]>) {
        let span = value.map(|v| {
            let at = self.buf.len();
            self.buf.extend_from_slice(v);
            Span { at, len: u32::try_from(v.len()).unwrap_or(u32::MAX) }
        });
        let v = match &mut self.entries {
            Entries::Tree(m) => {
                m.insert(Key::new(key), span);
                return;
            }
            Entries::Sorted(v) => v,
        };
        if v.last().is_none_or(|(last, _)| last.as_slice() < key) {
            v.push((Key::new(key), span));
            return;
        }
        match search(v, key) {
            Ok(i) => {
                if let Some(e) = v.get_mut(i) {
                    e.1 = span;
                }
            }
            Err(i) if v.len() < SMALL => v.insert(i, (Key::new(key), span)),
            Err(_) => {
                let mut m: BTreeMap<Key, Option<Span>> = std::mem::take(v).into_iter().collect();
                m.insert(Key::new(key), span);
                self.entries = Entries::Tree(m);
            }
        }
    }

    /// This set's write of `key`, if any: `Some(None)` is a delete.
    pub fn get(&self, key: &[u8]) -> Option<Option<&[u8]>> {
        let span = match &self.entries {
            Entries::Sorted(v) => search(v, key).ok().and_then(|i| v.get(i)).map(|(_, s)| *s),
            Entries::Tree(m) => m.get(key).copied(),
        }?;
        Some(bytes(&self.buf, span))
    }

    pub fn len(&self) -> usize {
        match &self.entries {
            Entries::Sorted(v) => v.len(),
            Entries::Tree(m) => m.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn clear(&mut self) {
        *self = WriteSet::default();
    }

    /// The writes in key order.
    #[inline]
    pub fn iter(&self) -> Iter<'_> {
        let inner = match &self.entries {
            Entries::Sorted(v) => Inner::Sorted(v.iter()),
            Entries::Tree(m) => Inner::Tree(m.range::<[u8], _>(..)),
        };
        Iter { inner, buf: &self.buf }
    }

    pub fn keys(&self) -> impl Iterator<Item = &Key> {
        self.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl Iterator<Item = Option<&[u8]>> {
        self.iter().map(|(_, v)| v)
    }

    /// The writes with keys within `bounds`, in key order. As `BTreeMap::range`, the caller
    /// must not pass a start above the end (`KeyRange::is_empty` checks that).
    pub fn range(&self, bounds: (Bound<Vec<u8>>, Bound<Vec<u8>>)) -> Iter<'_> {
        let inner = match &self.entries {
            Entries::Sorted(v) => {
                let lo = match &bounds.0 {
                    Bound::Included(s) => v.partition_point(|(k, _)| k.as_slice() < s.as_slice()),
                    Bound::Excluded(s) => v.partition_point(|(k, _)| k.as_slice() <= s.as_slice()),
                    Bound::Unbounded => 0,
                };
                let hi = match &bounds.1 {
                    Bound::Included(e) => v.partition_point(|(k, _)| k.as_slice() <= e.as_slice()),
                    Bound::Excluded(e) => v.partition_point(|(k, _)| k.as_slice() < e.as_slice()),
                    Bound::Unbounded => v.len(),
                };
                Inner::Sorted(v.get(lo..hi.max(lo)).unwrap_or_default().iter())
            }
            Entries::Tree(m) => Inner::Tree(m.range::<[u8], _>((as_ref(&bounds.0), as_ref(&bounds.1)))),
        };
        Iter { inner, buf: &self.buf }
    }
}

enum Inner<'a> {
    Sorted(std::slice::Iter<'a, Entry>),
    Tree(btree_map::Range<'a, Key, Option<Span>>),
}

/// See [`WriteSet::iter`].
pub(crate) struct Iter<'a> {
    inner: Inner<'a>,
    buf: &'a [u8],
}

impl<'a> Iterator for Iter<'a> {
    type Item = (&'a Key, Option<&'a [u8]>);

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        let (k, span) = match &mut self.inner {
            Inner::Sorted(i) => i.next().map(|(k, s)| (k, *s)),
            Inner::Tree(i) => i.next().map(|(k, s)| (k, *s)),
        }?;
        Some((k, bytes(self.buf, span)))
    }
}

impl<'a> IntoIterator for &'a WriteSet {
    type Item = (&'a Key, Option<&'a [u8]>);
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;
    use rand::{Rng, SeedableRng};

    type Value = Option<Vec<u8>>;

    fn pairs<'a>(i: Iter<'a>) -> Vec<(Vec<u8>, Value)> {
        i.map(|(k, v)| (k.as_slice().to_vec(), v.map(<[u8]>::to_vec))).collect()
    }

    fn model_pairs<'a>(i: impl Iterator<Item = (&'a Vec<u8>, &'a Value)>) -> Vec<(Vec<u8>, Value)> {
        i.map(|(k, v)| (k.clone(), v.clone())).collect()
    }

    fn bound(rng: &mut impl Rng) -> Bound<Vec<u8>> {
        match rng.gen_range(0..3) {
            0 => Bound::Unbounded,
            1 => Bound::Included(vec![rng.gen_range(0..40u8)]),
            _ => Bound::Excluded(vec![rng.gen_range(0..40u8)]),
        }
    }

    /// The set against the `BTreeMap` it replaces, over random runs that append, overwrite,
    /// insert in the middle (below and above `SMALL` entries) and clear; values of varied
    /// lengths, empty ones included (an empty value is a put, not a delete).
    #[test]
    fn behaves_as_the_ordered_map_it_replaces() {
        let mut converted = 0;
        for seed in 0..300u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut set = WriteSet::default();
            let mut model: BTreeMap<Vec<u8>, Value> = BTreeMap::new();
            let mut next = 0u16;
            for _ in 0..rng.gen_range(1..300) {
                let key = match rng.gen_range(0..10) {
                    0..=5 => {
                        next += 1;
                        next.to_be_bytes().to_vec()
                    }
                    6..=8 => rng.gen_range(0..(next + 2)).to_be_bytes().to_vec(),
                    _ => vec![rng.gen_range(0..40u8)],
                };
                let value =
                    rng.gen_bool(0.8).then(|| (0..rng.gen_range(0..12)).map(|_| rng.gen()).collect::<Vec<u8>>());
                if rng.gen_range(0..200) == 0 {
                    set.clear();
                    model.clear();
                }
                set.insert(&key, value.as_deref());
                model.insert(key.clone(), value);
                assert_eq!(set.get(&key), model.get(&key).map(Option::as_deref));
                let probe = vec![rng.gen_range(0..40u8)];
                assert_eq!(set.get(&probe), model.get(&probe).map(Option::as_deref));
            }
            assert_eq!(set.len(), model.len());
            assert_eq!(pairs(set.iter()), model_pairs(model.iter()), "seed {seed}");
            for _ in 0..20 {
                let (lo, hi) = (bound(&mut rng), bound(&mut rng));
                let empty = match (&lo, &hi) {
                    (Bound::Included(a) | Bound::Excluded(a), Bound::Included(b) | Bound::Excluded(b)) => {
                        a > b || (a == b && !(matches!(lo, Bound::Included(_)) && matches!(hi, Bound::Included(_))))
                    }
                    _ => false,
                };
                if empty {
                    continue; // BTreeMap::range panics there; callers never ask
                }
                let bounds = (lo, hi);
                assert_eq!(
                    pairs(set.range(bounds.clone())),
                    model_pairs(model.range(bounds.clone())),
                    "seed {seed} {bounds:?}"
                );
            }
            assert_eq!(
                set.values().map(|v| v.map(<[u8]>::to_vec)).collect::<Vec<_>>(),
                model.values().cloned().collect::<Vec<_>>()
            );
            assert_eq!(
                set.keys().map(|k| k.as_slice().to_vec()).collect::<Vec<_>>(),
                model.keys().cloned().collect::<Vec<_>>()
            );
            converted += usize::from(matches!(set.entries, Entries::Tree(_)));
        }
        assert!(converted > 0 && converted < 300, "both forms exercised ({converted} of 300 converted)");
    }

    #[test]
    fn ascending_writes_stay_a_vector_and_a_late_key_converts_a_long_one() {
        let mut set = WriteSet::default();
        for i in 0..1000u32 {
            set.insert(&i.to_be_bytes(), Some(&[1]));
        }
        assert!(matches!(set.entries, Entries::Sorted(_)));
        set.insert(&5u32.to_be_bytes(), None); // an overwrite stays in place
        assert!(matches!(set.entries, Entries::Sorted(_)));
        assert_eq!(set.get(&5u32.to_be_bytes()), Some(None));
        set.insert(&[0, 0, 0, 5, 1], None); // between two keys, in a long vector
        assert!(matches!(set.entries, Entries::Tree(_)));
        assert_eq!(set.len(), 1001);
        assert_eq!(set.get(&7u32.to_be_bytes()), Some(Some(&[1u8][..])));
    }
}
