//! `keel serve` on a data directory etcd 3.6.16's tools made. The fixtures in
//! `tests/data/etcd-3.6.16-datadir/` are real: one etcd member (`--name infra0
//! --initial-cluster infra0=http://127.0.0.1:23801 --initial-cluster-token tok`) took
//! `put foo1 val1`, `foo2`, `foo3` and `etcdctl snapshot save`; `restored` is `etcdutl snapshot
//! restore` of it with the same flags, `bumped` the same with `--bump-revision 10000
//! --mark-compacted`. `killed` is an etcd started with `--backend-batch-interval 1h`, given
//! `put k1 v1`..`k3` and killed with SIGKILL, so its WAL holds writes its database never
//! applied (its database then compacted with `etcdutl defrag`, which applies nothing, to keep
//! it small). WAL segments are cut after their last record (etcd preallocates 64 MB of zeros,
//! which end the log either way); the v2 `.snap` files are left out (keel does not read them).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};

use etcd_client::{Client, GetOptions, WatchOptions};
use keel_cluster::etcd_datadir::ImportError;
use keel_cluster::{ServeConfig, Server, StartError};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/etcd-3.6.16-datadir").join(name)
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// The flags the fixtures were made with; peer URL as recorded (it is what the member ids
/// derive from), listening on a loopback address of this test's own.
fn config(data_dir: &Path, octet: u8) -> ServeConfig {
    let ip = common::loopback_ip(octet);
    let peer = "http://127.0.0.1:23801".to_string();
    ServeConfig {
        name: "infra0".into(),
        data_dir: data_dir.to_path_buf(),
        initial_cluster: vec![("infra0".to_string(), vec![peer.clone()])].into_iter().collect(),
        initial_advertise_peer_urls: vec![peer],
        listen_peer_urls: vec![format!("http://{ip}:23801")],
        initial_cluster_token: "tok".into(),
        ..common::member_config(data_dir, "http", &ip, (23791, 23801), &["infra0"], 0, "tok")
    }
}

async fn client(server: &Server) -> Client {
    let url = format!("http://{}", server.client_addrs[0]);
    Client::connect([url], None).await.unwrap()
}

