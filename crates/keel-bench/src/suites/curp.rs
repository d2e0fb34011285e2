//! The `curp` suite (opt-in: `keel bench --suite curp`): seed 002's workload on three local
//! members, fsync on, side by side in one run: keel through the CURP client (fast path), keel
//! through etcd's API (plain Raft, the fast path unused) and etcd 3.6 through etcd's API. The
//! load is `keel cluster load` (this executable): 60 operations in flight, 10 % writes of
//! 100-byte values, the rest reads, half of all operations weak (causal), keys drawn Zipf 0.99
//! over 1M keys. keel-curp runs weak operations at each client's bound replica (spread over the
//! members); through etcd's API (keel-raft, etcd 3.6) a weak read is a serializable read and a
//! weak write an ordinary put, the nearest those have. Each system runs several timed runs; the
//! figures are the mean and the spread over the runs (never the best one), with the strong and
//! weak p50/p99 of the median run, the share of strong writes that completed on the fast
//! path, and the CPU per operation of the members and of the load. The 60 tasks share one
//! HTTP/2 connection per member (etcd's `benchmark` with `--conns`), each task its own CURP
//! session. A shorter run of the same mix without its writes gives each system's ceiling on
//! this machine: what its reads alone reach.
//!
//! Then strong writes across emulated distance (1 ms and 10 ms round trips between every two
//! parties, members and client, made by delay proxies in front of every member): one client's
//! write p50 in round trips, for the fast path, plain Raft and etcd 3.6.

use std::process::{Child, Command};
use std::time::Duration;

use anyhow::{bail, Context};

use super::cluster::{self, System};
use crate::report::Row;
use crate::{Scale, SuiteContext};

const SUITE: &str = "curp";

/// One run's figures, from the `key=value` line `keel cluster load` prints.
#[derive(Debug, Default, Clone, PartialEq)]
struct Figures {
    ops_per_s: f64,
    writes: f64,
    fast: f64,
    errors: f64,
    write_p50_ms: f64,
    write_p99_ms: f64,
    read_p50_ms: f64,
    read_p99_ms: f64,
    strong_p50_ms: f64,
    strong_p99_ms: f64,
    weak_p50_ms: f64,
    weak_p99_ms: f64,
    weak_write_p50_ms: f64,
    weak_read_p50_ms: f64,
    rtt_measured_ms: f64,
}

fn parse(line: &str) -> Figures {
    let mut f = Figures::default();
    for (k, v) in line.split_whitespace().filter_map(|w| w.split_once('=')) {
        let v: f64 = v.parse().unwrap_or(0.0);
        match k {
            "ops_per_s" => f.ops_per_s = v,
            "writes" => f.writes = v,
            "fast" => f.fast = v,
            "errors" => f.errors = v,
            "write_p50_ms" => f.write_p50_ms = v,
            "write_p99_ms" => f.write_p99_ms = v,
            "read_p50_ms" => f.read_p50_ms = v,
            "read_p99_ms" => f.read_p99_ms = v,
            "strong_p50_ms" => f.strong_p50_ms = v,
            "strong_p99_ms" => f.strong_p99_ms = v,
            "weak_p50_ms" => f.weak_p50_ms = v,
            "weak_p99_ms" => f.weak_p99_ms = v,
            "weak_write_p50_ms" => f.weak_write_p50_ms = v,
            "weak_read_p50_ms" => f.weak_read_p50_ms = v,
            "rtt_measured_ms" => f.rtt_measured_ms = v,
            _ => {}
        }
    }
    f
}

/// (runs, seconds per run) by scale: the issue asks at least 5 runs of 60 s.
fn plan(scale: Scale) -> (usize, u64) {
    match scale {
        Scale::Full => (5, 60),
        Scale::Quick => (2, 10),
        Scale::Tiny => (1, 2),
    }
}

