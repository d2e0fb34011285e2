//! etcd's leases: the replicated lease state, the leader's lessor that decides expiry, and the
//! `Lease` gRPC service.
//!
//! Replicated state (in the state machine's store, so in every snapshot and across restarts):
//! - `leases`: lease id (8 bytes, big-endian) → TTL in seconds (i64, little-endian), the TTL
//!   already raised to the minimum by the member that proposed the grant;
//! - `lease_keys`: lease id (8 bytes, big-endian) ++ key → empty, one row per key attached to
//!   the lease, written by the same request that puts or deletes the key (`mvcc::Writer`).
//!
//! Invariants:
//! - A key's record names lease `L` (not 0) exactly when `lease_keys` has the row `L ++ key`,
//!   and `L` is then in `leases`: a put naming an unknown lease fails and writes nothing; a
//!   revoke deletes every attached key and the lease in one request.
//! - Apply is deterministic: grants carry their id and final TTL in the log entry; nothing
//!   applied depends on a clock. Expiry is decided only by the leader's [`Lessor`], which
//!   proposes a revoke; every member applies that revoke like a client's.
//! - Deadlines exist only on the leader. On becoming leader every lease's deadline is set to
//!   now + election timeout + TTL (etcd's promote), so a failover never shortens a lease; a
//!   follower keeps none and forwards keep-alives and time-to-live questions to the leader.
//! - Remaining TTLs are not persisted (no checkpoints): after a leader change a lease's
//!   remaining time starts again at its full TTL (plus the election timeout).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::proto::{
    PbDeleteRequest, PbLeaseGrantRequest, PbLeaseGrantResponse, PbLeaseKeepAliveRequest, PbLeaseKeepAliveResponse,
    PbLeaseLeasesRequest, PbLeaseLeasesResponse, PbLeaseRevokeRequest, PbLeaseRevokeResponse, PbLeaseService,
    PbLeaseStatus, PbLeaseTimeToLiveRequest, PbLeaseTimeToLiveResponse, PbResponseHeader,
};
use futures_util::StreamExt;
use openraft::async_runtime::WatchReceiver;
use openraft::{EntryPayload, ReadPolicy, ServerState};
use parking_lot::Mutex;
use prost::Message;
use serde::{Deserialize, Serialize};
use tonic::{Request as GrpcRequest, Response as GrpcResponse, Status};

use crate::etcd_api::{apply_status, node_status, Api};
use crate::mvcc::{Overlay, Writer};
use crate::network::{PeerRequest, PeerResponse};
use crate::node::{Node, NodeError};
use crate::types::{ApplyError, Entry, RequestKind, Response};

/// Table of leases: id → TTL.
pub const LEASES: &str = "leases";
/// Table of attached keys: id ++ key → empty.
pub const LEASE_KEYS: &str = "lease_keys";
/// etcd's `MaxLeaseTTL`, in seconds.
pub const MAX_TTL_SECS: i64 = 9_000_000_000;
/// etcd's default lease revoke rate: at most this many expiry revokes proposed per second.
const REVOKES_PER_SEC: u64 = 1000;
/// How long the leader waits before proposing the revoke of an expired lease again (etcd's
/// `expiredLeaseRetryInterval`), in case the first proposal was lost.
const REVOKE_RETRY: Duration = Duration::from_secs(3);

pub(crate) fn id_key(id: i64) -> [u8; 8] {
    (id as u64).to_be_bytes()
}

pub(crate) fn index_key(id: i64, key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + key.len());
    out.extend_from_slice(&id_key(id));
    out.extend_from_slice(key);
    out
}

/// A lease's row in `leases`.
pub(crate) fn encode_ttl(ttl: i64) -> Vec<u8> {
    ttl.to_le_bytes().to_vec()
}

fn decode_ttl(bytes: &[u8]) -> Result<i64, ApplyError> {
    let b: [u8; 8] = bytes.try_into().map_err(|_| ApplyError::Invalid("corrupt lease record".into()))?;
    Ok(i64::from_le_bytes(b))
}

fn decode_id(bytes: &[u8]) -> Option<i64> {
    let b: [u8; 8] = bytes.get(..8)?.try_into().ok()?;
    Some(u64::from_be_bytes(b) as i64)
}

