//! Three members in one process on loopback, driven by the `etcd-client` crate: etcd's
//! authentication and authorization — the root rules, key-range permissions on every KV
//! request, tokens that work on every member and die with their user or password, requests
//! refused at apply when auth changed after they were checked, and no password on disk.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::path::Path;
use std::time::{Duration, Instant};

use etcd_client::proto::{PbPutRequest, PbRangeRequest, PbRangeResponse};
use etcd_client::{Client, Compare, CompareOp, ConnectOptions, GetOptions, Permission, Txn, TxnOp};
use keel_cluster::auth::{AuthError, AuthStamp, User, USERS};
use keel_cluster::types::{ApplyError, Request, RequestKind, Response};
use keel_cluster::{ServeConfig, Server};
use prost::Message;

mod common;

fn config(dir: &Path, ip: &str, names: &[&str], i: usize) -> ServeConfig {
    common::member_config(dir, "http", ip, (24790, 24800), names, i, "auth")
}

async fn start_cluster(dir: &Path, ip: &str, token_ttl: Duration) -> Vec<Option<Server>> {
    let names = ["a1", "a2", "a3"];
    let mut servers = Vec::new();
    for i in 0..3 {
        let cfg = ServeConfig { auth_token_ttl: token_ttl, ..config(dir, ip, &names, i) };
        servers.push(Some(common::start_retrying(cfg, 20).await));
    }
    common::wait_leader(&servers, 20).await;
    servers
}

async fn client(url: &str, user: Option<(&str, &str)>) -> Result<Client, etcd_client::Error> {
    let options = user.map(|(u, p)| ConnectOptions::new().with_user(u, p));
    Client::connect([url], options).await
}

/// The gRPC status of a failed call.
fn status(e: etcd_client::Error) -> tonic::Status {
    match e {
        etcd_client::Error::GRpcStatus(s) => s,
        other => panic!("not a gRPC status: {other}"),
    }
}

fn assert_refused<T>(r: Result<T, etcd_client::Error>, code: tonic::Code, message: &str) {
    let Err(e) = r else { panic!("must be refused: {message}") };
    let s = status(e);
    assert_eq!((s.code(), s.message()), (code, message));
}

const DENIED: &str = "etcdserver: permission denied";

/// A Range sent to `url` with `token` in its metadata, as clientv3 sends it (etcd-client cannot
/// take a token obtained elsewhere).
async fn range_with_token(url: &str, token: &str, key: &str) -> Result<PbRangeResponse, tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string()).unwrap().connect().await.unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let mut request = tonic::Request::new(PbRangeRequest { key: key.into(), ..Default::default() });
    request.metadata_mut().insert("token", token.parse().unwrap());
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/etcdserverpb.KV/Range");
    let codec = tonic_prost::ProstCodec::<PbRangeRequest, PbRangeResponse>::default();
    grpc.unary(request, path, codec).await.map(|r| r.into_inner())
}

