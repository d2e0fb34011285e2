//! etcd's `Auth` gRPC service, and the checks the other services call on every request
//! ([`Api::authorize`], [`Api::caller`], [`Api::require_root`]).
//!
//! The service is written against tonic's server plumbing rather than etcd-client's `Auth`
//! trait, because etcd-client does not export `AuthStatusRequest`/`AuthStatusResponse` by name
//! and the trait cannot be implemented without naming them; the two messages are declared here
//! with etcd's field numbers.
//!
//! What it must not do: change auth state other than through the log, or let a request it
//! refuses reach the log.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use etcd_client::proto::*;
use prost::Message;
use tonic::codegen::{http, Body, BoxFuture, Context, Poll, Service, StdError};
use tonic::metadata::MetadataMap;
use tonic::{Request as GrpcRequest, Response as GrpcResponse, Status};

use crate::auth::{now_s, AuthError, AuthOp, AuthStamp, AuthState, Perm, Permission, BCRYPT_COST, ROOT};
use crate::etcd_api::Api;
use crate::types::{ApplyError, Request, RequestKind, Response};

/// etcd's `AuthStatusRequest` (not exported by etcd-client).
#[derive(Clone, PartialEq, Message)]
pub struct AuthStatusRequest {}

/// etcd's `AuthStatusResponse` (not exported by etcd-client).
#[derive(Clone, PartialEq, Message)]
pub struct AuthStatusResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<PbResponseHeader>,
    #[prost(bool, tag = "2")]
    pub enabled: bool,
    #[prost(uint64, tag = "3")]
    pub auth_revision: u64,
}

impl Api {
    /// The auth state this member has applied.
    pub fn auth_state(&self) -> Arc<AuthState> {
        Arc::clone(&self.node.sm.auth.read())
    }

    /// Who sends a request (from its `token` metadata) and the auth state it is checked
    /// against. While auth is disabled the user is `None` and nothing is checked.
    pub fn caller(&self, metadata: &MetadataMap) -> Result<(Arc<AuthState>, Option<String>), Status> {
        caller_in(self.auth_state(), metadata)
    }

    /// [`Api::caller`] with a stamp to propose with (Lease requests).
    pub fn stamp(&self, metadata: &MetadataMap) -> Result<AuthStamp, Status> {
        let (state, user) = self.caller(metadata)?;
        Ok(AuthStamp { user, revision: state.revision })
    }

    /// Checks that the sender of `metadata` may do `perm` on `[key, range_end)` (etcd's range
    /// forms); returns the user (`None` while auth is disabled). For Watch and Lease.
    pub fn authorize(
        &self,
        metadata: &MetadataMap,
        key: &[u8],
        range_end: &[u8],
        perm: Perm,
    ) -> Result<Option<String>, Status> {
        let (state, user) = self.caller(metadata)?;
        check(&state, user.as_deref(), key, range_end, perm)?;
        Ok(user)
    }

    /// Checks that the sender has the root role; returns the stamp to propose with.
    pub fn require_root(&self, metadata: &MetadataMap) -> Result<AuthStamp, Status> {
        let (state, user) = self.caller(metadata)?;
        if let Some(u) = &user {
            if !state.users.contains_key(u) {
                return Err(AuthError::UserNotFound.status());
            }
            if !state.is_root(u) {
                return Err(AuthError::PermissionDenied.status());
            }
        }
        Ok(AuthStamp { user, revision: state.revision })
    }

    /// Checks a KV request's permissions (every compare and op of a txn); returns the stamp to
    /// propose it with.
    pub fn authorize_kv(&self, metadata: &MetadataMap, req: KvCheck<'_>) -> Result<AuthStamp, Status> {
        let (state, user) = self.caller(metadata)?;
        if state.enabled {
            let u = user.as_deref();
            match req {
                KvCheck::Range(r) => check(&state, u, &r.key, &r.range_end, Perm::Read)?,
                KvCheck::Put(p) => put_check(&state, u, p)?,
                KvCheck::Delete(d) => delete_check(&state, u, d)?,
                KvCheck::Txn(t) => txn_check(&state, u, t)?,
            }
        }
        Ok(AuthStamp { user, revision: state.revision })
    }

