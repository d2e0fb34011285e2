//! Profiling driver for reopen: N keys (16-byte, hashed prefix, 100-byte values) loaded in
//! transactions of 10,000 into DIR, then exits without closing (`load`); a timed reopen that
//! replays the WAL, then checkpoints and closes (`wal`); a timed reopen from that checkpoint
//! (`checkpoint`, repeatable).
//! `load-wal` loads the same with automatic checkpoints off (the scale suite's store: the
//! whole history in the WAL).
//! `load1` is the recovery suite's fill instead (one put per relaxed commit); `wal-only` times
//! a reopen from the WAL and leaves the store as it was (repeatable).
//! Usage: reopen N DIR load|load-wal|load1|wal|wal-only|checkpoint
#![allow(clippy::unwrap_used, clippy::expect_used)]
use keeldb::{Database, Durability, Options, TxnOptions};

#[path = "common/keys.rs"]
mod keys;
use keys::key16;

fn timed_open(dir: &std::path::Path) -> (Database, f64) {
    let t = std::time::Instant::now();
    let db = Database::open(dir, Options::with_durability(Durability::Relaxed)).unwrap();
    (db, t.elapsed().as_secs_f64() * 1e3)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1_000_000);
    let dir = std::path::PathBuf::from(args.get(2).expect("usage: reopen N DIR PHASE"));
    match args.get(3).map(String::as_str) {
        Some(phase @ ("load" | "load-wal")) => {
            // `load-wal` is the scale suite's fill: no automatic checkpoint, the whole history
            // stays in the WAL.
            let options = if phase == "load-wal" {
                Options { checkpoint_wal_bytes: 0, ..Options::with_durability(Durability::Relaxed) }
            } else {
                Options::with_durability(Durability::Relaxed)
            };
            let db = Database::open(&dir, options).unwrap();
            let value = [42u8; 100];
            let mut next = 0;
            while next < n {
                let end = (next + 10_000).min(n);
                let mut tx = db
                    .begin_write_with(TxnOptions { durability: Some(Durability::Sync), ..TxnOptions::default() })
                    .unwrap();
                for i in next..end {
                    tx.put("large", &key16(i), &value).unwrap();
                }
                tx.commit().unwrap();
                next = end;
            }
            std::process::exit(0); // like a kill: no close, no checkpoint
        }
        Some("load1") => {
            // The recovery suite's fill: one put per relaxed commit, then a kill.
            let db = Database::open(&dir, Options::with_durability(Durability::Relaxed)).unwrap();
            let value = [42u8; 100];
            for i in 0..n {
                let mut tx = db.begin_write().unwrap();
                tx.put("large", &key16(i), &value).unwrap();
                tx.commit().unwrap();
            }
            std::process::exit(0);
        }
        Some("wal-only") => {
            let (_db, ms) = timed_open(&dir);
            println!("{n} keys: reopen from the WAL {ms:.0} ms ({} frames)", _db.recovery_report().frames_replayed);
            std::process::exit(0);
        }
        Some("wal") => {
            let (db, ms) = timed_open(&dir);
            println!("{n} keys: reopen from the WAL {ms:.0} ms ({} frames)", db.recovery_report().frames_replayed);
            db.checkpoint().unwrap();
            db.close().unwrap();
        }
        Some("checkpoint") => {
            let (_db, ms) = timed_open(&dir);
            println!("{n} keys: reopen from the checkpoint {ms:.0} ms");
            std::process::exit(0);
        }
        _ => panic!("PHASE is load, wal or checkpoint"),
    }
}
