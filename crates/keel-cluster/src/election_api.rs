//! etcd's `v3electionpb.Election` service: etcd's client-side `Election` recipe run inside the
//! member (as etcd's `v3election` runs it on an in-process client), on the pieces shared with
//! the Lock service in `lock_api.rs`.
//!
//! A candidate's key is `name/<lease in hex>`; the leader is the key under `name/` created
//! first. Campaign waits as a Lock does; Proclaim and Resign act only while the leader key
//! still has the create revision the caller was given; Observe follows the leader through the
//! member's watch hub.
//!
//! What it must not do: write anything except through the member's KV and Lease services.

use std::sync::Arc;

use etcd_client::proto::*;
use prost::Message;
use tokio::sync::mpsc;
use tonic::codegen::{http, Body, BoxFuture, Context, Poll, Service, StdError};
use tonic::metadata::MetadataMap;
use tonic::{Request as GrpcRequest, Response as GrpcResponse, Status};

use crate::etcd_api::Api;
use crate::lock_api::{
    created_at, get_first_created, get_key, malformed, op_delete, op_get, op_put, prefix_end, range_of, session_key,
    unary, undo_now, unimplemented, Cleanup, Concurrency, ConcurrencyError, HubWatch, Reply, Undo, Wake,
};
use crate::watch::{Hub, Span};

/// Leader answers an Observe stream queues for its client.
const OBSERVE_QUEUE: usize = 16;

/// etcd's `CampaignRequest` (not exported by etcd-client).
#[derive(Clone, PartialEq, Message)]
pub struct CampaignRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub name: Vec<u8>,
    #[prost(int64, tag = "2")]
    pub lease: i64,
    #[prost(bytes = "vec", tag = "3")]
    pub value: Vec<u8>,
}

/// etcd's `LeaderRequest` (not exported by etcd-client).
#[derive(Clone, PartialEq, Message)]
pub struct LeaderRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub name: Vec<u8>,
}

/// etcd's `ProclaimRequest` (not exported by etcd-client).
#[derive(Clone, PartialEq, Message)]
pub struct ProclaimRequest {
    #[prost(message, optional, tag = "1")]
    pub leader: Option<PbLeaderKey>,
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
}

/// etcd's `ResignRequest` (not exported by etcd-client).
#[derive(Clone, PartialEq, Message)]
pub struct ResignRequest {
    #[prost(message, optional, tag = "1")]
    pub leader: Option<PbLeaderKey>,
}

type LeaderStream = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<PbLeaderResponse, Status>> + Send>>;
type Outbox = mpsc::Sender<Result<PbLeaderResponse, Status>>;

impl Concurrency {
    /// etcd's `Election.Campaign` on an orphaned session.
    async fn campaign(
        &self,
        request: GrpcRequest<CampaignRequest>,
    ) -> Result<GrpcResponse<PbCampaignResponse>, Status> {
        let md = request.metadata().clone();
        let req = request.into_inner();
        let lease = self.session_lease(&md, req.lease).await?;
        let prefix = [req.name.as_slice(), b"/"].concat();
        let key = session_key(&prefix, lease);
        let enter = PbTxnRequest {
            compare: vec![created_at(&key, 0)],
            success: vec![op_put(&key, &req.value, lease)],
            failure: vec![op_get(get_key(&key))],
        };
        let resp = self.txn(&md, enter).await?;
        let mut rev = resp.header.as_ref().map_or(0, |h| h.revision);
        if !resp.succeeded {
            // A campaign with this lease is already in line: keep its place, with our value.
            let kv = range_of(&resp, 0).and_then(|r| r.kvs.first()).ok_or_else(malformed)?;
            rev = kv.create_revision;
            if kv.value != req.value {
                if let Err(e) = self.proclaim_as(&md, &key, rev, lease, &req.value).await {
                    undo_now(self, &md, Undo::Resign(key, rev)).await;
                    return Err(e);
                }
            }
        }
        // etcd resigns only when the client goes away; a wait that fails otherwise leaves the
        // key in line (its lease removes it).
        let mut cleanup = Cleanup::new(self.clone(), md.clone(), Undo::Resign(key.clone(), rev));
        let waited = self.wait_deletes(&md, &prefix, rev - 1).await;
        cleanup.disarm();
        waited?;
        let leader = PbLeaderKey { name: req.name, key, rev, lease };
        Ok(GrpcResponse::new(PbCampaignResponse { header: resp.header, leader: Some(leader) }))
    }

