//! etcd's v3 gRPC API (KV, Cluster, Maintenance) on a [`Node`]. The Lease service is in
//! `lease.rs`, Watch in `watch.rs`. Every KV request and every admin RPC is checked by
//! `auth_api.rs` first.

use std::pin::Pin;
use std::sync::Arc;

use etcd_client::proto::*;
use openraft::async_runtime::WatchReceiver;
use prost::Message;
use tonic::{Request as GrpcRequest, Response as GrpcResponse, Status};

use crate::auth::AuthStamp;
use crate::auth_api::KvCheck;
use crate::mvcc;
use crate::network::AdminRequest;
use crate::node::{Node, NodeError};
use crate::types::{ApplyError, Member, Request, RequestKind, Response};

/// `Status` response metadata: bytes of history (the change feed) held in memory.
pub const HISTORY_BYTES: &str = "keel-history-bytes";
/// `Status` response metadata: changes held by the change feed.
pub const HISTORY_CHANGES: &str = "keel-history-changes";
/// `Status` response metadata: the compacted revision.
pub const COMPACT_REVISION: &str = "keel-compact-revision";

/// etcd's version string, reported by `Status` (clients check it).
pub const ETCD_VERSION: &str = "3.6.16";

type Stream<T> = Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send + 'static>>;

/// The services, sharing one node.
#[derive(Clone)]
pub struct Api {
    pub node: Arc<Node>,
}

pub(crate) fn node_status(e: NodeError) -> Status {
    match e {
        NodeError::NoLeader
        | NodeError::Timeout
        | NodeError::Stopped
        | NodeError::NotLeader(_)
        | NodeError::LeaderTransferTimeout => Status::unavailable(e.to_string()),
        NodeError::Other(m) => Status::unavailable(m),
        NodeError::Member(e) => e.status(),
    }
}

/// clientv3's `WithRequireLeader` metadata: the request must fail at once on a member without
/// a leader (etcd's `rpctypes.MetadataRequireLeaderKey` and `MetadataHasLeader`).
pub const REQUIRE_LEADER_KEY: &str = "hasleader";
const REQUIRE_LEADER_VALUE: &str = "true";

/// Whether the request asks for a leader (clientv3's `WithRequireLeader`).
pub(crate) fn requires_leader(md: &tonic::metadata::MetadataMap) -> bool {
    md.get(REQUIRE_LEADER_KEY).is_some_and(|v| v.as_bytes() == REQUIRE_LEADER_VALUE.as_bytes())
}

/// etcd's answer to a require-leader request on a member without a (live) leader.
pub(crate) fn no_leader() -> Status {
    node_status(NodeError::NoLeader)
}

/// Refuses a require-leader request while this member has no live leader; every RPC goes
/// through it (a tonic interceptor, `Server::start`).
#[allow(clippy::result_large_err)]
pub fn check_require_leader(node: &Node, md: &tonic::metadata::MetadataMap) -> Result<(), Status> {
    if requires_leader(md) && node.live_leader().is_none() {
        return Err(no_leader());
    }
    Ok(())
}

/// When a request that waits for a leader gives up: a little before the client's gRPC
/// deadline (`grpc-timeout`), so that the client gets `no leader` rather than its own deadline
/// error, or after the member's request timeout when the client set none.
pub(crate) fn request_deadline(node: &Node, md: &tonic::metadata::MetadataMap) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    match md.get("grpc-timeout").and_then(|v| v.to_str().ok()).and_then(parse_grpc_timeout) {
        Some(t) => now + t.saturating_sub((t / 10).min(std::time::Duration::from_millis(100))),
        None => node.default_deadline(),
    }
}

