//! `keel bench`: the user-facing benchmark report for KeelDB, side by side with its peers.
//!
//! Each suite opens stores in fresh temporary directories, measures, and returns flat
//! [`report::Row`]s; [`run`] adds the machine facts, prints Markdown tables to stdout, progress
//! to stderr, writes the JSON contract (`schema: keel-bench/1`) and, with `--out`, PNG charts and
//! a `report.md` that embeds them.
//!
//! Code map: the harness (`report`, `markdown`, `charts`, `progress`, `timing`, `machine`,
//! `raw_sync`) never references the engine, so it builds and tests on its own. `peers` puts
//! KeelDB and each peer (SQLite, redb, LMDB, SurrealKV, fjall, RocksDB; each behind its cargo
//! feature) behind one small store interface; `suites::*` drive them; `child` is the helper
//! process the recovery and scale suites kill or measure in isolation. The peers' heavy
//! dependencies stay in this crate, never in the engine's tree.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

pub mod charts;
pub mod child;
pub mod machine;
pub mod markdown;
pub mod peers;
pub mod progress;
pub mod raw_sync;
pub mod report;
pub mod suites;
pub mod timing;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};

use crate::peers::{Mode, System};
use crate::progress::Progress;
use crate::report::{Machine, Report, Row};
use crate::timing::Budget;

pub use crate::child::{child_main, CHILD_COMMAND};
pub use crate::peers::KNOWN_PEERS;

/// Suite names in the order `keel bench` runs them.
pub const SUITES: [&str; 10] = [
    "durability",
    "group-commit",
    "sqlite-compare",
    "mvcc",
    "recovery",
    "scale",
    "cpu-accounting",
    "engine",
    "cluster",
    "curp",
];

/// Suites that run only when named with `--suite` (they start server processes and need the
/// Go tools of `scripts/go-tools`).
pub const OPT_IN_SUITES: [&str; 2] = ["cluster", "curp"];

/// How much work each suite does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scale {
    /// The full run, for published figures.
    #[default]
    Full,
    /// `--quick`: every suite together finishes in under a minute on two cores (keeldb only
    /// unless peers are asked for by name).
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
    /// `none`, `all`, or a comma-separated list of peers. `None` means every compiled-in peer
    /// for a full run and no peer for `--quick` (which could not finish in a minute with them).
    pub peers: Option<String>,
    /// Where to write the JSON report.
    pub json: Option<PathBuf>,
    /// A directory to write `report.md` and the PNG charts into.
    pub out: Option<PathBuf>,
    /// The parent directory for the benchmark's temporary stores (default: the OS temp dir).
    pub dir: Option<PathBuf>,
    /// Smoke-test scale for the CLI's own tests (hidden flag `--tiny`); overrides `quick`.
    pub tiny: bool,
    /// How to start the helper process (see [`child`]). `None`: this executable with
    /// [`CHILD_COMMAND`], which is what the `keel` binary provides.
    pub child_command: Option<Vec<String>>,
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

/// What a suite gets: where to put its stores, how hard to work, which peers to run beside
/// KeelDB, how to start helper processes, and where to report progress.
pub struct SuiteContext {
    /// Parent directory for temporary stores.
    pub base_dir: PathBuf,
    /// How much work to do.
    pub scale: Scale,
    /// Progress output.
    pub progress: Progress,
    /// The peers selected and compiled in, in report order.
    pub peers: Vec<&'static dyn System>,
    /// Program and leading arguments that start a helper process.
    pub child_command: Vec<String>,
}

impl SuiteContext {
    /// A fresh temporary directory for one store; removed when the guard drops.
    pub fn temp_dir(&self, label: &str) -> anyhow::Result<tempfile::TempDir> {
        tempfile::Builder::new()
            .prefix(&format!("keel-bench-{label}-"))
            .tempdir_in(&self.base_dir)
            .with_context(|| format!("creating a temporary directory in {}", self.base_dir.display()))
    }

    /// KeelDB followed by the selected peers.
    pub fn systems(&self) -> Vec<&'static dyn System> {
        let mut systems: Vec<&'static dyn System> = vec![&peers::keeldb::KeelDb];
        systems.extend(self.peers.iter().copied());
        systems
    }

    /// Whether a peer is selected.
    pub fn has_peer(&self, name: &str) -> bool {
        self.peers.iter().any(|p| p.name() == name)
    }
}

/// Checks suite names and returns them in run order; empty means all.
pub fn select_suites(requested: &[String]) -> anyhow::Result<Vec<&'static str>> {
    for name in requested {
        if !SUITES.contains(&name.as_str()) {
            bail!("unknown suite `{name}`; the suites are: {}", SUITES.join(", "));
        }
    }
    Ok(SUITES
        .iter()
        .copied()
        .filter(|s| if requested.is_empty() { !OPT_IN_SUITES.contains(s) } else { requested.iter().any(|r| r == s) })
        .collect())
}

