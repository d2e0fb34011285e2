//! The CURP client: a write goes to the leader (`Propose`) and to every other voter's witness
//! (`Record`) at once. It completes on the fast path, in one round trip, when the leader
//! answered speculatively in the client's term and at least superquorum − 1 other witnesses
//! accepted it in that term; otherwise it completes when the command has applied (the leader
//! answers `SYNCED`, or the client asks `WaitSynced`). Every attempt of one write carries the
//! same command id, so retries after timeouts or leader changes apply it at most once.
//!
//! A fast answer is the etcd response with header revision 0: the revision is decided when the
//! command applies; [`Client::synced`] waits for it.
//!
//! Weak (causal) operations go to the session's bound replica ([`Client::bind`]; any member):
//! [`Client::weak_put`] completes when that replica accepts the write, which it then forwards
//! to the leader; the session keeps the write and resends it (to another replica if need be)
//! until it knows it applied. [`Client::weak_get`] reads that replica's applied state, no older
//! than what the session has seen, with the session's own accepted writes over it. A strong
//! write from a session with weak writes not yet known to have applied first waits for them
//! ([`Client::settle`]) and then takes the slow path.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use parking_lot::Mutex;
use prost::Message;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::{Channel, Endpoint};

use crate::etcd::{Ignored, MemberListRequest, MemberListResponse, PutRequest, RangeRequest};

use crate::{
    status, superquorum, CommandId, CommandMsg, Kind, ProposeReply, RecordReply, SyncedReply, WaitSyncedRequest,
    WeakGetReply, WeakGetRequest, WeakPutReply,
};

/// Failures of a CURP write.
#[derive(Debug, thiserror::Error)]
pub enum CurpError {
    /// The cluster refused the request (an etcd error: its status and message).
    #[error("{0}")]
    Refused(tonic::Status),
    /// No answer within the client's timeout; the write may or may not apply (once).
    #[error("keel: CURP write {0} timed out; it may still apply, at most once")]
    Timeout(CommandId),
    /// The endpoints could not be reached or described no members.
    #[error("keel: {0}")]
    Connect(String),
}

/// How a write completed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub id: CommandId,
    /// On the fast path (header revision 0) or after apply (with its revision).
    pub fast: bool,
    /// The etcd response of the request's kind, protobuf-encoded.
    pub result: Vec<u8>,
}

#[derive(Clone)]
struct Member {
    id: u64,
    channel: Channel,
}

/// A weak read's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeakValue {
    /// The value and its revision (0 while it is this session's own write, not yet applied at
    /// the replica: `pending`).
    pub value: Option<(Vec<u8>, i64)>,
    pub pending: bool,
    /// The replica that answered.
    pub member: u64,
}

/// What the session keeps for its weak operations.
#[derive(Default)]
struct WeakSession {
    /// Weak writes accepted and not yet known to have applied, by sequence number.
    pending: std::collections::BTreeMap<u64, CommandMsg>,
    /// The newest revision the session has read at (its reads never go below it).
    min_revision: i64,
    /// The session's last strong write, until a weak read has seen it applied (0: none).
    after_seq: u64,
}

/// A CURP client session (one id; sequence numbers from 1).
pub struct Client {
    members: Vec<Member>,
    client: u64,
    next_seq: AtomicU64,
    /// Sequence numbers sent and not yet answered.
    outstanding: Mutex<BTreeSet<u64>>,
    term: AtomicU64,
    /// Index into `members` of the leader as last known.
    leader: AtomicUsize,
    timeout: Duration,
    fast: AtomicU64,
    slow: AtomicU64,
    /// Emulated distance to every member: half of it is waited before each call and half
    /// after (`with_emulated_rtt`).
    half_rtt: Duration,
    /// Index into `members` of the bound replica (weak operations).
    bound: AtomicUsize,
    weak: Mutex<WeakSession>,
    /// Serialises the session's weak writes (sent in sequence order).
    weak_order: tokio::sync::Mutex<()>,
}

