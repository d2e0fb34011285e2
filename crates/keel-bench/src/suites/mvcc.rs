//! The `mvcc` suite: seed 003's figures. Transaction overhead split into begin / put / commit
//! (in `relaxed`, which measures the engine, and in `sync`, which adds the fdatasync); point
//! reads against version-chain depth, from a new snapshot (newest version) and from an old one
//! held open across the overwrites (oldest version); and point reads and resident memory per
//! key over a large table (1M keys of 16 bytes with 100-byte values; the memory in a fresh
//! child process), with every selected peer's point reads over the same table beside KeelDB's.
//!
//! Phases are timed with a clock read around each; totals are timed as a batch without inner
//! clock reads, so `total` can be lower than the sum of the phases.

use std::hint::black_box;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use keeldb::{Database, Durability, TxnOptions};

use super::{key16, open, value_bytes, IndexStream};
use crate::child::{run_and_kill, ChildSpec};
use crate::peers::{Mode, System};
use crate::report::Row;
use crate::timing::{per_second, Budget};
use crate::{Scale, SuiteContext};

const SUITE: &str = "mvcc";

struct Plan {
    txn_relaxed: Budget,
    txn_sync: Budget,
    chain_keys: u64,
    chain_reads: u64,
    large_keys: u64,
    large_reads: u64,
    load_batch: u64,
    /// Time limit for one peer's point reads, in seconds.
    peer_read_s: f64,
}

fn plan(scale: Scale) -> Plan {
    let ms = Duration::from_millis;
    match scale {
        Scale::Full => Plan {
            txn_relaxed: Budget::new(1_000, 1_000_000, ms(1_000)),
            txn_sync: Budget::new(50, 10_000, ms(1_500)),
            chain_keys: 1_000,
            chain_reads: 1_000_000,
            large_keys: 1_000_000,
            large_reads: 2_000_000,
            load_batch: 10_000,
            peer_read_s: 3.0,
        },
        Scale::Quick => Plan {
            txn_relaxed: Budget::new(1_000, 200_000, ms(250)),
            txn_sync: Budget::new(20, 2_000, ms(400)),
            chain_keys: 200,
            chain_reads: 200_000,
            large_keys: 1_000_000,
            large_reads: 500_000,
            load_batch: 10_000,
            peer_read_s: 0.5,
        },
        Scale::Tiny => Plan {
            txn_relaxed: Budget::new(100, 1_000, ms(20)),
            txn_sync: Budget::new(3, 10, ms(20)),
            chain_keys: 20,
            chain_reads: 2_000,
            large_keys: 20_000,
            large_reads: 10_000,
            load_batch: 5_000,
            peer_read_s: 0.05,
        },
    }
}

const DEPTHS: [u64; 5] = [0, 5, 10, 20, 50];

/// Runs the suite.
pub fn run(context: &SuiteContext) -> anyhow::Result<Vec<Row>> {
    let plan = plan(context.scale);
    let mut rows = Vec::new();
    let dir = context.temp_dir(SUITE)?;
    let db = open(&dir.path().join("store"), Durability::Relaxed)?;

    for (durability, budget) in [(Durability::Relaxed, plan.txn_relaxed), (Durability::Sync, plan.txn_sync)] {
        rows.extend(transaction_overhead(context, &db, durability, budget)?);
    }
    rows.extend(version_chains(context, &db, &plan)?);
    db.close().context("closing the store")?;
    drop(dir);

    let dir = context.temp_dir(SUITE)?;
    rows.extend(large_table(context, dir.path(), &plan)?);
    drop(dir);
    for peer in &context.peers {
        let dir = context.temp_dir(SUITE)?;
        rows.extend(peer_point_reads(context, *peer, dir.path(), &plan)?);
    }
    Ok(rows)
}

