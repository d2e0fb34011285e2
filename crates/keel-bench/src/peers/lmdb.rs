//! LMDB through heed: a memory-mapped copy-on-write B-tree, no log. `sync` = default flags
//! (fsync of data and meta page at every commit); `periodic` = `NO_SYNC` plus
//! `Env::force_sync` every 100 ms (bench thread); `relaxed` = `NO_SYNC | NO_META_SYNC`.
//!
//! This is the one module of the crate with `unsafe`: heed marks opening an environment and
//! setting its flags unsafe because LMDB's guarantees depend on how the file is shared.
#![allow(unsafe_code)]

use std::path::Path;

use anyhow::Context;
use heed::types::Bytes;
use heed::{CommitOrAbort, Database, Env, EnvFlags, EnvOpenOptions, RoTxn, WithoutTls};

use super::{Mode, Reader, Store, System, Ticker};

/// Map size: the most the benchmark stores ever hold, with room to spare (address space only).
const MAP_BYTES: usize = 64 << 30;

/// LMDB.
pub struct Lmdb;

fn flags(mode: Mode) -> EnvFlags {
    match mode {
        Mode::Sync => EnvFlags::empty(),
        Mode::Periodic => EnvFlags::NO_SYNC,
        Mode::Relaxed => EnvFlags::NO_SYNC | EnvFlags::NO_META_SYNC,
    }
}

impl System for Lmdb {
    fn name(&self) -> &'static str {
        "lmdb"
    }

    fn describe(&self, mode: Mode) -> String {
        match mode {
            Mode::Sync => "default flags (fsync at every commit)".to_string(),
            Mode::Periodic => "NO_SYNC + Env::force_sync every 100 ms (bench thread)".to_string(),
            Mode::Relaxed => "NO_SYNC | NO_META_SYNC".to_string(),
        }
    }

    fn describe_checkpoint(&self) -> &'static str {
        "Env::force_sync"
    }

    fn open(&self, dir: &Path, mode: Mode) -> anyhow::Result<Box<dyn Store>> {
        std::fs::create_dir_all(dir)?;
        let mut options = EnvOpenOptions::new().read_txn_without_tls();
        options.map_size(MAP_BYTES).max_dbs(1);
        // SAFETY: the benchmark opens each environment once per process, in a directory it
        // created, and no other process maps it while it is open (the recovery suite's child
        // is killed before the parent reopens), which is what LMDB requires.
        let env = unsafe {
            options.flags(flags(mode));
            options.open(dir)
        }
        .with_context(|| format!("opening lmdb {}", dir.display()))?;
        let tx = env.write_txn()?;
        let db: Database<'static, Bytes, Bytes> = env
            .create_databases_and_commit(tx, |opener, tx| -> anyhow::Result<_> {
                let db = opener.create_database::<Bytes, Bytes>(tx, Some("kv"))?;
                Ok(CommitOrAbort::<_, ()>::Commit(db))
            })?
            .unwrap_commit();
        let ticker = match mode {
            Mode::Periodic => {
                let env = env.clone();
                Some(Ticker::start("lmdb", move || {
                    let _ = env.force_sync();
                })?)
            }
            _ => None,
        };
        Ok(Box::new(LmdbStore { env, db, ticker }))
    }
}

struct LmdbStore {
    env: Env<WithoutTls>,
    db: Database<'static, Bytes, Bytes>,
    ticker: Option<Ticker>,
}

impl Store for LmdbStore {
    fn write(&self, update: Option<&[u8]>, puts: &[(&[u8], &[u8])]) -> anyhow::Result<()> {
        let mut tx = self.env.write_txn()?;
        if let Some(key) = update {
            let mut value = self.db.get(&tx, key)?.context("update of a missing key")?.to_vec();
            value.push(b' ');
            self.db.put(&mut tx, key, &value)?;
        }
        for (key, value) in puts {
            self.db.put(&mut tx, key, value)?;
        }
        tx.commit()?;
        Ok(())
    }

    fn reader(&self) -> anyhow::Result<Box<dyn Reader + '_>> {
        Ok(Box::new(LmdbReader { db: self.db, tx: self.env.read_txn()? }))
    }

    fn checkpoint(&self) -> anyhow::Result<()> {
        Ok(self.env.force_sync()?)
    }

    fn close(mut self: Box<Self>) -> anyhow::Result<()> {
        if let Some(mut ticker) = self.ticker.take() {
            ticker.stop();
        }
        self.env.force_sync()?;
        Ok(())
    }
}

struct LmdbReader<'a> {
    db: Database<'static, Bytes, Bytes>,
    tx: RoTxn<'a, WithoutTls>,
}

impl Reader for LmdbReader<'_> {
    fn get_into(&mut self, key: &[u8], out: &mut Vec<u8>) -> anyhow::Result<bool> {
        Ok(super::copy_into(self.db.get(&self.tx, key)?, out))
    }
}
