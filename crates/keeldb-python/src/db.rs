//! `keeldb.open`, the `Database` class (transactions, `transact` with retries, checkpoints,
//! stats, close) and `keeldb.verify`. Opening, closing, checkpoints and verification run with
//! the GIL released: each may read or fsync a lot.

use std::sync::Arc;
use std::time::Duration;

use keeldb::{Durability, Isolation, Options, TxnOptions};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::errors::{is_conflict, to_py};
use crate::txn::{ReadTransaction, Shared, TxnState, WriteTransaction};

fn parse_durability(text: &str) -> PyResult<Durability> {
    Durability::parse(text).ok_or_else(|| {
        PyValueError::new_err(format!(
            "durability must be 'sync', 'periodic', 'periodic:<ms>' or 'relaxed', not {text:?}"
        ))
    })
}

fn parse_isolation(text: &str) -> PyResult<Isolation> {
    match text {
        "snapshot" => Ok(Isolation::Snapshot),
        "serializable" => Ok(Isolation::Serializable),
        other => Err(PyValueError::new_err(format!("isolation must be 'snapshot' or 'serializable', not {other:?}"))),
    }
}

fn seconds(what: &str, value: Option<f64>) -> PyResult<Option<Duration>> {
    value
        .map(|s| {
            Duration::try_from_secs_f64(s)
                .map_err(|_| PyValueError::new_err(format!("{what} must be a non-negative number of seconds, not {s}")))
        })
        .transpose()
}

/// Per-transaction options from keyword arguments.
fn txn_options(
    durability: Option<&str>,
    isolation: Option<&str>,
    tag: Option<&str>,
    cpu_budget: Option<f64>,
    timeout: Option<f64>,
) -> PyResult<TxnOptions> {
    Ok(TxnOptions {
        durability: durability.map(parse_durability).transpose()?,
        isolation: isolation.map(parse_isolation).transpose()?,
        tag: tag.map(Arc::from),
        cpu_budget: seconds("cpu_budget", cpu_budget)?,
        timeout: seconds("timeout", timeout)?,
    })
}

/// Opens (creating if absent) the store in directory `path`.
#[pyfunction]
#[pyo3(signature = (path, durability = "sync", isolation = "snapshot", *, checkpoint_wal_bytes = None,
    wal_segment_bytes = None, commit_delay = None, max_txn_bytes = None, cpu_budget = None, txn_timeout = None,
    background_threads = true))]
#[allow(clippy::too_many_arguments)]
pub fn open(
    py: Python<'_>,
    path: std::path::PathBuf,
    durability: &str,
    isolation: &str,
    checkpoint_wal_bytes: Option<u64>,
    wal_segment_bytes: Option<u64>,
    commit_delay: Option<f64>,
    max_txn_bytes: Option<usize>,
    cpu_budget: Option<f64>,
    txn_timeout: Option<f64>,
    background_threads: bool,
) -> PyResult<Database> {
    let defaults = Options::default();
    let options = Options {
        durability: parse_durability(durability)?,
        isolation: parse_isolation(isolation)?,
        checkpoint_wal_bytes: checkpoint_wal_bytes.unwrap_or(defaults.checkpoint_wal_bytes),
        wal_segment_bytes: wal_segment_bytes.unwrap_or(defaults.wal_segment_bytes),
        commit_delay: seconds("commit_delay", commit_delay)?.unwrap_or(defaults.commit_delay),
        max_txn_bytes: max_txn_bytes.unwrap_or(defaults.max_txn_bytes),
        cpu_budget: seconds("cpu_budget", cpu_budget)?,
        txn_timeout: seconds("txn_timeout", txn_timeout)?,
        background_threads,
        ..defaults
    };
    let db = py.allow_threads(move || keeldb::Database::open(path, options)).map_err(to_py)?;
    Ok(Database { db })
}

/// An open store. Share it freely between threads; give each thread its own transactions.
#[pyclass(frozen, module = "keeldb")]
pub struct Database {
    db: keeldb::Database,
}

#[pymethods]
impl Database {
    /// The store's directory.
    #[getter]
    fn path(&self) -> String {
        self.db.path().to_string_lossy().into_owned()
    }

    /// Starts a write transaction; use it as `with db.write() as tx:`.
    #[pyo3(signature = (*, durability = None, isolation = None, tag = None, cpu_budget = None, timeout = None))]
    fn write(
        &self,
        py: Python<'_>,
        durability: Option<&str>,
        isolation: Option<&str>,
        tag: Option<&str>,
        cpu_budget: Option<f64>,
        timeout: Option<f64>,
    ) -> PyResult<Py<WriteTransaction>> {
        let opts = txn_options(durability, isolation, tag, cpu_budget, timeout)?;
        WriteTransaction::create(py, self.db.begin_write_with(opts).map_err(to_py)?)
    }

    /// Starts a read-only snapshot; use it as `with db.read() as rx:`.
    #[pyo3(signature = (*, tag = None, cpu_budget = None, timeout = None))]
    fn read(&self, tag: Option<&str>, cpu_budget: Option<f64>, timeout: Option<f64>) -> PyResult<ReadTransaction> {
        let opts = txn_options(None, None, tag, cpu_budget, timeout)?;
        let tx = self.db.begin_read_with(opts).map_err(to_py)?;
        Ok(ReadTransaction { shared: Shared::new(TxnState::Read(tx)) })
    }

