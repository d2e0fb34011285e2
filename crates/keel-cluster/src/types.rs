//! The Raft type configuration, the log entry payload (an etcd write request), the member
//! record every node keeps for every other, and the apply results and auth stamp those carry.
//! The lowest file of the crate: it imports none of the others.

use std::fmt;

use serde::{Deserialize, Serialize};

openraft::declare_raft_types!(
    /// KeelDB's Raft types: u64 member ids, etcd write requests as entries.
    pub TypeConfig:
        D = Request,
        R = Response,
        NodeId = u64,
        Node = Member,
);

/// Shorthands over [`TypeConfig`].
pub type LogId = openraft::alias::LogIdOf<TypeConfig>;
/// A Raft log entry.
pub type Entry = openraft::alias::EntryOf<TypeConfig>;
/// A vote (term and candidate) as Raft persists it.
pub type Vote = openraft::alias::VoteOf<TypeConfig>;
/// Membership as last applied, with the entry that set it.
pub type StoredMembership = openraft::alias::StoredMembershipOf<TypeConfig>;
/// A snapshot's metadata.
pub type SnapshotMeta = openraft::alias::SnapshotMetaOf<TypeConfig>;

/// A cluster member as etcd describes one: its name and the URLs peers and clients use.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct Member {
    /// `--name`.
    pub name: String,
    /// `--initial-advertise-peer-urls` (the first is dialled by peers).
    pub peer_urls: Vec<String>,
    /// `--advertise-client-urls`.
    pub client_urls: Vec<String>,
}

impl fmt::Display for Member {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.name, self.peer_urls.join(","))
    }
}

/// Which etcd write a log entry carries; the body is the request's protobuf encoding, exactly
/// as the client sent it, so the entry replays the same on every member.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    /// `etcdserverpb.PutRequest`.
    Put,
    /// `etcdserverpb.DeleteRangeRequest`.
    DeleteRange,
    /// `etcdserverpb.TxnRequest`.
    Txn,
    /// `etcdserverpb.CompactionRequest`.
    Compact,
    /// A member publishing its name and client URLs (bincode `(u64, Member)`), as etcd
    /// members do after they start; takes no revision.
    Publish,
    /// `etcdserverpb.LeaseGrantRequest` with its id already chosen (never 0) and its TTL
    /// already raised to the minimum by the proposing member, so every member applies the
    /// same lease; takes no revision.
    LeaseGrant,
    /// `etcdserverpb.LeaseRevokeRequest`, from a client or from the leader's expiry; deletes
    /// the lease's keys in one revision (none if it has no keys).
    LeaseRevoke,
    /// A change of users, roles or permissions (bincode `auth::AuthOp`); takes no revision.
    Auth,
    /// A CURP client's command (bincode `curp::Command`: its id and a Put, DeleteRange or Txn):
    /// applied once per id, its result kept so that a retry or a new leader's copy from the
    /// witnesses is answered from the record instead of applied again.
    Curp,
}

/// A log entry's payload: one etcd write request.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// What `body` decodes as.
    pub kind: RequestKind,
    /// The protobuf-encoded request.
    pub body: Vec<u8>,
    /// Who sent it and the auth revision its permissions were checked at (`None`: an internal
    /// request, or one proposed before auth existed).
    #[serde(default)]
    pub auth: Option<AuthStamp>,
}

impl Request {
    /// A request of `kind` with its protobuf body. (Every request is built here, so that fields
    /// added later, such as who sent it, get one default.)
    pub fn new(kind: RequestKind, body: Vec<u8>) -> Request {
        Request { kind, body, auth: None }
    }

    /// A client's request, stamped with who sent it and the auth revision it was checked at.
    pub fn with_auth(kind: RequestKind, body: Vec<u8>, auth: AuthStamp) -> Request {
        Request { auth: Some(auth), ..Request::new(kind, body) }
    }
}

impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}({} bytes)", self.kind, self.body.len())
    }
}

/// What applying an entry produced: the protobuf-encoded etcd response (its header's revision
/// set; cluster, member and term are filled in by the member that answers), or the etcd error
/// the request ends with.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum Response {
    /// The encoded response message of the request's kind.
    Ok(Vec<u8>),
    /// The request failed deterministically on every member (nothing was written).
    Err(ApplyError),
}

/// Deterministic failures of an applied request; each maps to etcd's status and message.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    /// etcd `ErrCompacted`.
    #[error("etcdserver: mvcc: required revision has been compacted")]
    Compacted,
    /// etcd `ErrFutureRev`.
    #[error("etcdserver: mvcc: required revision is a future revision")]
    FutureRevision,
    /// `ignore_value`/`ignore_lease` on a key that does not exist.
    #[error("etcdserver: key not found")]
    KeyNotFound,
    /// etcd `ErrLeaseNotFound`: a put, revoke or keep-alive naming a lease that does not exist.
    #[error("etcdserver: requested lease not found")]
    LeaseNotFound,
    /// A request the API layer should have refused (checked again, so that a bad entry
    /// cannot make members diverge).
    #[error("etcdserver: {0}")]
    Invalid(String),
    /// etcd `ErrLeaseExist`: a grant naming an id that is taken.
    #[error("etcdserver: lease already exists")]
    LeaseExist,
    /// etcd `ErrLeaseTTLTooLarge`: a grant over `lease::MAX_TTL_SECS`.
    #[error("etcdserver: too large lease TTL")]
    LeaseTtlTooLarge,
    /// Refused by authentication or authorization (etcd's auth errors).
    #[error("{0}")]
    Auth(AuthError),
}

/// Who sent a request and the auth revision its permissions were checked at; stamped on every
/// proposed request (see `auth::AuthState::admit`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct AuthStamp {
    pub user: Option<String>,
    pub revision: u64,
}

/// etcd's auth errors, with rpctypes' messages; `AuthError::status` (in `auth.rs`) gives the
/// gRPC codes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("etcdserver: root user does not exist")]
    RootUserNotExist,
    #[error("etcdserver: root user does not have root role")]
    RootRoleNotExist,
    #[error("etcdserver: user name already exists")]
    UserAlreadyExist,
    #[error("etcdserver: user name is empty")]
    UserEmpty,
    #[error("etcdserver: user name not found")]
    UserNotFound,
    #[error("etcdserver: role name already exists")]
    RoleAlreadyExist,
    #[error("etcdserver: role name not found")]
    RoleNotFound,
    #[error("etcdserver: role name is empty")]
    RoleEmpty,
    #[error("etcdserver: authentication failed, invalid user ID or password")]
    AuthFailed,
    #[error("etcdserver: permission not given")]
    PermissionNotGiven,
    #[error("etcdserver: permission denied")]
    PermissionDenied,
    #[error("etcdserver: role is not granted to the user")]
    RoleNotGranted,
    #[error("etcdserver: permission is not granted to the role")]
    PermissionNotGranted,
    #[error("etcdserver: authentication is not enabled")]
    AuthNotEnabled,
    #[error("etcdserver: invalid auth token")]
    InvalidAuthToken,
    #[error("etcdserver: invalid auth management")]
    InvalidAuthMgmt,
    #[error("etcdserver: revision of auth store is old")]
    AuthOldRevision,
}
