//! The migration path from etcd, end to end against a real etcd 3.6.16 (and, for the way back,
//! etcd's own etcdutl): a snapshot `etcdctl snapshot save` took from etcd restores into keel with
//! every key, value, create and mod revision, version, lease and user; and the etcd snapshot keel
//! writes passes `etcdutl snapshot status` and `etcdutl snapshot restore`, and an etcd started
//! on the restored directory serves the same keys.
//!
//! The etcd binaries come from `scripts/go-tools etcd etcdctl etcdutl` (`.tools/bin`); without
//! them these tests print that they did not run and pass (the unit tests in
//! `src/etcd_snapshot/tests.rs` check the checked-in etcd fixtures without Go), unless
//! `KEEL_REQUIRE_ETCD` is set: `scripts/etcd-snapshot-check` builds the tools and sets it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions, GetOptions, LeaseTimeToLiveOptions, Permission, PutOptions, Txn, TxnOp};
use keel_cluster::ServeConfig;

/// `.tools/bin/NAME`, if built; with `KEEL_REQUIRE_ETCD` set (`scripts/etcd-snapshot-check`)
/// a missing tool fails the test instead of skipping it.
fn tool(name: &str) -> Option<PathBuf> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.tools/bin").join(name);
    let required = std::env::var_os("KEEL_REQUIRE_ETCD").is_some();
    assert!(path.exists() || !required, "{} is missing: run scripts/go-tools {name}", path.display());
    path.exists().then_some(path)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// An etcd server on 127.0.0.1, killed on drop.
struct Etcd {
    child: Child,
    endpoint: String,
}

