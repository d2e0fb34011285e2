//! Raft snapshots as files sent in chunks: a lagging member catches up through a snapshot of
//! several chunks and keeps it across a restart; damaged, short and cut transfers are refused,
//! leave no partial file and install nothing, and the leader's retry then succeeds. The
//! injected snapshot faults are process-wide, so these tests live in a binary of their own and
//! run one at a time (a lock).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use etcd_client::{Client, GetOptions};
use keel_cluster::network::faults::{self, SnapshotFault};
use keel_cluster::snapshot_file::IO_CHUNK;
use keel_cluster::{ServeConfig, Server};
use openraft::async_runtime::WatchReceiver;

mod common;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn config(dir: &Path, ip: &str, names: &[&str], i: usize) -> ServeConfig {
    common::member_config(dir, "http", ip, (24790, 24800), names, i, "snapshots")
}

async fn start_retrying(cfg: ServeConfig) -> Server {
    common::start_retrying(cfg, 30).await
}

async fn wait_leader(servers: &[Option<Server>]) -> u64 {
    common::wait_leader(servers, 30).await
}

/// Polls `check` every 50 ms until it holds or `secs` pass.
async fn eventually(secs: u64, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `KEYS` puts of 4 KiB values (one log entry each): more entries than a log keeps behind a
/// snapshot (1,000), and a snapshot of several 1 MiB chunks.
const KEYS: usize = 1100;

fn value(k: usize) -> Vec<u8> {
    format!("{k:05}").repeat(820).into_bytes()
}

async fn load(c: &Client) {
    let mut writers = tokio::task::JoinSet::new();
    for w in 0..8 {
        let mut c = c.clone();
        writers.spawn(async move {
            for k in (w..KEYS).step_by(8) {
                c.put(format!("k{k:05}"), value(k), None).await.unwrap();
            }
        });
    }
    while let Some(r) = writers.join_next().await {
        r.unwrap();
    }
}

fn snap_dir(cfg: &ServeConfig) -> PathBuf {
    cfg.data_dir.join("member").join("sm").join("snap")
}

fn temp_files(cfg: &ServeConfig) -> Vec<String> {
    std::fs::read_dir(snap_dir(cfg))
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect::<Vec<String>>())
        .unwrap_or_default()
        .into_iter()
        .filter(|n: &String| n.ends_with(".tmp"))
        .collect()
}

/// The member's keys as its own state machine holds them (serializable reads on its endpoint).
async fn local_count(url: &str) -> Option<i64> {
    let mut c = Client::connect([url], None).await.ok()?;
    let got = c.get("k", Some(GetOptions::new().with_prefix().with_count_only().with_serializable())).await.ok()?;
    Some(got.count())
}

