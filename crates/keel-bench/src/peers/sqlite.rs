//! SQLite (rusqlite, bundled) as a key-value store: one `WITHOUT ROWID` table of BLOB keys and
//! values. Writes go through one connection behind a mutex (SQLite admits one writer at a time;
//! this is the usual way to share it between threads); reads take a connection from a pool, as
//! seed 001's pooled setup did.
//!
//! Modes: `sync` = `journal_mode=WAL, synchronous=FULL`; `periodic` = `WAL, NORMAL` (SQLite's
//! own "durable at checkpoint" setting, not time-bounded); `relaxed` = `WAL, OFF`. The
//! `sqlite-compare` suite also opens `journal_mode=DELETE` stores through [`open_with`].

use std::path::{Path, PathBuf};

use anyhow::Context;
use rusqlite::{params, Connection, OptionalExtension};
use std::sync::Mutex;

use super::{Mode, Reader, Store, System};

/// SQLite.
pub struct Sqlite;

/// SQLite's rollback or write-ahead journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Journal {
    /// `journal_mode=DELETE`: the rollback journal, SQLite's default.
    Delete,
    /// `journal_mode=WAL`.
    Wal,
}

fn synchronous(mode: Mode) -> &'static str {
    match mode {
        Mode::Sync => "FULL",
        Mode::Periodic => "NORMAL",
        Mode::Relaxed => "OFF",
    }
}

/// The pragmas a store was opened with, in words.
pub fn describe_with(journal: Journal, mode: Mode) -> String {
    let journal = match journal {
        Journal::Delete => "DELETE",
        Journal::Wal => "WAL",
    };
    format!("journal_mode={journal}, synchronous={} (SQLite {})", synchronous(mode), rusqlite::version())
}

impl System for Sqlite {
    fn name(&self) -> &'static str {
        "sqlite"
    }

    fn describe(&self, mode: Mode) -> String {
        describe_with(Journal::Wal, mode)
    }

    fn describe_checkpoint(&self) -> &'static str {
        "PRAGMA wal_checkpoint(TRUNCATE)"
    }

    fn open(&self, dir: &Path, mode: Mode) -> anyhow::Result<Box<dyn Store>> {
        Ok(Box::new(open_with(dir, Journal::Wal, mode)?))
    }
}

/// An open SQLite store.
pub struct SqliteStore {
    path: PathBuf,
    writer: Mutex<Connection>,
    readers: Mutex<Vec<Connection>>,
}

/// Opens a store with an explicit journal mode.
pub fn open_with(dir: &Path, journal: Journal, mode: Mode) -> anyhow::Result<SqliteStore> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("kv.sqlite");
    let conn = connect(&path)?;
    let journal_name = match journal {
        Journal::Delete => "DELETE",
        Journal::Wal => "WAL",
    };
    let set: String = conn.query_row(&format!("PRAGMA journal_mode={journal_name}"), [], |r| r.get(0))?;
    anyhow::ensure!(set.eq_ignore_ascii_case(journal_name), "sqlite refused journal_mode={journal_name} (got {set})");
    conn.execute_batch(&format!(
        "PRAGMA synchronous={};
         CREATE TABLE IF NOT EXISTS kv (k BLOB PRIMARY KEY, v BLOB NOT NULL) WITHOUT ROWID;",
        synchronous(mode)
    ))?;
    Ok(SqliteStore { path, writer: Mutex::new(conn), readers: Mutex::new(Vec::new()) })
}

fn connect(path: &Path) -> anyhow::Result<Connection> {
    let conn = Connection::open(path).with_context(|| format!("opening sqlite {}", path.display()))?;
    conn.busy_timeout(std::time::Duration::from_secs(10))?;
    Ok(conn)
}

impl Store for SqliteStore {
    fn write(&self, update: Option<&[u8]>, puts: &[(&[u8], &[u8])]) -> anyhow::Result<()> {
        let mut conn = self.writer.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        let tx = conn.transaction()?;
        {
            if let Some(key) = update {
                let mut value: Vec<u8> = tx
                    .prepare_cached("SELECT v FROM kv WHERE k = ?1")?
                    .query_row(params![key], |r| r.get(0))
                    .optional()?
                    .context("update of a missing key")?;
                value.push(b' ');
                tx.prepare_cached("INSERT OR REPLACE INTO kv (k, v) VALUES (?1, ?2)")?.execute(params![key, value])?;
            }
            let mut insert = tx.prepare_cached("INSERT OR REPLACE INTO kv (k, v) VALUES (?1, ?2)")?;
            for (key, value) in puts {
                insert.execute(params![key, value])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn reader(&self) -> anyhow::Result<Box<dyn Reader + '_>> {
        let pooled = self.readers.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.pop();
        let conn = match pooled {
            Some(conn) => conn,
            None => connect(&self.path)?,
        };
        Ok(Box::new(SqliteReader { store: self, conn: Some(conn) }))
    }

    fn checkpoint(&self) -> anyhow::Result<()> {
        let conn = self.writer.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        // The result row (busy, log pages, checkpointed pages) is not needed.
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
        Ok(())
    }

    fn close(self: Box<Self>) -> anyhow::Result<()> {
        let readers = self.readers.into_inner().map_err(|_| anyhow::anyhow!("poisoned"))?;
        for conn in readers {
            conn.close().map_err(|(_, e)| e)?;
        }
        let writer = self.writer.into_inner().map_err(|_| anyhow::anyhow!("poisoned"))?;
        writer.close().map_err(|(_, e)| e)?;
        Ok(())
    }
}

struct SqliteReader<'a> {
    store: &'a SqliteStore,
    conn: Option<Connection>,
}

impl Reader for SqliteReader<'_> {
    fn get_into(&mut self, key: &[u8], out: &mut Vec<u8>) -> anyhow::Result<bool> {
        let conn = self.conn.as_ref().context("reader already returned")?;
        let mut statement = conn.prepare_cached("SELECT v FROM kv WHERE k = ?1")?;
        let mut rows = statement.query(params![key])?;
        let value = match rows.next()? {
            Some(row) => Some(row.get_ref(0)?.as_blob()?),
            None => None,
        };
        Ok(super::copy_into(value, out))
    }
}

impl Drop for SqliteReader<'_> {
    fn drop(&mut self) {
        if let (Some(conn), Ok(mut pool)) = (self.conn.take(), self.store.readers.lock()) {
            pool.push(conn);
        }
    }
}
