//! PNG charts of a [`Report`] (plotters, bitmap backend): commits per second against writers
//! (log scale), commit-latency percentiles per system, point reads, reopen times, the
//! sqlite-compare cases and the scale curves. Each chart is drawn only when its rows exist.
//!
//! Text needs a TrueType font. plotters' `ab_glyph` backend takes the font's bytes, so this
//! module loads DejaVu Sans (Debian: `fonts-dejavu-core`) from the usual places, or the file
//! named by `KEEL_BENCH_FONT`; without one it draws no chart and says why. This module knows
//! nothing about KeelDB.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{bail, Context};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{FontStyle, RGBColor};

use crate::report::{is_baseline, Report, Row};

/// One chart written: the suite it belongs to, a title, and its file name inside the out dir.
#[derive(Debug, Clone, PartialEq)]
pub struct Chart {
    /// The suite section the chart is embedded in.
    pub suite: String,
    /// Alt text and caption.
    pub title: String,
    /// File name, relative to the out directory.
    pub file: String,
}

const FONT_CANDIDATES: [&str; 4] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

/// Registers a sans-serif font with plotters once per process.
fn ensure_font() -> anyhow::Result<()> {
    static FONT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let result = FONT.get_or_init(|| {
        let mut candidates: Vec<PathBuf> = std::env::var_os("KEEL_BENCH_FONT").map(PathBuf::from).into_iter().collect();
        candidates.extend(FONT_CANDIDATES.iter().map(PathBuf::from));
        for path in candidates {
            if let Ok(bytes) = std::fs::read(&path) {
                // The font lives for the whole process: plotters keeps a `'static` reference.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    let _ = plotters::style::register_font("sans-serif", FontStyle::Bold, bytes);
                    return Ok(path);
                }
            }
        }
        Err("no TrueType font found: install fonts-dejavu-core (apt-get install -y \
             fonts-dejavu-core) or set KEEL_BENCH_FONT to a .ttf file"
            .to_string())
    });
    match result {
        Ok(_) => Ok(()),
        Err(why) => bail!("{why}"),
    }
}

/// Draws every chart the report has rows for into `out`; returns what was written.
pub fn write_all(out: &Path, report: &Report) -> anyhow::Result<Vec<Chart>> {
    ensure_font()?;
    let mut charts = Vec::new();
    let mut add = |suite: &str, title: &str, file: &str, written: anyhow::Result<bool>| match written {
        Ok(true) => charts.push(Chart { suite: suite.to_string(), title: title.to_string(), file: file.to_string() }),
        Ok(false) => {}
        Err(error) => eprintln!("keel bench: chart {file} failed: {error:#}"),
    };
    let rows = &report.rows;
    let t = "Durable commits/s vs writers (sync, one key per commit, log scales)";
    add("group-commit", t, "group_commit.png", group_commit(&out.join("group_commit.png"), rows, t));
    let t = "Commit latency percentiles per system (sync), µs, log scale";
    add("group-commit", t, "commit_latency.png", commit_latency(&out.join("commit_latency.png"), rows, t));
    let t = "Single create latency by durability mode (avg µs, log scale)";
    add("durability", t, "durability_create.png", durability(&out.join("durability_create.png"), rows, t));
    let t = "sqlite-compare: KeelDB vs SQLite (µs, log scale)";
    add("sqlite-compare", t, "sqlite_compare.png", sqlite_compare(&out.join("sqlite_compare.png"), rows, t));
    let t = "Point read from one snapshot (ns, log scale)";
    add("mvcc", t, "point_reads.png", point_reads(&out.join("point_reads.png"), rows, t));
    let t = "Reopen after SIGKILL (ms, log scale)";
    add("recovery", t, "recovery.png", recovery(&out.join("recovery.png"), rows, t));
    let t = "KeelDB cost curve from 10^4 keys up";
    add("scale", t, "scale.png", scale(&out.join("scale.png"), rows, t));
    Ok(charts)
}

const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

fn find(rows: &[Row], suite: &str, system: &str, config: &str, case: &str, metric: &str) -> Option<f64> {
    rows.iter()
        .find(|r| {
            r.suite == suite
                && r.system == system
                && (config.is_empty() || r.config == config)
                && r.case == case
                && r.metric == metric
        })
        .map(|r| r.value)
        .filter(|v| v.is_finite() && *v > 0.0)
}

/// Distinct values of a field, in order of first appearance.
fn distinct(rows: &[Row], suite: &str, field: impl Fn(&Row) -> &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for row in rows.iter().filter(|r| r.suite == suite) {
        let value = field(row);
        if !out.iter().any(|v| v == value) {
            out.push(value.to_string());
        }
    }
    out
}