    /// Calls `fn(tx)` in a write transaction and commits, retrying the whole call (with a new
    /// transaction and a short randomized backoff) when it raises `ConflictError`, up to
    /// `max_attempts` times. Returns what `fn` returned. If `fn` ends the transaction itself
    /// (commit or rollback), that stands.
    #[pyo3(signature = (f, *, durability = None, isolation = None, tag = None, max_attempts = 100))]
    fn transact(
        &self,
        py: Python<'_>,
        f: &Bound<'_, PyAny>,
        durability: Option<&str>,
        isolation: Option<&str>,
        tag: Option<&str>,
        max_attempts: u32,
    ) -> PyResult<PyObject> {
        let opts = txn_options(durability, isolation, tag, None, None)?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let tx = WriteTransaction::create(py, self.db.begin_write_with(opts.clone()).map_err(to_py)?)?;
            let result = f.call1((tx.clone_ref(py),)).and_then(|value| {
                let tx = tx.get();
                if matches!(&*tx.shared.lock()?, TxnState::Write(_)) {
                    tx.commit_inner(py)?;
                }
                Ok(value.unbind())
            });
            match result {
                Err(e) if is_conflict(py, &e) && attempt < max_attempts => {
                    drop(tx.get().shared.take());
                    py.allow_threads(|| keeldb::conflict_backoff(attempt));
                }
                Err(e) => {
                    drop(tx.get().shared.take());
                    return Err(e);
                }
                ok => return ok,
            }
        }
    }

    /// A new unique id (never returned before by this store, across restarts).
    fn next_id(&self) -> PyResult<u64> {
        self.db.next_id().map_err(to_py)
    }

    /// Writes a checkpoint now; returns what it wrote.
    fn checkpoint<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let db = self.db.clone();
        let info = py.allow_threads(move || db.checkpoint()).map_err(to_py)?;
        let d = PyDict::new(py);
        d.set_item("ts", info.ts)?;
        d.set_item("path", info.path.to_string_lossy())?;
        d.set_item("bytes", info.bytes)?;
        d.set_item("entries", info.entries)?;
        d.set_item("segments_removed", info.segments_removed)?;
        Ok(d)
    }

    /// Counters and sizes as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.db.stats();
        let d = PyDict::new(py);
        let tables = PyDict::new(py);
        for t in &s.tables {
            let row = PyDict::new(py);
            row.set_item("keys", t.keys)?;
            row.set_item("bytes", t.bytes)?;
            tables.set_item(&t.name, row)?;
        }
        d.set_item("tables", tables)?;
        d.set_item("wal_bytes", s.wal_bytes)?;
        d.set_item("wal_segments", s.wal_segments)?;
        d.set_item("checkpoint_bytes", s.checkpoint_bytes)?;
        d.set_item("checkpoint_ts", s.checkpoint_ts)?;
        d.set_item("last_commit_ts", s.last_commit_ts)?;
        d.set_item("commits", s.commits)?;
        d.set_item("batches", s.batches)?;
        d.set_item("wal_syncs", s.wal_syncs)?;
        d.set_item("digest", s.digest.to_hex())?;
        d.set_item("recovery", s.recovery.to_string())?;
        Ok(d)
    }

    /// The state digest (hex) at the newest visible commit.
    fn digest(&self) -> String {
        self.db.digest().to_hex()
    }

    /// Flushes and closes the store for every handle. Later calls raise `ClosedError`.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let db = self.db.clone();
        py.allow_threads(move || db.close()).map_err(to_py)
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!("keeldb.Database({:?})", self.db.path())
    }
}

/// What `keeldb.verify` found.
#[pyclass(frozen, module = "keeldb")]
pub struct VerifyReport {
    /// True when no corruption was found.
    #[pyo3(get)]
    intact: bool,
    /// Problems found (where and what); empty when intact.
    #[pyo3(get)]
    problems: Vec<String>,
    /// Notes that are not corruption (for example a torn tail that open would truncate).
    #[pyo3(get)]
    notes: Vec<String>,
    /// The recomputed state digest (hex), when the log could be read through.
    #[pyo3(get)]
    digest: Option<String>,
    text: String,
}

#[pymethods]
impl VerifyReport {
    fn __str__(&self) -> String {
        self.text.clone()
    }
    fn __bool__(&self) -> bool {
        self.intact
    }
    fn __repr__(&self) -> String {
        format!("VerifyReport(intact={}, problems={:?})", if self.intact { "True" } else { "False" }, self.problems)
    }
}

/// Checks a closed store offline (checksums of every checkpoint block and WAL frame, and the
/// state digest), like `keel verify`. Raises `LockedError` while the store is open.
#[pyfunction]
pub fn verify(py: Python<'_>, path: std::path::PathBuf) -> PyResult<VerifyReport> {
    let r = py.allow_threads(move || keeldb::verify(path)).map_err(to_py)?;
    Ok(VerifyReport {
        intact: r.is_intact(),
        problems: r.problems.clone(),
        notes: r.notes.clone(),
        digest: r.digest.map(|d| d.to_hex()),
        text: r.to_string(),
    })
}
