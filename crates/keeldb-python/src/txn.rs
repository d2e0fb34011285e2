//! `ReadTransaction` and `WriteTransaction` (a subclass: a write transaction can do every read),
//! their key-value methods and the range-scan iterator. Graph methods live in `graph.rs`.
//!
//! Both classes share one `Arc<Shared>` holding the engine transaction behind a read-write lock,
//! so iterators can keep reading after the method that made them returned. Reads of a read
//! transaction take the lock shared (threads may read one snapshot together); everything on a
//! write transaction takes it exclusively. The lock is only ever *tried*: a thread touching a
//! transaction another thread is using exclusively gets a `RuntimeError` instead of a deadlock
//! with the GIL. The GIL is released while a commit waits for its fsync and while a scan copies
//! a chunk out of the index; point reads keep it (they take well under a microsecond, less than
//! a GIL hand-off costs).

use std::collections::VecDeque;
use std::sync::Arc;

use keeldb::{ReadTxn, ScanRange, WriteTxn};
use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::errors::{busy, to_py};

/// The engine transaction behind a Python transaction object.
pub enum TxnState {
    Read(ReadTxn),
    Write(WriteTxn),
    Done,
}

/// Runs `$body` with `$tx` bound to the engine transaction as `&mut impl GraphRead`, or yields
/// `TransactionDone` when the transaction has ended. A read transaction is only borrowed
/// shared (`&mut &ReadTxn`), so several Python threads can read one snapshot at once; a write
/// transaction is borrowed exclusively. `$shared` is an `&Shared`; lock failures return early
/// with `RuntimeError`.
macro_rules! with_reader {
    ($shared:expr, |$tx:ident| $body:expr) => {{
        let shared: &$crate::txn::Shared = $shared;
        let read_guard = shared.read()?;
        match &*read_guard {
            $crate::txn::TxnState::Read(rx) => {
                let mut shared_rx: &keeldb::ReadTxn = rx;
                let $tx = &mut shared_rx;
                $body
            }
            $crate::txn::TxnState::Done => Err(keeldb::Error::TransactionDone.into()),
            $crate::txn::TxnState::Write(_) => {
                drop(read_guard);
                match &mut *shared.lock()? {
                    $crate::txn::TxnState::Write($tx) => $body,
                    _ => Err(keeldb::Error::TransactionDone.into()),
                }
            }
        }
    }};
}
pub(crate) use with_reader;

impl TxnState {
    pub fn writer(&mut self) -> PyResult<&mut WriteTxn> {
        match self {
            TxnState::Write(tx) => Ok(tx),
            _ => Err(to_py(keeldb::Error::TransactionDone)),
        }
    }
}

/// State shared by a transaction object and the iterators it made.
pub struct Shared {
    state: RwLock<TxnState>,
}

impl Shared {
    pub fn new(state: TxnState) -> Arc<Shared> {
        Arc::new(Shared { state: RwLock::new(state) })
    }

    /// Exclusive access, or `RuntimeError` if another thread is using the transaction now.
    pub fn lock(&self) -> PyResult<RwLockWriteGuard<'_, TxnState>> {
        self.state.try_write().ok_or_else(busy)
    }

    /// Shared access (enough for every read of a read transaction), or `RuntimeError` if
    /// another thread holds it exclusively now.
    pub fn read(&self) -> PyResult<RwLockReadGuard<'_, TxnState>> {
        self.state.try_read().ok_or_else(busy)
    }

    /// Ends the transaction and hands back what it was.
    pub fn take(&self) -> PyResult<TxnState> {
        Ok(std::mem::replace(&mut *self.lock()?, TxnState::Done))
    }
}

/// A snapshot of the database: reads only, never blocks writers, never conflicts.
#[pyclass(subclass, frozen, module = "keeldb")]
pub struct ReadTransaction {
    pub(crate) shared: Arc<Shared>,
}

