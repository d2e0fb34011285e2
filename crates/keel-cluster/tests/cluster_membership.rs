//! Membership through etcd's Cluster API as etcd does it, on members in one process: a voter
//! added to one member answered at once, learners and promotion, new peer URLs, the strict
//! reconfiguration check, a removed member stopping, and the last member kept.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::path::Path;
use std::time::{Duration, Instant};

use etcd_client::{Client, GetOptions, MemberAddOptions};
mod common;

use keel_cluster::{ServeConfig, Server};

const PORTS: (u16, u16) = (25790, 25800);

fn config(dir: &Path, ip: &str, names: &[&str], i: usize) -> ServeConfig {
    common::member_config(dir, "http", ip, PORTS, names, i, "membership")
}

/// Member `i` of `names` joining a running cluster (`--initial-cluster-state existing`).
fn joiner(dir: &Path, ip: &str, names: &[&str], i: usize) -> ServeConfig {
    ServeConfig { join_existing: true, ..config(dir, ip, names, i) }
}

fn client_url(ip: &str, i: usize) -> String {
    format!("http://{ip}:{}", PORTS.0 as usize + i)
}

fn peer_url(ip: &str, i: usize) -> String {
    format!("http://{ip}:{}", PORTS.1 as usize + i)
}

async fn client(url: &str) -> Client {
    Client::connect([url], None).await.expect("connect")
}