/// A log-scale range that holds every value with some margin.
fn log_range(values: impl Iterator<Item = f64>) -> Option<std::ops::Range<f64>> {
    let (mut lo, mut hi) = (f64::MAX, f64::MIN);
    for v in values.filter(|v| v.is_finite() && *v > 0.0) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    (lo <= hi).then(|| {
        // Bars start at the lower bound, so keep the smallest bar visibly taller than zero.
        let lo = 10f64.powf((lo.log10() - 0.15).floor());
        let hi = 10f64.powf((hi.log10() + 0.45).ceil().max(lo.log10() + 1.0));
        lo..hi
    })
}

fn group_commit(path: &Path, rows: &[Row], title: &str) -> anyhow::Result<bool> {
    let suite = "group-commit";
    let systems: Vec<String> = distinct(rows, suite, |r| &r.system).into_iter().filter(|s| !is_baseline(s)).collect();
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for system in &systems {
        let points: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.suite == suite && &r.system == system && r.metric == "commits_per_s")
            .filter_map(|r| {
                let writers: f64 = r.case.strip_prefix("writers_")?.parse().ok()?;
                (r.value > 0.0).then_some((writers, r.value))
            })
            .collect();
        if !points.is_empty() {
            series.push((system.clone(), points));
        }
    }
    if series.is_empty() {
        return Ok(false);
    }
    let raw = find(rows, suite, "raw-fdatasync", "", "single", "commits_per_s");
    let root = BitMapBackend::new(path, (1100, 650)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut all: Vec<f64> = series.iter().flat_map(|(_, p)| p.iter().map(|(_, y)| *y)).collect();
    all.extend(raw);
    let y = log_range(all.into_iter()).context("no values")?;
    // Writers double from one count to the next, so x is log2(writers) on a linear axis, which
    // puts a labelled tick exactly on every count measured.
    let series: Vec<(String, Vec<(f64, f64)>)> = series
        .into_iter()
        .map(|(name, points)| (name, points.into_iter().map(|(x, y)| (x.log2(), y)).collect()))
        .collect();
    let max_x = series.iter().flat_map(|(_, p)| p.iter().map(|(x, _)| *x)).fold(0.0, f64::max);
    let (x_lo, x_hi) = (-0.25, max_x + 0.25);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(15)
        .x_label_area_size(50)
        .y_label_area_size(90)
        .build_cartesian_2d(x_lo..x_hi, y.log_scale())?;
    chart
        .configure_mesh()
        .x_desc("writer threads")
        .y_desc("commits/s")
        .x_labels((max_x as usize + 1).max(2))
        .x_label_formatter(&|x| {
            if (x - x.round()).abs() < 1e-6 && *x >= 0.0 {
                format!("{:.0}", 2f64.powf(x.round()))
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|y| short_number(*y))
        .label_style(("sans-serif", 16))
        .draw()?;
    for (i, (name, points)) in series.iter().enumerate() {
        let style = color(i).stroke_width(3);
        chart
            .draw_series(LineSeries::new(points.iter().copied(), style))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color(i).stroke_width(3)));
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 5, color(i).filled())))?;
    }
    if let Some(raw) = raw {
        let gray = RGBColor(90, 90, 90);
        chart
            .draw_series(DashedLineSeries::new(vec![(x_lo, raw), (x_hi, raw)], 8, 6, gray.stroke_width(2)))?
            .label("raw fdatasync (4 KiB append)")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], gray.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 16))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(true)
}

/// Bars: one group per label, one bar per series inside each group, log y.
struct Bars {
    title: String,
    y_desc: String,
    groups: Vec<String>,
    series: Vec<(String, Vec<Option<f64>>)>,
}

