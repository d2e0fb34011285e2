//! fjall: an LSM-tree with a journal. `sync` = a write batch with
//! `durability(PersistMode::SyncData)`; `periodic` = `PersistMode::Buffer` (fjall's default:
//! flushed to the OS) plus `Database::persist(SyncData)` every 100 ms (bench thread);
//! `relaxed` = `PersistMode::Buffer` only.

use std::path::Path;

use anyhow::Context;
use fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode, Readable, Snapshot};

use super::{Mode, Reader, Store, System, Ticker};

/// fjall.
pub struct Fjall;

impl System for Fjall {
    fn name(&self) -> &'static str {
        "fjall"
    }

    fn describe(&self, mode: Mode) -> String {
        match mode {
            Mode::Sync => "WriteBatch durability PersistMode::SyncData".to_string(),
            Mode::Periodic => {
                "PersistMode::Buffer per batch + Database::persist(SyncData) every 100 ms (bench thread)".to_string()
            }
            Mode::Relaxed => "PersistMode::Buffer per batch (the default: flushed to the OS)".to_string(),
        }
    }

    fn describe_checkpoint(&self) -> &'static str {
        "memtable rotated and flushed to a segment, then persist(SyncAll)"
    }

    fn open(&self, dir: &Path, mode: Mode) -> anyhow::Result<Box<dyn Store>> {
        let db = Database::builder(dir).open().with_context(|| format!("opening fjall {}", dir.display()))?;
        let keyspace = db.keyspace("kv", KeyspaceCreateOptions::default)?;
        let ticker = match mode {
            Mode::Periodic => {
                let db = db.clone();
                Some(Ticker::start("fjall", move || {
                    let _ = db.persist(PersistMode::SyncData);
                })?)
            }
            _ => None,
        };
        let durability = match mode {
            Mode::Sync => Some(PersistMode::SyncData),
            // fjall's own default for a batch when journal persistence is automatic.
            Mode::Periodic | Mode::Relaxed => Some(PersistMode::Buffer),
        };
        Ok(Box::new(FjallStore { db, keyspace, durability, ticker }))
    }
}

struct FjallStore {
    db: Database,
    keyspace: Keyspace,
    durability: Option<PersistMode>,
    ticker: Option<Ticker>,
}

impl Store for FjallStore {
    fn write(&self, update: Option<&[u8]>, puts: &[(&[u8], &[u8])]) -> anyhow::Result<()> {
        let mut batch = self.db.batch().durability(self.durability);
        if let Some(key) = update {
            let mut value = self.keyspace.get(key)?.context("update of a missing key")?.to_vec();
            value.push(b' ');
            batch.insert(&self.keyspace, key, value);
        }
        for (key, value) in puts {
            batch.insert(&self.keyspace, *key, *value);
        }
        batch.commit()?;
        Ok(())
    }

    fn reader(&self) -> anyhow::Result<Box<dyn Reader + '_>> {
        Ok(Box::new(FjallReader { snapshot: self.db.snapshot(), keyspace: &self.keyspace }))
    }

    fn checkpoint(&self) -> anyhow::Result<()> {
        self.keyspace.rotate_memtable_and_wait()?;
        self.db.persist(PersistMode::SyncAll)?;
        Ok(())
    }

    fn close(mut self: Box<Self>) -> anyhow::Result<()> {
        if let Some(mut ticker) = self.ticker.take() {
            ticker.stop();
        }
        self.db.persist(PersistMode::SyncAll)?;
        Ok(())
    }
}

struct FjallReader<'a> {
    snapshot: Snapshot,
    keyspace: &'a Keyspace,
}

impl Reader for FjallReader<'_> {
    fn get_into(&mut self, key: &[u8], out: &mut Vec<u8>) -> anyhow::Result<bool> {
        let value = self.snapshot.get(self.keyspace, key)?;
        Ok(super::copy_into(value.as_deref(), out))
    }
}