/// Runs the workload against each system.
pub fn run(context: &SuiteContext) -> anyhow::Result<Vec<Row>> {
    let tools = cluster::tools_dir(context);
    let etcdctl = tools.join("etcdctl");
    if !etcdctl.exists() {
        bail!("the curp suite needs etcdctl in {} (run scripts/go-tools)", tools.display());
    }
    let Some(keel) = context.child_command.first().cloned() else { bail!("no keel executable to run the load") };
    let (runs, secs) = plan(context.scale);
    // keel twice (CURP client, etcd API), then etcd 3.6 if it is there; not etcd 3.4.
    let mut drives: Vec<(String, &str, System)> = Vec::new();
    for system in cluster::systems(context, &tools) {
        match system.name {
            "keel" => {
                let again = System { name: "keel", program: system.program.clone(), leading: system.leading.clone() };
                drives.push(("keel-curp".into(), "curp", system));
                drives.push(("keel-raft".into(), "etcd", again));
            }
            "etcd-3.6" => drives.push(("etcd-3.6".into(), "etcd", system)),
            _ => {}
        }
    }
    let mut rows = Vec::new();
    for (n, (name, mode, system)) in drives.iter().enumerate() {
        let c = cluster::start(context, system, 25000 + 100 * n as u16, &etcdctl)?;
        context.progress.line(SUITE, format!("{name}: 3 members up on {}", c.endpoints.join(",")));
        let pids: Vec<u32> = c.children.iter().map(Child::id).collect();
        let mut all = Vec::new();
        let mut cpu = Vec::new();
        for r in 0..runs {
            let (f, server_us, load_us) =
                load_run(&keel, &c, &pids, mode, 10, secs, r as u64 + 1).with_context(|| format!("load on {name}"))?;
            context.progress.line(
                SUITE,
                format!(
                    "{name} run {}: {:.0} ops/s, strong p50 {:.2} ms p99 {:.2} ms (write p50 {:.2}, read p50 {:.2}), weak p50 {:.2} ms p99 {:.2} ms (write p50 {:.2}, read p50 {:.2}), fast {:.0}/{:.0}, errors {:.0}, CPU per op {server_us:.0} µs members + {load_us:.0} µs load",
                    r + 1, f.ops_per_s, f.strong_p50_ms, f.strong_p99_ms, f.write_p50_ms, f.read_p50_ms, f.weak_p50_ms, f.weak_p99_ms,
                    f.weak_write_p50_ms, f.weak_read_p50_ms, f.fast, f.writes, f.errors
                ),
            );
            cpu.push((server_us, load_us));
            all.push(f);
            std::thread::sleep(Duration::from_millis(500));
        }
        // The same mix without its writes: what reads alone reach on this machine, a ceiling
        // for the whole mix.
        let (ceiling, ceiling_server_us, ceiling_load_us) = load_run(&keel, &c, &pids, mode, 0, (secs / 4).max(1), 99)
            .with_context(|| format!("reads-only load on {name}"))?;
        context.progress.line(
            SUITE,
            format!(
                "{name} reads only: {:.0} ops/s, CPU per op {ceiling_server_us:.0} µs members + {ceiling_load_us:.0} µs load",
                ceiling.ops_per_s
            ),
        );
        drop(c);
        let mean = all.iter().map(|f| f.ops_per_s).sum::<f64>() / all.len() as f64;
        let min = all.iter().map(|f| f.ops_per_s).fold(f64::MAX, f64::min);
        let max = all.iter().map(|f| f.ops_per_s).fold(0.0, f64::max);
        let mut by_rate = all.clone();
        by_rate.sort_by(|a, b| a.ops_per_s.total_cmp(&b.ops_per_s));
        let median = by_rate[by_rate.len() / 2].clone();
        let writes: f64 = all.iter().map(|f| f.writes).sum();
        let fast: f64 = all.iter().map(|f| f.fast).sum();
        let case = "zipf099_w10_weak50_c60";
        let row = |metric: &str, v: f64| Row::new(SUITE, name, "fsync", case, metric, v);
        rows.push(row("ops_per_s_mean", mean));
        rows.push(row("ops_per_s_min", min));
        rows.push(row("ops_per_s_max", max));
        rows.push(row("write_p50_us", median.write_p50_ms * 1000.0));
        rows.push(row("write_p99_us", median.write_p99_ms * 1000.0));
        rows.push(row("read_p50_us", median.read_p50_ms * 1000.0));
        rows.push(row("read_p99_us", median.read_p99_ms * 1000.0));
        rows.push(row("strong_p50_us", median.strong_p50_ms * 1000.0));
        rows.push(row("strong_p99_us", median.strong_p99_ms * 1000.0));
        rows.push(row("weak_p50_us", median.weak_p50_ms * 1000.0));
        rows.push(row("weak_p99_us", median.weak_p99_ms * 1000.0));
        rows.push(row("weak_write_p50_us", median.weak_write_p50_ms * 1000.0));
        rows.push(row("weak_read_p50_us", median.weak_read_p50_ms * 1000.0));
        rows.push(row("fast_path_share", if writes > 0.0 { fast / writes } else { 0.0 }));
        rows.push(row("errors", all.iter().map(|f| f.errors).sum()));
        let n = cpu.len().max(1) as f64;
        rows.push(row("server_cpu_us_per_op", cpu.iter().map(|c| c.0).sum::<f64>() / n));
        rows.push(row("load_cpu_us_per_op", cpu.iter().map(|c| c.1).sum::<f64>() / n));
        let reads = |metric: &str, v: f64| Row::new(SUITE, name, "fsync", "zipf099_w0_weak50_c60", metric, v);
        rows.push(reads("ops_per_s_mean", ceiling.ops_per_s));
        rows.push(reads("server_cpu_us_per_op", ceiling_server_us));
        rows.push(reads("load_cpu_us_per_op", ceiling_load_us));
    }
    rows.extend(distance(context, &keel, &etcdctl, &drives)?);
    Ok(rows)
}

