//! The `cluster` suite (opt-in: `keel bench --suite cluster`): three local members of each
//! system, fsync on, started the same way on the same disk, driven by etcd's own `benchmark`
//! tool, side by side in one run: `keel serve` (this executable), etcd 3.6 (built by
//! `scripts/go-tools`) and etcd 3.4 (Debian's `etcd-server`, `/usr/bin/etcd`).
//!
//! Cases: put at 1, 16, 64 and 256 clients (100-byte values, 1M-key space), linearizable and
//! serializable range of one key at 64 clients, txn-put at 64 clients. Figures: requests per
//! second, p50 and p99 latency as the tool reports them, and server CPU per operation (user +
//! system time of the three server processes over the case, from /proc).
//!
//! Tools are found in `KEEL_TOOLS` (default: `.tools/bin` of the checkout holding this
//! executable); a system whose binary is missing is skipped with a note on stderr.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::report::Row;
use crate::{Scale, SuiteContext};

const SUITE: &str = "cluster";
const MEMBERS: usize = 3;

/// One system under test: how to start a member.
pub(super) struct System {
    pub(super) name: &'static str,
    pub(super) program: PathBuf,
    pub(super) leading: Vec<String>,
}

/// The directory holding the pinned Go tools.
pub(super) fn tools_dir(context: &SuiteContext) -> PathBuf {
    if let Ok(dir) = std::env::var("KEEL_TOOLS") {
        return PathBuf::from(dir);
    }
    let exe = PathBuf::from(context.child_command.first().cloned().unwrap_or_default());
    // target/<profile>/keel → <checkout>/.tools/bin
    exe.ancestors().nth(3).map(|root| root.join(".tools/bin")).unwrap_or_else(|| PathBuf::from(".tools/bin"))
}

pub(super) fn systems(context: &SuiteContext, tools: &Path) -> Vec<System> {
    let mut out = Vec::new();
    if let Some(keel) = context.child_command.first() {
        out.push(System { name: "keel", program: PathBuf::from(keel), leading: vec!["serve".into()] });
    }
    let etcd36 = tools.join("etcd");
    if etcd36.exists() {
        out.push(System { name: "etcd-3.6", program: etcd36, leading: Vec::new() });
    } else {
        context
            .progress
            .line(SUITE, format!("note: {} missing (run scripts/go-tools): etcd 3.6 skipped", etcd36.display()));
    }
    let etcd34 = PathBuf::from(std::env::var("KEEL_ETCD34").unwrap_or_else(|_| "/usr/bin/etcd".into()));
    if etcd34.exists() {
        out.push(System { name: "etcd-3.4", program: etcd34, leading: Vec::new() });
    } else {
        context.progress.line(SUITE, "note: /usr/bin/etcd missing (apt-get install etcd-server): etcd 3.4 skipped");
    }
    out
}