impl Etcd {
    /// Starts etcd with client URL `http://127.0.0.1:client` and peer URL `peer_url`.
    fn start(binary: &Path, data_dir: &Path, log: &Path, client: u16, peer_url: &str) -> Etcd {
        let endpoint = format!("http://127.0.0.1:{client}");
        let log = std::fs::File::create(log).unwrap();
        let child = Command::new(binary)
            .args(["--name", "e1", "--data-dir"])
            .arg(data_dir)
            .args(["--listen-client-urls", &endpoint, "--advertise-client-urls", &endpoint])
            .args(["--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url])
            .args(["--initial-cluster", &format!("e1={peer_url}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Etcd { child, endpoint }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn connect(endpoint: &str, user: Option<(&str, &str)>) -> Client {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let options = user.map(|(u, p)| ConnectOptions::new().with_user(u, p));
        let answer = match Client::connect([endpoint], options).await {
            Ok(c) => c.maintenance_client().status().await.map(|_| c),
            Err(e) => Err(e),
        };
        match answer {
            Ok(c) => return c,
            Err(e) => assert!(Instant::now() < deadline, "{endpoint} did not answer: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every key with what etcd says of it: (key, value, create, mod, version, lease); the revision.
async fn all_keys(c: &mut Client) -> (Vec<(Vec<u8>, Vec<u8>, i64, i64, i64, i64)>, i64) {
    let r = c.get(vec![0u8], Some(GetOptions::new().with_from_key())).await.unwrap();
    let kvs = r
        .kvs()
        .iter()
        .map(|kv| {
            (kv.key().to_vec(), kv.value().to_vec(), kv.create_revision(), kv.mod_revision(), kv.version(), kv.lease())
        })
        .collect();
    (kvs, r.header().unwrap().revision())
}

/// Each lease: (id, granted TTL, attached keys).
async fn all_leases(c: &mut Client) -> Vec<(i64, i64, Vec<Vec<u8>>)> {
    let mut ids: Vec<i64> = c.leases().await.unwrap().leases().iter().map(|l| l.id()).collect();
    ids.sort();
    let mut out = Vec::new();
    for id in ids {
        let t = c.lease_time_to_live(id, Some(LeaseTimeToLiveOptions::new().with_keys())).await.unwrap();
        let mut keys = t.keys().to_vec();
        keys.sort();
        out.push((id, t.granted_ttl(), keys));
    }
    out
}

/// Keys, overwrites, deletes, a multi-key txn (one revision, two sub revisions), a value past a
/// page, leases with and without keys, a compaction, users and roles, auth on.
async fn fill(c: &mut Client) {
    for i in 0..60 {
        c.put(format!("k/{i:02}"), format!("v{i}"), None).await.unwrap();
    }
    for i in 0..10 {
        c.put(format!("k/{i:02}"), format!("again{i}"), None).await.unwrap();
    }
    c.delete("k/5", Some(etcd_client::DeleteOptions::new().with_prefix())).await.unwrap();
    let r = c.txn(Txn::new().and_then(vec![TxnOp::put("t/a", "1", None), TxnOp::put("t/b", "2", None)])).await.unwrap();
    c.compact(r.header().unwrap().revision(), None).await.unwrap();
    let lease = c.lease_grant(3600, None).await.unwrap().id();
    c.lease_grant(7200, None).await.unwrap();
    for k in ["l/1", "l/2"] {
        c.put(k, "leased", Some(PutOptions::new().with_lease(lease))).await.unwrap();
    }
    c.put("big", vec![b'x'; 20_000], None).await.unwrap();
    c.put("k/00", "third", None).await.unwrap();
    // Deleted after the compaction: the tombstone is in the file.
    c.delete("t/b", None).await.unwrap();
    // Enough keys for a three-level tree in etcd's `key` bucket (branch pages over branch
    // pages), written 100 to a txn (80 requests).
    for batch in 0..80 {
        let puts: Vec<TxnOp> =
            (0..100).map(|i| TxnOp::put(format!("bulk/{batch:02}/{i:02}"), vec![b'b'; 64], None)).collect();
        c.txn(Txn::new().and_then(puts)).await.unwrap();
    }
    c.user_add("root", "rootpw", None).await.unwrap();
    c.role_add("root").await.unwrap();
    c.user_grant_role("root", "root").await.unwrap();
    c.role_add("reader").await.unwrap();
    c.role_grant_permission("reader", Permission::read("k/").with_prefix()).await.unwrap();
    c.user_add("alice", "alicepw", None).await.unwrap();
    c.user_grant_role("alice", "reader").await.unwrap();
    c.auth_enable().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_snapshot_restores_into_keel_with_every_key_revision_lease_and_user() {
    let (Some(etcd_bin), Some(etcdctl)) = (tool("etcd"), tool("etcdctl")) else {
        eprintln!("not run: build etcd and etcdctl with scripts/go-tools etcd etcdctl");
        return;
    };
    import_from(&etcd_bin, &etcdctl, 81).await;
    // Debian's etcd-server package is etcd 3.4: the oldest backend schema keel reads.
    let debian = Path::new("/usr/bin/etcd");
    match Command::new(debian).arg("--version").output() {
        Ok(v) if String::from_utf8_lossy(&v.stdout).contains("etcd Version: 3.4.") => {
            import_from(debian, &etcdctl, 83).await
        }
        _ => eprintln!("etcd 3.4 not run: no /usr/bin/etcd 3.4 (Debian's etcd-server)"),
    }
}

/// Fills an etcd started from `etcd_bin`, saves a snapshot with `etcdctl`, restores it into a
/// keel member on `common::loopback_ip(ip_octet)` and compares.
async fn import_from(etcd_bin: &Path, etcdctl: &Path, ip_octet: u8) {
    let dir = tempfile::tempdir().unwrap();
    let peer_url = format!("http://127.0.0.1:{}", free_port());
    let etcd = Etcd::start(etcd_bin, &dir.path().join("etcd"), &dir.path().join("etcd.log"), free_port(), &peer_url);
    fill(&mut connect(&etcd.endpoint, None).await).await;
    let mut from_etcd = connect(&etcd.endpoint, Some(("root", "rootpw"))).await;
    let (etcd_keys, etcd_revision) = all_keys(&mut from_etcd).await;
    let etcd_leases = all_leases(&mut from_etcd).await;
    let snapshot = dir.path().join("etcd.snapshot");
    let saved = Command::new(etcdctl)
        .args(["--endpoints", &etcd.endpoint, "--user", "root:rootpw", "snapshot", "save"])
        .arg(&snapshot)
        .output()
        .unwrap();
    assert!(saved.status.success(), "etcdctl snapshot save: {}", String::from_utf8_lossy(&saved.stderr));
    drop(etcd);

    let ip = common::loopback_ip(ip_octet);
    let cfg = ServeConfig {
        initial_cluster_token: "from-etcd".into(),
        ..common::member_config(dir.path(), "http", &ip, (23790, 23800), &["m1"], 0, "from-etcd")
    };
    let bytes = std::fs::read(&snapshot).unwrap();
    let revision = keel_cluster::restore_snapshot(&cfg, &bytes).unwrap();
    assert_eq!(revision, etcd_revision, "{}", etcd_bin.display());
    let server = common::start_retrying(cfg, 20).await;
    let url = format!("http://{ip}:23790");
    let mut keel = connect(&url, Some(("root", "rootpw"))).await;
    let (keel_keys, keel_revision) = all_keys(&mut keel).await;
    assert_eq!(keel_keys.len(), etcd_keys.len());
    assert!(keel_keys == etcd_keys, "{}: every key, value, create/mod revision, version and lease", etcd_bin.display());
    assert_eq!(keel_revision, etcd_revision);
    assert_eq!(all_leases(&mut keel).await, etcd_leases);
    // Revisions continue from etcd's; etcd's users log in with etcd's passwords.
    let put = keel.put("after", "1", None).await.unwrap();
    assert_eq!(put.header().unwrap().revision(), etcd_revision + 1);
    let mut alice = connect(&url, Some(("alice", "alicepw"))).await;
    assert_eq!(alice.get("k/00", None).await.unwrap().kvs()[0].value(), b"third");
    assert!(alice.put("k/00", "no", None).await.is_err(), "alice's role only reads");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keels_etcd_snapshot_passes_etcdutl_and_restores_into_etcd() {
    let (Some(etcd_bin), Some(etcdutl)) = (tool("etcd"), tool("etcdutl")) else {
        eprintln!("not run: build etcd and etcdutl with scripts/go-tools etcd etcdutl");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(82);
    let cfg = common::member_config(dir.path(), "http", &ip, (23790, 23800), &["m1"], 0, "to-etcd");
    let server = common::start_retrying(cfg, 20).await;
    let url = format!("http://{ip}:23790");
    let mut keel = connect(&url, None).await;
    fill(&mut keel).await;
    let mut keel = connect(&url, Some(("root", "rootpw"))).await;
    let (keel_keys, keel_revision) = all_keys(&mut keel).await;
    let keel_leases = all_leases(&mut keel).await;
    let (txn, _) = server.node.sm.read_now().unwrap();
    // As Maintenance.Snapshot would: the database into a file, then its SHA-256 after it.
    let snapshot = dir.path().join("keel.snapshot");
    let out = std::fs::File::create(&snapshot).unwrap();
    let (mut out, len) = keel_cluster::etcd_snapshot::export_to(&txn, out).unwrap();
    drop(txn);
    server.stop().await;
    let hash = <sha2::Sha256 as sha2::Digest>::digest(std::fs::read(&snapshot).unwrap());
    std::io::Write::write_all(&mut out, &hash).unwrap();
    drop(out);
    assert_eq!(std::fs::metadata(&snapshot).unwrap().len(), len + 32);

    let status = Command::new(&etcdutl).args(["snapshot", "status", "-w", "json"]).arg(&snapshot).output().unwrap();
    let text = String::from_utf8_lossy(&status.stdout).to_string();
    assert!(status.status.success(), "etcdutl snapshot status: {}", String::from_utf8_lossy(&status.stderr));
    assert!(text.contains(&format!("\"revision\":{keel_revision}")), "status names keel's revision: {text}");

    let etcd_dir = dir.path().join("etcd");
    let peer_url = format!("http://127.0.0.1:{}", free_port());
    let restore = Command::new(&etcdutl)
        .args(["snapshot", "restore"])
        .arg(&snapshot)
        .args(["--name", "e1", "--data-dir"])
        .arg(&etcd_dir)
        .args(["--initial-cluster", &format!("e1={peer_url}"), "--initial-advertise-peer-urls", &peer_url])
        .output()
        .unwrap();
    assert!(restore.status.success(), "etcdutl snapshot restore: {}", String::from_utf8_lossy(&restore.stderr));
    let etcd = Etcd::start(&etcd_bin, &etcd_dir, &dir.path().join("etcd.log"), free_port(), &peer_url);
    let mut from_etcd = connect(&etcd.endpoint, Some(("root", "rootpw"))).await;
    let (etcd_keys, etcd_revision) = all_keys(&mut from_etcd).await;
    assert_eq!(etcd_keys, keel_keys);
    assert_eq!(etcd_revision, keel_revision);
    assert_eq!(all_leases(&mut from_etcd).await, keel_leases);
    let put = from_etcd.put("after", "1", None).await.unwrap();
    assert_eq!(put.header().unwrap().revision(), keel_revision + 1);
    let mut alice = connect(&etcd.endpoint, Some(("alice", "alicepw"))).await;
    assert_eq!(alice.get("k/00", None).await.unwrap().kvs()[0].value(), b"third");
}
