//! Markdown rendering of a [`Report`]: one section per suite, each with one or more tables
//! pivoted for reading (cases down, configurations or metrics across, units in the headers).
//!
//! The layout per suite lives here so the suites only produce flat rows. The Markdown form is
//! for people and may change freely; tools read the JSON. This module knows nothing about
//! KeelDB; it must stay compilable without the engine.

use crate::charts::Chart;
use crate::raw_sync::OVERWRITE_SYSTEM;
use crate::report::{is_baseline, Report, Row};

/// A rendered-to-be table: a header and rows of cells.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Table {
    /// Printed as a bold line above the table, when present.
    pub title: Option<String>,
    /// Column headers; the first names the row labels.
    pub header: Vec<String>,
    /// Cells, each row as long as the header.
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// The table as GitHub-flavoured Markdown: padded columns, the first left-aligned and the
    /// rest right-aligned (they hold numbers). Pipes inside cells are escaped.
    pub fn render(&self) -> String {
        self.render_aligned(true)
    }

    /// Like [`Table::render`], with every column left-aligned (for tables of words).
    pub fn render_left_aligned(&self) -> String {
        self.render_aligned(false)
    }

    fn render_aligned(&self, numeric: bool) -> String {
        let columns = self.header.len();
        let cell = |row: &[String], i: usize| row.get(i).map_or(String::new(), |c| escape(c));
        let mut widths: Vec<usize> = (0..columns).map(|i| cell(&self.header, i).chars().count()).collect();
        for row in &self.rows {
            for (i, width) in widths.iter_mut().enumerate() {
                *width = (*width).max(cell(row, i).chars().count()).max(3);
            }
        }
        let line = |row: &[String]| {
            let cells: Vec<String> = (0..columns)
                .map(|i| {
                    let text = cell(row, i);
                    let pad = widths[i].saturating_sub(text.chars().count());
                    if i == 0 || !numeric {
                        format!("{text}{}", " ".repeat(pad))
                    } else {
                        format!("{}{text}", " ".repeat(pad))
                    }
                })
                .collect();
            format!("| {} |\n", cells.join(" | "))
        };
        let mut out = String::new();
        if let Some(title) = &self.title {
            out.push_str(&format!("**{title}**\n\n"));
        }
        out.push_str(&line(&self.header));
        let rule: Vec<String> = widths
            .iter()
            .enumerate()
            .map(|(i, &w)| if i == 0 || !numeric { "-".repeat(w) } else { format!("{}:", "-".repeat(w - 1)) })
            .collect();
        out.push_str(&format!("| {} |\n", rule.join(" | ")));
        for row in &self.rows {
            out.push_str(&line(row));
        }
        out
    }
}

fn escape(text: &str) -> String {
    text.replace('|', "\\|")
}

/// Formats a figure for reading: thousands separators for large values, fewer decimals as the
/// magnitude grows, and an em dash for non-finite values.
pub fn format_value(value: f64) -> String {
    if !value.is_finite() {
        return "—".to_string();
    }
    let magnitude = value.abs();
    if magnitude >= 1_000.0 {
        group_thousands(value.round())
    } else if magnitude >= 100.0 {
        format!("{value:.0}")
    } else if magnitude >= 10.0 {
        format!("{value:.1}")
    } else if magnitude == 0.0 {
        "0".to_string()
    } else {
        format!("{value:.2}")
    }
}

fn group_thousands(value: f64) -> String {
    let digits = format!("{:.0}", value.abs());
    let mut grouped = String::new();
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            grouped.push(',');
        }
        grouped.push(digit);
    }
    if value < 0.0 {
        format!("-{grouped}")
    } else {
        grouped
    }
}

/// Splits a metric name into a label and a unit from its suffix:
/// `p50_us` → (`p50`, `µs`), `commits_per_s` → (`commits`, `/s`), `bytes_per_key` →
/// (`bytes`, `/key`). A metric without a known suffix has no unit.
pub fn split_unit(metric: &str) -> (String, Option<&'static str>) {
    const SUFFIXES: [(&str, &str); 7] = [
        ("_per_s", "/s"),
        ("_per_key", "/key"),
        ("_us", "µs"),
        ("_ns", "ns"),
        ("_ms", "ms"),
        ("_s", "s"),
        ("_bytes", "bytes"),
    ];
    for (suffix, unit) in SUFFIXES {
        if let Some(label) = metric.strip_suffix(suffix) {
            return (label.replace('_', " "), Some(unit));
        }
    }
    (metric.replace('_', " "), None)
}

