//! etcd's `v3lockpb.Lock` service, and what it shares with the Election service
//! (`election_api.rs`): the client-side concurrency recipes of etcd (`Mutex`, `waitDeletes`)
//! run inside the member, as etcd runs them on an in-process client.
//!
//! Every write and read goes through the member's own KV and Lease services ([`Api`]) with the
//! caller's metadata, so auth is checked on the lock's keys exactly as for the same calls made
//! by a client, and a lock is a txn, a range and a delete like any other. Waiting uses the
//! member's watch hub: a waiter wakes only when the key ahead of it changes, then looks again.
//!
//! Errors are etcd's as its server sends them: etcd's in-process client turns every server
//! error into a value gRPC cannot map, so a Lock or Election call fails with code `Unknown` and
//! the server error's text; the recipes' own errors (`mutex: session is expired`, ...) too.
//!
//! What it must not do: write anything except through [`Api`], or wait by polling.
//!
//! The service is written against tonic's server plumbing because etcd-client does not export
//! the Lock and Election request messages or server traits; the requests are declared here
//! with etcd's field numbers.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use etcd_client::proto::*;
use prost::Message;
use tokio::sync::mpsc;
use tonic::codegen::{http, Body, BoxFuture, Context, Poll, Service, StdError};
use tonic::metadata::MetadataMap;
use tonic::{Request as GrpcRequest, Response as GrpcResponse, Status};

use crate::etcd_api::Api;
use crate::watch::{Delivery, Hub, Join, Span, Target};

/// etcd's `defaultSessionTTL`: a Lock or Campaign naming no lease gets one of this many
/// seconds, which nobody keeps alive (etcd orphans the session it creates).
pub const SESSION_TTL_SECS: i64 = 60;

/// Deliveries a wait's hub stream holds; more mark its watcher lost, and it looks again.
const WAIT_INBOX: usize = 4;

// etcd's enum values (etcd-client does not export these enums).
const SORT_ASCEND: i32 = 1;
const SORT_DESCEND: i32 = 2;
const SORT_BY_CREATE: i32 = 2;
const COMPARE_EQUAL: i32 = 0;

/// etcd's `LockRequest` (not exported by etcd-client).
#[derive(Clone, PartialEq, Message)]
pub struct LockRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub name: Vec<u8>,
    #[prost(int64, tag = "2")]
    pub lease: i64,
}

/// etcd's `UnlockRequest` (not exported by etcd-client).
#[derive(Clone, PartialEq, Message)]
pub struct UnlockRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
}

/// The errors of etcd's concurrency recipes, with etcd's texts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConcurrencyError {
    /// The lock's key went (its lease expired or was revoked) while the Lock waited.
    #[error("mutex: session is expired")]
    SessionExpired,
    #[error("election: not leader")]
    NotLeader,
    #[error("election: no leader")]
    NoLeader,
    /// Proclaim or Resign without a leader key.
    #[error("\"leader\" field must be provided")]
    MissingLeaderKey,
    /// The member's watch hub stopped (the member is stopping) while a call waited.
    #[error("etcdserver: server stopped")]
    Stopped,
}

impl ConcurrencyError {
    /// As etcd sends it: a Go error gRPC does not know, so `Unknown`.
    pub fn status(&self) -> Status {
        Status::unknown(self.to_string())
    }
}

/// A server error as etcd's Lock and Election services send it: etcd's in-process client
/// turns it into an `EtcdError`, which gRPC sends as `Unknown` with the same text.
pub(crate) fn relayed(s: Status) -> Status {
    Status::unknown(s.message().to_string())
}

/// etcd's `clientv3.GetPrefixRangeEnd`: the end of the range of keys starting with `prefix`.
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// `prefix` followed by the lease in Go's `%x` (a negative id keeps its sign, as in Go).
pub(crate) fn session_key(prefix: &[u8], lease: i64) -> Vec<u8> {
    let hex = if lease < 0 { format!("-{:x}", lease.unsigned_abs()) } else { format!("{lease:x}") };
    [prefix, hex.as_bytes()].concat()
}

