//! `keelcurp.Curp`: the CURP extension service, served on the client port beside etcd's
//! services (plain etcd clients never see it and keep the Raft path).
//!
//! - `Propose` (to the leader): records the command in the leader's own witness pool and
//!   hands it to the front. If the client's term is the leader's, the pool took it and nothing
//!   pending conflicts, the answer is speculative and immediate; otherwise the answer comes
//!   once the command has applied (`SYNCED`). Either way the command is in the log.
//! - `Record` (to every other voter): the witness records the command or refuses it.
//! - `WaitSynced` (to any member): the applied answer of a command, with its revision.
//! - `WeakPut` and `WeakGet` (to the session's bound replica, any member): weak (causal)
//!   writes and point reads (`curp::weak`).
//!
//! Messages are protobuf (prost, defined in the `keel-curp` crate with our client), so any gRPC
//! client can speak it.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use prost::Message;
use tonic::codegen::{http, Body, BoxFuture, Context, Poll, Service, StdError};
use tonic::{Request as GrpcRequest, Response as GrpcResponse, Status};

use super::witness::Refusal;
use keel_curp::etcd::PutRequest as PbPutRequest;
use keel_curp::{
    status, CommandMsg, Kind, ProposeReply, RecordReply, SyncedReply, WaitSyncedRequest, WeakGetReply, WeakGetRequest,
    WeakPutReply,
};

use super::{Command, CommandId};
use crate::node::{Node, NodeError};
use crate::types::{RequestKind, Response};

fn kind_of(n: i32) -> Result<RequestKind, Status> {
    match Kind::from_number(n) {
        Some(Kind::Put) => Ok(RequestKind::Put),
        Some(Kind::DeleteRange) => Ok(RequestKind::DeleteRange),
        Some(Kind::Txn) => Ok(RequestKind::Txn),
        None => Err(Status::invalid_argument(format!(
            "keel: CURP command kind {n} is not Put (1), DeleteRange (2) or Txn (3)"
        ))),
    }
}

/// Checks a command as the etcd API would check its request; returns it with its kind.
fn command_of(node: &Node, m: CommandMsg) -> Result<(Command, u64), Status> {
    if m.client == 0 || m.seq == 0 {
        return Err(Status::invalid_argument(
            "keel: a CURP command needs a client id and a sequence number (both > 0)",
        ));
    }
    if m.first_incomplete > m.seq {
        return Err(Status::invalid_argument("keel: first_incomplete is after the command's own sequence number"));
    }
    if node.sm.auth.read().enabled {
        return Err(Status::failed_precondition(
            "keel: the CURP extension does not serve clusters with authentication enabled yet; use the etcd API",
        ));
    }
    let kind = kind_of(m.kind)?;
    crate::etcd_api::check_request(node, kind, &m.body)?;
    let cmd = Command {
        id: CommandId { client: m.client, seq: m.seq },
        first_incomplete: m.first_incomplete,
        kind,
        body: m.body,
    };
    Ok((cmd, m.term))
}

fn refusal_text(r: &Refusal) -> &'static str {
    match r {
        Refusal::Conflict => "conflict",
        Refusal::Fenced { .. } => "fenced",
        Refusal::Full => "full",
    }
}

/// The service's handlers.
#[derive(Clone)]
pub struct Curp {
    pub node: Arc<Node>,
}

