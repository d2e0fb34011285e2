//! CURP (NSDI'19) on openraft: a client sends a write to the leader and records it with a
//! witness on every other member at once; when the leader's speculative answer and a
//! superquorum of witnesses (f + ⌈f/2⌉ + 1 of the 2f + 1 pools, the leader's own included)
//! accept it in the same term, the write is durable against any minority failure after one
//! round trip, and completes without waiting for commit. Otherwise it completes after commit
//! (the slow path). `docs/design/replication.md` (section C) argues each case.
//!
//! - [`witness`]: the per-member pools of unsynced commands.
//! - [`recovery`]: which pooled commands a new leader must propose again, and in what order.
//! - [`front`]: the leader's single ordering point (speculative order is log order).
//! - [`service`]: the `keelcurp.Curp` gRPC service beside etcd's.
//! - [`client`]: the Rust client with the fast path.

use serde::{Deserialize, Serialize};


/// A command's identity: the client session that sent it and its sequence number there.
/// Applying a command records its result under this id, so a retry (or a witness's copy
/// proposed again by a new leader) is answered from the record and never applied twice.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CommandId {
    /// Chosen at random by the client session (never 0).
    pub client: u64,
    /// 1, 2, 3, ... per session.
    pub seq: u64,
}

impl std::fmt::Display for CommandId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:x}#{}", self.client, self.seq)
    }
}