    /// Puts `value` on the leader key only while it has the create revision `rev`.
    async fn proclaim_as(
        &self,
        md: &MetadataMap,
        key: &[u8],
        rev: i64,
        lease: i64,
        value: &[u8],
    ) -> Result<Option<PbResponseHeader>, Status> {
        let req = PbTxnRequest {
            compare: vec![created_at(key, rev)],
            success: vec![op_put(key, value, lease)],
            failure: vec![],
        };
        let resp = self.txn(md, req).await?;
        if !resp.succeeded {
            return Err(ConcurrencyError::NotLeader.status());
        }
        Ok(resp.header)
    }

    async fn proclaim(
        &self,
        request: GrpcRequest<ProclaimRequest>,
    ) -> Result<GrpcResponse<PbProclaimResponse>, Status> {
        let md = request.metadata().clone();
        let req = request.into_inner();
        let leader = req.leader.ok_or_else(|| ConcurrencyError::MissingLeaderKey.status())?;
        let lease = self.session_lease(&md, leader.lease).await?;
        let header = self.proclaim_as(&md, &leader.key, leader.rev, lease, &req.value).await?;
        Ok(GrpcResponse::new(PbProclaimResponse { header }))
    }

    async fn resign(&self, request: GrpcRequest<ResignRequest>) -> Result<GrpcResponse<PbResignResponse>, Status> {
        let md = request.metadata().clone();
        let leader = request.into_inner().leader.ok_or_else(|| ConcurrencyError::MissingLeaderKey.status())?;
        // etcd opens a session on the leader's lease here too (granting one for lease 0).
        self.session_lease(&md, leader.lease).await?;
        let req = PbTxnRequest {
            compare: vec![created_at(&leader.key, leader.rev)],
            success: vec![op_delete(&leader.key)],
            failure: vec![],
        };
        let resp = self.txn(&md, req).await?;
        Ok(GrpcResponse::new(PbResignResponse { header: resp.header }))
    }

    async fn leader(&self, request: GrpcRequest<LeaderRequest>) -> Result<GrpcResponse<PbLeaderResponse>, Status> {
        let md = request.metadata().clone();
        let prefix = [request.into_inner().name.as_slice(), b"/"].concat();
        let resp = self.get(&md, get_first_created(&prefix)).await?;
        let kv = resp.kvs.into_iter().next().ok_or_else(|| ConcurrencyError::NoLeader.status())?;
        Ok(GrpcResponse::new(PbLeaderResponse { header: resp.header, kv: Some(kv) }))
    }

