//! The few etcd v3 messages the client sends or reads, written from etcd's published
//! `rpc.proto` (field numbers as there), so this crate needs no etcd code generation.

use prost::Message;

/// `etcdserverpb.PutRequest`.
#[derive(Clone, PartialEq, Message)]
pub struct PutRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
    #[prost(int64, tag = "3")]
    pub lease: i64,
    #[prost(bool, tag = "4")]
    pub prev_kv: bool,
    #[prost(bool, tag = "5")]
    pub ignore_value: bool,
    #[prost(bool, tag = "6")]
    pub ignore_lease: bool,
}

/// `etcdserverpb.MemberListRequest`.
#[derive(Clone, PartialEq, Message)]
pub struct MemberListRequest {
    #[prost(bool, tag = "1")]
    pub linearizable: bool,
}

/// `etcdserverpb.Member`.
#[derive(Clone, PartialEq, Message)]
pub struct Member {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(string, tag = "2")]
    pub name: String,
    #[prost(string, repeated, tag = "3")]
    pub peer_urls: Vec<String>,
    #[prost(string, repeated, tag = "4")]
    pub client_urls: Vec<String>,
    #[prost(bool, tag = "5")]
    pub is_learner: bool,
}

/// `etcdserverpb.MemberListResponse` (its header is not read).
#[derive(Clone, PartialEq, Message)]
pub struct MemberListResponse {
    #[prost(message, repeated, tag = "2")]
    pub members: Vec<Member>,
}

/// `etcdserverpb.RangeRequest`: the fields a point read needs.
#[derive(Clone, PartialEq, Message)]
pub struct RangeRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bool, tag = "7")]
    pub serializable: bool,
}

/// Any answer whose content is not read (its fields are skipped).
#[derive(Clone, PartialEq, Message)]
pub struct Ignored {}