/// A `grpc-timeout` value: at most 8 digits and a unit (H, M, S, m, u, n).
fn parse_grpc_timeout(text: &str) -> Option<std::time::Duration> {
    use std::time::Duration;
    let unit = text.chars().last()?;
    let digits = text.get(..text.len() - unit.len_utf8())?;
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        'H' => Duration::from_secs(n * 3600),
        'M' => Duration::from_secs(n * 60),
        'S' => Duration::from_secs(n),
        'm' => Duration::from_millis(n),
        'u' => Duration::from_micros(n),
        'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

pub(crate) fn apply_status(e: ApplyError) -> Status {
    match e {
        ApplyError::Compacted | ApplyError::FutureRevision => Status::out_of_range(e.to_string()),
        ApplyError::LeaseNotFound => Status::not_found(e.to_string()),
        ApplyError::KeyNotFound | ApplyError::Invalid(_) => Status::invalid_argument(e.to_string()),
        ApplyError::LeaseExist => Status::failed_precondition(e.to_string()),
        ApplyError::LeaseTtlTooLarge => Status::out_of_range(e.to_string()),
        ApplyError::Auth(e) => e.status(),
    }
}

/// The checks the KV service makes before proposing a write of `kind` (for the CURP service,
/// which proposes the same requests): decodable, a key, within the size limit, a valid txn.
pub(crate) fn check_request(node: &Node, kind: RequestKind, body: &[u8]) -> Result<(), Status> {
    if body.len() > node.config.max_request_bytes {
        return Err(Status::invalid_argument("etcdserver: request is too large"));
    }
    let bad = |e: prost::DecodeError| Status::invalid_argument(format!("keel: undecodable request: {e}"));
    let no_key = || Status::invalid_argument("etcdserver: key is not provided");
    match kind {
        RequestKind::Put => {
            if PbPutRequest::decode(body).map_err(bad)?.key.is_empty() {
                return Err(no_key());
            }
        }
        RequestKind::DeleteRange => {
            if PbDeleteRequest::decode(body).map_err(bad)?.key.is_empty() {
                return Err(no_key());
            }
        }
        RequestKind::Txn => mvcc::check_txn(&PbTxnRequest::decode(body).map_err(bad)?).map_err(apply_status)?,
        other => return Err(Status::invalid_argument(format!("keel: {other:?} is not a KV write"))),
    }
    Ok(())
}

impl Api {
    pub(crate) fn header(&self, revision: i64) -> PbResponseHeader {
        PbResponseHeader {
            cluster_id: self.node.cluster_id,
            member_id: self.node.id,
            revision,
            raft_term: self.node.term(),
        }
    }

    pub(crate) fn fill(&self, h: &mut Option<PbResponseHeader>) {
        let rev = h.as_ref().map_or(0, |h| h.revision);
        *h = Some(self.header(rev));
    }

    fn check_size(&self, len: usize) -> Result<(), Status> {
        if len > self.node.config.max_request_bytes {
            return Err(Status::invalid_argument("etcdserver: request is too large"));
        }
        Ok(())
    }

    pub(crate) async fn propose<T: Message + Default>(
        &self,
        kind: RequestKind,
        body: Vec<u8>,
        auth: AuthStamp,
    ) -> Result<T, Status> {
        self.propose_until(kind, body, auth, self.node.default_deadline()).await
    }

    /// [`Api::propose`], waiting for a leader at most until `deadline`.
    pub(crate) async fn propose_until<T: Message + Default>(
        &self,
        kind: RequestKind,
        body: Vec<u8>,
        auth: AuthStamp,
        deadline: tokio::time::Instant,
    ) -> Result<T, Status> {
        self.propose_applied_until(kind, body, auth, deadline).await?.map_err(apply_status)
    }

    /// [`Api::propose_until`] with the apply result kept typed: `Ok(Err(e))` when the request
    /// was applied and refused (a caller that handles one of them matches the type, never the
    /// message of the status it becomes).
    pub(crate) async fn propose_applied_until<T: Message + Default>(
        &self,
        kind: RequestKind,
        body: Vec<u8>,
        auth: AuthStamp,
        deadline: tokio::time::Instant,
    ) -> Result<Result<T, ApplyError>, Status> {
        self.check_size(body.len())?;
        let req = Request::with_auth(kind, body, auth);
        match self.node.write_until(req, deadline).await.map_err(node_status)? {
            Response::Ok(bytes) => T::decode(bytes.as_slice()).map(Ok).map_err(|e| Status::internal(e.to_string())),
            Response::Err(e) => Ok(Err(e)),
        }
    }

    fn fill_txn(&self, resp: &mut PbTxnResponse) {
        self.fill(&mut resp.header);
        for op in &mut resp.responses {
            match op.response.as_mut() {
                Some(PbTxnOpResponse::ResponseRange(r)) => self.fill(&mut r.header),
                Some(PbTxnOpResponse::ResponsePut(r)) => self.fill(&mut r.header),
                Some(PbTxnOpResponse::ResponseDeleteRange(r)) => self.fill(&mut r.header),
                Some(PbTxnOpResponse::ResponseTxn(t)) => self.fill_txn(t),
                None => {}
            }
        }
    }

    async fn range_inner(
        &self,
        req: &PbRangeRequest,
        deadline: tokio::time::Instant,
    ) -> Result<PbRangeResponse, Status> {
        if req.key.is_empty() {
            return Err(Status::invalid_argument("etcdserver: key is not provided"));
        }
        if !(0..=2).contains(&req.sort_order) || !(0..=4).contains(&req.sort_target) {
            return Err(Status::invalid_argument("etcdserver: invalid sort option"));
        }
        if !req.serializable {
            self.node.read_barrier_until(deadline).await.map_err(node_status)?;
        }
        let sm = Arc::clone(&self.node.sm);
        let req = req.clone();
        let mut resp = read_off_runtime(req.range_end.is_empty(), move || {
            let (mut txn, current) = sm.read_at(req.revision)?;
            mvcc::range(&mut txn, &req, current)
        })
        .await?
        .map_err(apply_status)?;
        self.fill(&mut resp.header);
        Ok(resp)
    }

    /// The members as this member has appended them: a configuration entry counts from when
    /// it is in the log, as an etcd configuration change counts from when it applies (which,
    /// committed under the previous configuration, it does at once).
    fn members(&self) -> Vec<PbMember> {
        self.members_of(self.node.appended_members())
    }

    /// `members` (id, member, voter) as etcd lists them, with the names and client URLs the
    /// members published.
    fn members_of(&self, members: Vec<(u64, Member, bool)>) -> Vec<PbMember> {
        let published = self.node.sm.published_members();
        members
            .into_iter()
            .map(|(id, m, voter)| {
                let attrs = published.get(&id).cloned().unwrap_or(Member { client_urls: Vec::new(), ..m.clone() });
                PbMember {
                    id,
                    // etcd lists a member that has not started yet with an empty name.
                    name: attrs.name.clone(),
                    peer_ur_ls: m.peer_urls.clone(),
                    client_ur_ls: attrs.client_urls.clone(),
                    is_learner: !voter,
                }
            })
            .collect()
    }
}

#[tonic::async_trait]
impl PbKvService for Api {
    async fn range(&self, request: GrpcRequest<PbRangeRequest>) -> Result<GrpcResponse<PbRangeResponse>, Status> {
        self.authorize_kv(request.metadata(), KvCheck::Range(request.get_ref()))?;
        let deadline = request_deadline(&self.node, request.metadata());
        Ok(GrpcResponse::new(self.range_inner(request.get_ref(), deadline).await?))
    }

    type RangeStreamStream = Stream<PbRangeStreamResponse>;

    async fn range_stream(
        &self,
        _request: GrpcRequest<PbRangeRequest>,
    ) -> Result<GrpcResponse<Self::RangeStreamStream>, Status> {
        Err(Status::unimplemented("keel: RangeStream is not implemented; use Range"))
    }

    async fn put(&self, request: GrpcRequest<PbPutRequest>) -> Result<GrpcResponse<PbPutResponse>, Status> {
        let auth = self.authorize_kv(request.metadata(), KvCheck::Put(request.get_ref()))?;
        let deadline = request_deadline(&self.node, request.metadata());
        let req = request.into_inner();
        if req.key.is_empty() {
            return Err(Status::invalid_argument("etcdserver: key is not provided"));
        }
        let mut resp: PbPutResponse = self.propose_until(RequestKind::Put, req.encode_to_vec(), auth, deadline).await?;
        self.fill(&mut resp.header);
        Ok(GrpcResponse::new(resp))
    }

    async fn delete_range(
        &self,
        request: GrpcRequest<PbDeleteRequest>,
    ) -> Result<GrpcResponse<PbDeleteResponse>, Status> {
        let auth = self.authorize_kv(request.metadata(), KvCheck::Delete(request.get_ref()))?;
        let deadline = request_deadline(&self.node, request.metadata());
        let req = request.into_inner();
        if req.key.is_empty() {
            return Err(Status::invalid_argument("etcdserver: key is not provided"));
        }
        let mut resp: PbDeleteResponse =
            self.propose_until(RequestKind::DeleteRange, req.encode_to_vec(), auth, deadline).await?;
        self.fill(&mut resp.header);
        Ok(GrpcResponse::new(resp))
    }

    async fn txn(&self, request: GrpcRequest<PbTxnRequest>) -> Result<GrpcResponse<PbTxnResponse>, Status> {
        let auth = self.authorize_kv(request.metadata(), KvCheck::Txn(request.get_ref()))?;
        let deadline = request_deadline(&self.node, request.metadata());
        let req = request.into_inner();
        mvcc::check_txn(&req).map_err(apply_status)?;
        let writes = has_writes(&req.success) || has_writes(&req.failure);
        let mut resp: PbTxnResponse = if writes {
            self.propose_until(RequestKind::Txn, req.encode_to_vec(), auth, deadline).await?
        } else {
            // A read-only txn is served like a linearizable range: no log entry.
            self.node.read_barrier_until(deadline).await.map_err(node_status)?;
            let sm = Arc::clone(&self.node.sm);
            tokio::task::spawn_blocking(move || -> Result<PbTxnResponse, ApplyError> {
                let (mut snapshot, current) = sm.read_now()?;
                let mut view = mvcc::Overlay::new(&mut snapshot);
                mvcc::Writer { txn: &mut view, revision: current, wrote: false }.txn(&req)
            })
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(apply_status)?
        };
        self.fill_txn(&mut resp);
        Ok(GrpcResponse::new(resp))
    }

    async fn compact(
        &self,
        request: GrpcRequest<PbCompactionRequest>,
    ) -> Result<GrpcResponse<PbCompactionResponse>, Status> {
        let auth = self.require_root(request.metadata())?;
        let deadline = request_deadline(&self.node, request.metadata());
        let req = request.into_inner();
        let mut resp: PbCompactionResponse =
            self.propose_until(RequestKind::Compact, req.encode_to_vec(), auth, deadline).await?;
        self.fill(&mut resp.header);
        Ok(GrpcResponse::new(resp))
    }
}

/// Runs a read of the state. One key (`point`) is read on the calling task: a lookup in the
/// in-memory index, about a microsecond, where a hand-off to the blocking pool costs a thread
/// wake and a switch each way (the larger part of a serializable get's server CPU when every
/// read went there). A read that may scan goes to the blocking pool, so a long range does not
/// hold a runtime worker.
pub(crate) async fn read_off_runtime<T: Send + 'static>(
    point: bool,
    read: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Status> {
    if point {
        return Ok(read());
    }
    tokio::task::spawn_blocking(read).await.map_err(|e| Status::internal(e.to_string()))
}

fn has_writes(ops: &[PbTxnRequestOp]) -> bool {
    ops.iter().any(|op| match &op.request {
        Some(PbTxnOpRequest::RequestPut(_)) | Some(PbTxnOpRequest::RequestDeleteRange(_)) => true,
        Some(PbTxnOpRequest::RequestTxn(t)) => has_writes(&t.success) || has_writes(&t.failure),
        _ => false,
    })
}

#[tonic::async_trait]
impl PbClusterService for Api {
    async fn member_add(
        &self,
        request: GrpcRequest<PbMemberAddRequest>,
    ) -> Result<GrpcResponse<PbMemberAddResponse>, Status> {
        self.require_root(request.metadata())?;
        let req = request.into_inner();
        check_peer_urls(&req.peer_ur_ls)?;
        // etcd names the member later (when it starts); the id comes from its URLs here.
        // etcd's id for an added member: its URLs, the token and the time of the add.
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let id = crate::config::member_id(&req.peer_ur_ls, &self.node.config.initial_cluster_token, Some(now));
        let member = Member { name: String::new(), peer_urls: req.peer_ur_ls.clone(), client_urls: Vec::new() };
        let after = self
            .node
            .admin(AdminRequest::AddMember { id, member, learner: req.is_learner })
            .await
            .map_err(node_status)?;
        let members = self.members_of(after);
        // The leader's list has the member it added; the answer names it in any case (etcdctl
        // reads it).
        let added = members.iter().find(|m| m.id == id).cloned().unwrap_or(PbMember {
            id,
            name: String::new(),
            peer_ur_ls: req.peer_ur_ls,
            client_ur_ls: Vec::new(),
            is_learner: req.is_learner,
        });
        Ok(GrpcResponse::new(PbMemberAddResponse { header: Some(self.header(0)), member: Some(added), members }))
    }

    async fn member_remove(
        &self,
        request: GrpcRequest<PbMemberRemoveRequest>,
    ) -> Result<GrpcResponse<PbMemberRemoveResponse>, Status> {
        self.require_root(request.metadata())?;
        let id = request.into_inner().id;
        let after = self.node.admin(AdminRequest::RemoveMember { id }).await.map_err(node_status)?;
        Ok(GrpcResponse::new(PbMemberRemoveResponse { header: Some(self.header(0)), members: self.members_of(after) }))
    }

    async fn member_update(
        &self,
        request: GrpcRequest<PbMemberUpdateRequest>,
    ) -> Result<GrpcResponse<PbMemberUpdateResponse>, Status> {
        self.require_root(request.metadata())?;
        let req = request.into_inner();
        check_peer_urls(&req.peer_ur_ls)?;
        let after = self
            .node
            .admin(AdminRequest::UpdateMember { id: req.id, peer_urls: req.peer_ur_ls })
            .await
            .map_err(node_status)?;
        Ok(GrpcResponse::new(PbMemberUpdateResponse { header: Some(self.header(0)), members: self.members_of(after) }))
    }

    async fn member_list(
        &self,
        request: GrpcRequest<PbMemberListRequest>,
    ) -> Result<GrpcResponse<PbMemberListResponse>, Status> {
        // etcd: any authenticated user while auth is on (requireAuthInfo).
        self.caller(request.metadata())?;
        // etcdctl 3.6 asks for a linearizable list by default: after a read barrier, as etcd.
        if request.get_ref().linearizable {
            self.node.read_barrier().await.map_err(node_status)?;
        }
        Ok(GrpcResponse::new(PbMemberListResponse { header: Some(self.header(0)), members: self.members() }))
    }

    async fn member_promote(
        &self,
        request: GrpcRequest<PbMemberPromoteRequest>,
    ) -> Result<GrpcResponse<PbMemberPromoteResponse>, Status> {
        self.require_root(request.metadata())?;
        let id = request.into_inner().id;
        let after = self.node.admin(AdminRequest::PromoteMember { id }).await.map_err(node_status)?;
        Ok(GrpcResponse::new(PbMemberPromoteResponse { header: Some(self.header(0)), members: self.members_of(after) }))
    }
}

/// etcd's check of the peer URLs of a member add (made of an update too): at least one, each
/// `scheme://host:port`.
fn check_peer_urls(urls: &[String]) -> Result<(), Status> {
    if urls.is_empty() || urls.iter().any(|u| crate::config::check_url("peerURLs", u).is_err()) {
        return Err(Status::invalid_argument("etcdserver: given member URLs are invalid"));
    }
    Ok(())
}

#[tonic::async_trait]
impl PbMaintenanceService for Api {
    async fn alarm(&self, request: GrpcRequest<PbAlarmRequest>) -> Result<GrpcResponse<PbAlarmResponse>, Status> {
        // etcd: listing alarms needs any authenticated user, changing them the root role.
        if request.get_ref().action == 0 {
            self.caller(request.metadata())?;
        } else {
            self.require_root(request.metadata())?;
        }
        // No alarms are raised yet (no space quota): the list is always empty.
        Ok(GrpcResponse::new(PbAlarmResponse { header: Some(self.header(0)), alarms: Vec::new() }))
    }

    async fn status(&self, request: GrpcRequest<PbStatusRequest>) -> Result<GrpcResponse<PbStatusResponse>, Status> {
        // etcd: any authenticated user while auth is on (requireAuthInfo).
        self.caller(request.metadata())?;
        let metrics = self.node.raft.metrics().borrow_watched().clone();
        let stats = self.node.sm.db.stats();
        let revision = self.node.sm.visible_revision();
        let is_learner = self.node.members().iter().any(|(i, _, voter)| *i == self.node.id && !voter);
        // The live leader: a leader cut off from its quorum (or a follower from its leader)
        // for an election timeout reports none, as etcd's does after CheckQuorum steps it down.
        let leader = self.node.live_leader();
        let mut errors = Vec::new();
        if leader.is_none() {
            errors.push(NodeError::NoLeader.to_string());
        }
        let db_size = (stats.wal_bytes + stats.checkpoint_bytes) as i64;
        let mut resp = GrpcResponse::new(PbStatusResponse {
            header: Some(self.header(revision)),
            version: ETCD_VERSION.into(),
            db_size,
            leader: leader.unwrap_or(0),
            raft_index: metrics.last_log_index.unwrap_or(0),
            raft_term: metrics.current_term,
            raft_applied_index: self.node.sm.applied_index(),
            errors,
            db_size_in_use: db_size,
            is_learner,
            ..Default::default()
        });
        // What history costs this member, for `keel cluster status` (etcd clients ignore
        // metadata they do not know).
        let compacted = self.node.sm.progress.lock().compact_revision;
        let md = resp.metadata_mut();
        md.insert(HISTORY_BYTES, stats.history_bytes.into());
        md.insert(HISTORY_CHANGES, stats.history_changes.into());
        md.insert(COMPACT_REVISION, compacted.into());
        Ok(resp)
    }

    async fn defragment(
        &self,
        request: GrpcRequest<PbDefragmentRequest>,
    ) -> Result<GrpcResponse<PbDefragmentResponse>, Status> {
        self.require_root(request.metadata())?;
        // Nothing to defragment: checkpoints rewrite the store compactly.
        Ok(GrpcResponse::new(PbDefragmentResponse { header: Some(self.header(0)) }))
    }

    async fn hash(&self, request: GrpcRequest<PbHashRequest>) -> Result<GrpcResponse<PbHashResponse>, Status> {
        self.require_root(request.metadata())?;
        let d = self.node.sm.db.digest();
        Ok(GrpcResponse::new(PbHashResponse { header: Some(self.header(0)), hash: fold_digest(&format!("{d:?}")) }))
    }

    async fn hash_kv(&self, request: GrpcRequest<PbHashKvRequest>) -> Result<GrpcResponse<PbHashKvResponse>, Status> {
        self.require_root(request.metadata())?;
        let rev = request.into_inner().revision;
        let sm = Arc::clone(&self.node.sm);
        let (hash, at, compact) = tokio::task::spawn_blocking(move || -> Result<(u32, i64, i64), ApplyError> {
            let (mut txn, current) = sm.read_at(rev)?;
            let at = if rev > 0 { rev } else { current };
            let compact = sm.progress.lock().compact_revision;
            let all = mvcc::KeySpan::new(b"\0", b"\0").read(&mut txn)?;
            let mut h = Fold::new();
            for (k, r) in all.iter().filter(|(_, r)| r.mod_revision <= at) {
                h.update(k);
                h.update(&r.encode());
            }
            Ok((h.finish(), at, compact))
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(apply_status)?;
        Ok(GrpcResponse::new(PbHashKvResponse {
            header: Some(self.header(at)),
            hash,
            compact_revision: compact,
            hash_revision: at,
        }))
    }

    type SnapshotStream = Stream<PbSnapshotResponse>;

    async fn snapshot(
        &self,
        request: GrpcRequest<PbSnapshotRequest>,
    ) -> Result<GrpcResponse<Self::SnapshotStream>, Status> {
        self.require_root(request.metadata())?;
        // One consistent checkpoint of this member's state (as of its last applied entry),
        // exported off the runtime into a temporary file, then streamed from it in 64 KiB
        // pieces, hashed on the way (the backup layout is in `backup.rs`); the file is removed
        // when the stream ends or the client goes. `keel snapshot restore` turns the stream
        // into the data directory of a new cluster.
        //
        // It first waits, as a linearizable read does, until this member has applied every
        // write acknowledged before the request arrived, so a backup taken through a follower
        // holds the writes its caller just made. A member that cannot reach a leader still
        // exports what it has (a backup is most needed when the cluster is broken), and says so.
        if let Err(e) = self.node.read_barrier().await {
            eprintln!(
                "keel: snapshot on member {:x} exported without a read barrier ({e}): it may miss the newest writes",
                self.node.id
            );
        }
        // The state as etcd's own snapshot file: a bbolt database in etcd's schema (what
        // `etcdutl snapshot status/restore` read, and what `keel snapshot-restore` takes from
        // either system), written to a temporary file from one engine view, then streamed in
        // 64 KiB pieces with its SHA-256 as the last piece, as etcd sends it.
        let sm = std::sync::Arc::clone(&self.node.sm);
        let dir =
            if self.node.config.data_dir.is_dir() { self.node.config.data_dir.clone() } else { std::env::temp_dir() };
        let path = dir.join(format!("keel-backup-{:x}-{}.db.tmp", self.node.id, rand::random::<u64>()));
        let file_path = path.clone();
        let exported = tokio::task::spawn_blocking(move || -> Result<(std::fs::File, u64), String> {
            let (txn, _) = sm.read_now().map_err(|e| e.to_string())?;
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&file_path)
                .map_err(|e| format!("{}: {e}", file_path.display()))?;
            let (file, len) = crate::etcd_snapshot::export_to(&txn, file).map_err(|e| e.to_string())?;
            Ok((file, len))
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
        // The file is gone from the directory at once; the open handle keeps its bytes.
        let _ = std::fs::remove_file(&path);
        let (file, len) = exported.map_err(|e| Status::internal(format!("keel: snapshot export failed: {e}")))?;
        let header = self.header(0);
        const CHUNK: usize = 64 * 1024;
        const HASH_LEN: u64 = 32;
        let total = len + HASH_LEN;
        let message = move |sent: u64, blob: Vec<u8>| PbSnapshotResponse {
            header: Some(header),
            remaining_bytes: total - sent,
            blob,
            version: ETCD_VERSION.to_string(),
        };
        let file = std::sync::Arc::new(file);
        // (offset, the hash so far: None once the hash is sent).
        let start = (0u64, Some(<sha2::Sha256 as sha2::Digest>::new()));
        let stream = futures_util::stream::unfold(start, move |(at, hasher)| {
            let file = std::sync::Arc::clone(&file);
            async move {
                let mut hasher = hasher?;
                if at < len {
                    let want = CHUNK.min((len - at) as usize);
                    let piece = tokio::task::spawn_blocking(move || {
                        let mut buf = vec![0u8; want];
                        std::os::unix::fs::FileExt::read_exact_at(file.as_ref(), &mut buf, at).map(|()| buf)
                    })
                    .await;
                    let piece = match piece {
                        Ok(Ok(p)) => p,
                        Ok(Err(e)) => {
                            return Some((
                                Err(Status::internal(format!("keel: snapshot read failed: {e}"))),
                                (at, None),
                            ))
                        }
                        Err(e) => return Some((Err(Status::internal(e.to_string())), (at, None))),
                    };
                    sha2::Digest::update(&mut hasher, &piece);
                    let at = at + piece.len() as u64;
                    return Some((Ok(message(at, piece)), (at, Some(hasher))));
                }
                let hash = sha2::Digest::finalize(hasher).to_vec();
                Some((Ok(message(total, hash)), (at, None)))
            }
        });
        Ok(GrpcResponse::new(Box::pin(stream)))
    }

    async fn move_leader(
        &self,
        request: GrpcRequest<PbMoveLeaderRequest>,
    ) -> Result<GrpcResponse<PbMoveLeaderResponse>, Status> {
        self.require_root(request.metadata())?;
        let deadline = request_deadline(&self.node, request.metadata());
        let target = request.into_inner().target_id;
        // etcd's errors: only the leader moves leadership, and only to a voting member.
        if self.node.leader() != Some(self.node.id) {
            return Err(Status::failed_precondition(NodeError::NotLeader(None).to_string()));
        }
        if !self.node.members().iter().any(|(i, _, voter)| *i == target && *voter) {
            return Err(Status::failed_precondition("etcdserver: bad leader transferee"));
        }
        if target != self.node.id {
            // Answered once the target leads, as etcd's MoveLeader is.
            match self.node.transfer_leadership(target, deadline).await {
                Ok(new) if new == target => {}
                Ok(_) | Err(NodeError::NoLeader) | Err(NodeError::LeaderTransferTimeout) => {
                    return Err(node_status(NodeError::LeaderTransferTimeout))
                }
                Err(e) => return Err(node_status(e)),
            }
        }
        Ok(GrpcResponse::new(PbMoveLeaderResponse { header: Some(self.header(0)) }))
    }

    async fn downgrade(
        &self,
        _request: GrpcRequest<PbDowngradeRequest>,
    ) -> Result<GrpcResponse<PbDowngradeResponse>, Status> {
        Err(Status::unimplemented("keel: Downgrade does not apply"))
    }
}

/// FNV-1a folded to 32 bits (etcd's hashes are 32-bit).
fn fold_digest(s: &str) -> u32 {
    let mut h = Fold::new();
    h.update(s.as_bytes());
    h.finish()
}

struct Fold(u64);

impl Fold {
    fn new() -> Fold {
        Fold(0xcbf2_9ce4_8422_2325)
    }

    fn update(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn finish(&self) -> u32 {
        (self.0 ^ (self.0 >> 32)) as u32
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::parse_grpc_timeout;

    #[test]
    fn grpc_timeouts_parse_as_the_grpc_spec_says_and_bad_ones_are_ignored() {
        assert_eq!(parse_grpc_timeout("1000m"), Some(Duration::from_secs(1)));
        assert_eq!(parse_grpc_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse_grpc_timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse_grpc_timeout("99999999H"), Some(Duration::from_secs(99_999_999 * 3600)));
        assert_eq!(parse_grpc_timeout("250u"), Some(Duration::from_micros(250)));
        assert_eq!(parse_grpc_timeout("7n"), Some(Duration::from_nanos(7)));
        for bad in ["", "m", "123456789m", "12x", "-1S", "1.5S", "1é", "é"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad:?}");
        }
    }
}