/// The same large table in a peer (relaxed, loaded in transactions of `load_batch` keys), then
/// point reads in the same pseudo-random order from one reader (snapshot), each into one reused
/// buffer ([`crate::peers::Reader::get_into`]), bounded in time so a slow peer cannot stall the
/// run.
fn peer_point_reads(
    context: &SuiteContext,
    peer: &dyn System,
    dir: &std::path::Path,
    plan: &Plan,
) -> anyhow::Result<Vec<Row>> {
    let n = plan.large_keys;
    let name = peer.name();
    let store = peer.open(dir, Mode::Relaxed)?;
    let value = value_bytes(100, 42);
    let started = Instant::now();
    let mut next = 0u64;
    while next < n {
        let end = (next + plan.load_batch).min(n);
        let keys: Vec<[u8; 16]> = (next..end).map(key16).collect();
        let puts: Vec<(&[u8], &[u8])> = keys.iter().map(|k| (&k[..], &value[..])).collect();
        store.write(None, &puts)?;
        next = end;
    }
    let load_elapsed = started.elapsed();
    let mut reader = store.reader()?;
    let mut order = IndexStream::new(0xbead, n);
    let (mut reads, mut found) = (0u64, 0u64);
    let limit = Duration::from_secs_f64(plan.peer_read_s);
    let mut buf = Vec::new();
    let started = Instant::now();
    while reads < plan.large_reads && (reads == 0 || started.elapsed() < limit) {
        for _ in 0..1_000 {
            if black_box(reader.get_into(&key16(order.next_index()), &mut buf)?) && black_box(&buf).len() == 100 {
                found += 1;
            }
        }
        reads += 1_000;
    }
    let read_elapsed = started.elapsed();
    drop(reader);
    ensure!(found == reads, "{name}: {} of {reads} reads of loaded keys found nothing", reads - found);
    store.close()?;
    let read_ns = read_elapsed.as_nanos() as f64 / reads.max(1) as f64;
    context.progress.line(
        SUITE,
        format!(
            "{name} {n} keys: loaded in {:.2} s, {read_ns:.0} ns/read over {reads} reads",
            load_elapsed.as_secs_f64()
        ),
    );
    let case = format!("keys_{n}");
    Ok(vec![
        Row::new(SUITE, name, "relaxed", &case, "read_ns", read_ns),
        Row::new(SUITE, name, "relaxed", &case, "load_keys_per_s", per_second(n, load_elapsed)),
    ])
}

fn txn_options(durability: Durability) -> TxnOptions {
    TxnOptions { durability: Some(durability), ..TxnOptions::default() }
}

/// Means of a phased loop, in ns.
#[derive(Default)]
struct Phases {
    begin: f64,
    put: f64,
    commit: f64,
}

fn transaction_overhead(
    context: &SuiteContext,
    db: &Database,
    durability: Durability,
    budget: Budget,
) -> anyhow::Result<Vec<Row>> {
    let config = durability.name();
    let mut rows = Vec::new();
    let mut push = |case: &str, metric: &str, value: f64| {
        rows.push(Row::new(SUITE, "keeldb", config, case, metric, value));
    };

    // Empty write transaction: begin, commit with no writes.
    let phases = phased(budget, |_| {
        let t0 = Instant::now();
        let tx = db.begin_write_with(txn_options(durability))?;
        let t1 = Instant::now();
        tx.commit()?;
        Ok((t1 - t0, Duration::ZERO, t1.elapsed()))
    })?;
    let total = batched(budget, |_| {
        db.begin_write_with(txn_options(durability))?.commit()?;
        Ok(())
    })?;
    push("txn_empty_write", "begin_ns", phases.begin);
    push("txn_empty_write", "commit_ns", phases.commit);
    push("txn_empty_write", "total_ns", total);

    // One-put transaction on a fresh key.
    let value = value_bytes(100, 7);
    let key = |i: u64| format!("{config}-put-{i:012}").into_bytes();
    let phases = phased(budget, |i| {
        let key = key(i);
        let t0 = Instant::now();
        let mut tx = db.begin_write_with(txn_options(durability))?;
        let t1 = Instant::now();
        tx.put("mvcc", &key, &value)?;
        let t2 = Instant::now();
        tx.commit()?;
        Ok((t1 - t0, t2 - t1, t2.elapsed()))
    })?;
    let total = batched(budget, |i| {
        let mut tx = db.begin_write_with(txn_options(durability))?;
        tx.put("mvcc", &key(u64::MAX / 2 + i), &value)?;
        tx.commit()?;
        Ok(())
    })?;
    push("txn_one_put", "begin_ns", phases.begin);
    push("txn_one_put", "put_ns", phases.put);
    push("txn_one_put", "commit_ns", phases.commit);
    push("txn_one_put", "total_ns", total);
    context.progress.line(
        SUITE,
        format!(
            "keeldb {config} one-put txn: begin {:.0} ns, put {:.0} ns, commit {:.0} ns, total {total:.0} ns",
            phases.begin, phases.put, phases.commit
        ),
    );

    // Empty read transaction: begin a snapshot and release it. Durability does not apply, so
    // it is measured once, under the relaxed rows.
    if durability == Durability::Relaxed {
        let phases = phased(budget, |_| {
            let t0 = Instant::now();
            let rx = db.begin_read()?;
            let t1 = Instant::now();
            drop(rx);
            Ok((t1 - t0, Duration::ZERO, t1.elapsed()))
        })?;
        let total = batched(budget, |_| {
            drop(black_box(db.begin_read()?));
            Ok(())
        })?;
        push("txn_empty_read", "begin_ns", phases.begin);
        push("txn_empty_read", "total_ns", total);
    }
    Ok(rows)
}

