//! Profiling driver for range scans: N keys (16-byte, hashed prefix, 100-byte values) loaded
//! in relaxed transactions of 10,000; then S scans of 100 entries from pseudo-random starts,
//! and one scan of the whole table, forward and reverse.
//! Usage: scan_loop N S
#![allow(clippy::unwrap_used, clippy::expect_used)]
use keeldb::{Database, Durability, Options, ScanRange};
use std::hint::black_box;

#[path = "common/keys.rs"]
mod keys;
use keys::{key16, mix64};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1_000_000);
    let scans: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(100_000);
    let dir = tempfile::tempdir().unwrap();
    let db = Database::open(dir.path().join("s"), Options::with_durability(Durability::Relaxed)).unwrap();
    let mut next = 0;
    while next < n {
        let end = (next + 10_000).min(n);
        let mut tx = db.begin_write().unwrap();
        for i in next..end {
            tx.put("t", &key16(i), &[42u8; 100]).unwrap();
        }
        tx.commit().unwrap();
        next = end;
    }
    let rx = db.begin_read().unwrap();
    let t = std::time::Instant::now();
    let mut seen = 0u64;
    for s in 0..scans {
        let start = key16(mix64(s) % n).to_vec();
        for entry in rx.scan("t", ScanRange::all().start(start)).unwrap().take(100) {
            black_box(entry.unwrap());
            seen += 1;
        }
    }
    let short = t.elapsed().as_nanos() as f64 / seen as f64;
    let full = |range: ScanRange| {
        let t = std::time::Instant::now();
        let mut count = 0u64;
        for entry in rx.scan("t", range).unwrap() {
            black_box(entry.unwrap());
            count += 1;
        }
        assert_eq!(count, n);
        t.elapsed().as_nanos() as f64 / n as f64
    };
    let (forward, reverse) = (full(ScanRange::all()), full(ScanRange::all().reverse()));
    println!(
        "{n} keys: short scans {short:.0} ns/entry; full scan {forward:.0} ns/entry, reverse {reverse:.0} ns/entry"
    );
}