/// One timed run of seed 002's mix with `write_percent` writes (half of all operations weak,
/// 60 in flight over one connection per member): its figures, and the CPU per operation of
/// the members and of the load process (reaped when the run ends, so its time shows in this
/// process's children's; the members are reaped only when they stop).
fn load_run(
    keel: &str,
    c: &cluster::Cluster,
    pids: &[u32],
    mode: &str,
    write_percent: u32,
    secs: u64,
    seed: u64,
) -> anyhow::Result<(Figures, f64, f64)> {
    let cpu0: f64 = pids.iter().map(|p| cluster::cpu_seconds(*p)).sum();
    let load0 = cluster::children_cpu_seconds();
    let out = Command::new(keel)
        .args(["cluster", &format!("--endpoints={}", c.endpoints.join(",")), "load"])
        .args([&format!("--mode={mode}"), "--clients=60", "--conns=1", &format!("--write-percent={write_percent}")])
        .args(["--weak-percent=50", "--keys=1000000", "--zipf=0.99", "--value-size=100"])
        .args([format!("--duration={secs}s"), format!("--seed={seed}")])
        .output()
        .context("running keel cluster load")?;
    let load1 = cluster::children_cpu_seconds();
    let cpu1: f64 = pids.iter().map(|p| cluster::cpu_seconds(*p)).sum();
    let text = String::from_utf8_lossy(&out.stdout);
    let f = parse(text.lines().last().unwrap_or(""));
    if !out.status.success() || f.ops_per_s <= 0.0 {
        bail!("{}", String::from_utf8_lossy(&out.stderr));
    }
    let ops = (f.ops_per_s * secs as f64).max(1.0);
    Ok((f, (cpu1 - cpu0) * 1e6 / ops, (load1 - load0) * 1e6 / ops))
}