/// Checks `--peers`: `none`, `all`, `default`, or a comma-separated list of known peers.
/// Returns the peers asked for (empty for `none`; every known peer for `all` and `default`).
pub fn parse_peers(text: &str) -> anyhow::Result<Vec<&'static str>> {
    match text.trim() {
        "" | "none" => Ok(Vec::new()),
        "all" | "default" => Ok(KNOWN_PEERS.to_vec()),
        list => list
            .split(',')
            .map(|name| {
                let name = name.trim();
                KNOWN_PEERS
                    .iter()
                    .copied()
                    .find(|p| *p == name)
                    .with_context(|| format!("unknown peer `{name}`; known peers: {}", KNOWN_PEERS.join(", ")))
            })
            .collect(),
    }
}

/// The peers a run compares against, and why any asked for are missing.
pub struct PeerSelection {
    /// Selected and compiled in, in report order.
    pub peers: Vec<&'static dyn System>,
    /// Lines for the report's preamble.
    pub notes: Vec<String>,
}

/// Resolves `--peers` against the peers compiled into this build.
pub fn select_peers(text: Option<&str>, scale: Scale) -> anyhow::Result<PeerSelection> {
    let compiled = peers::compiled();
    let mut notes = Vec::new();
    let text = text.map(str::trim).unwrap_or("default");
    let asked = if text == "default" && scale != Scale::Full {
        notes.push(
            "--quick runs keeldb only by default (six systems cannot finish in a minute on two \
             cores); pass --peers all or a list to include peers."
                .to_string(),
        );
        Vec::new()
    } else {
        parse_peers(text)?
    };
    let mut missing = Vec::new();
    let mut selected = Vec::new();
    for name in asked {
        match compiled.iter().find(|p| p.name() == name) {
            Some(peer) => selected.push(*peer),
            None => missing.push(name),
        }
    }
    if !missing.is_empty() {
        let features: Vec<&str> = missing.iter().map(|p| peers::feature_of(p)).collect();
        notes.push(format!(
            "Not compiled into this build, skipped: {} (rebuild keel with `--features {}`).",
            missing.join(", "),
            features.join(",")
        ));
    }
    // Keep report order (the order of `peers::compiled`), whatever order the list used.
    selected.sort_by_key(|p| compiled.iter().position(|c| c.name() == p.name()));
    selected.dedup_by_key(|p| p.name());
    Ok(PeerSelection { peers: selected, notes })
}

/// Runs the selected suites and writes the reports. Markdown goes to stdout, progress to
/// stderr, JSON to `args.json`, and `report.md` plus PNG charts into `args.out`.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let suites = select_suites(&args.suites)?;
    let scale = args.scale();
    let selection = select_peers(args.peers.as_deref(), scale)?;
    let progress = Progress::new(false);
    for note in &selection.notes {
        progress.line("bench", format!("note: {note}"));
    }
    let base_dir = match &args.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            dir.clone()
        }
        None => std::env::temp_dir(),
    };
    let child_command = match &args.child_command {
        Some(command) => command.clone(),
        None => {
            let exe = std::env::current_exe().context("locating the keel executable")?;
            vec![exe.to_string_lossy().into_owned(), CHILD_COMMAND.to_string()]
        }
    };
    let context = SuiteContext { base_dir, scale, progress, peers: selection.peers, child_command };
    let names: Vec<&str> = context.systems().iter().map(|s| s.name()).collect();
    context.progress.line("bench", format!("systems: {}", names.join(", ")));
    let mut rows: Vec<Row> = Vec::new();
    for suite in &suites {
        context.progress.line(suite, "starting");
        let suite_rows = match *suite {
            "durability" => suites::durability::run(&context)?,
            "group-commit" => suites::group_commit::run(&context)?,
            "sqlite-compare" => suites::sqlite_compare::run(&context)?,
            "mvcc" => suites::mvcc::run(&context)?,
            "recovery" => suites::recovery::run(&context)?,
            "scale" => suites::scale::run(&context)?,
            "cpu-accounting" => suites::cpu_accounting::run(&context)?,
            "engine" => suites::engine::run(&context)?,
            "cluster" => suites::cluster::run(&context)?,
            "curp" => suites::curp::run(&context)?,
            other => bail!("suite `{other}` has no runner"),
        };
        context.progress.line(suite, format!("done ({} rows)", suite_rows.len()));
        rows.extend(suite_rows);
    }
    let machine = machine_facts(&context, &rows)?;
    let report = Report::new(machine, rows);
    let preamble = preamble(&context, &selection.notes);
    let markdown = markdown::render_report(&report, &preamble, &[]);
    print!("{markdown}");
    if let Some(path) = &args.json {
        report.write_json(path)?;
        context.progress.line("bench", format!("wrote {}", path.display()));
    }
    if let Some(out) = &args.out {
        std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
        let charts = match charts::write_all(out, &report) {
            Ok(charts) => charts,
            Err(error) => {
                context.progress.line("bench", format!("note: no charts: {error:#}"));
                Vec::new()
            }
        };
        let with_charts = markdown::render_report(&report, &preamble, &charts);
        write_markdown(out, &with_charts)?;
        context
            .progress
            .line("bench", format!("wrote {} and {} charts", out.join("report.md").display(), charts.len()));
    }
    context.progress.line("bench", format!("finished in {:.1} s", context.progress.elapsed_s()));
    Ok(())
}