/// A txn comparing `key`'s create revision with `rev`.
pub(crate) fn created_at(key: &[u8], rev: i64) -> PbCompare {
    PbCompare {
        result: COMPARE_EQUAL,
        target: PbCompareTarget::Create as i32,
        key: key.to_vec(),
        range_end: Vec::new(),
        target_union: Some(PbTargetUnion::CreateRevision(rev)),
    }
}

pub(crate) fn op_put(key: &[u8], value: &[u8], lease: i64) -> PbTxnRequestOp {
    PbTxnRequestOp {
        request: Some(PbTxnOpRequest::RequestPut(PbPutRequest {
            key: key.to_vec(),
            value: value.to_vec(),
            lease,
            ..Default::default()
        })),
    }
}

pub(crate) fn op_get(req: PbRangeRequest) -> PbTxnRequestOp {
    PbTxnRequestOp { request: Some(PbTxnOpRequest::RequestRange(req)) }
}

pub(crate) fn op_delete(key: &[u8]) -> PbTxnRequestOp {
    PbTxnRequestOp {
        request: Some(PbTxnOpRequest::RequestDeleteRange(PbDeleteRequest { key: key.to_vec(), ..Default::default() })),
    }
}

pub(crate) fn get_key(key: &[u8]) -> PbRangeRequest {
    PbRangeRequest { key: key.to_vec(), ..Default::default() }
}

/// etcd's `WithFirstCreate`: the key under `prefix` created first.
pub(crate) fn get_first_created(prefix: &[u8]) -> PbRangeRequest {
    PbRangeRequest {
        key: prefix.to_vec(),
        range_end: prefix_end(prefix),
        limit: 1,
        sort_order: SORT_ASCEND,
        sort_target: SORT_BY_CREATE,
        ..Default::default()
    }
}

/// The `i`th op response of a txn as a range response.
pub(crate) fn range_of(resp: &PbTxnResponse, i: usize) -> Option<&PbRangeResponse> {
    match resp.responses.get(i).and_then(|r| r.response.as_ref()) {
        Some(PbTxnOpResponse::ResponseRange(r)) => Some(r),
        _ => None,
    }
}

pub(crate) fn malformed() -> Status {
    Status::internal("keel: a concurrency txn answered without its range response")
}

/// What the Lock and Election services share: the member's API and its watch hub.
#[derive(Clone)]
pub struct Concurrency {
    pub(crate) api: Api,
    pub(crate) hub: Arc<Hub>,
}

fn with_metadata<T>(md: &MetadataMap, message: T) -> GrpcRequest<T> {
    GrpcRequest::from_parts(md.clone(), tonic::Extensions::default(), message)
}

impl Concurrency {
    pub fn new(api: Api, hub: Arc<Hub>) -> Concurrency {
        Concurrency { api, hub }
    }

    /// The largest request message accepted, as the KV service's.
    pub(crate) fn max_request_bytes(&self) -> usize {
        self.api.node.config.max_request_bytes + 64 * 1024
    }

    pub(crate) async fn txn(&self, md: &MetadataMap, req: PbTxnRequest) -> Result<PbTxnResponse, Status> {
        let r = PbKvService::txn(&self.api, with_metadata(md, req)).await.map_err(relayed)?;
        Ok(r.into_inner())
    }

    /// A linearizable read, checked as the caller's.
    pub(crate) async fn get(&self, md: &MetadataMap, req: PbRangeRequest) -> Result<PbRangeResponse, Status> {
        let r = PbKvService::range(&self.api, with_metadata(md, req)).await.map_err(relayed)?;
        Ok(r.into_inner())
    }

    pub(crate) async fn delete(&self, md: &MetadataMap, key: &[u8]) -> Result<PbDeleteResponse, Status> {
        let req = PbDeleteRequest { key: key.to_vec(), ..Default::default() };
        let r = PbKvService::delete_range(&self.api, with_metadata(md, req)).await.map_err(relayed)?;
        Ok(r.into_inner())
    }

