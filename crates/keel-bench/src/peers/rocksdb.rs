//! RocksDB (rust-rocksdb, compression libraries off). `sync` = `WriteOptions::set_sync(true)`;
//! `periodic` = WAL written to the OS (`sync=false`) plus `DB::flush_wal(true)` every 100 ms
//! (bench thread); `relaxed` = `sync=false` (WAL kept, not synced). Compiled only with the
//! `rocksdb` feature: its C++ build needs libclang-dev and about 11 minutes on two cores.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use rocksdb::{Options, WriteBatch, WriteOptions, DB};

use super::{Mode, Reader, Store, System, Ticker};

/// RocksDB.
pub struct RocksDb;

impl System for RocksDb {
    fn name(&self) -> &'static str {
        "rocksdb"
    }

    fn describe(&self, mode: Mode) -> String {
        match mode {
            Mode::Sync => "WriteOptions sync=true".to_string(),
            Mode::Periodic => "sync=false + DB::flush_wal(true) every 100 ms (bench thread)".to_string(),
            Mode::Relaxed => "sync=false (WAL on, not synced)".to_string(),
        }
    }

    fn describe_checkpoint(&self) -> &'static str {
        "DB::flush (memtable to SST) and flush_wal(true)"
    }

    fn open(&self, dir: &Path, mode: Mode) -> anyhow::Result<Box<dyn Store>> {
        let mut options = Options::default();
        options.create_if_missing(true);
        let db = Arc::new(DB::open(&options, dir).with_context(|| format!("opening rocksdb {}", dir.display()))?);
        let ticker = match mode {
            Mode::Periodic => {
                let db = Arc::clone(&db);
                Some(Ticker::start("rocksdb", move || {
                    let _ = db.flush_wal(true);
                })?)
            }
            _ => None,
        };
        let mut write_options = WriteOptions::default();
        write_options.set_sync(mode == Mode::Sync);
        Ok(Box::new(RocksStore { db, write_options, ticker }))
    }
}

struct RocksStore {
    db: Arc<DB>,
    write_options: WriteOptions,
    ticker: Option<Ticker>,
}

impl Store for RocksStore {
    fn write(&self, update: Option<&[u8]>, puts: &[(&[u8], &[u8])]) -> anyhow::Result<()> {
        let mut batch = WriteBatch::default();
        if let Some(key) = update {
            let mut value = self.db.get(key)?.context("update of a missing key")?;
            value.push(b' ');
            batch.put(key, value);
        }
        for (key, value) in puts {
            batch.put(key, value);
        }
        self.db.write_opt(batch, &self.write_options)?;
        Ok(())
    }

    fn reader(&self) -> anyhow::Result<Box<dyn Reader + '_>> {
        Ok(Box::new(RocksReader(&self.db)))
    }

    fn checkpoint(&self) -> anyhow::Result<()> {
        self.db.flush()?;
        self.db.flush_wal(true)?;
        Ok(())
    }

    fn close(mut self: Box<Self>) -> anyhow::Result<()> {
        if let Some(mut ticker) = self.ticker.take() {
            ticker.stop();
        }
        self.db.flush_wal(true)?;
        Ok(())
    }
}

struct RocksReader<'a>(&'a DB);

impl Reader for RocksReader<'_> {
    fn get_into(&mut self, key: &[u8], out: &mut Vec<u8>) -> anyhow::Result<bool> {
        let value = self.0.get_pinned(key)?;
        Ok(super::copy_into(value.as_deref(), out))
    }
}