async fn start_cluster(dir: &Path, ip: &str, names: &[&str]) -> Vec<Option<Server>> {
    let mut servers = Vec::new();
    for i in 0..names.len() {
        servers.push(Some(common::start_retrying(config(dir, ip, names, i), 20).await));
    }
    common::wait_leader(&servers, 20).await;
    // Every member started (published its name and client URLs), as etcd's strict check
    // counts them.
    let mut c = client(&client_url(ip, 0)).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let list = c.member_list().await;
        if list.as_ref().is_ok_and(|l| l.members().iter().all(|m| !m.client_urls().is_empty())) {
            break;
        }
        assert!(Instant::now() < deadline, "members never started: {list:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    servers
}

async fn stop_all(servers: Vec<Option<Server>>) {
    for s in servers.into_iter().flatten() {
        s.stop().await;
    }
}

fn status(e: etcd_client::Error) -> tonic::Status {
    match e {
        etcd_client::Error::GRpcStatus(s) => s,
        other => panic!("not a gRPC status: {other}"),
    }
}

fn assert_refused<T: std::fmt::Debug>(r: Result<T, etcd_client::Error>, code: tonic::Code, message: &str) {
    let s = status(r.expect_err(message));
    assert_eq!((s.code(), s.message()), (code, message));
}

const UNHEALTHY: &str = "etcdserver: unhealthy cluster";
const NOT_ENOUGH_STARTED: &str = "etcdserver: re-configuration failed due to not enough started members";

/// Retries `op` while it is refused as unhealthy (peers not yet connected for etcd's 5 s),
/// for at most 20 s.
async fn when_healthy<T, F, Fut>(mut op: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
{
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match op().await {
            Ok(v) => return v,
            Err(etcd_client::Error::GRpcStatus(s)) if s.message() == UNHEALTHY && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => panic!("refused: {e}"),
        }
    }
}

/// Waits up to 20 s until `url` serves `key` with `value` from its own state.
async fn wait_value(url: &str, key: &str, value: &[u8]) {
    let mut c = client(url).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got = c.get(key, Some(GetOptions::new().with_serializable())).await;
        if got.as_ref().is_ok_and(|g| g.kvs().first().is_some_and(|kv| kv.value() == value)) {
            return;
        }
        assert!(Instant::now() < deadline, "{url} never served {key}: {got:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// etcd answers a voter add on one member at once (the change commits under the old
/// configuration); the new member counts in the quorum from then on, so nothing else commits
/// until it runs; started with `existing`, it joins and writes commit again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_voter_added_to_one_member_is_answered_at_once_and_joins_with_existing() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(110);
    let names = ["m1", "m2"];
    let mut servers = start_cluster(dir.path(), &ip, &names[..1]).await;
    let mut c = client(&client_url(&ip, 0)).await;
    c.put("before", "1", None).await.unwrap();

    let added = tokio::time::timeout(Duration::from_secs(5), c.member_add([peer_url(&ip, 1)], None))
        .await
        .expect("member add must answer at once")
        .unwrap();
    let member = added.member().expect("the answer names the added member");
    assert!(!member.is_learner());
    assert_eq!(member.peer_urls(), [peer_url(&ip, 1)]);
    assert_eq!(added.member_list().len(), 2);
    let new_id = member.id();

    // Two voters, one running: a write cannot commit.
    let stuck = tokio::time::timeout(Duration::from_secs(5), c.put("stuck", "x", None)).await;
    assert!(!matches!(stuck, Ok(Ok(_))), "a write committed without the added voter: {stuck:?}");

    let s2 = common::start_retrying(joiner(dir.path(), &ip, &names, 1), 20).await;
    assert_eq!(s2.node.id, new_id);
    servers.push(Some(s2));
    let deadline = Instant::now() + Duration::from_secs(20);
    while c.put("after", "2", None).await.is_err() {
        assert!(Instant::now() < deadline, "writes never committed after the new member joined");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    wait_value(&client_url(&ip, 1), "after", b"2").await;
    wait_value(&client_url(&ip, 1), "before", b"1").await;
    let list = c.member_list().await.unwrap();
    assert!(list.members().iter().any(|m| m.id() == new_id && m.name() == "m2" && !m.is_learner()));
    stop_all(servers).await;
}

/// A learner add answers at once with the member; promotion waits until the learner caught up
/// (etcd's errors before), and a voter cannot be promoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_learner_is_added_at_once_and_promoted_once_in_sync() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(111);
    let names = ["l1", "l2", "l3"];
    let mut servers = start_cluster(dir.path(), &ip, &names[..1]).await;
    let mut c = client(&client_url(&ip, 0)).await;
    for i in 0..100 {
        c.put(format!("k{i}"), "v", None).await.unwrap();
    }
    let learner = MemberAddOptions::new().with_is_learner();
    let added = tokio::time::timeout(Duration::from_secs(5), c.member_add([peer_url(&ip, 1)], Some(learner.clone())))
        .await
        .expect("a learner add must answer at once")
        .unwrap();
    let member = added.member().expect("the answer names the added member");
    assert!(member.is_learner());
    let id = member.id();
    // etcd allows one learner at a time.
    assert_refused(
        c.member_add([peer_url(&ip, 2)], Some(learner)).await,
        tonic::Code::FailedPrecondition,
        "etcdserver: too many learner members in cluster",
    );
    // Not started: it has none of the leader's log.
    assert_refused(
        c.member_promote(id).await,
        tonic::Code::FailedPrecondition,
        "etcdserver: can only promote a learner member which is in sync with leader",
    );
    // Writes still commit with the learner down: it is not in the quorum.
    c.put("with-learner", "1", None).await.unwrap();

    servers.push(Some(common::start_retrying(joiner(dir.path(), &ip, &names, 1), 20).await));
    wait_value(&client_url(&ip, 1), "with-learner", b"1").await;
    let promoted = c.member_promote(id).await.unwrap();
    assert!(promoted.members().iter().any(|m| m.id() == id && !m.is_learner()));
    assert_refused(
        c.member_promote(id).await,
        tonic::Code::FailedPrecondition,
        "etcdserver: can only promote a learner member",
    );
    assert_refused(c.member_promote(0xdead_beef).await, tonic::Code::NotFound, "etcdserver: member not found");
    c.put("promoted", "1", None).await.unwrap();
    wait_value(&client_url(&ip, 1), "promoted", b"1").await;
    stop_all(servers).await;
}

/// `member update` gives a member new peer URLs everywhere; restarted on them, the member is
/// reached there and catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_updated_to_new_peer_urls_restarts_there_and_catches_up() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(112);
    let names = ["u1", "u2", "u3"];
    let mut servers = start_cluster(dir.path(), &ip, &names).await;
    // The member moved is a follower, so that writes go on while it is down.
    let leader = common::wait_leader(&servers, 20).await;
    let at = (0..3).rev().find(|i| servers[*i].as_ref().unwrap().node.id != leader).unwrap();
    let mut c = client(&client_url(&ip, (0..3).find(|i| *i != at).unwrap())).await;
    c.put("a", "1", None).await.unwrap();
    let moved = servers[at].as_ref().unwrap().node.id;
    let new_peer = peer_url(&ip, 5);
    // Another member's URLs are refused, as in etcd.
    assert_refused(
        c.member_update(moved, [peer_url(&ip, (at + 1) % 3)]).await,
        tonic::Code::FailedPrecondition,
        "etcdserver: Peer URLs already exists",
    );
    let updated = c.member_update(moved, [new_peer.clone()]).await.unwrap();
    assert!(updated.members().iter().any(|m| m.id() == moved && m.peer_urls() == [new_peer.clone()]));

    servers[at].take().unwrap().stop().await;
    c.put("while-down", "2", None).await.unwrap();
    let mut cfg = config(dir.path(), &ip, &names, at);
    cfg.listen_peer_urls = vec![new_peer.clone()];
    cfg.initial_advertise_peer_urls = vec![new_peer.clone()];
    cfg.initial_cluster.insert(names[at].into(), vec![new_peer.clone()]);
    servers[at] = Some(common::start_retrying(cfg, 20).await);
    wait_value(&client_url(&ip, at), "while-down", b"2").await;
    // Every member lists the new URL.
    for i in 0..3 {
        let list = client(&client_url(&ip, i)).await.member_list().await.unwrap();
        assert!(list.members().iter().any(|m| m.id() == moved && m.peer_urls() == [new_peer.clone()]), "{i}");
    }
    stop_all(servers).await;
}

/// etcd's `--strict-reconfig-check`: with a member down, an add and the removal of a live
/// member are refused as unhealthy, the down member's removal is not; once it is back and
/// connected for 5 s, an add is accepted. Without the check the add is accepted at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_strict_check_refuses_changes_while_a_member_is_down_and_accepts_after() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(113);
    let names = ["s1", "s2", "s3"];
    let mut servers = start_cluster(dir.path(), &ip, &names).await;
    let leader = common::wait_leader(&servers, 20).await;
    let down = servers.iter().flatten().position(|s| s.node.id != leader).unwrap();
    let live = (0..3).find(|i| *i != down && servers[*i].as_ref().unwrap().node.id != leader).unwrap();
    let live_id = servers[live].as_ref().unwrap().node.id;
    let mut c = client(&client_url(&ip, (0..3).find(|i| *i != down).unwrap())).await;
    // Let every member count as connected first, then stop one.
    let learner = || Some(MemberAddOptions::new().with_is_learner());
    let probe = when_healthy(|| {
        let (mut c, url) = (c.clone(), peer_url(&ip, 7));
        async move { c.member_add([url], learner()).await }
    })
    .await;
    let probe_id = probe.member().unwrap().id();
    c.member_remove(probe_id).await.unwrap();
    servers[down].take().unwrap().stop().await;
    // The leader counts a member as down once it has not answered for an election timeout.
    tokio::time::sleep(Duration::from_secs(2)).await;

    assert_refused(c.member_add([peer_url(&ip, 6)], learner()).await, tonic::Code::Unavailable, UNHEALTHY);
    assert_refused(c.member_remove(live_id).await, tonic::Code::Unavailable, UNHEALTHY);

    servers[down] = Some(common::start_retrying(config(dir.path(), &ip, &names, down), 20).await);
    let added = when_healthy(|| {
        let (mut c, url) = (c.clone(), peer_url(&ip, 6));
        async move { c.member_add([url], learner()).await }
    })
    .await;
    assert!(added.member().unwrap().is_learner());
    stop_all(servers).await;

    // The same with the check off: accepted with a member down.
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(114);
    let mut servers = Vec::new();
    for i in 0..3 {
        let cfg = ServeConfig { strict_reconfig_check: false, ..config(dir.path(), &ip, &names, i) };
        servers.push(Some(common::start_retrying(cfg, 20).await));
    }
    let leader = common::wait_leader(&servers, 20).await;
    let down = servers.iter().flatten().position(|s| s.node.id != leader).unwrap();
    servers[down].take().unwrap().stop().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut c = client(&client_url(&ip, (0..3).find(|i| *i != down).unwrap())).await;
    c.member_add([peer_url(&ip, 6)], learner()).await.unwrap();
    stop_all(servers).await;
}

