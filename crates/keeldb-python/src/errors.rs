//! Maps engine and graph errors onto the Python exception hierarchy defined in
//! `python/keeldb/_errors.py` (a pure-Python module, so classes can also inherit from
//! `ValueError`, `LookupError`, ...). The classes are looked up once and cached.

use keeldb::graph::GraphError;
use keeldb::Error;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::PyType;

static ERRORS_MODULE: GILOnceCell<Py<PyModule>> = GILOnceCell::new();

/// Loads the exception module; called at import so a broken install fails loudly and early.
pub fn init(py: Python<'_>) -> PyResult<()> {
    ERRORS_MODULE.get_or_try_init(py, || Ok::<_, PyErr>(py.import("keeldb._errors")?.unbind()))?;
    Ok(())
}

/// An exception of the class `name` of `keeldb._errors` with `message`.
pub fn new_error(py: Python<'_>, name: &str, message: String) -> PyErr {
    let class = ERRORS_MODULE
        .get_or_try_init(py, || Ok::<_, PyErr>(py.import("keeldb._errors")?.unbind()))
        .and_then(|m| m.bind(py).getattr(name))
        .and_then(|c| c.downcast_into::<PyType>().map_err(PyErr::from));
    match class {
        Ok(class) => PyErr::from_type(class, message),
        Err(e) => PyRuntimeError::new_err(format!("keeldb: cannot load exception class {name}: {e}; {message}")),
    }
}

fn class_of(e: &Error) -> &'static str {
    match e {
        Error::Conflict { .. } => "ConflictError",
        Error::Corruption { .. } => "CorruptionError",
        Error::Locked(_) => "LockedError",
        Error::Poisoned(_) => "PoisonedError",
        Error::LimitExceeded { .. } => "LimitError",
        Error::InvalidArgument(_) | Error::ReservedTable(_) => "InvalidArgumentError",
        Error::NotAStore { .. } => "NotAStoreError",
        Error::UnsupportedVersion { .. } => "UnsupportedVersionError",
        Error::Closed => "ClosedError",
        Error::TransactionDone => "TransactionDoneError",
        Error::CpuBudgetExceeded { .. } => "CpuBudgetError",
        Error::Timeout { .. } => "TxnTimeoutError",
        Error::Io { .. } => "IoError",
        _ => "Error",
    }
}

/// Converts an engine error into the matching `keeldb.Error` subclass.
pub fn to_py(e: Error) -> PyErr {
    Python::with_gil(|py| new_error(py, class_of(&e), e.to_string()))
}

/// Converts a graph error: missing nodes and edges become `NotFoundError`.
pub fn graph_to_py(e: GraphError) -> PyErr {
    match e {
        GraphError::Storage(e) => to_py(e),
        GraphError::NodeNotFound(_) | GraphError::EdgeNotFound(_) => {
            Python::with_gil(|py| new_error(py, "NotFoundError", e.to_string()))
        }
        GraphError::Malformed { .. } => Python::with_gil(|py| new_error(py, "CorruptionError", e.to_string())),
        other => Python::with_gil(|py| new_error(py, "Error", other.to_string())),
    }
}

/// Whether `e` is a `keeldb.ConflictError`.
pub fn is_conflict(py: Python<'_>, e: &PyErr) -> bool {
    ERRORS_MODULE
        .get(py)
        .and_then(|m| m.bind(py).getattr("ConflictError").ok())
        .is_some_and(|c| e.get_type(py).is_subclass(&c).unwrap_or(false))
}

/// The `RuntimeError` raised when two threads use one transaction at the same time.
pub fn busy() -> PyErr {
    PyRuntimeError::new_err("this transaction is being used by another thread; give each thread its own transaction")
}
