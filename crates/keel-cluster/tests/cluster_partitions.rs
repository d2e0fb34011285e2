//! Three in-process members while a seeded nemesis cuts members off (both directions, or one),
//! delays their messages or loses some of them, then heals, with clients bound to every member doing put, linearizable
//! get and compare-and-swap on a few keys. The history is checked for linearizability per key
//! (`common::history`). Seeds are printed; `KEEL_PARTITION_SEED` replays
//! one and `KEEL_PARTITION_SECS` lengthens the run.
//!
//! Its own test binary: the link cuts are process-wide.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::Client;
use keel_cluster::network::faults;
use keel_cluster::{ServeConfig, Server};

mod common;
use common::history::{self, linearizable, Event, Op, Out};
use rand::{Rng, SeedableRng};

fn config(dir: &std::path::Path, ip: &str, i: usize) -> ServeConfig {
    ServeConfig {
        election_timeout: Duration::from_millis(300),
        snapshot_count: 200,
        ..common::member_config(dir, "http", ip, (23890, 23900), &["p1", "p2", "p3"], i, "partitions")
    }
}

#[test]
fn the_checker_rejects_a_stale_read() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let ev = |op, out, c, r| Event { key: 0, op, out, call: at(c), ret: Some(at(r)) };
    let good = vec![ev(Op::Put(1), Out::Ok, 0, 10), ev(Op::Get, Out::Value(Some(1)), 20, 30)];
    assert!(linearizable(&good));
    let stale =
        vec![ev(Op::Put(1), Out::Ok, 0, 10), ev(Op::Put(2), Out::Ok, 20, 30), ev(Op::Get, Out::Value(Some(1)), 40, 50)];
    assert!(!linearizable(&stale));
    let lost_unknown_ok = vec![
        Event { key: 0, op: Op::Put(1), out: Out::Unknown, call: at(0), ret: None },
        ev(Op::Get, Out::Value(None), 5, 8),
        ev(Op::Get, Out::Value(Some(1)), 20, 30),
    ];
    assert!(linearizable(&lost_unknown_ok));
    let bad_cas = vec![ev(Op::Put(1), Out::Ok, 0, 10), ev(Op::Cas(2, 3), Out::Swapped(true), 20, 30)];
    assert!(!linearizable(&bad_cas));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn histories_under_partitions_are_linearizable() {
    let seed: u64 = std::env::var("KEEL_PARTITION_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    let secs: u64 = std::env::var("KEEL_PARTITION_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(12);
    eprintln!("partition test seed {seed} ({secs} s); replay with KEEL_PARTITION_SEED={seed}");
    let dir = tempfile::tempdir().unwrap();
    let pid = std::process::id();
    let ip = format!("127.50.{}.{}", (pid >> 8) as u8, (pid as u8).max(2));
    let mut servers = Vec::new();
    for i in 0..3 {
        servers.push(Server::start(config(dir.path(), &ip, i)).await.unwrap());
    }
    let ids: Vec<u64> = servers.iter().map(|s| s.node.id).collect();
    let shared = history::Shared::default();
    let history = Arc::clone(&shared.history);
    let keys = 12usize;
    let deadline = Instant::now() + Duration::from_secs(secs);

    let mut tasks = Vec::new();
    for c in 0..6u64 {
        let plan = history::ClientPlan {
            url: format!("http://{ip}:{}", 23890 + (c % 3)),
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

    // Nemesis, one fault at a time, then heal: isolate a member (the leader or any), cut one
    // direction only, delay every message (reordering messages across connections), or lose
    // messages (requests or answers) on every link.
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    faults::seed(seed);
    let mut cuts = 0;
    let mut kinds = BTreeMap::new();
    while Instant::now() + Duration::from_millis(1500) < deadline {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(300..900))).await;
        let leader = servers[0].node.leader().unwrap_or(ids[0]);
        let victim = if rng.gen_bool(0.5) { leader } else { ids[rng.gen_range(0..3)] };
        let kind = rng.gen_range(0..4);
        for &other in &ids {
            if other == victim {
                continue;
            }
            match kind {
                0 => {
                    faults::set_cut(victim, other, true);
                    faults::set_cut(other, victim, true);
                }
                1 => faults::set_cut(victim, other, true),
                2 => {
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
        *kinds.entry(["isolate", "one-way cut", "delay", "loss"][kind]).or_insert(0) += 1;
        cuts += 1;
        tokio::time::sleep(Duration::from_millis(rng.gen_range(400..1500))).await;
        faults::heal_all();
    }
    eprintln!("faults: {kinds:?}");
    faults::heal_all();
    for t in tasks {
        t.await.unwrap();
    }
    // Final linearizable reads of every key through every member are part of the history.
    for m in 0..3 {
        let mut client = Client::connect([format!("http://{ip}:{}", 23890 + m)], None).await.unwrap();
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
    let history = history.lock().clone();
    let ok = history.iter().filter(|e| e.ret.is_some()).count();
    eprintln!("seed {seed}: {} operations ({ok} answered), {cuts} partitions", history.len());
    assert!(cuts >= 3, "the nemesis must have cut links");
    assert!(ok > 50, "too few operations completed: {ok}");
    let check_start = Instant::now();
    history::assert_linearizable(&history, keys, seed);
    history::assert_revisions(&shared.revisions.lock(), seed);
    eprintln!("checked in {:?}", check_start.elapsed());
    for s in servers {
        s.stop().await;
    }
}