fn draw_bars(area: &DrawingArea<BitMapBackend<'_>, Shift>, bars: &Bars) -> anyhow::Result<()> {
    let values = bars.series.iter().flat_map(|(_, v)| v.iter().flatten().copied());
    let Some(y) = log_range(values) else {
        return Ok(());
    };
    let groups = bars.groups.len().max(1) as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(&bars.title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(-0.5f64..groups - 0.5, y.clone().log_scale())?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc(bars.y_desc.as_str())
        .y_label_formatter(&|y| short_number(*y))
        .label_style(("sans-serif", 15))
        .draw()?;
    let count = bars.series.len().max(1) as f64;
    let width = 0.8 / count;
    for (j, (name, values)) in bars.series.iter().enumerate() {
        let bars_iter = values.iter().enumerate().filter_map(|(i, v)| {
            let v = (*v)?;
            let x0 = i as f64 - 0.4 + j as f64 * width;
            Some(Rectangle::new([(x0, y.start), (x0 + width * 0.92, v)], color(j).filled()))
        });
        chart
            .draw_series(bars_iter)?
            .label(name.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], color(j).filled()));
        let labels = values.iter().enumerate().filter_map(|(i, v)| {
            let v = (*v)?;
            let x = i as f64 - 0.4 + (j as f64 + 0.46) * width;
            Some(Text::new(
                short_number(v),
                (x, v),
                ("sans-serif", 12).into_font().color(&BLACK).pos(plotters::style::text_anchor::Pos::new(
                    plotters::style::text_anchor::HPos::Center,
                    plotters::style::text_anchor::VPos::Bottom,
                )),
            ))
        });
        chart.draw_series(labels)?;
    }
    // Group names under the axis, in pixel coordinates.
    let (base_x, base_y) = area.get_base_pixel();
    for (i, name) in bars.groups.iter().enumerate() {
        let (px, py) = chart.backend_coord(&(i as f64, y.start));
        area.draw(&Text::new(
            name.clone(),
            (px - base_x, py - base_y + 8),
            ("sans-serif", 15).into_font().color(&BLACK).pos(plotters::style::text_anchor::Pos::new(
                plotters::style::text_anchor::HPos::Center,
                plotters::style::text_anchor::VPos::Top,
            )),
        ))?;
    }
    if bars.series.len() > 1 {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font(("sans-serif", 14))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    }
    Ok(())
}

fn commit_latency(path: &Path, rows: &[Row], title: &str) -> anyhow::Result<bool> {
    let suite = "group-commit";
    let systems: Vec<String> = distinct(rows, suite, |r| &r.system).into_iter().filter(|s| !is_baseline(s)).collect();
    let cases: Vec<String> =
        distinct(rows, suite, |r| &r.case).into_iter().filter(|c| c.starts_with("writers_")).collect();
    let (Some(first), Some(last)) = (cases.first(), cases.last()) else {
        return Ok(false);
    };
    let root = BitMapBackend::new(path, (1100, 900)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 24))?;
    let panels = root.split_evenly((2, 1));
    for (panel, case) in panels.iter().zip([first, last]) {
        let series = ["p50_us", "p99_us"]
            .iter()
            .map(|metric| {
                let values = systems.iter().map(|s| find(rows, suite, s, "sync", case, metric)).collect();
                (metric.trim_end_matches("_us").to_string(), values)
            })
            .collect();
        draw_bars(
            panel,
            &Bars {
                title: format!("{} writer(s)", case.trim_start_matches("writers_")),
                y_desc: "commit latency (µs)".to_string(),
                groups: systems.clone(),
                series,
            },
        )?;
    }
    root.present()?;
    Ok(true)
}

