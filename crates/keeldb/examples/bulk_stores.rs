//! Profiling driver for the durability suite's pattern: STORES fresh stores opened one after
//! another in one process, each given T relaxed transactions of K puts (200-byte values),
//! then closed and deleted. Prints µs per put for each store, and the slowest commit.
//! Usage: bulk_stores STORES T K
#![allow(clippy::unwrap_used, clippy::expect_used)]
use keeldb::{Database, Durability, Options};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let stores: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(5);
    let txns: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(2_000);
    let k: u64 = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(100);
    let value = [7u8; 200];
    for s in 0..stores {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::open(dir.path().join("s"), Options::with_durability(Durability::Relaxed)).unwrap();
        let mut slowest = std::time::Duration::ZERO;
        let t = std::time::Instant::now();
        for i in 0..txns {
            let c = std::time::Instant::now();
            let mut tx = db.begin_write().unwrap();
            for j in 0..k {
                tx.put("tasks", format!("task-{:012}", i * k + j).as_bytes(), &value).unwrap();
            }
            tx.commit().unwrap();
            slowest = slowest.max(c.elapsed());
        }
        let e = t.elapsed();
        db.close().unwrap();
        println!(
            "store {s}: {:.3} us per put, slowest commit {} us",
            e.as_secs_f64() * 1e6 / (txns * k) as f64,
            slowest.as_micros()
        );
    }
}