#[pymethods]
impl ReadTransaction {
    /// The value stored under `key` in `table`, or `default`.
    #[pyo3(signature = (table, key, default = None))]
    fn get(&self, py: Python<'_>, table: &str, key: &[u8], default: Option<PyObject>) -> PyResult<PyObject> {
        let value = with_reader!(&self.shared, |tx| tx.get(table, key)).map_err(to_py)?;
        Ok(match value {
            Some(v) => PyBytes::new(py, &v).into_any().unbind(),
            None => default.unwrap_or_else(|| py.None()),
        })
    }

    /// The values stored under `keys` in `table`, in the order given: each one's value, or
    /// `default` where there is none. One call for many keys, looked up in batches so each
    /// key's memory misses overlap the others'; a write transaction sees its own writes.
    #[pyo3(signature = (table, keys, default = None))]
    fn get_many(
        &self,
        py: Python<'_>,
        table: &str,
        keys: Vec<Bound<'_, PyBytes>>,
        default: Option<PyObject>,
    ) -> PyResult<Vec<PyObject>> {
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        let values = with_reader!(&self.shared, |tx| tx.get_many(table, &keys)).map_err(to_py)?;
        Ok(values
            .into_iter()
            .map(|v| match v {
                Some(v) => PyBytes::new(py, &v).into_any().unbind(),
                None => default.as_ref().map_or_else(|| py.None(), |d| d.clone_ref(py)),
            })
            .collect())
    }

    /// Iterates `(key, value)` pairs of `table` in key order: keys `>= start`, `< stop`, starting
    /// with `prefix` (all that are given), descending when `reverse`.
    #[pyo3(signature = (table, start = None, stop = None, prefix = None, reverse = false))]
    fn scan(
        &self,
        table: &str,
        start: Option<&[u8]>,
        stop: Option<&[u8]>,
        prefix: Option<&[u8]>,
        reverse: bool,
    ) -> ScanIter {
        ScanIter {
            shared: Arc::clone(&self.shared),
            table: table.to_owned(),
            prefix: prefix.map(<[u8]>::to_vec),
            start: start.map(<[u8]>::to_vec),
            stop: stop.map(<[u8]>::to_vec),
            reverse,
            buf: VecDeque::new(),
            done: false,
            chunk: 64,
        }
    }

    /// Names of the tables in this transaction's view.
    fn tables(&self) -> PyResult<Vec<String>> {
        Ok(match &*self.shared.read()? {
            TxnState::Read(tx) => tx.tables(),
            TxnState::Write(tx) => tx.tables(),
            TxnState::Done => return Err(to_py(keeldb::Error::TransactionDone)),
        })
    }

    /// The commit timestamp this transaction reads at.
    #[getter]
    fn snapshot_ts(&self) -> PyResult<u64> {
        match &*self.shared.read()? {
            TxnState::Read(tx) => Ok(tx.snapshot_ts()),
            TxnState::Write(tx) => Ok(tx.snapshot_ts()),
            TxnState::Done => Err(to_py(keeldb::Error::TransactionDone)),
        }
    }

    /// False once the transaction was committed, rolled back or closed.
    #[getter]
    fn active(&self) -> PyResult<bool> {
        Ok(!matches!(&*self.shared.read()?, TxnState::Done))
    }

    /// Ends the transaction (a write transaction is rolled back). Idempotent.
    fn close(&self) -> PyResult<()> {
        drop(self.shared.take()?);
        Ok(())
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.close()?;
        Ok(false)
    }
}

/// A read-write transaction. `with db.write() as tx:` commits when the block ends normally and
/// rolls back when it raises. Dropping an uncommitted transaction rolls it back.
#[pyclass(extends = ReadTransaction, frozen, module = "keeldb")]
pub struct WriteTransaction {
    pub(crate) shared: Arc<Shared>,
}

impl WriteTransaction {
    /// A new Python object for `tx`.
    pub fn create(py: Python<'_>, tx: WriteTxn) -> PyResult<Py<WriteTransaction>> {
        let shared = Shared::new(TxnState::Write(tx));
        let init = PyClassInitializer::from(ReadTransaction { shared: Arc::clone(&shared) })
            .add_subclass(WriteTransaction { shared });
        Py::new(py, init)
    }

