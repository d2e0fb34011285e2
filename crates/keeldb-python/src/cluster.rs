//! `keeldb.connect`: a client for etcd's v3 gRPC API, so for a `keel serve` cluster and for etcd
//! itself. Built on the `etcd-client` crate; every `Client` owns a small tokio runtime and its
//! methods block on it with the GIL released.
//!
//! Endpoints and retries. Each endpoint gets its own `etcd_client::Client` (one lazily
//! connected channel), so this module, not a load balancer, decides where a request goes: to
//! the endpoint that answered last, then to the others in turn, with a doubling backoff after
//! each full round, until the client's timeout. Any member will do for writes (keel and etcd
//! forward proposals to the leader), so there is no leader discovery beyond "someone answers".
//!
//! What is retried. A read (range, status, member list) is retried on any `Unavailable`. A
//! write is retried only when it certainly was not applied: the connection could not be made
//! (`tonic::ConnectError` in the error's source chain), or the member refused it before
//! proposing (`no leader`, `too many requests`, `not capable`, `unhealthy cluster`, a refused
//! HTTP/2 stream). Every other failure of a write after it may have reached a server
//! (`request timed out`, `leader changed`, a broken connection, the client's own deadline)
//! raises `keeldb.Timeout`: the outcome is unknown and the caller must decide.
//!
//! Errors by gRPC code and message: `OutOfRange` is `Compacted` or `FutureRevision` (or
//! `InvalidRequest` for anything else out of range), `InvalidArgument` is `InvalidRequest`,
//! `Unavailable` after the deadline is `Unavailable`, anything else a `ClusterError`.

use std::error::Error as StdError;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::proto::{PbKeyValue, PbTxnOpResponse, PbTxnResponse};
use etcd_client::{
    Compare as EtcdCompare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, PutOptions, SortOrder, SortTarget,
    Txn, TxnOp,
};
use parking_lot::RwLock;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyList, PyString, PyTuple};
use tokio::runtime::Runtime;
use tokio::time::Instant;
use tonic::Code;

use crate::errors::new_error;

// ---------------------------------------------------------------------------------------------
// Arguments

/// A key or value argument: `bytes`, `bytearray` or `str` (encoded as UTF-8).
pub struct Blob(pub(crate) Vec<u8>);

impl<'py> FromPyObject<'py> for Blob {
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(b) = ob.downcast::<PyBytes>() {
            return Ok(Blob(b.as_bytes().to_vec()));
        }
        if let Ok(s) = ob.downcast::<PyString>() {
            return Ok(Blob(s.to_cow()?.as_bytes().to_vec()));
        }
        if let Ok(b) = ob.downcast::<PyByteArray>() {
            return Ok(Blob(b.to_vec()));
        }
        Err(PyTypeError::new_err(format!("keys and values must be str or bytes, not {}", ob.get_type().name()?)))
    }
}

fn compare_op(text: &str) -> PyResult<CompareOp> {
    match text {
        "==" | "=" => Ok(CompareOp::Equal),
        "!=" => Ok(CompareOp::NotEqual),
        "<" => Ok(CompareOp::Less),
        ">" => Ok(CompareOp::Greater),
        other => Err(PyValueError::new_err(format!("compare operator must be '==', '!=', '<' or '>', not {other:?}"))),
    }
}

fn sort_target(text: &str) -> PyResult<SortTarget> {
    match text {
        "key" => Ok(SortTarget::Key),
        "version" => Ok(SortTarget::Version),
        "create" | "create_revision" => Ok(SortTarget::Create),
        "mod" | "mod_revision" => Ok(SortTarget::Mod),
        "value" => Ok(SortTarget::Value),
        other => Err(PyValueError::new_err(format!(
            "sort target must be 'key', 'version', 'create_revision', 'mod_revision' or 'value', not {other:?}"
        ))),
    }
}

fn sort_order(text: &str) -> PyResult<SortOrder> {
    match text {
        "ascend" | "asc" => Ok(SortOrder::Ascend),
        "descend" | "desc" => Ok(SortOrder::Descend),
        other => Err(PyValueError::new_err(format!("sort order must be 'ascend' or 'descend', not {other:?}"))),
    }
}

/// `sort=None | "target" | ("target", "order")`.
fn parse_sort(sort: Option<&Bound<'_, PyAny>>) -> PyResult<Option<(SortTarget, SortOrder)>> {
    let Some(sort) = sort.filter(|s| !s.is_none()) else { return Ok(None) };
    if let Ok(target) = sort.extract::<String>() {
        return Ok(Some((sort_target(&target)?, SortOrder::Ascend)));
    }
    match sort.extract::<(String, String)>() {
        Ok((target, order)) => Ok(Some((sort_target(&target)?, sort_order(&order)?))),
        Err(_) => {
            Err(PyTypeError::new_err("sort must be None, a target such as 'key', or (target, 'ascend'|'descend')"))
        }
    }
}

/// What to read: the options of `Client.range` and `Op.get`.
#[derive(Clone, Debug, Default)]
struct RangeSpec {
    key: Vec<u8>,
    end: Option<Vec<u8>>,
    prefix: bool,
    limit: i64,
    revision: i64,
    serializable: bool,
    keys_only: bool,
    sort: Option<(SortTarget, SortOrder)>,
}

impl RangeSpec {
    fn single(key: Vec<u8>) -> Self {
        RangeSpec { key, ..Default::default() }
    }

    fn start(&self) -> Vec<u8> {
        range_start(&self.key, self.end.is_some())
    }

    fn check(&self) -> PyResult<()> {
        if self.prefix && self.end.is_some() {
            return Err(PyValueError::new_err("give either end or prefix=True, not both"));
        }
        if self.limit < 0 || self.revision < 0 {
            return Err(PyValueError::new_err("limit and revision must not be negative"));
        }
        Ok(())
    }

