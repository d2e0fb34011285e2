//! How long a member with many keys takes to serve again after kill -9 (issue 11's goal: a
//! member restarted with 1M keys serves again within 3 s).
//!
//! Starts three `keel serve` processes on 127.0.0.1, loads `--keys` keys (100-byte values, 100
//! puts per txn, 32 txns in flight) through the etcd v3 API, then for a follower and then the
//! leader: kill -9, restart, and time until the member answers a linearizable and a
//! serializable read of the last key on its own endpoint.
//!
//! ```text
//! cargo build --release -p keel-cli
//! cargo run --release -p keel-cluster --example restart -- --keel target/release/keel --keys 1000000
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout, clippy::indexing_slicing, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use etcd_client::{Client, GetOptions, Txn, TxnOp};

const BASE_PORT: u16 = 26300;

struct Member {
    name: &'static str,
    client: String,
    child: Option<Child>,
}

/// Members die with the program, also when it panics.
impl Drop for Member {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn spawn(keel: &Path, dir: &Path, name: &str, i: u16, initial_cluster: &str, state: &str) -> Child {
    let client = format!("http://127.0.0.1:{}", BASE_PORT + 2 * i);
    let peer = format!("http://127.0.0.1:{}", BASE_PORT + 2 * i + 1);
    Command::new(keel)
        .args(["serve", "--name", name, "--data-dir"])
        .arg(dir.join(name))
        .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
        .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
        .args(["--initial-cluster", initial_cluster, "--initial-cluster-state", state, "--log-level", "error"])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start keel serve")
}

/// Polls `endpoint` until a read of `key` answers at `consistency`; returns the time taken.
async fn time_to_serve(endpoint: &str, key: &str, serializable: bool, started: Instant) -> Duration {
    let deadline = started + Duration::from_secs(120);
    loop {
        assert!(Instant::now() < deadline, "{endpoint} did not serve within 120 s");
        if let Ok(mut c) = Client::connect([endpoint], None).await {
            let opts = if serializable { GetOptions::new().with_serializable() } else { GetOptions::new() };
            if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_millis(500), c.get(key, Some(opts))).await {
                if !r.kvs().is_empty() {
                    return started.elapsed();
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let mut keel = PathBuf::from("target/release/keel");
    let mut keys: usize = 1_000_000;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--keel" => keel = PathBuf::from(args.next().expect("--keel PATH")),
            "--keys" => keys = args.next().expect("--keys N").parse().expect("a number"),
            other => panic!("unknown argument {other}"),
        }
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let names = ["a", "b", "c"];
    let initial_cluster = names
        .iter()
        .enumerate()
        .map(|(i, n)| format!("{n}=http://127.0.0.1:{}", BASE_PORT + 2 * i as u16 + 1))
        .collect::<Vec<_>>()
        .join(",");
    let mut members: Vec<Member> = names
        .iter()
        .enumerate()
        .map(|(i, &name)| Member {
            name,
            client: format!("http://127.0.0.1:{}", BASE_PORT + 2 * i as u16),
            child: Some(spawn(&keel, dir.path(), name, i as u16, &initial_cluster, "new")),
        })
        .collect();
    let endpoints: Vec<String> = members.iter().map(|m| m.client.clone()).collect();
    let mut client = loop {
        if let Ok(mut c) = Client::connect(endpoints.clone(), None).await {
            if c.put("ready", "1", None).await.is_ok() {
                break c;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    let load = Instant::now();
    let value = vec![b'v'; 100];
    let per_txn = 100;
    let mut next = 0usize;
    let mut inflight = tokio::task::JoinSet::new();
    while next < keys || !inflight.is_empty() {
        while next < keys && inflight.len() < 32 {
            let ops: Vec<TxnOp> = (next..(next + per_txn).min(keys))
                .map(|k| TxnOp::put(format!("key{k:08}"), value.clone(), None))
                .collect();
            next += ops.len();
            let mut c = client.clone();
            inflight.spawn(async move { c.txn(Txn::new().and_then(ops)).await.map(|_| ()) });
        }
        if let Some(r) = inflight.join_next().await {
            r.expect("load task").expect("load txn");
        }
    }
    let last_key = format!("key{:08}", keys - 1);
    let count = client.get("key", Some(GetOptions::new().with_prefix().with_count_only())).await.unwrap().count();
    assert_eq!(count as usize, keys, "every loaded key is there");
    println!("loaded {keys} keys in {:.1} s", load.elapsed().as_secs_f64());

    for role in ["follower", "leader"] {
        let status = client.status().await.unwrap();
        let leader = status.leader();
        let mut which = None;
        for (i, m) in members.iter().enumerate() {
            let mut c = Client::connect([m.client.clone()], None).await.unwrap();
            let id = c.status().await.unwrap().header().unwrap().member_id();
            if (role == "leader") == (id == leader) {
                which = Some(i);
                break;
            }
        }
        let i = which.expect("a member in that role");
        let m = &mut members[i];
        let mut child = m.child.take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        let started = Instant::now();
        m.child = Some(spawn(&keel, dir.path(), m.name, i as u16, &initial_cluster, "existing"));
        let ser = time_to_serve(&m.client, &last_key, true, started).await;
        let lin = time_to_serve(&m.client, &last_key, false, started).await;
        println!(
            "{role} {} restarted after kill -9 with {keys} keys: serializable read after {:.2} s, linearizable after {:.2} s",
            m.name,
            ser.as_secs_f64(),
            lin.as_secs_f64()
        );
        // Let the cluster settle (a new leader after the leader's kill) before the next round.
        tokio::time::sleep(Duration::from_secs(2)).await;
        client = Client::connect(endpoints.clone(), None).await.unwrap();
    }
    drop(members);
}