    async fn propose_auth(&self, op: AuthOp, stamp: AuthStamp) -> Result<PbResponseHeader, Status> {
        let body = bincode::serialize(&op).map_err(|e| Status::internal(e.to_string()))?;
        match self.node.write(Request::with_auth(RequestKind::Auth, body, stamp)).await {
            Ok(Response::Ok(_)) => {
                // The leader has applied the change; wait until this member has too, so that the
                // client's next request here is checked against it (not refused as checked at an
                // old revision).
                self.node.read_barrier().await.map_err(|e| Status::unavailable(e.to_string()))?;
                Ok(self.header_now())
            }
            Ok(Response::Err(ApplyError::Auth(e))) => Err(e.status()),
            Ok(Response::Err(e)) => Err(Status::invalid_argument(e.to_string())),
            Err(e) => Err(Status::unavailable(e.to_string())),
        }
    }

    fn header_now(&self) -> PbResponseHeader {
        PbResponseHeader {
            cluster_id: self.node.cluster_id,
            member_id: self.node.id,
            revision: self.node.sm.visible_revision(),
            raft_term: self.node.term(),
        }
    }

    /// A linearizable view of the auth state for the read-only admin RPCs.
    async fn read_auth(&self) -> Result<Arc<AuthState>, Status> {
        self.node.read_barrier().await.map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(self.auth_state())
    }
}

/// The metadata key under which [`cert_user`] passes a verified client certificate's common
/// name to the services. Whatever a client sends under it is removed first.
pub const CERT_USER: &str = "keel-internal-cert-user";

/// A gRPC interceptor for every client listener: removes any [`CERT_USER`] a client sent and,
/// when `client_cert_auth` is on and the connection presented a verified certificate (rustls
/// hands the chain over only after verifying it), sets it to the certificate's common name.
pub fn cert_user(client_cert_auth: bool, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
    req.metadata_mut().remove(CERT_USER);
    if !client_cert_auth {
        return Ok(req);
    }
    let certs = req.extensions().get::<crate::listener::ClientConnInfo>().and_then(|c| c.peer_certs.clone());
    let name = certs.and_then(|chain| chain.first().and_then(|cert| common_name(cert.as_ref())));
    if let Some(value) = name.and_then(|n| tonic::metadata::MetadataValue::try_from(n.as_str()).ok()) {
        req.metadata_mut().insert(CERT_USER, value);
    }
    Ok(req)
}

/// A status as grpc-go prints an error (`rpc error: code = PermissionDenied desc = ...`):
/// what etcd puts in a watch's cancel reason and clientv3 parses back into a typed error.
pub fn grpc_error_text(status: &Status) -> String {
    use tonic::Code::*;
    let code = match status.code() {
        Ok => "OK",
        Cancelled => "Canceled",
        Unknown => "Unknown",
        InvalidArgument => "InvalidArgument",
        DeadlineExceeded => "DeadlineExceeded",
        NotFound => "NotFound",
        AlreadyExists => "AlreadyExists",
        PermissionDenied => "PermissionDenied",
        ResourceExhausted => "ResourceExhausted",
        FailedPrecondition => "FailedPrecondition",
        Aborted => "Aborted",
        OutOfRange => "OutOfRange",
        Unimplemented => "Unimplemented",
        Internal => "Internal",
        Unavailable => "Unavailable",
        DataLoss => "DataLoss",
        Unauthenticated => "Unauthenticated",
    };
    format!("rpc error: code = {code} desc = {}", status.message())
}

/// The first common name in a DER certificate's subject, if it has one.
fn common_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let cn = cert.subject().iter_common_name().next()?;
    cn.as_str().ok().map(str::to_string)
}