    fn options(&self) -> GetOptions {
        let mut o = GetOptions::new();
        if let Some(end) = &self.end {
            o = o.with_range(end.clone());
        }
        if self.prefix {
            o = o.with_prefix();
        }
        if self.limit > 0 {
            o = o.with_limit(self.limit);
        }
        if self.revision > 0 {
            o = o.with_revision(self.revision);
        }
        if self.serializable {
            o = o.with_serializable();
        }
        if self.keys_only {
            o = o.with_keys_only();
        }
        if let Some((target, order)) = self.sort {
            o = o.with_sort(target, order);
        }
        o
    }
}

/// The key a range starts at: etcd refuses an empty key, but no key is empty, so a range from
/// `""` is the range from `"\0"` (etcd's smallest key; `("\0", "\0")` is every key).
fn range_start(key: &[u8], has_end: bool) -> Vec<u8> {
    if key.is_empty() && has_end {
        vec![0]
    } else {
        key.to_vec()
    }
}

fn delete_options(prefix: bool, range_end: Option<Vec<u8>>) -> PyResult<DeleteOptions> {
    let mut o = DeleteOptions::new();
    match (prefix, range_end) {
        (true, Some(_)) => return Err(PyValueError::new_err("give either range_end or prefix=True, not both")),
        (true, None) => o = o.with_prefix(),
        (false, Some(end)) => o = o.with_range(end),
        (false, None) => {}
    }
    Ok(o)
}

// ---------------------------------------------------------------------------------------------
// Results

/// One key's state as etcd reports it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Kv {
    pub(crate) key: Vec<u8>,
    pub(crate) value: Vec<u8>,
    pub(crate) create_revision: i64,
    pub(crate) mod_revision: i64,
    pub(crate) version: i64,
    pub(crate) lease: i64,
}

impl From<PbKeyValue> for Kv {
    fn from(kv: PbKeyValue) -> Self {
        Kv {
            key: kv.key,
            value: kv.value,
            create_revision: kv.create_revision,
            mod_revision: kv.mod_revision,
            version: kv.version,
            lease: kv.lease,
        }
    }
}

/// A key, its value and its revisions, as returned by `get_kv`, `range` and `put(prev_kv=True)`.
///
/// `create_revision` is the revision that created the key (since its last deletion),
/// `mod_revision` the one that last wrote it, `version` the number of writes since it was
/// created (1 after the first put), `lease` the lease id (0 for none).
#[pyclass(frozen, module = "keeldb")]
pub struct KeyValue {
    kv: Kv,
}

#[pymethods]
impl KeyValue {
    #[getter]
    fn key<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.kv.key)
    }

    #[getter]
    fn value<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.kv.value)
    }

    #[getter]
    fn create_revision(&self) -> i64 {
        self.kv.create_revision
    }

    #[getter]
    fn mod_revision(&self) -> i64 {
        self.kv.mod_revision
    }

    #[getter]
    fn version(&self) -> i64 {
        self.kv.version
    }

    #[getter]
    fn lease(&self) -> i64 {
        self.kv.lease
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.downcast::<KeyValue>().is_ok_and(|o| o.get().kv == self.kv)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "KeyValue(key={}, value={}, create_revision={}, mod_revision={}, version={}, lease={})",
            self.key(py).repr()?,
            self.value(py).repr()?,
            self.kv.create_revision,
            self.kv.mod_revision,
            self.kv.version,
            self.kv.lease
        ))
    }
}

/// What a member says about itself (`Client.status()`).
#[pyclass(frozen, get_all, module = "keeldb")]
pub struct MemberStatus {
    /// The endpoint that answered.
    endpoint: String,
    /// The answering member's id.
    member_id: u64,
    cluster_id: u64,
    /// The member id of the leader it knows (0: none).
    leader: u64,
    /// The store's current revision.
    revision: i64,
    /// The etcd API version the server reports.
    version: String,
    db_size: i64,
    raft_index: u64,
    raft_term: u64,
    raft_applied_index: u64,
    is_learner: bool,
    errors: Vec<String>,
}

#[pymethods]
impl MemberStatus {
    fn __repr__(&self) -> String {
        format!(
            "MemberStatus(endpoint={:?}, member_id={:#x}, leader={:#x}, revision={}, raft_term={}, version={:?})",
            self.endpoint, self.member_id, self.leader, self.revision, self.raft_term, self.version
        )
    }
}

/// A cluster member (`Client.members()`).
#[pyclass(frozen, get_all, module = "keeldb")]
pub struct Member {
    id: u64,
    /// Empty for a member that was added but has not started yet.
    name: String,
    peer_urls: Vec<String>,
    client_urls: Vec<String>,
    is_learner: bool,
}

#[pymethods]
impl Member {
    fn __repr__(&self) -> String {
        format!(
            "Member(id={:#x}, name={:?}, peer_urls={:?}, client_urls={:?}, is_learner={})",
            self.id,
            self.name,
            self.peer_urls,
            self.client_urls,
            if self.is_learner { "True" } else { "False" }
        )
    }
}

/// The outcome of `Client.txn`: whether every comparison held (so `success` ran, else
/// `failure`), the revision after the transaction, and one entry per operation that ran,
/// each what the matching `Client` method returns: a put its revision (or `(revision,
/// previous KeyValue or None)` with `prev_kv=True`), a get a list of `KeyValue`, a delete the
/// number of keys deleted, a nested txn a `TxnResult`.
#[pyclass(frozen, module = "keeldb")]
pub struct TxnResult {
    #[pyo3(get)]
    succeeded: bool,
    #[pyo3(get)]
    revision: i64,
    responses: Vec<PyObject>,
}