/// The smallest TTL a grant gets, in seconds: etcd's `minLeaseTTL`, 1.5 election timeouts
/// rounded up, so a lease outlives the election that may follow its grant.
pub fn min_ttl_secs(election_timeout: Duration) -> i64 {
    let ms = election_timeout.as_millis() as i64 * 3 / 2;
    ((ms + 999) / 1000).max(1)
}

// ---- apply side (deterministic) ----

/// Whether lease `id` exists as the batch so far leaves the store.
pub fn exists(view: &mut Overlay<'_>, id: i64) -> Result<bool, ApplyError> {
    Ok(view.get_in(LEASES, &id_key(id))?.is_some())
}

/// Moves `key` from lease `old` to lease `new` in the key index (0: none).
pub fn reattach(view: &mut Overlay<'_>, key: &[u8], old: i64, new: i64) {
    if old == new {
        return;
    }
    if old != 0 {
        view.set_in(LEASE_KEYS, index_key(old, key), None);
    }
    if new != 0 {
        view.set_in(LEASE_KEYS, index_key(new, key), Some(Vec::new()));
    }
}

/// Applies a grant: the id is taken or the TTL too large → etcd's error, nothing written.
pub fn grant(
    view: &mut Overlay<'_>,
    req: &PbLeaseGrantRequest,
    revision: i64,
) -> Result<PbLeaseGrantResponse, ApplyError> {
    if req.id == 0 {
        return Err(ApplyError::LeaseNotFound);
    }
    if req.ttl > MAX_TTL_SECS {
        return Err(ApplyError::LeaseTtlTooLarge);
    }
    if exists(view, req.id)? {
        return Err(ApplyError::LeaseExist);
    }
    view.set_in(LEASES, id_key(req.id).to_vec(), Some(encode_ttl(req.ttl)));
    Ok(PbLeaseGrantResponse {
        header: Some(PbResponseHeader { revision, ..Default::default() }),
        id: req.id,
        ttl: req.ttl,
        error: String::new(),
    })
}

/// Applies a revoke: every attached key is deleted by this one request (one revision, in key
/// order, as etcd), then the lease. An unknown lease → `LeaseNotFound`, nothing written.
pub fn revoke(
    w: &mut Writer<'_, '_>,
    req: &PbLeaseRevokeRequest,
    revision: i64,
) -> Result<PbLeaseRevokeResponse, ApplyError> {
    if !exists(w.txn, req.id)? {
        return Err(ApplyError::LeaseNotFound);
    }
    let prefix = id_key(req.id);
    for (row, _) in w.txn.scan_prefix_in(LEASE_KEYS, &prefix)? {
        let key = row.get(8..).unwrap_or_default().to_vec();
        w.delete_range(&PbDeleteRequest { key, ..Default::default() })?;
        w.txn.set_in(LEASE_KEYS, row, None);
    }
    w.txn.set_in(LEASES, prefix.to_vec(), None);
    let revision = if w.wrote { w.revision } else { revision };
    Ok(PbLeaseRevokeResponse { header: Some(PbResponseHeader { revision, ..Default::default() }) })
}

/// Tells the lessor about the grants and revokes a committed batch applied.
pub fn applied(lessor: &Lessor, entries: &[Entry], responses: &[Response]) {
    for (entry, response) in entries.iter().zip(responses) {
        let (EntryPayload::Normal(req), Response::Ok(_)) = (&entry.payload, response) else { continue };
        match req.kind {
            RequestKind::LeaseGrant => {
                if let Ok(g) = PbLeaseGrantRequest::decode(req.body.as_slice()) {
                    lessor.granted(g.id, g.ttl);
                }
            }
            RequestKind::LeaseRevoke => {
                if let Ok(r) = PbLeaseRevokeRequest::decode(req.body.as_slice()) {
                    lessor.revoked(r.id);
                }
            }
            _ => {}
        }
    }
}

