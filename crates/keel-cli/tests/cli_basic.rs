//! End-to-end tests of the `keel` binary on a temporary store: put/get/scan/del, stats, verify
//! (including a flipped byte in a WAL frame), exit codes, and a smoke run of `keel bench`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs `keel` with `args`; the one helper every test goes through.
fn keel(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_keel")).args(args).output().expect("running keel")
}

fn code(output: &Output) -> i32 {
    output.status.code().expect("keel exited by signal")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Asserts the exit code, showing both streams on failure.
#[track_caller]
fn expect_code(output: &Output, expected: i32) {
    assert_eq!(
        code(output),
        expected,
        "unexpected exit code\nstdout:\n{}\nstderr:\n{}",
        stdout(output),
        stderr(output)
    );
}

fn path_arg(path: &Path) -> &str {
    path.to_str().expect("temp paths are UTF-8")
}

/// A store with three users and one binary key, written through the CLI.
fn populated_store() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let s = path_arg(&store);
    for (key, value) in [("alice", "{\"age\": 30}"), ("bob", "{\"age\": 41}"), ("carol", "{\"age\": 27}")] {
        expect_code(&keel(&["put", s, "users", key, value]), 0);
    }
    expect_code(&keel(&["put", "--hex", s, "blobs", "00ff", "0xdeadbeef"]), 0);
    (dir, store)
}

#[test]
fn put_get_scan_del_round_trip() {
    let (_dir, store) = populated_store();
    let s = path_arg(&store);

    let got = keel(&["get", s, "users", "bob"]);
    expect_code(&got, 0);
    assert_eq!(stdout(&got), "{\"age\": 41}\n");

    let missing = keel(&["get", s, "users", "zoe"]);
    expect_code(&missing, 1);
    assert!(stdout(&missing).is_empty());
    assert!(stderr(&missing).contains("not found"), "{}", stderr(&missing));

    let all = keel(&["scan", s, "users"]);
    expect_code(&all, 0);
    assert_eq!(stdout(&all), "alice\t{\"age\": 30}\nbob\t{\"age\": 41}\ncarol\t{\"age\": 27}\n");

    let last = keel(&["scan", s, "users", "--reverse", "--limit", "1"]);
    expect_code(&last, 0);
    assert_eq!(stdout(&last), "carol\t{\"age\": 27}\n");

    let bounded = keel(&["scan", s, "users", "--start", "b", "--end", "c"]);
    expect_code(&bounded, 0);
    assert_eq!(stdout(&bounded), "bob\t{\"age\": 41}\n");

    let prefixed = keel(&["scan", s, "users", "--prefix", "al"]);
    expect_code(&prefixed, 0);
    assert_eq!(stdout(&prefixed), "alice\t{\"age\": 30}\n");

    // Binary keys and values print as 0x-prefixed hex.
    let binary = keel(&["get", "--hex", s, "blobs", "0x00FF"]);
    expect_code(&binary, 0);
    assert_eq!(stdout(&binary), "0xdeadbeef\n");
    let binary_scan = keel(&["scan", s, "blobs"]);
    assert_eq!(stdout(&binary_scan), "0x00ff\t0xdeadbeef\n");

    expect_code(&keel(&["del", s, "users", "bob"]), 0);
    expect_code(&keel(&["get", s, "users", "bob"]), 1);
    expect_code(&keel(&["del", s, "users", "bob"]), 1);
    let after = keel(&["scan", s, "users"]);
    assert_eq!(stdout(&after), "alice\t{\"age\": 30}\ncarol\t{\"age\": 27}\n");
}

#[test]
fn stats_and_verify_on_an_intact_store() {
    let (_dir, store) = populated_store();
    let s = path_arg(&store);

    let stats = keel(&["stats", s]);
    expect_code(&stats, 0);
    let text = stdout(&stats);
    let users = text.lines().find(|l| l.starts_with("users ")).unwrap_or_else(|| panic!("no users row:\n{text}"));
    assert_eq!(users.split_whitespace().nth(1), Some("3"), "{users}");
    assert!(text.contains("blobs"), "{text}");
    assert!(text.contains("last recovery"), "{text}");

    let verify = keel(&["verify", s]);
    expect_code(&verify, 0);
    assert!(stdout(&verify).contains("intact"), "{}", stdout(&verify));
}

