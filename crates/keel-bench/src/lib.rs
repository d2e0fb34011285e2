//! `keel bench`: the user-facing benchmark report for KeelDB.
//!
//! Each suite opens an embedded store in a fresh temporary directory, measures, and returns flat
//! [`report::Row`]s; [`run`] adds the machine facts, prints Markdown tables to stdout, progress
//! to stderr, and writes the JSON contract (`schema: keel-bench/1`) when asked.
//!
//! Code map: the harness (`report`, `markdown`, `progress`, `timing`, `machine`, `raw_sync`)
//! never references the engine, so it builds and tests on its own; only `suites::*` call
//! `keeldb`. Peer adapters (SQLite, redb, ...) will live beside the suites, and their heavy
//! dependencies stay in this crate, never in the engine's tree.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

pub mod machine;
pub mod markdown;
pub mod progress;
pub mod raw_sync;
pub mod report;
pub mod suites;
pub mod timing;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};

use crate::progress::Progress;
use crate::report::{Machine, Report, Row};
use crate::timing::Budget;

/// Suite names in the order `keel bench` runs them.
pub const SUITES: [&str; 3] = ["durability", "group-commit", "mvcc"];

/// Peer systems a later issue adds adapters for; accepted by `--peers` today.
pub const KNOWN_PEERS: [&str; 6] = ["sqlite", "redb", "lmdb", "surrealkv", "rocksdb", "fjall"];

/// How much work each suite does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scale {
    /// The full run, for published figures.
    #[default]
    Full,
    /// `--quick`: every suite together finishes in under a minute on two cores.
    Quick,
    /// A smoke run for tests: seconds in total, figures not meaningful.
    Tiny,
}

/// Arguments of `keel bench`.
#[derive(Debug, Clone, Default)]
pub struct BenchArgs {
    /// Fewer iterations; every suite together under 60 s on a 2-core machine.
    pub quick: bool,
    /// Suites to run, in [`SUITES`] order; empty runs them all.
    pub suites: Vec<String>,
    /// `none`, `all`, or a comma-separated list of peers. Only `none` runs today.
    pub peers: String,
    /// Where to write the JSON report.
    pub json: Option<PathBuf>,
    /// A directory to write `report.md` into.
    pub out: Option<PathBuf>,
    /// The parent directory for the benchmark's temporary stores (default: the OS temp dir).
    pub dir: Option<PathBuf>,
    /// Smoke-test scale for the CLI's own tests (hidden flag `--tiny`); overrides `quick`.
    pub tiny: bool,
}

impl BenchArgs {
    fn scale(&self) -> Scale {
        if self.tiny {
            Scale::Tiny
        } else if self.quick {
            Scale::Quick
        } else {
            Scale::Full
        }
    }
}

/// What a suite gets: where to put its stores, how hard to work, and where to report progress.
#[derive(Debug)]
pub struct SuiteContext {
    /// Parent directory for temporary stores.
    pub base_dir: PathBuf,
    /// How much work to do.
    pub scale: Scale,
    /// Progress output.
    pub progress: Progress,
}

impl SuiteContext {
    /// A fresh temporary directory for one store; removed when the guard drops.
    pub fn temp_dir(&self, label: &str) -> anyhow::Result<tempfile::TempDir> {
        tempfile::Builder::new()
            .prefix(&format!("keel-bench-{label}-"))
            .tempdir_in(&self.base_dir)
            .with_context(|| {
                format!(
                    "creating a temporary directory in {}",
                    self.base_dir.display()
                )
            })
    }
}

/// Checks suite names and returns them in run order; empty means all.
pub fn select_suites(requested: &[String]) -> anyhow::Result<Vec<&'static str>> {
    for name in requested {
        if !SUITES.contains(&name.as_str()) {
            bail!(
                "unknown suite `{name}`; the suites are: {}",
                SUITES.join(", ")
            );
        }
    }
    Ok(SUITES
        .iter()
        .copied()
        .filter(|s| requested.is_empty() || requested.iter().any(|r| r == s))
        .collect())
}

/// Checks `--peers`: `none`, `all`, or a comma-separated list of known peers. Returns the peers
/// asked for (empty for `none`).
pub fn parse_peers(text: &str) -> anyhow::Result<Vec<&'static str>> {
    match text.trim() {
        "" | "none" => Ok(Vec::new()),
        "all" => Ok(KNOWN_PEERS.to_vec()),
        list => list
            .split(',')
            .map(|name| {
                let name = name.trim();
                KNOWN_PEERS
                    .iter()
                    .copied()
                    .find(|p| *p == name)
                    .with_context(|| {
                        format!(
                            "unknown peer `{name}`; known peers: {}",
                            KNOWN_PEERS.join(", ")
                        )
                    })
            })
            .collect(),
    }
}