/// Every lease in a store snapshot: (id, TTL).
pub fn stored_leases(txn: &keeldb::ReadTxn) -> Result<Vec<(i64, i64)>, ApplyError> {
    let engine = |e: keeldb::Error| ApplyError::Invalid(format!("storage: {e}"));
    let mut out = Vec::new();
    for row in txn.scan(LEASES, keeldb::ScanRange::all()).map_err(engine)? {
        let (k, v) = row.map_err(engine)?;
        if let Some(id) = decode_id(&k) {
            out.push((id, decode_ttl(&v)?));
        }
    }
    Ok(out)
}

/// The keys attached to lease `id` in a store snapshot, in key order.
pub fn stored_keys(txn: &keeldb::ReadTxn, id: i64) -> Result<Vec<Vec<u8>>, ApplyError> {
    let engine = |e: keeldb::Error| ApplyError::Invalid(format!("storage: {e}"));
    let prefix = id_key(id);
    let mut out = Vec::new();
    for row in txn.scan(LEASE_KEYS, keeldb::ScanRange::all().start(prefix.to_vec())).map_err(engine)? {
        let (k, _) = row.map_err(engine)?;
        match k.strip_prefix(&prefix[..]) {
            Some(key) => out.push(key.to_vec()),
            None => break,
        }
    }
    Ok(out)
}

// ---- the leader's lessor ----

struct Held {
    ttl: i64,
    /// When the lease expires (a keep-alive moves it).
    deadline: Instant,
    /// Past the deadline, when its revoke may be proposed again: kept apart from the
    /// deadline, so TimeToLive still reports an expired lease as expired, as etcd does.
    retry_at: Option<Instant>,
}

#[derive(Default)]
struct LessorState {
    /// This member leads and holds deadlines.
    primary: bool,
    /// The term it was promoted in.
    term: u64,
    leases: HashMap<i64, Held>,
}

/// A lease's standing on the leader.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct LeaseStanding {
    /// Whole seconds left (0 once the deadline passed and the revoke is pending).
    pub remaining_secs: i64,
    /// The lease's TTL.
    pub ttl: i64,
    /// Attached keys (when asked for).
    pub keys: Vec<Vec<u8>>,
}

/// Lease deadlines, held only while this member leads; and the ids this member gives grants.
pub struct Lessor {
    state: Mutex<LessorState>,
    next_id: AtomicU64,
    /// Keep-alives queued for the leader (`renew_batches`), set when the member starts.
    renewals: std::sync::OnceLock<tokio::sync::mpsc::UnboundedSender<Renewal>>,
}

impl Default for Lessor {
    fn default() -> Self {
        Lessor::new()
    }
}

