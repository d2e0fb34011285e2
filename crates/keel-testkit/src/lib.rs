//! Test support for KeelDB: file systems that count or fail operations behind the engine's
//! file-system seam, and a reference model. Never a dependency of the engine itself.

pub mod counting;
