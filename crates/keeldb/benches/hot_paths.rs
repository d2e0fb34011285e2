//! Criterion micro-benchmarks of the engine's hot paths, through the public API only:
//! `cargo bench -p keeldb` (add `-- <filter>` to pick some, e.g. `-- point_read`).
//!
//! - `commit`: an empty write transaction, and one-put transactions in `relaxed` (the engine's
//!   own cost: validation, WAL encode + CRC32C, write(2), index apply) and `sync` (adds the
//!   fdatasync, so it measures the disk).
//! - `wal_encode`: relaxed one-put commits at growing value sizes, with byte throughput. The
//!   WAL encoder is internal, so it is measured through the commit path; the slope over value
//!   size is the per-byte cost of encoding, checksumming, writing the frame and applying it.
//!   Commits overwrite a fixed set of 1,024 keys so the heap stays the same size (with fresh
//!   keys, page faults of the growing heap and the checkpoint thread dominate the profile).
//! - `point_read`: `get` on a 100,000-key table from one snapshot, and `begin_read` + `get`.
//! - `scan`: the first 100 pairs from a random start key.
//! - `digest`: `StateDigest::add` for one entry.
//!
//! Figures from these are for regressions on one machine; `keel bench` is the user-facing
//! report and the only source of published numbers.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use keeldb::{Database, Durability, Options, ScanRange, StateDigest};

const TABLE: &str = "bench";
const KEYS: u64 = 100_000;

fn key(i: u64) -> [u8; 16] {
    // A multiplicative hash spreads keys over the key space; the suffix keeps them unique.
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes());
    key[8..].copy_from_slice(&i.to_be_bytes());
    key
}

fn open(durability: Durability) -> (tempfile::TempDir, Database) {
    let dir = tempfile::tempdir().unwrap();
    let db = Database::open(dir.path().join("store"), Options::with_durability(durability)).unwrap();
    (dir, db)
}

fn loaded() -> (tempfile::TempDir, Database) {
    let (dir, db) = open(Durability::Relaxed);
    let value = [b'v'; 100];
    for chunk in (0..KEYS).collect::<Vec<_>>().chunks(10_000) {
        let mut tx = db.begin_write().unwrap();
        for &i in chunk {
            tx.put(TABLE, &key(i), &value).unwrap();
        }
        tx.commit().unwrap();
    }
    (dir, db)
}

fn commit(c: &mut Criterion) {
    let mut group = c.benchmark_group("commit");
    let (_dir, db) = open(Durability::Relaxed);
    group.bench_function("empty_write_txn", |b| {
        b.iter(|| db.begin_write().unwrap().commit().unwrap());
    });
    let value = [b'v'; 100];
    let mut i = 0u64;
    group.bench_function("relaxed_one_put_100B", |b| {
        b.iter(|| {
            i += 1;
            let mut tx = db.begin_write().unwrap();
            tx.put(TABLE, &key(i), &value).unwrap();
            tx.commit().unwrap()
        });
    });
    db.close().unwrap();
    let (_sync_dir, db) = open(Durability::Sync);
    group.sample_size(20);
    group.bench_function("sync_one_put_100B", |b| {
        b.iter(|| {
            i += 1;
            let mut tx = db.begin_write().unwrap();
            tx.put(TABLE, &key(i), &value).unwrap();
            tx.commit().unwrap()
        });
    });
    db.close().unwrap();
    group.finish();
}

fn wal_encode(c: &mut Criterion) {
    let mut group = c.benchmark_group("wal_encode");
    let (_dir, db) = open(Durability::Relaxed);
    let mut i = 0u64;
    for size in [16usize, 1024, 16 * 1024] {
        let value = vec![b'w'; size];
        group.throughput(Throughput::Bytes(size as u64 + 16));
        group.bench_with_input(BenchmarkId::new("relaxed_commit", size), &value, |b, value| {
            b.iter(|| {
                i += 1;
                let mut tx = db.begin_write().unwrap();
                tx.put(TABLE, &key(i % 1_024), value).unwrap();
                tx.commit().unwrap()
            });
        });
    }
    group.finish();
    db.close().unwrap();
}

fn point_read(c: &mut Criterion) {
    let mut group = c.benchmark_group("point_read");
    let (_dir, db) = loaded();
    let rx = db.begin_read().unwrap();
    let mut i = 0u64;
    group.bench_function("get_100k_keys", |b| {
        b.iter(|| {
            i = (i + 7_919) % KEYS;
            black_box(rx.get(TABLE, &key(i)).unwrap())
        });
    });
    drop(rx);
    group.bench_function("begin_read_and_get", |b| {
        b.iter(|| {
            i = (i + 7_919) % KEYS;
            let rx = db.begin_read().unwrap();
            black_box(rx.get(TABLE, &key(i)).unwrap())
        });
    });
    group.finish();
    db.close().unwrap();
}

fn scan(c: &mut Criterion) {
    let mut group = c.benchmark_group("scan");
    let (_dir, db) = loaded();
    let rx = db.begin_read().unwrap();
    let mut i = 0u64;
    group.throughput(Throughput::Elements(100));
    group.bench_function("first_100_from_random_start", |b| {
        b.iter(|| {
            i = (i + 7_919) % KEYS;
            let range = ScanRange::all().start(key(i).to_vec());
            let mut count = 0;
            for item in rx.scan(TABLE, range).unwrap().take(100) {
                black_box(item.unwrap());
                count += 1;
            }
            count
        });
    });
    drop(rx);
    group.finish();
    db.close().unwrap();
}

fn digest(c: &mut Criterion) {
    let mut group = c.benchmark_group("digest");
    for size in [100usize, 1024] {
        let value = vec![b'd'; size];
        let mut digest = StateDigest::default();
        let mut i = 0u64;
        group.throughput(Throughput::Bytes(size as u64 + 16));
        group.bench_with_input(BenchmarkId::new("add", size), &value, |b, value| {
            b.iter(|| {
                i += 1;
                digest.add(TABLE, &key(i), value);
                black_box(digest)
            });
        });
    }
    group.finish();
}

criterion_group!(benches, commit, wal_encode, point_read, scan, digest);
criterion_main!(benches);