impl Lessor {
    pub fn new() -> Lessor {
        // Like etcd's request ids: a clock-seeded counter under the member's prefix, so ids
        // differ between members and between a member's runs.
        let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_millis() as u64);
        Lessor {
            state: Mutex::new(LessorState::default()),
            next_id: AtomicU64::new(ms << 8),
            renewals: std::sync::OnceLock::new(),
        }
    }

    /// A new positive lease id for a grant that named none.
    pub fn choose_id(&self, member_id: u64) -> i64 {
        loop {
            let n = self.next_id.fetch_add(1, Ordering::Relaxed) & ((1 << 48) - 1);
            let id = ((member_id & 0x7fff) << 48) | n;
            if id != 0 {
                return id as i64;
            }
        }
    }

    /// Whether this member holds deadlines (it leads).
    pub fn is_primary(&self) -> bool {
        self.state.lock().primary
    }

    /// Becomes primary for `term`: every lease `load` lists (read while the lessor is locked,
    /// so a grant applied meanwhile is either listed or reported to [`Lessor::granted`] after)
    /// gets the deadline now + `extend` + TTL.
    pub fn promote(&self, term: u64, extend: Duration, load: impl FnOnce() -> Vec<(i64, i64)>) {
        let mut s = self.state.lock();
        s.primary = true;
        s.term = term;
        let now = Instant::now();
        s.leases = load()
            .into_iter()
            .map(|(id, ttl)| (id, Held { ttl, deadline: deadline(now + extend, ttl), retry_at: None }))
            .collect();
    }

    /// Stops holding deadlines (leadership lost).
    pub fn demote(&self) {
        let mut s = self.state.lock();
        s.primary = false;
        s.leases = HashMap::new();
    }

    fn promoted_in(&self) -> Option<u64> {
        let s = self.state.lock();
        s.primary.then_some(s.term)
    }

    /// A grant was applied.
    pub fn granted(&self, id: i64, ttl: i64) {
        let mut s = self.state.lock();
        if s.primary {
            s.leases.entry(id).or_insert(Held { ttl, deadline: deadline(Instant::now(), ttl), retry_at: None });
        }
    }

    /// A revoke was applied.
    pub fn revoked(&self, id: i64) {
        self.state.lock().leases.remove(&id);
    }

    /// Renews lease `id`: `None` if not primary, `Some(0)` if unknown or past its deadline
    /// (its revoke is under way), else its TTL (the deadline is now + TTL).
    pub fn renew(&self, id: i64) -> Option<i64> {
        let mut s = self.state.lock();
        if !s.primary {
            return None;
        }
        let now = Instant::now();
        Some(match s.leases.get_mut(&id) {
            Some(h) if h.deadline > now => {
                h.deadline = deadline(now, h.ttl);
                h.ttl
            }
            _ => 0,
        })
    }

    /// Lease `id`'s remaining time and TTL: `None` if not primary, `Some(None)` if unknown.
    pub fn standing(&self, id: i64) -> Option<Option<(i64, i64)>> {
        let s = self.state.lock();
        if !s.primary {
            return None;
        }
        let now = Instant::now();
        Some(s.leases.get(&id).map(|h| (remaining_secs(h.deadline, now), h.ttl)))
    }

    /// Up to `limit` leases past their deadline; each gets `REVOKE_RETRY` more before it is
    /// listed again (its revoke is proposed by the caller).
    pub fn expired(&self, limit: usize) -> Vec<i64> {
        let mut s = self.state.lock();
        if !s.primary {
            return Vec::new();
        }
        let now = Instant::now();
        let mut out = Vec::new();
        for (id, h) in s.leases.iter_mut() {
            if out.len() >= limit {
                break;
            }
            if h.deadline <= now && h.retry_at.is_none_or(|r| r <= now) {
                h.retry_at = Some(now + REVOKE_RETRY);
                out.push(*id);
            }
        }
        out
    }
}

/// Whole seconds from `now` to `deadline`, truncated toward zero and negative once it has
/// passed (etcd's `int64(Remaining().Seconds())`): an expired lease whose revoke is under way
/// reports 0 or less, never a fresh TTL.
fn remaining_secs(deadline: Instant, now: Instant) -> i64 {
    match deadline.checked_duration_since(now) {
        Some(left) => left.as_secs() as i64,
        None => -(now.duration_since(deadline).as_secs() as i64),
    }
}

fn deadline(from: Instant, ttl: i64) -> Instant {
    // A TTL up to MAX_TTL_SECS (285 years) fits an Instant on the platforms we run on; were it
    // not to, the deadline is capped (136 years, then `from`) rather than panicking.
    let ttl = Duration::from_secs(ttl.max(0) as u64);
    from.checked_add(ttl).or_else(|| from.checked_add(Duration::from_secs(u64::from(u32::MAX)))).unwrap_or(from)
}

