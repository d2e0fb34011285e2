//! etcd's leases on three in-process members, driven by the `etcd-client` crate's lease API:
//! grants and their errors, keys attached and deleted with their lease in one revision, expiry
//! decided by the leader, keep-alives through a follower across a leader stop, and leases kept
//! by a member restart and carried by a Raft snapshot.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::path::Path;
use std::time::{Duration, Instant};

use etcd_client::{Client, GetOptions, LeaseGrantOptions, LeaseTimeToLiveOptions, PutOptions, Txn, TxnOp};
use keel_cluster::{ServeConfig, Server};
use openraft::async_runtime::WatchReceiver;

mod common;

const PORTS: (u16, u16) = (25790, 25800);

fn config(dir: &Path, ip: &str, names: &[&str], i: usize) -> ServeConfig {
    common::member_config(dir, "http", ip, PORTS, names, i, "leases")
}

fn url(ip: &str, i: usize) -> String {
    format!("http://{ip}:{}", PORTS.0 as usize + i)
}

async fn start(configs: &[ServeConfig]) -> Vec<Option<Server>> {
    let mut servers = Vec::new();
    for cfg in configs {
        servers.push(Some(common::start_retrying(cfg.clone(), 30).await));
    }
    servers
}

async fn stop_all(servers: Vec<Option<Server>>) {
    for s in servers.into_iter().flatten() {
        s.stop().await;
    }
}

/// Index of a running member that does not lead.
fn follower(servers: &[Option<Server>], leader: u64) -> usize {
    servers.iter().position(|s| s.as_ref().is_some_and(|s| s.node.id != leader)).unwrap()
}

async fn client(url: &str) -> Client {
    Client::connect([url], None).await.expect("connect")
}

fn keys_of(got: &etcd_client::GetResponse) -> Vec<String> {
    got.kvs().iter().map(|kv| String::from_utf8(kv.key().to_vec()).unwrap()).collect()
}