#[test]
fn usage_errors_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    let m = path_arg(&missing);
    expect_code(&keel(&[]), 2);
    expect_code(&keel(&["frobnicate"]), 2);
    expect_code(&keel(&["get", m, "users", "alice"]), 2);
    expect_code(&keel(&["scan", m, "users"]), 2);
    expect_code(&keel(&["stats", m]), 2);
    expect_code(&keel(&["verify", m]), 2);
    assert!(!missing.exists(), "read commands must not create a store");
    expect_code(&keel(&["put", "--hex", m, "users", "zz", "00"]), 2);
    expect_code(&keel(&["bench", "--suite", "no-such-suite"]), 2);
    expect_code(&keel(&["bench", "--peers", "sqlite,no-such-peer"]), 2);

    // A directory that holds something other than a store.
    let other = dir.path().join("other");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("notes.txt"), b"not a database").unwrap();
    expect_code(&keel(&["verify", path_arg(&other)]), 2);
}

#[test]
fn locked_store_is_a_usage_error() {
    let (_dir, store) = populated_store();
    let db = keeldb::Database::open(&store, keeldb::Options::default()).unwrap();
    let locked = keel(&["get", path_arg(&store), "users", "alice"]);
    expect_code(&locked, 2);
    assert!(stderr(&locked).contains("lock"), "{}", stderr(&locked));
    db.close().unwrap();
    expect_code(&keel(&["get", path_arg(&store), "users", "alice"]), 0);
}

/// The WAL segment holding the most bytes beyond its 64-byte header.
fn largest_wal_segment(store: &Path) -> PathBuf {
    let mut segments: Vec<(u64, PathBuf)> = std::fs::read_dir(store)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            name.starts_with("wal-") && name.ends_with(".log")
        })
        .map(|path| (std::fs::metadata(&path).unwrap().len(), path))
        .collect();
    segments.sort();
    let (len, path) = segments.pop().unwrap_or_else(|| panic!("no wal-*.log in {}", store.display()));
    assert!(len > 64 + 16, "{} holds no frames ({len} bytes)", path.display());
    path
}

#[test]
fn verify_finds_a_flipped_byte_in_a_wal_frame() {
    let (_dir, store) = populated_store();
    // One session with many commits gives a segment whose middle frame is followed by valid
    // frames, so the flip cannot pass for a torn tail (which open may truncate).
    let db = keeldb::Database::open(&store, keeldb::Options::default()).unwrap();
    for i in 0..20 {
        let mut tx = db.begin_write().unwrap();
        tx.put("events", format!("event-{i:03}").as_bytes(), b"payload of a committed event").unwrap();
        tx.commit().unwrap();
    }
    db.close().unwrap();
    let wal = largest_wal_segment(&store);
    let mut bytes = std::fs::read(&wal).unwrap();
    // The middle of the frames: the newest segment ends in preallocated zeros, not frames.
    let frames_end = bytes.iter().rposition(|&b| b != 0).unwrap() + 1;
    let offset = 64 + (frames_end - 64) / 2;
    bytes[offset] ^= 0x40;
    std::fs::write(&wal, &bytes).unwrap();

    let verify = keel(&["verify", path_arg(&store)]);
    expect_code(&verify, 1);
    let report = stdout(&verify);
    let name = wal.file_name().unwrap().to_string_lossy().into_owned();
    assert!(report.contains(&name), "the report should name {name}:\n{report}");
    assert!(report.contains("CORRUPTION"), "{report}");

    // Opening the store refuses it too: a failure (exit 1), not a usage error.
    let get = keel(&["get", path_arg(&store), "users", "alice"]);
    expect_code(&get, 1);
    assert!(stderr(&get).contains("corruption"), "{}", stderr(&get));
}