/// Runs `step` under `budget`; it returns its begin / put / commit durations. Means in ns.
fn phased(
    budget: Budget,
    mut step: impl FnMut(u64) -> anyhow::Result<(Duration, Duration, Duration)>,
) -> anyhow::Result<Phases> {
    let mut sums = [0u128; 3];
    let mut run = budget.start();
    let mut i = 0;
    while run.keep_going() {
        let (begin, put, commit) = step(i)?;
        i += 1;
        sums[0] += begin.as_nanos();
        sums[1] += put.as_nanos();
        sums[2] += commit.as_nanos();
    }
    let n = run.iterations().max(1) as f64;
    Ok(Phases { begin: sums[0] as f64 / n, put: sums[1] as f64 / n, commit: sums[2] as f64 / n })
}

/// Runs `step` under `budget` without timing each call; the mean in ns.
fn batched(budget: Budget, mut step: impl FnMut(u64) -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let mut run = budget.start();
    let mut i = 0;
    while run.keep_going() {
        step(i)?;
        i += 1;
    }
    Ok(run.elapsed().as_nanos() as f64 / run.iterations().max(1) as f64)
}

/// For each depth: `chain_keys` keys written once, an old snapshot taken, then every key
/// overwritten `depth` times. Reads from a new snapshot see the newest version; reads from the
/// old snapshot must find the first.
fn version_chains(context: &SuiteContext, db: &Database, plan: &Plan) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    let table = "chains";
    for depth in DEPTHS {
        let key = |i: u64| format!("d{depth:02}-{i:08}").into_bytes();
        let version = |round: u64| format!("value at round {round:04} padded to look like a record").into_bytes();
        db.transact(|tx| {
            for i in 0..plan.chain_keys {
                tx.put(table, &key(i), &version(0))?;
            }
            Ok(())
        })?;
        let old = db.begin_read()?;
        for round in 1..=depth {
            db.transact(|tx| {
                for i in 0..plan.chain_keys {
                    tx.put(table, &key(i), &version(round))?;
                }
                Ok(())
            })?;
        }
        let new = db.begin_read()?;
        for i in [0, plan.chain_keys - 1] {
            let newest = new.get(table, &key(i))?;
            ensure!(newest == Some(version(depth)), "engine bug: new snapshot at depth {depth} read {newest:?}");
            let oldest = old.get(table, &key(i))?;
            ensure!(oldest == Some(version(0)), "engine bug: old snapshot at depth {depth} read {oldest:?}");
        }
        let keys: Vec<Vec<u8>> = (0..plan.chain_keys).map(key).collect();
        let new_ns = read_loop(plan.chain_reads, &keys, |k| new.get(table, k))?;
        let old_ns = read_loop(plan.chain_reads, &keys, |k| old.get(table, k))?;
        drop(old);
        let case = format!("depth_{depth}");
        rows.push(Row::new(SUITE, "keeldb", "relaxed", &case, "new_snapshot_ns", new_ns));
        rows.push(Row::new(SUITE, "keeldb", "relaxed", &case, "old_snapshot_ns", old_ns));
        context.progress.line(
            SUITE,
            format!("keeldb version-chain depth {depth}: newest {new_ns:.0} ns/read, oldest {old_ns:.0} ns/read"),
        );
    }
    Ok(rows)
}

/// `reads` point reads of `keys` in a pseudo-random order; the mean in ns. Every read must
/// find its key.
fn read_loop(
    reads: u64,
    keys: &[Vec<u8>],
    mut get: impl FnMut(&[u8]) -> keeldb::Result<Option<Vec<u8>>>,
) -> anyhow::Result<f64> {
    let mut order = IndexStream::new(0xc0ffee, keys.len() as u64);
    let mut found = 0u64;
    let started = Instant::now();
    for _ in 0..reads {
        let key = &keys[order.next_index() as usize];
        if black_box(get(key)?).is_some() {
            found += 1;
        }
    }
    let elapsed = started.elapsed();
    ensure!(found == reads, "engine bug: {} of {reads} reads of present keys found nothing", reads - found);
    Ok(elapsed.as_nanos() as f64 / reads.max(1) as f64)
}

