//! Three members in one process on loopback, driven by the `etcd-client` crate: etcd's KV
//! semantics through any member, a leader stopped mid-run, and a member restarted from its
//! data directory.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::path::Path;
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp};
mod common;

use keel_cluster::{ServeConfig, Server};
use openraft::async_runtime::WatchReceiver;

fn base_ip(test: u8) -> String {
    common::loopback_ip(10 + test)
}

fn config(dir: &Path, ip: &str, names: &[&str], i: usize) -> ServeConfig {
    common::member_config(dir, "http", ip, (23790, 23800), names, i, "test")
}

async fn start_retrying(cfg: ServeConfig) -> Server {
    common::start_retrying(cfg, 20).await
}

async fn wait_leader(servers: &[Option<Server>]) -> u64 {
    common::wait_leader(servers, 20).await
}

async fn client(url: &str) -> Client {
    Client::connect([url], None).await.expect("connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_members_serve_etcd_kv_through_any_member_and_survive_a_leader_stop() {
    let dir = tempfile::tempdir().unwrap();
    let ip = base_ip(1);
    let names = ["n1", "n2", "n3"];
    let mut servers: Vec<Option<Server>> = Vec::new();
    for i in 0..3 {
        servers.push(Some(start_retrying(config(dir.path(), &ip, &names, i)).await));
    }
    let leader = wait_leader(&servers).await;
    let url = |i: usize| format!("http://{ip}:{}", 23790 + i);
    let follower = servers.iter().flatten().position(|s| s.node.id != leader).unwrap();
    let mut c = client(&url(follower)).await;

    // Revisions: one per write request, shared by its keys; versions count puts.
    let r1 = c.put("a", "1", None).await.unwrap().header().unwrap().revision();
    let r2 = c.put("a", "2", Some(PutOptions::new().with_prev_key())).await.unwrap();
    assert_eq!(r2.header().unwrap().revision(), r1 + 1);
    assert_eq!(r2.prev_key().unwrap().value(), b"1");
    let got = c.get("a", None).await.unwrap();
    let kv = &got.kvs()[0];
    assert_eq!((kv.value(), kv.version(), kv.create_revision(), kv.mod_revision()), (&b"2"[..], 2, r1, r1 + 1));

    // A txn: compare on value and version, two writes at one revision.
    let txn = Txn::new()
        .when([Compare::value("a", CompareOp::Equal, "2"), Compare::version("a", CompareOp::Equal, 2)])
        .and_then([TxnOp::put("b", "x", None), TxnOp::put("c", "y", None), TxnOp::get("a", None)])
        .or_else([TxnOp::put("failed", "1", None)]);
    let t = c.txn(txn).await.unwrap();
    assert!(t.succeeded());
    let rev = t.header().unwrap().revision();
    assert_eq!(rev, r1 + 2);
    let b = c.get("b", None).await.unwrap();
    let cc = c.get("c", None).await.unwrap();
    assert_eq!(b.kvs()[0].mod_revision(), rev);
    assert_eq!(cc.kvs()[0].mod_revision(), rev);
    // A failing compare takes the other branch.
    let t = c
        .txn(Txn::new().when([Compare::value("a", CompareOp::Equal, "nope")]).or_else([TxnOp::put("d", "z", None)]))
        .await
        .unwrap();
    assert!(!t.succeeded());
    // Prefix range, limit, count, reverse sort.
    let all = c.get("", Some(GetOptions::new().with_all_keys())).await.unwrap();
    assert_eq!(all.count(), 4);
    let lim = c
        .get(
            "",
            Some(
                GetOptions::new()
                    .with_all_keys()
                    .with_limit(2)
                    .with_sort(etcd_client::SortTarget::Key, etcd_client::SortOrder::Descend),
            ),
        )
        .await
        .unwrap();
    assert_eq!(lim.kvs().iter().map(|k| k.key().to_vec()).collect::<Vec<_>>(), vec![b"d".to_vec(), b"c".to_vec()]);
    assert!(lim.more());
    // Reads at a past revision come from history.
    let old = c.get("a", Some(GetOptions::new().with_revision(r1))).await.unwrap();
    assert_eq!(old.kvs()[0].value(), b"1");
    let future = c.get("a", Some(GetOptions::new().with_revision(rev + 100))).await;
    assert!(future.unwrap_err().to_string().contains("future revision"));
    // Delete with prev_kv.
    let d = c.delete("b", Some(DeleteOptions::new().with_prev_key())).await.unwrap();
    assert_eq!(d.deleted(), 1);
    assert_eq!(d.prev_kvs()[0].value(), b"x");
    // Serializable read on a follower sees its applied state.
    let s = c.get("c", Some(GetOptions::new().with_serializable())).await.unwrap();
    assert_eq!(s.kvs().len(), 1);

    // Bad input: errors, nothing applied.
    let before = c.get("a", None).await.unwrap().header().unwrap().revision();
    let dup = c.txn(Txn::new().and_then([TxnOp::put("k", "1", None), TxnOp::put("k", "2", None)])).await;
    assert!(dup.unwrap_err().to_string().contains("duplicate key"));
    let big = c.put("big", vec![0u8; 100 * 1024], None).await;
    assert!(big.is_err(), "a value over --max-request-bytes must be refused");
    let empty = c.put("", "v", None).await;
    assert!(empty.unwrap_err().to_string().contains("key is not provided"));
    assert_eq!(c.get("a", None).await.unwrap().header().unwrap().revision(), before);

    // Members and status.
    let members = c.member_list().await.unwrap();
    assert_eq!(members.members().len(), 3);
    let status = c.status().await.unwrap();
    assert_eq!(status.leader(), leader);
    assert!(status.version().starts_with("3."));

    // Enough writes to take snapshots and purge the log; then stop the leader.
    for i in 0..120 {
        c.put(format!("k{i:03}"), format!("v{i}"), None).await.unwrap();
    }
    let li = servers.iter().flatten().position(|s| s.node.id == leader).unwrap();
    let stopped = servers[li].take().unwrap();
    stopped.stop().await;
    let new_leader = wait_leader(&servers).await;
    assert_ne!(new_leader, leader);
    let survivor = servers.iter().position(|s| s.is_some()).unwrap();
    let mut c2 = client(&url(survivor)).await;
    c2.put("after", "stop", None).await.unwrap();
    let n = c2.get("k", Some(GetOptions::new().with_prefix())).await.unwrap();
    assert_eq!(n.count(), 120);

    // The stopped member restarts from its data directory and catches up.
    servers[li] = Some(start_retrying(config(dir.path(), &ip, &names, li)).await);
    wait_leader(&servers).await;
    let mut c3 = client(&url(li)).await;
    let got = c3.get("after", None).await.unwrap();
    assert_eq!(got.kvs()[0].value(), b"stop");

    for s in servers.into_iter().flatten() {
        s.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_dir_of_another_member_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ip = base_ip(2);
    let names = ["solo"];
    let s = start_retrying(config(dir.path(), &ip, &names, 0)).await;
    let id = s.node.id;
    let servers = vec![Some(s)];
    wait_leader(&servers).await;
    // Same directory, another member's name: refused with a clear error, nothing touched.
    let mut other = config(dir.path(), &ip, &names, 0);
    other.name = "another".into();
    other.initial_cluster = [("another".to_string(), other.initial_advertise_peer_urls.clone())].into_iter().collect();
    // (the first server still runs and holds the ports; the identity check comes first)
    let err = Server::start(other).await.err().expect("must refuse");
    assert!(err.to_string().contains("belongs to"), "{err}");
    for s in servers.into_iter().flatten() {
        s.stop().await;
    }
    // Same name, another cluster token: as etcd, a data directory that exists wins over the
    // initial-cluster flags; the member keeps the ids it recorded.
    let mut retoken = config(dir.path(), &ip, &names, 0);
    retoken.initial_cluster_token = "another".into();
    let again = start_retrying(retoken).await;
    assert_eq!(again.node.id, id);
    again.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_from_clients_and_peers_gets_errors_and_changes_nothing() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let ip = base_ip(3);
    let names = ["solo"];
    let servers = vec![Some(start_retrying(config(dir.path(), &ip, &names, 0)).await)];
    wait_leader(&servers).await;
    let mut c = client(&format!("http://{ip}:23790")).await;
    let rev = c.put("a", "1", None).await.unwrap().header().unwrap().revision();

    // An inverted range is empty, not an error (as in etcd).
    let inv = c.get("z", Some(GetOptions::new().with_range("a"))).await.unwrap();
    assert_eq!((inv.count(), inv.kvs().len()), (0, 0));
    // Unknown member ids.
    let err = c.member_remove(0xdead_beef).await.unwrap_err().to_string();
    assert!(err.contains("member not found"), "{err}");
    // A compaction beyond the current revision.
    let err = c.compact(rev + 10, None).await.unwrap_err().to_string();
    assert!(err.contains("future revision"), "{err}");

    // Garbage on the peer port: random bytes, then a frame that claims 4 GiB.
    let peer = format!("{ip}:23800");
    let mut s = tokio::net::TcpStream::connect(&peer).await.unwrap();
    let junk: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let _ = s.write_all(&junk).await;
    let mut buf = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await.unwrap().unwrap_or(0);
    assert_eq!(n, 0, "the member must close a connection that sends garbage");
    let mut s = tokio::net::TcpStream::connect(&peer).await.unwrap();
    let _ = s.write_all(&u32::MAX.to_le_bytes()).await;
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await.unwrap().unwrap_or(0);
    assert_eq!(n, 0);
    // A well-formed hello from another cluster is refused before any request is read.
    let mut s = tokio::net::TcpStream::connect(&peer).await.unwrap();
    let node = &servers[0].as_ref().unwrap().node;
    let hello = keel_cluster::network::Hello {
        magic: 0x4b45_454c_5045_4552,
        cluster_id: node.cluster_id ^ 1,
        from: 7,
        to: node.id,
    };
    keel_cluster::network::write_frame(&mut s, &hello).await.unwrap();
    // The member may already have closed the connection after the hello: then this write
    // fails (broken pipe), which is the same refusal seen earlier.
    let _ = keel_cluster::network::write_frame(&mut s, &keel_cluster::network::PeerRequest::ReadIndex).await;
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await.unwrap().unwrap_or(0);
    assert_eq!(n, 0, "a peer of another cluster must get no answer");

    // Nothing changed, and the member still serves.
    let after = c.get("a", None).await.unwrap();
    assert_eq!(after.header().unwrap().revision(), rev);
    assert_eq!(c.put("b", "2", None).await.unwrap().header().unwrap().revision(), rev + 1);
    for s in servers.into_iter().flatten() {
        s.stop().await;
    }
}

/// etcd's way to grow a cluster: `member add` on the running cluster, then the new member starts
/// with `--initial-cluster-state existing`, learns its ids from a running member, catches up
/// (from a snapshot: the log behind it is purged) and serves; restarted with the same flags it
/// keeps its identity. A member nobody added is refused with a clear error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_added_with_member_add_joins_with_state_existing_and_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let ip = base_ip(4);
    let names = ["n1", "n2", "n3", "n4"];
    let url = |i: usize| format!("http://{ip}:{}", 23790 + i);
    let mut servers: Vec<Option<Server>> = Vec::new();
    for i in 0..3 {
        servers.push(Some(start_retrying(config(dir.path(), &ip, &names[..3], i)).await));
    }
    wait_leader(&servers).await;
    let mut c = client(&url(0)).await;
    // More entries than the log keeps behind a snapshot (1,000), so the joiner needs one.
    let mut writers = tokio::task::JoinSet::new();
    for w in 0..8 {
        let mut c = c.clone();
        writers.spawn(async move {
            for k in (w..1200).step_by(8) {
                c.put(format!("k{k:04}"), "v", None).await.unwrap();
            }
        });
    }
    while let Some(r) = writers.join_next().await {
        r.unwrap();
    }

    // Not added yet: refused, naming what to do, and nothing is written to its directory.
    let mut joiner = config(dir.path(), &ip, &names, 3);
    joiner.join_existing = true;
    joiner.election_timeout = Duration::from_millis(100);
    joiner.heartbeat_interval = Duration::from_millis(20);
    let err = Server::start(joiner.clone()).await.err().expect("an unknown member must be refused");
    assert!(err.to_string().contains("add it first"), "{err}");
    assert!(!joiner.data_dir.join("member").join("identity").exists());
    joiner.election_timeout = Duration::from_millis(400);
    joiner.heartbeat_interval = Duration::from_millis(50);

    let peer4 = format!("http://{ip}:{}", 23803);
    // etcd's strict reconfiguration check refuses an add until the leader has reached every
    // member for 5 s.
    let deadline = Instant::now() + Duration::from_secs(20);
    let added = loop {
        match c.member_add([peer4.clone()], None).await {
            Err(etcd_client::Error::GRpcStatus(s))
                if s.message() == "etcdserver: unhealthy cluster" && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            r => break r.unwrap(),
        }
    };
    let new_id = added.member().unwrap().id();
    let s4 = start_retrying(joiner.clone()).await;
    assert_eq!(s4.node.id, new_id, "the joiner takes the id member add gave its peer URLs");
    servers.push(Some(s4));

    // It serves everything written before it joined, and what is written after.
    c.put("after", "1", None).await.unwrap();
    let mut c4 = client(&url(3)).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got = c4.get("k", Some(GetOptions::new().with_prefix().with_count_only())).await;
        if got.as_ref().is_ok_and(|g| g.count() == 1200) {
            break;
        }
        assert!(Instant::now() < deadline, "the new member did not catch up: {got:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(c4.get("after", None).await.unwrap().kvs()[0].value(), b"1");
    let joined = servers[3].as_ref().unwrap().node.raft.metrics().borrow_watched().clone();
    assert!(joined.snapshot.is_some(), "the joiner caught up from a snapshot: {joined:?}");
    let members = c.member_list().await.unwrap();
    assert_eq!(members.members().len(), 4);
    assert!(members.members().iter().any(|m| m.id() == new_id && m.name() == "n4"));

    // Restarted with the same flags (state existing), it is the same member.
    servers[3].take().unwrap().stop().await;
    let s4 = start_retrying(joiner).await;
    assert_eq!(s4.node.id, new_id);
    servers[3] = Some(s4);
    c.put("after-restart", "2", None).await.unwrap();
    let mut c4 = client(&url(3)).await;
    assert_eq!(c4.get("after-restart", None).await.unwrap().kvs()[0].value(), b"2");
    for s in servers.into_iter().flatten() {
        s.stop().await;
    }
}

/// Backup and restore as etcd operators do it: `Maintenance.Snapshot` from a running member
/// (after a read barrier when a leader answers, so a follower's backup holds every acknowledged
/// write), then a new cluster made from the file. The keys, values and revision carry over; the old
/// cluster's members do not. Garbage and an occupied data directory are refused and leave no
/// member directory behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_snapshot_saved_from_a_member_restores_into_a_new_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let ip = base_ip(5);
    let names = ["n1", "n2", "n3"];
    let url = |i: usize| format!("http://{ip}:{}", 23790 + i);
    let mut servers: Vec<Option<Server>> = Vec::new();
    for i in 0..3 {
        servers.push(Some(start_retrying(config(dir.path(), &ip, &names, i)).await));
    }
    let leader = wait_leader(&servers).await;
    let at = |id: u64| servers.iter().flatten().position(|s| s.node.id == id).unwrap();
    let follower = (0..3).find(|&i| i != at(leader)).unwrap();
    // Writes go to the leader, the snapshot comes from a follower: the backup holds every
    // write acknowledged before it was asked for (the follower waits for a read barrier), even
    // from a follower that was down when the write was made and has just restarted.
    let mut w = client(&url(at(leader))).await;
    for k in 0..300 {
        w.put(format!("k{k:03}"), format!("v{k}"), None).await.unwrap();
    }
    let save = |c: &mut Client| {
        let mut c = c.clone();
        async move {
            let mut stream = c.snapshot().await.unwrap();
            let mut bytes = Vec::new();
            let mut remaining = u64::MAX;
            while let Some(chunk) = stream.message().await.unwrap() {
                bytes.extend_from_slice(chunk.blob());
                remaining = chunk.remaining_bytes();
            }
            assert_eq!(remaining, 0, "the stream says when it is complete");
            bytes
        }
    };
    let restored_revision = |bytes: &[u8]| {
        let scratch = tempfile::tempdir().unwrap();
        keel_cluster::restore_snapshot(&config(scratch.path(), &base_ip(6), &["probe"], 0), bytes).unwrap()
    };
    if let Some(s) = servers[follower].take() {
        s.stop().await;
    }
    let while_down = w.put("while-down", "x", None).await.unwrap().header().unwrap().revision();
    servers[follower] = Some(start_retrying(config(dir.path(), &ip, &names, follower)).await);
    let mut c = client(&url(follower)).await;
    let bytes = save(&mut c).await;
    assert_eq!(restored_revision(&bytes), while_down, "a restarted follower's backup holds the write it missed");
    let last = w.delete("k000", None).await.unwrap().header().unwrap().revision();
    assert_eq!(restored_revision(&save(&mut c).await), last);
    // A member left alone (no leader to give a read index) still exports what it has: a backup
    // is most needed when the cluster is broken.
    for (i, s) in servers.iter_mut().enumerate() {
        if i != follower {
            if let Some(s) = s.take() {
                s.stop().await;
            }
        }
    }
    let bytes = save(&mut c).await;
    for s in servers.into_iter().flatten() {
        s.stop().await;
    }

    // A one-member cluster on other addresses, from the snapshot.
    let new_dir = tempfile::tempdir().unwrap();
    let new_ip = base_ip(6);
    let mut cfg = config(new_dir.path(), &new_ip, &["r1"], 0);
    cfg.initial_cluster_token = "restored".into();
    let garbage = keel_cluster::restore_snapshot(&cfg, b"not a checkpoint");
    assert!(garbage.is_err());
    assert!(!cfg.data_dir.join("member").exists(), "a failed restore leaves nothing");
    let revision = keel_cluster::restore_snapshot(&cfg, &bytes).unwrap();
    assert_eq!(revision, last, "the revision of the last write before the snapshot");
    assert!(keel_cluster::restore_snapshot(&cfg, &bytes).is_err(), "an occupied data dir is refused");
    let server = start_retrying(cfg).await;
    let mut r = client(&format!("http://{new_ip}:23790")).await;
    let all = r.get("k", Some(GetOptions::new().with_prefix())).await.unwrap();
    assert_eq!(all.count(), 299);
    assert_eq!(all.kvs()[0].key(), b"k001");
    assert_eq!(all.kvs()[0].value(), b"v1");
    let next = r.put("new", "1", None).await.unwrap().header().unwrap().revision();
    assert!(next > last, "revisions continue after the snapshot's ({next} > {last})");
    let members = r.member_list().await.unwrap();
    assert_eq!(members.members().len(), 1);
    assert_eq!(members.members()[0].name(), "r1");
    server.stop().await;
}

/// A member whose Raft stops on a storage error stops as a whole (`stopped()` completes,
/// `fatal` says why; `keel serve` exits non-zero on it) instead of holding its client ports
/// open without ever answering. Provoked by a store whose engine keeps an applied log position
/// that its tables forgot, so the engine refuses the first entry Raft applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_raft_stops_on_a_storage_error_stops_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let ip = base_ip(7);
    let source = Server::start(config(dir.path(), &ip, &["s1"], 0)).await.unwrap();
    let mut c = client(&format!("http://{ip}:23790")).await;
    for k in 0..20 {
        c.put(format!("k{k}"), "v", None).await.unwrap();
    }
    // The member's own checkpoint export (a Raft snapshot's data), which carries the engine's
    // applied log position.
    let (_, snapshot) = source.node.sm.export_snapshot("test").unwrap();

    let other = tempfile::tempdir().unwrap();
    let cfg = config(other.path(), &base_ip(8), &["f1"], 0);
    let member_dir = cfg.data_dir.join("member");
    let store = keeldb::Database::open(member_dir.join("sm").join("store"), keeldb::Options::default()).unwrap();
    store.install_checkpoint(&mut snapshot.checkpoint_reader()).unwrap();
    drop(snapshot);
    source.stop().await;
    // Forget the old cluster's position in the tables only (the engine still knows it).
    let mut txn = store.begin_write().unwrap();
    txn.delete("meta", b"applied").unwrap();
    txn.delete("meta", b"membership").unwrap();
    txn.commit().unwrap();
    store.close().unwrap();
    std::fs::write(
        member_dir.join("identity"),
        format!("cluster {:016x} member {:016x} ({})\n", cfg.cluster_id(), cfg.member_id(), cfg.name),
    )
    .unwrap();
    let server = Server::start(cfg).await.unwrap();
    tokio::time::timeout(Duration::from_secs(20), server.node.stopped())
        .await
        .expect("the member must stop when its Raft does");
    let why = server.node.fatal.lock().clone().expect("and say why");
    assert!(why.contains("raft stopped"), "{why}");
    server.stop().await;
}

