//! Model-based test: random operation sequences over several tables, with rollbacks,
//! checkpoints and reopens in between, checked against a `BTreeMap` model after every step.
//! Failing seeds are printed; `KEEL_MODEL_SEED=<n>` replays one, `KEEL_MODEL_SEEDS=<n>` runs more.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod common;
use std::collections::BTreeMap;
use std::ops::Bound;

use common::*;
use keeldb::{Database, Durability, Options, ScanRange, StateDigest};
use rand::{rngs::StdRng, Rng, SeedableRng};

type Model = BTreeMap<String, BTreeMap<Vec<u8>, Vec<u8>>>;

const TABLES: [&str; 3] = ["a", "b", "c"];

fn key(rng: &mut StdRng) -> Vec<u8> {
    // A small key space forces overwrites and deletes of existing keys; some long keys
    // exercise the heap-allocated key path.
    let n: u8 = rng.gen_range(0..40);
    if rng.gen_bool(0.1) {
        let mut k = vec![b'L'; 30];
        k.push(n);
        k
    } else {
        vec![b'k', n / 10, n % 10]
    }
}

fn digest_of(model: &Model) -> StateDigest {
    let mut d = StateDigest::default();
    for (t, kv) in model {
        for (k, v) in kv {
            d.add(t, k, v);
        }
    }
    d
}

fn check(db: &Database, model: &Model, rng: &mut StdRng) {
    let rx = db.begin_read().unwrap();
    let live: Vec<String> = model.iter().filter(|(_, kv)| !kv.is_empty()).map(|(t, _)| t.clone()).collect();
    for t in rx.tables() {
        // Tables may exist with no keys left; every table with keys must be listed.
        assert!(TABLES.contains(&t.as_str()));
    }
    for t in &live {
        assert!(rx.tables().contains(t), "table {t} missing from {:?}", rx.tables());
    }
    for t in TABLES {
        let empty = BTreeMap::new();
        let want = model.get(t).unwrap_or(&empty);
        let got: BTreeMap<Vec<u8>, Vec<u8>> = rx.scan(t, ScanRange::all()).unwrap().map(|r| r.unwrap()).collect();
        assert_eq!(&got, want, "table {t}");
        // A random bounded scan, both directions.
        let (mut lo, mut hi) = (key(rng), key(rng));
        if lo > hi {
            std::mem::swap(&mut lo, &mut hi);
        }
        let want_range: Vec<(Vec<u8>, Vec<u8>)> = want
            .range::<Vec<u8>, _>((Bound::Included(lo.clone()), Bound::Excluded(hi.clone())))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let got_range: Vec<(Vec<u8>, Vec<u8>)> =
            rx.scan(t, ScanRange::all().start(lo.clone()).end(hi.clone())).unwrap().map(|r| r.unwrap()).collect();
        assert_eq!(got_range, want_range, "range scan of {t}");
        let mut rev: Vec<(Vec<u8>, Vec<u8>)> =
            rx.scan(t, ScanRange::all().start(lo).end(hi).reverse()).unwrap().map(|r| r.unwrap()).collect();
        rev.reverse();
        assert_eq!(rev, want_range, "reverse range scan of {t}");
        let probe = key(rng);
        assert_eq!(rx.get(t, &probe).unwrap().as_ref(), want.get(&probe));
    }
    assert_eq!(db.digest(), digest_of(model), "maintained digest differs from the model's");
}

fn run(seed: u64, steps: usize) {
    let t = TestDir::new();
    let path = t.path();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut opts = Options { background_threads: false, wal_segment_bytes: 8 * 1024, ..Options::default() };
    opts.durability = [Durability::Sync, Durability::Relaxed][rng.gen_range(0..2)];
    let mut db = Database::open(&path, opts.clone()).unwrap();
    let mut model: Model = BTreeMap::new();
    for _step in 0..steps {
        match rng.gen_range(0..100) {
            0..=69 => {
                // A transaction of a few writes, committed or rolled back.
                let mut tx = db.begin_write().unwrap();
                let mut staged = model.clone();
                for _ in 0..rng.gen_range(1..6) {
                    let table = TABLES[rng.gen_range(0..3)];
                    let k = key(&mut rng);
                    if rng.gen_bool(0.7) {
                        let v: Vec<u8> = (0..rng.gen_range(0..50)).map(|_| rng.gen()).collect();
                        tx.put(table, &k, &v).unwrap();
                        staged.entry(table.to_owned()).or_default().insert(k.clone(), v.clone());
                        assert_eq!(tx.get(table, &k).unwrap(), Some(v), "read-your-own-write");
                    } else {
                        tx.delete(table, &k).unwrap();
                        staged.entry(table.to_owned()).or_default().remove(&k);
                        assert_eq!(tx.get(table, &k).unwrap(), None);
                    }
                }
                if rng.gen_bool(0.9) {
                    tx.commit().unwrap();
                    model = staged;
                } else {
                    tx.rollback();
                }
            }
            70..=74 => {
                let table = TABLES[rng.gen_range(0..3)];
                let mut tx = db.begin_write().unwrap();
                tx.drop_table(table).unwrap();
                tx.commit().unwrap();
                model.remove(table);
            }
            75..=84 => {
                db.checkpoint().unwrap();
            }
            85..=92 => {
                db.close().unwrap();
                db = Database::open(&path, opts.clone()).unwrap();
            }
            _ => {
                // Reopen without a clean close: every acknowledged commit must survive a
                // process crash in every mode (the OS keeps written data).
                drop(db);
                db = Database::open(&path, opts.clone()).unwrap();
            }
        }
        check(&db, &model, &mut rng);
    }
    db.close().unwrap();
    let v = keeldb::verify(&path).unwrap();
    assert!(v.is_intact(), "seed {seed}: {v}");
    assert_eq!(v.digest, Some(digest_of(&model)));
}

#[test]
fn random_operations_match_the_model_across_reopens() {
    let seeds: Vec<u64> = match std::env::var("KEEL_MODEL_SEED") {
        Ok(s) => vec![s.parse().expect("KEEL_MODEL_SEED must be a number")],
        Err(_) => {
            let n: u64 = std::env::var("KEEL_MODEL_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(12);
            let base: u64 = rand::random();
            (0..n).map(|i| base.wrapping_add(i)).collect()
        }
    };
    for seed in seeds {
        let result = std::panic::catch_unwind(|| run(seed, 150));
        if let Err(e) = result {
            eprintln!(
                "model test failed; replay with KEEL_MODEL_SEED={seed} cargo test -p keeldb --test model_random_ops"
            );
            std::panic::resume_unwind(e);
        }
    }
}
