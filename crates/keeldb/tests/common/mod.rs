//! Shared helpers for the integration tests, so API changes touch one place.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::path::{Path, PathBuf};

use keeldb::{Database, Durability, Options, ScanRange};

pub struct TestDir {
    pub dir: tempfile::TempDir,
}

impl TestDir {
    pub fn new() -> Self {
        TestDir { dir: tempfile::tempdir().expect("tempdir") }
    }
    pub fn path(&self) -> PathBuf {
        self.dir.path().join("store")
    }
}

pub fn opts(d: Durability) -> Options {
    Options { durability: d, background_threads: false, ..Options::default() }
}

pub fn open(path: &Path) -> Database {
    Database::open(path, opts(Durability::Sync)).expect("open")
}

pub fn put(db: &Database, table: &str, k: &[u8], v: &[u8]) -> u64 {
    let mut tx = db.begin_write().unwrap();
    tx.put(table, k, v).unwrap();
    tx.commit().unwrap().ts
}

pub fn get(db: &Database, table: &str, k: &[u8]) -> Option<Vec<u8>> {
    db.begin_read().unwrap().get(table, k).unwrap()
}

pub fn scan_all(db: &Database, table: &str) -> Vec<(Vec<u8>, Vec<u8>)> {
    let rx = db.begin_read().unwrap();
    rx.scan(table, ScanRange::all()).unwrap().map(|r| r.unwrap()).collect()
}

/// Paths of files in `dir` whose names start with `prefix`, sorted.
pub fn files(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with(prefix))
        .collect();
    v.sort();
    v
}