/// A stopped member's stores are closed when `stop` returns, even while something still holds
/// the member (here the test; in the CURP fault run it was a task of the stopped Raft): it
/// restarts in the same process from the same directory without waiting for the holder. The
/// ports may take a moment to free; a locked store fails the test at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_member_restarts_while_a_handle_to_it_lives() {
    let dir = tempfile::tempdir().unwrap();
    let ip = base_ip(9);
    let names = ["solo"];
    let s = start_retrying(config(dir.path(), &ip, &names, 0)).await;
    let servers = vec![Some(s)];
    wait_leader(&servers).await;
    let mut c = client(&format!("http://{ip}:23790")).await;
    c.put("kept", "1", None).await.unwrap();
    drop(c);
    let s = servers.into_iter().flatten().next().unwrap();
    let held = std::sync::Arc::clone(&s.node);
    s.stop().await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let s = loop {
        match Server::start(config(dir.path(), &ip, &names, 0)).await {
            Ok(s) => break s,
            Err(e) => {
                let e = e.to_string();
                assert!(!e.contains("locked"), "the stopped member's store is still open: {e}");
                assert!(Instant::now() < deadline, "no restart: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert!(std::sync::Arc::strong_count(&held) >= 1);
    let servers = vec![Some(s)];
    wait_leader(&servers).await;
    let mut c = client(&format!("http://{ip}:23790")).await;
    let got = c.get("kept", None).await.unwrap();
    assert_eq!(got.kvs().first().map(|kv| kv.value().to_vec()), Some(b"1".to_vec()));
    drop(held);
    for s in servers.into_iter().flatten() {
        s.stop().await;
    }
}
