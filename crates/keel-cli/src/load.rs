//! `keel cluster load`: seed 002's workload against a cluster, through the CURP client (fast
//! path) or etcd's API (plain Raft; also drives etcd itself), for `keel bench --suite curp`.
//!
//! A fixed number of operations are in flight at all times (one per task); each picks a key
//! from a Zipf distribution over the key space and is a write (`Put` of a value of the given
//! size) with the given probability, else a linearizable read (`Range` of the key). With
//! `--weak-percent`, that share of operations is weak (seed 002's CURP-HO): through the CURP
//! client a weak write or a weak read at the task's bound replica (tasks are spread over the
//! members); through etcd's API, where nothing is weaker than a serializable read, a weak read
//! is a serializable `Range` and a weak write an ordinary `Put`. It prints one line of
//! `key=value` figures, parsed by the bench suite.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_curp::client::{Client as CurpClient, EtcdKv};
use keel_curp::etcd::PutRequest as PbPutRequest;
use rand::{Rng, SeedableRng};

/// Which client drives the writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Writes through the CURP client (one round trip when the fast path holds).
    Curp,
    /// Writes through etcd's KV API (Raft: commit, then answer).
    Etcd,
}

/// The workload's shape.
#[derive(Debug, Clone, clap::Args)]
pub struct LoadArgs {
    /// curp or etcd.
    #[arg(long, value_enum, default_value = "curp")]
    pub mode: Mode,
    /// Operations in flight.
    #[arg(long, default_value_t = 60)]
    pub clients: usize,
    /// How long to run (etcd-style: 500ms, 30s, 1m).
    #[arg(long, default_value = "10s", value_parser = crate::serve::parse_duration)]
    pub duration: Duration,
    /// Percent of operations that are writes.
    #[arg(long, default_value_t = 10)]
    pub write_percent: u32,
    /// Percent of operations (reads and writes alike) that are weak (causal).
    #[arg(long, default_value_t = 0)]
    pub weak_percent: u32,
    /// Keys drawn from (Zipf over key0 .. keyN-1).
    #[arg(long, default_value_t = 1_000_000)]
    pub keys: usize,
    /// Zipf exponent (0: uniform).
    #[arg(long, default_value_t = 0.99)]
    pub zipf: f64,
    /// Bytes per written value.
    #[arg(long, default_value_t = 100)]
    pub value_size: usize,
    /// Seed of the key and operation draws.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Emulated round trip to every member, in ms (0: none): each call waits half of it before
    /// it is sent and half after its answer (calls made together overlap). Start the members
    /// with KEEL_EMULATED_PEER_DELAY_MS set to half of it to put the same distance between them.
    #[arg(long, default_value_t = 0.0)]
    pub rtt_ms: f64,
    /// HTTP/2 connections to each member, shared by the tasks (0: one per task, as before).
    /// Tasks are spread over the connections; through the CURP client each task is still a
    /// session of its own. etcd's `benchmark` calls these `--conns` and `--clients`.
    #[arg(long, default_value_t = 0)]
    pub conns: usize,
    /// Send etcd API calls to the leader only (the CURP client always proposes to the leader),
    /// so a write is not forwarded by a follower on the way.
    #[arg(long)]
    pub leader_only: bool,
    /// Measure one round trip before the run (the p50 of 21 serializable reads of a missing key
    /// through the etcd endpoints, with --rtt-ms's emulation) and print it as rtt_measured_ms.
    #[arg(long)]
    pub measure_rtt: bool,
}

/// Waits `d` (emulated distance); nothing at all when it is zero (tokio's timer would still
/// round a zero wait up to its next millisecond tick).
async fn wait(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

/// The client URL of the member that leads, asked of each endpoint in turn.
async fn leader_endpoint(endpoints: &[String]) -> anyhow::Result<String> {
    for url in endpoints {
        let Ok(mut c) = etcd_client::Client::connect([url.as_str()], None).await else { continue };
        let Ok(status) = c.status().await else { continue };
        if status.leader() == status.header().map_or(0, |h| h.member_id()) {
            return Ok(url.clone());
        }
    }
    anyhow::bail!("no endpoint says it leads")
}

/// Draws ranks 0..n with probability proportional to 1 / (rank + 1)^s (inverse CDF).
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    pub fn new(n: usize, s: f64) -> Zipf {
        let mut cdf = Vec::with_capacity(n.max(1));
        let mut sum = 0.0;
        for k in 0..n.max(1) {
            sum += 1.0 / ((k + 1) as f64).powf(s);
            cdf.push(sum);
        }
        for c in &mut cdf {
            *c /= sum;
        }
        Zipf { cdf }
    }

    pub fn sample(&self, rng: &mut impl Rng) -> usize {
        let u: f64 = rng.gen();
        self.cdf.partition_point(|c| *c < u).min(self.cdf.len() - 1)
    }
}

