//! Coordination on the etcd v3 API for `keeldb.connect` clients: leases (`Client.lease`),
//! watches (`Client.watch`) and locks (`Client.lock`).
//!
//! - A `Lease` is granted at once; `keep_alive()` (or `with client.lease(ttl) as lease:`)
//!   refreshes it from a task on the client's runtime every third of its TTL, on whichever
//!   endpoint answers; when a refresh finds the lease gone (TTL 0), `expired` turns true and
//!   the task stops. Leaving the `with` block revokes it.
//! - A `Watch` is a task that keeps one watch stream open, resuming on the next endpoint from
//!   the revision after the last event it delivered when a stream breaks (as clientv3 does),
//!   so a member going away neither loses nor repeats an event; a compacted start revision
//!   raises `Compacted`. Events reach Python through a bounded queue: a consumer that stops
//!   reading stops the stream (the server then holds the events back), never the process's memory.
//! - A `Lock` is etcd's lock recipe (the one `concurrency.NewMutex` and `etcdctl lock` use):
//!   a key `name/<lease id>` under the holder's own lease, created in a txn; the holder is the
//!   key with the lowest create revision; a waiter watches the key just before its own until
//!   it is deleted. A holder that crashes loses the lock when its lease expires.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Compare as EtcdCompare, CompareOp, EventType, GetOptions, LeaseGrantOptions, LeaseTimeToLiveOptions, PutOptions,
    SortOrder, SortTarget, Txn, TxnOp, WatchFilterType, WatchOptions,
};
use parking_lot::Mutex;
use pyo3::exceptions::{PyStopIteration, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::cluster::{classify, kv_object, Blob, Client, Inner, Kv, Mode, Raise, TaskHold, Verdict};
use crate::errors::new_error;

/// Events a watch holds for Python before its stream waits.
const WATCH_QUEUE: usize = 1024;
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(1);

// ---------------------------------------------------------------------------------------------
// Leases

/// Refreshes lease `id` every `ttl / 3` until it is gone or `stop` is set; sets `expired`
/// when a refresh answers TTL 0 (the lease was revoked or expired).
async fn keep_alive_loop(hold: TaskHold, id: i64, ttl: i64, stop: Arc<AtomicBool>, expired: Arc<AtomicBool>) {
    let Some(inner) = hold.get() else { return };
    let period = Duration::from_millis((ttl.max(1) as u64 * 1000) / 3).max(Duration::from_millis(100));
    let n = inner.endpoints.len().max(1);
    let mut index = 0usize;
    let mut backoff = RETRY_FIRST;
    while !stop.load(Ordering::Acquire) {
        let Some((_, client)) = inner.endpoints.get(index % n) else { return };
        let mut client = client.clone();
        let opened = tokio::time::timeout(inner.timeout, client.lease_keep_alive(id)).await;
        if let Ok(Err(e)) = &opened {
            if matches!(e, etcd_client::Error::LeaseKeepAliveError(m) if m.contains("not found")) {
                expired.store(true, Ordering::Release);
                return;
            }
        }
        let Ok(Ok((mut keeper, mut stream))) = opened else {
            index += 1;
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(RETRY_MAX);
            continue;
        };
        loop {
            if stop.load(Ordering::Acquire) {
                return;
            }
            if keeper.keep_alive().await.is_err() {
                break;
            }
            match tokio::time::timeout(inner.timeout, stream.message()).await {
                Ok(Ok(Some(resp))) if resp.ttl() <= 0 => {
                    expired.store(true, Ordering::Release);
                    return;
                }
                Ok(Ok(Some(_))) => backoff = RETRY_FIRST,
                _ => break,
            }
            tokio::time::sleep(period).await;
        }
        index += 1;
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(RETRY_MAX);
    }
}

/// A lease (see `Client.lease`).
#[pyclass(frozen, module = "keeldb")]
pub struct Lease {
    /// The lease id (pass it as `put(..., lease=id)`).
    #[pyo3(get)]
    id: i64,
    /// The TTL the cluster granted, in seconds.
    #[pyo3(get)]
    ttl: i64,
    inner: Arc<Inner>,
    keeper: Mutex<Option<(JoinHandle<()>, Arc<AtomicBool>)>>,
    expired: Arc<AtomicBool>,
}

impl Lease {
    fn stop_keeper(&self) {
        if let Some((task, stop)) = self.keeper.lock().take() {
            stop.store(true, Ordering::Release);
            task.abort();
        }
    }

    fn call<T, F, Fut>(&self, py: Python<'_>, mode: Mode, what: &str, f: F) -> PyResult<T>
    where
        T: Send,
        F: Fn(etcd_client::Client) -> Fut + Send,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        let inner = Arc::clone(&self.inner);
        py.allow_threads(move || inner.runtime.block_on(inner.call(mode, what, f)).map(|(v, _)| v))
            .map_err(|r| r.into_py(py))
    }
}

impl Lease {
    fn revoke_raw(&self, py: Python<'_>) -> Result<(), Raise> {
        self.stop_keeper();
        let id = self.id;
        let inner = Arc::clone(&self.inner);
        py.allow_threads(move || {
            inner
                .runtime
                .block_on(inner.call(Mode::Write, "lease revoke", |mut c| async move { c.lease_revoke(id).await }))
                .map(|_| ())
        })?;
        self.expired.store(true, Ordering::Release);
        Ok(())
    }
}

/// What `Lease.time_to_live` reports.
#[pyclass(frozen, get_all, module = "keeldb")]
pub struct LeaseInfo {
    /// The lease id.
    id: i64,
    /// Seconds left (-1 or 0 once it is gone, as etcd reports).
    ttl: i64,
    /// The TTL it was granted with.
    granted_ttl: i64,
    /// The keys attached (with `keys=True`).
    keys: Vec<Vec<u8>>,
}

#[pymethods]
impl LeaseInfo {
    fn __repr__(&self) -> String {
        format!(
            "LeaseInfo(id={}, ttl={}, granted_ttl={}, keys={})",
            self.id,
            self.ttl,
            self.granted_ttl,
            self.keys.len()
        )
    }
}

#[pymethods]
impl Lease {
    /// Refreshes the lease once and returns the TTL it has again. Raises `LeaseNotFound` if it
    /// expired or was revoked.
    fn refresh(&self, py: Python<'_>) -> PyResult<i64> {
        let id = self.id;
        let inner = Arc::clone(&self.inner);
        // Opening the keep-alive stream refreshes once (and fails with LeaseNotFound when the
        // lease is gone); the second refresh reports the TTL.
        let got = py.allow_threads(move || {
            inner
                .runtime
                .block_on(inner.call(Mode::Read, "lease keep-alive", |mut c| async move {
                    let (mut keeper, mut stream) = c.lease_keep_alive(id).await?;
                    keeper.keep_alive().await?;
                    match stream.message().await? {
                        Some(r) => Ok(r.ttl()),
                        None => {
                            Err(etcd_client::Error::GRpcStatus(tonic::Status::unavailable("keep-alive stream closed")))
                        }
                    }
                }))
                .map(|(ttl, _)| ttl)
        });
        match got {
            Ok(ttl) if ttl > 0 => Ok(ttl),
            Ok(_) => {
                self.expired.store(true, Ordering::Release);
                Err(Raise::new("LeaseNotFound", format!("lease {id:x} expired or was revoked")).into_py(py))
            }
            Err(r) => {
                if r.class == "LeaseNotFound" {
                    self.expired.store(true, Ordering::Release);
                }
                Err(r.into_py(py))
            }
        }
    }

    /// The seconds left and the granted TTL (and, with `keys=True`, the attached keys).
    #[pyo3(signature = (*, keys = false))]
    fn time_to_live(&self, py: Python<'_>, keys: bool) -> PyResult<LeaseInfo> {
        let id = self.id;
        let r = self.call(py, Mode::Read, "lease time-to-live", |mut c| async move {
            let opts = if keys { Some(LeaseTimeToLiveOptions::new().with_keys()) } else { None };
            c.lease_time_to_live(id, opts).await
        })?;
        Ok(LeaseInfo { id, ttl: r.ttl(), granted_ttl: r.granted_ttl(), keys: r.keys().to_vec() })
    }

    /// Refreshes the lease in the background until `revoke()`, `stop_keep_alive()`, the end of
    /// a `with` block, or the lease is found gone (`expired`). Idempotent.
    fn keep_alive(&self) {
        let mut keeper = self.keeper.lock();
        if keeper.is_some() {
            return;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let task = self.inner.runtime.spawn(keep_alive_loop(
            TaskHold::new(&self.inner),
            self.id,
            self.ttl,
            Arc::clone(&stop),
            Arc::clone(&self.expired),
        ));
        *keeper = Some((task, stop));
    }

    /// Stops the background refresh (the lease then expires after its TTL).
    fn stop_keep_alive(&self) {
        self.stop_keeper();
    }

    /// Whether a refresh found the lease gone.
    #[getter]
    fn expired(&self) -> bool {
        self.expired.load(Ordering::Acquire)
    }

    /// Ends the lease now: every key attached to it is deleted (in one revision). Raises
    /// `LeaseNotFound` if it had already ended.
    fn revoke(&self, py: Python<'_>) -> PyResult<()> {
        self.revoke_raw(py).map_err(|r| r.into_py(py))
    }

    fn __enter__(slf: Py<Self>, py: Python<'_>) -> Py<Self> {
        slf.get().keep_alive();
        let _ = py;
        slf
    }

    #[pyo3(signature = (_exc_type = None, _exc = None, _tb = None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        match self.revoke_raw(py) {
            Err(r) if r.class == "LeaseNotFound" => Ok(false), // already ended: nothing to undo
            Err(r) => Err(r.into_py(py)),
            Ok(()) => Ok(false),
        }
    }

    fn __repr__(&self) -> String {
        format!("<keeldb.Lease id={:x} ttl={}{}>", self.id, self.ttl, if self.expired() { " expired" } else { "" })
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.stop_keeper();
    }
}

