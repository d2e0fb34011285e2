//! Kill -9 torture on the real file system, a short run for CI: the `keel-torture` binary
//! starts a child committing under `sync` from four threads, SIGKILLs it at a random moment,
//! verifies and reopens the store and checks every acknowledged commit (also under `relaxed`,
//! and with segments long enough for recovery's read-ahead thread). `KEEL_TORTURE_ROUNDS`
//! sets the round count (default 20); `KEEL_TORTURE_SEED` fixes the kill timings.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

fn torture(durability: &str, default_rounds: u64, segment_bytes: Option<u64>) {
    let rounds = std::env::var("KEEL_TORTURE_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(default_rounds);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_keel-torture"));
    cmd.arg("run")
        .args(["--rounds", &rounds.to_string()])
        .args(["--durability", durability])
        .arg("--dir")
        .arg(dir.path().join("store"));
    if let Some(bytes) = segment_bytes {
        cmd.args(["--segment-bytes", &bytes.to_string()]);
    }
    if let Ok(seed) = std::env::var("KEEL_TORTURE_SEED") {
        cmd.args(["--seed", &seed]);
    }
    let out = cmd.output().expect("run keel-torture");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}{stderr}");
    assert!(out.status.success(), "keel-torture failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains(&format!("{rounds} rounds")), "every round ran: {stdout}");
}

#[test]
fn kill9_torture_sync() {
    torture("sync", 20, None);
}

#[test]
fn kill9_torture_relaxed_survives_process_crash() {
    // A process crash keeps the page cache: relaxed commits must survive it too.
    torture("relaxed", 10, None);
}

#[test]
fn kill9_torture_relaxed_replays_through_the_read_ahead_thread() {
    // 4 MiB segments, checkpointed every 16 MiB of log: each reopen replays a segment longer
    // than recovery's 1 MiB read window, so its read-ahead thread is under the kills too.
    torture("relaxed", 10, Some(4 << 20));
}
