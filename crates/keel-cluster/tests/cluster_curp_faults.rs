//! CURP under faults: three in-process members; CURP clients writing on the fast path and etcd
//! clients doing put, linearizable get and compare-and-swap on the same few keys, while a seeded
//! nemesis isolates members (the leader half the time), delays or loses messages, and stops and
//! restarts the leader. Every key's history, fast writes included, must be linearizable: a fast
//! write lost with its leader, or applied twice (an old value coming back), fails the check.
//! Beside them, weak sessions (each bound to a different member) do weak puts, weak reads and
//! strong puts on keys of their own; their histories are checked against the log for causal
//! anomalies (`common::causal`).
//! Seeds are printed; `KEEL_CURP_SEED` replays one, `KEEL_CURP_SECS` lengthens the run.
//!
//! Its own test binary: the link cuts are process-wide.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_cluster::curp::client::Client as CurpClient;
use keel_cluster::network::faults;
use keel_cluster::{ServeConfig, Server};
use keel_curp::etcd::PutRequest as PbPutRequest;

mod common;
use common::causal::{self, SessionOp};
use common::history::{self, Event, Op, Out};
use rand::{Rng, SeedableRng};

const NAMES: [&str; 3] = ["f1", "f2", "f3"];
const PORTS: (u16, u16) = (24410, 24420);

