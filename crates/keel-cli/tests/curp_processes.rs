//! CURP weak sessions on three real `keel serve` processes while members are killed with
//! SIGKILL and restarted (the leader half the time): each session, bound to a different member,
//! does weak puts, weak reads and strong puts with unique values; afterwards every session's
//! history is checked against the log for causal anomalies (keel-cluster's `common::causal`:
//! read-your-writes, monotonic reads and writes, writes-follow-reads, no read of a write never
//! made, nothing lost or applied twice). Strong operations under kill -9 are porcupine-checked by
//! `keelcheck fault --curp-percent` in scripts/cluster-check. `KEEL_CURP_SEED` replays a seed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_curp::client::Client as CurpClient;
use keel_curp::etcd::PutRequest;
use rand::{Rng, SeedableRng};

#[allow(dead_code)]
#[path = "../../keel-cluster/tests/common/causal.rs"]
mod causal;
use causal::SessionOp;

const BASE: u16 = 27410;

struct Members {
    dir: tempfile::TempDir,
    children: Vec<Option<Child>>,
}

fn client_url(i: usize) -> String {
    format!("http://127.0.0.1:{}", BASE + 2 * i as u16)
}

fn peer_url(i: usize) -> String {
    format!("http://127.0.0.1:{}", BASE + 2 * i as u16 + 1)
}

impl Members {
    fn start(&mut self, i: usize) {
        let initial: Vec<String> = (0..3).map(|j| format!("p{j}={}", peer_url(j))).collect();
        let log = std::fs::File::create(self.dir.path().join(format!("p{i}.log"))).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_keel"))
            .arg("serve")
            .arg(format!("--name=p{i}"))
            .arg(format!("--data-dir={}", self.dir.path().join(format!("p{i}")).display()))
            .arg(format!("--listen-client-urls={}", client_url(i)))
            .arg(format!("--advertise-client-urls={}", client_url(i)))
            .arg(format!("--listen-peer-urls={}", peer_url(i)))
            .arg(format!("--initial-advertise-peer-urls={}", peer_url(i)))
            .arg(format!("--initial-cluster={}", initial.join(",")))
            .arg("--initial-cluster-token=curp-processes")
            .arg("--initial-cluster-state=new")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("starting keel serve");
        self.children[i] = Some(child);
    }

    /// SIGKILLs member `i`; true if it was still running when struck.
    fn kill(&mut self, i: usize) -> bool {
        let Some(mut c) = self.children[i].take() else { return false };
        let alive = matches!(c.try_wait(), Ok(None));
        let _ = c.kill(); // SIGKILL
        let _ = c.wait();
        alive
    }
}

impl Drop for Members {
    fn drop(&mut self) {
        for i in 0..self.children.len() {
            let _ = self.kill(i);
        }
    }
}