/// A column header for a metric: `p50 (µs)`, `commits/s`, `bytes/key`.
pub fn metric_header(metric: &str) -> String {
    match split_unit(metric) {
        (label, Some(unit)) if unit.starts_with('/') => format!("{label}{unit}"),
        (label, Some(unit)) => format!("{label} ({unit})"),
        (label, None) => label,
    }
}

/// Pivots rows into a table: one table row per distinct `row_key`, one column per distinct
/// `col_key`, both in order of first appearance. Missing cells print as an em dash.
pub fn pivot(rows: &[&Row], corner: &str, row_key: impl Fn(&Row) -> String, col_key: impl Fn(&Row) -> String) -> Table {
    let mut row_keys: Vec<String> = Vec::new();
    let mut col_keys: Vec<String> = Vec::new();
    for row in rows {
        let (r, c) = (row_key(row), col_key(row));
        if !row_keys.contains(&r) {
            row_keys.push(r);
        }
        if !col_keys.contains(&c) {
            col_keys.push(c);
        }
    }
    let mut cells = vec![vec!["—".to_string(); col_keys.len()]; row_keys.len()];
    for row in rows {
        let r = row_keys.iter().position(|k| *k == row_key(row));
        let c = col_keys.iter().position(|k| *k == col_key(row));
        if let (Some(r), Some(c)) = (r, c) {
            cells[r][c] = format_value(row.value);
        }
    }
    let mut header = vec![corner.to_string()];
    header.extend(col_keys);
    let rows = row_keys
        .into_iter()
        .zip(cells)
        .map(|(label, mut values)| {
            values.insert(0, label);
            values
        })
        .collect();
    Table { title: None, header, rows }
}

fn titled(mut table: Table, title: &str) -> Table {
    table.title = Some(title.to_string());
    table
}

fn readable(case: &str) -> String {
    case.replace('_', " ")
}

/// The tables for one suite's rows.
pub fn suite_tables(suite: &str, rows: &[&Row]) -> Vec<Table> {
    match suite {
        "durability" => durability_tables(rows),
        "group-commit" => group_commit_tables(rows),
        "sqlite-compare" => vec![sqlite_compare_table(rows)],
        "mvcc" => mvcc_tables(rows),
        "recovery" => vec![pivot(
            rows,
            "system, case",
            |r| format!("{} {} ({})", r.system, readable(&r.case), r.config),
            |r| metric_header(&r.metric),
        )],
        "scale" => vec![scale_table(rows)],
        _ => vec![pivot(
            rows,
            "case",
            |r| format!("{} {} {}", r.system, r.config, readable(&r.case)),
            |r| metric_header(&r.metric),
        )],
    }
}

/// Position of `value` in `order`, unknown values last.
fn rank(order: &[String], value: &str) -> usize {
    order.iter().position(|v| v == value).unwrap_or(usize::MAX)
}

fn first_appearance(rows: &[&Row], field: impl Fn(&Row) -> &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for row in rows {
        let value = field(row);
        if !out.iter().any(|v| v == value) {
            out.push(value.to_string());
        }
    }
    out
}

/// Seed 004's layout: operations down (each with a line per system), durability modes across,
/// latency and throughput apart.
fn durability_tables(rows: &[&Row]) -> Vec<Table> {
    let systems = first_appearance(rows, |r| &r.system);
    let cases = first_appearance(rows, |r| &r.case);
    let metrics = first_appearance(rows, |r| &r.metric);
    let mut sorted: Vec<&Row> = rows.to_vec();
    sorted.sort_by_key(|r| (rank(&cases, &r.case), rank(&metrics, &r.metric), rank(&systems, &r.system)));
    let (throughput, latency): (Vec<&Row>, Vec<&Row>) = sorted.iter().partition(|r| r.metric.ends_with("_per_s"));
    let latency = pivot(
        &latency,
        "operation",
        |r| format!("{} {}, {}", readable(&r.case), split_unit(&r.metric).0, r.system),
        |r| format!("{} (µs)", r.config),
    );
    let throughput = pivot(
        &throughput,
        "operation",
        |r| format!("{}, {}", readable(&r.case), r.system),
        |r| format!("{} (ops/s)", r.config),
    );
    vec![titled(latency, "Latency"), titled(throughput, "Throughput")]
}

