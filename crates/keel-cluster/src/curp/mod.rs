//! CURP (NSDI'19) on openraft: a client sends a write to the leader and records it with a
//! witness on every other member at once; when the leader's speculative answer and a
//! superquorum of witnesses (f + ⌈f/2⌉ + 1 of the 2f + 1 pools, the leader's own included)
//! accept it in the same term, the write is durable against any minority failure after one
//! round trip, and completes without waiting for commit. Otherwise it completes after commit
//! (the slow path). `docs/design/replication.md` (section C) argues each case.
//!
//! - [`witness`]: the per-member pools of unsynced commands.
//! - [`journal`]: where a witness keeps its pool and fence across a crash.
//! - [`recovery`]: which pooled commands a new leader must propose again, and in what order.
//! - [`front`]: the leader's single ordering point (speculative order is log order).
//! - [`service`]: the `keelcurp.Curp` gRPC service beside etcd's.
//! - [`weak`]: weak (causal) writes and reads at a session's bound replica.
//! - [`client`]: the Rust client with the fast path (crate `keel-curp`).

use serde::{Deserialize, Serialize};

use crate::types::{Request, RequestKind};

pub mod front;
pub mod journal;
pub mod recovery;
pub mod service;
pub mod takeover;
pub mod weak;
pub mod witness;

/// The client (`keel-curp`, a crate of its own so the Python package can use it).
pub use keel_curp::client;
/// A command's identity (client session, sequence number): see `keel_curp::CommandId`.
pub use keel_curp::CommandId;

/// What a CURP log entry carries (the body of a [`RequestKind::Curp`] request).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Command {
    pub id: CommandId,
    /// The client's lowest sequence number still waiting for its answer: the results of its
    /// commands below it are forgotten when this command applies, and a command below it is
    /// refused (the client has its answer; a late copy must not apply).
    pub first_incomplete: u64,
    /// Put, DeleteRange or Txn.
    pub kind: RequestKind,
    /// The etcd request's protobuf encoding.
    pub body: Vec<u8>,
}

impl Command {
    /// The log request carrying this command.
    pub fn to_request(&self) -> Result<Request, bincode::Error> {
        Ok(Request::new(RequestKind::Curp, bincode::serialize(self)?))
    }

    /// The command a [`RequestKind::Curp`] request carries.
    pub fn from_request(req: &Request) -> Option<Command> {
        if req.kind != RequestKind::Curp {
            return None;
        }
        bincode::deserialize(&req.body).ok()
    }
}

/// The dedup table: client (big-endian) ++ seq (big-endian) → bincode [`Response`] of the
/// command as it applied.
pub const DEDUP: &str = "curp_dedup";
/// Per client (big-endian): the `first_incomplete` last applied (bincode u64); commands
/// below it are refused.
pub const CLIENTS: &str = "curp_clients";

/// The dedup table's key of `id`.
pub fn dedup_key(id: CommandId) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[..8].copy_from_slice(&id.client.to_be_bytes());
    k[8..].copy_from_slice(&id.seq.to_be_bytes());
    k
}
