//! Markdown rendering of a [`Report`]: one section per suite, each with one or more tables
//! pivoted for reading (cases down, configurations or metrics across, units in the headers).
//!
//! The layout per suite lives here so the suites only produce flat rows. The Markdown form is
//! for people and may change freely; tools read the JSON. This module knows nothing about
//! KeelDB; it must stay compilable without the engine.

use crate::report::{Report, Row};

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
        let columns = self.header.len();
        let cell = |row: &[String], i: usize| row.get(i).map_or(String::new(), |c| escape(c));
        let mut widths: Vec<usize> = (0..columns)
            .map(|i| cell(&self.header, i).chars().count())
            .collect();
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
                    if i == 0 {
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
            .map(|(i, &w)| {
                if i == 0 {
                    "-".repeat(w)
                } else {
                    format!("{}:", "-".repeat(w - 1))
                }
            })
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
pub fn pivot(
    rows: &[&Row],
    corner: &str,
    row_key: impl Fn(&Row) -> String,
    col_key: impl Fn(&Row) -> String,
) -> Table {
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
    Table {
        title: None,
        header,
        rows,
    }
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
        "group-commit" => vec![group_commit_table(rows)],
        "mvcc" => mvcc_tables(rows),
        _ => vec![pivot(
            rows,
            "case",
            |r| format!("{} {} {}", r.system, r.config, readable(&r.case)),
            |r| metric_header(&r.metric),
        )],
    }
}

/// Seed 004's layout: operations down, durability modes across, latency and throughput apart.
fn durability_tables(rows: &[&Row]) -> Vec<Table> {
    let (throughput, latency): (Vec<&Row>, Vec<&Row>) =
        rows.iter().partition(|r| r.metric.ends_with("_per_s"));
    let latency = pivot(
        &latency,
        "operation",
        |r| format!("{} {}", readable(&r.case), split_unit(&r.metric).0),
        |r| format!("{} (µs)", r.config),
    );
    let throughput = pivot(
        &throughput,
        "operation",
        |r| readable(&r.case),
        |r| format!("{} (ops/s)", r.config),
    );
    vec![titled(latency, "Latency"), titled(throughput, "Throughput")]
}

/// Writer counts down, metrics across, plus each row's throughput as a multiple of the
/// raw-fdatasync baseline (above 1× means commits share fdatasyncs).
fn group_commit_table(rows: &[&Row]) -> Table {
    let label = |r: &Row| {
        if r.system == "raw-fdatasync" {
            "raw fdatasync (4 KiB append)".to_string()
        } else {
            format!("{} {}, {}", r.system, r.config, readable(&r.case))
        }
    };
    let mut table = pivot(rows, "system", label, |r| metric_header(&r.metric));
    let baseline = rows
        .iter()
        .find(|r| r.system == "raw-fdatasync" && r.metric == "commits_per_s")
        .map(|r| r.value);
    table.header.push("× raw fdatasync".to_string());
    for table_row in &mut table.rows {
        let label_text = table_row.first().cloned().unwrap_or_default();
        let commits = rows
            .iter()
            .find(|r| r.metric == "commits_per_s" && label(r) == label_text)
            .map(|r| r.value);
        let ratio = match (commits, baseline) {
            (Some(c), Some(b)) if b > 0.0 => format!("{:.2}×", c / b),
            _ => "—".to_string(),
        };
        table_row.push(ratio);
    }
    table
}

/// Seed 003's tables: transaction overhead split by phase, read cost against version-chain
/// depth, and the large-table read and memory figures.
fn mvcc_tables(rows: &[&Row]) -> Vec<Table> {
    let group = |prefix: &str| -> Vec<&Row> {
        rows.iter()
            .copied()
            .filter(|r| r.case.starts_with(prefix))
            .collect()
    };
    let mut tables = Vec::new();
    let mut txn = group("txn_");
    // Columns appear in pivot order of first appearance; sort so phases read left to right.
    let phase_rank = |metric: &str| {
        ["begin_ns", "put_ns", "commit_ns", "total_ns"]
            .iter()
            .position(|m| *m == metric)
            .unwrap_or(usize::MAX)
    };
    txn.sort_by_key(|r| phase_rank(&r.metric));
    if !txn.is_empty() {
        let table = pivot(
            &txn,
            "transaction",
            |r| {
                format!(
                    "{} ({})",
                    readable(r.case.trim_start_matches("txn_")),
                    r.config
                )
            },
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
                let count = count
                    .parse::<f64>()
                    .map_or_else(|_| count.to_string(), format_value);
                format!("{count} keys ({})", r.config)
            },
            |r| metric_header(&r.metric),
        );
        tables.push(titled(table, "Large table: point reads and memory"));
    }
    let known = ["txn_", "depth_", "keys_"];
    let other: Vec<&Row> = rows
        .iter()
        .copied()
        .filter(|r| !known.iter().any(|k| r.case.starts_with(k)))
        .collect();
    if !other.is_empty() {
        tables.push(pivot(
            &other,
            "case",
            |r| readable(&r.case),
            |r| metric_header(&r.metric),
        ));
    }
    tables
}