async fn unary<Req: Message + 'static, Resp: Message + Default + 'static>(
    channel: &Channel,
    path: &'static str,
    req: Req,
    timeout: Duration,
) -> Result<Resp, tonic::Status> {
    unary_at(channel, path, req, timeout, Duration::ZERO).await
}

/// One call; `half_rtt` is waited before it is sent and after its answer (emulated distance).
async fn unary_at<Req: Message + 'static, Resp: Message + Default + 'static>(
    channel: &Channel,
    path: &'static str,
    req: Req,
    timeout: Duration,
    half_rtt: Duration,
) -> Result<Resp, tonic::Status> {
    if !half_rtt.is_zero() {
        tokio::time::sleep(half_rtt).await;
    }
    let answer = unary_now(channel, path, req, timeout).await;
    if !half_rtt.is_zero() {
        tokio::time::sleep(half_rtt).await;
    }
    answer
}

async fn unary_now<Req: Message + 'static, Resp: Message + Default + 'static>(
    channel: &Channel,
    path: &'static str,
    req: Req,
    timeout: Duration,
) -> Result<Resp, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    let call = async {
        grpc.ready().await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        grpc.unary(tonic::Request::new(req), PathAndQuery::from_static(path), tonic_prost::ProstCodec::default()).await
    };
    match tokio::time::timeout(timeout, call).await {
        Ok(r) => r.map(tonic::Response::into_inner),
        Err(_) => Err(tonic::Status::deadline_exceeded("keel: no answer in time")),
    }
}

/// Errors worth trying another member or attempt for (the rest are the cluster's answer).
fn retryable(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown | tonic::Code::Cancelled
    )
}

