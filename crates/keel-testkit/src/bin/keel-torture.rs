//! `keel-torture`: kill -9 torture on the real file system.
//!
//! `keel-torture run --rounds N [--seconds S] [--dir D] [--seed X] [--threads T]
//! [--durability sync|relaxed|periodic] [--segment-bytes B]` repeatedly starts a child that commits from several
//! threads and reports every acknowledged commit on its stdout (a pipe), kills it with SIGKILL
//! after a random 5–200 ms, runs `keeldb::verify` on the store, reopens it and checks that every
//! acknowledged commit is there with the right value and that the store is exactly a prefix of
//! the commit history. The store is reused so state accumulates (about one round in twenty
//! starts a fresh one). Exit status 0 when every round passed. WAL segments are 64 KiB unless
//! `--segment-bytes` says otherwise: segments longer than recovery's 1 MiB read window put its
//! read-ahead thread under the kills too.
//!
//! `keel-torture child DIR [--threads T] [--durability D] [--segment-bytes B]` is the child. Thread `t` commits
//! sequence numbers 1, 2, ...: each commit puts `data/t<t>:<seq % 64>` (a value derived from
//! `t` and `seq`) and `meta/seq:<t>` = `seq`, then prints `ack <t> <seq> <ts>`. A kill -9 keeps
//! the page cache, so every acknowledged commit must survive in every durability mode.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use keel_testkit::rng::SimRng;
use keeldb::{Database, Durability, Options};

const KEYS_PER_THREAD: u64 = 64;

type Result<T> = std::result::Result<T, String>;

fn value_for(t: u64, seq: u64) -> Vec<u8> {
    let mut v = format!("{t}:{seq}:").into_bytes();
    v.resize(v.len() + ((seq * 7 + t * 13) % 200) as usize, b'a' + (seq % 26) as u8);
    v
}

/// Checkpoints every four segments' worth of log (256 KiB at the default 64 KiB segments),
/// so that a larger segment fills before a checkpoint rolls it.
fn child_options(durability: Durability, segment_bytes: u64) -> Options {
    let checkpoint_wal_bytes = segment_bytes.saturating_mul(4);
    Options { durability, wal_segment_bytes: segment_bytes, checkpoint_wal_bytes, ..Options::default() }
}

fn read_counter(db: &Database, t: u64) -> Result<u64> {
    let rx = db.begin_read().map_err(|e| e.to_string())?;
    match rx.get("meta", format!("seq:{t}").as_bytes()).map_err(|e| e.to_string())? {
        None => Ok(0),
        Some(v) => String::from_utf8_lossy(&v).parse().map_err(|_| format!("thread {t}: unparsable counter")),
    }
}

fn child(dir: &Path, threads: u64, durability: Durability, segment_bytes: u64) -> Result<()> {
    let db =
        Database::open(dir, child_options(durability, segment_bytes)).map_err(|e| format!("child open failed: {e}"))?;
    let mut handles = Vec::new();
    for t in 0..threads {
        let db = db.clone();
        let start = read_counter(&db, t)?;
        handles.push(std::thread::spawn(move || -> Result<()> {
            for seq in start + 1.. {
                let mut tx = db.begin_write().map_err(|e| e.to_string())?;
                tx.put("data", format!("t{t}:{}", seq % KEYS_PER_THREAD).as_bytes(), &value_for(t, seq))
                    .map_err(|e| e.to_string())?;
                tx.put("meta", format!("seq:{t}").as_bytes(), seq.to_string().as_bytes()).map_err(|e| e.to_string())?;
                let info = tx.commit().map_err(|e| format!("thread {t} commit {seq} failed: {e}"))?;
                let mut out = std::io::stdout().lock();
                writeln!(out, "ack {t} {seq} {}", info.ts).and_then(|()| out.flush()).map_err(|e| e.to_string())?;
            }
            Ok(())
        }));
    }
    for h in handles {
        h.join().map_err(|_| "a committer panicked".to_owned())??;
    }
    Ok(())
}

/// What the parent knows about the store between rounds.
#[derive(Debug, Default, Clone)]
struct Known {
    ts: u64,
    counters: BTreeMap<u64, u64>,
}

#[derive(Debug, Default)]
struct Totals {
    rounds: u64,
    fresh_stores: u64,
    acks_checked: u64,
    killed_before_first_ack: u64,
    torn_tails: u64,
    unacked_but_present: u64,
    recovery_ms_max: f64,
}

struct Config {
    rounds: u64,
    seconds: Option<u64>,
    dir: PathBuf,
    seed: u64,
    threads: u64,
    durability: String,
    segment_bytes: u64,
}

