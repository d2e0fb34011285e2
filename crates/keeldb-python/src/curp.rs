//! `Client.curp_put`: writes through keel's CURP extension (`keel-curp`), which completes in
//! one round trip when no other pending write touches the key. Only keel clusters serve it
//! (etcd answers `Unimplemented`, raised as `InvalidRequest`). `curp_weak_put`,
//! `curp_weak_get` and `curp_settle` are the session's weak (causal) operations.

use std::sync::Arc;

use etcd_client::proto::PbPutResponse;
use keel_curp::etcd::PutRequest as PbPutRequest;
use prost::Message;
use pyo3::prelude::*;

use crate::cluster::{classify, Blob, Client, Mode, Raise, Verdict};

fn raise(e: keel_curp::client::CurpError) -> Raise {
    match e {
        keel_curp::client::CurpError::Refused(status) => {
            match classify(etcd_client::Error::GRpcStatus(status), Mode::Write) {
                Verdict::Raise(r) => r,
                Verdict::Retry(m) => Raise::new("Unavailable", format!("curp_put: {m}")),
            }
        }
        keel_curp::client::CurpError::Timeout(id) => Raise::new(
            "Timeout",
            format!("curp_put: write {id} got no answer in time; it may still apply (at most once)"),
        ),
        keel_curp::client::CurpError::Connect(m) => Raise::new("Unavailable", format!("curp_put: {m}")),
    }
}

/// The client's CURP session, made at first use.
async fn session(inner: &crate::cluster::Inner) -> Result<Arc<keel_curp::client::Client>, Raise> {
    let existing = inner.curp.lock().clone();
    if let Some(c) = existing {
        return Ok(c);
    }
    let urls: Vec<String> = inner.endpoints.iter().map(|(u, _)| u.clone()).collect();
    let c = Arc::new(keel_curp::client::Client::connect(&urls, inner.timeout).await.map_err(raise)?);
    Ok(Arc::clone(inner.curp.lock().get_or_insert(c)))
}

#[pymethods]
impl Client {
    /// Sets `key` to `value` through keel's CURP extension. Returns None when the write
    /// completed on the fast path (one round trip: durable against any minority failure,
    /// visible to every later linearizable read, its revision not yet known), or the write's
    /// revision when it completed after commit. With `wait=True` always waits for the revision.
    ///
    /// Raises `Timeout` when the outcome is unknown (retries never apply it twice).
    #[pyo3(signature = (key, value, *, wait = false))]
    fn curp_put(&self, py: Python<'_>, key: Blob, value: Blob, wait: bool) -> PyResult<Option<i64>> {
        if key.0.is_empty() {
            return Err(Raise::new("InvalidRequest", "curp_put: the key is empty").into_py(py));
        }
        let inner = self.inner(py)?;
        let req = PbPutRequest { key: key.0, value: value.0, ..Default::default() };
        let result = py.allow_threads(move || {
            inner.runtime.block_on(async {
                let client = session(&inner).await?;
                let answer = client.put(&req).await.map_err(raise)?;
                let bytes = if answer.fast && !wait {
                    return Ok(None);
                } else if answer.fast {
                    client.synced(answer.id).await.map_err(raise)?
                } else {
                    answer.result
                };
                let resp = PbPutResponse::decode(bytes.as_slice())
                    .map_err(|e| Raise::new("ClusterError", format!("curp_put: undecodable answer: {e}")))?;
                Ok(Some(resp.header.map_or(0, |h| h.revision)))
            })
        });
        result.map_err(|r: Raise| r.into_py(py))
    }

    /// Writes this client's CURP session completed on the fast path and after commit so far.
    fn curp_counts(&self, py: Python<'_>) -> PyResult<(u64, u64)> {
        let inner = self.inner(py)?;
        let c = inner.curp.lock().clone();
        Ok(c.map_or((0, 0), |c| c.path_counts()))
    }

    /// A weak (causal) write of `key`: complete once the session's bound replica has accepted
    /// it, which forwards it to the leader; the session resends it until it has applied. The
    /// session's own reads see it at once; other clients once it has applied. Returns nothing
    /// (its revision is decided later: `curp_settle` waits for it).
    fn curp_weak_put(&self, py: Python<'_>, key: Blob, value: Blob) -> PyResult<()> {
        if key.0.is_empty() {
            return Err(Raise::new("InvalidRequest", "curp_weak_put: the key is empty").into_py(py));
        }
        let inner = self.inner(py)?;
        let req = PbPutRequest { key: key.0, value: value.0, ..Default::default() };
        let result = py.allow_threads(move || {
            inner.runtime.block_on(async {
                let client = session(&inner).await?;
                client.weak_put(&req).await.map(|_| ()).map_err(raise)
            })
        });
        result.map_err(|r: Raise| r.into_py(py))
    }

    /// A weak (causal) read of `key` at the session's bound replica: never older than what this
    /// session has read or written before. Returns the value or None.
    fn curp_weak_get(&self, py: Python<'_>, key: Blob) -> PyResult<Option<Vec<u8>>> {
        if key.0.is_empty() {
            return Err(Raise::new("InvalidRequest", "curp_weak_get: the key is empty").into_py(py));
        }
        let inner = self.inner(py)?;
        let result = py.allow_threads(move || {
            inner.runtime.block_on(async {
                let client = session(&inner).await?;
                client.weak_get(&key.0).await.map(|r| r.value.map(|v| v.0)).map_err(raise)
            })
        });
        result.map_err(|r: Raise| r.into_py(py))
    }

    /// Waits until every weak write of this session has applied (visible to every client).
    fn curp_settle(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.inner(py)?;
        let result = py.allow_threads(move || {
            inner.runtime.block_on(async {
                let client = session(&inner).await?;
                client.settle().await.map_err(raise)
            })
        });
        result.map_err(|r: Raise| r.into_py(py))
    }
}