/// Writer counts down, systems across: commits per second (with KeelDB's commits per
/// fdatasync and its ratio to the best peer), then p50 / p99 latency. The raw-fdatasync
/// baseline and the one-writer ceiling (`raw-overwrite`) are named in the first title.
fn group_commit_tables(rows: &[&Row]) -> Vec<Table> {
    let systems: Vec<String> = first_appearance(rows, |r| &r.system).into_iter().filter(|s| !is_baseline(s)).collect();
    let cases: Vec<String> =
        first_appearance(rows, |r| &r.case).into_iter().filter(|c| c.starts_with("writers_")).collect();
    let value = |system: &str, case: &str, metric: &str| {
        rows.iter().find(|r| r.system == system && r.case == case && r.metric == metric).map(|r| r.value)
    };
    let raw = |metric: &str| rows.iter().find(|r| r.system == "raw-fdatasync" && r.metric == metric).map(|r| r.value);
    let peers: Vec<&String> = systems.iter().filter(|s| *s != "keeldb").collect();
    let ceiling = rows
        .iter()
        .find(|r| r.system == OVERWRITE_SYSTEM && r.metric == "commits_per_s")
        .map(|r| format!("; one writer's ceiling, a small overwrite + fdatasync: {}/s", format_value(r.value)))
        .unwrap_or_default();
    let mut commits = Table {
        title: Some(match (raw("commits_per_s"), raw("p50_us")) {
            (Some(c), Some(p)) => format!(
                "Commits/s, sync, one key per commit (raw fdatasync baseline: {}/s, p50 {} µs{ceiling})",
                format_value(c),
                format_value(p)
            ),
            _ => "Commits/s, sync, one key per commit".to_string(),
        }),
        header: vec!["writers".to_string()],
        rows: Vec::new(),
    };
    commits.header.extend(systems.iter().cloned());
    let has_keel = systems.iter().any(|s| s == "keeldb");
    if has_keel {
        commits.header.push("keeldb commits/fdatasync".to_string());
        commits.header.push("keeldb × raw fdatasync".to_string());
        if !peers.is_empty() {
            commits.header.push("keeldb × best peer".to_string());
        }
    }
    let mut latency = Table {
        title: Some("Commit latency p50 / p99 (µs), sync".to_string()),
        header: vec!["writers".to_string()],
        rows: Vec::new(),
    };
    latency.header.extend(systems.iter().cloned());
    let cell = |v: Option<f64>| v.map_or_else(|| "—".to_string(), format_value);
    for case in &cases {
        let label = case.trim_start_matches("writers_").to_string();
        let mut row = vec![label.clone()];
        row.extend(systems.iter().map(|s| cell(value(s, case, "commits_per_s"))));
        if has_keel {
            let keel = value("keeldb", case, "commits_per_s");
            row.push(cell(value("keeldb", case, "commits_per_sync")));
            row.push(match (keel, raw("commits_per_s")) {
                (Some(k), Some(b)) if b > 0.0 => format!("{:.2}×", k / b),
                _ => "—".to_string(),
            });
            if !peers.is_empty() {
                let best = peers.iter().filter_map(|p| value(p, case, "commits_per_s")).fold(0.0, f64::max);
                row.push(match keel {
                    Some(k) if best > 0.0 => format!("{:.2}×", k / best),
                    _ => "—".to_string(),
                });
            }
        }
        commits.rows.push(row);
        let mut row = vec![label];
        row.extend(systems.iter().map(|s| match (value(s, case, "p50_us"), value(s, case, "p99_us")) {
            (Some(p50), Some(p99)) => format!("{} / {}", format_value(p50), format_value(p99)),
            _ => "—".to_string(),
        }));
        latency.rows.push(row);
    }
    vec![commits, latency]
}