fn durability(path: &Path, rows: &[Row], title: &str) -> anyhow::Result<bool> {
    let suite = "durability";
    let systems = distinct(rows, suite, |r| &r.system);
    if systems.is_empty() {
        return Ok(false);
    }
    let series = ["sync", "periodic", "relaxed"]
        .iter()
        .map(|mode| {
            let values = systems.iter().map(|s| find(rows, suite, s, mode, "create", "avg_us")).collect();
            (mode.to_string(), values)
        })
        .collect();
    let root = BitMapBackend::new(path, (1100, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    draw_bars(
        &root,
        &Bars { title: title.to_string(), y_desc: "create latency (µs)".to_string(), groups: systems, series },
    )?;
    root.present()?;
    Ok(true)
}

fn sqlite_compare(path: &Path, rows: &[Row], title: &str) -> anyhow::Result<bool> {
    let suite = "sqlite-compare";
    let cases: [(&str, &str, &str); 5] = [
        ("read", "avg_us", "read"),
        ("write", "avg_us", "write"),
        ("insert_100_one_txn", "total_us", "100 inserts, 1 txn"),
        ("insert_100_individual", "total_us", "100 inserts, 100 txns"),
        ("concurrent_reads_10x100", "total_us", "10 threads × 100 reads"),
    ];
    let mut configs: Vec<(String, String)> = Vec::new();
    for row in rows.iter().filter(|r| r.suite == suite) {
        let key = (row.system.clone(), row.config.clone());
        if !configs.contains(&key) {
            configs.push(key);
        }
    }
    if configs.is_empty() {
        return Ok(false);
    }
    let series = configs
        .iter()
        .map(|(system, config)| {
            let values =
                cases.iter().map(|(case, metric, _)| find(rows, suite, system, config, case, metric)).collect();
            (format!("{system} {config}"), values)
        })
        .collect();
    let root = BitMapBackend::new(path, (1200, 650)).into_drawing_area();
    root.fill(&WHITE)?;
    draw_bars(
        &root,
        &Bars {
            title: title.to_string(),
            y_desc: "µs".to_string(),
            groups: cases.iter().map(|c| c.2.to_string()).collect(),
            series,
        },
    )?;
    root.present()?;
    Ok(true)
}

fn point_reads(path: &Path, rows: &[Row], title: &str) -> anyhow::Result<bool> {
    let suite = "mvcc";
    let Some(case) = distinct(rows, suite, |r| &r.case).into_iter().rev().find(|c| c.starts_with("keys_")) else {
        return Ok(false);
    };
    let systems = distinct(rows, suite, |r| &r.system);
    let values: Vec<Option<f64>> = systems.iter().map(|s| find(rows, suite, s, "relaxed", &case, "read_ns")).collect();
    let root = BitMapBackend::new(path, (1000, 550)).into_drawing_area();
    root.fill(&WHITE)?;
    draw_bars(
        &root,
        &Bars {
            title: format!(
                "{title}, {} keys",
                crate::markdown::format_value(case.trim_start_matches("keys_").parse::<f64>().unwrap_or(0.0))
            ),
            y_desc: "ns per point read".to_string(),
            groups: systems,
            series: vec![("read".to_string(), values)],
        },
    )?;
    root.present()?;
    Ok(true)
}

fn recovery(path: &Path, rows: &[Row], title: &str) -> anyhow::Result<bool> {
    let suite = "recovery";
    let systems = distinct(rows, suite, |r| &r.system);
    let cases = distinct(rows, suite, |r| &r.case);
    if systems.is_empty() {
        return Ok(false);
    }
    let series = cases
        .iter()
        .map(|case| {
            let values = systems.iter().map(|s| find(rows, suite, s, "", case, "reopen_ms")).collect();
            (case.replace('_', " "), values)
        })
        .collect();
    let root = BitMapBackend::new(path, (1100, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    draw_bars(
        &root,
        &Bars { title: title.to_string(), y_desc: "reopen + first read (ms)".to_string(), groups: systems, series },
    )?;
    root.present()?;
    Ok(true)
}

/// A scale panel: its title, its unit, and `(legend label, metric)` per curve.
type Panel<'a> = (&'a str, &'a str, Vec<(&'a str, &'a str)>);

fn scale(path: &Path, rows: &[Row], title: &str) -> anyhow::Result<bool> {
    let suite = "scale";
    let keys: Vec<(String, f64)> = distinct(rows, suite, |r| &r.case)
        .into_iter()
        .filter_map(|c| {
            let n: f64 = c.strip_prefix("keys_")?.parse().ok()?;
            Some((c, n))
        })
        .collect();
    if keys.is_empty() {
        return Ok(false);
    }
    // x is log10(keys) on a linear axis, so each power of ten gets one labelled tick.
    let curve = |metric: &str| -> Vec<(f64, f64)> {
        keys.iter().filter_map(|(case, n)| Some((n.log10(), find(rows, suite, "keeldb", "", case, metric)?))).collect()
    };
    let root = BitMapBackend::new(path, (1200, 900)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 24))?;
    let panels = root.split_evenly((2, 2));
    let specs: [Panel<'_>; 4] = [
        ("Memory", "resident bytes per key", vec![("bytes/key", "bytes_per_key")]),
        ("Point read", "ns", vec![("read (one snapshot)", "read_ns")]),
        (
            "One-put commit",
            "µs",
            vec![("sync p50", "commit_p50_us"), ("sync p99", "commit_p99_us"), ("relaxed mean", "commit_us")],
        ),
        (
            "Reopen",
            "ms",
            vec![("after SIGKILL (WAL replay)", "reopen_wal_ms"), ("from checkpoint", "reopen_checkpoint_ms")],
        ),
    ];
    let max_x = keys.iter().map(|(_, n)| n.log10()).fold(0.0, f64::max);
    let min_x = keys.iter().map(|(_, n)| n.log10()).fold(f64::MAX, f64::min);
    for (panel, (name, unit, metrics)) in panels.iter().zip(specs) {
        let series: Vec<(&str, Vec<(f64, f64)>)> = metrics.iter().map(|(label, m)| (*label, curve(m))).collect();
        let Some(y) = log_range(series.iter().flat_map(|(_, p)| p.iter().map(|(_, y)| *y))) else {
            continue;
        };
        let mut chart = ChartBuilder::on(panel)
            .caption(name, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(min_x - 0.3..max_x + 0.3, y.log_scale())?;
        chart
            .configure_mesh()
            .x_desc("keys")
            .y_desc(unit)
            .x_labels((max_x - min_x) as usize + 2)
            .x_label_formatter(&|x| {
                if (x - x.round()).abs() < 1e-6 {
                    short_number(10f64.powf(x.round()))
                } else {
                    String::new()
                }
            })
            .y_label_formatter(&|y| short_number(*y))
            .label_style(("sans-serif", 14))
            .draw()?;
        for (i, (label, points)) in series.iter().enumerate() {
            chart
                .draw_series(LineSeries::new(points.iter().copied(), color(i).stroke_width(3)))?
                .label(*label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color(i).stroke_width(3)));
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color(i).filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font(("sans-serif", 13))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(true)
}

/// 1234 → `1.2k`, 2500000 → `2.5M`, 0.5 → `0.5`.
pub fn short_number(value: f64) -> String {
    let magnitude = value.abs();
    let (scaled, suffix) = if magnitude >= 1e9 {
        (value / 1e9, "G")
    } else if magnitude >= 1e6 {
        (value / 1e6, "M")
    } else if magnitude >= 1e3 {
        (value / 1e3, "k")
    } else {
        (value, "")
    };
    let text = if scaled.abs() >= 100.0 || scaled.fract().abs() < 0.05 {
        format!("{scaled:.0}")
    } else if scaled.abs() >= 10.0 {
        format!("{scaled:.1}")
    } else {
        format!("{scaled:.2}")
    };
    let text = if text.contains('.') { text.trim_end_matches('0').trim_end_matches('.').to_string() } else { text };
    format!("{text}{suffix}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_numbers() {
        assert_eq!(short_number(1_234.0), "1.23k");
        assert_eq!(short_number(2_500_000.0), "2.5M");
        assert_eq!(short_number(140.0), "140");
        assert_eq!(short_number(0.5), "0.5");
        assert_eq!(short_number(10_000.0), "10k");
    }

    #[test]
    fn draws_every_chart_from_a_synthetic_report() {
        if let Err(why) = ensure_font() {
            // Charts are optional output; a machine without fonts says so at run time.
            eprintln!("skipping chart drawing: {why:#}");
            return;
        }
        let mut rows = vec![Row::new("group-commit", "raw-fdatasync", "4k-append", "single", "commits_per_s", 5e3)];
        for (i, system) in ["keeldb", "sqlite"].iter().enumerate() {
            let k = (i + 1) as f64;
            for writers in [1u32, 8, 64] {
                let case = format!("writers_{writers}");
                for (metric, value) in
                    [("commits_per_s", 4e3 * k * f64::from(writers)), ("p50_us", 200.0), ("p99_us", 900.0)]
                {
                    rows.push(Row::new("group-commit", system, "sync", &case, metric, value));
                }
            }
            for mode in ["sync", "periodic", "relaxed"] {
                rows.push(Row::new("durability", system, mode, "create", "avg_us", 10.0 * k));
            }
            rows.push(Row::new("sqlite-compare", system, "sync", "read", "avg_us", k));
            rows.push(Row::new("mvcc", system, "relaxed", "keys_1000000", "read_ns", 500.0 * k));
            for case in ["wal_300000", "checkpoint_300000"] {
                rows.push(Row::new("recovery", system, "relaxed", case, "reopen_ms", 100.0 * k));
            }
        }
        for n in [10_000u64, 100_000, 1_000_000] {
            let case = format!("keys_{n}");
            for metric in ["bytes_per_key", "read_ns", "commit_us", "reopen_wal_ms", "reopen_checkpoint_ms"] {
                rows.push(Row::new("scale", "keeldb", "relaxed", &case, metric, n as f64 / 1e3));
            }
            rows.push(Row::new("scale", "keeldb", "sync", &case, "commit_p50_us", 300.0));
        }
        let report = Report::new(
            crate::report::Machine { cpus: 2, os: "linux".into(), filesystem: "ext4".into(), fdatasync_us_p50: 200.0 },
            rows,
        );
        let dir = tempfile::tempdir().unwrap();
        let charts = write_all(dir.path(), &report).unwrap();
        assert_eq!(charts.len(), 7, "{charts:?}");
        for chart in &charts {
            let bytes = std::fs::read(dir.path().join(&chart.file)).unwrap();
            assert!(bytes.starts_with(b"\x89PNG"), "{} is not a PNG", chart.file);
        }
    }

    #[test]
    fn log_range_covers_values() {
        let range = log_range([3.0, 4_500.0].into_iter()).unwrap();
        assert!(range.start <= 3.0 && range.end >= 4_500.0);
        assert!(log_range([0.0, f64::NAN].into_iter()).is_none());
    }
}
