//! Per-tag totals of finished transactions (CPU, latency, outcomes, log2 histograms) and their
//! persistence: cumulative totals are saved to `accounting.txt` at close and after each
//! checkpoint, and merged back at open, so `keel stats` in another process can show them.
//!
//! The file is informational, not part of the durable state: it is written with a temp file
//! and a rename but not fsynced, carries a CRC32C, and a file that fails to parse is ignored
//! (and replaced at the next save) rather than failing the open.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::cpu::{Histogram, TagStats, HISTOGRAM_BUCKETS};
use crate::fs::{read_all, write_all_at, FileSystem, OpenMode};

use crate::files::ACCOUNTING_FILE;
const MAGIC: &str = "keel-accounting 1";

/// Most distinct tags tracked; further tags are totalled under `"(other)"`.
const MAX_TAGS: usize = 10_000;

/// Per-tag accounting of finished transactions.
#[derive(Debug, Default)]
pub struct Accounting {
    untagged: TagStats,
    tagged: crate::types::FastMap<Arc<str>, TagStats>,
}

/// How a transaction ended, for accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    Committed,
    RolledBack,
    Tripped(crate::cpu::Tripped),
}

impl Accounting {
    pub fn record(&mut self, tag: Option<&Arc<str>>, cpu: Duration, wall: Duration, ending: Ending) {
        let stats = match tag {
            None => &mut self.untagged,
            Some(t) => {
                let key = if self.tagged.len() >= MAX_TAGS && !self.tagged.contains_key(t) {
                    Arc::from("(other)")
                } else {
                    Arc::clone(t)
                };
                self.tagged
                    .entry(key)
                    .or_insert_with_key(|k| TagStats { tag: Some(k.to_string()), ..TagStats::default() })
            }
        };
        stats.transactions += 1;
        match ending {
            Ending::Committed => stats.commits += 1,
            Ending::RolledBack => {}
            Ending::Tripped(crate::cpu::Tripped::Cpu { .. }) => stats.cpu_budget_aborts += 1,
            Ending::Tripped(crate::cpu::Tripped::Timeout { .. }) => stats.timeouts += 1,
        }
        // Nanoseconds in u64: Duration additions normalize and `as_micros` divides in u128,
        // which showed up in the per-transaction cost.
        let (cpu_ns, wall_ns) = (duration_ns(cpu), duration_ns(wall));
        stats.cpu_time = Duration::from_nanos(duration_ns(stats.cpu_time).saturating_add(cpu_ns));
        stats.wall_time = Duration::from_nanos(duration_ns(stats.wall_time).saturating_add(wall_ns));
        stats.cpu_histogram.record_ns(cpu_ns);
        stats.latency_histogram.record_ns(wall_ns);
    }

    pub fn snapshot(&self) -> Vec<TagStats> {
        let mut out = Vec::with_capacity(self.tagged.len() + 1);
        if self.untagged.transactions > 0 {
            out.push(self.untagged.clone());
        }
        let mut tagged: Vec<TagStats> = self.tagged.values().cloned().collect();
        tagged.sort_by_key(|t| std::cmp::Reverse(t.cpu_time));
        out.extend(tagged);
        out
    }
}

