//! Systems under test behind one small interface: KeelDB itself and the peers it is compared
//! with (SQLite, redb, LMDB, SurrealKV, fjall, RocksDB). Each adapter maps the three KeelDB
//! durability modes onto the peer's closest equivalent and says in words what it used, so every
//! table can name the configuration it measured.
//!
//! A peer's heavy dependency is compiled only with its cargo feature (`sqlite`, `redb`, `lmdb`,
//! `surrealkv`, `fjall`, `rocksdb`); [`compiled`] lists the ones in this build. Nothing here is
//! reachable from the engine: peers live in the bench crate only.
//!
//! The interface is deliberately narrow: one transaction that may read-modify-write one key and
//! put several, a reader for point gets, a checkpoint, and close. Every suite drives KeelDB
//! through the same interface as the peers, so harness overhead is the same for all.

#[cfg(feature = "fjall")]
pub mod fjall;
pub mod keeldb;
#[cfg(feature = "lmdb")]
pub mod lmdb;
#[cfg(feature = "redb")]
pub mod redb;
#[cfg(feature = "rocksdb")]
pub mod rocksdb;
#[cfg(feature = "sqlite")]
pub mod sqlite;
#[cfg(feature = "surrealkv")]
pub mod surrealkv;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// The interval of every `periodic` configuration: KeelDB's `periodic` and the background sync
/// thread the peers without a built-in equivalent get.
pub const PERIODIC_INTERVAL: Duration = Duration::from_millis(100);

/// A durability mode, named as KeelDB names it; each peer maps it to its closest equivalent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `commit()` returns once the commit is on stable storage.
    Sync,
    /// Written to the OS at commit; synced in the background at least every 100 ms.
    Periodic,
    /// Written to the OS at commit (or buffered); synced only at checkpoint or close.
    Relaxed,
}

impl Mode {
    /// All three, in report order.
    pub const ALL: [Mode; 3] = [Mode::Sync, Mode::Periodic, Mode::Relaxed];

    /// `sync`, `periodic`, `relaxed`: the `config` of a JSON row.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Sync => "sync",
            Mode::Periodic => "periodic",
            Mode::Relaxed => "relaxed",
        }
    }

    /// Parses [`Mode::name`].
    pub fn parse(text: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|m| m.name() == text)
    }
}

/// One open store. Shared by reference across writer threads, so it must be `Sync`.
pub trait Store: Send + Sync {
    /// One committed transaction with the store's durability: when `update` is given, read that
    /// key and write it back with one byte appended (it must exist), then put every pair.
    fn write(&self, update: Option<&[u8]>, puts: &[(&[u8], &[u8])]) -> anyhow::Result<()>;

    /// A reader for point gets; one snapshot where the peer has them.
    fn reader(&self) -> anyhow::Result<Box<dyn Reader + '_>>;

    /// Makes the store's state durable so that reopening need not replay a log (KeelDB's
    /// checkpoint, SQLite's WAL checkpoint, an LSM's memtable flush, ...).
    fn checkpoint(&self) -> anyhow::Result<()>;

    /// Commits and fdatasyncs since the store opened, for stores that count them.
    fn sync_counters(&self) -> Option<(u64, u64)> {
        None
    }

    /// Stops background threads and closes cleanly.
    fn close(self: Box<Self>) -> anyhow::Result<()>;
}

/// Point reads.
pub trait Reader {
    /// Replaces `out`'s contents with the value under `key` and returns true, or returns false
    /// when there is none. Each store does it its own cheapest way (borrowing from a page, a
    /// pinned block or a shared buffer where it can), then copies into the caller's buffer, so
    /// a point-read loop that reuses one buffer allocates nothing per read in any store.
    fn get_into(&mut self, key: &[u8], out: &mut Vec<u8>) -> anyhow::Result<bool>;

    /// The value under `key`, if any, in a new vector.
    fn get(&mut self, key: &[u8]) -> anyhow::Result<Option<Vec<u8>>> {
        let mut out = Vec::new();
        Ok(self.get_into(key, &mut out)?.then_some(out))
    }
}

/// Copies a borrowed value into the caller's buffer, for [`Reader::get_into`].
pub(crate) fn copy_into(value: Option<&[u8]>, out: &mut Vec<u8>) -> bool {
    out.clear();
    match value {
        Some(v) => {
            out.extend_from_slice(v);
            true
        }
        None => false,
    }
}

/// A system that can open stores.
pub trait System: Sync {
    /// `keeldb` or the peer's name as JSON rows spell it.
    fn name(&self) -> &'static str;

    /// What `mode` is mapped to, in the peer's own terms (shown in every report).
    fn describe(&self, mode: Mode) -> String;