async fn wait_writable(c: &mut Client) -> i64 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        match c.get("foo1", None).await {
            Ok(r) => return r.header().unwrap().revision(),
            Err(e) => assert!(std::time::Instant::now() < deadline, "no answer: {e}"),
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

fn keys(r: &etcd_client::GetResponse) -> Vec<(String, String, i64, i64, i64)> {
    r.kvs()
        .iter()
        .map(|kv| {
            let s = |b: &[u8]| String::from_utf8(b.to_vec()).unwrap();
            (s(kv.key()), s(kv.value()), kv.create_revision(), kv.mod_revision(), kv.version())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_etcd_dir_is_imported_and_its_files_set_aside() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("d");
    copy_tree(&fixture("restored"), &dir);
    // Leftovers of an import that crashed before its identity file are replaced.
    std::fs::create_dir_all(dir.join("member/sm/store")).unwrap();
    std::fs::write(dir.join("member/sm/store/junk"), b"half an import").unwrap();
    let server = common::start_retrying(config(&dir, 91), 20).await;
    let mut c = client(&server).await;
    assert_eq!(wait_writable(&mut c).await, 4);
    let all = c.get("", Some(GetOptions::new().with_from_key())).await.unwrap();
    let want = |i: i64| (format!("foo{i}"), format!("val{i}"), i + 1, i + 1, 1);
    assert_eq!(keys(&all), vec![want(1), want(2), want(3)]);
    let put = c.put("foo4", "val4", None).await.unwrap();
    assert_eq!(put.header().unwrap().revision(), 5);
    server.stop().await;
    let member = dir.join("member");
    assert!(!member.join("snap").exists() && !member.join("wal").exists(), "etcd no longer finds its files");
    assert!(member.join("etcd-imported/snap/db").exists() && member.join("etcd-imported/wal").is_dir());
    assert!(!member.join("sm/store/junk").exists());

    // A crash after the identity but before the files were set aside: the next start finishes
    // that, and the member is the keel member it was (foo4 kept).
    std::fs::rename(member.join("etcd-imported/wal"), member.join("wal")).unwrap();
    let server = common::start_retrying(config(&dir, 91), 20).await;
    let mut c = client(&server).await;
    wait_writable(&mut c).await;
    let r = c.get("foo4", None).await.unwrap();
    assert_eq!(keys(&r), vec![("foo4".into(), "val4".into(), 5, 5, 1)]);
    assert!(!member.join("wal").exists() && member.join("etcd-imported/wal").is_dir());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bumped_and_compacted_restore_shows_etcds_revisions() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("d");
    copy_tree(&fixture("bumped"), &dir);
    let server = common::start_retrying(config(&dir, 92), 20).await;
    let mut c = client(&server).await;
    // As etcd on the same directory: revision 10004, the keys at their old revisions, the
    // marker row etcdutl writes invisible, everything below 10004 compacted.
    assert_eq!(wait_writable(&mut c).await, 10_004);
    let all = c.get("", Some(GetOptions::new().with_from_key())).await.unwrap();
    assert_eq!(all.count(), 3);
    assert_eq!(keys(&all)[0], ("foo1".into(), "val1".into(), 2, 2, 1));
    assert!(c.get("foo1", Some(GetOptions::new().with_revision(10_003))).await.is_err());
    assert_eq!(c.get("foo1", Some(GetOptions::new().with_revision(10_004))).await.unwrap().count(), 1);
    let mut stream = c.watch("foo", Some(WatchOptions::new().with_prefix().with_start_revision(8))).await.unwrap();
    let first = stream.message().await.unwrap().unwrap();
    let first = if first.created() && !first.canceled() { stream.message().await.unwrap().unwrap() } else { first };
    assert!(first.canceled());
    assert_eq!(first.compact_revision(), 10_004);
    // From the compaction point on, a watch is served: nothing at 10004, then the next put.
    let mut stream = c.watch("foo", Some(WatchOptions::new().with_prefix().with_start_revision(10_004))).await.unwrap();
    let put = c.put("foo4", "val4", None).await.unwrap();
    assert_eq!(put.header().unwrap().revision(), 10_005);
    let mut events = Vec::new();
    while events.is_empty() {
        let r = stream.message().await.unwrap().unwrap();
        assert!(!r.canceled(), "a watch from the compaction point is served");
        events.extend(r.events().iter().map(|e| (e.kv().unwrap().key().to_vec(), e.kv().unwrap().mod_revision())));
    }
    assert_eq!(events, vec![(b"foo4".to_vec(), 10_005)]);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_etcds_dir_with_unapplied_writes_is_refused_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("d");
    copy_tree(&fixture("killed"), &dir);
    let before = std::fs::read_dir(dir.join("member")).unwrap().count();
    let err = Server::start(config(&dir, 93)).await.err().expect("the import must be refused");
    match &err {
        StartError::EtcdDataDir(ImportError::UnappliedEntries { count, first, last, consistent_index }) => {
            // The database never committed; the log holds the member's published attributes,
            // the cluster version and the three puts (raft indexes 3 to 7).
            assert_eq!((*consistent_index, *first, *last, *count), (0, 3, 7, 5), "{err}");
        }
        other => panic!("not the unapplied-entries refusal: {other}"),
    }
    assert_eq!(std::fs::read_dir(dir.join("member")).unwrap().count(), before);
    assert!(!dir.join("member/identity").exists() && dir.join("member/wal").is_dir());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_members_flags_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("d");
    copy_tree(&fixture("restored"), &dir);
    let cfg = ServeConfig { initial_cluster_token: "other".into(), ..config(&dir, 94) };
    let err = Server::start(cfg).await.err().expect("other flags must be refused");
    assert!(matches!(err, StartError::EtcdDataDir(ImportError::OtherMember { .. })), "{err}");
    // Same member, but the flags name a second one: another cluster than the one recorded
    // (etcd would take the recorded membership; keel refuses rather than found a cluster the
    // flags do not describe).
    let mut cfg = config(&dir, 94);
    cfg.initial_cluster.insert("infra1".into(), vec!["http://127.0.0.1:23802".into()]);
    let err = Server::start(cfg).await.err().expect("another membership must be refused");
    assert!(matches!(err, StartError::EtcdDataDir(ImportError::OtherCluster { .. })), "{err}");
    assert!(!dir.join("member/identity").exists() && dir.join("member/snap/db").exists());
}

/// etcd's TestIssue6361: a member added to the imported cluster gets the imported keys, which no
/// log entry carries (the import's state goes into a snapshot, the log before it is purged).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_added_after_the_import_gets_the_imported_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("d");
    copy_tree(&fixture("restored"), &dir);
    // The recorded peer URL is the one a joiner dials, so this member listens on it.
    let first = ServeConfig { listen_peer_urls: vec!["http://127.0.0.1:23801".into()], ..config(&dir, 95) };
    let s1 = common::start_retrying(first.clone(), 20).await;
    let mut c = client(&s1).await;
    wait_writable(&mut c).await;
    // The import marks the store restored; the mark goes once its state is in a snapshot the
    // log starts from (until then every start snapshots and purges again).
    let marker = dir.join("member/sm/restored");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while marker.exists() {
        assert!(std::time::Instant::now() < deadline, "the restored state was never snapshotted and purged");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let ip = common::loopback_ip(95);
    let url = format!("http://{ip}:23802");
    c.member_add([url.clone()], None).await.unwrap();
    let mut initial_cluster = first.initial_cluster.clone();
    initial_cluster.insert("m2".to_string(), vec![url.clone()]);
    let joiner = ServeConfig {
        name: "m2".into(),
        data_dir: tmp.path().join("m2"),
        listen_client_urls: vec![format!("http://{ip}:23792")],
        advertise_client_urls: vec![format!("http://{ip}:23792")],
        listen_peer_urls: vec![url.clone()],
        initial_advertise_peer_urls: vec![url],
        initial_cluster,
        join_existing: true,
        ..first
    };
    let s2 = common::start_retrying(joiner, 20).await;
    let mut c2 = client(&s2).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let r = c2.get("foo", Some(GetOptions::new().with_prefix().with_serializable())).await;
        if let Ok(r) = r.as_ref().map(keys) {
            if r.len() == 3 {
                assert_eq!(r[2], ("foo3".into(), "val3".into(), 4, 4, 1));
                break;
            }
        }
        assert!(std::time::Instant::now() < deadline, "the new member never had the imported keys: {r:?}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    s2.stop().await;
    s1.stop().await;
}