// ---------------------------------------------------------------------------------------------
// Watches

/// One change a watch reports.
#[pyclass(frozen, module = "keeldb")]
pub struct WatchEvent {
    /// `"put"` or `"delete"`.
    #[pyo3(get)]
    kind: &'static str,
    kv: Kv,
    prev: Option<Kv>,
}

#[pymethods]
impl WatchEvent {
    /// The key.
    #[getter]
    fn key<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.kv.key)
    }

    /// The new value (empty for a delete).
    #[getter]
    fn value<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.kv.value)
    }

    /// The revision of the change.
    #[getter]
    fn revision(&self) -> i64 {
        self.kv.mod_revision
    }

    /// The key after the change, as a `KeyValue` (for a delete: the key and the revision).
    #[getter]
    fn kv(&self, py: Python<'_>) -> PyResult<PyObject> {
        kv_object(py, self.kv.clone())
    }

    /// The key before the change (watches made with `prev_kv=True`), or None.
    #[getter]
    fn prev_kv(&self, py: Python<'_>) -> PyResult<Option<PyObject>> {
        self.prev.clone().map(|kv| kv_object(py, kv)).transpose()
    }

    fn __repr__(&self) -> String {
        format!(
            "WatchEvent({}, key={:?}, revision={})",
            self.kind,
            String::from_utf8_lossy(&self.kv.key),
            self.kv.mod_revision
        )
    }
}

