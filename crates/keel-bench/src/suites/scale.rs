//! The `scale` suite: the cost curve of a memory-resident store. For 10^4 up to 10^7 keys
//! (16-byte keys, 100-byte values; 10^7 only in the full run) a helper process
//! ([`crate::child`]) loads the keys into a fresh KeelDB store in 10,000-key relaxed
//! transactions and measures, in a process of its own: resident memory per key, the mean
//! point read from one snapshot, and the latency of one-put commits (`sync` p50 and p99,
//! `relaxed` mean) with the table at that size. It is then killed with SIGKILL. A second fresh
//! process times the reopen that replays the whole WAL, then checkpoints and closes; a third
//! times a reopen from the checkpoint (each as a restarted application would open the store).

use std::time::Duration;

use crate::child::{run_and_kill, ChildSpec};
use crate::report::Row;
use crate::{Scale, SuiteContext};

const SUITE: &str = "scale";

struct Plan {
    sizes: &'static [u64],
    reads: u64,
    sync_commits: u64,
    sync_budget_ms: u64,
}

fn plan(scale: Scale) -> Plan {
    match scale {
        Scale::Full => Plan {
            sizes: &[10_000, 100_000, 1_000_000, 10_000_000],
            reads: 1_000_000,
            sync_commits: 2_000,
            sync_budget_ms: 1_500,
        },
        Scale::Quick => {
            Plan { sizes: &[10_000, 100_000, 1_000_000], reads: 200_000, sync_commits: 300, sync_budget_ms: 300 }
        }
        Scale::Tiny => Plan { sizes: &[1_000, 10_000], reads: 2_000, sync_commits: 10, sync_budget_ms: 20 },
    }
}

/// Runs every size.
pub fn run(context: &SuiteContext) -> anyhow::Result<Vec<Row>> {
    let plan = plan(context.scale);
    let mut rows = Vec::new();
    for &n in plan.sizes {
        let dir = context.temp_dir(SUITE)?;
        let store_dir = dir.path().join("keeldb");
        let spec = ChildSpec {
            task: "scale".to_string(),
            system: "keeldb".to_string(),
            dir: store_dir.clone(),
            records: n,
            batch: 10_000,
            value_bytes: 100,
            checkpoint: false,
            reads: plan.reads,
            sync_commits: plan.sync_commits,
            sync_budget_ms: plan.sync_budget_ms,
        };
        let measured = run_and_kill(&context.child_command, &spec)?;

        // Each reopen in a fresh process, as a restart opens the store: not in this one, which
        // has just freed gigabytes and whose allocator and threads are in another state.
        let reopen = |checkpoint: bool| {
            let spec = ChildSpec { task: "reopen".to_string(), checkpoint, ..spec.clone() };
            run_and_kill(&context.child_command, &spec)
        };
        let from_wal = reopen(true)?;
        let from_checkpoint = reopen(false)?;
        let replayed = from_wal.frames_replayed;
        let keys = from_checkpoint.keys;
        anyhow::ensure!(keys >= n, "keeldb came back with {keys} keys after a checkpoint of {n}");
        anyhow::ensure!(
            from_wal.keys == keys,
            "keeldb had {} keys from the WAL, {keys} from its checkpoint",
            from_wal.keys
        );
        let wal_reopen = Duration::from_secs_f64(from_wal.reopen_ms / 1e3);
        let checkpoint_reopen = Duration::from_secs_f64(from_checkpoint.reopen_ms / 1e3);

        let case = format!("keys_{n}");
        let per_key = measured.rss_delta_bytes / n as f64;
        let relaxed = [
            ("bytes_per_key", per_key),
            ("load_keys_per_s", n as f64 / measured.write_s.max(1e-9)),
            ("read_ns", measured.read_ns),
            ("commit_us", measured.relaxed_us),
            ("reopen_wal_ms", wal_reopen.as_secs_f64() * 1e3),
            ("reopen_checkpoint_ms", checkpoint_reopen.as_secs_f64() * 1e3),
        ];
        for (metric, value) in relaxed {
            rows.push(Row::new(SUITE, "keeldb", "relaxed", &case, metric, value));
        }
        rows.push(Row::new(SUITE, "keeldb", "sync", &case, "commit_p50_us", measured.sync_p50_us));
        rows.push(Row::new(SUITE, "keeldb", "sync", &case, "commit_p99_us", measured.sync_p99_us));
        context.progress.line(
            SUITE,
            format!(
                "keeldb {n} keys: {per_key:.0} bytes/key, read {:.0} ns, sync commit p50 {:.0} µs p99 {:.0} µs, relaxed commit {:.1} µs, reopen {:.0} ms (WAL, {replayed} frames) / {:.0} ms (checkpoint)",
                measured.read_ns,
                measured.sync_p50_us,
                measured.sync_p99_us,
                measured.relaxed_us,
                wal_reopen.as_secs_f64() * 1e3,
                checkpoint_reopen.as_secs_f64() * 1e3
            ),
        );
    }
    Ok(rows)
}