fn config(dir: &std::path::Path, ip: &str, i: usize) -> ServeConfig {
    ServeConfig {
        election_timeout: Duration::from_millis(300),
        snapshot_count: 200,
        ..common::member_config(dir, "http", ip, PORTS, &NAMES, i, "curp-faults")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn curp_histories_under_faults_are_linearizable() {
    let seed: u64 = std::env::var("KEEL_CURP_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    let secs: u64 = std::env::var("KEEL_CURP_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(12);
    eprintln!("curp fault test seed {seed} ({secs} s); replay with KEEL_CURP_SEED={seed}");
    let dir = tempfile::tempdir().unwrap();
    let ip = common::loopback_ip(64);
    let mut servers: Vec<Option<Server>> = Vec::new();
    for i in 0..3 {
        servers.push(Some(common::start_retrying(config(dir.path(), &ip, i), 20).await));
    }
    common::wait_leader(&servers, 20).await;
    let ids: Vec<u64> = servers.iter().flatten().map(|s| s.node.id).collect();
    let urls: Vec<String> = (0..3).map(|i| format!("http://{ip}:{}", PORTS.0 + i as u16)).collect();
    let shared = history::Shared::default();
    let history = Arc::clone(&shared.history);
    let keys = 8usize;
    // The nemesis makes faults while `secs` last, and at least MIN_FAULTS of them; the clients
    // run until it is done (`shared.stop`), bounded by a hard deadline.
    let faults_until = Instant::now() + Duration::from_secs(secs);
    let deadline = faults_until + Duration::from_secs(60);

    let mut tasks = Vec::new();
    for c in 0..3u64 {
        let plan = history::ClientPlan {
            url: urls[c as usize].clone(),
            seed,
            client: c,
            keys,
            deadline,
            max_ops: usize::MAX,
            unique_puts: false,
            timeout: Duration::from_secs(4),
        };
        tasks.push(tokio::spawn(history::run_client(plan, shared.clone())));
    }
    let fast = Arc::new(AtomicU64::new(0));
    for c in 0..3u64 {
        let client = CurpClient::connect(&urls, Duration::from_secs(2)).await.unwrap();
        let (shared, fast) = (shared.clone(), Arc::clone(&fast));
        tasks.push(tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ ((c + 100) << 32));
            while Instant::now() < deadline && !shared.stop.load(Ordering::Relaxed) {
                let key = rng.gen_range(0..keys);
                let v = shared.counter.fetch_add(1, Ordering::Relaxed);
                let req =
                    PbPutRequest { key: format!("key{key}").into(), value: v.to_string().into(), ..Default::default() };
                let call = Instant::now();
                let out = match client.put(&req).await {
                    Ok(a) => {
                        if a.fast {
                            fast.fetch_add(1, Ordering::Relaxed);
                        }
                        Out::Ok
                    }
                    Err(_) => Out::Unknown,
                };
                let ret = (out == Out::Ok).then(Instant::now);
                shared.history.lock().push(Event { key, op: Op::Put(v), out, call, ret });
                if ret.is_none() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }));
    }

    // Weak sessions on keys wkey0.. of their own: weak puts, weak reads, now and then a strong
    // put (after the session's weak writes: the slow path). Values unique.
    let weak_keys = 6usize;
    let mut etcd = etcd_client::Client::connect(urls.clone(), None).await.unwrap();
    let start_rev = etcd.get("wkey", None).await.unwrap().header().unwrap().revision();
    let (head_tx, head_rx) = tokio::sync::watch::channel(0i64);
    let recorder = tokio::spawn(causal::record_log(urls.clone(), "wkey", start_rev + 1, head_rx));
    let mut weak_tasks = Vec::new();
    for c in 0..3usize {
        let client = CurpClient::connect(&urls, Duration::from_secs(2)).await.unwrap();
        client.bind(c);
        let counter = Arc::clone(&shared.counter);
        let stop = Arc::clone(&shared.stop);
        weak_tasks.push(tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ ((c as u64 + 200) << 32));
            let mut ops = Vec::new();
            while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
                let key = rng.gen_range(0..weak_keys);
                let k = format!("wkey{key}");
                match rng.gen_range(0..20) {
                    0..=8 => {
                        let value = counter.fetch_add(1, Ordering::Relaxed);
                        let req = PbPutRequest { key: k.into(), value: value.to_string().into(), ..Default::default() };
                        let ok = client.weak_put(&req).await.is_ok();
                        ops.push(SessionOp::Put { key, value, strong: false, ok });
                    }
                    9..=17 => {
                        if let Ok(r) = client.weak_get(k.as_bytes()).await {
                            let got = r.value.map(|(v, rev)| (history::parse(&v), rev));
                            ops.push(SessionOp::Get { key, got, pending: r.pending });
                        }
                    }
                    _ => {
                        let value = counter.fetch_add(1, Ordering::Relaxed);
                        let req = PbPutRequest { key: k.into(), value: value.to_string().into(), ..Default::default() };
                        let ok = client.put(&req).await.is_ok();
                        ops.push(SessionOp::Put { key, value, strong: true, ok });
                    }
                }
            }
            (client, ops)
        }));
    }

    // Nemesis, one fault at a time, then heal.
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    faults::seed(seed);
    let mut kinds = BTreeMap::new();
    // A count as well as a time: a slow restart must not leave the run with fewer faults.
    const MIN_FAULTS: usize = 3;
    let mut rounds = 0;
    while rounds < MIN_FAULTS || Instant::now() + Duration::from_millis(2500) < faults_until {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(300..900))).await;
        let leader = servers.iter().flatten().find_map(|s| s.node.leader()).unwrap_or(ids[0]);
        let victim = if rng.gen_bool(0.5) { leader } else { ids[rng.gen_range(0..3)] };
        let kind = rng.gen_range(0..4);
        *kinds.entry(["isolate", "delay", "loss", "stop leader"][kind]).or_insert(0) += 1;
        rounds += 1;
        if kind == 3 {
            let at = servers.iter().position(|s| s.as_ref().is_some_and(|s| s.node.id == leader)).unwrap();
            servers[at].take().unwrap().stop().await;
            tokio::time::sleep(Duration::from_millis(rng.gen_range(300..1200))).await;
            servers[at] = Some(common::start_retrying(config(dir.path(), &ip, at), 20).await);
            continue;
        }
        for &other in ids.iter().filter(|o| **o != victim) {
            match kind {
                0 => {
                    faults::set_cut(victim, other, true);
                    faults::set_cut(other, victim, true);
                }
                1 => {
                    let hi = rng.gen_range(5..60);
                    faults::set_delay(victim, other, Some((1, hi)));
                    faults::set_delay(other, victim, Some((1, hi)));
                }
                _ => {
                    let p = rng.gen_range(0.05..0.3);
                    faults::set_loss(victim, other, p);
                    faults::set_loss(other, victim, p);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(400..1500))).await;
        faults::heal_all();
    }
    faults::heal_all();
    eprintln!("faults: {kinds:?}");
    // A moment of healed cluster under load, then the clients stop.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let clients_outlived_nemesis = Instant::now() < deadline;
    shared.stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    common::wait_leader(&servers, 30).await;
    for url in &urls {
        let mut client = etcd_client::Client::connect([url.clone()], None).await.unwrap();
        for key in 0..keys {
            let call = Instant::now();
            let r = tokio::time::timeout(Duration::from_secs(10), client.get(format!("key{key}"), None))
                .await
                .unwrap()
                .unwrap();
            let v = r.kvs().first().map(|kv| history::parse(kv.value()));
            history.lock().push(Event { key, op: Op::Get, out: Out::Value(v), call, ret: Some(Instant::now()) });
        }
    }
    // The weak sessions' writes apply (resent where need be), then the log of their keys is
    // read back (recorded by the watch since the start) and every session is checked against it.
    let sessions = causal::settle_all(weak_tasks, 10).await.unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    let log = causal::close_log(&urls, "wkey", start_rev, head_tx, recorder)
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    let weak_ops: usize = sessions.iter().map(Vec::len).sum();
    let pending_reads = sessions.iter().flatten().filter(|o| matches!(o, SessionOp::Get { pending: true, .. })).count();
    eprintln!("seed {seed}: {weak_ops} weak-session operations ({pending_reads} reads of own pending writes), {} writes applied", log.len());
    assert!(weak_ops > 30, "too few weak-session operations to mean anything: {weak_ops}");
    causal::check(&log, &sessions).unwrap_or_else(|e| panic!("seed {seed}: causal anomaly: {e}"));

    let history = history.lock().clone();
    let ok = history.iter().filter(|e| e.ret.is_some()).count();
    let fast = fast.load(Ordering::Relaxed);
    eprintln!("seed {seed}: {} operations ({ok} answered, {fast} fast CURP writes), {rounds} faults", history.len());
    assert!(clients_outlived_nemesis, "seed {seed}: the clients stopped (hard deadline) before the nemesis was done");
    assert!(fast > 20, "too few fast-path writes to mean anything: {fast}");
    history::assert_linearizable(&history, keys, seed);
    history::assert_revisions(&shared.revisions.lock(), seed);
    for s in servers.into_iter().flatten() {
        s.stop().await;
    }
}