impl Curp {
    async fn propose(&self, req: GrpcRequest<CommandMsg>) -> Result<GrpcResponse<ProposeReply>, Status> {
        let node = &self.node;
        let (cmd, client_term) = command_of(node, req.into_inner())?;
        let term = node.term();
        let not_leader = |leader: Option<u64>| ProposeReply {
            status: status::NOT_LEADER,
            term,
            leader: leader.unwrap_or(0),
            ..Default::default()
        };
        if node.leader() != Some(node.id) {
            return Ok(GrpcResponse::new(not_leader(node.leader())));
        }
        // A retry of a command that has applied: its recorded answer, never a new execution.
        match node.sm.curp_result(cmd.id) {
            Ok(Some(Response::Ok(result))) => {
                let voters = node.voters();
                return Ok(GrpcResponse::new(ProposeReply {
                    status: status::SYNCED,
                    term,
                    leader: node.id,
                    result,
                    voters,
                }));
            }
            Ok(Some(Response::Err(e))) => return Err(crate::etcd_api::apply_status(e)),
            Ok(None) => {}
            Err(e) => return Err(Status::internal(e.to_string())),
        }
        // The leader's own pool holds the command as another witness would (its log holds it
        // too, but a deposed leader's log may be cut; its pool is fenced like any other).
        let ticket = if client_term == term && node.front.open_term() == Some(term) {
            node.witness.record(cmd.id, term, cmd.kind, cmd.body.clone()).ok()
        } else {
            None
        };
        let recorded = ticket.is_some();
        let request = cmd.to_request().map_err(|e| Status::internal(e.to_string()))?;
        let cmd_id = cmd.id;
        let submitted = match node.propose(request, recorded.then_some(term)).await {
            Ok(s) => s,
            Err(NodeError::NotLeader(l)) => {
                if recorded {
                    node.witness.discard(cmd.id);
                }
                return Ok(GrpcResponse::new(not_leader(l)));
            }
            Err(e) => return Err(crate::etcd_api::node_status(e)),
        };
        let voters = node.voters();
        // A speculative answer only once the command is in this leader's log (`front`), and the
        // leader's own record is durable (W5): its log entry may not be yet, and this pool is
        // one of the superquorum.
        let appended = match submitted.appended {
            Some(rx) => tokio::time::timeout(node.request_timeout, rx).await.is_ok_and(|r| r.is_ok()),
            None => false,
        };
        let durable = match ticket {
            Some(t) => t.durable().await.is_ok(),
            None => false,
        };
        if let (true, true, Some(Response::Ok(result))) = (appended, durable, submitted.speculative) {
            return Ok(GrpcResponse::new(ProposeReply {
                status: status::SPECULATIVE,
                term,
                leader: node.id,
                result,
                voters,
            }));
        }
        match tokio::time::timeout(node.request_timeout, submitted.applied).await {
            Ok(Ok(Ok(Response::Ok(result)))) => {
                Ok(GrpcResponse::new(ProposeReply { status: status::SYNCED, term, leader: node.id, result, voters }))
            }
            Ok(Ok(Ok(Response::Err(e)))) => Err(crate::etcd_api::apply_status(e)),
            Ok(Ok(Err(NodeError::NotLeader(l)))) => {
                // Refused by Raft: this pool's record will never leave by applying here.
                if recorded {
                    node.witness.discard(cmd_id);
                }
                Ok(GrpcResponse::new(not_leader(l)))
            }
            Ok(Ok(Err(e))) => Err(crate::etcd_api::node_status(e)),
            _ => Err(crate::etcd_api::node_status(NodeError::Timeout)),
        }
    }

    async fn record(&self, req: GrpcRequest<CommandMsg>) -> Result<GrpcResponse<RecordReply>, Status> {
        let node = &self.node;
        let (cmd, term) = command_of(node, req.into_inner())?;
        let member = node.id;
        if !node.voters().contains(&member) {
            return Ok(GrpcResponse::new(RecordReply {
                accepted: false,
                fence: 0,
                member,
                refusal: "not a voter".into(),
            }));
        }
        // A record of a command that has applied here (a retry, or a record slower than the
        // log) is durable already: accept it without pooling it, or it would linger in the
        // pool for good (its apply, which removes it, has passed), slowing every record and
        // refusing fast paths on its keys.
        if matches!(node.sm.curp_applied(cmd.id), Ok(true)) {
            return Ok(GrpcResponse::new(RecordReply {
                accepted: true,
                fence: node.witness.fence_term(),
                member,
                refusal: String::new(),
            }));
        }
        let recorded = node.witness.record(cmd.id, term, cmd.kind, cmd.body);
        Ok(GrpcResponse::new(match recorded {
            // Accepted only once the record is durable (W5).
            Ok(ticket) => match ticket.durable().await {
                Ok(()) => {
                    RecordReply { accepted: true, fence: node.witness.fence_term(), member, refusal: String::new() }
                }
                Err(e) => RecordReply {
                    accepted: false,
                    fence: node.witness.fence_term(),
                    member,
                    refusal: format!("storage: {e}"),
                },
            },
            Err(r) => {
                let fence = match r {
                    Refusal::Fenced { fence } => fence,
                    _ => node.witness.fence_term(),
                };
                RecordReply { accepted: false, fence, member, refusal: refusal_text(&r).into() }
            }
        }))
    }

    async fn weak_put(&self, req: GrpcRequest<CommandMsg>) -> Result<GrpcResponse<WeakPutReply>, Status> {
        let node = &self.node;
        let (cmd, _) = command_of(node, req.into_inner())?;
        if cmd.kind != RequestKind::Put {
            return Err(Status::invalid_argument("keel: a weak write is a Put (kind 1)"));
        }
        let put = PbPutRequest::decode(cmd.body.as_slice())
            .map_err(|e| Status::invalid_argument(format!("keel: undecodable request: {e}")))?;
        if put.lease != 0 || put.ignore_value || put.ignore_lease {
            return Err(Status::invalid_argument(
                "keel: a weak write is a plain Put (no lease, ignore_value or ignore_lease)",
            ));
        }
        let applied_through = node.weak.accept(node, cmd, put.key, put.value)?;
        Ok(GrpcResponse::new(WeakPutReply { member: node.id, applied_through }))
    }