async fn lease_ids(c: &mut Client) -> Vec<i64> {
    let mut ids: Vec<i64> = c.leases().await.unwrap().leases().iter().map(|l| l.id()).collect();
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grants_attached_keys_and_revokes_follow_etcd() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(91);
    let names = ["l1", "l2", "l3"];
    // A 1 s election timeout: etcd's minimum TTL is then ceil(1.5 s) = 2 s.
    let configs: Vec<ServeConfig> = (0..3)
        .map(|i| ServeConfig { election_timeout: Duration::from_millis(1000), ..config(dir.path(), &ip, &names, i) })
        .collect();
    let servers = start(&configs).await;
    let leader = common::wait_leader(&servers, 30).await;
    let mut c = client(&url(&ip, follower(&servers, leader))).await;

    // TTL bounds and ids.
    let big = c.lease_grant(9_000_000_001, None).await.unwrap_err().to_string();
    assert!(big.contains("etcdserver: too large lease TTL"), "{big}");
    let short = c.lease_grant(1, None).await.unwrap();
    assert_eq!(short.ttl(), 2, "a TTL under the minimum is raised to it");
    assert!(short.id() > 0);
    let other = c.lease_grant(30, None).await.unwrap();
    assert!(other.id() > 0 && other.id() != short.id());
    let l = c.lease_grant(30, Some(LeaseGrantOptions::new().with_id(7777))).await.unwrap();
    assert_eq!((l.id(), l.ttl()), (7777, 30));
    let again = c.lease_grant(30, Some(LeaseGrantOptions::new().with_id(7777))).await.unwrap_err().to_string();
    assert!(again.contains("etcdserver: lease already exists"), "{again}");
    assert_eq!(lease_ids(&mut c).await, {
        let mut v = vec![short.id(), other.id(), 7777];
        v.sort();
        v
    });

    // Keys attached by put and by txn; an unknown lease writes nothing.
    c.put("k1", "1", Some(PutOptions::new().with_lease(7777))).await.unwrap();
    c.put("k2", "2", Some(PutOptions::new().with_lease(7777))).await.unwrap();
    c.txn(Txn::new().and_then([TxnOp::put("k3", "3", Some(PutOptions::new().with_lease(7777)))])).await.unwrap();
    let before = c.get("k", Some(GetOptions::new().with_prefix())).await.unwrap();
    let unknown = c.put("k4", "4", Some(PutOptions::new().with_lease(4242))).await.unwrap_err().to_string();
    assert!(unknown.contains("etcdserver: requested lease not found"), "{unknown}");
    let in_txn = c
        .txn(
            Txn::new().and_then([
                TxnOp::put("k5", "5", None),
                TxnOp::put("k6", "6", Some(PutOptions::new().with_lease(4242))),
            ]),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(in_txn.contains("requested lease not found"), "{in_txn}");
    let provided =
        c.put("k1", "x", Some(PutOptions::new().with_lease(7777).with_ignore_lease())).await.unwrap_err().to_string();
    assert!(provided.contains("etcdserver: lease is provided"), "{provided}");
    let after = c.get("k", Some(GetOptions::new().with_prefix())).await.unwrap();
    assert_eq!(after.header().unwrap().revision(), before.header().unwrap().revision(), "nothing was written");
    assert_eq!(keys_of(&after), ["k1", "k2", "k3"]);
    assert!(after.kvs().iter().all(|kv| kv.lease() == 7777));

    // TimeToLive with keys; an unknown lease has TTL -1.
    let ttl = c.lease_time_to_live(7777, Some(LeaseTimeToLiveOptions::new().with_keys())).await.unwrap();
    assert_eq!(ttl.granted_ttl(), 30);
    assert!(ttl.ttl() > 0 && ttl.ttl() <= 30, "remaining {}", ttl.ttl());
    assert_eq!(ttl.keys(), [b"k1".to_vec(), b"k2".to_vec(), b"k3".to_vec()]);
    assert_eq!(c.lease_time_to_live(4242, None).await.unwrap().ttl(), -1);

    // Putting without a lease detaches, and so does a delete (a key deleted and put again
    // without a lease must survive the revoke); put with ignore_lease keeps it.
    c.put("k2", "2b", None).await.unwrap();
    c.put("k0", "0", Some(PutOptions::new().with_lease(7777))).await.unwrap();
    c.delete("k0", None).await.unwrap();
    c.put("k0", "0b", None).await.unwrap();
    c.put("k3", "3b", Some(PutOptions::new().with_ignore_lease())).await.unwrap();
    let ttl = c.lease_time_to_live(7777, Some(LeaseTimeToLiveOptions::new().with_keys())).await.unwrap();
    assert_eq!(ttl.keys(), [b"k1".to_vec(), b"k3".to_vec()]);

    // The revoke deletes k1 and k3 in one revision, and the lease.
    let rev = c.get("k", Some(GetOptions::new().with_prefix())).await.unwrap().header().unwrap().revision();
    let revoked = c.lease_revoke(7777).await.unwrap();
    assert_eq!(revoked.header().unwrap().revision(), rev + 1, "one revision for all of the lease's keys");
    let now = c.get("k", Some(GetOptions::new().with_prefix())).await.unwrap();
    assert_eq!(keys_of(&now), ["k0", "k2"]);
    let just_before = c.get("k", Some(GetOptions::new().with_prefix().with_revision(rev))).await.unwrap();
    assert_eq!(keys_of(&just_before), ["k0", "k1", "k2", "k3"]);
    let gone = c.lease_revoke(7777).await.unwrap_err().to_string();
    assert!(gone.contains("etcdserver: requested lease not found"), "{gone}");
    // A revoke of a lease without keys takes no revision.
    let revoked = c.lease_revoke(other.id()).await.unwrap();
    assert_eq!(revoked.header().unwrap().revision(), rev + 1);
    assert_eq!(lease_ids(&mut c).await, [short.id()]);

    // Keep-alive of an unknown (revoked) lease answers TTL 0, which etcd-client (like
    // clientv3) reports as "lease not found" (it sends one keep-alive and checks the TTL);
    // of a live one, its TTL.
    let unknown = c.lease_keep_alive(7777).await.map(|_| ()).unwrap_err().to_string();
    assert!(unknown.contains("lease not found"), "{unknown}");
    let (mut keeper, mut answers) = c.lease_keep_alive(short.id()).await.unwrap();
    keeper.keep_alive().await.unwrap();
    assert_eq!(answers.message().await.unwrap().unwrap().ttl(), 2);
    stop_all(servers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unrenewed_lease_expires_within_its_ttl_and_one_election_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(92);
    let names = ["e1", "e2", "e3"];
    let configs: Vec<ServeConfig> = (0..3).map(|i| config(dir.path(), &ip, &names, i)).collect();
    let election = configs[0].election_timeout;
    let servers = start(&configs).await;
    let leader = common::wait_leader(&servers, 30).await;
    let mut c = client(&url(&ip, follower(&servers, leader))).await;
    c.put("warm", "1", None).await.unwrap();

    let ttl = Duration::from_secs(2);
    let asked = Instant::now();
    let lease = c.lease_grant(2, None).await.unwrap();
    let granted = Instant::now();
    assert_eq!(lease.ttl(), 2);
    c.put("eph", "1", Some(PutOptions::new().with_lease(lease.id()))).await.unwrap();
    c.put("eph2", "1", Some(PutOptions::new().with_lease(lease.id()))).await.unwrap();
    let rev = c.get("eph", None).await.unwrap().header().unwrap().revision();
    let gone_at = loop {
        let got = c.get("eph", Some(GetOptions::new().with_prefix())).await.unwrap();
        if got.count() == 0 {
            break Instant::now();
        }
        assert!(asked.elapsed() < ttl * 10, "the lease never expired");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // Never before its TTL (the leader's deadline starts when it applies the grant, after the
    // client asked), and within one election timeout after it.
    assert!(gone_at - asked >= ttl, "expired early: {:?}", gone_at - asked);
    assert!(gone_at - granted <= ttl + election, "expired late: {:?} after the grant", gone_at - granted);
    // Both keys went in one revision: the expiry's revoke.
    let now = c.get("eph", None).await.unwrap().header().unwrap().revision();
    assert_eq!(now, rev + 1);
    assert_eq!(c.lease_time_to_live(lease.id(), None).await.unwrap().ttl(), -1);
    assert!(lease_ids(&mut c).await.is_empty());
    stop_all(servers).await;
}

/// Sends keep-alives for `id` through `c` every `every` until `until`; reconnects the stream
/// after an error (a leader change). Returns the TTLs answered; panics if `key` is ever gone.
async fn keep_alive_until(c: &mut Client, id: i64, key: &str, every: Duration, until: Instant) -> Vec<i64> {
    let mut ttls = Vec::new();
    let mut stream = None;
    while Instant::now() < until {
        if stream.is_none() {
            stream = c.lease_keep_alive(id).await.ok();
        }
        if let Some((keeper, answers)) = stream.as_mut() {
            let answered = async {
                keeper.keep_alive().await?;
                answers.message().await
            };
            match tokio::time::timeout(Duration::from_secs(2), answered).await {
                Ok(Ok(Some(a))) => ttls.push(a.ttl()),
                _ => stream = None,
            }
        }
        if let Ok(got) = c.get(key, None).await {
            assert_eq!(got.count(), 1, "the key of a kept-alive lease vanished");
        }
        tokio::time::sleep(every).await;
    }
    ttls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_kept_alive_through_a_follower_is_never_expired_across_a_leader_stop() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(93);
    let names = ["a1", "a2", "a3"];
    let configs: Vec<ServeConfig> = (0..3).map(|i| config(dir.path(), &ip, &names, i)).collect();
    let election = configs[0].election_timeout;
    let mut servers = start(&configs).await;
    let leader = common::wait_leader(&servers, 30).await;
    let f = follower(&servers, leader);
    let mut c = client(&url(&ip, f)).await;
    let lease = c.lease_grant(2, None).await.unwrap();
    c.put("alive", "1", Some(PutOptions::new().with_lease(lease.id()))).await.unwrap();

    // Kept alive through the follower for three TTLs, then the leader stops, then three more.
    let every = Duration::from_millis(500);
    let ttls = keep_alive_until(&mut c, lease.id(), "alive", every, Instant::now() + Duration::from_secs(6)).await;
    assert!(ttls.len() >= 5 && ttls.iter().all(|t| *t == 2), "{ttls:?}");
    let old = servers.iter().position(|s| s.as_ref().is_some_and(|s| s.node.id == leader)).unwrap();
    servers[old].take().unwrap().stop().await;
    let ttls = keep_alive_until(&mut c, lease.id(), "alive", every, Instant::now() + Duration::from_secs(6)).await;
    assert!(!ttls.is_empty() && ttls.iter().all(|t| *t == 2), "never TTL 0 while kept alive: {ttls:?}");
    let new_leader = common::wait_leader(&servers, 30).await;
    assert_ne!(new_leader, leader);
    assert_eq!(c.get("alive", None).await.unwrap().count(), 1);

    // Left alone, the new leader expires it: after at least its TTL, within its TTL plus the
    // election timeout promote adds and one more election timeout.
    let left = Instant::now();
    loop {
        if c.get("alive", None).await.unwrap().count() == 0 {
            break;
        }
        assert!(left.elapsed() < Duration::from_secs(2) + election * 2, "not expired by the new leader");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop_all(servers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leases_survive_a_member_restart_and_travel_in_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(94);
    let names = ["r1", "r2", "r3"];
    let configs: Vec<ServeConfig> = (0..3).map(|i| config(dir.path(), &ip, &names, i)).collect();
    let mut servers = start(&configs).await;
    let leader = common::wait_leader(&servers, 30).await;
    let lagging = follower(&servers, leader);
    let other = (0..3).find(|i| *i != lagging).unwrap();
    let mut c = client(&url(&ip, other)).await;
    c.put("early", "1", None).await.unwrap();
    let mut lc = client(&url(&ip, lagging)).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while lc.get("early", Some(GetOptions::new().with_serializable())).await.map_or(0, |g| g.count()) != 1 {
        assert!(Instant::now() < deadline, "the member to lag never applied the first write");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    servers[lagging].take().unwrap().stop().await;

    // While it is stopped: a lease with keys, a lease revoked with its key, and more entries
    // than the log keeps behind a snapshot (1,000), so it can only catch up from a snapshot.
    let kept = c.lease_grant(600, None).await.unwrap().id();
    let dropped = c.lease_grant(600, None).await.unwrap().id();
    c.put("kept/a", "1", Some(PutOptions::new().with_lease(kept))).await.unwrap();
    c.put("kept/b", "1", Some(PutOptions::new().with_lease(kept))).await.unwrap();
    c.put("dropped/a", "1", Some(PutOptions::new().with_lease(dropped))).await.unwrap();
    c.lease_revoke(dropped).await.unwrap();
    let mut writers = tokio::task::JoinSet::new();
    for w in 0..8 {
        let mut c = c.clone();
        writers.spawn(async move {
            for k in (w..1100).step_by(8) {
                c.put(format!("fill/{k:05}"), "x", None).await.unwrap();
            }
        });
    }
    while let Some(r) = writers.join_next().await {
        r.unwrap();
    }

    servers[lagging] = Some(common::start_retrying(configs[lagging].clone(), 30).await);
    let mut lc = client(&url(&ip, lagging)).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let got = lc.get("fill/", Some(GetOptions::new().with_prefix().with_count_only().with_serializable())).await;
        if got.is_ok_and(|g| g.count() == 1100) {
            break;
        }
        assert!(Instant::now() < deadline, "the lagging member did not catch up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let installed = servers[lagging].as_ref().unwrap().node.raft.metrics().borrow_watched().snapshot;
    assert!(installed.is_some_and(|s| s.index > 1000), "caught up from a snapshot: {installed:?}");
    // Its own store has the lease and its keys (LeaseLeases and serializable reads are local).
    assert_eq!(lease_ids(&mut lc).await, [kept]);
    let local = lc.get("kept/", Some(GetOptions::new().with_prefix().with_serializable())).await.unwrap();
    assert_eq!(keys_of(&local), ["kept/a", "kept/b"]);
    assert!(local.kvs().iter().all(|kv| kv.lease() == kept));
    assert_eq!(lc.get("dropped/", Some(GetOptions::new().with_prefix().with_serializable())).await.unwrap().count(), 0);

    // Every member restarted: the lease, its keys and its key index are still there.
    stop_all(servers).await;
    let servers = start(&configs).await;
    common::wait_leader(&servers, 30).await;
    let mut c = client(&url(&ip, lagging)).await;
    assert_eq!(lease_ids(&mut c).await, [kept]);
    let ttl = c.lease_time_to_live(kept, Some(LeaseTimeToLiveOptions::new().with_keys())).await.unwrap();
    assert_eq!((ttl.granted_ttl(), ttl.keys()), (600, &[b"kept/a".to_vec(), b"kept/b".to_vec()][..]));
    let (mut keeper, mut answers) = c.lease_keep_alive(kept).await.unwrap();
    keeper.keep_alive().await.unwrap();
    assert_eq!(answers.message().await.unwrap().unwrap().ttl(), 600);
    c.lease_revoke(kept).await.unwrap();
    assert_eq!(c.get("kept/", Some(GetOptions::new().with_prefix())).await.unwrap().count(), 0);
    stop_all(servers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_cut_off_from_the_others_stops_renewing_before_the_new_leader_could_expire() {
    use keel_cluster::network::faults;
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(95);
    let names = ["i1", "i2", "i3"];
    let configs: Vec<ServeConfig> = (0..3).map(|i| config(dir.path(), &ip, &names, i)).collect();
    let servers = start(&configs).await;
    let leader = common::wait_leader(&servers, 30).await;
    let at_leader = servers.iter().position(|s| s.as_ref().is_some_and(|s| s.node.id == leader)).unwrap();
    let others: Vec<u64> = servers.iter().flatten().map(|s| s.node.id).filter(|id| *id != leader).collect();
    let mut old = client(&url(&ip, at_leader)).await;
    let mut majority = client(&url(&ip, follower(&servers, leader))).await;
    let ttl = Duration::from_secs(2);
    let lease = old.lease_grant(2, None).await.unwrap().id();
    old.put("held", "1", Some(PutOptions::new().with_lease(lease))).await.unwrap();

    // The old leader is cut off; its client keeps renewing through it for five seconds.
    for o in &others {
        faults::set_cut(leader, *o, true);
        faults::set_cut(*o, leader, true);
    }
    let watcher = tokio::spawn(async move {
        let since = Instant::now();
        loop {
            if majority.get("held", None).await.is_ok_and(|g| g.count() == 0) {
                return Instant::now();
            }
            assert!(since.elapsed() < Duration::from_secs(30), "the majority never expired the lease");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    let until = Instant::now() + Duration::from_secs(5);
    let mut last_renewed = None;
    let mut stream = None;
    while Instant::now() < until {
        if stream.is_none() {
            stream = tokio::time::timeout(Duration::from_secs(3), old.lease_keep_alive(lease)).await.ok();
            if let Some(Ok(_)) = &stream {
                last_renewed = Some(Instant::now());
            }
        }
        if let Some(Ok((keeper, answers))) = stream.as_mut() {
            let sent = async {
                keeper.keep_alive().await?;
                answers.message().await
            };
            match tokio::time::timeout(Duration::from_secs(3), sent).await {
                Ok(Ok(Some(a))) if a.ttl() > 0 => last_renewed = Some(Instant::now()),
                _ => stream = None,
            }
        } else {
            stream = None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let gone = watcher.await.unwrap();
    for o in &others {
        faults::set_cut(leader, *o, false);
        faults::set_cut(*o, leader, false);
    }
    // Whatever the old leader answered, the lease outlived it by a full TTL on the majority.
    let last = last_renewed.expect("the lease was renewed at least once before the cut took effect");
    assert!(gone >= last + ttl, "expired {:?} after a renewal the isolated leader answered", gone - last);
    stop_all(servers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backup_restores_leases_with_their_keys() {
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(96);
    let source = common::start_retrying(config(dir.path(), &ip, &["b1"], 0), 30).await;
    let mut c = client(&url(&ip, 0)).await;
    let lease = c.lease_grant(600, None).await.unwrap().id();
    c.put("backed/a", "1", Some(PutOptions::new().with_lease(lease))).await.unwrap();
    c.put("backed/b", "1", None).await.unwrap();
    let mut stream = c.snapshot().await.unwrap();
    let mut bytes = Vec::new();
    while let Some(chunk) = stream.message().await.unwrap() {
        bytes.extend_from_slice(chunk.blob());
    }
    source.stop().await;

    let new_dir = tempfile::tempdir().unwrap();
    let new_ip = common::loopback_ip(97);
    let cfg = config(new_dir.path(), &new_ip, &["b2"], 0);
    keel_cluster::restore_snapshot(&cfg, &bytes).unwrap();
    let restored = common::start_retrying(cfg, 30).await;
    let mut r = client(&url(&new_ip, 0)).await;
    assert_eq!(lease_ids(&mut r).await, [lease]);
    let ttl = r.lease_time_to_live(lease, Some(LeaseTimeToLiveOptions::new().with_keys())).await.unwrap();
    assert_eq!((ttl.granted_ttl(), ttl.keys()), (600, &[b"backed/a".to_vec()][..]));
    r.lease_revoke(lease).await.unwrap();
    let left = r.get("backed/", Some(GetOptions::new().with_prefix())).await.unwrap();
    assert_eq!(keys_of(&left), ["backed/b"], "the revoke found the restored key through the restored index");
    restored.stop().await;
}