/// The leader's expiry loop, one per member: follows leadership (promote / demote) and, while
/// leading, proposes the revoke of each expired lease, at most etcd's rate per second.
pub async fn run(node: Arc<Node>) {
    let (renewals, queue) = tokio::sync::mpsc::unbounded_channel();
    if node.sm.lessor.renewals.set(renewals).is_ok() {
        tokio::spawn(renew_batches(Arc::clone(&node), queue));
    }
    let tick = node.config.heartbeat_interval.clamp(Duration::from_millis(20), Duration::from_millis(500));
    let per_tick = ((REVOKES_PER_SEC * tick.as_millis() as u64) / 1000).max(1) as usize;
    // Server metrics change with state, vote and leader only (not with every applied entry),
    // so a busy member does not wake this loop per write.
    let mut metrics = node.raft.server_metrics();
    let mut next_scan = Instant::now();
    loop {
        let leading = {
            let m = metrics.borrow_watched();
            m.state == ServerState::Leader && m.current_leader == Some(node.id)
        };
        let term = node.term();
        let lessor = &node.sm.lessor;
        match (leading, lessor.promoted_in()) {
            (true, Some(t)) if t == term => {}
            (true, _) => {
                let sm = Arc::clone(&node.sm);
                lessor.promote(term, node.config.election_timeout, move || match sm.db.begin_read() {
                    Ok(txn) => stored_leases(&txn).unwrap_or_else(|e| {
                        eprintln!("keel: cannot read leases: {e}");
                        Vec::new()
                    }),
                    Err(e) => {
                        eprintln!("keel: cannot read leases: {e}");
                        Vec::new()
                    }
                });
            }
            (false, Some(_)) => lessor.demote(),
            (false, None) => {}
        }
        let now = Instant::now();
        let due = if now >= next_scan {
            next_scan = now + tick;
            lessor.expired(per_tick)
        } else {
            Vec::new()
        };
        for id in due {
            let node = Arc::clone(&node);
            tokio::spawn(async move {
                let body = PbLeaseRevokeRequest { id }.encode_to_vec();
                // A lost or failed revoke is proposed again after REVOKE_RETRY.
                let _ = node.write(crate::types::Request::new(RequestKind::LeaseRevoke, body)).await;
            });
        }
        tokio::select! {
            _ = tokio::time::sleep_until(next_scan.into()) => {}
            c = metrics.changed() => if c.is_err() { return },
            _ = node.stopped() => return,
        }
    }
}

// ---- leader-side answers to forwarded requests ----

/// Waits until this member (the leader) has applied everything committed before now.
async fn caught_up(node: &Node) -> Result<(), String> {
    let read = node.raft.ensure_linearizable(ReadPolicy::ReadIndex).await.map_err(|e| format!("etcdserver: {e}"))?;
    let index = read.log_id().index;
    let mut rx = node.sm.applied_tx.subscribe();
    let waited = tokio::time::timeout(node.config.election_timeout * 5, rx.wait_for(|a| *a >= index)).await;
    match waited {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(_)) => Err(NodeError::Stopped.to_string()),
        Err(_) => Err(NodeError::Timeout.to_string()),
    }
}

/// Whether a quorum acknowledged this leader within the last election timeout. openraft has no
/// check-quorum step-down: a leader cut off from the others keeps calling itself leader while
/// the rest elect another, whose deadlines decide. Such a leader must not renew: a lease it
/// renewed could expire on the real leader before the TTL it answered. The majority cannot
/// elect a new leader before an election timeout without this leader's heartbeats, and that
/// leader then gives every lease a full TTL plus an election timeout (LE4), so renewals refused
/// from one election timeout after the last acknowledgement on are always covered.
fn quorum_is_recent(node: &Node) -> bool {
    let metrics = node.raft.metrics();
    let m = metrics.borrow_watched();
    if m.membership_config.membership().voter_ids().count() <= 1 {
        return true;
    }
    m.last_quorum_acked.as_ref().is_some_and(|at| openraft::Instant::elapsed(&**at) < node.config.election_timeout)
}

/// Keep-alives on the leader, answered in order. A lease it does not hold may be a grant it
/// has not applied yet (it just became leader): it catches up once before answering TTL 0.
pub async fn keep_alive_on_leader(node: &Node, ids: &[i64]) -> PeerResponse {
    if !quorum_is_recent(node) {
        // Not (or no longer) a leader the others follow: the caller retries on the leader.
        return PeerResponse::NotLeader(None);
    }
    let lessor = &node.sm.lessor;
    let Some(mut ttls) = ids.iter().map(|id| lessor.renew(*id)).collect::<Option<Vec<i64>>>() else {
        return PeerResponse::NotLeader(None);
    };
    if ttls.iter().all(|t| *t > 0) {
        return PeerResponse::LeaseKeepAlive(ttls);
    }
    if let Err(e) = caught_up(node).await {
        return PeerResponse::Error(e);
    }
    for (id, ttl) in ids.iter().zip(ttls.iter_mut()) {
        if *ttl == 0 {
            match lessor.renew(*id) {
                None => return PeerResponse::NotLeader(None),
                Some(t) => *ttl = t,
            }
        }
    }
    PeerResponse::LeaseKeepAlive(ttls)
}

/// A keep-alive waiting for its batch: the lease id and where its TTL goes.
type Renewal = (i64, tokio::sync::oneshot::Sender<Result<i64, Status>>);

