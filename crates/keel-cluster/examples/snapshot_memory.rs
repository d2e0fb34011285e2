//! Peak memory of Raft snapshots (issue 11: snapshots are checkpoint streams, never whole in
//! memory): how much a member that joins a loaded cluster, and so catches up from a snapshot,
//! holds at its peak, and how much a `Maintenance.Snapshot` adds on the member serving it.
//!
//! Starts three member processes on 127.0.0.1 (this program again, with `--member`: a
//! `keel_cluster::Server` with `keel serve`'s defaults and a snapshot count of 1000, so that
//! only this crate needs building), loads `--keys`
//! keys (100-byte values, 100 puts per txn, 32 txns in flight), adds a fourth member with
//! `member add` and starts it with `--initial-cluster-state existing`, waits until it serves
//! every key from its own state, and reports its peak RSS (VmHWM in /proc/PID/status) and the
//! leader's. Then streams a `Maintenance.Snapshot` from a follower and reports that member's
//! peak RSS before and after. Last, a follower is killed, misses 3,000 writes and restarts:
//! its peak RSS while it catches up from a snapshot on top of its own state.
//!
//! ```text
//! cargo run --release -p keel-cluster --example snapshot_memory -- --keys 1000000
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout, clippy::indexing_slicing, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use etcd_client::{Client, GetOptions, Txn, TxnOp};
use keel_cluster::ServeConfig;

const BASE_PORT: u16 = 26400;

/// A member process, killed with the program (also when it panics).
struct Member {
    name: &'static str,
    client: String,
    child: Child,
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn peer(i: u16) -> String {
    format!("http://127.0.0.1:{}", BASE_PORT + 2 * i + 1)
}

fn client_url(i: u16) -> String {
    format!("http://127.0.0.1:{}", BASE_PORT + 2 * i)
}

/// Starts member `i` of `members` (names) as a process of its own.
fn spawn(dir: &Path, name: &'static str, i: u16, members: usize, state: &str) -> Member {
    let child = Command::new(std::env::current_exe().expect("this program"))
        .args(["--member", name, &i.to_string(), &members.to_string(), state])
        .arg(dir.join(name))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start a member");
    Member { name, client: client_url(i), child }
}

/// The member process: serves until killed.
async fn member(mut args: impl Iterator<Item = String>) {
    let name = args.next().expect("name");
    let i: u16 = args.next().expect("index").parse().expect("a number");
    let n: u16 = args.next().expect("members").parse().expect("a number");
    let state = args.next().expect("state");
    let dir = PathBuf::from(args.next().expect("data dir"));
    let names = ["a", "b", "c", "d"];
    let config = ServeConfig {
        name,
        data_dir: dir,
        listen_client_urls: vec![client_url(i)],
        advertise_client_urls: vec![client_url(i)],
        listen_peer_urls: vec![peer(i)],
        initial_advertise_peer_urls: vec![peer(i)],
        initial_cluster: (0..n).map(|m| (names[m as usize].to_string(), vec![peer(m)])).collect(),
        initial_cluster_token: "snapshot-memory".into(),
        join_existing: state == "existing",
        snapshot_count: 1000,
        ..ServeConfig::default()
    };
    let server = keel_cluster::Server::start(config).await.expect("member start");
    server.node.stopped().await;
}

/// (VmHWM, VmRSS) of a process, in MiB.
fn memory(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/PID/status");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .expect("a memory field")
            / 1024.0
    };
    (field("VmHWM:"), field("VmRSS:"))
}

