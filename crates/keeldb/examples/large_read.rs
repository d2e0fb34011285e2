//! Profiling driver for the mvcc suite's large table: N keys (16-byte, hashed prefix) with
//! 100-byte values loaded in relaxed transactions of 10,000, resident bytes per key, then R
//! point reads in a pseudo-random order from one snapshot, by `get`, by `get_into`, then by `get_many` 64 keys at a time.
//! Usage: large_read N R
#![allow(clippy::unwrap_used, clippy::expect_used)]
use keeldb::{Database, Durability, Options};
use std::hint::black_box;

#[path = "common/keys.rs"]
mod keys;
use keys::{key16, mix64};

fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1_000_000);
    let reads: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(2_000_000);
    let dir = tempfile::tempdir().unwrap();
    let db = Database::open(dir.path().join("s"), Options::with_durability(Durability::Relaxed)).unwrap();
    let value = [42u8; 100];
    let before = rss();
    let t = std::time::Instant::now();
    let mut next = 0;
    while next < n {
        let end = (next + 10_000).min(n);
        let mut tx = db.begin_write().unwrap();
        for i in next..end {
            tx.put("large", &key16(i), &value).unwrap();
        }
        tx.commit().unwrap();
        next = end;
    }
    let load = t.elapsed();
    let after = rss();
    let rx = db.begin_read().unwrap();
    let mut state = 0xbeadu64;
    let mut found = 0u64;
    let t = std::time::Instant::now();
    for _ in 0..reads {
        state = state.wrapping_add(1);
        if black_box(rx.get("large", &key16(mix64(state) % n)).unwrap()).is_some() {
            found += 1;
        }
    }
    let read = t.elapsed();
    assert_eq!(found, reads);
    // The same reads into one reused buffer.
    let mut buf = Vec::new();
    let mut state = 0xbeadu64;
    let t = std::time::Instant::now();
    for _ in 0..reads {
        state = state.wrapping_add(1);
        if black_box(rx.get_into("large", &key16(mix64(state) % n), &mut buf).unwrap()) {
            found += 1;
        }
    }
    let read_into = t.elapsed();
    assert_eq!(found, 2 * reads);
    println!("get_into: {:.0} ns/read", read_into.as_nanos() as f64 / reads as f64);
    // The same reads, 64 keys per get_many call.
    let mut state = 0xbeadu64;
    let mut batch: Vec<[u8; 16]> = Vec::with_capacity(64);
    let t = std::time::Instant::now();
    for _ in 0..reads / 64 {
        batch.clear();
        for _ in 0..64 {
            state = state.wrapping_add(1);
            batch.push(key16(mix64(state) % n));
        }
        found += black_box(rx.get_many("large", &batch).unwrap()).iter().filter(|v| v.is_some()).count() as u64;
    }
    let read_many = t.elapsed();
    assert_eq!(found, 2 * reads + reads / 64 * 64);
    println!("get_many (64 a call): {:.0} ns/read", read_many.as_nanos() as f64 / (reads / 64 * 64) as f64);
    println!(
        "{n} keys loaded in {:.2} s ({:.0} keys/s); {:.0} resident bytes/key; {:.0} ns/read",
        load.as_secs_f64(),
        n as f64 / load.as_secs_f64(),
        (after - before) as f64 / n as f64,
        read.as_nanos() as f64 / reads as f64
    );
    let huge = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
    if let Some(l) = huge.lines().find(|l| l.starts_with("AnonHugePages:")) {
        println!("{l}");
    }
    drop(rx);
    db.close().unwrap();
}