/// A removed member stops as etcd's does, whether it learns of its removal from the log or
/// from the others; the answer lists the membership after the removal.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_removed_member_stops_and_the_answer_no_longer_lists_it() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(115);
    let names = ["r1", "r2", "r3"];
    let mut servers = start_cluster(dir.path(), &ip, &names).await;
    let leader = common::wait_leader(&servers, 20).await;
    let follower = servers.iter().flatten().position(|s| s.node.id != leader).unwrap();
    let follower_id = servers[follower].as_ref().unwrap().node.id;
    let other = (0..3).find(|i| *i != follower).unwrap();
    let c = client(&client_url(&ip, other)).await;

    let removed = when_healthy(|| {
        let mut c = c.clone();
        async move { c.member_remove(follower_id).await }
    })
    .await;
    assert_eq!(removed.members().len(), 2);
    assert!(!removed.members().iter().any(|m| m.id() == follower_id));
    let gone = servers[follower].take().unwrap();
    tokio::time::timeout(Duration::from_secs(20), gone.node.stopped()).await.expect("the removed member must stop");
    assert!(gone.node.removed.load(std::sync::atomic::Ordering::SeqCst));
    gone.stop().await;

    // The leader removes itself: it answers, then stops; the other member leads alone.
    let leader_at = servers.iter().position(|s| s.as_ref().is_some_and(|s| s.node.id == leader)).unwrap();
    let cl = client(&client_url(&ip, leader_at)).await;
    let removed = when_healthy(|| {
        let mut c = cl.clone();
        async move { c.member_remove(leader).await }
    })
    .await;
    assert_eq!(removed.members().len(), 1);
    let old = servers[leader_at].take().unwrap();
    tokio::time::timeout(Duration::from_secs(20), old.node.stopped()).await.expect("the removed leader must stop");
    assert!(old.node.removed.load(std::sync::atomic::Ordering::SeqCst));
    old.stop().await;
    let rest = servers.iter().position(Option::is_some).unwrap();
    let mut c = client(&client_url(&ip, rest)).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while c.put("alone", "1", None).await.is_err() {
        assert!(Instant::now() < deadline, "the remaining member never took over");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop_all(servers).await;
}