    /// etcd's session lease: the caller's, or for 0 a new lease of [`SESSION_TTL_SECS`].
    pub(crate) async fn session_lease(&self, md: &MetadataMap, lease: i64) -> Result<i64, Status> {
        if lease != 0 {
            return Ok(lease);
        }
        let req = PbLeaseGrantRequest { ttl: SESSION_TTL_SECS, id: 0 };
        let r = PbLeaseService::lease_grant(&self.api, with_metadata(md, req)).await.map_err(relayed)?;
        Ok(r.into_inner().id)
    }

    /// etcd's `waitDeletes`: returns once no key under `prefix` has a create revision of at
    /// most `max_create_rev`. It waits for the newest such key to go, then asks again, so a
    /// waiter wakes when the one ahead of it leaves, not on every release.
    pub(crate) async fn wait_deletes(
        &self,
        md: &MetadataMap,
        prefix: &[u8],
        max_create_rev: i64,
    ) -> Result<(), Status> {
        loop {
            let req = PbRangeRequest {
                key: prefix.to_vec(),
                range_end: prefix_end(prefix),
                limit: 1,
                sort_order: SORT_DESCEND,
                sort_target: SORT_BY_CREATE,
                max_create_revision: max_create_rev,
                ..Default::default()
            };
            let resp = self.get(md, req).await?;
            let Some(ahead) = resp.kvs.first() else { return Ok(()) };
            self.wait_gone(&ahead.key, ahead.create_revision).await?;
        }
    }

    /// Waits until `key` no longer holds the version created at `create_rev` in this member's
    /// state. The watch joins the hub before the first look, so a delete after it wakes us.
    async fn wait_gone(&self, key: &[u8], create_rev: i64) -> Result<(), Status> {
        let Some(span) = Span::new(key, &[]) else { return Ok(()) };
        let mut watch = HubWatch::open(&self.hub, vec![(span, true)])?;
        loop {
            if self.local_create_revision(key)? != Some(create_rev) {
                return Ok(());
            }
            watch.wake().await?;
        }
    }

    fn local_create_revision(&self, key: &[u8]) -> Result<Option<i64>, Status> {
        let (mut txn, current) = self.api.node.sm.read_at(0).map_err(crate::etcd_api::apply_status)?;
        let got = crate::mvcc::range(&mut txn, &get_key(key), current).map_err(crate::etcd_api::apply_status)?;
        Ok(got.kvs.first().map(|kv| kv.create_revision))
    }

    /// etcd's `Mutex.Lock` on an orphaned session (`v3lock.Lock`).
    async fn lock(&self, request: GrpcRequest<LockRequest>) -> Result<GrpcResponse<PbLockResponse>, Status> {
        let md = request.metadata().clone();
        let req = request.into_inner();
        let lease = self.session_lease(&md, req.lease).await?;
        let prefix = [req.name.as_slice(), b"/"].concat();
        let key = session_key(&prefix, lease);
        // Put ourselves in line (or find our key from an earlier Lock with this lease) and
        // learn the holder in the same txn, so an uncontended lock takes one proposal.
        let acquire = PbTxnRequest {
            compare: vec![created_at(&key, 0)],
            success: vec![op_put(&key, b"", lease), op_get(get_first_created(&prefix))],
            failure: vec![op_get(get_key(&key)), op_get(get_first_created(&prefix))],
        };
        let resp = self.txn(&md, acquire).await?;
        let my_rev = if resp.succeeded {
            resp.header.as_ref().map_or(0, |h| h.revision)
        } else {
            range_of(&resp, 0).and_then(|r| r.kvs.first()).ok_or_else(malformed)?.create_revision
        };
        let owner = range_of(&resp, 1).ok_or_else(malformed)?.kvs.first();
        if owner.is_none_or(|o| o.create_revision == my_rev) {
            return Ok(GrpcResponse::new(PbLockResponse { header: resp.header, key }));
        }
        // etcd removes the key of a waiter whose wait fails or whose client goes away.
        let mut cleanup = Cleanup::new(self.clone(), md.clone(), Undo::Delete(key.clone()));
        if let Err(e) = self.wait_deletes(&md, &prefix, my_rev - 1).await {
            cleanup.run().await;
            return Err(e);
        }
        let got = match self.get(&md, get_key(&key)).await {
            Ok(got) => got,
            Err(e) => {
                cleanup.run().await;
                return Err(e);
            }
        };
        cleanup.disarm();
        if got.kvs.is_empty() {
            return Err(ConcurrencyError::SessionExpired.status());
        }
        Ok(GrpcResponse::new(PbLockResponse { header: got.header, key }))
    }

