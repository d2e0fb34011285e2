//! KeelDB's CURP client and the messages of the `keelcurp.Curp` service that keel members serve
//! beside etcd's API (`keel-cluster/src/curp/` has the server side and the argument).
//!
//! A write goes to the leader (`Propose`) and to every other voter's witness (`Record`) at
//! once; it completes in one round trip when the leader answered speculatively in the client's
//! term and at least superquorum − 1 other witnesses accepted it in that term, else after it
//! has applied. This crate depends on no server code, so the Python package can use it.

use prost::Message;
use serde::{Deserialize, Serialize};

pub mod client;
pub mod etcd;

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

/// The etcd writes a CURP command may carry, with their wire numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `etcdserverpb.PutRequest` (1).
    Put = 1,
    /// `etcdserverpb.DeleteRangeRequest` (2).
    DeleteRange = 2,
    /// `etcdserverpb.TxnRequest` (3).
    Txn = 3,
}

impl Kind {
    /// The kind of wire number `n`.
    pub fn from_number(n: i32) -> Option<Kind> {
        match n {
            1 => Some(Kind::Put),
            2 => Some(Kind::DeleteRange),
            3 => Some(Kind::Txn),
            _ => None,
        }
    }
}

/// The members a superquorum is counted over: f + ⌈f/2⌉ + 1 of n = 2f + 1 (3 of 3, 4 of 5).
pub fn superquorum(n: usize) -> usize {
    let f = n.saturating_sub(1) / 2;
    f + f.div_ceil(2) + 1
}

/// `ProposeRequest` and `RecordRequest`: a command and the term its client believes current.
#[derive(Clone, PartialEq, Message)]
pub struct CommandMsg {
    #[prost(uint64, tag = "1")]
    pub client: u64,
    #[prost(uint64, tag = "2")]
    pub seq: u64,
    #[prost(uint64, tag = "3")]
    pub first_incomplete: u64,
    /// 1 Put, 2 DeleteRange, 3 Txn.
    #[prost(int32, tag = "4")]
    pub kind: i32,
    /// The etcd request's protobuf encoding.
    #[prost(bytes = "vec", tag = "5")]
    pub body: Vec<u8>,
    #[prost(uint64, tag = "6")]
    pub term: u64,
}

/// How a `Propose` was answered.
pub mod status {
    /// Executed speculatively: `result` is the early answer (header revision 0).
    pub const SPECULATIVE: i32 = 0;
    /// Applied: `result` is the final answer (with its revision).
    pub const SYNCED: i32 = 1;
    /// This member does not lead: try `leader` (0: unknown).
    pub const NOT_LEADER: i32 = 2;
}

/// The answer to `Propose`.
#[derive(Clone, PartialEq, Message)]
pub struct ProposeReply {
    #[prost(int32, tag = "1")]
    pub status: i32,
    /// The leader's term.
    #[prost(uint64, tag = "2")]
    pub term: u64,
    #[prost(uint64, tag = "3")]
    pub leader: u64,
    /// The encoded etcd response of the command's kind.
    #[prost(bytes = "vec", tag = "4")]
    pub result: Vec<u8>,
    /// The voting members' ids (the client counts witnesses against them).
    #[prost(uint64, repeated, tag = "5")]
    pub voters: Vec<u64>,
}

/// The answer to `Record`.
#[derive(Clone, PartialEq, Message)]
pub struct RecordReply {
    #[prost(bool, tag = "1")]
    pub accepted: bool,
    /// The witness's fence term.
    #[prost(uint64, tag = "2")]
    pub fence: u64,
    /// The witness's member id.
    #[prost(uint64, tag = "3")]
    pub member: u64,
    /// Why it was refused ("conflict", "fenced", "full").
    #[prost(string, tag = "4")]
    pub refusal: String,
}

/// `WaitSynced`: which command.
#[derive(Clone, PartialEq, Message)]
pub struct WaitSyncedRequest {
    #[prost(uint64, tag = "1")]
    pub client: u64,
    #[prost(uint64, tag = "2")]
    pub seq: u64,
}

/// The applied answer (an etcd error is a gRPC status instead).
#[derive(Clone, PartialEq, Message)]
pub struct SyncedReply {
    #[prost(bytes = "vec", tag = "1")]
    pub result: Vec<u8>,
}

/// The answer to `WeakPut` (the request is a [`CommandMsg`] whose body is a plain
/// `etcdserverpb.PutRequest`; its term is ignored).
#[derive(Clone, PartialEq, Message)]
pub struct WeakPutReply {
    /// The replica that accepted it.
    #[prost(uint64, tag = "1")]
    pub member: u64,
    /// The session's highest sequence number this replica has forwarded and seen applied on
    /// the leader (the session's weak writes up to it are in the log).
    #[prost(uint64, tag = "2")]
    pub applied_through: u64,
}

/// `WeakGet`: a point read at the session's bound replica.
#[derive(Clone, PartialEq, Message)]
pub struct WeakGetRequest {
    #[prost(uint64, tag = "1")]
    pub client: u64,
    #[prost(bytes = "vec", tag = "2")]
    pub key: Vec<u8>,
    /// The replica answers from a state at least this new (the session's monotonic reads).
    #[prost(int64, tag = "3")]
    pub min_revision: i64,
    /// The session's command that must have applied at the replica first (0: none): its
    /// latest strong write, whose fast answer carried no revision (read-your-writes).
    #[prost(uint64, tag = "4")]
    pub after_seq: u64,
}

/// The answer to `WeakGet`.
#[derive(Clone, PartialEq, Message)]
pub struct WeakGetReply {
    #[prost(bool, tag = "1")]
    pub found: bool,
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
    /// The value's revision; 0 when it is the session's own weak write, accepted and not yet
    /// applied here (`pending`).
    #[prost(int64, tag = "3")]
    pub mod_revision: i64,
    #[prost(bool, tag = "4")]
    pub pending: bool,
    /// The replica's revision the read was served at.
    #[prost(int64, tag = "5")]
    pub revision: i64,
    /// As in [`WeakPutReply`].
    #[prost(uint64, tag = "6")]
    pub applied_through: u64,
    #[prost(uint64, tag = "7")]
    pub member: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn superquorums_and_kinds() {
        assert_eq!([1, 3, 5, 7].map(superquorum), [1, 3, 4, 6]);
        assert_eq!(Kind::from_number(2), Some(Kind::DeleteRange));
        assert_eq!(Kind::from_number(0), None);
        assert_eq!(Kind::Txn as i32, 3);
    }
}