enum Item {
    Event(Box<WatchEvent>),
    End(Raise),
}

#[derive(Clone)]
struct WatchSpec {
    key: Vec<u8>,
    end: Option<Vec<u8>>,
    prefix: bool,
    prev_kv: bool,
    no_put: bool,
    no_delete: bool,
}

impl WatchSpec {
    fn options(&self, start: i64) -> WatchOptions {
        let mut o = WatchOptions::new();
        if let Some(end) = &self.end {
            o = o.with_range(end.clone());
        } else if self.prefix {
            o = o.with_prefix();
        }
        if start > 0 {
            o = o.with_start_revision(start);
        }
        if self.prev_kv {
            o = o.with_prev_key();
        }
        let mut filters = Vec::new();
        if self.no_put {
            filters.push(WatchFilterType::NoPut);
        }
        if self.no_delete {
            filters.push(WatchFilterType::NoDelete);
        }
        if !filters.is_empty() {
            o = o.with_filters(filters);
        }
        o
    }
}

/// Keeps a watch open across members until the receiver is dropped or the server ends it.
async fn watch_loop(hold: TaskHold, spec: WatchSpec, mut next: i64, tx: mpsc::Sender<Item>) {
    let Some(inner) = hold.get() else { return };
    let n = inner.endpoints.len().max(1);
    let mut index = 0usize;
    let mut backoff = RETRY_FIRST;
    loop {
        if tx.is_closed() {
            return;
        }
        let Some((_, client)) = inner.endpoints.get(index % n) else { return };
        let mut client = client.clone();
        let opened =
            tokio::time::timeout(inner.timeout, client.watch(spec.key.clone(), Some(spec.options(next)))).await;
        let mut stream = match opened {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                if let Verdict::Raise(r) = classify(e, Mode::Read) {
                    let _ = tx.send(Item::End(r)).await;
                    return;
                }
                index += 1;
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(RETRY_MAX);
                continue;
            }
            Err(_) => {
                index += 1;
                continue;
            }
        };
        loop {
            let msg = tokio::select! {
                m = stream.message() => m,
                _ = tx.closed() => return,
            };
            let resp = match msg {
                Ok(Some(r)) => r,
                _ => break, // the stream broke: resume elsewhere from `next`
            };
            if resp.created() && next <= 0 {
                // A watch "from now" resumes after the revision it started at.
                next = resp.header().map_or(0, |h| h.revision()) + 1;
            }
            if resp.canceled() {
                let r = if resp.compact_revision() > 0 {
                    Raise::new(
                        "Compacted",
                        format!(
                            "watch from revision {next}: required revision has been compacted (compact revision {})",
                            resp.compact_revision()
                        ),
                    )
                } else {
                    Raise::new("ClusterError", format!("watch canceled by the server: {}", resp.cancel_reason()))
                };
                let _ = tx.send(Item::End(r)).await;
                return;
            }
            backoff = RETRY_FIRST;
            for ev in resp.events() {
                let pb = ev.0.clone();
                let Some(kv) = pb.kv else { continue };
                let kv = Kv::from(kv);
                next = next.max(kv.mod_revision + 1);
                let kind = match ev.event_type() {
                    EventType::Put => "put",
                    EventType::Delete => "delete",
                };
                let event = WatchEvent { kind, kv, prev: pb.prev_kv.map(Kv::from) };
                if tx.send(Item::Event(Box::new(event))).await.is_err() {
                    return;
                }
            }
        }
        index += 1;
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(RETRY_MAX);
    }
}