/// A KV request to check.
pub enum KvCheck<'a> {
    Range(&'a PbRangeRequest),
    Put(&'a PbPutRequest),
    Delete(&'a PbDeleteRequest),
    Txn(&'a PbTxnRequest),
}

/// Who sends a request (from its `token` metadata), checked against `state`. While auth is
/// disabled the user is `None` and nothing is checked.
pub fn caller_in(state: Arc<AuthState>, metadata: &MetadataMap) -> Result<(Arc<AuthState>, Option<String>), Status> {
    if !state.enabled {
        return Ok((state, None));
    }
    let Some(token) = metadata.get("token") else {
        // etcd: without a token, the common name of a verified client certificate is the user
        // (with --client-cert-auth; [`cert_user`] puts it here and nothing else can).
        return match metadata.get(CERT_USER).and_then(|v| v.to_str().ok()) {
            Some(name) if !name.is_empty() => Ok((state, Some(name.to_string()))),
            _ => Err(AuthError::UserEmpty.status()),
        };
    };
    let token = token.to_str().map_err(|_| AuthError::InvalidAuthToken.status())?;
    let user = state.verify_token(token, now_s()).map_err(|e| e.status())?;
    Ok((state, Some(user)))
}

/// Whether `user` may do `perm` on `[key, range_end)` under `state` (always, while auth is
/// disabled); etcd's permission-denied and user-empty statuses otherwise.
pub fn check(state: &AuthState, user: Option<&str>, key: &[u8], range_end: &[u8], perm: Perm) -> Result<(), Status> {
    if !state.enabled {
        return Ok(());
    }
    let Some(user) = user else { return Err(AuthError::UserEmpty.status()) };
    if state.permitted(user, key, range_end, perm) {
        Ok(())
    } else {
        Err(AuthError::PermissionDenied.status())
    }
}

fn put_check(state: &AuthState, user: Option<&str>, p: &PbPutRequest) -> Result<(), Status> {
    check(state, user, &p.key, &[], Perm::Write)?;
    if p.prev_kv {
        check(state, user, &p.key, &[], Perm::Read)?;
    }
    Ok(())
}

fn delete_check(state: &AuthState, user: Option<&str>, d: &PbDeleteRequest) -> Result<(), Status> {
    check(state, user, &d.key, &d.range_end, Perm::Write)?;
    if d.prev_kv {
        check(state, user, &d.key, &d.range_end, Perm::Read)?;
    }
    Ok(())
}

fn txn_check(state: &AuthState, user: Option<&str>, t: &PbTxnRequest) -> Result<(), Status> {
    for c in &t.compare {
        check(state, user, &c.key, &c.range_end, Perm::Read)?;
    }
    for op in t.success.iter().chain(&t.failure) {
        match &op.request {
            Some(PbTxnOpRequest::RequestRange(r)) => check(state, user, &r.key, &r.range_end, Perm::Read)?,
            Some(PbTxnOpRequest::RequestPut(p)) => put_check(state, user, p)?,
            Some(PbTxnOpRequest::RequestDeleteRange(d)) => delete_check(state, user, d)?,
            Some(PbTxnOpRequest::RequestTxn(inner)) => txn_check(state, user, inner)?,
            None => {}
        }
    }
    Ok(())
}

/// bcrypt off the async runtime (tens of milliseconds at cost 10).
async fn hash_password(password: String) -> Result<String, Status> {
    tokio::task::spawn_blocking(move || bcrypt::hash(password, BCRYPT_COST))
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(|e| Status::internal(format!("keel: password hash failed: {e}")))
}

/// The hash to store for a password given in clear or (etcd 3.5+) already hashed by the client.
async fn chosen_hash(password: &str, hashed: &str) -> Result<String, Status> {
    if !hashed.is_empty() {
        return Ok(hashed.to_string());
    }
    hash_password(password.to_string()).await
}

impl Api {
    async fn auth_enable(
        &self,
        r: GrpcRequest<PbAuthEnableRequest>,
    ) -> Result<GrpcResponse<PbAuthEnableResponse>, Status> {
        let stamp = self.require_root(r.metadata())?;
        let mut secret = [0u8; 32];
        rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut secret);
        let header = self.propose_auth(AuthOp::Enable { secret }, stamp).await?;
        Ok(GrpcResponse::new(PbAuthEnableResponse { header: Some(header) }))
    }

    async fn auth_disable(
        &self,
        r: GrpcRequest<PbAuthDisableRequest>,
    ) -> Result<GrpcResponse<PbAuthDisableResponse>, Status> {
        let stamp = self.require_root(r.metadata())?;
        let header = self.propose_auth(AuthOp::Disable, stamp).await?;
        Ok(GrpcResponse::new(PbAuthDisableResponse { header: Some(header) }))
    }

    async fn auth_status(
        &self,
        _r: GrpcRequest<AuthStatusRequest>,
    ) -> Result<GrpcResponse<AuthStatusResponse>, Status> {
        let state = self.read_auth().await?;
        Ok(GrpcResponse::new(AuthStatusResponse {
            header: Some(self.header_now()),
            enabled: state.enabled,
            auth_revision: state.revision,
        }))
    }

    async fn authenticate(
        &self,
        r: GrpcRequest<PbAuthenticateRequest>,
    ) -> Result<GrpcResponse<PbAuthenticateResponse>, Status> {
        let r = r.into_inner();
        let state = self.read_auth().await?;
        if !state.enabled {
            return Err(AuthError::AuthNotEnabled.status());
        }
        let Some(user) = state.users.get(&r.name) else { return Err(AuthError::AuthFailed.status()) };
        let Some(hash) = user.password_hash.clone().filter(|_| !user.no_password) else {
            return Err(AuthError::AuthFailed.status());
        };
        let ok = tokio::task::spawn_blocking(move || bcrypt::verify(r.password, &hash).unwrap_or(false))
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        if !ok {
            return Err(AuthError::AuthFailed.status());
        }
        let token = state
            .issue_token(&r.name, now_s(), self.node.config.auth_token_ttl.as_secs())
            .ok_or_else(|| AuthError::AuthFailed.status())?;
        Ok(GrpcResponse::new(PbAuthenticateResponse { header: Some(self.header_now()), token }))
    }

    async fn user_add(
        &self,
        r: GrpcRequest<PbAuthUserAddRequest>,
    ) -> Result<GrpcResponse<PbAuthUserAddResponse>, Status> {
        let stamp = self.require_root(r.metadata())?;
        let r = r.into_inner();
        if r.name.is_empty() {
            return Err(AuthError::UserEmpty.status());
        }
        let no_password = r.options.as_ref().is_some_and(|o| o.no_password);
        let password_hash = if no_password { None } else { Some(chosen_hash(&r.password, &r.hashed_password).await?) };
        let header = self.propose_auth(AuthOp::UserAdd { name: r.name, password_hash, no_password }, stamp).await?;
        Ok(GrpcResponse::new(PbAuthUserAddResponse { header: Some(header) }))
    }

    async fn user_get(
        &self,
        r: GrpcRequest<PbAuthUserGetRequest>,
    ) -> Result<GrpcResponse<PbAuthUserGetResponse>, Status> {
        // etcd: the root role, or a user asking about itself.
        let (_, caller) = self.caller(r.metadata())?;
        if caller.as_deref() != Some(r.get_ref().name.as_str()) {
            self.require_root(r.metadata())?;
        }
        let state = self.read_auth().await?;
        let user = state.users.get(&r.get_ref().name).ok_or_else(|| AuthError::UserNotFound.status())?;
        Ok(GrpcResponse::new(PbAuthUserGetResponse { header: Some(self.header_now()), roles: user.roles.clone() }))
    }

    async fn user_list(
        &self,
        r: GrpcRequest<PbAuthUserListRequest>,
    ) -> Result<GrpcResponse<PbAuthUserListResponse>, Status> {
        self.require_root(r.metadata())?;
        let state = self.read_auth().await?;
        let users = state.users.keys().cloned().collect();
        Ok(GrpcResponse::new(PbAuthUserListResponse { header: Some(self.header_now()), users }))
    }

    async fn user_delete(
        &self,
        r: GrpcRequest<PbAuthUserDeleteRequest>,
    ) -> Result<GrpcResponse<PbAuthUserDeleteResponse>, Status> {
        let stamp = self.require_root(r.metadata())?;
        let header = self.propose_auth(AuthOp::UserDelete { name: r.into_inner().name }, stamp).await?;
        Ok(GrpcResponse::new(PbAuthUserDeleteResponse { header: Some(header) }))
    }

    async fn user_change_password(
        &self,
        r: GrpcRequest<PbAuthUserChangePasswordRequest>,
    ) -> Result<GrpcResponse<PbAuthUserChangePasswordResponse>, Status> {
        let stamp = self.require_root(r.metadata())?;
        let r = r.into_inner();
        let password_hash = Some(chosen_hash(&r.password, &r.hashed_password).await?);
        let header = self.propose_auth(AuthOp::UserChangePassword { name: r.name, password_hash }, stamp).await?;
        Ok(GrpcResponse::new(PbAuthUserChangePasswordResponse { header: Some(header) }))
    }

    async fn user_grant_role(
        &self,
        r: GrpcRequest<PbAuthUserGrantRoleRequest>,
    ) -> Result<GrpcResponse<PbAuthUserGrantRoleResponse>, Status> {
        let stamp = self.require_root(r.metadata())?;
        let r = r.into_inner();
        let header = self.propose_auth(AuthOp::UserGrantRole { user: r.user, role: r.role }, stamp).await?;
        Ok(GrpcResponse::new(PbAuthUserGrantRoleResponse { header: Some(header) }))
    }

    async fn user_revoke_role(
        &self,
        r: GrpcRequest<PbAuthUserRevokeRoleRequest>,
    ) -> Result<GrpcResponse<PbAuthUserRevokeRoleResponse>, Status> {
        let stamp = self.require_root(r.metadata())?;
        let r = r.into_inner();
        let header = self.propose_auth(AuthOp::UserRevokeRole { name: r.name, role: r.role }, stamp).await?;
        Ok(GrpcResponse::new(PbAuthUserRevokeRoleResponse { header: Some(header) }))
    }

    async fn role_add(
        &self,
        r: GrpcRequest<PbAuthRoleAddRequest>,
    ) -> Result<GrpcResponse<PbAuthRoleAddResponse>, Status> {
        let stamp = self.require_root(r.metadata())?;
        let header = self.propose_auth(AuthOp::RoleAdd { name: r.into_inner().name }, stamp).await?;
        Ok(GrpcResponse::new(PbAuthRoleAddResponse { header: Some(header) }))
    }

    async fn role_get(
        &self,
        r: GrpcRequest<PbAuthRoleGetRequest>,
    ) -> Result<GrpcResponse<PbAuthRoleGetResponse>, Status> {
        // etcd: the root role, or a user asking about a role it has.
        let (state, caller) = self.caller(r.metadata())?;
        let own =
            caller.as_deref().and_then(|u| state.users.get(u)).is_some_and(|u| u.roles.contains(&r.get_ref().role));
        if !own {
            self.require_root(r.metadata())?;
        }
        let state = self.read_auth().await?;
        let name = &r.get_ref().role;
        let role = state.roles.get(name).ok_or_else(|| AuthError::RoleNotFound.status())?;
        let mut resp = PbAuthRoleGetResponse { header: Some(self.header_now()), perm: Vec::new() };
        // The root role may do everything; etcd shows that as READWRITE on every key.
        let all = [Permission { perm: Perm::ReadWrite, key: Vec::new(), range_end: b"\0".to_vec() }];
        let perms = if name == ROOT { &all[..] } else { &role.perms[..] };
        for p in perms {
            resp.perm.push(Default::default());
            if let Some(out) = resp.perm.last_mut() {
                out.perm_type = p.perm.to_i32();
                out.key = p.key.clone();
                out.range_end = p.range_end.clone();
            }
        }
        Ok(GrpcResponse::new(resp))
    }

    async fn role_list(
        &self,
        r: GrpcRequest<PbAuthRoleListRequest>,
    ) -> Result<GrpcResponse<PbAuthRoleListResponse>, Status> {
        self.require_root(r.metadata())?;
        let state = self.read_auth().await?;
        let roles = state.roles.keys().cloned().collect();
        Ok(GrpcResponse::new(PbAuthRoleListResponse { header: Some(self.header_now()), roles }))
    }

    async fn role_delete(
        &self,
        r: GrpcRequest<PbAuthRoleDeleteRequest>,
    ) -> Result<GrpcResponse<PbAuthRoleDeleteResponse>, Status> {
        let stamp = self.require_root(r.metadata())?;
        let header = self.propose_auth(AuthOp::RoleDelete { name: r.into_inner().role }, stamp).await?;
        Ok(GrpcResponse::new(PbAuthRoleDeleteResponse { header: Some(header) }))
    }

    async fn role_grant_permission(
        &self,
        r: GrpcRequest<PbAuthRoleGrantPermissionRequest>,
    ) -> Result<GrpcResponse<PbAuthRoleGrantPermissionResponse>, Status> {
        let stamp = self.require_root(r.metadata())?;
        let r = r.into_inner();
        let Some(p) = r.perm else { return Err(AuthError::PermissionNotGiven.status()) };
        let Some(perm) = Perm::from_i32(p.perm_type) else { return Err(AuthError::InvalidAuthMgmt.status()) };
        let perm = Permission { perm, key: p.key, range_end: p.range_end };
        let header = self.propose_auth(AuthOp::RoleGrantPermission { name: r.name, perm }, stamp).await?;
        Ok(GrpcResponse::new(PbAuthRoleGrantPermissionResponse { header: Some(header) }))
    }

    async fn role_revoke_permission(
        &self,
        r: GrpcRequest<PbAuthRoleRevokePermissionRequest>,
    ) -> Result<GrpcResponse<PbAuthRoleRevokePermissionResponse>, Status> {
        let stamp = self.require_root(r.metadata())?;
        let r = r.into_inner();
        let op = AuthOp::RoleRevokePermission { role: r.role, key: r.key, range_end: r.range_end };
        let header = self.propose_auth(op, stamp).await?;
        Ok(GrpcResponse::new(PbAuthRoleRevokePermissionResponse { header: Some(header) }))
    }
}

/// The `etcdserverpb.Auth` gRPC service.
#[derive(Clone)]
pub struct AuthServer {
    api: Api,
}

impl AuthServer {
    pub fn new(api: Api) -> AuthServer {
        AuthServer { api }
    }
}

impl tonic::server::NamedService for AuthServer {
    const NAME: &'static str = "etcdserverpb.Auth";
}

type Reply<T> = Pin<Box<dyn Future<Output = Result<GrpcResponse<T>, Status>> + Send>>;

/// One unary call: a handler taken once.
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

macro_rules! route {
    ($req:expr, $api:expr, $method:ident) => {
        unary($req, move |r| -> Reply<_> { Box::pin(async move { $api.$method(r).await }) })
    };
}

impl<B> Service<http::Request<B>> for AuthServer
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
            "/etcdserverpb.Auth/AuthEnable" => route!(req, api, auth_enable),
            "/etcdserverpb.Auth/AuthDisable" => route!(req, api, auth_disable),
            "/etcdserverpb.Auth/AuthStatus" => route!(req, api, auth_status),
            "/etcdserverpb.Auth/Authenticate" => route!(req, api, authenticate),
            "/etcdserverpb.Auth/UserAdd" => route!(req, api, user_add),
            "/etcdserverpb.Auth/UserGet" => route!(req, api, user_get),
            "/etcdserverpb.Auth/UserList" => route!(req, api, user_list),
            "/etcdserverpb.Auth/UserDelete" => route!(req, api, user_delete),
            "/etcdserverpb.Auth/UserChangePassword" => route!(req, api, user_change_password),
            "/etcdserverpb.Auth/UserGrantRole" => route!(req, api, user_grant_role),
            "/etcdserverpb.Auth/UserRevokeRole" => route!(req, api, user_revoke_role),
            "/etcdserverpb.Auth/RoleAdd" => route!(req, api, role_add),
            "/etcdserverpb.Auth/RoleGet" => route!(req, api, role_get),
            "/etcdserverpb.Auth/RoleList" => route!(req, api, role_list),
            "/etcdserverpb.Auth/RoleDelete" => route!(req, api, role_delete),
            "/etcdserverpb.Auth/RoleGrantPermission" => route!(req, api, role_grant_permission),
            "/etcdserverpb.Auth/RoleRevokePermission" => route!(req, api, role_revoke_permission),
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
