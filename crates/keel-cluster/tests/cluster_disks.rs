//! Three in-process members, each on its own simulated disk (`keel-testkit`'s `SimFs`: a power
//! loss loses, tears or bit-flips unsynced data and forgets unsynced directory operations),
//! while clients bound to every member do put, linearizable get and compare-and-swap on a few
//! keys (and writes of fresh keys whose acknowledgements are recorded), and a seeded nemesis,
//! round after round:
//! - power loss of one member (its disk crashes, the member is dropped and restarted on what
//!   the disk kept);
//! - power loss of all three at once, then all restart;
//! - a process kill of one member (the page cache survives, unsynced);
//! - an fdatasync `EIO` on one member's Raft log: the member must stop on its own with its
//!   fatal reason; it is then killed and restarted (recovery rewrites what the failed sync may
//!   have dropped, see `docs/design/replication.md`).
//!
//! Afterwards: every key's history is linearizable, every acknowledged fresh key is present,
//! and the members converge (the same revision and the same `HashKV`). Seeds are printed (and
//! again on failure); `KEEL_SIM_SEED` replays one, `KEEL_SIM_ROUNDS` runs more rounds.
//!
//! Its own test binary: it binds fixed loopback ports.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions, GetOptions};
use keel_cluster::{ServeConfig, Server};
use keel_testkit::sim::{Fault, FaultOp, SimFs};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

mod common;
use common::history::{self, Event, Op, Out};

const NAMES: [&str; 3] = ["d1", "d2", "d3"];
const PORTS: (u16, u16) = (23960, 23970);

/// Prints the seeds again if the test panics, so the replay command is at the failure.
struct SeedGuard(u64);

impl Drop for SeedGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("cluster_disks FAILED with seed {0}; replay: KEEL_SIM_SEED={0} cargo test -p keel-cluster --test cluster_disks", self.0);
        }
    }
}

struct Member {
    disk: SimFs,
    config: ServeConfig,
    server: Option<Server>,
}

fn config(ip: &str, i: usize, disk: &SimFs) -> ServeConfig {
    ServeConfig {
        election_timeout: Duration::from_millis(500),
        snapshot_count: 100,
        fs: Arc::new(disk.clone()),
        ..common::member_config(Path::new("/"), "http", ip, PORTS, &NAMES, i, "disks")
    }
}