async fn member_id(url: &str) -> u64 {
    let mut c = Client::connect([url], None).await.unwrap();
    c.status().await.unwrap().header().unwrap().member_id()
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1).peekable();
    if args.peek().is_some_and(|a| a == "--member") {
        args.next();
        return member(args).await;
    }
    let mut keys: usize = 1_000_000;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--keys" => keys = args.next().expect("--keys N").parse().expect("a number"),
            other => panic!("unknown argument {other}"),
        }
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let names = ["a", "b", "c", "d"];
    let mut members: Vec<Member> = (0..3).map(|i| spawn(dir.path(), names[i], i as u16, 3, "new")).collect();
    let endpoints: Vec<String> = members.iter().map(|m| m.client.clone()).collect();
    // Every member answers before the load starts.
    for e in &endpoints {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(mut c) = Client::connect([e.as_str()], None).await {
                if c.put("ready", "1", None).await.is_ok() {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "{e} did not answer");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let mut client = Client::connect(endpoints.clone(), None).await.unwrap();

    let load = Instant::now();
    let value = vec![b'v'; 100];
    let mut next = 0usize;
    let mut inflight = tokio::task::JoinSet::new();
    while next < keys || !inflight.is_empty() {
        while next < keys && inflight.len() < 32 {
            let ops: Vec<TxnOp> =
                (next..(next + 100).min(keys)).map(|k| TxnOp::put(format!("key{k:08}"), value.clone(), None)).collect();
            next += ops.len();
            let mut c = client.clone();
            // Puts are idempotent here: a txn that timed out (unknown outcome) is sent again.
            inflight.spawn(async move {
                let mut tries = 0;
                loop {
                    match c.txn(Txn::new().and_then(ops.clone())).await {
                        Ok(_) => return Ok(()),
                        Err(e) if tries < 10 => {
                            tries += 1;
                            eprintln!("retrying a load txn: {e}");
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                        Err(e) => return Err(e),
                    }
                }
            });
        }
        if let Some(r) = inflight.join_next().await {
            r.expect("load task").expect("load txn");
        }
    }
    println!("loaded {keys} keys in {:.1} s", load.elapsed().as_secs_f64());
    let leader = client.status().await.unwrap().leader();
    let mut leader_at = 0;
    for (i, m) in members.iter().enumerate() {
        let (hwm, rss) = memory(m.child.id());
        let is_leader = member_id(&m.client).await == leader;
        if is_leader {
            leader_at = i;
        }
        println!(
            "member {} ({}) after the load: peak {hwm:.0} MiB, now {rss:.0} MiB",
            m.name,
            if is_leader { "leader" } else { "follower" }
        );
    }

    // A new member: it needs a snapshot (the log behind the last one is purged).
    client.member_add([peer(3)], None).await.unwrap();
    let started = Instant::now();
    members.push(spawn(dir.path(), names[3], 3, 4, "existing"));
    let joiner = members[3].client.clone();
    let deadline = started + Duration::from_secs(600);
    loop {
        assert!(Instant::now() < deadline, "the new member did not catch up within 600 s");
        if let Ok(mut c) = Client::connect([joiner.as_str()], None).await {
            let opts = GetOptions::new().with_prefix().with_count_only().with_serializable();
            if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(5), c.get("key", Some(opts))).await {
                if r.count() as usize == keys {
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let snap = dir.path().join("d/member/sm/snap/current");
    let snap_mib = std::fs::metadata(&snap).map(|m| m.len() as f64 / (1 << 20) as f64).unwrap_or(0.0);
    let (hwm, rss) = memory(members[3].child.id());
    println!(
        "new member d caught up from a {snap_mib:.0} MiB snapshot in {:.1} s: peak {hwm:.0} MiB, now {rss:.0} MiB",
        started.elapsed().as_secs_f64()
    );
    let (hwm, rss) = memory(members[leader_at].child.id());
    println!("leader {} after sending it: peak {hwm:.0} MiB, now {rss:.0} MiB", members[leader_at].name);

    // Maintenance.Snapshot from a follower that has served nothing else.
    let f = (0..3).find(|i| *i != leader_at).unwrap();
    let before = memory(members[f].child.id());
    let mut c = Client::connect([members[f].client.as_str()], None).await.unwrap();
    let mut stream = c.snapshot().await.unwrap();
    let mut bytes = 0usize;
    while let Some(chunk) = stream.message().await.unwrap() {
        bytes += chunk.blob().len();
    }
    let after = memory(members[f].child.id());
    println!(
        "Maintenance.Snapshot of {:.0} MiB from {}: peak {:.0} MiB before, {:.0} MiB after (now {:.0} MiB)",
        bytes as f64 / (1 << 20) as f64,
        members[f].name,
        before.0,
        after.0,
        after.1
    );

    // A lagging member: a follower is killed, 3,000 writes go by (more than the log keeps
    // behind a snapshot), and it restarts from its own disk, then catches up from a snapshot.
    let f = (0..3).find(|i| *i != leader_at).unwrap();
    let _ = members[f].child.kill();
    let _ = members[f].child.wait();
    let mut more = tokio::task::JoinSet::new();
    for w in 0..32 {
        let mut c = Client::connect([members[leader_at].client.as_str()], None).await.unwrap();
        more.spawn(async move {
            for k in (w..3000).step_by(32) {
                c.put(format!("key-late{k:05}"), vec![b'w'; 100], None).await.unwrap();
            }
        });
    }
    while let Some(r) = more.join_next().await {
        r.unwrap();
    }
    let restarted = std::time::SystemTime::now();
    let started = Instant::now();
    members[f] = spawn(dir.path(), names[f], f as u16, 3, "new");
    let url = members[f].client.clone();
    let deadline = started + Duration::from_secs(600);
    loop {
        assert!(Instant::now() < deadline, "the lagging member did not catch up within 600 s");
        if let Ok(mut c) = Client::connect([url.as_str()], None).await {
            let opts = GetOptions::new().with_prefix().with_count_only().with_serializable();
            if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(5), c.get("key", Some(opts))).await {
                if r.count() as usize == keys + 3000 {
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let snap = dir.path().join(names[f]).join("member/sm/snap/current");
    let installed = std::fs::metadata(&snap).and_then(|m| m.modified()).is_ok_and(|t| t > restarted);
    let (hwm, rss) = memory(members[f].child.id());
    println!(
        "lagging member {} restarted and caught up in {:.1} s (snapshot received: {installed}): peak {hwm:.0} MiB, now {rss:.0} MiB",
        members[f].name,
        started.elapsed().as_secs_f64()
    );
    drop(members);
}