    async fn unlock(&self, request: GrpcRequest<UnlockRequest>) -> Result<GrpcResponse<PbUnlockResponse>, Status> {
        let md = request.metadata().clone();
        let resp = self.delete(&md, &request.into_inner().key).await?;
        Ok(GrpcResponse::new(PbUnlockResponse { header: resp.header }))
    }
}

/// What a call undoes if its client goes away while it waits.
pub(crate) enum Undo {
    /// Lock: delete the waiter's key.
    Delete(Vec<u8>),
    /// Campaign: resign (delete the key if it still has this create revision).
    Resign(Vec<u8>, i64),
}

/// Runs its [`Undo`] unless disarmed: at once through [`Cleanup::run`], or in a task of its own
/// when dropped armed (the handler's future was dropped because the client went away). The
/// undo is checked with the caller's credentials.
pub(crate) struct Cleanup {
    service: Concurrency,
    md: MetadataMap,
    undo: Option<Undo>,
}

impl Cleanup {
    pub(crate) fn new(service: Concurrency, md: MetadataMap, undo: Undo) -> Cleanup {
        Cleanup { service, md, undo: Some(undo) }
    }

    pub(crate) fn disarm(&mut self) {
        self.undo = None;
    }

    pub(crate) async fn run(&mut self) {
        if let Some(undo) = self.undo.take() {
            undo_now(&self.service, &self.md, undo).await;
        }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let Some(undo) = self.undo.take() else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let service = self.service.clone();
        let md = std::mem::take(&mut self.md);
        runtime.spawn(async move { undo_now(&service, &md, undo).await });
    }
}

/// The undo's outcome is not reported: like etcd, a failed undo leaves the key to its lease.
pub(crate) async fn undo_now(service: &Concurrency, md: &MetadataMap, undo: Undo) {
    match undo {
        Undo::Delete(key) => {
            let _ = service.delete(md, &key).await;
        }
        Undo::Resign(key, rev) => {
            let req =
                PbTxnRequest { compare: vec![created_at(&key, rev)], success: vec![op_delete(&key)], failure: vec![] };
            let _ = service.txn(md, req).await;
        }
    }
}

/// Why a [`HubWatch`] woke.
pub(crate) enum Wake {
    /// Events on the watched keys.
    Events(Delivery),
    /// The hub dropped deliveries for us (we were slow): look at the state again.
    Lost,
}

/// One wait's watchers on the member's hub, in a hub stream of its own (closed when dropped).
/// Each watcher is joined at the hub's next revision, so every change committed after
/// [`HubWatch::open`] (or a [`Wake::Lost`]) reaches it: a waiter opens it, then reads.
pub(crate) struct HubWatch {
    hub: Arc<Hub>,
    stream: u64,
    inbox: mpsc::Receiver<Delivery>,
    victims: Arc<crate::watch::Victims>,
    /// Token (the index) → (keys, no_put).
    spans: Vec<(Arc<Span>, bool)>,
}