/// A watch (see `Client.watch`): iterate it for `WatchEvent`s, or call `get(timeout)`.
#[pyclass(frozen, module = "keeldb")]
pub struct Watch {
    inner: Arc<Inner>,
    rx: Mutex<Option<mpsc::Receiver<Item>>>,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Watch {
    fn next_item(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Item>> {
        let timeout = match timeout {
            None => None,
            Some(t) => Some(Duration::try_from_secs_f64(t).map_err(|_| {
                PyValueError::new_err(format!("timeout must be a non-negative number of seconds, not {t}"))
            })?),
        };
        let inner = Arc::clone(&self.inner);
        let mut guard = self.rx.lock();
        let Some(rx) = guard.as_mut() else { return Ok(None) };
        let got = py.allow_threads(|| {
            inner.runtime.block_on(async {
                match timeout {
                    None => Ok(rx.recv().await),
                    Some(t) => tokio::time::timeout(t, rx.recv()).await,
                }
            })
        });
        match got {
            Ok(None) => {
                *guard = None;
                Ok(None)
            }
            Ok(Some(item)) => Ok(Some(item)),
            Err(_) => Ok(None), // timed out: nothing yet
        }
    }

    fn take(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
        closed: impl Fn(Python<'_>) -> PyErr,
    ) -> PyResult<Option<WatchEvent>> {
        if self.rx.lock().is_none() {
            return Err(closed(py));
        }
        match self.next_item(py, timeout)? {
            Some(Item::Event(e)) => Ok(Some(*e)),
            Some(Item::End(r)) => {
                self.cancel();
                Err(r.into_py(py))
            }
            None if self.rx.lock().is_none() => Err(closed(py)),
            None => Ok(None),
        }
    }
}

#[pymethods]
impl Watch {
    /// The next event, waiting up to `timeout` seconds (None: until one comes); None when
    /// the time passed. Raises `Compacted` when the watch's start revision was compacted, and
    /// `ClosedError` once the watch is canceled.
    #[pyo3(signature = (timeout = None))]
    fn get(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<WatchEvent>> {
        self.take(py, timeout, |py| new_error(py, "ClosedError", "the watch was canceled or ended".into()))
    }

    /// Stops the watch. Idempotent.
    fn cancel(&self) {
        self.rx.lock().take();
        if let Some(t) = self.task.lock().take() {
            t.abort();
        }
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<WatchEvent> {
        loop {
            match self.take(py, Some(0.2), |_| PyStopIteration::new_err(()))? {
                Some(e) => return Ok(e),
                None => py.check_signals()?,
            }
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (_exc_type = None, _exc = None, _tb = None))]
    fn __exit__(
        &self,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.cancel();
        false
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.cancel();
    }
}

// ---------------------------------------------------------------------------------------------
// Locks

/// A lock (see `Client.lock`).
#[pyclass(frozen, module = "keeldb")]
pub struct Lock {
    inner: Arc<Inner>,
    /// The lock's name (its keys are `name/<lease id>`).
    #[pyo3(get)]
    name: Vec<u8>,
    ttl: i64,
    held: Mutex<Option<Held>>,
}

struct Held {
    lease: Lease,
    key: Vec<u8>,
}

/// Waits until `key` is deleted (a watch from `after + 1`), or the deadline passes (false), or
/// the watch breaks (true: the caller looks again).
async fn wait_deleted(inner: &Inner, key: Vec<u8>, after: i64, deadline: Option<Instant>) -> bool {
    let far = Instant::now() + Duration::from_secs(86_400 * 365);
    let deadline = deadline.unwrap_or(far);
    let opts = WatchOptions::new().with_start_revision(after + 1).with_filters([WatchFilterType::NoPut]);
    let mut opened = None;
    for (_, client) in &inner.endpoints {
        let mut client = client.clone();
        let until = deadline.min(Instant::now() + inner.timeout);
        if let Ok(Ok(s)) = tokio::time::timeout_at(until, client.watch(key.clone(), Some(opts.clone()))).await {
            opened = Some(s);
            break;
        }
    }
    let Some(mut stream) = opened else {
        // No member would watch: look again after a pause (the caller re-reads the holders).
        tokio::time::sleep_until((Instant::now() + RETRY_MAX).min(deadline)).await;
        return Instant::now() < deadline;
    };
    loop {
        match tokio::time::timeout_at(deadline, stream.message()).await {
            Err(_) => return false,
            Ok(Ok(Some(resp))) => {
                if resp.canceled() || resp.events().iter().any(|e| e.event_type() == EventType::Delete) {
                    return true;
                }
            }
            Ok(_) => return true,
        }
    }
}

impl Lock {
    /// The recipe; returns the held lock, or None when the deadline passed (nothing left behind).
    async fn acquire_async(&self, deadline: Option<Instant>) -> Result<Option<Held>, Raise> {
        let inner = &self.inner;
        let ttl = self.ttl;
        let (grant, _) = inner
            .call(Mode::Write, "lock: lease grant", |mut c| async move {
                c.lease_grant(ttl, Some(LeaseGrantOptions::new())).await
            })
            .await?;
        let lease_id = grant.id();
        let stop = Arc::new(AtomicBool::new(false));
        let expired = Arc::new(AtomicBool::new(false));
        let task = inner.runtime.spawn(keep_alive_loop(
            TaskHold::new(inner),
            lease_id,
            grant.ttl(),
            Arc::clone(&stop),
            Arc::clone(&expired),
        ));
        let lease = Lease {
            id: lease_id,
            ttl: grant.ttl(),
            inner: Arc::clone(inner),
            keeper: Mutex::new(Some((task, stop))),
            expired,
        };
        let mut prefix = self.name.clone();
        prefix.push(b'/');
        let mut key = prefix.clone();
        key.extend_from_slice(format!("{lease_id:x}").as_bytes());
        let result = self.wait_turn(&prefix, &key, lease_id, deadline).await;
        match result {
            Ok(true) => Ok(Some(Held { lease, key })),
            other => {
                // Gave up or failed: the lease (and so the key) goes.
                lease.stop_keeper();
                let _ = inner
                    .call(Mode::Write, "lock: lease revoke", |mut c| async move { c.lease_revoke(lease_id).await })
                    .await;
                other.map(|_| None)
            }
        }
    }

    async fn wait_turn(
        &self,
        prefix: &[u8],
        key: &[u8],
        lease_id: i64,
        deadline: Option<Instant>,
    ) -> Result<bool, Raise> {
        let inner = &self.inner;
        let txn = Txn::new()
            .when([EtcdCompare::create_revision(key.to_vec(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.to_vec(), Vec::new(), Some(PutOptions::new().with_lease(lease_id)))])
            .or_else([TxnOp::get(key.to_vec(), None)]);
        let (resp, _) = inner
            .call(Mode::Write, "lock: create key", |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        let my_rev = if resp.succeeded() {
            resp.header().map_or(0, |h| h.revision())
        } else {
            // The key was already there (a retried txn that had been applied): its own revision.
            resp.op_responses()
                .into_iter()
                .find_map(|r| match r {
                    etcd_client::TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.create_revision()),
                    _ => None,
                })
                .unwrap_or(0)
        };
        loop {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(false);
            }
            let opts = GetOptions::new()
                .with_prefix()
                .with_max_create_revision(my_rev - 1)
                .with_sort(SortTarget::Create, SortOrder::Descend)
                .with_limit(1);
            let (before, _) = inner
                .call(Mode::Read, "lock: look for holders", |mut c| {
                    let (p, o) = (prefix.to_vec(), opts.clone());
                    async move { c.get(p, Some(o)).await }
                })
                .await?;
            let Some(ahead) = before.kvs().first() else { return Ok(true) };
            let at = before.header().map_or(0, |h| h.revision());
            if !wait_deleted(inner, ahead.key().to_vec(), at, deadline).await {
                return Ok(false);
            }
        }
    }
}

#[pymethods]
impl Lock {
    /// Takes the lock, waiting up to `timeout` seconds (None: as long as it takes); returns
    /// whether it was taken. The lock lives on a lease of its own, refreshed in the background;
    /// a process that dies holding it loses it after `ttl` seconds.
    #[pyo3(signature = (timeout = None))]
    fn acquire(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        if self.held.lock().is_some() {
            return Err(PyValueError::new_err("this Lock is already held; release it first"));
        }
        let deadline = match timeout {
            None => None,
            Some(t) => Some(
                Instant::now()
                    + Duration::try_from_secs_f64(t).map_err(|_| {
                        PyValueError::new_err(format!("timeout must be a non-negative number of seconds, not {t}"))
                    })?,
            ),
        };
        let inner = Arc::clone(&self.inner);
        let got = py.allow_threads(|| inner.runtime.block_on(self.acquire_async(deadline)));
        match got {
            Ok(Some(h)) => {
                *self.held.lock() = Some(h);
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(r) => Err(r.into_py(py)),
        }
    }

    /// Gives the lock up (deletes its key and revokes its lease). Raises `ValueError` when not held.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        let Some(held) = self.held.lock().take() else {
            return Err(PyValueError::new_err("the lock is not held"));
        };
        held.lease.stop_keeper();
        let id = held.lease.id;
        let inner = Arc::clone(&self.inner);
        let r = py.allow_threads(|| {
            inner.runtime.block_on(inner.call(Mode::Write, "unlock", |mut c| async move { c.lease_revoke(id).await }))
        });
        match r {
            Ok(_) => Ok(()),
            Err(r) if r.class == "LeaseNotFound" => Ok(()), // already gone: so is the key
            Err(r) => Err(r.into_py(py)),
        }
    }

    /// Whether this object holds the lock and its lease was not found gone.
    #[getter]
    fn held(&self) -> bool {
        self.held.lock().as_ref().is_some_and(|h| !h.lease.expired.load(Ordering::Acquire))
    }

    /// The key that holds the lock (None when not held).
    #[getter]
    fn key<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.held.lock().as_ref().map(|h| PyBytes::new(py, &h.key))
    }

    fn __enter__(slf: Py<Self>, py: Python<'_>) -> PyResult<Py<Self>> {
        slf.get().acquire(py, None)?;
        Ok(slf)
    }

    #[pyo3(signature = (_exc_type = None, _exc = None, _tb = None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        self.release(py)?;
        Ok(false)
    }
}

// ---------------------------------------------------------------------------------------------
// Client methods

#[pymethods]
impl Client {
    /// Grants a lease of `ttl` seconds (`id`: ask for this id; 0 lets the cluster choose) and
    /// returns a `Lease`. Keys put with `lease=lease.id` are deleted when it ends. Use it as a
    /// context manager to keep it alive in the background and revoke it at the end:
    ///
    /// ```python
    /// with client.lease(10) as lease:
    ///     client.put("service/me", "10.0.0.7", lease=lease.id)
    /// ```
    #[pyo3(signature = (ttl, *, id = 0))]
    fn lease(&self, py: Python<'_>, ttl: i64, id: i64) -> PyResult<Lease> {
        if ttl <= 0 {
            return Err(PyValueError::new_err(format!("ttl must be a positive number of seconds, not {ttl}")));
        }
        let (r, _) = self.run(py, Mode::Write, "lease grant", |mut c| async move {
            let opts = if id != 0 { LeaseGrantOptions::new().with_id(id) } else { LeaseGrantOptions::new() };
            c.lease_grant(ttl, Some(opts)).await
        })?;
        Ok(Lease {
            id: r.id(),
            ttl: r.ttl(),
            inner: self.inner(py)?,
            keeper: Mutex::new(None),
            expired: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Compacts history: reads and watches below `revision` then raise `Compacted`. Returns
    /// the revision of the store when it was done.
    fn compact(&self, py: Python<'_>, revision: i64) -> PyResult<i64> {
        let (r, _) = self.run(py, Mode::Write, "compact", |mut c| async move { c.compact(revision, None).await })?;
        Ok(r.header().map_or(0, |h| h.revision()))
    }

    /// The ids of every live lease.
    fn leases(&self, py: Python<'_>) -> PyResult<Vec<i64>> {
        let (r, _) = self.run(py, Mode::Read, "leases", |mut c| async move { c.leases().await })?;
        Ok(r.leases().iter().map(|l| l.id()).collect())
    }

    /// Watches `key` (or `[key, end)`, or every key starting with it with `prefix=True`) for
    /// changes, from `start_revision` (0: from now), and returns a `Watch` to iterate:
    ///
    /// ```python
    /// with client.watch("config/", prefix=True, start_revision=rev) as w:
    ///     for event in w:                      # WatchEvent(kind, key, value, revision, prev_kv)
    ///         ...
    /// ```
    ///
    /// `prev_kv=True` adds the previous pair to each event; `no_put`/`no_delete` filter.
    #[pyo3(signature = (key, end = None, *, prefix = false, start_revision = 0, prev_kv = false,
        no_put = false, no_delete = false))]
    #[allow(clippy::too_many_arguments)]
    fn watch(
        &self,
        py: Python<'_>,
        key: Blob,
        end: Option<Blob>,
        prefix: bool,
        start_revision: i64,
        prev_kv: bool,
        no_put: bool,
        no_delete: bool,
    ) -> PyResult<Watch> {
        if key.0.is_empty() && end.is_none() && !prefix {
            return Err(PyValueError::new_err(
                "key must not be empty (use prefix=True with an empty key to watch every key)",
            ));
        }
        if end.is_some() && prefix {
            return Err(PyValueError::new_err("give end or prefix=True, not both"));
        }
        if start_revision < 0 {
            return Err(PyValueError::new_err(format!("start_revision must be >= 0, not {start_revision}")));
        }
        let spec = WatchSpec { key: key.0, end: end.map(|e| e.0), prefix, prev_kv, no_put, no_delete };
        let inner = self.inner(py)?;
        let (tx, rx) = mpsc::channel(WATCH_QUEUE);
        let task = inner.runtime.spawn(watch_loop(TaskHold::new(&inner), spec, start_revision, tx));
        Ok(Watch { inner, rx: Mutex::new(Some(rx)), task: Mutex::new(Some(task)) })
    }

    /// A lock named `name` (not yet taken): `with client.lock("jobs/nightly"):` takes it, waiting
    /// as long as it takes, and gives it up at the end; `acquire(timeout=...)` waits less. It is
    /// etcd's lock recipe, so it excludes `etcdctl lock` and Go's `concurrency.Mutex` on the same
    /// name. `ttl`: seconds a crashed holder keeps it.
    #[pyo3(signature = (name, *, ttl = 10))]
    fn lock(&self, py: Python<'_>, name: Blob, ttl: i64) -> PyResult<Lock> {
        if name.0.is_empty() {
            return Err(PyValueError::new_err("the lock name must not be empty"));
        }
        if ttl <= 0 {
            return Err(PyValueError::new_err(format!("ttl must be a positive number of seconds, not {ttl}")));
        }
        Ok(Lock { inner: self.inner(py)?, name: name.0, ttl, held: Mutex::new(None) })
    }
}

/// Registers the classes.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Lease>()?;
    m.add_class::<LeaseInfo>()?;
    m.add_class::<Watch>()?;
    m.add_class::<WatchEvent>()?;
    m.add_class::<Lock>()?;
    Ok(())
}
