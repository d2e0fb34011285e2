//! KeelDB behind the [`Store`] interface, so it runs through exactly the code the peers run
//! through. `sync`, `periodic` (100 ms) and `relaxed` are the engine's own modes.

use std::path::Path;

use anyhow::Context;
use keeldb::{Database, Durability, Options, ReadTxn};

use super::{Mode, Reader, Store, System, PERIODIC_INTERVAL};

/// The table every store-interface write goes to.
pub const TABLE: &str = "bench";

/// KeelDB.
pub struct KeelDb;

/// The engine durability for a mode.
pub fn durability(mode: Mode) -> Durability {
    match mode {
        Mode::Sync => Durability::Sync,
        Mode::Periodic => Durability::Periodic(PERIODIC_INTERVAL),
        Mode::Relaxed => Durability::Relaxed,
    }
}

impl System for KeelDb {
    fn name(&self) -> &'static str {
        "keeldb"
    }

    fn describe(&self, mode: Mode) -> String {
        match mode {
            Mode::Sync => "Durability::Sync (group commit, one fdatasync per batch)".to_string(),
            Mode::Periodic => "Durability::Periodic(100 ms)".to_string(),
            Mode::Relaxed => "Durability::Relaxed".to_string(),
        }
    }

    fn describe_checkpoint(&self) -> &'static str {
        "Database::checkpoint (snapshot file, WAL segments dropped)"
    }

    fn open(&self, dir: &Path, mode: Mode) -> anyhow::Result<Box<dyn Store>> {
        Ok(Box::new(KeelStore::open(dir, Options::with_durability(durability(mode)))?))
    }
}

/// An open KeelDB store.
pub struct KeelStore {
    /// The engine handle, for suites that need more than the interface.
    pub db: Database,
}

impl KeelStore {
    /// Opens with explicit options (the recovery and scale suites turn off automatic
    /// checkpoints).
    pub fn open(dir: &Path, options: Options) -> anyhow::Result<KeelStore> {
        let db = Database::open(dir, options).with_context(|| format!("opening keeldb at {}", dir.display()))?;
        Ok(KeelStore { db })
    }
}

impl Store for KeelStore {
    fn write(&self, update: Option<&[u8]>, puts: &[(&[u8], &[u8])]) -> anyhow::Result<()> {
        let mut tx = self.db.begin_write()?;
        if let Some(key) = update {
            let mut value = tx.get(TABLE, key)?.context("update of a missing key")?;
            value.push(b' ');
            tx.put(TABLE, key, &value)?;
        }
        for (key, value) in puts {
            tx.put(TABLE, key, value)?;
        }
        tx.commit()?;
        Ok(())
    }

    fn reader(&self) -> anyhow::Result<Box<dyn Reader + '_>> {
        Ok(Box::new(KeelReader(self.db.begin_read()?)))
    }

    fn checkpoint(&self) -> anyhow::Result<()> {
        self.db.checkpoint()?;
        Ok(())
    }

    fn sync_counters(&self) -> Option<(u64, u64)> {
        let stats = self.db.stats();
        Some((stats.commits, stats.wal_syncs))
    }

    fn close(self: Box<Self>) -> anyhow::Result<()> {
        self.db.close().context("closing keeldb")
    }
}

struct KeelReader(ReadTxn);

impl Reader for KeelReader {
    fn get_into(&mut self, key: &[u8], out: &mut Vec<u8>) -> anyhow::Result<bool> {
        Ok(self.0.get_into(TABLE, key, out)?)
    }
}