impl HubWatch {
    pub(crate) fn open(hub: &Arc<Hub>, spans: Vec<(Span, bool)>) -> Result<HubWatch, Status> {
        let (stream, inbox, victims) = hub.open_stream(WAIT_INBOX).ok_or_else(|| ConcurrencyError::Stopped.status())?;
        let watch = HubWatch {
            hub: Arc::clone(hub),
            stream,
            inbox,
            victims,
            spans: spans.into_iter().map(|(s, no_put)| (Arc::new(s), no_put)).collect(),
        };
        for token in 0..watch.spans.len() {
            watch.join(token);
        }
        Ok(watch)
    }

    /// Joins watcher `token` just past what the hub has dispatched. The hub only refuses a
    /// join it has already dispatched past, so each retry starts after its newer revision.
    fn join(&self, token: usize) {
        let Some((span, no_put)) = self.spans.get(token) else { return };
        let mut next_rev = self.hub.dispatched() + 1;
        loop {
            let target = Target {
                stream: self.stream,
                token: token as u64,
                next_rev,
                no_put: *no_put,
                no_delete: false,
                span: Arc::clone(span),
            };
            match self.hub.join(target) {
                Join::Joined => return,
                Join::Behind(rev) => next_rev = rev + 1,
            }
        }
    }

    /// The next delivery, or [`Wake::Lost`] (the dropped watchers joined again first).
    pub(crate) async fn wake(&mut self) -> Result<Wake, Status> {
        tokio::select! {
            d = self.inbox.recv() => d.map(Wake::Events).ok_or_else(|| ConcurrencyError::Stopped.status()),
            _ = self.victims.notify.notified() => {
                let lost: Vec<(u64, i64)> = std::mem::take(&mut *self.victims.list.lock());
                for (token, _) in lost {
                    self.join(token as usize);
                }
                Ok(Wake::Lost)
            }
        }
    }
}

impl Drop for HubWatch {
    fn drop(&mut self) {
        self.hub.close_stream(self.stream);
    }
}

/// The `v3lockpb.Lock` gRPC service.
#[derive(Clone)]
pub struct LockServer {
    service: Concurrency,
}

impl LockServer {
    pub fn new(api: Api, hub: Arc<Hub>) -> LockServer {
        LockServer { service: Concurrency::new(api, hub) }
    }
}

impl tonic::server::NamedService for LockServer {
    const NAME: &'static str = "v3lockpb.Lock";
}

pub(crate) type Reply<T> = Pin<Box<dyn Future<Output = Result<GrpcResponse<T>, Status>> + Send>>;

/// One call's handler, taken once.
pub(crate) struct Handler<F>(Option<F>);

impl<Req, Resp, F> tonic::server::UnaryService<Req> for Handler<F>
where
    F: FnOnce(GrpcRequest<Req>) -> Reply<Resp>,
    Resp: Send + 'static,
{
    type Response = Resp;
    type Future = Reply<Resp>;

    fn call(&mut self, request: GrpcRequest<Req>) -> Self::Future {
        match self.0.take() {
            Some(f) => f(request),
            None => Box::pin(async { Err(Status::internal("keel: handler called twice")) }),
        }
    }
}

/// Serves one unary call of `Req` with `f`; a request over `max_bytes` is refused by gRPC.
pub(crate) fn unary<B, Req, Resp, F>(
    req: http::Request<B>,
    max_bytes: usize,
    f: F,
) -> BoxFuture<http::Response<tonic::body::Body>, Infallible>
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
    Req: Message + Default + Send + 'static,
    Resp: Message + Send + 'static,
    F: FnOnce(GrpcRequest<Req>) -> Reply<Resp> + Send + 'static,
{
    Box::pin(async move {
        let codec = tonic_prost::ProstCodec::<Resp, Req>::default();
        let mut grpc = tonic::server::Grpc::new(codec).max_decoding_message_size(max_bytes);
        Ok(grpc.unary(Handler(Some(f)), req).await)
    })
}