    /// Commits with the GIL released, so other Python threads run (and join the same group
    /// commit) while this one waits for the fsync.
    pub fn commit_inner(&self, py: Python<'_>) -> PyResult<u64> {
        let tx = match self.shared.take()? {
            TxnState::Write(tx) => tx,
            _ => return Err(to_py(keeldb::Error::TransactionDone)),
        };
        let info = py.allow_threads(move || tx.commit()).map_err(to_py)?;
        Ok(info.ts)
    }
}

#[pymethods]
impl WriteTransaction {
    /// Stores `value` under `key` in `table` (the table is created by its first write).
    fn put(&self, table: &str, key: &[u8], value: &[u8]) -> PyResult<()> {
        self.shared.lock()?.writer()?.put(table, key, value).map_err(to_py)
    }

    /// Deletes `key` from `table`; no error when it is absent.
    fn delete(&self, table: &str, key: &[u8]) -> PyResult<()> {
        self.shared.lock()?.writer()?.delete(table, key).map_err(to_py)
    }

    /// Drops `table` with all its keys; returns whether it existed.
    fn drop_table(&self, table: &str) -> PyResult<bool> {
        self.shared.lock()?.writer()?.drop_table(table).map_err(to_py)
    }

    /// Commits and returns the commit timestamp. Raises `ConflictError` if a concurrent
    /// transaction committed a conflicting write first (nothing was written).
    fn commit(&self, py: Python<'_>) -> PyResult<u64> {
        self.commit_inner(py)
    }

    /// Discards every write of the transaction. Idempotent.
    fn rollback(&self) -> PyResult<()> {
        drop(self.shared.take()?);
        Ok(())
    }

    #[pyo3(signature = (exc_type, _exc_value = None, _traceback = None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: Option<&Bound<'_, PyAny>>,
        _exc_value: Option<&Bound<'_, PyAny>>,
        _traceback: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let failed = exc_type.is_some_and(|t| !t.is_none());
        let active = !matches!(&*self.shared.lock()?, TxnState::Done);
        if failed || !active {
            self.rollback()?;
        } else {
            self.commit_inner(py)?;
        }
        Ok(false)
    }
}

/// Iterator over a key range; fetches chunks of growing size with the GIL released.
#[pyclass(module = "keeldb")]
pub struct ScanIter {
    shared: Arc<Shared>,
    table: String,
    prefix: Option<Vec<u8>>,
    start: Option<Vec<u8>>,
    stop: Option<Vec<u8>>,
    reverse: bool,
    buf: VecDeque<(Vec<u8>, Vec<u8>)>,
    done: bool,
    chunk: usize,
}

impl ScanIter {
    fn range(&self) -> ScanRange {
        let mut range = self.prefix.clone().map_or_else(ScanRange::all, ScanRange::prefix);
        if let Some(s) = &self.start {
            range = range.start(s.clone());
        }
        if let Some(e) = &self.stop {
            range = range.end(e.clone());
        }
        if self.reverse {
            range = range.reverse();
        }
        range
    }

    fn fill(&mut self, py: Python<'_>) -> PyResult<()> {
        let (range, limit) = (self.range(), self.chunk);
        let table = self.table.as_str();
        let rows: Vec<(Vec<u8>, Vec<u8>)> = with_reader!(&self.shared, |tx| {
            py.allow_threads(move || tx.scan(table, range).and_then(|scan| scan.take(limit).collect()))
        })
        .map_err(to_py)?;
        self.done = rows.len() < limit;
        self.chunk = (self.chunk * 4).min(4096);
        // Resume after the last key: keys are unique, so the next one is strictly beyond it.
        if let Some((last, _)) = rows.last() {
            if self.reverse {
                self.stop = Some(last.clone());
            } else {
                let mut next = last.clone();
                next.push(0);
                self.start = Some(next);
            }
        }
        self.buf.extend(rows);
        Ok(())
    }
}

#[pymethods]
impl ScanIter {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(
        mut slf: PyRefMut<'py, Self>,
        py: Python<'py>,
    ) -> PyResult<Option<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)>> {
        if slf.buf.is_empty() && !slf.done {
            slf.fill(py)?;
        }
        Ok(slf.buf.pop_front().map(|(k, v)| (PyBytes::new(py, &k), PyBytes::new(py, &v))))
    }
}