/// Waits (bounded) until a put through the members succeeds.
async fn wait_ready(urls: &[String]) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Ok(mut c) = etcd_client::Client::connect(urls, None).await {
            if c.put("ready", "1", None).await.is_ok() {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("the members did not come up within 60 s");
}

/// The member that leads, as the first one that answers says.
async fn leader_index(urls: &[String]) -> Option<usize> {
    for url in urls {
        let Ok(Ok(mut c)) =
            tokio::time::timeout(Duration::from_secs(1), etcd_client::Client::connect([url.as_str()], None)).await
        else {
            continue;
        };
        let Ok(Ok(s)) = tokio::time::timeout(Duration::from_secs(1), c.status()).await else { continue };
        let leader = s.leader();
        for (i, u) in urls.iter().enumerate() {
            let Ok(Ok(mut c)) =
                tokio::time::timeout(Duration::from_secs(1), etcd_client::Client::connect([u.as_str()], None)).await
            else {
                continue;
            };
            if let Ok(Ok(s)) = tokio::time::timeout(Duration::from_secs(1), c.status()).await {
                if s.header().map_or(0, |h| h.member_id()) == leader {
                    return Some(i);
                }
            }
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn weak_sessions_stay_causal_across_kill_9() {
    let seed: u64 = std::env::var("KEEL_CURP_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    eprintln!("curp processes seed {seed}; replay with KEEL_CURP_SEED={seed}");
    let mut members = Members { dir: tempfile::tempdir().unwrap(), children: (0..3).map(|_| None).collect() };
    for i in 0..3 {
        members.start(i);
    }
    let urls: Vec<String> = (0..3).map(client_url).collect();
    wait_ready(&urls).await;
    let mut etcd = etcd_client::Client::connect(urls.clone(), None).await.unwrap();
    let start_rev = etcd.get("wkey", None).await.unwrap().header().unwrap().revision();
    let (head_tx, head_rx) = tokio::sync::watch::channel(0i64);
    let recorder = tokio::spawn(causal::record_log(urls.clone(), "wkey", start_rev + 1, head_rx));

    // The sessions run until the nemesis has made its kills and the cluster has had a moment
    // to settle, bounded by a hard deadline in case a restart hangs.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let deadline = Instant::now() + Duration::from_secs(45);
    let counter = Arc::new(AtomicU64::new(1));
    let mut tasks = Vec::new();
    for c in 0..3usize {
        let client = CurpClient::connect(&urls, Duration::from_secs(2)).await.unwrap();
        client.bind(c);
        let counter = Arc::clone(&counter);
        let stop = Arc::clone(&stop);
        tasks.push(tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ ((c as u64 + 1) << 40));
            let mut ops = Vec::new();
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                let key = rng.gen_range(0..6usize);
                let k = format!("wkey{key}");
                let roll = rng.gen_range(0..20);
                if (9..18).contains(&roll) {
                    if let Ok(r) = client.weak_get(k.as_bytes()).await {
                        let got = r.value.map(|(v, rev)| (causal::parse(&v), rev));
                        ops.push(SessionOp::Get { key, got, pending: r.pending });
                    }
                    continue;
                }
                let value = counter.fetch_add(1, Ordering::Relaxed);
                let req = PutRequest { key: k.into(), value: value.to_string().into(), ..Default::default() };
                let strong = roll >= 18;
                let ok = if strong { client.put(&req).await.is_ok() } else { client.weak_put(&req).await.is_ok() };
                ops.push(SessionOp::Put { key, value, strong, ok });
            }
            (client, ops)
        }));
    }

    // Nemesis: exactly KILLS times, kill -9 a member (the leader half the time) while the
    // sessions run, and restart it a moment later. A count, not a time budget: on a slow machine
    // a time budget fitted fewer kills than the test promises.
    const KILLS: usize = 3;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut struck = 0;
    for _ in 0..KILLS {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(1500..3000))).await;
        let victim = match rng.gen_bool(0.5) {
            true => leader_index(&urls).await.unwrap_or(0),
            false => rng.gen_range(0..3),
        };
        struck += usize::from(members.kill(victim));
        tokio::time::sleep(Duration::from_millis(rng.gen_range(300..1500))).await;
        members.start(victim);
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let sessions_outlived_nemesis = Instant::now() < deadline;
    stop.store(true, Ordering::Relaxed);

    let sessions = causal::settle_all(tasks, 20).await.unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    let log = causal::close_log(&urls, "wkey", start_rev, head_tx, recorder)
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    let ops: usize = sessions.iter().map(Vec::len).sum();
    let pending = sessions.iter().flatten().filter(|o| matches!(o, SessionOp::Get { pending: true, .. })).count();
    eprintln!("seed {seed}: {struck} kills, {ops} weak-session operations ({pending} reads of own pending writes), {} writes applied", log.len());
    assert_eq!(struck, KILLS, "seed {seed}: every kill must strike a running member");
    assert!(sessions_outlived_nemesis, "seed {seed}: the sessions stopped (hard deadline) before the nemesis was done");
    assert!(ops > 50, "too few operations to mean anything: {ops}");
    causal::check(&log, &sessions).unwrap_or_else(|e| panic!("seed {seed}: causal anomaly: {e}"));
}
