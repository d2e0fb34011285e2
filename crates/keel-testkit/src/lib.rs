//! Test support for KeelDB: file systems that count, fail, lose, tear and corrupt operations
//! behind the engine's file-system seam, a reference model, and crash workloads. Never a
//! dependency of the engine itself. The fault model is written down in `docs/RELIABILITY.md`.

pub mod concurrent;
pub mod counting;
pub mod model;
pub mod rng;
pub mod sim;
pub mod workload;