/// A running three-member cluster; killed and its directory removed on drop.
pub(super) struct Cluster {
    pub(super) children: Vec<Child>,
    pub(super) endpoints: Vec<String>,
    _dir: tempfile::TempDir,
    _proxies: Vec<super::delay_proxy::DelayProxy>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub(super) fn start(
    context: &SuiteContext,
    system: &System,
    base_port: u16,
    etcdctl: &Path,
) -> anyhow::Result<Cluster> {
    start_with(context, system, base_port, etcdctl, None)
}

/// [`start`] behind delay proxies: every member advertises client and peer URLs of a proxy
/// (ports `base_port + 10 ..`) that holds bytes `rtt / 2` each way, so every client call and
/// every peer message and its answer take `rtt` more, whatever the system.
pub(super) fn start_distant(
    context: &SuiteContext,
    system: &System,
    base_port: u16,
    etcdctl: &Path,
    rtt: Duration,
) -> anyhow::Result<Cluster> {
    start_with(context, system, base_port, etcdctl, Some(rtt))
}

fn start_with(
    context: &SuiteContext,
    system: &System,
    base_port: u16,
    etcdctl: &Path,
    rtt: Option<Duration>,
) -> anyhow::Result<Cluster> {
    let dir = context.temp_dir(&format!("cluster-{}", system.name))?;
    let port = |i: usize, peer: bool| base_port + 2 * i as u16 + u16::from(peer);
    let shown = |i: usize, peer: bool| port(i, peer) + if rtt.is_some() { 10 } else { 0 };
    let url = |p: u16| format!("http://127.0.0.1:{p}");
    let mut proxies = Vec::new();
    if let Some(rtt) = rtt {
        for i in 0..MEMBERS {
            for peer in [false, true] {
                let listen = std::net::SocketAddr::from(([127, 0, 0, 1], shown(i, peer)));
                let upstream = std::net::SocketAddr::from(([127, 0, 0, 1], port(i, peer)));
                proxies.push(super::delay_proxy::DelayProxy::start(listen, upstream, rtt / 2)?);
            }
        }
    }
    let peer = |i: usize| url(port(i, true));
    let client = |i: usize| url(port(i, false));
    let initial: Vec<String> = (0..MEMBERS).map(|i| format!("m{i}={}", url(shown(i, true)))).collect();
    let mut children = Vec::new();
    for i in 0..MEMBERS {
        let log = std::fs::File::create(dir.path().join(format!("m{i}.log")))?;
        let child = Command::new(&system.program)
            .args(&system.leading)
            .arg(format!("--name=m{i}"))
            .arg(format!("--data-dir={}", dir.path().join(format!("m{i}")).display()))
            .arg(format!("--listen-client-urls={}", client(i)))
            .arg(format!("--advertise-client-urls={}", url(shown(i, false))))
            .arg(format!("--listen-peer-urls={}", peer(i)))
            .arg(format!("--initial-advertise-peer-urls={}", url(shown(i, true))))
            .arg(format!("--initial-cluster={}", initial.join(",")))
            .arg("--initial-cluster-token=keel-bench")
            .arg("--initial-cluster-state=new")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", system.program.display()))?;
        children.push(child);
    }
    let endpoints: Vec<String> = (0..MEMBERS).map(|i| url(shown(i, false))).collect();
    let cluster = Cluster { children, endpoints, _dir: dir, _proxies: proxies };
    // Ready when a linearizable write succeeds through every member.
    let deadline = Instant::now() + Duration::from_secs(30);
    for ep in &cluster.endpoints {
        loop {
            let ok = Command::new(etcdctl)
                .args([&format!("--endpoints={ep}"), "--command-timeout=2s", "put", "keel-bench-ready", "1"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if ok {
                break;
            }
            if Instant::now() > deadline {
                bail!("{} cluster did not become ready within 30 s (logs in its temp dir)", system.name);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    Ok(cluster)
}

/// User + system CPU seconds of a process so far, from /proc/PID/stat.
pub(super) fn cpu_seconds(pid: u32) -> f64 {
    // After the command name: state is field 0, utime 11, stime 12.
    stat_seconds(&format!("/proc/{pid}/stat"), [11, 12])
}

/// CPU seconds (user + system) of this process's reaped children: cutime and cstime.
pub(super) fn children_cpu_seconds() -> f64 {
    stat_seconds("/proc/self/stat", [13, 14])
}

/// The sum of two clock-tick fields of a `/proc/.../stat` file, counted from the field after
/// the command name, in seconds (USER_HZ is 100 on Linux); 0 when it cannot be read.
fn stat_seconds(path: &str, fields: [usize; 2]) -> f64 {
    let Ok(stat) = std::fs::read_to_string(path) else { return 0.0 };
    let Some(after) = stat.rsplit_once(')').map(|(_, r)| r) else { return 0.0 };
    let values: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| values.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    fields.into_iter().map(ticks).sum::<f64>() / 100.0
}

/// What the benchmark tool printed that we keep.
#[derive(Debug, Default, PartialEq)]
struct Summary {
    requests_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    total: f64,
}

/// Parses the `benchmark` tool's summary (`Requests/sec:`, `Total:`, `50% in 0.0012 secs`).
fn parse_summary(text: &str) -> Summary {
    let mut s = Summary::default();
    for line in text.lines().map(str::trim) {
        let num = |l: &str| l.split_whitespace().find_map(|w| w.parse::<f64>().ok()).unwrap_or(0.0);
        if let Some(rest) = line.strip_prefix("Requests/sec:") {
            s.requests_per_s = num(rest);
        } else if let Some(rest) = line.strip_prefix("Total:") {
            s.total = num(rest);
        } else if let Some(rest) = line.strip_prefix("50% in ") {
            s.p50_ms = num(rest) * 1000.0;
        } else if let Some(rest) = line.strip_prefix("99% in ") {
            s.p99_ms = num(rest) * 1000.0;
        }
    }
    s
}

struct Case {
    name: String,
    clients: usize,
    total: usize,
    args: Vec<String>,
}

fn cases(scale: Scale) -> Vec<Case> {
    let per_client = |c: usize| match scale {
        Scale::Full => (c * 400).clamp(4_000, 100_000),
        Scale::Quick => (c * 50).clamp(500, 10_000),
        Scale::Tiny => 50,
    };
    let mut out = Vec::new();
    let put = |c: usize| Case {
        name: format!("put_clients_{c}"),
        clients: c,
        total: per_client(c),
        args: ["put", "--key-size=8", "--val-size=100", "--key-space-size=1000000"].map(String::from).to_vec(),
    };
    for c in [1, 16, 64, 256] {
        out.push(put(c));
    }
    for (label, consistency) in [("linearizable", "l"), ("serializable", "s")] {
        out.push(Case {
            name: format!("range_{label}_clients_64"),
            clients: 64,
            total: per_client(64) * 2,
            args: vec!["range".into(), "keel-bench-ready".into(), format!("--consistency={consistency}")],
        });
    }
    out.push(Case {
        name: "txn_put_clients_64".into(),
        clients: 64,
        total: per_client(64),
        args: ["txn-put", "--key-size=8", "--val-size=100", "--key-space-size=1000000"].map(String::from).to_vec(),
    });
    out
}

/// Runs every case against every system found.
pub fn run(context: &SuiteContext) -> anyhow::Result<Vec<Row>> {
    let tools = tools_dir(context);
    let benchmark = tools.join("benchmark");
    let etcdctl = tools.join("etcdctl");
    if !benchmark.exists() || !etcdctl.exists() {
        bail!("the cluster suite needs etcd's benchmark and etcdctl in {} (run scripts/go-tools)", tools.display());
    }
    let mut rows = Vec::new();
    for (n, system) in systems(context, &tools).iter().enumerate() {
        let cluster = start(context, system, 24000 + 100 * n as u16, &etcdctl)?;
        context.progress.line(SUITE, format!("{}: 3 members up on {}", system.name, cluster.endpoints.join(",")));
        for case in cases(context.scale) {
            let pids: Vec<u32> = cluster.children.iter().map(Child::id).collect();
            let cpu0: f64 = pids.iter().map(|p| cpu_seconds(*p)).sum();
            let out = Command::new(&benchmark)
                .arg(format!("--endpoints={}", cluster.endpoints.join(",")))
                .arg(format!("--conns={}", case.clients.min(64)))
                .arg(format!("--clients={}", case.clients))
                .args(&case.args)
                .arg(format!("--total={}", case.total))
                .output()
                .context("running etcd's benchmark tool")?;
            let cpu1: f64 = pids.iter().map(|p| cpu_seconds(*p)).sum();
            let text = String::from_utf8_lossy(&out.stdout);
            let s = parse_summary(&text);
            if !out.status.success() || s.requests_per_s <= 0.0 {
                bail!("benchmark {} on {} failed: {}", case.name, system.name, String::from_utf8_lossy(&out.stderr));
            }
            let cpu_us = (cpu1 - cpu0) * 1e6 / case.total as f64;
            context.progress.line(
                SUITE,
                format!(
                    "{} {}: {:.0} req/s, p50 {:.2} ms, p99 {:.2} ms, {:.0} µs server CPU/op",
                    system.name, case.name, s.requests_per_s, s.p50_ms, s.p99_ms, cpu_us
                ),
            );
            let row = |metric: &str, v: f64| Row::new(SUITE, system.name, "fsync", &case.name, metric, v);
            rows.push(row("requests_per_s", s.requests_per_s));
            rows.push(row("p50_us", s.p50_ms * 1000.0));
            rows.push(row("p99_us", s.p99_ms * 1000.0));
            rows.push(row("server_cpu_us_per_op", cpu_us));
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_benchmark_tools_summary() {
        let text = "\nSummary:\n  Total:\t2.5 secs.\n  Slowest:\t0.01 secs.\n  Requests/sec:\t4000.5\n\nLatency distribution:\n  10% in 0.0005 secs.\n  50% in 0.0012 secs.\n  99% in 0.0040 secs.\n";
        let s = parse_summary(text);
        assert_eq!(s.requests_per_s, 4000.5);
        assert!((s.p50_ms - 1.2).abs() < 1e-9 && (s.p99_ms - 4.0).abs() < 1e-9);
        assert_eq!(s.total, 2.5);
        assert_eq!(parse_summary("garbage"), Summary::default());
    }
}