#[pymethods]
impl TxnResult {
    #[getter]
    fn responses<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.responses.iter().map(|r| r.bind(py)))
    }

    fn __bool__(&self) -> bool {
        self.succeeded
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "TxnResult(succeeded={}, revision={}, responses={})",
            if self.succeeded { "True" } else { "False" },
            self.revision,
            self.responses(py)?.repr()?
        ))
    }
}

/// A decoded operation response (built without the GIL, converted to Python after).
enum OpResult {
    Put { revision: i64, prev_kv: Option<Option<Kv>> },
    Get(Vec<Kv>),
    Delete(i64),
    Txn(TxnOutcome),
}

struct TxnOutcome {
    succeeded: bool,
    revision: i64,
    responses: Vec<OpResult>,
}

pub(crate) fn kv_object(py: Python<'_>, kv: Kv) -> PyResult<PyObject> {
    Ok(Py::new(py, KeyValue { kv })?.into_any())
}

fn kv_list(py: Python<'_>, kvs: Vec<Kv>) -> PyResult<Bound<'_, PyList>> {
    let items = kvs.into_iter().map(|kv| kv_object(py, kv)).collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, items)
}

fn put_result(py: Python<'_>, revision: i64, prev_kv: Option<Option<Kv>>) -> PyResult<PyObject> {
    match prev_kv {
        None => Ok(revision.into_pyobject(py)?.into_any().unbind()),
        Some(prev) => {
            let prev = match prev {
                Some(kv) => kv_object(py, kv)?,
                None => py.None(),
            };
            Ok(PyTuple::new(py, [revision.into_pyobject(py)?.into_any().unbind(), prev])?.into_any().unbind())
        }
    }
}

impl OpResult {
    fn into_py(self, py: Python<'_>) -> PyResult<PyObject> {
        match self {
            OpResult::Put { revision, prev_kv } => put_result(py, revision, prev_kv),
            OpResult::Get(kvs) => Ok(kv_list(py, kvs)?.into_any().unbind()),
            OpResult::Delete(n) => Ok(n.into_pyobject(py)?.into_any().unbind()),
            OpResult::Txn(t) => Ok(Py::new(py, t.into_result(py)?)?.into_any()),
        }
    }
}

impl TxnOutcome {
    fn into_result(self, py: Python<'_>) -> PyResult<TxnResult> {
        let responses = self.responses.into_iter().map(|r| r.into_py(py)).collect::<PyResult<Vec<_>>>()?;
        Ok(TxnResult { succeeded: self.succeeded, revision: self.revision, responses })
    }
}

// ---------------------------------------------------------------------------------------------
// Transactions: comparisons and operations

/// A comparison of a transaction. Make one with the static constructors:
///
/// ```python
/// keeldb.Compare.value("k", "==", "v")          # the value equals "v"
/// keeldb.Compare.version("k", "==", 0)          # the key does not exist
/// keeldb.Compare.create_revision("k", ">", 0)   # the key exists
/// keeldb.Compare.mod_revision("k", "<", 42)     # last written before revision 42
/// ```
///
/// Operators: `"=="`, `"!="`, `"<"`, `">"`. A missing key has version, create_revision and
/// mod_revision 0 and compares unequal to every value.
#[pyclass(frozen, module = "keeldb")]
#[derive(Clone)]
pub struct Compare {
    cmp: EtcdCompare,
    text: String,
}

impl Compare {
    fn make(cmp: EtcdCompare, what: &str, key: &[u8], op: &str, rhs: String) -> Compare {
        Compare { cmp, text: format!("Compare.{what}({}, {op:?}, {rhs})", bytes_repr(key)) }
    }
}

fn bytes_repr(b: &[u8]) -> String {
    format!("b\"{}\"", b.escape_ascii())
}

#[pymethods]
impl Compare {
    /// The key's value compared with `value`.
    #[staticmethod]
    fn value(key: Blob, op: &str, value: Blob) -> PyResult<Compare> {
        let rhs = bytes_repr(&value.0);
        Ok(Compare::make(EtcdCompare::value(key.0.clone(), compare_op(op)?, value.0), "value", &key.0, op, rhs))
    }

    /// The key's version (writes since creation; 0 if absent) compared with `version`.
    #[staticmethod]
    fn version(key: Blob, op: &str, version: i64) -> PyResult<Compare> {
        let cmp = EtcdCompare::version(key.0.clone(), compare_op(op)?, version);
        Ok(Compare::make(cmp, "version", &key.0, op, version.to_string()))
    }

    /// The revision that created the key (0 if absent) compared with `revision`.
    #[staticmethod]
    fn create_revision(key: Blob, op: &str, revision: i64) -> PyResult<Compare> {
        let cmp = EtcdCompare::create_revision(key.0.clone(), compare_op(op)?, revision);
        Ok(Compare::make(cmp, "create_revision", &key.0, op, revision.to_string()))
    }

    /// The revision that last wrote the key (0 if absent) compared with `revision`.
    #[staticmethod]
    fn mod_revision(key: Blob, op: &str, revision: i64) -> PyResult<Compare> {
        let cmp = EtcdCompare::mod_revision(key.0.clone(), compare_op(op)?, revision);
        Ok(Compare::make(cmp, "mod_revision", &key.0, op, revision.to_string()))
    }

    /// The key's lease id (0 for none) compared with `lease`.
    #[staticmethod]
    fn lease(key: Blob, op: &str, lease: i64) -> PyResult<Compare> {
        let cmp = EtcdCompare::lease(key.0.clone(), compare_op(op)?, lease);
        Ok(Compare::make(cmp, "lease", &key.0, op, lease.to_string()))
    }

    fn __repr__(&self) -> String {
        self.text.clone()
    }
}

#[derive(Clone, Debug)]
enum OpSpec {
    Put { key: Vec<u8>, value: Vec<u8>, prev_kv: bool },
    Get(RangeSpec),
    Delete { key: Vec<u8>, prefix: bool, range_end: Option<Vec<u8>> },
    Txn(Box<TxnSpec>),
}

