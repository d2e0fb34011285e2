//! etcd's Lock and Election services on three in-process members, driven by the `etcd-client`
//! crate's `LockClient` and `ElectionClient`: a second locker waits for the first, a lock is
//! lost with its lease, a waiter whose client goes away leaves no key; campaign, leader,
//! proclaim, observe and resign; etcd's errors (code `Unknown`, etcd's texts); auth on the
//! lock's keys.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use etcd_client::{
    Client, ConnectOptions, GetOptions, LeaderKey, LeaseTimeToLiveOptions, LockOptions, Permission, ProclaimOptions,
    ResignOptions,
};
use keel_cluster::{ServeConfig, Server};

mod common;

const PORTS: (u16, u16) = (26790, 26800);

fn config(dir: &Path, ip: &str, names: &[&str], i: usize) -> ServeConfig {
    common::member_config(dir, "http", ip, PORTS, names, i, "lockelect")
}

fn url(ip: &str, i: usize) -> String {
    format!("http://{ip}:{}", PORTS.0 as usize + i)
}

/// Three members; the indexes of the leader and of a follower.
async fn start_cluster(dir: &Path, ip: &str) -> (Vec<Option<Server>>, usize, usize) {
    let names = ["c1", "c2", "c3"];
    let mut servers = Vec::new();
    for i in 0..3 {
        servers.push(Some(common::start_retrying(config(dir, ip, &names, i), 30).await));
    }
    let leader = common::wait_leader(&servers, 30).await;
    let at = |want: bool| servers.iter().position(|s| s.as_ref().is_some_and(|s| (s.node.id == leader) == want));
    let (leader, follower) = (at(true).unwrap(), at(false).unwrap());
    (servers, leader, follower)
}

async fn stop_all(servers: Vec<Option<Server>>) {
    for s in servers.into_iter().flatten() {
        s.stop().await;
    }
}

async fn grant(c: &Client) -> i64 {
    c.clone().lease_grant(30, None).await.unwrap().id()
}

async fn client(url: &str) -> Client {
    Client::connect([url], None).await.expect("connect")
}

/// The gRPC status of a failed call.
fn status<T>(r: Result<T, etcd_client::Error>) -> tonic::Status {
    match r {
        Err(etcd_client::Error::GRpcStatus(s)) => s,
        Err(other) => panic!("not a gRPC status: {other}"),
        Ok(_) => panic!("the call succeeded"),
    }
}

/// etcd's Lock and Election services send every error as `Unknown` with etcd's text.
fn assert_etcd_error<T>(r: Result<T, etcd_client::Error>, text: &str) {
    let s = status(r);
    assert_eq!((s.code(), s.message()), (tonic::Code::Unknown, text));
}

/// The session key etcd makes: `name/` and the lease id in hex.
fn key_of(name: &str, lease: i64) -> Vec<u8> {
    format!("{name}/{lease:x}").into_bytes()
}

/// Whether `f` is still pending after `ms` (it is then polled on by the caller).
async fn still_waiting<T>(f: &mut tokio::task::JoinHandle<T>, ms: u64) -> bool {
    tokio::time::timeout(Duration::from_millis(ms), f).await.is_err()
}

async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), f).await.unwrap_or_else(|_| panic!("timed out: {what}"))
}