    /// etcd's `Election.Observe`: a task follows the leader and feeds the stream until the
    /// client goes. Like etcd, a read that fails ends the stream without an error.
    fn observe(&self, request: GrpcRequest<LeaderRequest>) -> LeaderStream {
        let md = request.metadata().clone();
        let prefix = [request.into_inner().name.as_slice(), b"/"].concat();
        let (tx, rx) = mpsc::channel(OBSERVE_QUEUE);
        let service = self.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = service.follow_leader(&md, &prefix, &tx) => {}
                _ = tx.closed() => {}
            }
        });
        Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
    }

    /// One round per leader: read who leads (answering with it), then follow its key's puts
    /// until it is deleted; with no leader, the first put under the prefix is the leader. The
    /// hub watch covers the whole prefix and joined before the first read, so nothing between
    /// a read and the events after it is missed; events at or below the read's revision are
    /// already in what the read saw.
    async fn follow_leader(&self, md: &MetadataMap, prefix: &[u8], tx: &Outbox) {
        let Some(span) = Span::new(prefix, &prefix_end(prefix)) else { return };
        let Ok(mut watch) = HubWatch::open(&self.hub, vec![(span, false)]) else { return };
        let mut sent = None;
        loop {
            let Ok(resp) = self.get(md, get_first_created(prefix)).await else { return };
            let mut after = resp.header.as_ref().map_or(0, |h| h.revision);
            let mut leader = None;
            if let Some(kv) = resp.kvs.into_iter().next() {
                leader = Some(kv.key.clone());
                if !answer(tx, &mut sent, resp.header, kv).await {
                    return;
                }
            }
            'round: loop {
                let delivery = match watch.wake().await {
                    Ok(Wake::Events(d)) => d,
                    // Events were dropped for us: the next read sees what they did.
                    Ok(Wake::Lost) => break 'round,
                    Err(_) => return,
                };
                let batches = &delivery.batches;
                for (b, e) in delivery.hits.iter().flat_map(|h| h.events.iter()) {
                    let Some(batch) = batches.get(*b as usize) else { continue };
                    let Some(event) = batch.events.get(*e as usize) else { continue };
                    if batch.revision <= after {
                        continue;
                    }
                    let ours = match &leader {
                        None => event.put,
                        Some(k) => *k == event.kv.key,
                    };
                    if !ours {
                        continue;
                    }
                    if !event.put {
                        break 'round;
                    }
                    leader = Some(event.kv.key.clone());
                    after = batch.revision;
                    let header = Some(self.api.header(batch.revision));
                    if !answer(tx, &mut sent, header, event.kv.clone()).await {
                        return;
                    }
                }
            }
        }
    }
}

/// Sends one leader answer unless it is the one sent last (a read after a lost delivery may
/// find the leader as already told); false once the client has gone.
async fn answer(
    tx: &Outbox,
    sent: &mut Option<(Vec<u8>, i64)>,
    header: Option<PbResponseHeader>,
    kv: PbKeyValue,
) -> bool {
    let id = (kv.key.clone(), kv.mod_revision);
    if sent.as_ref() == Some(&id) {
        return true;
    }
    *sent = Some(id);
    tx.send(Ok(PbLeaderResponse { header, kv: Some(kv) })).await.is_ok()
}

/// The `v3electionpb.Election` gRPC service.
#[derive(Clone)]
pub struct ElectionServer {
    service: Concurrency,
}

impl ElectionServer {
    pub fn new(api: Api, hub: Arc<Hub>) -> ElectionServer {
        ElectionServer { service: Concurrency::new(api, hub) }
    }
}

impl tonic::server::NamedService for ElectionServer {
    const NAME: &'static str = "v3electionpb.Election";
}

/// The Observe call's handler.
struct Observing(Concurrency);

impl tonic::server::ServerStreamingService<LeaderRequest> for Observing {
    type Response = PbLeaderResponse;
    type ResponseStream = LeaderStream;
    type Future = Reply<LeaderStream>;

    fn call(&mut self, request: GrpcRequest<LeaderRequest>) -> Self::Future {
        let stream = self.0.observe(request);
        Box::pin(async move { Ok(GrpcResponse::new(stream)) })
    }
}

macro_rules! route {
    ($req:expr, $service:expr, $method:ident) => {{
        let s = $service;
        unary($req, s.max_request_bytes(), move |r| -> Reply<_> { Box::pin(async move { s.$method(r).await }) })
    }};
}

impl<B> Service<http::Request<B>> for ElectionServer
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let s = self.service.clone();
        match req.uri().path() {
            "/v3electionpb.Election/Campaign" => route!(req, s, campaign),
            "/v3electionpb.Election/Proclaim" => route!(req, s, proclaim),
            "/v3electionpb.Election/Leader" => route!(req, s, leader),
            "/v3electionpb.Election/Resign" => route!(req, s, resign),
            "/v3electionpb.Election/Observe" => Box::pin(async move {
                let codec = tonic_prost::ProstCodec::<PbLeaderResponse, LeaderRequest>::default();
                let mut grpc = tonic::server::Grpc::new(codec).max_decoding_message_size(s.max_request_bytes());
                Ok(grpc.server_streaming(Observing(s), req).await)
            }),
            _ => unimplemented(),
        }
    }
}