/// The answer to a method this service does not have.
pub(crate) fn unimplemented() -> BoxFuture<http::Response<tonic::body::Body>, Infallible> {
    Box::pin(async move {
        let mut response = http::Response::new(tonic::body::Body::default());
        let headers = response.headers_mut();
        headers.insert(Status::GRPC_STATUS, (tonic::Code::Unimplemented as i32).into());
        headers.insert(http::header::CONTENT_TYPE, tonic::metadata::GRPC_CONTENT_TYPE);
        Ok(response)
    })
}

impl<B> Service<http::Request<B>> for LockServer
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let s = self.service.clone();
        let max = s.max_request_bytes();
        match req.uri().path() {
            "/v3lockpb.Lock/Lock" => unary(req, max, move |r| -> Reply<_> { Box::pin(async move { s.lock(r).await }) }),
            "/v3lockpb.Lock/Unlock" => {
                unary(req, max, move |r| -> Reply<_> { Box::pin(async move { s.unlock(r).await }) })
            }
            _ => unimplemented(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::mvcc::{Record, KV, META, REV_KEY};
    use crate::state_machine::StateMachine;
    use std::time::Duration;

    fn commit(sm: &crate::state_machine::Shared, rev: i64, key: &[u8]) {
        let mut t = sm.db.begin_write().unwrap();
        let r = Record { create_revision: rev, mod_revision: rev, version: 1, lease: 0, value: b"v".to_vec() };
        t.put(KV, key, &r.encode()).unwrap();
        t.put(META, REV_KEY, &bincode::serialize(&rev).unwrap()).unwrap();
        t.commit().unwrap();
    }

    async fn wake(watch: &mut HubWatch) -> Wake {
        tokio::time::timeout(Duration::from_secs(10), watch.wake()).await.expect("no wake in 10 s").unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_watch_the_hub_dropped_is_told_and_joins_again() {
        let dir = tempfile::tempdir().unwrap();
        let sm = StateMachine::open(dir.path(), Arc::new(keeldb::fs::StdFs)).unwrap().shared;
        let (_stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let hub = Hub::start(Arc::clone(&sm), stop_rx);
        let mut watch = HubWatch::open(&hub, vec![(Span::new(b"k", &[]).unwrap(), false)]).unwrap();
        // More deliveries than the inbox holds, none taken: the hub drops the watcher.
        let mut rev = 1;
        for _ in 0..WAIT_INBOX + 2 {
            rev += 1;
            commit(&sm, rev, b"k");
            for _ in 0..2000 {
                if hub.dispatched() == rev {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        let mut lost = false;
        for _ in 0..=WAIT_INBOX {
            if let Wake::Lost = wake(&mut watch).await {
                lost = true;
                break;
            }
        }
        assert!(lost, "the dropped watcher was not told");
        while let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(50), watch.inbox.recv()).await {}
        // Joined again: the next change reaches it.
        commit(&sm, rev + 1, b"k");
        match wake(&mut watch).await {
            Wake::Events(d) => assert_eq!(d.revision, rev + 1),
            Wake::Lost => panic!("lost again"),
        }
        drop(watch);
        assert_eq!(hub.synced_len(), 0, "a dropped watch leaves the hub");
    }

    #[test]
    fn prefix_ends_and_session_keys_are_etcds() {
        assert_eq!(prefix_end(b"lock/"), b"lock0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
        assert_eq!(session_key(b"l/", 0x694d_77f3_1a2b), b"l/694d77f31a2b".to_vec());
        assert_eq!(session_key(b"l/", -26), b"l/-1a".to_vec());
    }

    #[test]
    fn recipe_errors_are_etcds_texts_with_code_unknown() {
        let s = ConcurrencyError::NotLeader.status();
        assert_eq!((s.code(), s.message()), (tonic::Code::Unknown, "election: not leader"));
        let s = relayed(Status::not_found("etcdserver: requested lease not found"));
        assert_eq!((s.code(), s.message()), (tonic::Code::Unknown, "etcdserver: requested lease not found"));
    }
}