/// Cases down, each system and configuration across (seed 001's comparisons side by side).
fn sqlite_compare_table(rows: &[&Row]) -> Table {
    titled(
        pivot(
            rows,
            "case",
            |r| format!("{} {}", readable(&r.case), split_unit(&r.metric).0),
            |r| format!("{} {} (µs)", r.system, r.config),
        ),
        "Latency (µs); delete-full = journal_mode=DELETE, synchronous=FULL; wal-full / wal-normal = journal_mode=WAL, synchronous=FULL / NORMAL",
    )
}

/// Table sizes down, metrics across; the `sync` commit figures say so in their header.
fn scale_table(rows: &[&Row]) -> Table {
    pivot(
        rows,
        "keys",
        |r| {
            let count = r.case.trim_start_matches("keys_");
            count.parse::<f64>().map_or_else(|_| count.to_string(), format_value)
        },
        |r| {
            if r.config == "sync" {
                format!("sync {}", metric_header(&r.metric))
            } else {
                metric_header(&r.metric)
            }
        },
    )
}

/// Seed 003's tables: transaction overhead split by phase, read cost against version-chain
/// depth, and the large-table read and memory figures.
fn mvcc_tables(rows: &[&Row]) -> Vec<Table> {
    let group = |prefix: &str| -> Vec<&Row> { rows.iter().copied().filter(|r| r.case.starts_with(prefix)).collect() };
    let mut tables = Vec::new();
    let mut txn = group("txn_");
    // Columns appear in pivot order of first appearance; sort so phases read left to right.
    let phase_rank = |metric: &str| {
        ["begin_ns", "put_ns", "commit_ns", "total_ns"].iter().position(|m| *m == metric).unwrap_or(usize::MAX)
    };
    txn.sort_by_key(|r| phase_rank(&r.metric));
    if !txn.is_empty() {
        let table = pivot(
            &txn,
            "transaction",
            |r| format!("{} ({})", readable(r.case.trim_start_matches("txn_")), r.config),
            |r| metric_header(&r.metric),
        );
        tables.push(titled(table, "Transaction overhead"));
    }
    let depth = group("depth_");
    if !depth.is_empty() {
        let table = pivot(
            &depth,
            "version-chain depth",
            |r| r.case.trim_start_matches("depth_").to_string(),
            |r| metric_header(&r.metric),
        );
        tables.push(titled(table, "Point read against version-chain depth"));
    }
    let keys = group("keys_");
    if !keys.is_empty() {
        let table = pivot(
            &keys,
            "table size",
            |r| {
                let count = r.case.trim_start_matches("keys_");
                let count = count.parse::<f64>().map_or_else(|_| count.to_string(), format_value);
                format!("{}: {count} keys ({})", r.system, r.config)
            },
            |r| metric_header(&r.metric),
        );
        tables.push(titled(table, "Large table: point reads and memory"));
    }
    let known = ["txn_", "depth_", "keys_"];
    let other: Vec<&Row> = rows.iter().copied().filter(|r| !known.iter().any(|k| r.case.starts_with(k))).collect();
    if !other.is_empty() {
        tables.push(pivot(&other, "case", |r| readable(&r.case), |r| metric_header(&r.metric)));
    }
    tables
}