/// Strong writes across emulated distance: one client, writes only (Zipf over 1M keys, so
/// almost never conflicting), with every round trip (client to member, member to member) made
/// `rtt` longer by delay proxies in front of every member's advertised client and peer URLs
/// (`delay_proxy`: bytes held `rtt / 2` each way, the same for keel and etcd). The write p50 is
/// given in set round trips and in measured ones (the p50 of a serializable read of a missing key
/// at the leader through the same proxies, the smallest call there is), for keel through the CURP
/// client, keel through etcd's API and etcd 3.6, all to the leader (no follower forwarding on
/// the way).
fn distance(
    context: &SuiteContext,
    keel: &str,
    etcdctl: &std::path::Path,
    systems: &[(String, &str, System)],
) -> anyhow::Result<Vec<Row>> {
    let secs = match context.scale {
        Scale::Full => 20,
        Scale::Quick => 5,
        Scale::Tiny => 2,
    };
    let mut rows = Vec::new();
    for (n, rtt) in [1u64, 10].into_iter().enumerate() {
        let mut port = 25500 + 200 * n as u16;
        for (name, mode, system) in systems {
            let c = cluster::start_distant(context, system, port, etcdctl, Duration::from_millis(rtt))?;
            port += 50;
            let out = Command::new(keel)
                .args(["cluster", &format!("--endpoints={}", c.endpoints.join(",")), "load"])
                .args([&format!("--mode={mode}"), "--clients=1", "--write-percent=100", "--keys=1000000"])
                .args(["--zipf=0.99", "--value-size=100", &format!("--duration={secs}s")])
                .args(["--leader-only", "--measure-rtt"])
                .output()
                .context("running keel cluster load")?;
            drop(c);
            let f = parse(String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or(""));
            if !out.status.success() || f.writes <= 0.0 {
                bail!("distance load ({name}, {rtt} ms) failed: {}", String::from_utf8_lossy(&out.stderr));
            }
            let measured = f.rtt_measured_ms.max(1e-9);
            context.progress.line(
                SUITE,
                format!(
                    "{name} at {rtt} ms round trips (measured {:.2} ms): write p50 {:.2} ms = {:.2} set / {:.2} measured round trips, p99 {:.2} ms, fast {:.0}/{:.0}",
                    f.rtt_measured_ms,
                    f.write_p50_ms,
                    f.write_p50_ms / rtt as f64,
                    f.write_p50_ms / measured,
                    f.write_p99_ms,
                    f.fast,
                    f.writes
                ),
            );
            let case = format!("write_rtt_{rtt}ms_c1");
            let row = |metric: &str, v: f64| Row::new(SUITE, name, "fsync", &case, metric, v);
            rows.push(row("write_p50_us", f.write_p50_ms * 1000.0));
            rows.push(row("write_p99_us", f.write_p99_ms * 1000.0));
            rows.push(row("write_p50_round_trips", f.write_p50_ms / rtt as f64));
            rows.push(row("rtt_measured_us", f.rtt_measured_ms * 1000.0));
            rows.push(row("write_p50_measured_round_trips", f.write_p50_ms / measured));
            rows.push(row("fast_path_share", if f.writes > 0.0 { f.fast / f.writes } else { 0.0 }));
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_load_line() {
        let f = parse("ops_per_s=1234 ops=5 writes=10 fast=9 errors=1 write_p50_ms=0.5 write_p99_ms=2.25 read_p50_ms=0.4 read_p99_ms=1.5");
        assert_eq!(f.ops_per_s, 1234.0);
        assert_eq!((f.writes, f.fast, f.errors), (10.0, 9.0, 1.0));
        assert_eq!((f.write_p50_ms, f.write_p99_ms, f.read_p50_ms, f.read_p99_ms), (0.5, 2.25, 0.4, 1.5));
        let g = parse("strong_p50_ms=1.5 strong_p99_ms=3 weak_p50_ms=0.25 weak_p99_ms=2 weak_write_p50_ms=0.2 weak_read_p50_ms=0.3");
        assert_eq!((g.strong_p50_ms, g.strong_p99_ms, g.weak_p50_ms, g.weak_p99_ms), (1.5, 3.0, 0.25, 2.0));
        assert_eq!((g.weak_write_p50_ms, g.weak_read_p50_ms), (0.2, 0.3));
        assert_eq!(parse("garbage"), Figures::default());
    }
}