/// etcd refuses to remove the last member (its strict check: no started quorum would be left).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_the_last_member_is_refused_as_etcd_does() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(116);
    let servers = start_cluster(dir.path(), &ip, &["solo"]).await;
    let id = servers[0].as_ref().unwrap().node.id;
    let mut c = client(&client_url(&ip, 0)).await;
    // etcd sends this one with code Unknown (its table maps it to a client-side value).
    assert_refused(c.member_remove(id).await, tonic::Code::Unknown, NOT_ENOUGH_STARTED);
    assert_refused(
        c.member_add(["not a url"], None).await,
        tonic::Code::InvalidArgument,
        "etcdserver: given member URLs are invalid",
    );
    assert_refused(c.member_remove(0xdead_beef).await, tonic::Code::NotFound, "etcdserver: member not found");
    assert_eq!(c.member_list().await.unwrap().members().len(), 1);
    c.put("still", "serving", None).await.unwrap();
    stop_all(servers).await;
}

/// Cuts (or heals) every link between member `id` and the others, both ways; the process
/// keeps running.
fn isolate(ids: &[u64], id: u64, cut: bool) {
    for &other in ids.iter().filter(|o| **o != id) {
        keel_cluster::network::faults::set_cut(id, other, cut);
        keel_cluster::network::faults::set_cut(other, id, cut);
    }
}