    async fn weak_get(&self, req: GrpcRequest<WeakGetRequest>) -> Result<GrpcResponse<WeakGetReply>, Status> {
        let node = &self.node;
        let r = req.into_inner();
        if r.client == 0 {
            return Err(Status::invalid_argument("keel: a weak read needs its session's client id (> 0)"));
        }
        if node.sm.auth.read().enabled {
            return Err(Status::failed_precondition(
                "keel: the CURP extension does not serve clusters with authentication enabled yet; use the etcd API",
            ));
        }
        let read = node.weak.read(node, r.client, r.key, r.min_revision, r.after_seq).await?;
        let (found, value, mod_revision) = match read.value {
            Some((v, rev)) => (true, v, rev),
            None => (false, Vec::new(), 0),
        };
        Ok(GrpcResponse::new(WeakGetReply {
            found,
            value,
            mod_revision,
            pending: read.pending,
            revision: read.revision,
            applied_through: read.applied_through,
            member: node.id,
        }))
    }

    async fn wait_synced(&self, req: GrpcRequest<WaitSyncedRequest>) -> Result<GrpcResponse<SyncedReply>, Status> {
        let node = &self.node;
        let r = req.into_inner();
        let id = CommandId { client: r.client, seq: r.seq };
        let mut applied = node.sm.applied_tx.subscribe();
        let deadline = tokio::time::Instant::now() + node.request_timeout;
        loop {
            match node.sm.curp_result(id) {
                Ok(Some(Response::Ok(result))) => return Ok(GrpcResponse::new(SyncedReply { result })),
                Ok(Some(Response::Err(e))) => return Err(crate::etcd_api::apply_status(e)),
                Ok(None) => {}
                Err(e) => return Err(Status::internal(e.to_string())),
            }
            match tokio::time::timeout_at(deadline, applied.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(crate::etcd_api::node_status(NodeError::Stopped)),
                // Not applied here in time: its fate is unknown to this member (the client
                // proposes it again; the dedup table keeps that from applying twice).
                Err(_) => return Err(crate::etcd_api::node_status(NodeError::Timeout)),
            }
        }
    }
}

/// The hand-routed tonic service (as `auth_api::AuthServer`).
#[derive(Clone)]
pub struct CurpServer {
    api: Curp,
}

impl CurpServer {
    pub fn new(node: Arc<Node>) -> CurpServer {
        CurpServer { api: Curp { node } }
    }
}

impl tonic::server::NamedService for CurpServer {
    const NAME: &'static str = "keelcurp.Curp";
}

type Reply<T> = Pin<Box<dyn Future<Output = Result<GrpcResponse<T>, Status>> + Send>>;

struct Unary<F>(Option<F>);

impl<Req, Resp, F> tonic::server::UnaryService<Req> for Unary<F>
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

fn unary<B, Req, Resp, F>(req: http::Request<B>, f: F) -> BoxFuture<http::Response<tonic::body::Body>, Infallible>
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
    Req: Message + Default + Send + 'static,
    Resp: Message + Send + 'static,
    F: FnOnce(GrpcRequest<Req>) -> Reply<Resp> + Send + 'static,
{
    Box::pin(async move {
        let codec = tonic_prost::ProstCodec::<Resp, Req>::default();
        let mut grpc = tonic::server::Grpc::new(codec);
        Ok(grpc.unary(Unary(Some(f)), req).await)
    })
}

impl<B> Service<http::Request<B>> for CurpServer
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
        let api = self.api.clone();
        match req.uri().path() {
            "/keelcurp.Curp/Propose" => {
                unary(req, move |r| -> Reply<_> { Box::pin(async move { api.propose(r).await }) })
            }
            "/keelcurp.Curp/Record" => {
                unary(req, move |r| -> Reply<_> { Box::pin(async move { api.record(r).await }) })
            }
            "/keelcurp.Curp/WaitSynced" => {
                unary(req, move |r| -> Reply<_> { Box::pin(async move { api.wait_synced(r).await }) })
            }
            "/keelcurp.Curp/WeakPut" => {
                unary(req, move |r| -> Reply<_> { Box::pin(async move { api.weak_put(r).await }) })
            }
            "/keelcurp.Curp/WeakGet" => {
                unary(req, move |r| -> Reply<_> { Box::pin(async move { api.weak_get(r).await }) })
            }
            _ => Box::pin(async move {
                let mut response = http::Response::new(tonic::body::Body::default());
                let headers = response.headers_mut();
                headers.insert(Status::GRPC_STATUS, (tonic::Code::Unimplemented as i32).into());
                headers.insert(http::header::CONTENT_TYPE, tonic::metadata::GRPC_CONTENT_TYPE);
                Ok(response)
            }),
        }
    }
}