impl Client {
    /// Connects to the cluster behind `endpoints` (client URLs, `http://host:port`): asks
    /// one for the member list and opens a channel to every voter's first client URL.
    pub async fn connect(endpoints: &[String], timeout: Duration) -> Result<Client, CurpError> {
        let mut last = String::from("no endpoints given");
        'endpoints: for url in endpoints {
            let channel = match Endpoint::from_shared(url.clone()) {
                Ok(e) => e.connect_timeout(timeout).connect_lazy(),
                Err(e) => {
                    last = format!("{url}: {e}");
                    continue;
                }
            };
            // A member that has just started publishes its client URLs a moment later: ask
            // again (bounded) until every voter has them, or go on with those that do.
            let deadline = tokio::time::Instant::now() + timeout;
            let list: MemberListResponse = loop {
                let list: MemberListResponse = match unary(
                    &channel,
                    "/etcdserverpb.Cluster/MemberList",
                    MemberListRequest { linearizable: true },
                    timeout,
                )
                .await
                {
                    Ok(l) => l,
                    Err(e) => {
                        last = format!("{url}: {}", e.message());
                        continue 'endpoints;
                    }
                };
                let complete = list.members.iter().filter(|m| !m.is_learner).all(|m| !m.client_urls.is_empty());
                if complete || tokio::time::Instant::now() >= deadline {
                    break list;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            let mut members = Vec::new();
            for m in list.members.iter().filter(|m| !m.is_learner) {
                let Some(u) = m.client_urls.first() else { continue };
                let e = Endpoint::from_shared(u.clone()).map_err(|e| CurpError::Connect(format!("{u}: {e}")))?;
                members.push(Member { id: m.id, channel: e.connect_timeout(timeout).tcp_nodelay(true).connect_lazy() });
            }
            if members.is_empty() {
                last = format!("{url}: the member list names no voter with a client URL");
                continue;
            }
            return Ok(Client::session_over(members, timeout));
        }
        Err(CurpError::Connect(last))
    }

    fn session_over(members: Vec<Member>, timeout: Duration) -> Client {
        Client {
            members,
            client: loop {
                let id: u64 = rand::random();
                if id != 0 {
                    break id;
                }
            },
            next_seq: AtomicU64::new(1),
            outstanding: Mutex::new(BTreeSet::new()),
            term: AtomicU64::new(0),
            leader: AtomicUsize::new(0),
            timeout,
            fast: AtomicU64::new(0),
            slow: AtomicU64::new(0),
            half_rtt: Duration::ZERO,
            bound: AtomicUsize::new(0),
            weak: Mutex::new(WeakSession::default()),
            weak_order: tokio::sync::Mutex::new(()),
        }
    }

    /// A new session (its own id, sequence numbers from 1, no weak state, bound to the first
    /// member, no emulated distance) over this one's connections: many sessions can share one
    /// HTTP/2 connection per member, as etcd clients share theirs.
    pub fn new_session(&self) -> Client {
        Client::session_over(self.members.clone(), self.timeout)
    }

    /// Emulates `rtt` of distance to every member (a benchmark aid: half before each call, half
    /// after its answer, so calls made together overlap as over a real link).
    pub fn with_emulated_rtt(mut self, rtt: Duration) -> Client {
        self.half_rtt = rtt / 2;
        self
    }

    /// Writes completed on the fast path and on the slow path so far.
    pub fn path_counts(&self) -> (u64, u64) {
        (self.fast.load(Ordering::Relaxed), self.slow.load(Ordering::Relaxed))
    }

    /// This session's client id.
    pub fn id(&self) -> u64 {
        self.client
    }

    /// An etcd Put.
    pub async fn put(&self, req: &PutRequest) -> Result<Answer, CurpError> {
        self.execute(Kind::Put, req.encode_to_vec()).await
    }

    /// Runs an etcd write (Put, DeleteRange or Txn, protobuf-encoded) as one CURP command.
    pub async fn execute(&self, kind: Kind, body: Vec<u8>) -> Result<Answer, CurpError> {
        // After weak writes: they apply first, and this one then goes the slow way.
        let slow = !self.weak.lock().pending.is_empty();
        if slow {
            self.settle().await?;
        }
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        self.outstanding.lock().insert(seq);
        let result = self.run(CommandId { client: self.client, seq }, kind, body, slow).await;
        self.outstanding.lock().remove(&seq);
        if result.is_ok() {
            // The session's next weak read waits until it has applied at the replica.
            self.weak.lock().after_seq = seq;
        }
        match &result {
            Ok(a) if a.fast => self.fast.fetch_add(1, Ordering::Relaxed),
            Ok(_) => self.slow.fetch_add(1, Ordering::Relaxed),
            Err(_) => 0,
        };
        result
    }

    /// The lowest sequence number this session still waits on (strong or weak), or `seq`.
    fn first_incomplete(&self, seq: u64) -> u64 {
        let strong = self.outstanding.lock().first().copied().unwrap_or(seq);
        let weak = self.weak.lock().pending.keys().next().copied().unwrap_or(seq);
        strong.min(weak).min(seq)
    }

    async fn run(&self, id: CommandId, kind: Kind, body: Vec<u8>, slow: bool) -> Result<Answer, CurpError> {
        let deadline = tokio::time::Instant::now() + self.timeout * 3;
        let mut last = CurpError::Timeout(id);
        let mut attempt = 0usize;
        while tokio::time::Instant::now() < deadline {
            attempt += 1;
            let first_incomplete = self.first_incomplete(id.seq);
            // Term 0 is never the leader's: no speculation, the answer comes after apply.
            let term = if slow { 0 } else { self.term.load(Ordering::Relaxed) };
            let msg = CommandMsg {
                client: id.client,
                seq: id.seq,
                first_incomplete,
                kind: kind as i32,
                body: body.clone(),
                term,
            };
            let leader_at = self.leader.load(Ordering::Relaxed) % self.members.len();
            let Some(leader) = self.members.get(leader_at) else { return Err(CurpError::Connect("no members".into())) };
            let mut records: FuturesUnordered<_> = self
                .members
                .iter()
                .filter(|m| m.id != leader.id && !slow)
                .map(|m| {
                    let msg = msg.clone();
                    async move {
                        (
                            m.id,
                            unary_at::<_, RecordReply>(
                                &m.channel,
                                "/keelcurp.Curp/Record",
                                msg,
                                self.timeout,
                                self.half_rtt,
                            )
                            .await,
                        )
                    }
                })
                .collect();
            let propose = unary_at::<_, ProposeReply>(
                &leader.channel,
                "/keelcurp.Curp/Propose",
                msg,
                self.timeout,
                self.half_rtt,
            );
            // The witnesses are asked on the same round trip; their answers are gathered while
            // the leader's is awaited.
            let mut accepted = 0usize;
            let mut refused = 0usize;
            tokio::pin!(propose);
            let reply = loop {
                tokio::select! {
                    r = &mut propose => break r,
                    Some((_, rec)) = records.next() => match rec {
                        Ok(r) if r.accepted => accepted += 1,
                        Ok(r) => {
                            self.term.fetch_max(r.fence, Ordering::Relaxed);
                            refused += 1;
                        }
                        Err(_) => refused += 1,
                    },
                }
            };
            let reply = match reply {
                Ok(r) => r,
                Err(s) if retryable(&s) => {
                    self.leader.store(leader_at + 1, Ordering::Relaxed);
                    last = CurpError::Refused(s);
                    backoff(attempt).await;
                    continue;
                }
                Err(s) => return Err(CurpError::Refused(s)),
            };
            self.term.fetch_max(reply.term, Ordering::Relaxed);
            match reply.status {
                status::SYNCED => return Ok(Answer { id, fast: false, result: reply.result }),
                status::NOT_LEADER => {
                    let next = self.members.iter().position(|m| m.id == reply.leader).unwrap_or(leader_at + 1);
                    self.leader.store(next, Ordering::Relaxed);
                    backoff(attempt).await;
                    continue;
                }
                status::SPECULATIVE => {}
                other => return Err(CurpError::Connect(format!("unknown propose status {other}"))),
            }
            // Speculative: fast if a superquorum of pools (the leader's and the witnesses')
            // took it in the leader's term.
            let needed = superquorum(reply.voters.len().max(1)).saturating_sub(1);
            let witnesses = reply.voters.len().saturating_sub(1);
            if reply.term == term && !slow {
                while accepted < needed && accepted + (witnesses - refused.min(witnesses) - accepted) >= needed {
                    // A witness still to answer could make it; wait for it, a little.
                    match tokio::time::timeout(self.timeout, records.next()).await {
                        Ok(Some((_, Ok(r)))) if r.accepted => accepted += 1,
                        Ok(Some((_, Ok(r)))) => {
                            self.term.fetch_max(r.fence, Ordering::Relaxed);
                            refused += 1;
                        }
                        Ok(Some((_, Err(_)))) => refused += 1,
                        Ok(None) | Err(_) => break,
                    }
                }
                if accepted >= needed {
                    return Ok(Answer { id, fast: true, result: reply.result });
                }
            }
            // Slow path: the command is in the leader's log; wait for it to apply.
            match self.wait_synced_at(leader_at, id).await {
                Ok(result) => return Ok(Answer { id, fast: false, result }),
                Err(s) if retryable(&s) => {
                    last = CurpError::Refused(s);
                    continue;
                }
                Err(s) => return Err(CurpError::Refused(s)),
            }
        }
        Err(match last {
            CurpError::Refused(_) => CurpError::Timeout(id),
            other => other,
        })
    }

    async fn wait_synced_at(&self, member: usize, id: CommandId) -> Result<Vec<u8>, tonic::Status> {
        let Some(m) = self.members.get(member % self.members.len().max(1)) else {
            return Err(tonic::Status::unavailable("keel: no members"));
        };
        let req = WaitSyncedRequest { client: id.client, seq: id.seq };
        let r: SyncedReply =
            unary_at(&m.channel, "/keelcurp.Curp/WaitSynced", req, self.timeout, self.half_rtt).await?;
        Ok(r.result)
    }

    /// The applied answer (with its revision) of a command this session sent and has not yet
    /// moved past (the members keep answers until the session's next write says it has them).
    pub async fn synced(&self, id: CommandId) -> Result<Vec<u8>, CurpError> {
        let deadline = tokio::time::Instant::now() + self.timeout * 3;
        let mut at = self.leader.load(Ordering::Relaxed);
        let mut last = CurpError::Timeout(id);
        while tokio::time::Instant::now() < deadline {
            match self.wait_synced_at(at, id).await {
                Ok(r) => return Ok(r),
                Err(s) if retryable(&s) => {
                    at += 1;
                    last = CurpError::Refused(s);
                }
                Err(s) => return Err(CurpError::Refused(s)),
            }
        }
        Err(last)
    }
}

impl Client {
    /// The voting members' ids, in the order [`Client::bind`] counts them.
    pub fn members(&self) -> Vec<u64> {
        self.members.iter().map(|m| m.id).collect()
    }