#[derive(Clone, Debug)]
struct TxnSpec {
    compare: Vec<EtcdCompare>,
    success: Vec<OpSpec>,
    failure: Vec<OpSpec>,
}

impl OpSpec {
    fn to_etcd(&self) -> PyResult<TxnOp> {
        Ok(match self {
            OpSpec::Put { key, value, prev_kv } => {
                let o = if *prev_kv { PutOptions::new().with_prev_key() } else { PutOptions::new() };
                TxnOp::put(key.clone(), value.clone(), Some(o))
            }
            OpSpec::Get(r) => TxnOp::get(r.start(), Some(r.options())),
            OpSpec::Delete { key, prefix, range_end } => {
                TxnOp::delete(range_start(key, range_end.is_some()), Some(delete_options(*prefix, range_end.clone())?))
            }
            OpSpec::Txn(t) => TxnOp::txn(t.to_etcd()?),
        })
    }

    fn repr(&self) -> String {
        match self {
            OpSpec::Put { key, value, prev_kv } => {
                format!(
                    "Op.put({}, {}{})",
                    bytes_repr(key),
                    bytes_repr(value),
                    if *prev_kv { ", prev_kv=True" } else { "" }
                )
            }
            OpSpec::Get(r) => format!("Op.get({})", bytes_repr(&r.key)),
            OpSpec::Delete { key, .. } => format!("Op.delete({})", bytes_repr(key)),
            OpSpec::Txn(t) => format!(
                "Op.txn({} compares, {} success, {} failure)",
                t.compare.len(),
                t.success.len(),
                t.failure.len()
            ),
        }
    }
}

impl TxnSpec {
    fn new(compare: Vec<PyRef<'_, Compare>>, success: Vec<PyRef<'_, Op>>, failure: Vec<PyRef<'_, Op>>) -> TxnSpec {
        TxnSpec {
            compare: compare.iter().map(|c| c.cmp.clone()).collect(),
            success: success.iter().map(|o| o.spec.clone()).collect(),
            failure: failure.iter().map(|o| o.spec.clone()).collect(),
        }
    }

    fn to_etcd(&self) -> PyResult<Txn> {
        let success = self.success.iter().map(OpSpec::to_etcd).collect::<PyResult<Vec<_>>>()?;
        let failure = self.failure.iter().map(OpSpec::to_etcd).collect::<PyResult<Vec<_>>>()?;
        Ok(Txn::new().when(self.compare.clone()).and_then(success).or_else(failure))
    }

    /// Pairs the response with the operations of the branch that ran.
    fn decode(&self, resp: PbTxnResponse, revision: Option<i64>) -> Result<TxnOutcome, Raise> {
        // Nested transactions share the outer one's revision (one txn is one revision).
        let revision = revision.unwrap_or_else(|| resp.header.as_ref().map_or(0, |h| h.revision));
        let ops = if resp.succeeded { &self.success } else { &self.failure };
        if ops.len() != resp.responses.len() {
            return Err(malformed(format!("{} responses for {} operations", resp.responses.len(), ops.len())));
        }
        let mut responses = Vec::with_capacity(ops.len());
        for (op, r) in ops.iter().zip(resp.responses) {
            let decoded = match (op, r.response) {
                (OpSpec::Put { prev_kv, .. }, Some(PbTxnOpResponse::ResponsePut(p))) => {
                    OpResult::Put { revision, prev_kv: prev_kv.then(|| p.prev_kv.map(Kv::from)) }
                }
                (OpSpec::Get(_), Some(PbTxnOpResponse::ResponseRange(g))) => {
                    OpResult::Get(g.kvs.into_iter().map(Kv::from).collect())
                }
                (OpSpec::Delete { .. }, Some(PbTxnOpResponse::ResponseDeleteRange(d))) => OpResult::Delete(d.deleted),
                (OpSpec::Txn(t), Some(PbTxnOpResponse::ResponseTxn(inner))) => {
                    OpResult::Txn(t.decode(inner, Some(revision))?)
                }
                (op, other) => {
                    return Err(malformed(format!("{} answered with {other:?}", op.repr())));
                }
            };
            responses.push(decoded);
        }
        Ok(TxnOutcome { succeeded: resp.succeeded, revision, responses })
    }
}

/// An operation of a transaction (`Client.txn(success=[...], failure=[...])`):
///
/// ```python
/// keeldb.Op.put("k", "v", prev_kv=False)
/// keeldb.Op.get("k", end=None, prefix=False, limit=0, ...)   # the options of Client.range
/// keeldb.Op.delete("k", prefix=False, range_end=None)
/// keeldb.Op.txn(compare=[...], success=[...], failure=[...])
/// ```
#[pyclass(frozen, module = "keeldb")]
pub struct Op {
    spec: OpSpec,
}

#[pymethods]
impl Op {
    /// Sets `key` to `value`; with `prev_kv=True` the response also carries the previous pair.
    #[staticmethod]
    #[pyo3(signature = (key, value, *, prev_kv = false))]
    fn put(key: Blob, value: Blob, prev_kv: bool) -> Op {
        Op { spec: OpSpec::Put { key: key.0, value: value.0, prev_kv } }
    }

