//! Which synced watchers an event's key goes to: single-key watchers in a hash map by key,
//! range and prefix watchers in a list checked one by one.
//!
//! Pure data: no I/O, no locks (the hub holds it under its own lock).

use std::collections::HashMap;
use std::sync::Arc;

/// The keys a watcher watches (etcd's key and range_end, normalised).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span {
    pub key: Vec<u8>,
    /// `None`: `key` only. `Some(empty)`: every key from `key` on. Otherwise `[key, end)`.
    pub end: Option<Vec<u8>>,
}

impl Span {
    /// etcd's rules: an empty key is `\0` (the smallest); an empty range_end watches one key; a
    /// range_end of `\0` every key from `key` on. `None` when the range is empty (key ≥ end).
    pub fn new(key: &[u8], range_end: &[u8]) -> Option<Span> {
        let key = if key.is_empty() { vec![0] } else { key.to_vec() };
        let end = match range_end {
            [] => None,
            [0] => Some(Vec::new()),
            end if end <= key.as_slice() => return None,
            end => Some(end.to_vec()),
        };
        Some(Span { key, end })
    }

    pub fn contains(&self, k: &[u8]) -> bool {
        match &self.end {
            None => k == self.key.as_slice(),
            Some(end) => k >= self.key.as_slice() && (end.is_empty() || k < end.as_slice()),
        }
    }
}

/// What the hub needs of one synced watcher.
#[derive(Debug, Clone)]
pub struct Target {
    pub stream: u64,
    /// Unique within its stream for the stream's lifetime (a client may reuse a watch id).
    pub token: u64,
    /// The first revision this watcher still needs: older batches are not for it.
    pub next_rev: i64,
    pub no_put: bool,
    pub no_delete: bool,
    pub span: Arc<Span>,
}

impl Target {
    pub fn wants(&self, revision: i64, put: bool) -> bool {
        revision >= self.next_rev && passes(self.no_put, self.no_delete, put)
    }
}

/// Whether an event of this kind passes the NOPUT / NODELETE filters.
pub fn passes(no_put: bool, no_delete: bool, put: bool) -> bool {
    if put {
        !no_put
    } else {
        !no_delete
    }
}

#[derive(Debug, Default)]
pub struct Index {
    exact: HashMap<Vec<u8>, Vec<Target>>,
    ranges: Vec<Target>,
}

impl Index {
    pub fn insert(&mut self, t: Target) {
        if t.span.end.is_none() {
            self.exact.entry(t.span.key.clone()).or_default().push(t);
        } else {
            self.ranges.push(t);
        }
    }

    /// Removes the watcher `(stream, token)` watching `span`; whether it was there.
    pub fn remove(&mut self, span: &Span, stream: u64, token: u64) -> bool {
        let is = |t: &Target| t.stream == stream && t.token == token;
        if span.end.is_some() {
            let before = self.ranges.len();
            self.ranges.retain(|t| !is(t));
            return self.ranges.len() != before;
        }
        let Some(list) = self.exact.get_mut(&span.key) else { return false };
        let before = list.len();
        list.retain(|t| !is(t));
        let removed = list.len() != before;
        if list.is_empty() {
            self.exact.remove(&span.key);
        }
        removed
    }

    /// Calls `f` with every watcher whose span holds `key`.
    pub fn for_each_match(&self, key: &[u8], mut f: impl FnMut(&Target)) {
        if let Some(list) = self.exact.get(key) {
            list.iter().for_each(&mut f);
        }
        self.ranges.iter().filter(|t| t.span.contains(key)).for_each(f);
    }

    /// Removes and returns every watcher for which `pred` holds.
    pub fn drain_where(&mut self, mut pred: impl FnMut(&Target) -> bool) -> Vec<Target> {
        let mut out = Vec::new();
        for list in self.exact.values_mut() {
            list.retain(|t| {
                let take = pred(t);
                if take {
                    out.push(t.clone());
                }
                !take
            });
        }
        self.exact.retain(|_, l| !l.is_empty());
        self.ranges.retain(|t| {
            let take = pred(t);
            if take {
                out.push(t.clone());
            }
            !take
        });
        out
    }