/// Moves leadership from `leader` to `target` and waits until both name `target`.
async fn move_leader_to(servers: &[Option<Server>], ip: &str, leader: u64, target: u64) {
    let index = |id: u64| servers.iter().position(|s| s.as_ref().is_some_and(|s| s.node.id == id)).unwrap();
    client(&client_url(ip, index(leader))).await.move_leader(target).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while [leader, target].iter().any(|id| servers[index(*id)].as_ref().unwrap().node.leader() != Some(target)) {
        assert!(Instant::now() < deadline, "{target:x} never led");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Longer than etcd's `HealthInterval` (5 s): every member counts as connected to the others.
const CONNECTED_AFTER: Duration = Duration::from_secs(6);

/// etcd counts a peer as connected from when its transport reached it, whoever led then: right
/// after a leader change, the new leader accepts an add at once (keel used to count from the
/// election and refused every change for 5 s after it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_add_right_after_a_leader_change_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(120);
    let names = ["l1", "l2", "l3"];
    let servers = start_cluster(dir.path(), &ip, &names).await;
    tokio::time::sleep(CONNECTED_AFTER).await;
    let leader = common::wait_leader(&servers, 20).await;
    let target = servers.iter().flatten().map(|s| s.node.id).find(|id| *id != leader).unwrap();
    move_leader_to(&servers, &ip, leader, target).await;

    let at = servers.iter().position(|s| s.as_ref().is_some_and(|s| s.node.id == target)).unwrap();
    let mut c = client(&client_url(&ip, at)).await;
    let learner = Some(MemberAddOptions::new().with_is_learner());
    let added = c.member_add([peer_url(&ip, 6)], learner).await.expect("an add right after a leader change");
    assert!(added.member().unwrap().is_learner());
    // The removal of a live voter too: the two left are connected.
    let other = servers.iter().flatten().map(|s| s.node.id).find(|id| *id != leader && *id != target).unwrap();
    let removed = c.member_remove(other).await.expect("a removal right after a leader change");
    assert!(!removed.members().iter().any(|m| m.id() == other));
    stop_all(servers).await;
}

/// A member that runs but that no message reaches (both ways cut) is not connected, also for
/// a leader elected after the cut that had been in contact with it before: an add and the
/// removal of another live member are refused. Healed, it counts again only 5 s after its
/// return, as in etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_strict_check_refuses_while_a_running_member_is_cut_off() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(121);
    let names = ["k1", "k2", "k3"];
    let servers = start_cluster(dir.path(), &ip, &names).await;
    tokio::time::sleep(CONNECTED_AFTER).await;
    let ids: Vec<u64> = servers.iter().flatten().map(|s| s.node.id).collect();
    let leader = common::wait_leader(&servers, 20).await;
    let target = *ids.iter().find(|id| **id != leader).unwrap();
    let cut = *ids.iter().find(|id| **id != leader && **id != target).unwrap();
    isolate(&ids, cut, true);
    // Longer than an election timeout: the contact has lapsed on every member.
    tokio::time::sleep(Duration::from_secs(1)).await;
    move_leader_to(&servers, &ip, leader, target).await;
    let cut_at = servers.iter().position(|s| s.as_ref().is_some_and(|s| s.node.id == cut)).unwrap();
    let mut c = client(&client_url(&ip, (cut_at + 1) % 3)).await;
    let learner = || Some(MemberAddOptions::new().with_is_learner());

    assert_refused(c.member_add([peer_url(&ip, 6)], learner()).await, tonic::Code::Unavailable, UNHEALTHY);
    assert_refused(c.member_remove(leader).await, tonic::Code::Unavailable, UNHEALTHY);

    isolate(&ids, cut, false);
    // Back, but not yet for 5 s.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_refused(c.member_add([peer_url(&ip, 6)], learner()).await, tonic::Code::Unavailable, UNHEALTHY);
    let added = when_healthy(|| {
        let (mut c, url) = (c.clone(), peer_url(&ip, 6));
        async move { c.member_add([url], learner()).await }
    })
    .await;
    assert!(added.member().unwrap().is_learner());
    stop_all(servers).await;
}