/// Most keep-alives in one batch to the leader.
const RENEWALS_PER_BATCH: usize = 4096;

/// Sends this member's keep-alives to the leader in batches: one peer request carries every
/// keep-alive that arrived while the previous one was in flight, so a follower serving
/// thousands of leases makes a few round trips (and one connection) instead of one each.
async fn renew_batches(node: Arc<Node>, mut queue: tokio::sync::mpsc::UnboundedReceiver<Renewal>) {
    loop {
        // Ends with the member (this task holds the node; the queue's sender lives in it).
        let first = tokio::select! {
            r = queue.recv() => match r { Some(r) => r, None => return },
            _ = node.stopped() => return,
        };
        let mut batch = vec![first];
        while batch.len() < RENEWALS_PER_BATCH {
            match queue.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        let ids: Vec<i64> = batch.iter().map(|r| r.0).collect();
        let answer = match node.to_leader(PeerRequest::LeaseKeepAlive(ids)).await {
            Ok(PeerResponse::LeaseKeepAlive(ttls)) if ttls.len() == batch.len() => Ok(ttls),
            Ok(other) => Err(Status::internal(format!("unexpected answer {other:?}"))),
            Err(e) => Err(node_status(e)),
        };
        match answer {
            Ok(ttls) => batch.into_iter().zip(ttls).for_each(|((_, tx), ttl)| drop(tx.send(Ok(ttl)))),
            Err(e) => batch.into_iter().for_each(|(_, tx)| drop(tx.send(Err(e.clone())))),
        }
    }
}

/// A time-to-live question on the leader, answered once it has applied everything committed.
pub async fn time_to_live_on_leader(node: &Node, id: i64, keys: bool) -> PeerResponse {
    if let Err(e) = caught_up(node).await {
        return PeerResponse::Error(e);
    }
    let (remaining_secs, ttl) = match node.sm.lessor.standing(id) {
        None => return PeerResponse::NotLeader(None),
        Some(None) => return PeerResponse::LeaseTimeToLive(None),
        Some(Some(s)) => s,
    };
    let keys = if keys {
        let found = node
            .sm
            .db
            .begin_read()
            .map_err(|e| e.to_string())
            .and_then(|t| stored_keys(&t, id).map_err(|e| e.to_string()));
        match found {
            Ok(k) => k,
            Err(e) => return PeerResponse::Error(e),
        }
    } else {
        Vec::new()
    };
    PeerResponse::LeaseTimeToLive(Some(LeaseStanding { remaining_secs, ttl, keys }))
}

// ---- the gRPC service ----

type Stream<T> = Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Keep-alives of one stream in flight at once (answered as they complete, as etcd's client
/// matches answers by lease id).
const KEEP_ALIVES_IN_FLIGHT: usize = 64;

impl Api {
    fn lease_header(&self) -> PbResponseHeader {
        self.header(self.node.sm.visible_revision())
    }

    /// etcd's check before showing leases' keys to `user`: the root role (or auth off) may see
    /// everything; anyone else needs read permission on every key attached to `ids`.
    async fn check_lease_keys(
        &self,
        state: &crate::auth::AuthState,
        user: Option<&str>,
        ids: Vec<i64>,
    ) -> Result<(), Status> {
        if !state.enabled || user.is_some_and(|u| state.is_root(u)) {
            return Ok(());
        }
        let sm = Arc::clone(&self.node.sm);
        let keys = tokio::task::spawn_blocking(move || -> Result<Vec<Vec<u8>>, ApplyError> {
            let txn = sm.db.begin_read().map_err(|e| ApplyError::Invalid(e.to_string()))?;
            let mut keys = Vec::new();
            for id in ids {
                keys.extend(stored_keys(&txn, id)?);
            }
            Ok(keys)
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(apply_status)?;
        for key in &keys {
            crate::auth_api::check(state, user, key, &[], crate::auth::Perm::Read)?;
        }
        Ok(())
    }

    async fn renew(&self, id: i64) -> Result<PbLeaseKeepAliveResponse, Status> {
        let queue =
            self.node.sm.lessor.renewals.get().ok_or_else(|| Status::unavailable("etcdserver: server stopped"))?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        queue.send((id, tx)).map_err(|_| Status::unavailable("etcdserver: server stopped"))?;
        let ttl = rx.await.map_err(|_| Status::unavailable("etcdserver: server stopped"))??;
        Ok(PbLeaseKeepAliveResponse { header: Some(self.lease_header()), id, ttl })
    }
}

#[tonic::async_trait]
impl PbLeaseService for Api {
    async fn lease_grant(
        &self,
        request: GrpcRequest<PbLeaseGrantRequest>,
    ) -> Result<GrpcResponse<PbLeaseGrantResponse>, Status> {
        let stamp = self.stamp(request.metadata())?;
        let mut req = request.into_inner();
        if req.ttl > MAX_TTL_SECS {
            return Err(apply_status(ApplyError::LeaseTtlTooLarge));
        }
        req.ttl = req.ttl.max(min_ttl_secs(self.node.config.election_timeout));
        let chosen = req.id == 0;
        // An id this member chose may (rarely) be taken by another member's choice: choose again.
        for _ in 0..8 {
            if chosen {
                req.id = self.node.sm.lessor.choose_id(self.node.id);
            }
            let deadline = self.node.default_deadline();
            match self
                .propose_applied_until::<PbLeaseGrantResponse>(
                    RequestKind::LeaseGrant,
                    req.encode_to_vec(),
                    stamp.clone(),
                    deadline,
                )
                .await?
            {
                Err(ApplyError::LeaseExist) if chosen => continue,
                Err(e) => return Err(apply_status(e)),
                Ok(mut resp) => {
                    self.fill(&mut resp.header);
                    return Ok(GrpcResponse::new(resp));
                }
            }
        }
        Err(apply_status(ApplyError::LeaseExist))
    }

    async fn lease_revoke(
        &self,
        request: GrpcRequest<PbLeaseRevokeRequest>,
    ) -> Result<GrpcResponse<PbLeaseRevokeResponse>, Status> {
        let (state, user) = self.caller(request.metadata())?;
        let req = request.into_inner();
        if state.enabled {
            // etcd: revoking needs write permission on every key attached to the lease.
            let sm = Arc::clone(&self.node.sm);
            let id = req.id;
            let keys = tokio::task::spawn_blocking(move || -> Result<Vec<Vec<u8>>, ApplyError> {
                let txn = sm.db.begin_read().map_err(|e| ApplyError::Invalid(e.to_string()))?;
                stored_keys(&txn, id)
            })
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(apply_status)?;
            for key in &keys {
                crate::auth_api::check(&state, user.as_deref(), key, &[], crate::auth::Perm::Write)?;
            }
        }
        let stamp = crate::auth::AuthStamp { user, revision: state.revision };
        let mut resp: PbLeaseRevokeResponse =
            self.propose(RequestKind::LeaseRevoke, req.encode_to_vec(), stamp).await?;
        self.fill(&mut resp.header);
        Ok(GrpcResponse::new(resp))
    }

    type LeaseKeepAliveStream = Stream<PbLeaseKeepAliveResponse>;

    async fn lease_keep_alive(
        &self,
        request: GrpcRequest<tonic::Streaming<PbLeaseKeepAliveRequest>>,
    ) -> Result<GrpcResponse<Self::LeaseKeepAliveStream>, Status> {
        self.caller(request.metadata())?;
        let api = self.clone();
        let answers = request
            .into_inner()
            .map(move |r| {
                let api = api.clone();
                async move { api.renew(r?.id).await }
            })
            .buffer_unordered(KEEP_ALIVES_IN_FLIGHT);
        Ok(GrpcResponse::new(Box::pin(answers)))
    }

    async fn lease_time_to_live(
        &self,
        request: GrpcRequest<PbLeaseTimeToLiveRequest>,
    ) -> Result<GrpcResponse<PbLeaseTimeToLiveResponse>, Status> {
        let (state, user) = self.caller(request.metadata())?;
        let req = request.into_inner();
        if req.keys {
            // etcd: the keys are shown only to a user who may read every one of them.
            self.check_lease_keys(&state, user.as_deref(), vec![req.id]).await?;
        }
        let ask = PeerRequest::LeaseTimeToLive { id: req.id, keys: req.keys };
        let standing = match self.node.to_leader(ask).await.map_err(node_status)? {
            PeerResponse::LeaseTimeToLive(s) => s,
            other => return Err(Status::internal(format!("unexpected answer {other:?}"))),
        };
        let header = Some(self.lease_header());
        // etcd answers an unknown lease with TTL -1, not an error.
        let resp = match standing {
            None => PbLeaseTimeToLiveResponse { header, id: req.id, ttl: -1, granted_ttl: 0, keys: Vec::new() },
            Some(s) => PbLeaseTimeToLiveResponse {
                header,
                id: req.id,
                ttl: s.remaining_secs,
                granted_ttl: s.ttl,
                keys: s.keys,
            },
        };
        Ok(GrpcResponse::new(resp))
    }

    async fn lease_leases(
        &self,
        request: GrpcRequest<PbLeaseLeasesRequest>,
    ) -> Result<GrpcResponse<PbLeaseLeasesResponse>, Status> {
        let (state, user) = self.caller(request.metadata())?;
        self.node.read_barrier().await.map_err(node_status)?;
        let sm = Arc::clone(&self.node.sm);
        let leases = tokio::task::spawn_blocking(move || -> Result<Vec<(i64, i64)>, ApplyError> {
            let txn = sm.db.begin_read().map_err(|e| ApplyError::Invalid(e.to_string()))?;
            stored_leases(&txn)
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(apply_status)?;
        // etcd: a user who is not root sees the list only if it may read every leased key.
        self.check_lease_keys(&state, user.as_deref(), leases.iter().map(|(id, _)| *id).collect()).await?;
        Ok(GrpcResponse::new(PbLeaseLeasesResponse {
            header: Some(self.lease_header()),
            leases: leases.into_iter().map(|(id, _)| PbLeaseStatus { id }).collect(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn min_ttl_is_one_and_a_half_election_timeouts_rounded_up() {
        assert_eq!(min_ttl_secs(Duration::from_millis(1000)), 2);
        assert_eq!(min_ttl_secs(Duration::from_millis(400)), 1);
        assert_eq!(min_ttl_secs(Duration::from_millis(2000)), 3);
    }

    #[test]
    fn deadlines_exist_only_while_primary_and_promote_extends_every_lease() {
        let l = Lessor::new();
        l.granted(1, 10);
        assert_eq!(l.renew(1), None, "a follower holds no deadlines");
        l.promote(2, Duration::from_secs(1), || vec![(1, 10), (2, 5)]);
        let (left, ttl) = l.standing(1).unwrap().unwrap();
        assert_eq!(ttl, 10);
        assert!(left >= 10, "promote gives TTL + election timeout, got {left}");
        assert_eq!(l.renew(1), Some(10));
        assert_eq!(l.renew(9), Some(0), "an unknown lease renews to TTL 0");
        l.granted(3, 0);
        assert_eq!(l.expired(10), vec![3]);
        assert_eq!(l.expired(10), Vec::<i64>::new(), "a proposed revoke is not proposed again at once");
        assert_eq!(l.renew(3), Some(0), "an expired lease is not renewed");
        let (left, _) = l.standing(3).unwrap().unwrap();
        assert!(left <= 0, "an expired lease whose revoke is under way reports no time left, got {left}");
        assert_eq!(remaining_secs(Instant::now() + Duration::from_millis(1500), Instant::now()), 1);
        let past = Instant::now();
        assert_eq!(remaining_secs(past, past + Duration::from_millis(2500)), -2, "etcd truncates toward zero");
        l.revoked(3);
        assert_eq!(l.standing(3), Some(None));
        // The revoke rate: at most `limit` per call; the rest stay due for the next tick.
        for id in 10..15 {
            l.granted(id, 0);
        }
        let first = l.expired(2);
        assert_eq!(first.len(), 2);
        let rest = l.expired(10);
        assert_eq!(rest.len(), 3);
        assert!(first.iter().all(|id| !rest.contains(id)));
        l.demote();
        assert_eq!(l.standing(1), None);
        let a = l.choose_id(7);
        let b = l.choose_id(7);
        assert!(a > 0 && b > 0 && a != b);
    }
}