/// Waits up to 20 s for `token` to be refused on `url` (the member may apply the change that
/// kills it a moment after the member that answered the change).
async fn wait_refused(url: &str, token: &str) -> tonic::Status {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match range_with_token(url, token, "ro/a").await {
            Err(s) => return s,
            Ok(_) => assert!(Instant::now() < deadline, "token still accepted on {url}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn token_of(url: &str, user: &str, password: &str) -> String {
    let c = client(url, None).await.unwrap();
    c.auth_client().authenticate(user.into(), password.into()).await.unwrap().token().to_string()
}

/// Every file under `dir`, read whole.
fn files_under(dir: &Path, out: &mut Vec<(std::path::PathBuf, Vec<u8>)>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files_under(&path, out);
        } else if let Ok(bytes) = std::fs::read(&path) {
            out.push((path, bytes));
        }
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn auth_rules_permissions_and_tokens_hold_on_every_member() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(70);
    let servers = start_cluster(dir.path(), &ip, Duration::from_secs(300)).await;
    let url = |i: usize| format!("http://{ip}:{}", 24790 + i);
    let mut open = client(&url(0), None).await.unwrap();

    // Enable needs the user root, holding the role root.
    assert_refused(open.auth_enable().await, tonic::Code::FailedPrecondition, "etcdserver: root user does not exist");
    open.user_add("root", "rootpw", None).await.unwrap();
    assert_refused(
        open.auth_enable().await,
        tonic::Code::FailedPrecondition,
        "etcdserver: root user does not have root role",
    );
    open.user_grant_role("root", "root").await.unwrap();
    open.put("ro/a", "1", None).await.unwrap();
    open.put("other/x", "1", None).await.unwrap();
    open.auth_enable().await.unwrap();

    // Without a token nothing passes; root may do everything, on any member.
    assert_refused(open.put("k", "v", None).await, tonic::Code::InvalidArgument, "etcdserver: user name is empty");
    assert_refused(open.get("ro/a", None).await, tonic::Code::InvalidArgument, "etcdserver: user name is empty");
    // As etcd's requireAuthInfo: member list, status and the alarm list need a user too.
    let empty = "etcdserver: user name is empty";
    assert_refused(open.member_list().await, tonic::Code::InvalidArgument, empty);
    assert_refused(open.status().await, tonic::Code::InvalidArgument, empty);
    assert_refused(
        open.alarm(etcd_client::AlarmAction::Get, etcd_client::AlarmType::None, None).await,
        tonic::Code::InvalidArgument,
        empty,
    );
    let mut root = client(&url(1), Some(("root", "rootpw"))).await.unwrap();
    assert_eq!(root.get("ro/a", None).await.unwrap().kvs()[0].value(), b"1");
    // Root cannot lose its role or be deleted while auth is on.
    assert_refused(
        root.user_revoke_role("root", "root").await,
        tonic::Code::InvalidArgument,
        "etcdserver: invalid auth management",
    );
    assert_refused(root.user_delete("root").await, tonic::Code::InvalidArgument, "etcdserver: invalid auth management");

    // alice may read the prefix ro/ and nothing else.
    root.role_add("reader").await.unwrap();
    root.role_grant_permission("reader", Permission::read("ro/").with_prefix()).await.unwrap();
    root.user_add("alice", "alice-Pa55word-xyzzy", None).await.unwrap();
    root.user_grant_role("alice", "reader").await.unwrap();
    assert_refused(
        root.user_grant_role("alice", "nope").await,
        tonic::Code::FailedPrecondition,
        "etcdserver: role name not found",
    );
    assert_refused(
        root.user_add("alice", "x", None).await,
        tonic::Code::FailedPrecondition,
        "etcdserver: user name already exists",
    );
    let mut alice = client(&url(2), Some(("alice", "alice-Pa55word-xyzzy"))).await.unwrap();
    assert_eq!(alice.get("ro/a", None).await.unwrap().kvs()[0].value(), b"1");
    assert_eq!(alice.get("ro/", Some(GetOptions::new().with_prefix())).await.unwrap().count(), 1);
    let before = root.get("", Some(GetOptions::new().with_all_keys())).await.unwrap();
    assert_refused(alice.get("other/x", None).await, tonic::Code::PermissionDenied, DENIED);
    assert_refused(alice.get("", Some(GetOptions::new().with_all_keys())).await, tonic::Code::PermissionDenied, DENIED);
    assert_refused(alice.put("ro/b", "2", None).await, tonic::Code::PermissionDenied, DENIED);
    assert_refused(alice.put("other/y", "2", None).await, tonic::Code::PermissionDenied, DENIED);
    assert_refused(alice.delete("ro/a", None).await, tonic::Code::PermissionDenied, DENIED);
    // A txn is refused if any compare or op leaves the permission, even on the branch not taken.
    let outside_compare =
        Txn::new().when([Compare::value("other/x", CompareOp::Equal, "1")]).and_then([TxnOp::get("ro/a", None)]);
    assert_refused(alice.txn(outside_compare).await, tonic::Code::PermissionDenied, DENIED);
    let write_op = Txn::new()
        .when([Compare::value("ro/a", CompareOp::Equal, "nope")])
        .and_then([TxnOp::get("ro/a", None)])
        .or_else([TxnOp::put("ro/a", "2", None)]);
    assert_refused(alice.txn(write_op).await, tonic::Code::PermissionDenied, DENIED);
    let inside = Txn::new().when([Compare::value("ro/a", CompareOp::Equal, "1")]).and_then([TxnOp::get("ro/a", None)]);
    assert!(alice.txn(inside).await.unwrap().succeeded());
    // Any user may list members and ask for status; a user may read itself and its own roles
    // (etcd's UserGet and RoleGet rules), not other users or roles.
    assert_eq!(alice.member_list().await.unwrap().members().len(), 3);
    assert!(alice.status().await.unwrap().leader() != 0);
    assert_eq!(alice.user_get("alice").await.unwrap().roles(), ["reader".to_string()]);
    assert_eq!(alice.role_get("reader").await.unwrap().permissions().len(), 1);
    assert_refused(alice.user_get("root").await, tonic::Code::PermissionDenied, DENIED);
    assert_refused(alice.role_get("root").await, tonic::Code::PermissionDenied, DENIED);
    // Admin RPCs need root.
    assert_refused(alice.compact(1, None).await, tonic::Code::PermissionDenied, DENIED);
    assert_refused(alice.user_list().await, tonic::Code::PermissionDenied, DENIED);
    assert_refused(alice.auth_disable().await, tonic::Code::PermissionDenied, DENIED);
    // Nothing refused changed anything.
    let after = root.get("", Some(GetOptions::new().with_all_keys())).await.unwrap();
    assert_eq!(after.header().unwrap().revision(), before.header().unwrap().revision());
    let pairs = |r: &etcd_client::GetResponse| {
        r.kvs().iter().map(|kv| (kv.key().to_vec(), kv.value().to_vec(), kv.mod_revision())).collect::<Vec<_>>()
    };
    assert_eq!(pairs(&after), pairs(&before));

    // A wrong password, a user that does not exist, a no-password user: authentication fails.
    let failed = "etcdserver: authentication failed, invalid user ID or password";
    assert_refused(client(&url(0), Some(("alice", "wrong"))).await, tonic::Code::InvalidArgument, failed);
    assert_refused(client(&url(0), Some(("nobody", "x"))).await, tonic::Code::InvalidArgument, failed);
    root.user_add("svc", "", Some(etcd_client::UserAddOptions::new().with_no_pwd())).await.unwrap();
    assert_refused(client(&url(0), Some(("svc", ""))).await, tonic::Code::InvalidArgument, failed);

    // A token issued by one member works on the others; a forged one does not.
    let token = token_of(&url(0), "alice", "alice-Pa55word-xyzzy").await;
    for i in 0..3 {
        let r = range_with_token(&url(i), &token, "ro/a").await.unwrap();
        assert_eq!(r.kvs[0].value, b"1");
    }
    let flipped = if token.ends_with('0') { '1' } else { '0' };
    let forged = format!("{}{flipped}", &token[..token.len() - 1]);
    let s = range_with_token(&url(1), &forged, "ro/a").await.unwrap_err();
    assert_eq!((s.code(), s.message()), (tonic::Code::Unauthenticated, "etcdserver: invalid auth token"));

    // A password change kills the user's tokens; so does deleting the user (even re-added).
    root.user_change_password("alice", "alice-second").await.unwrap();
    let s = wait_refused(&url(2), &token).await;
    assert_eq!((s.code(), s.message()), (tonic::Code::Unauthenticated, "etcdserver: invalid auth token"));
    let token = token_of(&url(1), "alice", "alice-second").await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while range_with_token(&url(2), &token, "ro/a").await.is_err() {
        assert!(Instant::now() < deadline, "a fresh token is refused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    root.user_delete("alice").await.unwrap();
    let s = wait_refused(&url(2), &token).await;
    assert_eq!((s.code(), s.message()), (tonic::Code::Unauthenticated, "etcdserver: invalid auth token"));
    root.user_add("alice", "alice-second", None).await.unwrap();
    let s = range_with_token(&url(0), &token, "ro/a").await.unwrap_err();
    assert_eq!(s.code(), tonic::Code::Unauthenticated);

    // A permission revoked between two writes: the second is refused and not applied.
    root.role_add("writer").await.unwrap();
    root.role_grant_permission("writer", Permission::read_write("w/").with_prefix()).await.unwrap();
    root.user_add("wendy", "wendy-pw", None).await.unwrap();
    root.user_grant_role("wendy", "writer").await.unwrap();
    let mut wendy = client(&url(2), Some(("wendy", "wendy-pw"))).await.unwrap();
    wendy.put("w/1", "1", None).await.unwrap();
    root.role_revoke_permission("writer", "w/", Some(etcd_client::RoleRevokePermissionOptions::new().with_prefix()))
        .await
        .unwrap();
    let s = status(wendy.put("w/2", "2", None).await.unwrap_err());
    // Refused when received (the member has applied the revoke) or at apply (it had not yet).
    assert!(s.message() == DENIED || s.message() == "etcdserver: revision of auth store is old", "{s:?}");
    assert_eq!(root.get("w/2", None).await.unwrap().count(), 0);

    // At apply: a write checked at an older auth revision is refused whole, one checked at the
    // current revision applies. (The stamps are what the API puts on requests it checked.)
    let node = &servers[0].as_ref().unwrap().node;
    let current = node.sm.auth.read().revision;
    let put = |key: &str| PbPutRequest { key: key.into(), value: b"v".to_vec(), ..Default::default() }.encode_to_vec();
    let stale = AuthStamp { user: Some("root".into()), revision: current - 1 };
    let r = node.write(Request::with_auth(RequestKind::Put, put("stale"), stale)).await.unwrap();
    assert_eq!(r, Response::Err(ApplyError::Auth(AuthError::AuthOldRevision)));
    // An unstamped entry is a member's own (lease expiry, compaction): only members propose,
    // and the API stamps every client request, so it applies.
    let unstamped = node.write(Request::new(RequestKind::Put, put("unstamped"))).await.unwrap();
    assert!(matches!(unstamped, Response::Ok(_)), "{unstamped:?}");
    let fresh = AuthStamp { user: Some("root".into()), revision: current };
    assert!(matches!(
        node.write(Request::with_auth(RequestKind::Put, put("fresh"), fresh)).await.unwrap(),
        Response::Ok(_)
    ));
    assert_eq!(root.get("stale", None).await.unwrap().count(), 0);
    assert_eq!(root.get("unstamped", None).await.unwrap().count(), 1);
    assert_eq!(root.get("fresh", None).await.unwrap().count(), 1);

    // Passwords are stored as bcrypt hashes, never in clear: not in the store, not in any file
    // of any member (log, WAL, checkpoints, snapshots).
    let txn = node.sm.db.begin_read().unwrap();
    let stored: User = bincode::deserialize(&txn.get(USERS, b"wendy").unwrap().unwrap()).unwrap();
    let hash = stored.password_hash.unwrap();
    assert!(hash.starts_with("$2") && bcrypt::verify("wendy-pw", &hash).unwrap());
    drop(txn);
    let mut files = Vec::new();
    files_under(dir.path(), &mut files);
    assert!(files.iter().any(|(_, b)| contains(b, hash.as_bytes())), "the hash itself is on disk (control)");
    for secret in ["alice-Pa55word-xyzzy", "alice-second", "wendy-pw", "rootpw"] {
        for (path, bytes) in &files {
            assert!(!contains(bytes, secret.as_bytes()), "{secret} in clear in {}", path.display());
        }
    }

    // Disabled again by root: requests without a token pass.
    root.auth_disable().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while open.put("open/again", "1", None).await.is_err() {
        assert!(Instant::now() < deadline, "auth still enabled");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    for s in servers.into_iter().flatten() {
        s.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_token_expires_after_the_token_ttl_on_every_member() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(71);
    // 6 s: a member busy with other tests (debug build, 2 cores) once took over 2 s to apply
    // the auth enable, and a 2 s token had expired before that member ever accepted it.
    let servers = start_cluster(dir.path(), &ip, Duration::from_secs(6)).await;
    let url = |i: usize| format!("http://{ip}:{}", 24790 + i);
    let mut open = client(&url(0), None).await.unwrap();
    open.user_add("root", "rootpw", None).await.unwrap();
    open.user_grant_role("root", "root").await.unwrap();
    open.auth_enable().await.unwrap();
    let token = token_of(&url(0), "root", "rootpw").await;
    let issued = Instant::now();
    // Valid at once everywhere (it may take a member a moment to apply the enable).
    for i in 0..3 {
        let deadline = Instant::now() + Duration::from_secs(20);
        while let Err(s) = range_with_token(&url(i), &token, "k").await {
            assert!(Instant::now() < deadline, "fresh token refused on member {i}: {s:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    for i in 0..3 {
        let s = wait_refused(&url(i), &token).await;
        assert_eq!((s.code(), s.message()), (tonic::Code::Unauthenticated, "etcdserver: invalid auth token"));
    }
    // Not before the TTL (whole seconds: at least one second passed).
    assert!(issued.elapsed() >= Duration::from_secs(1), "expired after {:?}", issued.elapsed());
    // A new Authenticate gives a working token.
    let fresh = token_of(&url(1), "root", "rootpw").await;
    assert!(range_with_token(&url(1), &fresh, "k").await.is_ok());
    for s in servers.into_iter().flatten() {
        s.stop().await;
    }
}

/// The auth state is in the store: a restarted member enforces it, and a backup restored into a
/// new cluster keeps users, roles and auth enabled (as etcd's restore does).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn auth_survives_a_restart_and_a_backup_restore() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(72);
    let mut servers = start_cluster(dir.path(), &ip, Duration::from_secs(300)).await;
    let url = |i: usize| format!("http://{ip}:{}", 24790 + i);
    let mut open = client(&url(0), None).await.unwrap();
    open.user_add("root", "rootpw", None).await.unwrap();
    open.user_grant_role("root", "root").await.unwrap();
    open.role_add("reader").await.unwrap();
    open.role_grant_permission("reader", Permission::read("ro/").with_prefix()).await.unwrap();
    open.user_add("carol", "carol-pw", None).await.unwrap();
    open.user_grant_role("carol", "reader").await.unwrap();
    open.put("ro/a", "1", None).await.unwrap();
    open.auth_enable().await.unwrap();
    let token = token_of(&url(0), "carol", "carol-pw").await;

    // Member 2 restarted: it reloads the auth state from its store; the old token still works
    // there (the key is in the store) and carol is still refused writes.
    let names = ["a1", "a2", "a3"];
    servers[2].take().unwrap().stop().await;
    servers[2] = Some(common::start_retrying(config(dir.path(), &ip, &names, 2), 20).await);
    common::wait_leader(&servers, 20).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let got = loop {
        match range_with_token(&url(2), &token, "ro/a").await {
            Ok(r) => break r,
            Err(s) => assert!(Instant::now() < deadline, "token refused after restart: {s:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(got.kvs[0].value, b"1");
    let mut carol = client(&url(2), Some(("carol", "carol-pw"))).await.unwrap();
    assert_refused(carol.put("ro/a", "2", None).await, tonic::Code::PermissionDenied, DENIED);

    let root = client(&url(1), Some(("root", "rootpw"))).await.unwrap();
    let mut stream = root.maintenance_client().snapshot().await.unwrap();
    let mut bytes = Vec::new();
    while let Some(chunk) = stream.message().await.unwrap() {
        bytes.extend_from_slice(chunk.blob());
    }
    for s in servers.into_iter().flatten() {
        s.stop().await;
    }
    let new_dir = tempfile::tempdir().unwrap();
    let new_ip = common::loopback_ip(73);
    let cfg = ServeConfig { initial_cluster_token: "restored".into(), ..config(new_dir.path(), &new_ip, &["r1"], 0) };
    keel_cluster::restore_snapshot(&cfg, &bytes).unwrap();
    let server = common::start_retrying(cfg, 20).await;
    let new_url = format!("http://{new_ip}:24790");
    let mut anonymous = client(&new_url, None).await.unwrap();
    assert_refused(anonymous.get("ro/a", None).await, tonic::Code::InvalidArgument, "etcdserver: user name is empty");
    let mut carol = client(&new_url, Some(("carol", "carol-pw"))).await.unwrap();
    assert_eq!(carol.get("ro/a", None).await.unwrap().kvs()[0].value(), b"1");
    assert_refused(carol.put("ro/b", "1", None).await, tonic::Code::PermissionDenied, DENIED);
    server.stop().await;
}

/// With auth on, leases and watches are checked too, and the leader's own lease expiry (an
/// unstamped, member-internal revoke) still applies: a leased key goes when its lease expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leases_and_watches_are_checked_and_expiry_still_applies_under_auth() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(74);
    let servers = start_cluster(dir.path(), &ip, Duration::from_secs(300)).await;
    let url = |i: usize| format!("http://{ip}:{}", 24790 + i);
    let mut open = client(&url(0), None).await.unwrap();
    open.user_add("root", "rootpw", None).await.unwrap();
    open.user_grant_role("root", "root").await.unwrap();
    open.user_add("reader", "readpw", None).await.unwrap();
    open.role_add("app-read").await.unwrap();
    open.role_grant_permission("app-read", Permission::read("app/").with_prefix()).await.unwrap();
    open.user_grant_role("reader", "app-read").await.unwrap();
    open.auth_enable().await.unwrap();

    // No token: refused before anything is proposed.
    let mut anon = client(&url(1), None).await.unwrap();
    assert_refused(anon.lease_grant(30, None).await, tonic::Code::InvalidArgument, "etcdserver: user name is empty");

    let mut root = client(&url(1), Some(("root", "rootpw"))).await.unwrap();
    let lease = root.lease_grant(1, None).await.unwrap().id();
    root.put("app/x", "v", Some(etcd_client::PutOptions::new().with_lease(lease))).await.unwrap();

    // A reader may watch its prefix but not another range, and may not revoke a lease whose
    // key it cannot write.
    let mut reader = client(&url(2), Some(("reader", "readpw"))).await.unwrap();
    let mut ok = reader.watch("app/", Some(etcd_client::WatchOptions::new().with_prefix())).await.unwrap();
    let created = ok.message().await.unwrap().unwrap();
    assert!(created.created() && !created.canceled(), "{created:?}");
    let mut denied = reader.watch("secret", None).await.unwrap();
    let refused = denied.message().await.unwrap().unwrap();
    // The cancel reason is the gRPC error as etcd writes it, so clientv3 maps it back to
    // rpctypes.ErrGRPCPermissionDenied.
    assert!(refused.canceled(), "{refused:?}");
    assert_eq!(refused.cancel_reason(), "rpc error: code = PermissionDenied desc = etcdserver: permission denied");
    assert_refused(reader.lease_revoke(lease).await, tonic::Code::PermissionDenied, DENIED);
    // A lease's keys are shown only to whoever may read them all; the list of leases likewise.
    let secret_lease = root.lease_grant(60, None).await.unwrap().id();
    root.put("secret/k", "v", Some(etcd_client::PutOptions::new().with_lease(secret_lease))).await.unwrap();
    let keys = || Some(etcd_client::LeaseTimeToLiveOptions::new().with_keys());
    assert_refused(reader.lease_time_to_live(secret_lease, keys()).await, tonic::Code::PermissionDenied, DENIED);
    assert!(reader.lease_time_to_live(secret_lease, None).await.unwrap().ttl() > 0);
    assert_refused(reader.leases().await, tonic::Code::PermissionDenied, DENIED);
    assert_eq!(root.lease_time_to_live(secret_lease, keys()).await.unwrap().keys(), [b"secret/k".to_vec()]);
    assert!(root.leases().await.unwrap().leases().iter().any(|l| l.id() == secret_lease));
    root.lease_revoke(secret_lease).await.unwrap();

    // Nobody keeps the lease alive: the leader's expiry revoke applies although it carries no
    // user, and the reader's watch sees the delete.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let msg = tokio::time::timeout(deadline - Instant::now(), ok.message()).await;
        let resp = msg.expect("the leased key was never deleted").unwrap().unwrap();
        if resp.events().iter().any(|e| e.event_type() == etcd_client::EventType::Delete) {
            break;
        }
    }
    assert_eq!(root.get("app/x", None).await.unwrap().count(), 0);
    for s in servers.into_iter().flatten() {
        s.stop().await;
    }
}