/// The whole report as Markdown: a header naming the machine, then a section per suite in the
/// order the suites ran. `preamble` lines (commit, mode) go under the heading.
pub fn render_report(report: &Report, preamble: &[String]) -> String {
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
            rows: vec![
                vec!["a|b".into(), "1.00".into()],
                vec!["long name".into(), "12,345".into()],
            ],
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
        assert_eq!(
            table.rows,
            [["create", "10.0", "1.00"], ["read", "0.50", "—"]]
        );
    }

    #[test]
    fn group_commit_table_has_ratio_column() {
        let rows = [
            row(
                "group-commit",
                "raw-fdatasync",
                "4k-append",
                "single",
                "commits_per_s",
                1000.0,
            ),
            row(
                "group-commit",
                "raw-fdatasync",
                "4k-append",
                "single",
                "p50_us",
                900.0,
            ),
            row(
                "group-commit",
                "keeldb",
                "sync",
                "writers_1",
                "commits_per_s",
                800.0,
            ),
            row(
                "group-commit",
                "keeldb",
                "sync",
                "writers_8",
                "commits_per_s",
                4000.0,
            ),
        ];
        let refs: Vec<&Row> = rows.iter().collect();
        let table = group_commit_table(&refs);
        assert_eq!(
            table.header,
            ["system", "commits/s", "p50 (µs)", "× raw fdatasync"]
        );
        assert_eq!(
            table.rows[0],
            ["raw fdatasync (4 KiB append)", "1,000", "900", "1.00×"]
        );
        assert_eq!(
            table.rows[1],
            ["keeldb sync, writers 1", "800", "—", "0.80×"]
        );
        assert_eq!(table.rows[2][3], "4.00×");
    }

    #[test]
    fn durability_splits_latency_and_throughput() {
        let rows = [
            row("durability", "keeldb", "sync", "create", "avg_us", 100.0),
            row("durability", "keeldb", "relaxed", "create", "avg_us", 5.0),
            row(
                "durability",
                "keeldb",
                "sync",
                "create",
                "ops_per_s",
                9_000.0,
            ),
        ];
        let refs: Vec<&Row> = rows.iter().collect();
        let tables = suite_tables("durability", &refs);
        assert_eq!(tables.len(), 2);
        assert_eq!(tables[0].header, ["operation", "sync (µs)", "relaxed (µs)"]);
        assert_eq!(tables[0].rows, [["create avg", "100", "5.00"]]);
        assert_eq!(tables[1].header, ["operation", "sync (ops/s)"]);
    }

    #[test]
    fn report_has_header_and_a_section_per_suite() {
        let report = Report::new(
            Machine {
                cpus: 2,
                os: "linux".into(),
                filesystem: "ext4".into(),
                fdatasync_us_p50: 140.0,
            },
            vec![
                row(
                    "mvcc",
                    "keeldb",
                    "relaxed",
                    "depth_5",
                    "new_snapshot_ns",
                    80.0,
                ),
                row(
                    "mvcc",
                    "keeldb",
                    "relaxed",
                    "txn_empty_write",
                    "total_ns",
                    300.0,
                ),
                row(
                    "mvcc",
                    "keeldb",
                    "relaxed",
                    "txn_empty_write",
                    "begin_ns",
                    100.0,
                ),
                row("other", "keeldb", "x", "y", "z_ns", 1.0),
            ],
        );
        let text = render_report(&report, &["Commit: abc".to_string()]);
        assert!(text.starts_with(
            "# keel bench\n\nMachine: 2 CPUs, linux, file system ext4, fdatasync p50 140 µs"
        ));
        assert!(text.contains("Commit: abc\n"));
        let mvcc = text.find("## mvcc").unwrap();
        let other = text.find("## other").unwrap();
        assert!(mvcc < other);
        assert!(text.contains("**Transaction overhead**"));
        assert!(text.contains("| empty write (relaxed) |"));
        assert!(
            text.contains("| transaction           | begin (ns) | total (ns) |"),
            "{text}"
        );
        assert!(text.contains("**Point read against version-chain depth**"));
    }
}