    /// What [`Store::checkpoint`] does, in the peer's own terms.
    fn describe_checkpoint(&self) -> &'static str;

    /// Opens (creating when absent) a store in directory `dir` with durability `mode`.
    fn open(&self, dir: &Path, mode: Mode) -> anyhow::Result<Box<dyn Store>>;
}

/// Every peer name `--peers` accepts, compiled in or not.
pub const KNOWN_PEERS: [&str; 6] = ["sqlite", "redb", "lmdb", "surrealkv", "rocksdb", "fjall"];

/// The cargo feature that compiles each peer in.
pub fn feature_of(peer: &str) -> &'static str {
    match peer {
        "sqlite" => "sqlite",
        "redb" => "redb",
        "lmdb" => "lmdb",
        "surrealkv" => "surrealkv",
        "rocksdb" => "rocksdb",
        "fjall" => "fjall",
        _ => "peers",
    }
}

/// The peers compiled into this build, in report order.
#[allow(clippy::vec_init_then_push)] // Each push is behind its own feature.
pub fn compiled() -> Vec<&'static dyn System> {
    #[allow(unused_mut)]
    let mut peers: Vec<&'static dyn System> = Vec::new();
    #[cfg(feature = "sqlite")]
    peers.push(&sqlite::Sqlite);
    #[cfg(feature = "redb")]
    peers.push(&redb::Redb);
    #[cfg(feature = "lmdb")]
    peers.push(&lmdb::Lmdb);
    #[cfg(feature = "surrealkv")]
    peers.push(&surrealkv::SurrealKv);
    #[cfg(feature = "rocksdb")]
    peers.push(&rocksdb::RocksDb);
    #[cfg(feature = "fjall")]
    peers.push(&fjall::Fjall);
    peers
}

/// KeelDB or a compiled-in peer by name.
pub fn by_name(name: &str) -> Option<&'static dyn System> {
    if name == "keeldb" {
        return Some(&keeldb::KeelDb);
    }
    compiled().into_iter().find(|p| p.name() == name)
}

/// A background thread that calls `tick` every [`PERIODIC_INTERVAL`] until stopped: the
/// `periodic` mode of peers that have no built-in timed sync.
pub struct Ticker {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Ticker {
    /// Starts the thread.
    pub fn start(name: &str, tick: impl Fn() + Send + 'static) -> anyhow::Result<Ticker> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let handle = std::thread::Builder::new().name(format!("bench-{name}-sync")).spawn(move || {
            while !flag.load(Ordering::Acquire) {
                std::thread::park_timeout(PERIODIC_INTERVAL);
                if !flag.load(Ordering::Acquire) {
                    tick();
                }
            }
        })?;
        Ok(Ticker { stop, handle: Some(handle) })
    }

    /// Stops the thread and waits for it.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(handle) = self.handle.take() {
            handle.thread().unpark();
            let _ = handle.join();
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every compiled-in system: write, update, read back, checkpoint, reopen, read again.
    #[test]
    fn every_system_round_trips_in_every_mode() {
        let mut systems: Vec<&dyn System> = vec![&keeldb::KeelDb];
        systems.extend(compiled());
        for system in systems {
            for mode in Mode::ALL {
                let dir = tempfile::tempdir().unwrap();
                let label = format!("{} {}", system.name(), mode.name());
                assert!(!system.describe(mode).is_empty(), "{label}");
                let store = system.open(dir.path(), mode).unwrap();
                store.write(None, &[(b"a", b"1"), (b"b", b"2")]).unwrap();
                store.write(Some(b"a"), &[(b"c", b"3")]).unwrap();
                {
                    let mut reader = store.reader().unwrap();
                    assert_eq!(reader.get(b"a").unwrap().as_deref(), Some(&b"1 "[..]), "{label}");
                    assert_eq!(reader.get(b"c").unwrap().as_deref(), Some(&b"3"[..]), "{label}");
                    assert_eq!(reader.get(b"zz").unwrap(), None, "{label}");
                }
                store.checkpoint().unwrap();
                store.close().unwrap();
                let store = system.open(dir.path(), mode).unwrap();
                let mut reader = store.reader().unwrap();
                assert_eq!(reader.get(b"b").unwrap().as_deref(), Some(&b"2"[..]), "{label}");
                drop(reader);
                store.close().unwrap();
            }
        }
    }

    #[test]
    fn modes_parse_their_names() {
        for mode in Mode::ALL {
            assert_eq!(Mode::parse(mode.name()), Some(mode));
        }
        assert_eq!(Mode::parse("fast"), None);
    }
}