    pub fn len(&self) -> usize {
        self.exact.values().map(Vec::len).sum::<usize>() + self.ranges.len()
    }

    pub fn is_empty(&self) -> bool {
        self.exact.is_empty() && self.ranges.is_empty()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn target(token: u64, key: &str, end: &str) -> Target {
        Target {
            stream: 1,
            token,
            next_rev: 0,
            no_put: false,
            no_delete: false,
            span: Arc::new(Span::new(key.as_bytes(), end.as_bytes()).unwrap()),
        }
    }

    fn matches(i: &Index, key: &str) -> Vec<u64> {
        let mut out = Vec::new();
        i.for_each_match(key.as_bytes(), |t| out.push(t.token));
        out.sort_unstable();
        out
    }

    #[test]
    fn spans_follow_etcds_key_and_range_end_rules() {
        assert_eq!(Span::new(b"", b"").unwrap().key, vec![0]);
        assert!(Span::new(b"b", b"a").is_none());
        assert!(Span::new(b"b", b"b").is_none());
        let from = Span::new(b"m", b"\0").unwrap();
        assert!(from.contains(b"m") && from.contains(b"zzz") && !from.contains(b"l"));
        let all = Span::new(b"", b"\0").unwrap();
        assert!(all.contains(b"\0") && all.contains(b"anything"));
        let range = Span::new(b"b", b"d").unwrap();
        assert!(range.contains(b"b") && range.contains(b"cz") && !range.contains(b"d"));
        let one = Span::new(b"k", b"").unwrap();
        assert!(one.contains(b"k") && !one.contains(b"k2"));
    }

    #[test]
    fn an_event_reaches_exactly_the_watchers_whose_span_holds_its_key() {
        let mut i = Index::default();
        i.insert(target(1, "a", ""));
        i.insert(target(2, "a", ""));
        i.insert(target(3, "p/", "p0")); // prefix p/
        i.insert(target(4, "b", "\0")); // from b
        i.insert(target(5, "", "\0")); // all
        assert_eq!(matches(&i, "a"), [1, 2, 5]);
        assert_eq!(matches(&i, "p/x"), [3, 4, 5]);
        assert_eq!(matches(&i, "p0"), [4, 5]);
        assert_eq!(matches(&i, "0"), [5]);
        assert_eq!(i.len(), 5);
        // Removal needs the right token and span; a second removal finds nothing.
        assert!(!i.remove(&Span::new(b"a", b"").unwrap(), 1, 9));
        assert!(i.remove(&Span::new(b"a", b"").unwrap(), 1, 1));
        assert!(!i.remove(&Span::new(b"a", b"").unwrap(), 1, 1));
        assert!(i.remove(&Span::new(b"p/", b"p0").unwrap(), 1, 3));
        assert_eq!(matches(&i, "a"), [2, 5]);
        assert_eq!(matches(&i, "p/x"), [4, 5]);
        let drained = i.drain_where(|t| t.token >= 4);
        assert_eq!(drained.len(), 2);
        assert_eq!(matches(&i, "a"), [2]);
        i.drain_where(|_| true);
        assert!(i.is_empty());
    }

    #[test]
    fn filters_and_the_next_revision_decide_what_a_watcher_wants() {
        let mut t = target(1, "a", "");
        t.next_rev = 5;
        assert!(!t.wants(4, true));
        assert!(t.wants(5, true) && t.wants(5, false));
        t.no_put = true;
        assert!(!t.wants(6, true) && t.wants(6, false));
        t.no_put = false;
        t.no_delete = true;
        assert!(t.wants(6, true) && !t.wants(6, false));
    }
}
