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
//! Invariant: in `Sorted`, keys are strictly ascending (so distinct), which makes iteration,
//! `range` and `get` agree with the map the set replaces.

use std::collections::{btree_map, BTreeMap};
use std::ops::Bound;

use crate::index::{as_ref, Key};

type Value = Option<Vec<u8>>;
/// Keys are the index's own type: up to 22 bytes inline, so a put allocates for its value
/// only (a `Vec<u8>` key was an allocation and a free per put).
type Entry = (Key, Value);

/// Longest sorted vector that takes an insertion in its middle.
const SMALL: usize = 64;

#[derive(Debug, Clone)]
pub(crate) enum WriteSet {
    Sorted(Vec<Entry>),
    Tree(BTreeMap<Key, Value>),
}

impl Default for WriteSet {
    fn default() -> Self {
        WriteSet::Sorted(Vec::new())
    }
}

/// Where `key` is, or would go, in a strictly ascending vector.
fn search(v: &[Entry], key: &[u8]) -> Result<usize, usize> {
    v.binary_search_by(|(k, _)| k.as_slice().cmp(key))
}

impl WriteSet {
    /// Sets `key`'s new value, replacing an earlier write of the same key.
    pub fn insert(&mut self, key: &[u8], value: Value) {
        let v = match self {
            WriteSet::Tree(m) => {
                m.insert(Key::new(key), value);
                return;
            }
            WriteSet::Sorted(v) => v,
        };
        if v.last().is_none_or(|(last, _)| last.as_slice() < key) {
            v.push((Key::new(key), value));
            return;
        }
        match search(v, key) {
            Ok(i) => {
                if let Some(e) = v.get_mut(i) {
                    e.1 = value;
                }
            }
            Err(i) if v.len() < SMALL => v.insert(i, (Key::new(key), value)),
            Err(_) => {
                let mut m: BTreeMap<Key, Value> = std::mem::take(v).into_iter().collect();
                m.insert(Key::new(key), value);
                *self = WriteSet::Tree(m);
            }
        }
    }

    /// This set's write of `key`, if any.
    pub fn get(&self, key: &[u8]) -> Option<&Value> {
        match self {
            WriteSet::Sorted(v) => search(v, key).ok().and_then(|i| v.get(i)).map(|(_, val)| val),
            WriteSet::Tree(m) => m.get(key),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            WriteSet::Sorted(v) => v.len(),
            WriteSet::Tree(m) => m.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn clear(&mut self) {
        *self = WriteSet::default();
    }

    /// The writes in key order.
    pub fn iter(&self) -> Iter<'_> {
        match self {
            WriteSet::Sorted(v) => Iter::Sorted(v.iter()),
            WriteSet::Tree(m) => Iter::Tree(m.range::<[u8], _>(..)),
        }
    }

    /// The writes in key order, values mutable.
    pub fn iter_mut(&mut self) -> IterMut<'_> {
        match self {
            WriteSet::Sorted(v) => IterMut::Sorted(v.iter_mut()),
            WriteSet::Tree(m) => IterMut::Tree(m.iter_mut()),
        }
    }

    pub fn keys(&self) -> impl Iterator<Item = &Key> {
        self.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl Iterator<Item = &Value> {
        self.iter().map(|(_, v)| v)
    }

    /// The writes with keys within `bounds`, in key order. As `BTreeMap::range`, the caller
    /// must not pass a start above the end (`KeyRange::is_empty` checks that).
    pub fn range(&self, bounds: (Bound<Vec<u8>>, Bound<Vec<u8>>)) -> Iter<'_> {
        match self {
            WriteSet::Sorted(v) => {
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
                Iter::Sorted(v.get(lo..hi.max(lo)).unwrap_or_default().iter())
            }
            WriteSet::Tree(m) => Iter::Tree(m.range::<[u8], _>((as_ref(&bounds.0), as_ref(&bounds.1)))),
        }
    }
}

