//! Range scans: an iterator over a snapshot's entries of one table, merged with the
//! transaction's own writes (read-your-own-writes).
//!
//! It copies a chunk of entries out of the index at a time, so a long-lived iterator never
//! holds an index lock, and checks the transaction's CPU budget per item. It never writes and
//! never sees another transaction's uncommitted writes.

use std::collections::VecDeque;
use std::ops::Bound;

use crate::cpu::MeterCell;
use crate::error::Result;
use crate::index::KeyRange;
use crate::txn::Snapshot;

/// How many entries a scan copies out of the index per lock acquisition.
pub(crate) const SCAN_CHUNK: usize = 256;

/// Bounds for a range scan: an optional inclusive start, exclusive end and prefix (all must
/// hold), in forward or reverse key order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScanRange {
    start: Option<Vec<u8>>,
    end: Option<Vec<u8>>,
    prefix: Option<Vec<u8>>,
    reverse: bool,
}

impl ScanRange {
    /// Every key of the table.
    pub fn all() -> Self {
        ScanRange::default()
    }
    /// Keys starting with `prefix`.
    pub fn prefix(prefix: impl Into<Vec<u8>>) -> Self {
        ScanRange { prefix: Some(prefix.into()), ..ScanRange::default() }
    }
    /// Keys `>= start`.
    pub fn start(mut self, start: impl Into<Vec<u8>>) -> Self {
        self.start = Some(start.into());
        self
    }
    /// Keys `< end`.
    pub fn end(mut self, end: impl Into<Vec<u8>>) -> Self {
        self.end = Some(end.into());
        self
    }
    /// Also require `prefix`.
    pub fn with_prefix(mut self, prefix: impl Into<Vec<u8>>) -> Self {
        self.prefix = Some(prefix.into());
        self
    }
    /// Descending key order.
    pub fn reverse(mut self) -> Self {
        self.reverse = true;
        self
    }

    pub(crate) fn is_reverse(&self) -> bool {
        self.reverse
    }

    /// The key interval this range denotes.
    pub(crate) fn resolve(&self) -> KeyRange {
        let mut start = self.start.clone().map_or(Bound::Unbounded, Bound::Included);
        let mut end = self.end.clone().map_or(Bound::Unbounded, Bound::Excluded);
        if let Some(p) = &self.prefix {
            if self.start.as_ref().is_none_or(|s| s < p) {
                start = Bound::Included(p.clone());
            }
            if let Some(succ) = prefix_successor(p) {
                if self.end.as_ref().is_none_or(|e| *e > succ) {
                    end = Bound::Excluded(succ);
                }
            }
        }
        KeyRange { start, end }
    }
}

/// The smallest key greater than every key with this prefix, if one exists.
fn prefix_successor(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut succ = prefix.to_vec();
    while let Some(last) = succ.pop() {
        if last < 0xff {
            succ.push(last + 1);
            return Some(succ);
        }
    }
    None
}

/// An iterator over `(key, value)` pairs of a range, copying a chunk at a time out of the index
/// so that a long-lived iterator never holds a lock.
pub struct Scan<'a> {
    snap: &'a Snapshot,
    meter: &'a MeterCell,
    table: String,
    range: KeyRange,
    reverse: bool,
    base: VecDeque<(Vec<u8>, Vec<u8>)>,
    base_more: bool,
    overlay: VecDeque<(Vec<u8>, Option<Vec<u8>>)>,
    /// Set after an error was returned: the iteration is over.
    failed: bool,
}

impl std::fmt::Debug for Scan<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scan").field("table", &self.table).field("reverse", &self.reverse).finish()
    }
}

impl<'a> Scan<'a> {
    pub(crate) fn new(
        snap: &'a Snapshot,
        meter: &'a MeterCell,
        table: &str,
        range: &ScanRange,
        overlay: Vec<(Vec<u8>, Option<Vec<u8>>)>,
        hide_base: bool,
    ) -> Self {
        let resolved = range.resolve();
        let base_more = !hide_base && !resolved.is_empty();
        Scan {
            snap,
            meter,
            table: table.to_owned(),
            range: resolved,
            reverse: range.is_reverse(),
            base: VecDeque::new(),
            base_more,
            overlay: overlay.into(),
            failed: false,
        }
    }

    fn refill(&mut self) {
        if !self.base.is_empty() || !self.base_more {
            return;
        }
        let (entries, more) = self.snap.chunk(&self.table, &self.range, self.reverse);
        if let Some((last, _)) = entries.last() {
            if self.reverse {
                self.range.end = Bound::Excluded(last.clone());
            } else {
                self.range.start = Bound::Excluded(last.clone());
            }
        }
        self.base_more = more && !entries.is_empty();
        self.base = entries.into();
    }

    /// Whether `a` comes before `b` in this scan's order.
    fn before(&self, a: &[u8], b: &[u8]) -> bool {
        if self.reverse {
            a > b
        } else {
            a < b
        }
    }
}

impl Iterator for Scan<'_> {
    type Item = Result<(Vec<u8>, Vec<u8>)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        if let Err(e) = self.meter.check() {
            // The transaction is over: report it once, then end the iteration.
            self.failed = true;
            return Some(Err(e));
        }
        loop {
            self.refill();
            let take_overlay = match (self.base.front(), self.overlay.front()) {
                (None, None) => return None,
                (Some(_), None) => false,
                (None, Some(_)) => true,
                (Some((bk, _)), Some((ok, _))) => {
                    if bk == ok {
                        self.base.pop_front(); // The transaction's own write shadows the snapshot.
                        true
                    } else {
                        !self.before(bk, ok)
                    }
                }
            };
            if take_overlay {
                let (k, v) = self.overlay.pop_front()?;
                match v {
                    Some(v) => return Some(Ok((k, v))),
                    None => continue, // Deleted by this transaction.
                }
            }
            return self.base.pop_front().map(Ok);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_successor_handles_ff() {
        assert_eq!(prefix_successor(b"ab"), Some(b"ac".to_vec()));
        assert_eq!(prefix_successor(&[0x61, 0xff]), Some(vec![0x62]));
        assert_eq!(prefix_successor(&[0xff, 0xff]), None);
        assert_eq!(prefix_successor(b""), None);
    }

    #[test]
    fn prefix_intersects_with_bounds() {
        let r = ScanRange::prefix(b"user:".to_vec()).start(b"user:m".to_vec()).resolve();
        assert!(r.contains(b"user:z"));
        assert!(!r.contains(b"user:a"));
        assert!(!r.contains(b"uses"));
        let r = ScanRange::prefix(b"b".to_vec()).end(b"a".to_vec()).resolve();
        assert!(r.is_empty());
    }
}
