//! The `keeldb` Python package's native module, `keeldb._keeldb`: PyO3 bindings over the
//! engine's public API only (this crate never reaches into engine internals).
//!
//! - `db.rs`: `open`, `Database`, `transact`, `verify`.
//! - `txn.rs`: `ReadTransaction`, `WriteTransaction`, key-value methods, range scans.
//! - `graph.rs`: `Node`, `Edge`, graph methods of the transactions.
//! - `props.rs`: JSON-compatible dict properties to and from compact JSON bytes.
//! - `errors.rs`: engine errors to the `keeldb.Error` hierarchy (`python/keeldb/_errors.py`).
//! - `cluster.rs`: `connect` and `Client`, a client of etcd's v3 gRPC API (`keel serve`, etcd).
//!
//! The GIL is released wherever the engine may wait (commit and its fsync, open, close,
//! checkpoint, verify, scan chunks), never for sub-microsecond point operations, and for every
//! network round trip of the cluster client.

mod cluster;
mod coord;
mod curp;
mod db;
mod errors;
mod graph;
mod props;
mod txn;

use pyo3::prelude::*;

#[pymodule]
fn _keeldb(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::init(m.py())?;
    m.add_function(wrap_pyfunction!(db::open, m)?)?;
    m.add_function(wrap_pyfunction!(db::verify, m)?)?;
    m.add_class::<db::Database>()?;
    m.add_class::<db::VerifyReport>()?;
    m.add_class::<txn::ReadTransaction>()?;
    m.add_class::<txn::WriteTransaction>()?;
    m.add_class::<txn::ScanIter>()?;
    m.add_class::<graph::Node>()?;
    m.add_class::<graph::Edge>()?;
    m.add_class::<graph::GraphIter>()?;
    cluster::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("FORMAT_VERSION", keeldb::FORMAT_VERSION)?;
    Ok(())
}