/// Starts (or restarts) a member, retrying while its old listeners let go of the ports.
async fn start(m: &mut Member, seed: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match Server::start(m.config.clone()).await {
            Ok(s) => {
                m.server = Some(s);
                return;
            }
            Err(keel_cluster::StartError::Listen { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => {
                let trace = m.disk.trace();
                let tail = &trace[trace.len().saturating_sub(40)..];
                panic!(
                    "seed {seed}: member {} does not restart on what its disk kept: {e}\ndisk {}: {:#?}",
                    m.config.name,
                    m.disk.seed(),
                    tail
                );
            }
        }
    }
}

/// Stops a member's server (whose disk already crashed or was killed, so nothing it does on
/// the way out reaches the disk: its handles are dead and its Raft is shut down) and waits a
/// little for the old member's tasks to let go of it. Client connections the old gRPC server
/// still holds can keep it referenced longer; they can only fail (its Raft is stopped).
async fn stop(m: &mut Member) {
    if let Some(s) = m.server.take() {
        let old = Arc::downgrade(&s.node);
        s.stop().await;
        let deadline = Instant::now() + Duration::from_secs(3);
        while old.strong_count() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if old.strong_count() > 0 {
            eprintln!("{}: the stopped member is still referenced after 3 s", m.config.name);
        }
    }
}

/// Waits (bounded) until every member knows one and the same leader.
async fn wait_leader(members: &[Member], seed: u64, round: usize) {
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let leaders: Vec<Option<u64>> =
            members.iter().map(|m| m.server.as_ref().and_then(|s| s.node.leader())).collect();
        if leaders[0].is_some() && leaders.iter().all(|l| *l == leaders[0]) {
            return;
        }
        assert!(Instant::now() < deadline, "seed {seed}: round {round}: no common leader after 40 s: {leaders:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    PowerLossOne,
    PowerLossAll,
    ProcessKill,
    FsyncEio,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn members_on_simulated_disks_survive_power_loss_kills_and_fsync_errors() {
    let seed: u64 = std::env::var("KEEL_SIM_SEED").ok().and_then(|s| s.trim().parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    let rounds: usize = std::env::var("KEEL_SIM_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(8);
    // The nemesis stops after `rounds` or this long, whichever comes first (a slow machine
    // runs fewer rounds rather than a longer test); the first four rounds, one of each kind,
    // always run, so the check below that every kind ran holds on a slow machine too.
    let budget = Duration::from_secs(std::env::var("KEEL_SIM_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(35));
    // Histories per key stay short enough to check quickly however long the run.
    let keys = rounds.max(8);
    let disk_seeds: Vec<u64> = (0..3).map(|i| seed.wrapping_mul(3).wrapping_add(i)).collect();
    eprintln!("cluster_disks seed {seed} (disks {disk_seeds:?}), {rounds} rounds; replay with KEEL_SIM_SEED={seed}");
    let _guard = SeedGuard(seed);
    let ip = common::loopback_ip(60);
    let mut members: Vec<Member> = (0..3)
        .map(|i| {
            let disk = SimFs::new(disk_seeds[i]);
            Member { config: config(&ip, i, &disk), disk, server: None }
        })
        .collect();
    for m in &mut members {
        start(m, seed).await;
    }
    wait_leader(&members, seed, 0).await;

    let shared = history::Shared::default();
    let started = Instant::now();
    let mut clients = Vec::new();
    for c in 0..6u64 {
        let plan = history::ClientPlan {
            url: format!("http://{ip}:{}", PORTS.0 as u64 + c % 3),
            seed,
            client: c,
            keys,
            deadline: started + budget + Duration::from_secs(60),
            max_ops: 400 * rounds,
            unique_puts: true,
            timeout: Duration::from_secs(3),
        };
        clients.push(tokio::spawn(history::run_client(plan, shared.clone())));
    }

    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    // Every kind once per four rounds, in a seeded order.
    let mut schedule = Vec::new();
    while schedule.len() < rounds {
        let mut block = vec![Kind::PowerLossOne, Kind::PowerLossAll, Kind::ProcessKill, Kind::FsyncEio];
        block.shuffle(&mut rng);
        schedule.extend(block);
    }
    schedule.truncate(rounds);
    let mut done: BTreeMap<Kind, usize> = BTreeMap::new();
    let mut eio_fired = 0;
    for (round, &kind) in schedule.iter().enumerate() {
        if round >= 4 && started.elapsed() > budget {
            eprintln!("time budget spent after {round} rounds");
            break;
        }
        // Let the clients work between faults.
        tokio::time::sleep(Duration::from_millis(rng.gen_range(300..1200))).await;
        let leader = members[0].server.as_ref().and_then(|s| s.node.leader());
        let victim = match leader.and_then(|l| members.iter().position(|m| m.config.member_id() == l)) {
            Some(l) if rng.gen_bool(0.5) => l,
            _ => rng.gen_range(0..3),
        };
        match kind {
            Kind::PowerLossOne => {
                let m = &mut members[victim];
                m.disk.crash();
                stop(m).await;
                randomize_join(m, &mut rng);
                start(m, seed).await;
            }
            Kind::PowerLossAll => {
                for m in &members {
                    m.disk.crash();
                }
                for m in &mut members {
                    stop(m).await;
                }
                for m in &mut members {
                    randomize_join(m, &mut rng);
                    start(m, seed).await;
                }
            }
            Kind::ProcessKill => {
                let m = &mut members[victim];
                m.disk.kill_process();
                stop(m).await;
                randomize_join(m, &mut rng);
                start(m, seed).await;
            }
            Kind::FsyncEio => {
                let m = &mut members[victim];
                let raft_dir = format!("/{}/member/raft/", m.config.name);
                let before = m.disk.stats().faults_injected;
                m.disk.inject(Fault::new(FaultOp::SyncData).on_path(&raft_dir));
                let node = Arc::clone(&m.server.as_ref().unwrap().node);
                // Clients keep writing, so the log syncs soon; the member must then stop.
                let stopped = tokio::time::timeout(Duration::from_secs(30), node.stopped()).await;
                let fired = m.disk.stats().faults_injected > before;
                if fired {
                    eio_fired += 1;
                    assert!(
                        stopped.is_ok(),
                        "seed {seed}: round {round}: a member whose log fsync failed kept running"
                    );
                    let why = node.fatal.lock().clone();
                    assert!(
                        why.as_deref().is_some_and(|w| w.contains("raft stopped")),
                        "seed {seed}: round {round}: the member stopped without its fatal reason: {why:?}"
                    );
                } else {
                    eprintln!("round {round}: no log fsync on {} within 30 s; fault withdrawn", m.config.name);
                }
                m.disk.clear_faults();
                // The stopped member's process exits (its page cache stays, fsyncgate and all);
                // then it is started again on the same disk.
                m.disk.kill_process();
                stop(m).await;
                randomize_join(m, &mut rng);
                start(m, seed).await;
            }
        }
        *done.entry(kind).or_default() += 1;
        wait_leader(&members, seed, round + 1).await;
    }
    shared.stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    let nemesis_secs = started.elapsed().as_secs_f64();

    // Final linearizable reads of every key through every member join the history.
    let opts = ConnectOptions::new().with_timeout(Duration::from_secs(10));
    let mut final_clients = Vec::new();
    for i in 0..3u16 {
        let url = format!("http://{ip}:{}", PORTS.0 + i);
        final_clients.push(Client::connect([url], Some(opts.clone())).await.unwrap());
    }
    for client in &mut final_clients {
        for key in 0..keys {
            let call = Instant::now();
            let r = read_retrying(client, &format!("key{key}"), seed).await;
            let v = r.kvs().first().map(|kv| history::parse(kv.value()));
            shared.history.lock().push(Event { key, op: Op::Get, out: Out::Value(v), call, ret: Some(Instant::now()) });
        }
    }
    let events = shared.history.lock().clone();
    let answered = events.iter().filter(|e| e.ret.is_some()).count();
    let acked = shared.acked.lock().clone();
    let stats: Vec<_> = members.iter().map(|m| m.disk.stats()).collect();
    eprintln!(
        "seed {seed}: {} rounds {done:?} in {nemesis_secs:.1} s, {eio_fired} fsync errors fired; {} register \
         operations ({answered} answered), {} fresh keys acknowledged; disks: {} power losses, {} torn writes, \
         {} bit flips, {} unsynced writes dropped",
        done.values().sum::<usize>(),
        events.len(),
        acked.len(),
        stats.iter().map(|s| s.crashes).sum::<u64>(),
        stats.iter().map(|s| s.torn_writes).sum::<u64>(),
        stats.iter().map(|s| s.bit_flips).sum::<u64>(),
        stats.iter().map(|s| s.writes_dropped).sum::<u64>(),
    );
    assert!(answered > 50, "seed {seed}: too few operations completed: {answered}");
    if rounds >= 4 {
        assert!(done.len() == 4, "seed {seed}: every kind of fault must have run: {done:?}");
    }

    // No acknowledged write lost: every fresh key acknowledged is there.
    for client in &mut final_clients {
        let r = read_prefix_retrying(client, "acked/", seed).await;
        let present: std::collections::HashSet<String> =
            r.kvs().iter().map(|kv| String::from_utf8_lossy(kv.key()).into_owned()).collect();
        let lost: Vec<&String> = acked.iter().filter(|k| !present.contains(*k)).collect();
        assert!(lost.is_empty(), "seed {seed}: acknowledged writes lost: {lost:?}");
    }
    history::assert_linearizable(&events, keys, seed);
    history::assert_revisions(&shared.revisions.lock(), seed);
    assert_converged(&mut final_clients, seed).await;

    for m in &mut members {
        stop(m).await;
    }
}

/// Restarts sometimes with `--initial-cluster-state existing`, sometimes `new`: a member with
/// a data directory of its own must come back the same either way.
fn randomize_join(m: &mut Member, rng: &mut rand::rngs::StdRng) {
    m.config.join_existing = rng.gen_bool(0.5);
}

async fn read_retrying(client: &mut Client, key: &str, seed: u64) -> etcd_client::GetResponse {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match client.get(key, None).await {
            Ok(r) => return r,
            Err(e) => {
                assert!(Instant::now() < deadline, "seed {seed}: final read of {key} kept failing: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn read_prefix_retrying(client: &mut Client, prefix: &str, seed: u64) -> etcd_client::GetResponse {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match client.get(prefix, Some(GetOptions::new().with_prefix())).await {
            Ok(r) => return r,
            Err(e) => {
                assert!(Instant::now() < deadline, "seed {seed}: final read of {prefix} kept failing: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Waits (bounded) until every member reports the same revision and the same `HashKV`.
async fn assert_converged(clients: &mut [Client], seed: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut seen = Vec::new();
        for c in clients.iter_mut() {
            match c.hash_kv(0).await {
                Ok(h) => seen.push(Some((h.header().map(|h| h.revision()), h.hash()))),
                Err(_) => seen.push(None),
            }
        }
        if seen[0].is_some() && seen.iter().all(|s| *s == seen[0]) {
            eprintln!("converged: revision and hash {:?}", seen[0]);
            return;
        }
        assert!(Instant::now() < deadline, "seed {seed}: members do not converge: {seen:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