    /// Binds the session's weak operations to member `index` (modulo the member count): the
    /// nearest replica. By default the first member of the list.
    pub fn bind(&self, index: usize) {
        self.bound.store(index % self.members.len().max(1), Ordering::Relaxed);
    }

    /// Weak writes accepted and not yet known to have applied.
    pub fn weak_pending(&self) -> usize {
        self.weak.lock().pending.len()
    }

    fn bound_member(&self) -> Result<&Member, CurpError> {
        let at = self.bound.load(Ordering::Relaxed) % self.members.len().max(1);
        self.members.get(at).ok_or_else(|| CurpError::Connect("no members".into()))
    }

    /// Moves the session to the next replica and resends its pending weak writes there, in
    /// order, so its reads there see them and that replica forwards what is still unapplied.
    async fn rebind(&self) -> Result<(), tonic::Status> {
        let next = (self.bound.load(Ordering::Relaxed) + 1) % self.members.len().max(1);
        self.bound.store(next, Ordering::Relaxed);
        let Ok(m) = self.bound_member() else { return Err(tonic::Status::unavailable("keel: no members")) };
        let pending: Vec<CommandMsg> = self.weak.lock().pending.values().cloned().collect();
        for msg in pending {
            let r: WeakPutReply =
                unary_at(&m.channel, "/keelcurp.Curp/WeakPut", msg, self.timeout, self.half_rtt).await?;
            self.forget_applied(r.applied_through);
        }
        Ok(())
    }