fn preamble(context: &SuiteContext, notes: &[String]) -> Vec<String> {
    let scale = match context.scale {
        Scale::Full => "full",
        Scale::Quick => "quick",
        Scale::Tiny => "tiny (smoke test; figures not meaningful)",
    };
    let commit = machine::git_commit().unwrap_or_else(|| "unknown".to_string());
    let systems = context.systems();
    let names: Vec<&str> = systems.iter().map(|s| s.name()).collect();
    let mut lines = vec![
        format!("Commit: {commit}. Scale: {scale}. Systems: {}.", names.join(", ")),
        format!(
            "Stores in {}; every system runs in the same process, one after another, on the same \
             disk. Keys are distinct per commit unless a table says otherwise.",
            context.base_dir.display()
        ),
    ];
    lines.extend(notes.iter().cloned());
    lines.push(String::new());
    lines.push("**What each durability mode means for each system**".to_string());
    lines.push(String::new());
    let mut table = markdown::Table {
        title: None,
        header: vec![
            "system".to_string(),
            "sync".to_string(),
            "periodic".to_string(),
            "relaxed".to_string(),
            "checkpoint".to_string(),
        ],
        rows: Vec::new(),
    };
    for system in &systems {
        let mut row = vec![system.name().to_string()];
        row.extend(Mode::ALL.iter().map(|m| system.describe(*m)));
        row.push(system.describe_checkpoint().to_string());
        table.rows.push(row);
    }
    lines.push(table.render_left_aligned());
    lines
}

/// Machine facts; `fdatasync_us_p50` comes from the group-commit suite's baseline when it ran,
/// otherwise from a short probe in the benchmark directory.
fn machine_facts(context: &SuiteContext, rows: &[Row]) -> anyhow::Result<Machine> {
    let measured = rows.iter().find(|r| r.system == "raw-fdatasync" && r.metric == "p50_us").map(|r| r.value);
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
    let path = out.join("report.md");
    std::fs::write(&path, markdown).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selects_suites_in_run_order() {
        assert_eq!(
            select_suites(&[]).unwrap(),
            SUITES.iter().copied().filter(|s| !OPT_IN_SUITES.contains(s)).collect::<Vec<_>>()
        );
        let picked = select_suites(&["mvcc".to_string(), "durability".to_string()]).unwrap();
        assert_eq!(picked, ["durability", "mvcc"]);
        let err = select_suites(&["nope".to_string()]).unwrap_err().to_string();
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

    #[test]
    fn quick_defaults_to_no_peers_and_lists_are_kept_in_report_order() {
        let quick = select_peers(None, Scale::Quick).unwrap();
        assert!(quick.peers.is_empty());
        assert!(quick.notes[0].contains("--quick"));
        let full = select_peers(None, Scale::Full).unwrap();
        assert_eq!(full.peers.len(), peers::compiled().len());
        let none = select_peers(Some("none"), Scale::Full).unwrap();
        assert!(none.peers.is_empty() && none.notes.is_empty());
        let listed = select_peers(Some("fjall,sqlite,fjall"), Scale::Quick).unwrap();
        let names: Vec<&str> = listed.peers.iter().map(|p| p.name()).collect();
        let compiled: Vec<&str> = peers::compiled().iter().map(|p| p.name()).collect();
        let expected: Vec<&str> = ["sqlite", "fjall"].into_iter().filter(|n| compiled.contains(n)).collect();
        assert_eq!(names, expected);
        if !compiled.contains(&"rocksdb") {
            let notes = select_peers(Some("rocksdb"), Scale::Full).unwrap().notes;
            assert!(notes[0].contains("--features rocksdb"), "{notes:?}");
        }
        assert!(select_peers(Some("oracle"), Scale::Full).is_err());
    }
}