/// Three members; the follower at index `lagging` is stopped while `KEYS` entries are
/// written, so the log it needs is purged. Returns the servers with the lagging one stopped.
async fn cluster_with_a_lagging_member(
    dir: &Path,
    ip: &str,
    names: &[&str],
) -> (Vec<Option<Server>>, usize, ServeConfig, Client) {
    let mut servers: Vec<Option<Server>> = Vec::new();
    for i in 0..3 {
        servers.push(Some(start_retrying(config(dir, ip, names, i)).await));
    }
    let leader = wait_leader(&servers).await;
    let lagging = servers.iter().flatten().position(|s| s.node.id != leader).unwrap();
    let other = (0..3).find(|i| *i != lagging).unwrap();
    let c = Client::connect([format!("http://{ip}:{}", 24790 + other)], None).await.unwrap();
    let mut c0 = c.clone();
    c0.put("early", "1", None).await.unwrap();
    let lagging_cfg = config(dir, ip, names, lagging);
    // It has applied "early" (and taken no snapshot of the rest) before it stops.
    let url = format!("http://{ip}:{}", 24790 + lagging);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut lc = Client::connect([url.as_str()], None).await.unwrap();
        if lc.get("early", Some(GetOptions::new().with_serializable())).await.is_ok_and(|g| g.count() == 1) {
            break;
        }
        assert!(Instant::now() < deadline, "the member to lag never applied the first write");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let lagging_applied =
        servers[lagging].as_ref().unwrap().node.raft.metrics().borrow_watched().last_applied.map_or(0, |l| l.index);
    servers[lagging].take().unwrap().stop().await;
    load(&c).await;
    // The running members snapshot now and purge their logs behind, so the lagging member's
    // next entry is gone everywhere and it must catch up from a snapshot. Left to their own
    // policy, the snapshots may lag the load on a slow machine: the member then caught up
    // from the log, built a snapshot of its own, and passed that off as the install (a CI
    // failure of "a build followed the install").
    let deadline = Instant::now() + Duration::from_secs(30);
    let purged_past =
        |s: &Server| s.node.raft.metrics().borrow_watched().purged.is_some_and(|p| p.index > lagging_applied);
    while !servers.iter().flatten().all(purged_past) {
        assert!(Instant::now() < deadline, "the running members did not purge their logs behind a snapshot");
        for s in servers.iter().flatten().filter(|s| !purged_past(s)) {
            let _ = s.node.raft.trigger().snapshot().await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    (servers, lagging, lagging_cfg, c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lagging_member_catches_up_through_a_snapshot_of_several_chunks_and_keeps_it_after_a_restart() {
    let _serial = SERIAL.lock().await;
    faults::set_snapshot_fault(None);
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(41);
    let names = ["s1", "s2", "s3"];
    let (mut servers, lagging, cfg, mut c) = cluster_with_a_lagging_member(dir.path(), &ip, &names).await;
    let url = format!("http://{ip}:{}", 24790 + lagging);

    servers[lagging] = Some(start_retrying(cfg.clone()).await);
    let deadline = Instant::now() + Duration::from_secs(60);
    while local_count(&url).await != Some(KEYS as i64) {
        assert!(Instant::now() < deadline, "the lagging member did not catch up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let node = &servers[lagging].as_ref().unwrap().node;
    let installed = node.raft.metrics().borrow_watched().snapshot;
    assert!(installed.is_some_and(|s| s.index > KEYS as u64 / 2), "caught up from a snapshot: {installed:?}");
    // Fewer entries than the snapshot count followed the installed snapshot: the member must
    // not export again what it just installed. (The policy once read openraft's snapshot
    // index, which moves only after the install applied, and saw every installed entry as
    // "since the last snapshot".)
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let applied = node.raft.metrics().borrow_watched().last_applied.map_or(0, |l| l.index);
    let after_install = applied - installed.map_or(0, |s| s.index);
    if after_install < cfg.snapshot_count {
        let built = node.sm.snapshots_built.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(built, 0, "a build followed the install ({after_install} entries after it)");
    }
    let current = std::fs::metadata(snap_dir(&cfg).join("current")).unwrap().len();
    assert!(current > 3 * IO_CHUNK as u64, "a snapshot of several chunks ({current} bytes)");
    assert_eq!(temp_files(&cfg), Vec::<String>::new(), "no partial file left");

    // Restarted, it comes back from its own disk with the snapshot's state and serves on.
    servers[lagging].take().unwrap().stop().await;
    let restarted = start_retrying(cfg.clone()).await;
    assert_eq!(local_count(&url).await, Some(KEYS as i64), "the installed state survives a restart");
    servers[lagging] = Some(restarted);
    c.put("after-restart", "1", None).await.unwrap();
    let mut lc = Client::connect([url.as_str()], None).await.unwrap();
    let got = lc.get("k00777", None).await.unwrap();
    assert_eq!(got.kvs()[0].value(), value(777).as_slice());
    assert_eq!(lc.get("after-restart", None).await.unwrap().count(), 1);
    for s in servers.into_iter().flatten() {
        s.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn damaged_short_and_cut_snapshot_transfers_install_nothing_and_the_retry_succeeds() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(42);
    let names = ["d1", "d2", "d3"];
    let (mut servers, lagging, cfg, _c) = cluster_with_a_lagging_member(dir.path(), &ip, &names).await;
    let url = format!("http://{ip}:{}", 24790 + lagging);
    let current = || std::fs::read(snap_dir(&cfg).join("current")).ok().map(|b| xxhash_rust::xxh3::xxh3_64(&b));

    faults::set_snapshot_fault(Some(SnapshotFault::FlipByte));
    servers[lagging] = Some(start_retrying(cfg.clone()).await);
    let node = std::sync::Arc::clone(&servers[lagging].as_ref().unwrap().node);
    // Restarted, it may first apply what the leader's log still holds (and snapshot that
    // itself); what it has once transfers have failed twice must then stay as it is.
    let mut before = None;
    for fault in [SnapshotFault::FlipByte, SnapshotFault::Truncate, SnapshotFault::Drop] {
        faults::set_snapshot_fault(Some(fault));
        let (sent, refused) = (faults::snapshot_faults_sent(), faults::snapshot_refused());
        // The leader tries again after each failure: two more damaged transfers.
        eventually(90, &format!("two {fault:?} transfers"), || faults::snapshot_faults_sent() >= sent + 2).await;
        if fault != SnapshotFault::Drop {
            eventually(30, &format!("{fault:?} refused"), || faults::snapshot_refused() >= refused + 2).await;
        }
        // Nothing installed: the member is where it was, its snapshot file untouched, its
        // Raft running, and at most the transfer in flight has a partial file.
        let now = (node.sm.applied_index(), current(), local_count(&url).await);
        assert!(now.0 < KEYS as u64 && now.2 < Some(KEYS as i64), "{fault:?}: it lags: {now:?}");
        assert_eq!(&now, before.get_or_insert(now), "{fault:?}: nothing may be installed");
        assert!(node.fatal.lock().is_none(), "{fault:?}: {:?}", node.fatal.lock());
        assert!(temp_files(&cfg).len() <= 1, "{fault:?}: partial files pile up: {:?}", temp_files(&cfg));
    }

    faults::set_snapshot_fault(None);
    let deadline = Instant::now() + Duration::from_secs(90);
    while local_count(&url).await != Some(KEYS as i64) {
        assert!(Instant::now() < deadline, "the retry after the faults did not catch the member up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut lc = Client::connect([url.as_str()], None).await.unwrap();
    let got = lc.get("k01099", Some(GetOptions::new().with_serializable())).await.unwrap();
    assert_eq!(got.kvs()[0].value(), value(1099).as_slice());
    eventually(20, "no partial files once caught up", || temp_files(&cfg).is_empty()).await;
    for s in servers.into_iter().flatten() {
        s.stop().await;
    }
}

/// The snapshot index `node` has, once no build is running: triggered builds finish first.
async fn settled_snapshot(node: &keel_cluster::node::Node) -> Option<u64> {
    let mut last = node.raft.metrics().borrow_watched().snapshot.map(|l| l.index);
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = node.raft.metrics().borrow_watched().snapshot.map(|l| l.index);
        if now == last {
            return now;
        }
        last = now;
    }
}

/// With the default `snapshot_bytes_percent` (50), a snapshot of a large state is not
/// rebuilt every `snapshot_count` entries: it waits until the entries since carry half its
/// size (a snapshot writes the whole state). With the count alone (the policy before), the
/// 400 small writes below would have exported the 3 MB state eight times.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_large_state_is_exported_again_only_after_writes_of_half_its_size() {
    let _serial = SERIAL.lock().await;
    faults::set_snapshot_fault(None);
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(43);
    let names = ["b1"];
    let cfg = ServeConfig { snapshot_bytes_percent: 50, ..config(dir.path(), &ip, &names, 0) };
    assert_eq!(cfg.snapshot_count, 50);
    let server = start_retrying(cfg.clone()).await;
    let servers = [Some(server)];
    wait_leader(&servers).await;
    let node = &servers[0].as_ref().unwrap().node;
    let mut c = Client::connect([format!("http://{ip}:24790")], None).await.unwrap();
    let big = vec![b'x'; 16 * 1024];
    for k in 0..200 {
        c.put(format!("big{k:03}"), big.clone(), None).await.unwrap();
    }
    // A snapshot of everything so far, so the writes below are measured from it (a trigger
    // while another build runs is ignored: trigger again until one covers it all).
    let applied = node.raft.metrics().borrow_watched().last_applied.map_or(0, |l| l.index);
    let deadline = Instant::now() + Duration::from_secs(30);
    while node.raft.metrics().borrow_watched().snapshot.is_none_or(|l| l.index < applied) {
        assert!(Instant::now() < deadline, "no snapshot of the big values");
        node.raft.trigger().snapshot().await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let before = settled_snapshot(node).await;
    let len = std::fs::metadata(snap_dir(&cfg).join("current")).unwrap().len();
    assert!(len > 200 * 16 * 1024, "the snapshot holds the big values ({len} bytes)");

    // 400 entries of a few bytes: eight times the count, a tiny share of the snapshot's size.
    for n in 0..400 {
        c.put("small", format!("{n}"), None).await.unwrap();
    }
    assert_eq!(settled_snapshot(node).await, before, "small writes re-exported the large state");

    // Writes carrying more than half the snapshot's bytes: now one is due.
    for k in 0..120 {
        c.put(format!("big{k:03}"), big.clone(), None).await.unwrap();
    }
    eventually(30, "a new snapshot after writes of half its size", || {
        node.raft.metrics().borrow_watched().snapshot.map(|l| l.index) > before
    })
    .await;
    for s in servers.into_iter().flatten() {
        s.stop().await;
    }
}