#[derive(Default)]
struct Tally {
    /// Strong writes and reads.
    writes: Vec<u32>,
    reads: Vec<u32>,
    weak_writes: Vec<u32>,
    weak_reads: Vec<u32>,
    fast: u64,
    errors: u64,
}

impl Tally {
    fn extend(&mut self, t: Tally) {
        self.writes.extend(t.writes);
        self.reads.extend(t.reads);
        self.weak_writes.extend(t.weak_writes);
        self.weak_reads.extend(t.weak_reads);
        self.fast += t.fast;
        self.errors += t.errors;
    }
}

fn sorted(parts: &[&Vec<u32>]) -> Vec<u32> {
    let mut all: Vec<u32> = parts.iter().flat_map(|p| p.iter().copied()).collect();
    all.sort_unstable();
    all
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).or(sorted.last()).map_or(0.0, |us| f64::from(*us) / 1000.0)
}

/// Runs the workload; prints `ops_per_s=... write_p50_ms=... ...` and returns it.
pub async fn run(endpoints: &[String], args: &LoadArgs) -> anyhow::Result<String> {
    anyhow::ensure!(args.clients > 0, "--clients must be at least 1");
    anyhow::ensure!(args.write_percent <= 100, "--write-percent is at most 100");
    anyhow::ensure!(args.weak_percent <= 100, "--weak-percent is at most 100");
    anyhow::ensure!(args.keys > 0, "--keys must be at least 1");
    anyhow::ensure!(args.rtt_ms >= 0.0 && args.rtt_ms < 10_000.0, "--rtt-ms must be between 0 and 10000");
    let rtt = Duration::from_secs_f64(args.rtt_ms / 1000.0);
    let half = rtt / 2;
    let zipf = Arc::new(Zipf::new(args.keys, args.zipf));
    let value = vec![b'v'; args.value_size];
    let stop = Arc::new(AtomicBool::new(false));
    let etcd_endpoints = if args.leader_only { vec![leader_endpoint(endpoints).await?] } else { endpoints.to_vec() };
    anyhow::ensure!(!etcd_endpoints.is_empty(), "no endpoints given");
    let endpoint = |i: usize| etcd_endpoints.get(i % etcd_endpoints.len()).map_or("", String::as_str);
    // With emulated distance, what one round trip really takes here (the timer rounds each wait
    // up): the p50 of serializable reads of a missing key, which no member forwards.
    let rtt_measured_ms = if rtt.is_zero() && !args.measure_rtt {
        0.0
    } else {
        let etcd = EtcdKv::connect(endpoint(0), Duration::from_secs(5))?;
        let mut pings = Vec::new();
        for _ in 0..21 {
            let start = Instant::now();
            wait(half).await;
            etcd.get(b"keel-load-ping".to_vec(), true).await?;
            wait(half).await;
            pings.push(start.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
        }
        pings.sort_unstable();
        percentile(&pings, 0.5)
    };
    // Tasks are spread over the endpoints (as etcd's benchmark spreads its clients); each uses
    // connection (t / endpoints) % conns of its endpoint, or one of its own with --conns=0.
    let n = etcd_endpoints.len();
    let conns = if args.conns == 0 { args.clients.div_ceil(n) } else { args.conns };
    let mut etcd_pool = Vec::new();
    for t in 0..n * conns {
        etcd_pool.push(EtcdKv::connect(endpoint(t), Duration::from_secs(5))?);
    }
    let mut curp_pool = Vec::new();
    // A CURP client holds a connection to every member: with --conns=0 each task has its own.
    let curp_conns = if args.conns == 0 { args.clients } else { args.conns };
    if args.mode == Mode::Curp {
        for _ in 0..curp_conns {
            curp_pool.push(CurpClient::connect(endpoints, Duration::from_secs(5)).await?);
        }
    }
    let mut tasks = Vec::new();
    for t in 0..args.clients {
        let Some(etcd) = etcd_pool.get(t % n + n * ((t / n) % conns)).cloned() else {
            anyhow::bail!("no connection for task {t}")
        };
        let curp = match curp_pool.get(if args.conns == 0 { t } else { (t / n) % conns }) {
            Some(base) => {
                let c = base.new_session().with_emulated_rtt(rtt);
                c.bind(t);
                Some(c)
            }
            None => None,
        };
        let (zipf, value, stop, args) = (Arc::clone(&zipf), value.clone(), Arc::clone(&stop), args.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed ^ ((t as u64) << 20));
            let mut tally = Tally::default();
            while !stop.load(Ordering::Relaxed) {
                let key = format!("key{}", zipf.sample(&mut rng));
                let write = rng.gen_range(0..100) < args.write_percent;
                let weak = rng.gen_range(0..100) < args.weak_percent;
                let start = Instant::now();
                let ok = match (&curp, write, weak) {
                    (Some(c), true, false) => {
                        let req = PbPutRequest { key: key.into_bytes(), value: value.clone(), ..Default::default() };
                        match c.put(&req).await {
                            Ok(a) => {
                                tally.fast += u64::from(a.fast);
                                true
                            }
                            Err(_) => false,
                        }
                    }
                    (Some(c), true, true) => {
                        let req = PbPutRequest { key: key.into_bytes(), value: value.clone(), ..Default::default() };
                        c.weak_put(&req).await.is_ok()
                    }
                    (Some(c), false, true) => c.weak_get(key.as_bytes()).await.is_ok(),
                    (Some(c), false, false) => {
                        // A strong read after the session's weak writes waits for them.
                        c.settle().await.is_ok() && {
                            wait(half).await;
                            let ok = etcd.get(key.into_bytes(), false).await.is_ok();
                            wait(half).await;
                            ok
                        }
                    }
                    (None, true, _) => {
                        wait(half).await;
                        let req = PbPutRequest { key: key.into_bytes(), value: value.clone(), ..Default::default() };
                        let ok = etcd.put(req).await.is_ok();
                        wait(half).await;
                        ok
                    }
                    (None, false, _) => {
                        wait(half).await;
                        let ok = etcd.get(key.into_bytes(), weak).await.is_ok();
                        wait(half).await;
                        ok
                    }
                };
                let us = start.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
                match (ok, write, weak) {
                    (false, _, _) => tally.errors += 1,
                    (true, true, false) => tally.writes.push(us),
                    (true, false, false) => tally.reads.push(us),
                    (true, true, true) => tally.weak_writes.push(us),
                    (true, false, true) => tally.weak_reads.push(us),
                }
            }
            tally
        }));
    }
    let start = Instant::now();
    tokio::time::sleep(args.duration).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Tally::default();
    for t in tasks {
        all.extend(t.await?);
    }
    let secs = start.elapsed().as_secs_f64();
    let writes = sorted(&[&all.writes]);
    let reads = sorted(&[&all.reads]);
    let weak_writes = sorted(&[&all.weak_writes]);
    let weak_reads = sorted(&[&all.weak_reads]);
    let strong = sorted(&[&all.writes, &all.reads]);
    let weak = sorted(&[&all.weak_writes, &all.weak_reads]);
    let ops = strong.len() + weak.len();
    let line = format!(
        "ops_per_s={:.0} ops={ops} writes={} weak_ops={} fast={} errors={} write_p50_ms={:.3} write_p99_ms={:.3} read_p50_ms={:.3} read_p99_ms={:.3} strong_p50_ms={:.3} strong_p99_ms={:.3} weak_p50_ms={:.3} weak_p99_ms={:.3} weak_write_p50_ms={:.3} weak_read_p50_ms={:.3} rtt_measured_ms={:.3}",
        ops as f64 / secs,
        writes.len(),
        weak.len(),
        all.fast,
        all.errors,
        percentile(&writes, 0.5),
        percentile(&writes, 0.99),
        percentile(&reads, 0.5),
        percentile(&reads, 0.99),
        percentile(&strong, 0.5),
        percentile(&strong, 0.99),
        percentile(&weak, 0.5),
        percentile(&weak, 0.99),
        percentile(&weak_writes, 0.5),
        percentile(&weak_reads, 0.5),
        rtt_measured_ms,
    );
    println!("{line}");
    Ok(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_favours_low_ranks_and_stays_in_range() {
        let z = Zipf::new(1000, 0.99);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut counts = vec![0u32; 1000];
        for _ in 0..100_000 {
            counts[z.sample(&mut rng)] += 1;
        }
        // Rank 0 about twice rank 1 and ~10x rank 9 at s = 0.99; the tail is drawn too.
        assert!(counts[0] > counts[1] * 3 / 2 && counts[0] < counts[1] * 5 / 2, "{:?}", &counts[..3]);
        assert!(counts[0] > counts[9] * 7, "{} vs {}", counts[0], counts[9]);
        assert!(counts[500..].iter().sum::<u32>() > 0);
        let uniform = Zipf::new(10, 0.0);
        let mut c = [0u32; 10];
        for _ in 0..10_000 {
            c[uniform.sample(&mut rng)] += 1;
        }
        assert!(c.iter().all(|n| (800..1200).contains(n)), "{c:?}");
    }
}