/// The checker itself catches each anomaly it names (a checker that passes everything would
/// make the fault test above mean nothing).
mod checker {
    use super::causal::{check, log_of, SessionOp};

    fn put(key: usize, value: u64) -> SessionOp {
        SessionOp::Put { key, value, strong: false, ok: true }
    }
    fn get(key: usize, got: Option<(u64, i64)>) -> SessionOp {
        SessionOp::Get { key, got, pending: false }
    }

    #[test]
    fn causal_checker_catches_each_anomaly() {
        let log = log_of(&[(0, 1, 5), (1, 2, 6), (0, 3, 7)]).unwrap();
        // Fine: own write read pending, then applied; another key read.
        let good = vec![
            put(0, 1),
            SessionOp::Get { key: 0, got: Some((1, 0)), pending: true },
            get(0, Some((1, 5))),
            get(1, Some((2, 6))),
        ];
        check(&log, &[good]).unwrap();
        // Read-your-writes broken: wrote 3 (rev 7), read 1 (rev 5).
        assert!(check(&log, &[vec![put(0, 3), get(0, Some((1, 5)))]]).is_err());
        // Monotonic reads broken: saw revision 7, then an older value of key 0.
        assert!(check(&log, &[vec![get(0, Some((3, 7))), get(0, Some((1, 5)))]]).is_err());
        // A value never written.
        assert!(check(&log, &[vec![get(0, Some((9, 8)))]]).is_err());
        // A completed write that never applied.
        assert!(check(&log, &[vec![put(1, 42)]]).is_err());
        // Writes out of session order.
        assert!(check(&log, &[vec![put(0, 3), put(1, 2)]]).is_err());
        // Writes-follow-reads: read revision 7, then a weak write at 6.
        assert!(check(&log, &[vec![get(0, Some((3, 7))), put(1, 2)]]).is_err());
        // Another session's pending value.
        assert!(check(&log, &[vec![SessionOp::Get { key: 0, got: Some((1, 0)), pending: true }]]).is_err());
        // A double apply.
        assert!(log_of(&[(0, 1, 5), (0, 1, 6)]).is_err());
    }
}