/// See [`WriteSet::iter`].
pub(crate) enum Iter<'a> {
    Sorted(std::slice::Iter<'a, Entry>),
    Tree(btree_map::Range<'a, Key, Value>),
}

impl<'a> Iterator for Iter<'a> {
    type Item = (&'a Key, &'a Value);

    fn next(&mut self) -> Option<Self::Item> {
        match self {
            Iter::Sorted(i) => i.next().map(|(k, v)| (k, v)),
            Iter::Tree(i) => i.next(),
        }
    }
}

/// See [`WriteSet::iter_mut`].
pub(crate) enum IterMut<'a> {
    Sorted(std::slice::IterMut<'a, Entry>),
    Tree(btree_map::IterMut<'a, Key, Value>),
}

impl<'a> Iterator for IterMut<'a> {
    type Item = (&'a Key, &'a mut Value);

    fn next(&mut self) -> Option<Self::Item> {
        match self {
            IterMut::Sorted(i) => i.next().map(|(k, v)| (&*k, v)),
            IterMut::Tree(i) => i.next(),
        }
    }
}

impl<'a> IntoIterator for &'a WriteSet {
    type Item = (&'a Key, &'a Value);
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

    fn pairs<'a, K: AsRef<[u8]> + 'a>(i: impl Iterator<Item = (&'a K, &'a Value)>) -> Vec<(Vec<u8>, Value)> {
        i.map(|(k, v)| (k.as_ref().to_vec(), v.clone())).collect()
    }

    fn bound(rng: &mut impl Rng) -> Bound<Vec<u8>> {
        match rng.gen_range(0..3) {
            0 => Bound::Unbounded,
            1 => Bound::Included(vec![rng.gen_range(0..40u8)]),
            _ => Bound::Excluded(vec![rng.gen_range(0..40u8)]),
        }
    }

    /// The set against the `BTreeMap` it replaces, over random runs that append, overwrite,
    /// insert in the middle (below and above `SMALL` entries) and clear.
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
                let value = rng.gen_bool(0.8).then(|| vec![rng.gen()]);
                if rng.gen_range(0..200) == 0 {
                    set.clear();
                    model.clear();
                }
                set.insert(&key, value.clone());
                model.insert(key.clone(), value);
                assert_eq!(set.get(&key), model.get(&key));
                let probe = vec![rng.gen_range(0..40u8)];
                assert_eq!(set.get(&probe), model.get(&probe));
            }
            assert_eq!(set.len(), model.len());
            assert_eq!(pairs(set.iter()), pairs(model.iter()), "seed {seed}");
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
                    pairs(model.range(bounds.clone())),
                    "seed {seed} {bounds:?}"
                );
            }
            for (_, v) in set.iter_mut() {
                *v = None;
            }
            assert!(set.values().all(Option::is_none));
            assert_eq!(
                set.keys().map(|k| k.as_slice().to_vec()).collect::<Vec<_>>(),
                model.keys().cloned().collect::<Vec<_>>()
            );
            converted += usize::from(matches!(set, WriteSet::Tree(_)));
        }
        assert!(converted > 0 && converted < 300, "both forms exercised ({converted} of 300 converted)");
    }

    #[test]
    fn ascending_writes_stay_a_vector_and_a_late_key_converts_a_long_one() {
        let mut set = WriteSet::default();
        for i in 0..1000u32 {
            set.insert(&i.to_be_bytes(), Some(vec![1]));
        }
        assert!(matches!(set, WriteSet::Sorted(_)));
        set.insert(&5u32.to_be_bytes(), None); // an overwrite stays in place
        assert!(matches!(set, WriteSet::Sorted(_)));
        assert_eq!(set.get(&5u32.to_be_bytes()), Some(&None));
        set.insert(&[0, 0, 0, 5, 1], None); // between two keys, in a long vector
        assert!(matches!(set, WriteSet::Tree(_)));
        assert_eq!(set.len(), 1001);
    }
}
