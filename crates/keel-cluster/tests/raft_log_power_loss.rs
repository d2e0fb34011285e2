//! The Raft log store on a simulated disk (`keel-testkit`'s `SimFs`), seed by seed: appends
//! whose flush callback fired survive a power loss; an append in flight when the power went
//! (its callback did not fire, or fired with an error) may be gone, but what reopens is a
//! contiguous prefix of what was appended, entry for entry: a torn or bit-flipped write never
//! decodes as an entry. Votes saved before the crash survive it. `KEEL_SIM_SEED` replays one
//! seed; `KEEL_SIM_ITERS` runs more.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::path::Path;
use std::sync::Arc;

use keel_cluster::log_store::LogStore;
use keel_cluster::types::{Entry, LogId, Request, RequestKind, TypeConfig, Vote};
use keel_testkit::rng::SimRng;
use keel_testkit::sim::SimFs;
use openraft::alias::{LeaderIdOf, OneshotReceiverOf};
use openraft::storage::{IOFlushed, RaftLogStorage};
use openraft::type_config::TypeConfigExt;
use openraft::vote::RaftLeaderIdExt;
use openraft::{EntryPayload, RaftLogReader};

fn log_id(term: u64, index: u64) -> LogId {
    LogId::new(LeaderIdOf::<TypeConfig>::new_committed(term, 1), index)
}

fn entry(rng: &mut SimRng, term: u64, index: u64) -> Entry {
    // Sizes from a few bytes to several sectors, so crashes tear entries in the middle.
    let len = rng.range(1, 3000) as usize;
    let body: Vec<u8> = (0..len).map(|i| (index as usize * 31 + i) as u8).collect();
    Entry { log_id: log_id(term, index), payload: EntryPayload::Normal(Request::new(RequestKind::Put, body)) }
}

/// Submits an append; `None` if the store refused it at once (its writer stopped after an
/// earlier failure, which the callback of that earlier append reported).
async fn append(
    store: &mut LogStore,
    entries: Vec<Entry>,
) -> Option<OneshotReceiverOf<TypeConfig, std::io::Result<()>>> {
    let (tx, rx) = TypeConfig::oneshot();
    store.append(entries, IOFlushed::signal(tx)).await.ok().map(|()| rx)
}

async fn one_seed(seed: u64) -> (usize, usize) {
    let mut rng = SimRng::new(seed);
    let fs = SimFs::new(seed);
    let dir = Path::new("/member/raft");
    let mut store = LogStore::open(dir, Arc::new(fs.clone())).unwrap();
    let mut appended: Vec<Entry> = Vec::new();
    let term = 1 + rng.range(0, 3);
    let vote = Vote::new_committed(term, 1);
    store.save_vote(&vote).await.unwrap();
    // Acknowledged batches.
    for _ in 0..rng.range(1, 6) {
        let batch: Vec<Entry> =
            (0..rng.range(1, 8)).map(|k| entry(&mut rng, term, appended.len() as u64 + 1 + k)).collect();
        appended.extend(batch.iter().cloned());
        append(&mut store, batch).await.unwrap().await.unwrap().unwrap();
    }
    let acked = appended.len();
    // Batches in flight when the power goes: the world stops after a few more disk operations,
    // or not at all before the crash.
    if rng.chance(0.7) {
        fs.stop_after_ops(rng.range(0, 12));
    }
    let mut pending = Vec::new();
    for _ in 0..rng.range(1, 4) {
        let batch: Vec<Entry> =
            (0..rng.range(1, 8)).map(|k| entry(&mut rng, term, appended.len() as u64 + 1 + k)).collect();
        appended.extend(batch.iter().cloned());
        pending.extend(append(&mut store, batch).await);
    }
    // Let some of them reach the disk (or fail on the stopped world) before the crash.
    if rng.chance(0.5) {
        if let Some(rx) = pending.pop() {
            let _ = rx.await;
        }
    }
    fs.crash();
    drop(store);
    for rx in pending {
        let _ = rx.await;
    }

    let mut store = LogStore::open(dir, Arc::new(fs.clone()))
        .unwrap_or_else(|e| panic!("seed {seed}: the log does not reopen after a power loss: {e}"));
    let state = store.get_log_state().await.unwrap();
    let found = store.try_get_log_entries(0..u64::MAX).await.unwrap();
    assert!(found.len() >= acked, "seed {seed}: {} entries after the crash, {acked} were acknowledged", found.len());
    assert!(found.len() <= appended.len(), "seed {seed}: more entries than appended");
    for (i, e) in found.iter().enumerate() {
        // A prefix, entry for entry: contiguous indexes and the bytes that were appended.
        assert_eq!(e.log_id, appended[i].log_id, "seed {seed}: entry {i} has another id");
        assert_eq!(e.payload, appended[i].payload, "seed {seed}: entry {} came back different", e.log_id.index);
    }
    assert_eq!(state.last_log_id, found.last().map(|e| e.log_id), "seed {seed}: log state disagrees with entries");
    assert_eq!(store.read_vote().await.unwrap(), Some(vote), "seed {seed}: the saved vote is gone");
    (acked, found.len() - acked)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_appends_survive_power_loss_and_torn_ones_never_decode() {
    let iters: u64 = std::env::var("KEEL_SIM_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    let seeds = keel_testkit::workload::seeds(0x1a9_0000, iters);
    let (mut acked, mut kept) = (0, 0);
    for &seed in &seeds {
        let (a, k) = one_seed(seed).await;
        acked += a;
        kept += k;
    }
    eprintln!("{} seeds: {acked} acknowledged entries survived, {kept} unacknowledged kept", seeds.len());
    assert!(acked > 0);
}

/// The log store keeps openraft's replication from ever sending a hole: a read whose start was
/// purged answers nothing (not the entries after it, which a follower would append after the
/// wrong predecessor), and an append that does not follow the last entry is refused.
#[tokio::test]
async fn reads_start_where_asked_and_appends_never_leave_a_hole() {
    let mut rng = SimRng::new(7);
    let fs = SimFs::new(7);
    let mut store = LogStore::open(Path::new("/member/raft"), Arc::new(fs)).unwrap();
    store.save_vote(&Vote::new_committed(1, 1)).await.unwrap();
    let batch: Vec<Entry> = (1..=10).map(|i| entry(&mut rng, 1, i)).collect();
    append(&mut store, batch).await.unwrap().await.unwrap().unwrap();
    store.purge(log_id(1, 5)).await.unwrap();
    let indexes = |v: Vec<Entry>| v.iter().map(|e| e.log_id.index).collect::<Vec<_>>();
    assert_eq!(indexes(store.try_get_log_entries(3..8).await.unwrap()), Vec::<u64>::new());
    assert_eq!(indexes(store.try_get_log_entries(6..8).await.unwrap()), vec![6, 7]);
    assert_eq!(indexes(store.try_get_log_entries(9..20).await.unwrap()), vec![9, 10]);
    let gap = vec![entry(&mut rng, 1, 12)];
    assert!(append(&mut store, gap).await.is_none(), "an append past index 11 was taken");
    assert!(store.try_get_log_entries(12..13).await.unwrap().is_empty());
    append(&mut store, vec![entry(&mut rng, 1, 11)]).await.unwrap().await.unwrap().unwrap();
    assert_eq!(indexes(store.try_get_log_entries(6..).await.unwrap()), vec![6, 7, 8, 9, 10, 11]);
}