    fn forget_applied(&self, through: u64) {
        let mut w = self.weak.lock();
        w.pending.retain(|seq, _| *seq > through);
    }

    /// A weak write: a plain etcd Put (no lease), complete when the bound replica accepted it.
    /// Returns its command id; [`Client::synced`] gives its applied answer once it applied.
    pub async fn weak_put(&self, req: &PutRequest) -> Result<CommandId, CurpError> {
        let _order = self.weak_order.lock().await;
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let id = CommandId { client: self.client, seq };
        let msg = CommandMsg {
            client: self.client,
            seq,
            first_incomplete: self.first_incomplete(seq),
            kind: Kind::Put as i32,
            body: req.encode_to_vec(),
            term: 0,
        };
        self.weak.lock().pending.insert(seq, msg.clone());
        let deadline = tokio::time::Instant::now() + self.timeout * 3;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let m = self.bound_member()?;
            let r: Result<WeakPutReply, _> =
                unary_at(&m.channel, "/keelcurp.Curp/WeakPut", msg.clone(), self.timeout, self.half_rtt).await;
            let err = match r {
                Ok(r) => {
                    self.forget_applied(r.applied_through);
                    return Ok(id);
                }
                Err(s) if retryable(&s) || s.code() == tonic::Code::FailedPrecondition => s,
                Err(s) => {
                    self.weak.lock().pending.remove(&seq);
                    return Err(CurpError::Refused(s));
                }
            };
            if tokio::time::Instant::now() >= deadline {
                // Kept: a later call resends it (its fate is unknown until then).
                return Err(CurpError::Refused(err));
            }
            backoff(attempt).await;
            // The new replica gets every pending write, this one included, in order.
            if self.rebind().await.is_ok() {
                return Ok(id);
            }
        }
    }