/// Runs the selected suites and writes the reports. Markdown goes to stdout, progress to
/// stderr, JSON to `args.json`, and `report.md` into `args.out`.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let suites = select_suites(&args.suites)?;
    let peers = parse_peers(&args.peers)?;
    let progress = Progress::new(false);
    if !peers.is_empty() {
        progress.line(
            "bench",
            format!(
                "note: peer adapters ({}) come in a later issue; running keeldb only",
                peers.join(", ")
            ),
        );
    }
    let base_dir = match &args.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            dir.clone()
        }
        None => std::env::temp_dir(),
    };
    let context = SuiteContext {
        base_dir,
        scale: args.scale(),
        progress,
    };
    let mut rows: Vec<Row> = Vec::new();
    for suite in &suites {
        context.progress.line(suite, "starting");
        let suite_rows = match *suite {
            "durability" => suites::durability::run(&context)?,
            "group-commit" => suites::group_commit::run(&context)?,
            "mvcc" => suites::mvcc::run(&context)?,
            other => bail!("suite `{other}` has no runner"),
        };
        context
            .progress
            .line(suite, format!("done ({} rows)", suite_rows.len()));
        rows.extend(suite_rows);
    }
    let machine = machine_facts(&context, &rows)?;
    let report = Report::new(machine, rows);
    let preamble = preamble(&context, &args);
    let markdown = markdown::render_report(&report, &preamble);
    print!("{markdown}");
    if let Some(path) = &args.json {
        report.write_json(path)?;
        context
            .progress
            .line("bench", format!("wrote {}", path.display()));
    }
    if let Some(out) = &args.out {
        write_markdown(out, &markdown)?;
    }
    context.progress.line(
        "bench",
        format!("finished in {:.1} s", context.progress.elapsed_s()),
    );
    Ok(())
}

fn preamble(context: &SuiteContext, args: &BenchArgs) -> Vec<String> {
    let scale = match context.scale {
        Scale::Full => "full",
        Scale::Quick => "quick",
        Scale::Tiny => "tiny (smoke test; figures not meaningful)",
    };
    let commit = machine::git_commit().unwrap_or_else(|| "unknown".to_string());
    let peers = if args.peers.trim().is_empty() {
        "none"
    } else {
        args.peers.trim()
    };
    vec![
        format!("Commit: {commit}. Scale: {scale}. Peers: {peers}."),
        format!(
            "Stores in {}; each table names its durability mode.",
            context.base_dir.display()
        ),
    ]
}

/// Machine facts; `fdatasync_us_p50` comes from the group-commit suite's baseline when it ran,
/// otherwise from a short probe in the benchmark directory.
fn machine_facts(context: &SuiteContext, rows: &[Row]) -> anyhow::Result<Machine> {
    let measured = rows
        .iter()
        .find(|r| r.system == "raw-fdatasync" && r.metric == "p50_us")
        .map(|r| r.value);
    let fdatasync_us_p50 = match measured {
        Some(value) => value,
        None => {
            let dir = context.temp_dir("fdatasync-probe")?;
            let budget = Budget::new(5, 200, Duration::from_millis(300));
            raw_sync::run(dir.path(), budget)?.p50_us
        }
    };
    Ok(Machine {
        cpus: machine::cpus(),
        os: machine::os(),
        filesystem: machine::filesystem_of(&context.base_dir),
        fdatasync_us_p50,
    })
}

fn write_markdown(out: &Path, markdown: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let path = out.join("report.md");
    std::fs::write(&path, markdown).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selects_suites_in_run_order() {
        assert_eq!(select_suites(&[]).unwrap(), SUITES.to_vec());
        let picked = select_suites(&["mvcc".to_string(), "durability".to_string()]).unwrap();
        assert_eq!(picked, ["durability", "mvcc"]);
        let err = select_suites(&["nope".to_string()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown suite `nope`"), "{err}");
    }

    #[test]
    fn parses_peers() {
        assert!(parse_peers("none").unwrap().is_empty());
        assert!(parse_peers("").unwrap().is_empty());
        assert_eq!(parse_peers("all").unwrap().len(), KNOWN_PEERS.len());
        assert_eq!(parse_peers("sqlite, redb").unwrap(), ["sqlite", "redb"]);
        assert!(parse_peers("sqlite,oracle").is_err());
    }
}