/// Keys per `get_many` call in the large table's batched reads.
const MULTI_GET: usize = 64;

/// Loads `large_keys` keys (16-byte keys, 100-byte values) in relaxed transactions, then
/// point-reads them in a pseudo-random order into one reused buffer, as the peers read, and
/// again [`MULTI_GET`] at a time by `get_many`; resident memory per key is measured by loading
/// the same table in a fresh child process.
fn large_table(context: &SuiteContext, dir: &std::path::Path, plan: &Plan) -> anyhow::Result<Vec<Row>> {
    let n = plan.large_keys;
    let table = "large";
    // Keys and values are generated on the fly so nothing but the store grows with n.
    let db = open(&dir.join("store"), Durability::Relaxed)?;
    let value = value_bytes(100, 42);
    let started = Instant::now();
    let mut next = 0u64;
    while next < n {
        let end = (next + plan.load_batch).min(n);
        let mut tx = db.begin_write()?;
        for i in next..end {
            tx.put(table, &key16(i), &value)?;
        }
        tx.commit()?;
        next = end;
    }
    let load_elapsed = started.elapsed();
    context.progress.line(SUITE, format!("keeldb loaded {n} keys in {:.2} s", load_elapsed.as_secs_f64()));

    let rx = db.begin_read()?;
    let mut order = IndexStream::new(0xbead, n);
    let mut found = 0u64;
    let mut buf = Vec::new();
    let started = Instant::now();
    for _ in 0..plan.large_reads {
        if black_box(rx.get_into(table, &key16(order.next_index()), &mut buf)?) && black_box(&buf).len() == 100 {
            found += 1;
        }
    }
    let read_elapsed = started.elapsed();
    // The same reads through `get_many`, MULTI_GET keys a call (no peer has a counterpart, so
    // this row stands beside the others, not in the comparison).
    let mut order = IndexStream::new(0xbead, n);
    let mut keys: Vec<[u8; 16]> = Vec::with_capacity(MULTI_GET);
    let calls = (plan.large_reads / MULTI_GET as u64).max(1);
    let started = Instant::now();
    for _ in 0..calls {
        keys.clear();
        keys.extend((0..MULTI_GET).map(|_| key16(order.next_index())));
        found += black_box(rx.get_many(table, &keys)?).iter().filter(|v| v.is_some()).count() as u64;
    }
    let many_elapsed = started.elapsed();
    drop(rx);
    let many_reads = calls * MULTI_GET as u64;
    ensure!(
        found == plan.large_reads + many_reads,
        "engine bug: {} of {} reads of loaded keys found nothing",
        plan.large_reads + many_reads - found,
        plan.large_reads + many_reads
    );
    db.close().context("closing the store")?;

    let case = format!("keys_{n}");
    let read_ns = read_elapsed.as_nanos() as f64 / plan.large_reads.max(1) as f64;
    let read_many_ns = many_elapsed.as_nanos() as f64 / many_reads.max(1) as f64;
    let mut rows = vec![
        Row::new(SUITE, "keeldb", "relaxed", &case, "read_ns", read_ns),
        Row::new(SUITE, "keeldb", "relaxed", &case, "read_many_ns", read_many_ns),
        Row::new(SUITE, "keeldb", "relaxed", &case, "load_keys_per_s", per_second(n, load_elapsed)),
    ];
    // Resident bytes per key come from a fresh process: measured here, after the earlier
    // suites freed their memory, the allocator hands that memory back out without the
    // resident set growing (a run printed 64 bytes per key).
    let spec = ChildSpec {
        task: "scale".to_string(),
        system: "keeldb".to_string(),
        dir: dir.join("resident"),
        records: n,
        batch: plan.load_batch,
        value_bytes: 100,
        checkpoint: false,
        reads: 0,
        sync_commits: 0,
        sync_budget_ms: 0,
    };
    let measured = run_and_kill(&context.child_command, &spec)?;
    let per_key = measured.rss_delta_bytes / n.max(1) as f64;
    rows.push(Row::new(SUITE, "keeldb", "relaxed", &case, "bytes_per_key", per_key));
    context.progress.line(
        SUITE,
        format!(
            "keeldb {n} keys: {read_ns:.0} ns/read ({read_many_ns:.0} ns/read by get_many, {MULTI_GET} keys a call), \
             {per_key:.0} resident bytes/key (in a fresh process)"
        ),
    );
    Ok(rows)
}