#[test]
fn bench_smoke_run_writes_schema_json() {
    let dir = tempfile::tempdir().unwrap();
    let json_path = dir.path().join("out/bench.json");
    let report_dir = dir.path().join("report");
    let output = keel(&[
        "bench",
        "--quick",
        "--tiny",
        "--suite",
        "mvcc",
        "--json",
        path_arg(&json_path),
        "--out",
        path_arg(&report_dir),
        "--dir",
        path_arg(dir.path()),
        "--peers",
        "sqlite",
    ]);
    expect_code(&output, 0);
    assert!(stdout(&output).contains("## mvcc"), "{}", stdout(&output));
    assert!(stderr(&output).contains("[mvcc]"), "progress goes to stderr");
    assert!(report_dir.join("report.md").exists());

    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    assert_eq!(json["schema"], "keel-bench/1");
    let machine = json["machine"].as_object().unwrap();
    let mut machine_keys: Vec<&str> = machine.keys().map(String::as_str).collect();
    machine_keys.sort_unstable();
    assert_eq!(machine_keys, ["cpus", "fdatasync_us_p50", "filesystem", "os"]);
    assert!(json["machine"]["cpus"].as_u64().unwrap() >= 1);
    assert!(json["machine"]["fdatasync_us_p50"].as_f64().unwrap() > 0.0);

    let rows = json["rows"].as_array().unwrap();
    assert!(!rows.is_empty());
    for row in rows {
        let object = row.as_object().unwrap();
        assert_eq!(object.len(), 6, "{row}");
        assert_eq!(row["suite"], "mvcc");
        // `--peers sqlite` adds SQLite's point reads beside keeldb's when the peer is compiled in.
        let system = row["system"].as_str().unwrap();
        assert!(["keeldb", "sqlite"].contains(&system), "{row}");
        for field in ["config", "case", "metric"] {
            assert!(!row[field].as_str().unwrap().is_empty(), "{row}");
        }
        let value = row["value"].as_f64().unwrap_or_else(|| panic!("non-numeric value in {row}"));
        assert!(value.is_finite() && value >= 0.0, "{row}");
    }
    assert_eq!(
        rows.iter().any(|r| r["system"] == "sqlite"),
        cfg!(feature = "peers"),
        "sqlite rows exactly when the peers are compiled in"
    );
    for case in ["depth_50", "txn_one_put"] {
        assert!(rows.iter().any(|r| r["case"] == case), "missing case {case}");
    }
    // The benchmark's temporary stores are cleaned up.
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("keel-bench-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn bench_engine_suite_reports_apply_async_and_history_rows() {
    let dir = tempfile::tempdir().unwrap();
    let json_path = dir.path().join("engine.json");
    let output = keel(&[
        "bench",
        "--tiny",
        "--suite",
        "engine",
        "--json",
        path_arg(&json_path),
        "--dir",
        path_arg(dir.path()),
        "--peers",
        "none",
    ]);
    expect_code(&output, 0);
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    let rows = json["rows"].as_array().unwrap();
    let value = |case: &str, metric: &str| {
        rows.iter()
            .find(|r| r["case"] == case && r["metric"] == metric)
            .and_then(|r| r["value"].as_f64())
            .unwrap_or_else(|| panic!("no row {case}/{metric} in {rows:?}"))
    };
    for case in ["apply_batch_1", "apply_batch_64"] {
        assert!(value(case, "commands_per_s") > 0.0);
    }
    for case in ["threads_64", "async_tasks_64_one_thread", "async_tasks_1024_one_thread"] {
        assert!(value(case, "commits_per_s") > 0.0);
        assert!(value(case, "commits_per_sync") >= 1.0, "{case}: every fdatasync carries at least one commit");
    }
    assert!(value("overwrite_8b_key_32b_value", "feed_bytes_per_change") > 40.0, "a change holds its key and value");
}