fn duration_ns(d: Duration) -> u64 {
    d.as_secs().saturating_mul(1_000_000_000).saturating_add(u64::from(d.subsec_nanos()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

fn line_of(s: &TagStats) -> String {
    let tag = s.tag.as_deref().map_or("-".to_owned(), |t| format!("t{}", hex(t.as_bytes())));
    let hist = |h: &Histogram| h.buckets.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    format!(
        "{tag} {} {} {} {} {} {} {} {}\n",
        s.transactions,
        s.commits,
        s.cpu_budget_aborts,
        s.timeouts,
        s.cpu_time.as_nanos(),
        s.wall_time.as_nanos(),
        hist(&s.cpu_histogram),
        hist(&s.latency_histogram)
    )
}

fn parse_line(line: &str) -> Option<TagStats> {
    let mut f = line.split(' ');
    let tag = match f.next()? {
        "-" => None,
        t => Some(String::from_utf8(unhex(t.strip_prefix('t')?)?).ok()?),
    };
    let mut num = || f.next()?.parse::<u64>().ok();
    let (transactions, commits, cpu_budget_aborts, timeouts) = (num()?, num()?, num()?, num()?);
    let (cpu_ns, wall_ns) = (num()?, num()?);
    let mut hist = || -> Option<Histogram> {
        let mut h = Histogram::default();
        let parts: Vec<&str> = f.next()?.split(',').collect();
        if parts.len() != HISTOGRAM_BUCKETS {
            return None;
        }
        for (b, p) in h.buckets.iter_mut().zip(parts) {
            *b = p.parse().ok()?;
        }
        Some(h)
    };
    let (cpu_histogram, latency_histogram) = (hist()?, hist()?);
    Some(TagStats {
        tag,
        transactions,
        commits,
        cpu_budget_aborts,
        timeouts,
        cpu_time: Duration::from_nanos(cpu_ns),
        wall_time: Duration::from_nanos(wall_ns),
        cpu_histogram,
        latency_histogram,
    })
}

impl Accounting {
    /// Loads saved totals; `None` when absent or unreadable (never an error: informational).
    pub fn load(fs: &dyn FileSystem, dir: &Path) -> Option<Accounting> {
        let bytes = fs.open(&dir.join(ACCOUNTING_FILE), OpenMode::Read).and_then(|f| read_all(f.as_ref())).ok()?;
        let text = std::str::from_utf8(&bytes).ok()?;
        let (body, crc_line) = text.trim_end_matches('\n').rsplit_once('\n')?;
        let crc: u32 = crc_line.strip_prefix("crc ")?.parse().ok()?;
        if crc != crc32c::crc32c(body.as_bytes()) {
            return None;
        }
        let mut lines = body.lines();
        if lines.next()? != MAGIC {
            return None;
        }
        let mut acct = Accounting::default();
        for line in lines {
            let s = parse_line(line)?;
            match &s.tag {
                None => acct.untagged = s,
                Some(t) => {
                    acct.tagged.insert(Arc::from(t.as_str()), s);
                }
            }
        }
        Some(acct)
    }

    /// Saves the totals (temp file, rename; not fsynced: informational).
    pub fn save(&self, fs: &dyn FileSystem, dir: &Path) -> std::io::Result<()> {
        let mut body = String::from(MAGIC);
        body.push('\n');
        body.push_str(&line_of(&self.untagged));
        let mut tagged: Vec<&TagStats> = self.tagged.values().collect();
        tagged.sort_by(|a, b| a.tag.cmp(&b.tag));
        for s in tagged {
            body.push_str(&line_of(s));
        }
        let body = body.trim_end_matches('\n').to_owned();
        let text = format!("{body}\ncrc {}\n", crc32c::crc32c(body.as_bytes()));
        let tmp = dir.join(crate::files::tmp_name(ACCOUNTING_FILE));
        if fs.exists(&tmp)? {
            fs.remove_file(&tmp)?;
        }
        let f = fs.open(&tmp, OpenMode::CreateNew)?;
        write_all_at(f.as_ref(), text.as_bytes(), 0)?;
        fs.rename(&tmp, &dir.join(ACCOUNTING_FILE))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::StdFs;

    #[test]
    fn totals_round_trip_and_merge() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut a = Accounting::default();
        a.record(None, Duration::from_micros(5), Duration::from_micros(9), Ending::Committed);
        a.record(Some(&Arc::from("tenant a")), Duration::from_millis(3), Duration::from_millis(4), Ending::RolledBack);
        a.save(&StdFs, dir.path()).expect("save");
        let b = Accounting::load(&StdFs, dir.path()).expect("load");
        assert_eq!(b.snapshot(), a.snapshot());
        let snap = b.snapshot();
        assert_eq!(snap[0].transactions, 1);
        assert_eq!(snap[1].tag.as_deref(), Some("tenant a"));
        assert_eq!(snap[1].cpu_time, Duration::from_millis(3));
    }

    #[test]
    fn a_damaged_file_is_ignored() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut a = Accounting::default();
        a.record(None, Duration::from_micros(5), Duration::from_micros(9), Ending::Committed);
        a.save(&StdFs, dir.path()).expect("save");
        let p = dir.path().join(ACCOUNTING_FILE);
        let mut bytes = std::fs::read(&p).expect("read");
        bytes[20] ^= 1;
        std::fs::write(&p, bytes).expect("write");
        assert!(Accounting::load(&StdFs, dir.path()).is_none());
    }
}