fn parse_acks(lines: &[String]) -> Vec<(u64, u64, u64)> {
    lines
        .iter()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            if it.next()? != "ack" {
                return None;
            }
            Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?, it.next()?.parse().ok()?))
        })
        .collect()
}

/// Starts the child, kills it after `kill_after`, and returns its acknowledgement lines.
fn run_child(cfg: &Config, kill_after: Duration) -> Result<Vec<String>> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .arg("child")
        .arg(&cfg.dir)
        .args(["--threads", &cfg.threads.to_string(), "--durability", &cfg.durability])
        .args(["--segment-bytes", &cfg.segment_bytes.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawn failed: {e}"))?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let stderr = child.stderr.take().ok_or("no stderr")?;
    let reader =
        std::thread::spawn(move || BufReader::new(stdout).lines().map_while(|l| l.ok()).collect::<Vec<String>>());
    let err_reader =
        std::thread::spawn(move || BufReader::new(stderr).lines().map_while(|l| l.ok()).collect::<Vec<String>>());
    std::thread::sleep(kill_after);
    let _ = child.kill(); // SIGKILL
    let status = child.wait().map_err(|e| e.to_string())?;
    let lines = reader.join().map_err(|_| "reader panicked")?;
    let errors = err_reader.join().map_err(|_| "reader panicked")?;
    if status.signal() != Some(libc::SIGKILL) {
        return Err(format!("the child exited by itself ({status}) before the kill: {}", errors.join(" | ")));
    }
    Ok(lines)
}

/// Verifies and reopens the store and checks it against the acknowledgements.
fn check_round(cfg: &Config, known: &mut Known, acks: &[(u64, u64, u64)], totals: &mut Totals) -> Result<()> {
    // A child killed while creating the store leaves no identity file: nothing to verify yet.
    let created = cfg.dir.join("KEELDB").exists();
    if created {
        let report = keeldb::verify(&cfg.dir).map_err(|e| format!("verify failed: {e}"))?;
        if !report.is_intact() {
            return Err(format!("verify found corruption:\n{report}"));
        }
    } else if !acks.is_empty() {
        return Err("commits were acknowledged but the store has no identity file".into());
    }
    let started = Instant::now();
    let opts = Options { background_threads: false, ..Options::default() };
    let db = Database::open(&cfg.dir, opts).map_err(|e| format!("reopen failed: {e}"))?;
    totals.recovery_ms_max = totals.recovery_ms_max.max(started.elapsed().as_secs_f64() * 1000.0);
    if db.recovery_report().torn_tail.is_some() {
        totals.torn_tails += 1;
    }
    let recovered_ts = db.begin_read().map_err(|e| e.to_string())?.snapshot_ts();
    let mut acked_max: BTreeMap<u64, u64> = BTreeMap::new();
    for &(t, seq, ts) in acks {
        let e = acked_max.entry(t).or_default();
        *e = (*e).max(seq);
        if ts > recovered_ts {
            return Err(format!(
                "acknowledged commit lost: thread {t} seq {seq} at ts {ts}, recovered through ts {recovered_ts}"
            ));
        }
    }
    let mut advanced = 0;
    let rx = db.begin_read().map_err(|e| e.to_string())?;
    for t in 0..cfg.threads {
        let before = known.counters.get(&t).copied().unwrap_or(0);
        let counter = read_counter(&db, t)?;
        let acked = acked_max.get(&t).copied().unwrap_or(before);
        // At most one commit per thread was in flight (durable, not yet reported).
        if counter < acked || counter > acked + 1 {
            return Err(format!("thread {t}: counter {counter}, acknowledged through {acked}"));
        }
        totals.unacked_but_present += counter - acked;
        advanced += counter - before;
        for j in 0..KEYS_PER_THREAD {
            let newest = (1..=counter).rev().find(|s| s % KEYS_PER_THREAD == j);
            let got = rx.get("data", format!("t{t}:{j}").as_bytes()).map_err(|e| e.to_string())?;
            let want = newest.map(|s| value_for(t, s));
            if got != want {
                return Err(format!("thread {t} key {j}: wrong value (counter {counter}, want seq {newest:?})"));
            }
        }
        known.counters.insert(t, counter);
    }
    if recovered_ts.checked_sub(known.ts) != Some(advanced) {
        return Err(format!(
            "not a prefix: ts advanced from {} to {recovered_ts} but the counters by {advanced}",
            known.ts
        ));
    }
    known.ts = recovered_ts;
    totals.acks_checked += acks.len() as u64;
    drop(rx);
    db.close().map_err(|e| format!("close failed: {e}"))
}

fn run(cfg: &Config) -> Result<Totals> {
    let mut rng = SimRng::new(cfg.seed);
    let mut totals = Totals::default();
    let mut known = Known::default();
    let deadline = cfg.seconds.map(|s| Instant::now() + Duration::from_secs(s));
    for round in 0..cfg.rounds {
        if deadline.is_some_and(|d| Instant::now() > d) {
            break;
        }
        if round == 0 || rng.chance(0.05) {
            if cfg.dir.exists() {
                std::fs::remove_dir_all(&cfg.dir).map_err(|e| e.to_string())?;
            }
            known = Known::default();
            totals.fresh_stores += 1;
        }
        let kill_after = Duration::from_millis(rng.range(5, 200));
        let lines = run_child(cfg, kill_after).map_err(|e| format!("round {round}: {e}"))?;
        let acks = parse_acks(&lines);
        if acks.is_empty() {
            totals.killed_before_first_ack += 1;
        }
        check_round(cfg, &mut known, &acks, &mut totals)
            .map_err(|e| format!("round {round} (killed after {kill_after:?}): {e}"))?;
        totals.rounds += 1;
        if totals.rounds % 100 == 0 {
            println!(
                "keel-torture: round {} passed, {} acknowledged commits checked so far",
                totals.rounds, totals.acks_checked
            );
        }
    }
    Ok(totals)
}

fn parse_run(args: &[String]) -> Result<Config> {
    let mut cfg = Config {
        rounds: 100,
        seconds: None,
        dir: std::env::temp_dir().join(format!("keel-torture-{}", std::process::id())),
        seed: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64),
        threads: 4,
        durability: "sync".into(),
        segment_bytes: 64 * 1024,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = || value.parse::<u64>().map_err(|_| format!("{flag}: not a number: {value}"));
        match flag.as_str() {
            "--rounds" => cfg.rounds = num()?,
            "--seconds" => cfg.seconds = Some(num()?),
            "--dir" => cfg.dir = PathBuf::from(value),
            "--seed" => cfg.seed = num()?,
            "--threads" => cfg.threads = num()?.max(1),
            "--durability" => cfg.durability = value.clone(),
            "--segment-bytes" => cfg.segment_bytes = num()?,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if cfg.seconds.is_some() && !args.iter().any(|a| a == "--rounds") {
        cfg.rounds = u64::MAX;
    }
    Durability::parse(&cfg.durability).ok_or_else(|| format!("bad durability {}", cfg.durability))?;
    Ok(cfg)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: keel-torture run [--rounds N] [--seconds S] [--dir D] [--seed X] [--threads T] [--durability sync|relaxed|periodic] [--segment-bytes B]\n       keel-torture child DIR [--threads T] [--durability D] [--segment-bytes B]";
    match args.first().map(String::as_str) {
        Some("child") => {
            let Some(dir) = args.get(1) else {
                eprintln!("{usage}");
                return ExitCode::from(2);
            };
            let cfg = match parse_run(args.get(2..).unwrap_or_default()) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("{e}\n{usage}");
                    return ExitCode::from(2);
                }
            };
            let durability = Durability::parse(&cfg.durability).unwrap_or(Durability::Sync);
            match child(Path::new(dir), cfg.threads, durability, cfg.segment_bytes) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Some("run") => {
            let cfg = match parse_run(args.get(1..).unwrap_or_default()) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("{e}\n{usage}");
                    return ExitCode::from(2);
                }
            };
            println!(
                "keel-torture: seed {} dir {} threads {} durability {} segment bytes {}",
                cfg.seed,
                cfg.dir.display(),
                cfg.threads,
                cfg.durability,
                cfg.segment_bytes
            );
            let started = Instant::now();
            match run(&cfg) {
                Ok(t) => {
                    println!(
                        "keel-torture: {} rounds in {:.1?}, {} acknowledged commits checked, 0 lost; {} fresh stores, {} kills before the first ack, {} torn tails truncated, {} durable-but-unreported commits, slowest recovery {:.1} ms",
                        t.rounds,
                        started.elapsed(),
                        t.acks_checked,
                        t.fresh_stores,
                        t.killed_before_first_ack,
                        t.torn_tails,
                        t.unacked_but_present,
                        t.recovery_ms_max
                    );
                    let _ = std::fs::remove_dir_all(&cfg.dir);
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("keel-torture: FAILED (seed {}, store kept at {}): {e}", cfg.seed, cfg.dir.display());
                    ExitCode::from(1)
                }
            }
        }
        _ => {
            eprintln!("{usage}");
            ExitCode::from(2)
        }
    }
}
