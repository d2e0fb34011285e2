//! redb: a copy-on-write B-tree in one file, no log. `sync` = `Durability::Immediate`;
//! `relaxed` = `Durability::None` (not persisted until a later `Immediate` commit: a crash
//! loses it); `periodic` = `Durability::None` plus a background `Immediate` empty commit every
//! 100 ms, which persists everything before it.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use redb::{Database, Durability, ReadOnlyTable, ReadableDatabase, ReadableTable, TableDefinition};

use super::{Mode, Reader, Store, System, Ticker};

const TABLE: TableDefinition<&[u8], &[u8]> = TableDefinition::new("kv");

/// redb.
pub struct Redb;

impl System for Redb {
    fn name(&self) -> &'static str {
        "redb"
    }

    fn describe(&self, mode: Mode) -> String {
        match mode {
            Mode::Sync => "Durability::Immediate".to_string(),
            Mode::Periodic => "Durability::None + Immediate empty commit every 100 ms (bench thread)".to_string(),
            Mode::Relaxed => "Durability::None (lost on crash until an Immediate commit)".to_string(),
        }
    }

    fn describe_checkpoint(&self) -> &'static str {
        "an empty Durability::Immediate commit"
    }

    fn open(&self, dir: &Path, mode: Mode) -> anyhow::Result<Box<dyn Store>> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join("kv.redb");
        let db = Arc::new(Database::create(&path).with_context(|| format!("opening redb {}", path.display()))?);
        let tx = db.begin_write()?;
        tx.open_table(TABLE)?;
        tx.commit()?;
        let ticker = match mode {
            Mode::Periodic => {
                let db = Arc::clone(&db);
                Some(Ticker::start("redb", move || {
                    let _ = immediate_commit(&db);
                })?)
            }
            _ => None,
        };
        let durability = match mode {
            Mode::Sync => Durability::Immediate,
            Mode::Periodic | Mode::Relaxed => Durability::None,
        };
        Ok(Box::new(RedbStore { db, durability, ticker }))
    }
}

fn immediate_commit(db: &Database) -> anyhow::Result<()> {
    let mut tx = db.begin_write()?;
    tx.set_durability(Durability::Immediate)?;
    tx.commit()?;
    Ok(())
}

struct RedbStore {
    db: Arc<Database>,
    durability: Durability,
    ticker: Option<Ticker>,
}

impl Store for RedbStore {
    fn write(&self, update: Option<&[u8]>, puts: &[(&[u8], &[u8])]) -> anyhow::Result<()> {
        let mut tx = self.db.begin_write()?;
        tx.set_durability(self.durability)?;
        {
            let mut table = tx.open_table(TABLE)?;
            if let Some(key) = update {
                let mut value = table.get(key)?.context("update of a missing key")?.value().to_vec();
                value.push(b' ');
                table.insert(key, value.as_slice())?;
            }
            for (key, value) in puts {
                table.insert(*key, *value)?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn reader(&self) -> anyhow::Result<Box<dyn Reader + '_>> {
        let tx = self.db.begin_read()?;
        let table = tx.open_table(TABLE)?;
        Ok(Box::new(RedbReader(table)))
    }

    fn checkpoint(&self) -> anyhow::Result<()> {
        immediate_commit(&self.db)
    }

    fn close(mut self: Box<Self>) -> anyhow::Result<()> {
        if let Some(mut ticker) = self.ticker.take() {
            ticker.stop();
        }
        immediate_commit(&self.db)
    }
}

struct RedbReader(ReadOnlyTable<&'static [u8], &'static [u8]>);

impl Reader for RedbReader {
    fn get_into(&mut self, key: &[u8], out: &mut Vec<u8>) -> anyhow::Result<bool> {
        let guard = self.0.get(key)?;
        Ok(super::copy_into(guard.as_ref().map(|v| v.value()), out))
    }
}