/// The whole report as Markdown: a header naming the machine, then a section per suite in the
/// order the suites ran. `preamble` lines (commit, mode) go under the heading.
pub fn render_report(report: &Report, preamble: &[String], charts: &[Chart]) -> String {
    let m = &report.machine;
    let mut out = String::from("# keel bench\n\n");
    out.push_str(&format!(
        "Machine: {} CPUs, {}, file system {}, fdatasync p50 {} µs (4 KiB append).\n",
        m.cpus,
        m.os,
        m.filesystem,
        format_value(m.fdatasync_us_p50)
    ));
    for line in preamble {
        out.push_str(line);
        out.push('\n');
    }
    let mut suites: Vec<&str> = Vec::new();
    for row in &report.rows {
        if !suites.contains(&row.suite.as_str()) {
            suites.push(&row.suite);
        }
    }
    for suite in suites {
        let rows: Vec<&Row> = report.rows.iter().filter(|r| r.suite == suite).collect();
        out.push_str(&format!("\n## {suite}\n"));
        for table in suite_tables(suite, &rows) {
            out.push('\n');
            out.push_str(&table.render());
        }
        for chart in charts.iter().filter(|c| c.suite == suite) {
            out.push_str(&format!("\n![{}]({})\n", chart.title, chart.file));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Machine;

    fn row(suite: &str, system: &str, config: &str, case: &str, metric: &str, value: f64) -> Row {
        Row::new(suite, system, config, case, metric, value)
    }

    #[test]
    fn formats_values_by_magnitude() {
        assert_eq!(format_value(0.0), "0");
        assert_eq!(format_value(0.123), "0.12");
        assert_eq!(format_value(7.5), "7.50");
        assert_eq!(format_value(42.25), "42.2");
        assert_eq!(format_value(420.4), "420");
        assert_eq!(format_value(1_234.0), "1,234");
        assert_eq!(format_value(1_234_567.8), "1,234,568");
        assert_eq!(format_value(-98_765.0), "-98,765");
        assert_eq!(format_value(f64::NAN), "—");
    }

    #[test]
    fn metric_headers_carry_units() {
        assert_eq!(metric_header("p50_us"), "p50 (µs)");
        assert_eq!(metric_header("commits_per_s"), "commits/s");
        assert_eq!(metric_header("bytes_per_key"), "bytes/key");
        assert_eq!(metric_header("read_ns"), "read (ns)");
        assert_eq!(metric_header("rss_delta_bytes"), "rss delta (bytes)");
        assert_eq!(metric_header("load_s"), "load (s)");
        assert_eq!(metric_header("ratio"), "ratio");
    }

    #[test]
    fn renders_aligned_table() {
        let table = Table {
            title: Some("T".to_string()),
            header: vec!["case".into(), "value (µs)".into()],
            rows: vec![vec!["a|b".into(), "1.00".into()], vec!["long name".into(), "12,345".into()]],
        };
        let expected = "**T**\n\n\
            | case      | value (µs) |\n\
            | --------- | ---------: |\n\
            | a\\|b      |       1.00 |\n\
            | long name |     12,345 |\n";
        assert_eq!(table.render(), expected);
    }

    #[test]
    fn every_rendered_line_has_the_same_cell_count() {
        let table = Table {
            title: None,
            header: vec!["a".into(), "b".into(), "c".into()],
            rows: vec![vec!["x".into()], vec!["1".into(), "2".into(), "3".into()]],
        };
        for line in table.render().lines() {
            assert_eq!(line.matches(" | ").count(), 2, "{line}");
        }
    }

    #[test]
    fn pivot_keeps_first_appearance_order_and_fills_gaps() {
        let rows = [
            row("s", "k", "sync", "create", "avg_us", 10.0),
            row("s", "k", "relaxed", "create", "avg_us", 1.0),
            row("s", "k", "sync", "read", "avg_us", 0.5),
        ];
        let refs: Vec<&Row> = rows.iter().collect();
        let table = pivot(&refs, "op", |r| r.case.clone(), |r| r.config.clone());
        assert_eq!(table.header, ["op", "sync", "relaxed"]);
        assert_eq!(table.rows, [["create", "10.0", "1.00"], ["read", "0.50", "—"]]);
    }

    #[test]
    fn group_commit_tables_put_systems_across_with_ratios() {
        let gc = |system: &str, case: &str, metric: &str, value: f64| {
            row("group-commit", system, "sync", case, metric, value)
        };
        let rows = [
            row("group-commit", "raw-fdatasync", "4k-append", "single", "commits_per_s", 1000.0),
            row("group-commit", "raw-fdatasync", "4k-append", "single", "p50_us", 900.0),
            row("group-commit", "raw-overwrite", "256b-overwrite", "writers_1", "commits_per_s", 1250.0),
            gc("keeldb", "writers_1", "commits_per_s", 800.0),
            gc("keeldb", "writers_1", "p50_us", 1200.0),
            gc("keeldb", "writers_1", "p99_us", 2000.0),
            gc("keeldb", "writers_1", "commits_per_sync", 1.0),
            gc("keeldb", "writers_8", "commits_per_s", 4000.0),
            gc("sqlite", "writers_1", "commits_per_s", 1000.0),
            gc("sqlite", "writers_8", "commits_per_s", 1000.0),
        ];
        let refs: Vec<&Row> = rows.iter().collect();
        let tables = suite_tables("group-commit", &refs);
        assert_eq!(tables.len(), 2);
        let commits = &tables[0];
        assert!(commits.title.as_deref().unwrap().contains("1,000/s, p50 900 µs"));
        // The one-writer ceiling is named in the title, not compared as a system.
        assert!(commits.title.as_deref().unwrap().contains("overwrite + fdatasync: 1,250/s"));
        assert_eq!(
            commits.header,
            ["writers", "keeldb", "sqlite", "keeldb commits/fdatasync", "keeldb × raw fdatasync", "keeldb × best peer"]
        );
        assert_eq!(commits.rows[0], ["1", "800", "1,000", "1.00", "0.80×", "0.80×"]);
        assert_eq!(commits.rows[1], ["8", "4,000", "1,000", "—", "4.00×", "4.00×"]);
        assert_eq!(tables[1].rows[0], ["1", "1,200 / 2,000", "—"]);
    }

    #[test]
    fn durability_splits_latency_and_throughput() {
        let rows = [
            row("durability", "keeldb", "sync", "create", "avg_us", 100.0),
            row("durability", "keeldb", "relaxed", "create", "avg_us", 5.0),
            row("durability", "keeldb", "sync", "read", "avg_us", 0.5),
            row("durability", "sqlite", "sync", "create", "avg_us", 200.0),
            row("durability", "keeldb", "sync", "create", "ops_per_s", 9_000.0),
        ];
        let refs: Vec<&Row> = rows.iter().collect();
        let tables = suite_tables("durability", &refs);
        assert_eq!(tables.len(), 2);
        assert_eq!(tables[0].header, ["operation", "sync (µs)", "relaxed (µs)"]);
        assert_eq!(
            tables[0].rows,
            [
                ["create avg, keeldb", "100", "5.00"],
                ["create avg, sqlite", "200", "—"],
                ["read avg, keeldb", "0.50", "—"]
            ]
        );
        assert_eq!(tables[1].header, ["operation", "sync (ops/s)"]);
    }

    #[test]
    fn report_has_header_and_a_section_per_suite() {
        let report = Report::new(
            Machine { cpus: 2, os: "linux".into(), filesystem: "ext4".into(), fdatasync_us_p50: 140.0 },
            vec![
                row("mvcc", "keeldb", "relaxed", "depth_5", "new_snapshot_ns", 80.0),
                row("mvcc", "keeldb", "relaxed", "txn_empty_write", "total_ns", 300.0),
                row("mvcc", "keeldb", "relaxed", "txn_empty_write", "begin_ns", 100.0),
                row("other", "keeldb", "x", "y", "z_ns", 1.0),
            ],
        );
        let chart = Chart { suite: "mvcc".into(), title: "Reads".into(), file: "reads.png".into() };
        let text = render_report(&report, &["Commit: abc".to_string()], &[chart]);
        assert!(text.contains("\n![Reads](reads.png)\n"));
        assert!(text.find("![Reads]").unwrap() < text.find("## other").unwrap());
        assert!(text.starts_with("# keel bench\n\nMachine: 2 CPUs, linux, file system ext4, fdatasync p50 140 µs"));
        assert!(text.contains("Commit: abc\n"));
        let mvcc = text.find("## mvcc").unwrap();
        let other = text.find("## other").unwrap();
        assert!(mvcc < other);
        assert!(text.contains("**Transaction overhead**"));
        assert!(text.contains("| empty write (relaxed) |"));
        assert!(text.contains("| transaction           | begin (ns) | total (ns) |"), "{text}");
        assert!(text.contains("**Point read against version-chain depth**"));
    }
}