    /// Reads `key` (or a range: the options mean what they mean for `Client.range`).
    #[staticmethod]
    #[pyo3(signature = (key, end = None, *, prefix = false, limit = 0, revision = 0, serializable = false,
        keys_only = false, sort = None))]
    #[allow(clippy::too_many_arguments)]
    fn get(
        key: Blob,
        end: Option<Blob>,
        prefix: bool,
        limit: i64,
        revision: i64,
        serializable: bool,
        keys_only: bool,
        sort: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Op> {
        let spec = RangeSpec {
            key: key.0,
            end: end.map(|e| e.0),
            prefix,
            limit,
            revision,
            serializable,
            keys_only,
            sort: parse_sort(sort)?,
        };
        spec.check()?;
        Ok(Op { spec: OpSpec::Get(spec) })
    }

    /// Deletes `key`, every key starting with it (`prefix=True`), or `[key, range_end)`.
    #[staticmethod]
    #[pyo3(signature = (key, *, prefix = false, range_end = None))]
    fn delete(key: Blob, prefix: bool, range_end: Option<Blob>) -> PyResult<Op> {
        let range_end = range_end.map(|e| e.0);
        delete_options(prefix, range_end.clone())?;
        Ok(Op { spec: OpSpec::Delete { key: key.0, prefix, range_end } })
    }

    /// A nested transaction (its response is a `TxnResult`).
    #[staticmethod]
    #[pyo3(signature = (compare = Vec::new(), success = Vec::new(), failure = Vec::new()))]
    fn txn(compare: Vec<PyRef<'_, Compare>>, success: Vec<PyRef<'_, Op>>, failure: Vec<PyRef<'_, Op>>) -> Op {
        Op { spec: OpSpec::Txn(Box::new(TxnSpec::new(compare, success, failure))) }
    }

    fn __repr__(&self) -> String {
        self.spec.repr()
    }
}

// ---------------------------------------------------------------------------------------------
// Errors and retries

/// An error to raise: a class of `keeldb._errors` and its message.
#[derive(Debug)]
pub struct Raise {
    pub(crate) class: &'static str,
    pub(crate) message: String,
}

impl Raise {
    pub(crate) fn new(class: &'static str, message: impl Into<String>) -> Raise {
        Raise { class, message: message.into() }
    }

    pub(crate) fn into_py(self, py: Python<'_>) -> PyErr {
        new_error(py, self.class, self.message)
    }
}

fn malformed(what: String) -> Raise {
    Raise::new("ClusterError", format!("malformed response: {what}"))
}

/// Whether a request changes state (and so must not be resent when it may have been applied).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Mode {
    Read,
    Write,
}

/// What to do about a failed attempt.
pub(crate) enum Verdict {
    /// Not applied (or harmless to repeat): try the next endpoint.
    Retry(String),
    /// Raise this.
    Raise(Raise),
}

/// Messages of refusals that etcd (and keel) give before proposing anything.
const REFUSED_BEFORE_PROPOSING: [&str; 5] =
    ["no leader", "too many requests", "not capable", "unhealthy cluster", "refused stream"];