/// Waits (at most 10 s) until `key` is absent.
async fn until_gone(c: &mut Client, key: &[u8]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.get(key, None).await.unwrap().count() != 0 {
        assert!(Instant::now() < deadline, "{} is still there", String::from_utf8_lossy(key));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_locker_waits_for_the_first_and_a_lock_goes_with_its_lease() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(101);
    // Holders through the leader, waiters through a follower (whose hub wakes them).
    let (servers, leader, follower) = start_cluster(dir.path(), &ip).await;
    let mut c0 = client(&url(&ip, leader)).await;
    let c1 = client(&url(&ip, follower)).await;
    let (l1, l2) = (grant(&c0).await, grant(&c0).await);

    // Uncontended: the key is name/<lease in hex>, held at once.
    let mut locks = c0.lock_client();
    let first = locks.lock("foo", Some(LockOptions::new().with_lease(l1))).await.unwrap();
    assert_eq!(first.key(), key_of("foo", l1));
    // The second locker (through another member) waits until the first unlocks.
    let mut other = c1.lock_client();
    let mut second = tokio::spawn(async move { other.lock("foo", Some(LockOptions::new().with_lease(l2))).await });
    assert!(still_waiting(&mut second, 500).await, "locked while the first holder held it");
    locks.unlock(first.key()).await.unwrap();
    let second = within("second lock", second).await.unwrap().unwrap();
    assert_eq!(second.key(), key_of("foo", l2));
    assert!(second.header().unwrap().revision() > first.header().unwrap().revision());
    // Locking again with the held lock's lease is the same lock (etcd reuses the key).
    let again = locks.lock("foo", Some(LockOptions::new().with_lease(l2))).await.unwrap();
    assert_eq!(again.key(), second.key());

    // The holder's lease revoked: its key goes and the next waiter holds the lock.
    let l3 = grant(&c0).await;
    let mut other = c1.lock_client();
    let mut third = tokio::spawn(async move { other.lock("foo", Some(LockOptions::new().with_lease(l3))).await });
    assert!(still_waiting(&mut third, 300).await);
    c0.lease_revoke(l2).await.unwrap();
    let third = within("third lock", third).await.unwrap().unwrap();
    assert_eq!(third.key(), key_of("foo", l3));

    // A waiter whose own lease goes while it waits fails as etcd's does once its turn comes.
    let l4 = grant(&c0).await;
    let mut other = c1.lock_client();
    let mut fourth = tokio::spawn(async move { other.lock("foo", Some(LockOptions::new().with_lease(l4))).await });
    assert!(still_waiting(&mut fourth, 300).await);
    c0.lease_revoke(l4).await.unwrap();
    locks.unlock(third.key()).await.unwrap();
    assert_etcd_error(within("fourth lock", fourth).await.unwrap(), "mutex: session is expired");

    // An unknown lease; no lease at all: etcd makes a session lease of 60 s for it.
    assert_etcd_error(
        locks.lock("foo", Some(LockOptions::new().with_lease(0x7777))).await,
        "etcdserver: requested lease not found",
    );
    let own = locks.lock("bar", None).await.unwrap();
    let kv = c0.get(own.key(), None).await.unwrap().kvs()[0].clone();
    assert_eq!(own.key(), key_of("bar", kv.lease()));
    let ttl = c0.lease_time_to_live(kv.lease(), Some(LeaseTimeToLiveOptions::new())).await.unwrap();
    assert_eq!(ttl.granted_ttl(), 60);
    locks.unlock(own.key()).await.unwrap();
    assert_eq!(c0.get(own.key(), None).await.unwrap().count(), 0);

    // A waiter whose client goes away takes its key with it, as etcd's does.
    let (l5, l6) = (grant(&c0).await, grant(&c0).await);
    let held = locks.lock("gone", Some(LockOptions::new().with_lease(l5))).await.unwrap();
    let mut other = c1.lock_client();
    let waiter = other.lock("gone", Some(LockOptions::new().with_lease(l6)));
    assert!(tokio::time::timeout(Duration::from_millis(500), waiter).await.is_err());
    until_gone(&mut c0, &key_of("gone", l6)).await;
    let left = c0.get("gone/", Some(GetOptions::new().with_prefix())).await.unwrap();
    assert_eq!(left.kvs().iter().map(|kv| kv.key().to_vec()).collect::<Vec<_>>(), vec![held.key().to_vec()]);
    stop_all(servers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn campaign_leader_proclaim_observe_and_resign_follow_etcd() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(102);
    // Holders through the leader, waiters through a follower (whose hub wakes them).
    let (servers, leader, follower) = start_cluster(dir.path(), &ip).await;
    let mut c0 = client(&url(&ip, leader)).await;
    let c1 = client(&url(&ip, follower)).await;
    let mut e = c0.election_client();
    let l1 = grant(&c0).await;
    let l2 = grant(&c0).await;

    assert_etcd_error(e.leader("e").await, "election: no leader");
    // A request over the member's request size limit is refused by gRPC as the KV service
    // refuses one (tonic's OutOfRange where etcd's gRPC says ResourceExhausted).
    let big = status(e.campaign("e", vec![b'x'; 200 * 1024], l1).await);
    let put = status(c0.put("e-big", vec![b'x'; 200 * 1024], None).await);
    assert_eq!(big.code(), put.code());
    assert!(big.message().contains("the limit is: 131072 bytes"), "{big}");
    // Observe from before the first campaign, through another member.
    let mut observe = c1.election_client().observe("e").await.unwrap();

    let won = e.campaign("e", "v1", l1).await.unwrap();
    let one = won.leader().unwrap().clone();
    assert_eq!((one.name(), one.key(), one.lease()), (&b"e"[..], &key_of("e", l1)[..], l1));
    assert_eq!(one.rev(), won.header().unwrap().revision());
    let mut other = c1.election_client();
    let mut second = tokio::spawn(async move { other.campaign("e", "v2", l2).await });
    assert!(still_waiting(&mut second, 500).await, "elected while the first leader led");

    e.proclaim("v1b", Some(ProclaimOptions::new().with_leader(one.clone()))).await.unwrap();
    let now = e.leader("e").await.unwrap();
    assert_eq!(now.kv().unwrap().value(), b"v1b");
    // A proclaim by a key that does not lead, or with no key at all.
    let pretender = LeaderKey::new().with_name("e").with_key(key_of("e", l2)).with_rev(one.rev());
    assert_etcd_error(
        e.proclaim("x", Some(ProclaimOptions::new().with_leader(pretender))).await,
        "election: not leader",
    );
    assert_etcd_error(e.proclaim("x", None).await, "\"leader\" field must be provided");
    assert_etcd_error(e.resign(None).await, "\"leader\" field must be provided");

    e.resign(Some(ResignOptions::new().with_leader(one.clone()))).await.unwrap();
    let won2 = within("second campaign", second).await.unwrap().unwrap();
    let two = won2.leader().unwrap().clone();
    assert_eq!(two.key(), key_of("e", l2));
    assert!(won2.header().unwrap().revision() > won.header().unwrap().revision());
    assert_eq!(e.leader("e").await.unwrap().kv().unwrap().value(), b"v2");
    // Resigning again with the old key changes nothing; proclaiming with it is refused.
    e.resign(Some(ResignOptions::new().with_leader(one.clone()))).await.unwrap();
    assert_etcd_error(e.proclaim("x", Some(ProclaimOptions::new().with_leader(one))).await, "election: not leader");
    e.proclaim("v2b", Some(ProclaimOptions::new().with_leader(two.clone()))).await.unwrap();
    // The leader's lease campaigns again with another value: same place, the new value.
    let again = e.campaign("e", "v2c", l2).await.unwrap();
    let again = again.leader().unwrap();
    assert_eq!((again.key(), again.rev()), (two.key(), two.rev()));

    // The observer saw each leader and each value, in order.
    let mut seen = Vec::new();
    while seen.len() < 5 {
        let m = within("observe", observe.message()).await.unwrap().expect("observe stream ended");
        seen.push(String::from_utf8(m.kv().unwrap().value().to_vec()).unwrap());
    }
    assert_eq!(seen, ["v1", "v1b", "v2", "v2b", "v2c"]);

    // The leader's lease revoked: no leader, and the observer is not told anything.
    c0.lease_revoke(l2).await.unwrap();
    assert_etcd_error(e.leader("e").await, "election: no leader");
    assert!(tokio::time::timeout(Duration::from_millis(300), observe.message()).await.is_err());

    // A campaigner whose client goes away resigns, as etcd's does.
    let (l3, l4) = (grant(&c0).await, grant(&c0).await);
    let three = e.campaign("e", "v3", l3).await.unwrap();
    let m = within("observe v3", observe.message()).await.unwrap().unwrap();
    assert_eq!(m.kv().unwrap().value(), b"v3");
    let mut other = c1.election_client();
    assert!(tokio::time::timeout(Duration::from_millis(500), other.campaign("e", "v4", l4)).await.is_err());
    until_gone(&mut c0, &key_of("e", l4)).await;
    assert_eq!(e.leader("e").await.unwrap().kv().unwrap().key(), three.leader().unwrap().key());
    stop_all(servers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_auth_on_a_lock_needs_the_callers_permission_on_its_keys() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(103);
    let (servers, leader, follower) = start_cluster(dir.path(), &ip).await;
    let mut open = client(&url(&ip, leader)).await;
    open.user_add("root", "rootpw", None).await.unwrap();
    open.user_grant_role("root", "root").await.unwrap();
    open.role_add("locker").await.unwrap();
    open.role_grant_permission("locker", Permission::read_write("mine/").with_prefix()).await.unwrap();
    open.user_add("bob", "bob-Pa55word-xyzzy", None).await.unwrap();
    open.user_grant_role("bob", "locker").await.unwrap();
    let lease = open.lease_grant(30, None).await.unwrap().id();
    open.auth_enable().await.unwrap();

    let options = ConnectOptions::new().with_user("bob", "bob-Pa55word-xyzzy");
    let bob = Client::connect([url(&ip, follower)], Some(options)).await.unwrap();
    let mut locks = bob.lock_client();
    assert_etcd_error(
        locks.lock("theirs", Some(LockOptions::new().with_lease(lease))).await,
        "etcdserver: permission denied",
    );
    assert_etcd_error(open.lock_client().lock("mine", None).await, "etcdserver: user name is empty");
    let held = locks.lock("mine", Some(LockOptions::new().with_lease(lease))).await.unwrap();
    assert_eq!(held.key(), key_of("mine", lease));
    let mut e = bob.election_client();
    assert_etcd_error(e.leader("theirs").await, "etcdserver: permission denied");
    locks.unlock(held.key()).await.unwrap();
    stop_all(servers).await;
}
