//! `Client.curp_put`: writes through keel's CURP extension (`keel-curp`), which completes in
//! one round trip when no other pending write touches the key. Only keel clusters serve it
//! (etcd answers `Unimplemented`, raised as `InvalidRequest`).

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
                let existing = inner.curp.lock().clone();
                let client = match existing {
                    Some(c) => c,
                    None => {
                        let urls: Vec<String> = inner.endpoints.iter().map(|(u, _)| u.clone()).collect();
                        let c =
                            Arc::new(keel_curp::client::Client::connect(&urls, inner.timeout).await.map_err(raise)?);
                        *inner.curp.lock() = Some(Arc::clone(&c));
                        c
                    }
                };
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
}