    /// A weak point read at the bound replica: its applied state no older than anything this
    /// session has read, after the session's last strong write, with the session's own
    /// accepted weak writes over it.
    pub async fn weak_get(&self, key: &[u8]) -> Result<WeakValue, CurpError> {
        let deadline = tokio::time::Instant::now() + self.timeout * 3;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let (min_revision, after_seq) = {
                let w = self.weak.lock();
                (w.min_revision, w.after_seq)
            };
            let req = WeakGetRequest { client: self.client, key: key.to_vec(), min_revision, after_seq };
            let m = self.bound_member()?;
            match unary_at::<_, WeakGetReply>(&m.channel, "/keelcurp.Curp/WeakGet", req, self.timeout, self.half_rtt)
                .await
            {
                Ok(r) => {
                    {
                        let mut w = self.weak.lock();
                        w.min_revision = w.min_revision.max(r.revision);
                        if w.after_seq == after_seq {
                            w.after_seq = 0;
                        }
                        w.pending.retain(|seq, _| *seq > r.applied_through);
                    }
                    return Ok(WeakValue {
                        value: r.found.then_some((r.value, r.mod_revision)),
                        pending: r.pending,
                        member: r.member,
                    });
                }
                Err(s) if retryable(&s) && tokio::time::Instant::now() < deadline => {
                    backoff(attempt).await;
                    let _order = self.weak_order.lock().await;
                    let _ = self.rebind().await;
                }
                Err(s) => return Err(CurpError::Refused(s)),
            }
        }
    }

    /// Waits until every weak write of this session has applied (resending them to another
    /// replica if the bound one does not answer). Errors with the last one's apply error.
    pub async fn settle(&self) -> Result<(), CurpError> {
        let _order = self.weak_order.lock().await;
        let Some(last) = self.weak.lock().pending.keys().next_back().copied() else { return Ok(()) };
        let id = CommandId { client: self.client, seq: last };
        let deadline = tokio::time::Instant::now() + self.timeout * 3;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let at = self.bound.load(Ordering::Relaxed);
            match self.wait_synced_at(at, id).await {
                Ok(_) => {
                    self.forget_applied(last);
                    return Ok(());
                }
                Err(s) if retryable(&s) && tokio::time::Instant::now() < deadline => {
                    backoff(attempt).await;
                    let _ = self.rebind().await;
                }
                Err(s) => {
                    if !retryable(&s) {
                        // Applied (with an error): the log has decided every one of them.
                        self.forget_applied(last);
                    }
                    return Err(CurpError::Refused(s));
                }
            }
        }
    }
}

/// etcd's KV API on one plain gRPC channel to one member: the smallest etcd client there is, for
/// benchmarks that compare it with the CURP client on equal terms.
#[derive(Clone)]
pub struct EtcdKv {
    channel: Channel,
    timeout: Duration,
}

impl EtcdKv {
    /// A lazily connected channel to `url` (`http://host:port`).
    pub fn connect(url: &str, timeout: Duration) -> Result<EtcdKv, CurpError> {
        let e = Endpoint::from_shared(url.to_string()).map_err(|e| CurpError::Connect(format!("{url}: {e}")))?;
        Ok(EtcdKv { channel: e.connect_timeout(timeout).tcp_nodelay(true).connect_lazy(), timeout })
    }

    /// `KV.Put`.
    pub async fn put(&self, req: PutRequest) -> Result<(), tonic::Status> {
        unary::<_, Ignored>(&self.channel, "/etcdserverpb.KV/Put", req, self.timeout).await.map(|_| ())
    }

    /// `KV.Range` of one key, linearizable or serializable.
    pub async fn get(&self, key: Vec<u8>, serializable: bool) -> Result<(), tonic::Status> {
        let req = RangeRequest { key, serializable };
        unary::<_, Ignored>(&self.channel, "/etcdserverpb.KV/Range", req, self.timeout).await.map(|_| ())
    }
}

async fn backoff(attempt: usize) {
    tokio::time::sleep(Duration::from_millis((10 * attempt as u64).min(200))).await;
}