/// Whether the connection could not be made, so the request never left this client.
fn is_connect_error(status: &tonic::Status) -> bool {
    let mut source: Option<&(dyn StdError + 'static)> = status.source();
    while let Some(e) = source {
        if e.is::<tonic::ConnectError>() {
            return true;
        }
        source = e.source();
    }
    false
}

/// The status message with the causes a client-side status carries (a bare "transport error"
/// says little).
fn describe(status: &tonic::Status) -> String {
    let mut text =
        if status.message().is_empty() { format!("gRPC {:?}", status.code()) } else { status.message().to_string() };
    let mut source: Option<&(dyn StdError + 'static)> = status.source();
    while let Some(e) = source {
        let part = e.to_string();
        if !text.contains(&part) {
            text = format!("{text}: {part}");
        }
        source = e.source();
    }
    text
}

fn classify_status(status: &tonic::Status, mode: Mode) -> Verdict {
    let message = status.message();
    let code = status.code();
    let text = describe(status);
    // A status made by this client (transport, h2) carries its cause; one sent by a server not.
    let local = status.source().is_some();
    let transient = match code {
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Aborted => true,
        Code::ResourceExhausted => message.contains("too many requests"),
        Code::Unknown | Code::Internal => local,
        _ => false,
    };
    if transient {
        let not_applied = is_connect_error(status) || REFUSED_BEFORE_PROPOSING.iter().any(|m| message.contains(m));
        return if mode == Mode::Read || not_applied {
            Verdict::Retry(text)
        } else {
            Verdict::Raise(Raise::new(
                "Timeout",
                format!("{text}; the write may or may not have been applied (gRPC {code:?})"),
            ))
        };
    }
    let class = match code {
        Code::NotFound if message.contains("lease not found") => "LeaseNotFound",
        Code::OutOfRange if message.contains("compacted") => "Compacted",
        Code::OutOfRange if message.contains("future revision") => "FutureRevision",
        Code::OutOfRange | Code::InvalidArgument | Code::ResourceExhausted => "InvalidRequest",
        _ => return Verdict::Raise(Raise::new("ClusterError", format!("{text} (gRPC {code:?})"))),
    };
    Verdict::Raise(Raise::new(class, text))
}

pub(crate) fn classify(e: etcd_client::Error, mode: Mode) -> Verdict {
    match e {
        etcd_client::Error::GRpcStatus(status) => classify_status(&status, mode),
        // Raised while setting up a channel, before anything is sent.
        etcd_client::Error::TransportError(e) => Verdict::Retry(format!("transport error: {e}")),
        etcd_client::Error::InvalidArgs(m) => Verdict::Raise(Raise::new("InvalidRequest", m)),
        // Opening a keep-alive stream refreshes once and reports a lease that is gone this way.
        etcd_client::Error::LeaseKeepAliveError(m) if m.contains("not found") => {
            Verdict::Raise(Raise::new("LeaseNotFound", format!("requested lease not found ({m})")))
        }
        other => Verdict::Raise(Raise::new("ClusterError", other.to_string())),
    }
}

fn seconds(d: Duration) -> String {
    format!("{:.3} s", d.as_secs_f64())
}

// ---------------------------------------------------------------------------------------------
// The client

/// A live client: its runtime and one etcd client per endpoint.
pub(crate) struct Inner {
    pub(crate) runtime: Runtime,
    pub(crate) endpoints: Vec<(String, etcd_client::Client)>,
    /// The endpoint to try first: the one that answered last.
    preferred: AtomicUsize,
    pub(crate) timeout: Duration,
    /// The CURP session (`curp_put`), made at first use.
    pub(crate) curp: parking_lot::Mutex<Option<Arc<keel_curp::client::Client>>>,
}

/// What a background task (lease keep-alive, watch) holds of its client. `Inner` owns the
/// runtime, so a task holding the last reference would drop the runtime on one of the
/// runtime's own threads when it ends or is aborted, and tokio refuses that with a panic
/// ("Cannot drop a runtime in a context where blocking is not allowed"). The last reference
/// taken here shuts the runtime down in the background instead, which never blocks.
pub(crate) struct TaskHold(Option<Arc<Inner>>);

impl TaskHold {
    pub(crate) fn new(inner: &Arc<Inner>) -> TaskHold {
        TaskHold(Some(Arc::clone(inner)))
    }

    pub(crate) fn get(&self) -> Option<&Inner> {
        self.0.as_deref()
    }
}

impl Drop for TaskHold {
    fn drop(&mut self) {
        if let Some(last) = self.0.take().and_then(Arc::into_inner) {
            let Inner { runtime, endpoints, curp, .. } = last;
            drop((endpoints, curp));
            runtime.shutdown_background();
        }
    }
}

const FIRST_BACKOFF: Duration = Duration::from_millis(25);
const MAX_BACKOFF: Duration = Duration::from_millis(500);

impl Inner {
    /// Runs `f` against the endpoints (preferred first, then in turn, backing off after each
    /// full round) until it succeeds, fails for good, or the client's timeout passes. Returns
    /// the value and the endpoint that answered.
    pub(crate) async fn call<T, F, Fut>(&self, mode: Mode, what: &str, f: F) -> Result<(T, &str), Raise>
    where
        F: Fn(etcd_client::Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let deadline = Instant::now() + self.timeout;
        let n = self.endpoints.len().max(1);
        let first = self.preferred.load(Ordering::Relaxed);
        let mut backoff = FIRST_BACKOFF;
        let mut failures: Vec<String> = Vec::new();
        for attempt in 0.. {
            let index = (first + attempt) % n;
            let Some((url, client)) = self.endpoints.get(index) else {
                return Err(Raise::new("ClusterError", "the client has no endpoints"));
            };
            match tokio::time::timeout_at(deadline, f(client.clone())).await {
                Ok(Ok(value)) => {
                    self.preferred.store(index, Ordering::Relaxed);
                    return Ok((value, url.as_str()));
                }
                Ok(Err(e)) => match classify(e, mode) {
                    Verdict::Retry(m) => {
                        if failures.len() >= n {
                            failures.remove(0);
                        }
                        failures.push(format!("{url}: {m}"));
                    }
                    Verdict::Raise(mut r) => {
                        r.message = format!("{what} on {url}: {}", r.message);
                        return Err(r);
                    }
                },
                Err(_) => {
                    let tail = match mode {
                        Mode::Write => "; the write may or may not have been applied",
                        Mode::Read => "",
                    };
                    return Err(Raise::new(
                        "Timeout",
                        format!("{what}: no answer from {url} within the timeout ({}){tail}", seconds(self.timeout)),
                    ));
                }
            }
            if (attempt + 1) % n == 0 {
                // Every endpoint failed this round: back off (never past the deadline), then
                // go round again.
                tokio::time::sleep_until((Instant::now() + backoff).min(deadline)).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
            if Instant::now() >= deadline {
                break;
            }
        }
        Err(Raise::new(
            "Unavailable",
            format!("{what}: no endpoint could serve it within {}: {}", seconds(self.timeout), failures.join("; ")),
        ))
    }
}

/// Splits `"a,b"` and checks the scheme: plain `http://` (or none) only.
fn parse_endpoints(endpoints: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    let raw: Vec<String> = if let Ok(s) = endpoints.extract::<String>() {
        s.split(',').map(str::to_string).collect()
    } else {
        endpoints
            .extract::<Vec<String>>()
            .map_err(|_| PyTypeError::new_err("endpoints must be a str or a list of str"))?
    };
    let mut out = Vec::new();
    for e in raw {
        let e = e.trim();
        if e.is_empty() {
            continue;
        }
        if e.starts_with("https://") || e.starts_with("unix:") {
            return Err(PyValueError::new_err(format!("{e}: only plain http:// endpoints are supported")));
        }
        out.push(e.to_string());
    }
    if out.is_empty() {
        return Err(PyValueError::new_err("no endpoints given"));
    }
    Ok(out)
}

/// Connects to an etcd v3 API (a `keel serve` cluster, or etcd) at `endpoints`.
///
/// `endpoints` is a list of `"host:port"` or `"http://host:port"` strings (or one string,
/// comma-separated as in etcdctl). Connections are made lazily by the first request, so this
/// does not fail when the cluster is down; requests raise `Unavailable` instead. `timeout` (in
/// seconds) bounds every call, retries included. Use it as a context manager, or call
/// `close()`.
#[pyfunction]
#[pyo3(signature = (endpoints, *, timeout = 5.0))]
pub fn connect(py: Python<'_>, endpoints: &Bound<'_, PyAny>, timeout: f64) -> PyResult<Client> {
    let urls = parse_endpoints(endpoints)?;
    let timeout = Duration::try_from_secs_f64(timeout)
        .ok()
        .filter(|t| !t.is_zero())
        .ok_or_else(|| PyValueError::new_err(format!("timeout must be a positive number of seconds, not {timeout}")))?;
    let inner = py.allow_threads(|| -> Result<Inner, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("keeldb-client")
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| format!("cannot start the client runtime: {e}"))?;
        // A dead host must not eat the whole budget: half of it at most, then the next endpoint.
        let connect_timeout = (timeout / 2).clamp(Duration::from_millis(50), Duration::from_secs(2));
        let options = ConnectOptions::new().with_connect_timeout(connect_timeout).with_require_leader(true);
        let mut endpoints = Vec::new();
        for url in &urls {
            let client = runtime
                .block_on(etcd_client::Client::connect([url.as_str()], Some(options.clone())))
                .map_err(|e| format!("{url}: {e}"))?;
            endpoints.push((url.clone(), client));
        }
        Ok(Inner { runtime, endpoints, preferred: AtomicUsize::new(0), timeout, curp: parking_lot::Mutex::new(None) })
    });
    let inner = inner.map_err(PyValueError::new_err)?;
    Ok(Client { inner: RwLock::new(Some(Arc::new(inner))), endpoints: urls, timeout: timeout.as_secs_f64() })
}

/// A client of an etcd v3 API cluster; see `keeldb.connect`. Thread-safe: share one client
/// between threads. Keys and values may be `str` (UTF-8) or `bytes`; they come back as `bytes`.
#[pyclass(frozen, module = "keeldb")]
pub struct Client {
    inner: RwLock<Option<Arc<Inner>>>,
    /// The endpoints, as given.
    #[pyo3(get)]
    endpoints: Vec<String>,
    /// The time limit of every call, in seconds.
    #[pyo3(get)]
    timeout: f64,
}

impl Client {
    pub(crate) fn inner(&self, py: Python<'_>) -> PyResult<Arc<Inner>> {
        self.inner.read().clone().ok_or_else(|| new_error(py, "ClosedError", "the client was closed".into()))
    }

    /// Runs one call with retries, the GIL released.
    pub(crate) fn run<T, F, Fut>(&self, py: Python<'_>, mode: Mode, what: &str, f: F) -> PyResult<(T, String)>
    where
        T: Send,
        F: Fn(etcd_client::Client) -> Fut + Send,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let inner = self.inner(py)?;
        let result = py.allow_threads(move || {
            let r = inner.runtime.block_on(inner.call(mode, what, f)).map(|(v, url)| (v, url.to_string()));
            drop(inner);
            r
        });
        result.map_err(|r| r.into_py(py))
    }

    fn range_kvs(&self, py: Python<'_>, spec: RangeSpec) -> PyResult<Vec<Kv>> {
        spec.check()?;
        let (resp, _) = self.run(py, Mode::Read, "range", |mut c| {
            let (key, options) = (spec.start(), spec.options());
            async move { c.get(key, Some(options)).await }
        })?;
        Ok(resp.0.kvs.into_iter().map(Kv::from).collect())
    }
}

#[pymethods]
impl Client {
    /// The value of `key`, or None if it does not exist (a linearizable read).
    fn get<'py>(&self, py: Python<'py>, key: Blob) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let kvs = self.range_kvs(py, RangeSpec::single(key.0))?;
        Ok(kvs.into_iter().next().map(|kv| PyBytes::new(py, &kv.value)))
    }

    /// `key` with its revisions as a `KeyValue`, or None if it does not exist.
    fn get_kv(&self, py: Python<'_>, key: Blob) -> PyResult<Option<PyObject>> {
        let kvs = self.range_kvs(py, RangeSpec::single(key.0))?;
        kvs.into_iter().next().map(|kv| kv_object(py, kv)).transpose()
    }

    /// Sets `key` to `value` and returns the revision of the write. With `prev_kv=True`,
    /// returns `(revision, previous KeyValue or None)`.
    ///
    /// Raises `Timeout` when the outcome is unknown (the request may have been applied).
    ///
    /// `lease`: attach the key to this lease id (`Lease.id`); the key is deleted when the
    /// lease ends. Raises `LeaseNotFound` (and writes nothing) for an unknown lease.
    #[pyo3(signature = (key, value, *, prev_kv = false, lease = 0))]
    fn put(&self, py: Python<'_>, key: Blob, value: Blob, prev_kv: bool, lease: i64) -> PyResult<PyObject> {
        let (resp, _) = self.run(py, Mode::Write, "put", |mut c| {
            let (key, value) = (key.0.clone(), value.0.clone());
            let options = if prev_kv { PutOptions::new().with_prev_key() } else { PutOptions::new() };
            let options = if lease != 0 { options.with_lease(lease) } else { options };
            async move { c.put(key, value, Some(options)).await }
        })?;
        let resp = resp.0;
        let revision = resp.header.as_ref().map_or(0, |h| h.revision);
        put_result(py, revision, prev_kv.then(|| resp.prev_kv.map(Kv::from)))
    }

    /// Deletes `key` (or every key starting with it when `prefix=True`, or every key in
    /// `[key, range_end)`) and returns how many keys were deleted.
    #[pyo3(signature = (key, *, prefix = false, range_end = None))]
    fn delete(&self, py: Python<'_>, key: Blob, prefix: bool, range_end: Option<Blob>) -> PyResult<i64> {
        let range_end = range_end.map(|e| e.0);
        delete_options(prefix, range_end.clone())?;
        let (resp, _) = self.run(py, Mode::Write, "delete", |mut c| {
            let key = range_start(&key.0, range_end.is_some());
            let options = delete_options(prefix, range_end.clone());
            async move {
                let options = options.map_err(|e| etcd_client::Error::InvalidArgs(e.to_string()))?;
                c.delete(key, Some(options)).await
            }
        })?;
        Ok(resp.deleted())
    }

    /// The keys in `[start, end)` in key order, as `KeyValue`s.
    ///
    /// With `end=None`, just `start` (etcd's convention; `end=b"\0"` means every key from
    /// `start` on, so `range("", b"\0")` is every key). `prefix=True`: every key starting with
    /// `start`. `limit`: at most this many (0: no limit). `revision`: read the store as of that
    /// revision (0: now; raises `Compacted` or `FutureRevision`). `serializable=True`: answer
    /// from the member's local state without a leader round trip (may be stale).
    /// `keys_only=True`: values come back empty. `sort`: `"key"`, `"version"`,
    /// `"create_revision"`, `"mod_revision"` or `"value"`, or a pair such as
    /// `("mod_revision", "descend")`.
    #[pyo3(signature = (start, end = None, *, prefix = false, limit = 0, revision = 0, serializable = false,
        keys_only = false, sort = None))]
    #[allow(clippy::too_many_arguments)]
    fn range<'py>(
        &self,
        py: Python<'py>,
        start: Blob,
        end: Option<Blob>,
        prefix: bool,
        limit: i64,
        revision: i64,
        serializable: bool,
        keys_only: bool,
        sort: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let spec = RangeSpec {
            key: start.0,
            end: end.map(|e| e.0),
            prefix,
            limit,
            revision,
            serializable,
            keys_only,
            sort: parse_sort(sort)?,
        };
        let kvs = self.range_kvs(py, spec)?;
        kv_list(py, kvs)
    }

    /// Runs a transaction: if every comparison in `compare` holds, the operations in `success`,
    /// otherwise those in `failure`, atomically at one revision. Returns a `TxnResult`.
    ///
    /// ```python
    /// r = client.txn(compare=[keeldb.Compare.version("lock", "==", 0)],
    ///                success=[keeldb.Op.put("lock", "me")],
    ///                failure=[keeldb.Op.get("lock")])
    /// ```
    ///
    /// Raises `InvalidRequest` for a key written twice in one branch, `Timeout` when the
    /// outcome is unknown.
    #[pyo3(signature = (compare = Vec::new(), success = Vec::new(), failure = Vec::new()))]
    fn txn(
        &self,
        py: Python<'_>,
        compare: Vec<PyRef<'_, Compare>>,
        success: Vec<PyRef<'_, Op>>,
        failure: Vec<PyRef<'_, Op>>,
    ) -> PyResult<TxnResult> {
        let spec = TxnSpec::new(compare, success, failure);
        let txn = spec.to_etcd()?;
        let writes = [&spec.success, &spec.failure].iter().any(|ops| ops.iter().any(OpSpec::writes));
        let mode = if writes { Mode::Write } else { Mode::Read };
        let (resp, _) = self.run(py, mode, "txn", |mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })?;
        spec.decode(resp.0, None).map_err(|r| r.into_py(py))?.into_result(py)
    }

    /// The status of a member (the first endpoint that answers): its id, the leader it knows,
    /// revision, raft term and index, version.
    fn status(&self, py: Python<'_>) -> PyResult<MemberStatus> {
        let (resp, endpoint) = self.run(py, Mode::Read, "status", |mut c| async move { c.status().await })?;
        let header = resp.header();
        Ok(MemberStatus {
            endpoint,
            member_id: header.map_or(0, |h| h.member_id()),
            cluster_id: header.map_or(0, |h| h.cluster_id()),
            revision: header.map_or(0, |h| h.revision()),
            leader: resp.leader(),
            version: resp.version().to_string(),
            db_size: resp.db_size(),
            raft_index: resp.raft_index(),
            raft_term: resp.raft_term(),
            raft_applied_index: resp.raft_applied_index(),
            is_learner: resp.is_learner(),
            errors: resp.errors().to_vec(),
        })
    }

    /// The member id of the current leader. Waits (up to the timeout, trying every endpoint)
    /// while the answering members know no leader, then raises `Unavailable`.
    fn leader(&self, py: Python<'_>) -> PyResult<u64> {
        let (leader, _) = self.run(py, Mode::Read, "leader", |mut c| async move {
            match c.status().await?.leader() {
                0 => Err(etcd_client::Error::GRpcStatus(tonic::Status::unavailable("etcdserver: no leader"))),
                id => Ok(id),
            }
        })?;
        Ok(leader)
    }

    /// The cluster's members, as `Member`s.
    fn members(&self, py: Python<'_>) -> PyResult<Vec<Member>> {
        let (resp, _) = self.run(py, Mode::Read, "members", |mut c| async move { c.member_list().await })?;
        Ok(resp
            .members()
            .iter()
            .map(|m| Member {
                id: m.id(),
                name: m.name().to_string(),
                peer_urls: m.peer_urls().to_vec(),
                client_urls: m.client_urls().to_vec(),
                is_learner: m.is_learner(),
            })
            .collect())
    }

    /// Closes the connections and stops the client's runtime. Idempotent; later calls raise
    /// `ClosedError`.
    fn close(&self, py: Python<'_>) {
        let inner = self.inner.write().take();
        py.allow_threads(move || drop(inner));
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.read().is_none()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (_exc_type = None, _exc = None, _tb = None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "<keeldb.Client endpoints={:?} timeout={}{}>",
            self.endpoints,
            self.timeout,
            if self.closed() { " closed" } else { "" }
        )
    }
}

impl OpSpec {
    fn writes(&self) -> bool {
        match self {
            OpSpec::Put { .. } | OpSpec::Delete { .. } => true,
            OpSpec::Get(_) => false,
            OpSpec::Txn(t) => t.success.iter().chain(&t.failure).any(OpSpec::writes),
        }
    }
}

/// Registers the classes and `connect` on the native module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(connect, m)?)?;
    m.add_class::<Client>()?;
    m.add_class::<KeyValue>()?;
    m.add_class::<MemberStatus>()?;
    m.add_class::<Member>()?;
    m.add_class::<TxnResult>()?;
    m.add_class::<Compare>()?;
    m.add_class::<Op>()?;
    crate::coord::register(m)?;
    Ok(())
}
