//! The benchmark report: flat result rows, the machine they ran on, and the JSON form other
//! tools read (`docs/` and notes quote figures only from it). The schema is a contract:
//!
//! ```json
//! {"schema": "keel-bench/1",
//!  "machine": {"cpus": 2, "os": "...", "filesystem": "...", "fdatasync_us_p50": 140.0},
//!  "rows": [{"suite": "group-commit", "system": "keeldb", "config": "sync",
//!            "case": "writers_64", "metric": "commits_per_s", "value": 123456.0}]}
//! ```
//!
//! Adding a field is a schema change (bump the version); the Markdown form is free to change.
//! This module knows nothing about KeelDB; it must stay compilable without the engine.

use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Serialize};

/// The `schema` value this build writes.
pub const SCHEMA: &str = "keel-bench/1";

/// Whether `system` names one of the disk baselines (`raw_sync`), not a database: reports
/// keep them out of the systems they compare.
pub fn is_baseline(system: &str) -> bool {
    system == "raw-fdatasync" || system == crate::raw_sync::OVERWRITE_SYSTEM
}

/// One measured figure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Suite name, for example `group-commit`.
    pub suite: String,
    /// `keeldb`, a peer's name, or a disk baseline (`raw-fdatasync`, `raw-overwrite`; see
    /// [`is_baseline`]).
    pub system: String,
    /// The configuration, usually a durability mode (`sync`, `periodic`, `relaxed`).
    pub config: String,
    /// What was measured, for example `writers_64`.
    pub case: String,
    /// The figure's name; its suffix names the unit (`_us`, `_ns`, `_per_s`, `_per_key`).
    pub metric: String,
    /// The figure.
    pub value: f64,
}

impl Row {
    /// A row from its parts.
    pub fn new(suite: &str, system: &str, config: &str, case: &str, metric: &str, value: f64) -> Self {
        Row {
            suite: suite.to_string(),
            system: system.to_string(),
            config: config.to_string(),
            case: case.to_string(),
            metric: metric.to_string(),
            value,
        }
    }
}

/// The machine a report was measured on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    /// CPUs available to the process.
    pub cpus: u32,
    /// OS and kernel release.
    pub os: String,
    /// File-system type under the benchmark directory.
    pub filesystem: String,
    /// Median latency of a 4 KiB append + fdatasync in the benchmark directory, in µs.
    pub fdatasync_us_p50: f64,
}

/// A whole run: the machine and every row, in the order measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Always [`SCHEMA`].
    pub schema: String,
    /// Where it ran.
    pub machine: Machine,
    /// What it measured.
    pub rows: Vec<Row>,
}

impl Report {
    /// A report with the current schema.
    pub fn new(machine: Machine, rows: Vec<Row>) -> Self {
        Report { schema: SCHEMA.to_string(), machine, rows }
    }

    /// The report as pretty-printed JSON. Non-finite values (which JSON cannot hold) are
    /// written as `null` by serde_json; the suites never produce them on purpose.
    pub fn to_json(&self) -> anyhow::Result<String> {
        let mut text = serde_json::to_string_pretty(self).context("serializing report")?;
        text.push('\n');
        Ok(text)
    }

    /// Writes [`Report::to_json`] to `path`, creating parent directories.
    pub fn write_json(&self, path: &Path) -> anyhow::Result<()> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(path, self.to_json()?).with_context(|| format!("writing {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Report {
        Report::new(
            Machine { cpus: 2, os: "linux 6.1".to_string(), filesystem: "ext4".to_string(), fdatasync_us_p50: 140.0 },
            vec![Row::new("group-commit", "keeldb", "sync", "writers_64", "commits_per_s", 123456.0)],
        )
    }

    fn keys(value: &serde_json::Value) -> Vec<String> {
        let mut keys: Vec<String> = value.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        keys
    }

    #[test]
    fn json_has_exactly_the_contract_shape() {
        let json: serde_json::Value = serde_json::from_str(&sample().to_json().unwrap()).unwrap();
        assert_eq!(keys(&json), ["machine", "rows", "schema"]);
        assert_eq!(json["schema"], "keel-bench/1");
        assert_eq!(keys(&json["machine"]), ["cpus", "fdatasync_us_p50", "filesystem", "os"]);
        assert!(json["machine"]["cpus"].is_u64());
        assert!(json["machine"]["fdatasync_us_p50"].is_f64());
        let rows = json["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(keys(&rows[0]), ["case", "config", "metric", "suite", "system", "value"]);
        assert_eq!(rows[0]["case"], "writers_64");
        assert_eq!(rows[0]["value"].as_f64(), Some(123456.0));
    }

    #[test]
    fn json_round_trips() {
        let report = sample();
        let back: Report = serde_json::from_str(&report.to_json().unwrap()).unwrap();
        assert_eq!(back, report);
    }

    #[test]
    fn write_json_creates_parent_dirs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested/out.json");
        sample().write_json(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"schema\": \"keel-bench/1\""));
    }
}
