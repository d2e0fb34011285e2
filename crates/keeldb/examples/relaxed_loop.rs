//! Profiling driver: N transactions of K puts each on a fresh store (default options).
//! Usage: relaxed_loop N K DURABILITY(relaxed|periodic|sync)
#![allow(clippy::unwrap_used, clippy::expect_used)]
use keeldb::{Database, Durability, Options};
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(20_000);
    let k: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(5);
    let durability = Durability::parse(args.get(3).map_or("relaxed", String::as_str)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = Database::open(dir.path().join("s"), Options::with_durability(durability)).unwrap();
    let t = std::time::Instant::now();
    for i in 0..n {
        let mut tx = db.begin_write().unwrap();
        for j in 0..k {
            tx.put("t", &(i * k + j).to_be_bytes(), &[7u8; 100]).unwrap();
        }
        tx.commit().unwrap();
    }
    println!("{:.2} us per {k}-op txn", t.elapsed().as_secs_f64() * 1e6 / n as f64);
    db.close().unwrap();
}