/// A removed follower stops soon, as etcd's does when its peers answer it "removed": its
/// contact probe finds that the leader no longer lists it. The election timeout here is long
/// (3 s), so that the other way a removed member learns it, after hearing from no leader for
/// four election timeouts, cannot come first.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_removed_follower_learns_it_from_its_contact_probe() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(122);
    let names = ["p1", "p2", "p3"];
    let slow = |i| ServeConfig {
        heartbeat_interval: Duration::from_millis(100),
        election_timeout: Duration::from_secs(3),
        strict_reconfig_check: false,
        ..config(dir.path(), &ip, &names, i)
    };
    let mut servers = Vec::new();
    for i in 0..3 {
        servers.push(Some(common::start_retrying(slow(i), 20).await));
    }
    let leader = common::wait_leader(&servers, 30).await;
    let follower = servers.iter().flatten().position(|s| s.node.id != leader).unwrap();
    let follower_id = servers[follower].as_ref().unwrap().node.id;
    let mut c = client(&client_url(&ip, (follower + 1) % 3)).await;
    c.member_remove(follower_id).await.unwrap();
    let removed_at = Instant::now();
    let gone = servers[follower].take().unwrap();
    tokio::time::timeout(Duration::from_secs(20), gone.node.stopped()).await.expect("the removed member must stop");
    let took = removed_at.elapsed();
    assert!(gone.node.removed.load(std::sync::atomic::Ordering::SeqCst));
    assert!(took < Duration::from_secs(9), "stopped after {took:?}: not by its probe");
    gone.stop().await;
    stop_all(servers).await;
}

/// etcd stops at once on SIGTERM when no peer is reached to take over leadership: a member
/// whose added voter never started (its log's last entry cannot commit) and the last running
/// member of three do not wait for a hand-over or an apply that cannot happen.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_graceful_stop_does_not_wait_for_members_that_are_down() {
    // Far longer than the stops may take: waiting for the bound fails the test.
    let bound = Duration::from_secs(60);
    let stop = |s: Server| async move {
        tokio::time::timeout(Duration::from_secs(20), s.stop_gracefully(bound))
            .await
            .expect("waited for a member that is down")
    };
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(123);
    let mut servers = start_cluster(dir.path(), &ip, &["g1"]).await;
    let mut c = client(&client_url(&ip, 0)).await;
    c.member_add([peer_url(&ip, 1)], None).await.unwrap();
    // An open client connection is one the stop rightly waits for.
    drop(c);
    assert_eq!(stop(servers[0].take().unwrap()).await, None);

    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(124);
    let mut servers = start_cluster(dir.path(), &ip, &["h1", "h2", "h3"]).await;
    for s in servers.iter_mut().take(2) {
        stop(s.take().unwrap()).await;
    }
    assert_eq!(stop(servers[2].take().unwrap()).await, None);
}
