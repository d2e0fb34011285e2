//! `keel serve` (a cluster member, with etcd's member flags) and `keel cluster ...` (member
//! administration through the etcd v3 API).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};
use keel_cluster::config::parse_initial_cluster;
use keel_cluster::{ServeConfig, TlsFiles};

use crate::Failure;

/// etcd's member flags, same names and meanings.
#[derive(Debug, Args)]
pub struct ServeCommand {
    /// Human-readable name for this member.
    #[arg(long, default_value = "default")]
    name: String,
    /// Path to the data directory (default: `<name>.keel`).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// URLs to listen on for client traffic (comma-separated).
    #[arg(long, default_value = "http://127.0.0.1:2379", value_delimiter = ',')]
    listen_client_urls: Vec<String>,
    /// This member's client URLs to advertise to the rest of the cluster.
    #[arg(long, default_value = "http://127.0.0.1:2379", value_delimiter = ',')]
    advertise_client_urls: Vec<String>,
    /// URLs to listen on for peer traffic.
    #[arg(long, default_value = "http://127.0.0.1:2380", value_delimiter = ',')]
    listen_peer_urls: Vec<String>,
    /// This member's peer URLs to advertise to the rest of the cluster.
    #[arg(long, default_value = "http://127.0.0.1:2380", value_delimiter = ',')]
    initial_advertise_peer_urls: Vec<String>,
    /// Initial cluster configuration for bootstrapping: `name=peer-url,...`
    /// (default: this member alone, `<name>=<initial-advertise-peer-urls>`).
    #[arg(long)]
    initial_cluster: Option<String>,
    /// Initial cluster token; clusters with different tokens never talk to each other.
    #[arg(long, default_value = "etcd-cluster")]
    initial_cluster_token: String,
    /// `new` to bootstrap a cluster, `existing` to join one (after `keel cluster add`).
    #[arg(long, default_value = "new", value_parser = ["new", "existing"])]
    initial_cluster_state: String,
    /// Time (in milliseconds) of a heartbeat interval.
    #[arg(long, default_value_t = 100)]
    heartbeat_interval: u64,
    /// Time (in milliseconds) for an election to timeout.
    #[arg(long, default_value_t = 1000)]
    election_timeout: u64,
    /// Number of applied entries between snapshots (log compaction); a floor, see
    /// --snapshot-bytes-percent.
    #[arg(long, default_value_t = 10_000)]
    snapshot_count: u64,
    /// A snapshot also waits until the entries applied since the last one carry this share of
    /// its size, in percent: a snapshot writes the whole state, so its cost stays in proportion
    /// to the writes. 0: --snapshot-count alone decides.
    #[arg(long, default_value_t = 50)]
    snapshot_bytes_percent: u64,
    /// Maximum client request size in bytes the server will accept.
    #[arg(long, default_value_t = 1536 * 1024)]
    max_request_bytes: usize,
    /// `periodic` (retention is a duration such as 30m or 1h, or a number of hours) or
    /// `revision` (retention is a number of revisions to keep).
    #[arg(long, default_value = "periodic")]
    auto_compaction_mode: String,
    /// History to keep before the leader compacts automatically; 0 never compacts.
    #[arg(long, default_value = "0")]
    auto_compaction_retention: String,
    /// Seconds an authentication token stays valid.
    #[arg(long, default_value_t = 300)]
    auth_token_ttl: u64,
    /// Path to the client server TLS cert file (PEM); used by https client URLs.
    #[arg(long)]
    cert_file: Option<PathBuf>,
    /// Path to the client server TLS key file (PEM).
    #[arg(long)]
    key_file: Option<PathBuf>,
    /// Path to the client server TLS trusted CA cert file (PEM), for --client-cert-auth.
    #[arg(long)]
    trusted_ca_file: Option<PathBuf>,
    /// Refuse clients without a certificate signed by --trusted-ca-file (https URLs only).
    #[arg(long, num_args = 0..=1, require_equals = true, default_value_t = false, default_missing_value = "true")]
    client_cert_auth: bool,
    /// Path to the peer TLS cert file (PEM): served on https peer URLs and presented when
    /// dialling other members.
    #[arg(long)]
    peer_cert_file: Option<PathBuf>,
    /// Path to the peer TLS key file (PEM).
    #[arg(long)]
    peer_key_file: Option<PathBuf>,
    /// Path to the peer TLS trusted CA file (PEM): other members' certificates must be
    /// signed by it.
    #[arg(long)]
    peer_trusted_ca_file: Option<PathBuf>,
    /// Refuse peers without a certificate signed by --peer-trusted-ca-file.
    #[arg(long, num_args = 0..=1, require_equals = true, default_value_t = false, default_missing_value = "true")]
    peer_client_cert_auth: bool,
    /// How often an idle watcher asking for progress notifications gets one (`10m`, `30s`,
    /// `500ms`).
    #[arg(long, alias = "experimental-watch-progress-notify-interval", default_value = "10m", value_parser = parse_duration)]
    watch_progress_notify_interval: Duration,
    /// Accepted for etcd scripts: `debug` and `info` print member events, `warn` and
    /// `error` only problems (KeelDB logs little either way).
    #[arg(long, default_value = "info", value_parser = ["debug", "info", "warn", "error", "panic", "fatal"])]
    log_level: String,
    /// Accepted for etcd scripts and ignored (KeelDB logs to stderr).
    #[arg(long, hide = true)]
    logger: Option<String>,
    /// Accepted for etcd scripts and ignored (KeelDB logs to stderr).
    #[arg(long, hide = true)]
    log_outputs: Option<String>,
    /// Run a Pre-Vote round before an election, so that a member rejoining after a partition
    /// does not depose a healthy leader (`--pre-vote=false` turns it off).
    #[arg(long, num_args = 0..=1, require_equals = true, default_value_t = true, default_missing_value = "true")]
    pre_vote: bool,
}

impl ServeCommand {
    fn config(self) -> Result<ServeConfig, Failure> {
        let initial_cluster = match &self.initial_cluster {
            Some(text) => parse_initial_cluster(text).map_err(Failure::usage)?,
            None => [(self.name.clone(), self.initial_advertise_peer_urls.clone())].into_iter().collect(),
        };
        let auto_compaction =
            keel_cluster::compactor::AutoCompaction::parse(&self.auto_compaction_mode, &self.auto_compaction_retention)
                .map_err(Failure::usage)?;
        let config = ServeConfig {
            auto_compaction,
            data_dir: self.data_dir.unwrap_or_else(|| PathBuf::from(format!("{}.keel", self.name))),
            listen_client_urls: self.listen_client_urls,
            advertise_client_urls: self.advertise_client_urls,
            listen_peer_urls: self.listen_peer_urls,
            initial_advertise_peer_urls: self.initial_advertise_peer_urls,
            initial_cluster,
            initial_cluster_token: self.initial_cluster_token,
            join_existing: self.initial_cluster_state == "existing",
            heartbeat_interval: Duration::from_millis(self.heartbeat_interval),
            election_timeout: Duration::from_millis(self.election_timeout),
            snapshot_count: self.snapshot_count.max(1),
            snapshot_bytes_percent: self.snapshot_bytes_percent,
            max_request_bytes: self.max_request_bytes,
            auth_token_ttl: Duration::from_secs(self.auth_token_ttl.max(1)),
            client_tls: TlsFiles {
                cert_file: self.cert_file,
                key_file: self.key_file,
                trusted_ca_file: self.trusted_ca_file,
                client_cert_auth: self.client_cert_auth,
            },
            peer_tls: TlsFiles {
                cert_file: self.peer_cert_file,
                key_file: self.peer_key_file,
                trusted_ca_file: self.peer_trusted_ca_file,
                client_cert_auth: self.peer_client_cert_auth,
            },
            name: self.name,
            fs: ServeConfig::default().fs,
            auto_compaction_interval: None,
            watch_progress_notify_interval: self.watch_progress_notify_interval,
            curp_weak_queue_bytes: ServeConfig::default().curp_weak_queue_bytes,
            pre_vote: self.pre_vote,
        };
        config.validate().map_err(Failure::usage)?;
        Ok(config)
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, Failure> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(Failure::runtime)
}

/// Runs a member until SIGINT or SIGTERM.
pub fn serve(cmd: ServeCommand) -> Result<u8, Failure> {
    let cmd_log_level = cmd.log_level.clone();
    let config = cmd.config()?;
    // A benchmark aid: emulated distance between members (this member waits this long before
    // each peer message and each answer it sends), for `keel cluster load --rtt-ms`.
    if let Ok(v) = std::env::var("KEEL_EMULATED_PEER_DELAY_MS") {
        let ms: f64 = v.parse().ok().filter(|ms: &f64| (0.0..10_000.0).contains(ms)).ok_or_else(|| {
            Failure::usage(anyhow::anyhow!(
                "KEEL_EMULATED_PEER_DELAY_MS must be a number of milliseconds below 10000, not {v:?}"
            ))
        })?;
        eprintln!("keel: emulating {ms} ms one-way on every peer link (KEEL_EMULATED_PEER_DELAY_MS)");
        keel_cluster::network::faults::set_default_delay(Some(Duration::from_secs_f64(ms / 1000.0)));
    }
    runtime()?.block_on(async move {
        let server = keel_cluster::Server::start(config).await.map_err(|e| match e {
            keel_cluster::StartError::Config(e) => Failure::usage(e),
            other => Failure::runtime(other),
        })?;
        let quiet = matches!(cmd_log_level.as_str(), "warn" | "error" | "panic" | "fatal");
        if !quiet {
            eprintln!(
                "keel: member {:x} ({}) of cluster {:x} serving clients on {:?}",
                server.node.id, server.node.config.name, server.node.cluster_id, server.client_addrs
            );
        }
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(Failure::runtime)?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
            _ = server.node.stopped() => {}
        }
        let fatal = server.node.fatal.lock().clone();
        if let Some(why) = fatal {
            server.stop().await;
            return Err(Failure::runtime(anyhow::anyhow!("{why}")));
        }
        if !quiet {
            eprintln!("keel: stopping");
        }
        // As etcd on a graceful stop: a leader first hands leadership to the most caught-up
        // voter, so writes stall for one election round instead of an election timeout; then
        // requests under way finish before Raft stops.
        let bound = server.node.config.election_timeout * 3;
        if let Some(new) = server.stop_gracefully(bound).await {
            if !quiet {
                eprintln!("keel: handed leadership to member {new:x}");
            }
        }
        Ok(0)
    })
}

/// Member administration.
#[derive(Debug, Args)]
pub struct ClusterCommand {
    /// Client URLs of one or more members (comma-separated).
    #[arg(long, default_value = "http://127.0.0.1:2379", value_delimiter = ',', global = true)]
    endpoints: Vec<String>,
    /// CA file (PEM) that signs the members' client certificates; needed for https endpoints.
    #[arg(long, global = true)]
    cacert: Option<PathBuf>,
    /// Client certificate (PEM) to present, for members with --client-cert-auth.
    #[arg(long, global = true, requires = "key")]
    cert: Option<PathBuf>,
    /// Key (PEM) of --cert.
    #[arg(long, global = true, requires = "cert")]
    key: Option<PathBuf>,
    #[command(subcommand)]
    action: ClusterAction,
}

#[derive(Debug, Subcommand)]
enum ClusterAction {
    /// List the members with their role, leader, Raft term and indexes, and revision.
    Status,
    /// Drive seed 002's workload (Zipf keys, a share of writes, linearizable reads) for a while
    /// through the CURP client or etcd's API; prints one line of figures.
    Load(crate::load::LoadArgs),
    /// Add a member by its peer URLs; then start it with `--initial-cluster-state existing`.
    Add {
        /// The new member's peer URLs (comma-separated).
        #[arg(long, value_delimiter = ',', required = true)]
        peer_urls: Vec<String>,
        /// Add as a non-voting learner.
        #[arg(long)]
        learner: bool,
    },
    /// Remove a member by its hex id (as `status` prints it).
    Remove {
        /// Member id, hex.
        id: String,
    },
    /// Make the member with this hex id the leader.
    TransferLeader {
        /// Member id, hex.
        id: String,
    },
    /// Save a member's state (`Maintenance.Snapshot`, as `etcdctl snapshot save`) to FILE;
    /// `keel snapshot-restore` makes a new cluster from it.
    SnapshotSave {
        /// Where to write the snapshot (written to FILE.part, synced, renamed).
        file: PathBuf,
    },
}

/// Makes a data directory for one founding member of a new cluster from a snapshot.
#[derive(Debug, Args)]
pub struct RestoreCommand {
    /// A snapshot from `keel cluster snapshot-save` or `etcdctl snapshot save` against keel.
    snapshot: PathBuf,
    /// The member's flags, exactly as it will be started with `keel serve`.
    #[command(flatten)]
    member: ServeCommand,
}

/// Writes the restored data directory; the member then starts with `keel serve` and the same
/// flags.
pub fn snapshot_restore(cmd: RestoreCommand) -> Result<u8, Failure> {
    let bytes =
        std::fs::read(&cmd.snapshot).map_err(|e| Failure::usage(anyhow::anyhow!("{}: {e}", cmd.snapshot.display())))?;
    let config = cmd.member.config()?;
    let revision = keel_cluster::restore_snapshot(&config, &bytes).map_err(|e| match e {
        keel_cluster::StartError::Config(e) => Failure::usage(e),
        other => Failure::usage(other),
    })?;
    println!(
        "restored {} ({} bytes, revision {revision}) into {} for member {}; start it with keel serve and the same flags",
        cmd.snapshot.display(),
        bytes.len(),
        config.data_dir.display(),
        config.name
    );
    Ok(0)
}

/// Bytes as etcdctl prints sizes (`12 kB`, `3.4 MB`).
fn human_bytes(n: u64) -> String {
    match n {
        0..=999 => format!("{n} B"),
        1_000..=999_999 => format!("{:.1} kB", n as f64 / 1e3),
        1_000_000..=999_999_999 => format!("{:.1} MB", n as f64 / 1e6),
        _ => format!("{:.1} GB", n as f64 / 1e9),
    }
}

fn parse_id(text: &str) -> Result<u64, Failure> {
    u64::from_str_radix(text.trim_start_matches("0x"), 16)
        .map_err(|_| Failure::usage(anyhow::anyhow!("{text:?} is not a hex member id")))
}

/// etcdctl's `--cacert`, `--cert`, `--key`, read into a TLS configuration (`None` without
/// `--cacert`: https endpoints are then refused with a message, since no system roots are used).
fn client_tls(cmd: &ClusterCommand) -> Result<Option<etcd_client::TlsOptions>, Failure> {
    let read = |flag: &str, path: &PathBuf| {
        std::fs::read(path).map_err(|e| Failure::usage(anyhow::anyhow!("--{flag} {}: {e}", path.display())))
    };
    let Some(ca) = &cmd.cacert else {
        if let Some(url) = cmd.endpoints.iter().find(|u| u.starts_with("https://")) {
            return Err(Failure::usage(anyhow::anyhow!("the https endpoint {url} needs --cacert")));
        }
        return Ok(None);
    };
    let mut tls =
        etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(read("cacert", ca)?));
    if let (Some(cert), Some(key)) = (&cmd.cert, &cmd.key) {
        tls = tls.identity(etcd_client::Identity::from_pem(read("cert", cert)?, read("key", key)?));
    }
    Ok(Some(tls))
}

async fn connect(endpoints: &[String], tls: Option<&etcd_client::TlsOptions>) -> Result<etcd_client::Client, Failure> {
    let mut opts = etcd_client::ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(3))
        .with_timeout(Duration::from_secs(10));
    if let Some(tls) = tls {
        opts = opts.with_tls(tls.clone());
    }
    etcd_client::Client::connect(endpoints, Some(opts)).await.map_err(Failure::runtime)
}

/// Runs one `keel cluster` action.
pub fn cluster(cmd: ClusterCommand) -> Result<u8, Failure> {
    let tls = client_tls(&cmd)?;
    let tls = tls.as_ref();
    runtime()?.block_on(async move {
        let mut client = connect(&cmd.endpoints, tls).await?;
        match cmd.action {
            ClusterAction::Load(args) => {
                crate::load::run(&cmd.endpoints, &args).await.map_err(Failure::runtime)?;
                Ok(0)
            }
            ClusterAction::Status => {
                let members = client.member_list().await.map_err(Failure::runtime)?;
                println!(
                    "{:<16}  {:<12}  {:<8}  {:>6}  {:>10}  {:>10}  {:>10}  {:>10}  {:>10}  client URLs",
                    "id", "name", "role", "term", "raft index", "applied", "revision", "compacted", "history"
                );
                for m in members.members() {
                    let mut row = format!("{:<16x}  {:<12}", m.id(), m.name());
                    let status = match m.client_urls().first() {
                        Some(url) => match connect(std::slice::from_ref(url), tls).await {
                            Ok(mut c) => c.status().await.ok(),
                            Err(_) => None,
                        },
                        None => None,
                    };
                    match status {
                        Some(s) => {
                            let role = if s.leader() == m.id() {
                                "leader"
                            } else if m.is_learner() {
                                "learner"
                            } else {
                                "follower"
                            };
                            row += &format!(
                                "  {:<8}  {:>6}  {:>10}  {:>10}  {:>10}",
                                role,
                                s.raft_term(),
                                s.raft_index(),
                                s.raft_applied_index(),
                                s.header().map_or(0, |h| h.revision())
                            );
                            let url = m.client_urls().first().cloned().unwrap_or_default();
                            row += &match keel_cluster::status_client::history_status(
                                &url,
                                tls.cloned(),
                                Duration::from_secs(3),
                            )
                            .await
                            {
                                Ok(h) => format!("  {:>10}  {:>10}", h.compact_revision, human_bytes(h.bytes)),
                                Err(_) => format!("  {:>10}  {:>10}", "-", "-"),
                            };
                        }
                        None => {
                            row += &format!(
                                "  {:<8}  {:>6}  {:>10}  {:>10}  {:>10}  {:>10}  {:>10}",
                                "down", "-", "-", "-", "-", "-", "-"
                            )
                        }
                    }
                    println!("{row}  {}", m.client_urls().join(","));
                }
                Ok(0)
            }
            ClusterAction::Add { peer_urls, learner } => {
                let opts = if learner { Some(etcd_client::MemberAddOptions::new().with_is_learner()) } else { None };
                let resp = client.member_add(peer_urls, opts).await.map_err(Failure::runtime)?;
                if let Some(m) = resp.member() {
                    println!("added member {:x}; start it with --initial-cluster-state existing", m.id());
                }
                Ok(0)
            }
            ClusterAction::SnapshotSave { file } => {
                let mut stream = client.snapshot().await.map_err(Failure::runtime)?;
                let part = file.with_extension("part");
                let mut out = std::fs::File::create(&part).map_err(Failure::runtime)?;
                let mut total = 0usize;
                let mut finished = false;
                while let Some(chunk) = stream.message().await.map_err(Failure::runtime)? {
                    use std::io::Write;
                    out.write_all(chunk.blob()).map_err(Failure::runtime)?;
                    total += chunk.blob().len();
                    finished = chunk.remaining_bytes() == 0;
                }
                if !finished {
                    let _ = std::fs::remove_file(&part);
                    return Err(Failure::runtime(anyhow::anyhow!("snapshot stream ended early")));
                }
                out.sync_all().map_err(Failure::runtime)?;
                std::fs::rename(&part, &file).map_err(Failure::runtime)?;
                println!("saved {total} bytes to {}", file.display());
                Ok(0)
            }
            ClusterAction::Remove { id } => {
                client.member_remove(parse_id(&id)?).await.map_err(Failure::runtime)?;
                println!("removed member {id}");
                Ok(0)
            }
            ClusterAction::TransferLeader { id } => {
                let target = parse_id(&id)?;
                // MoveLeader must reach the current leader.
                let members = client.member_list().await.map_err(Failure::runtime)?;
                let status = client.status().await.map_err(Failure::runtime)?;
                let leader = members
                    .members()
                    .iter()
                    .find(|m| m.id() == status.leader())
                    .and_then(|m| m.client_urls().first().cloned());
                let Some(url) = leader else { return Err(Failure::runtime(anyhow::anyhow!("no leader known"))) };
                let mut lc = connect(&[url], tls).await?;
                lc.move_leader(target).await.map_err(Failure::runtime)?;
                println!("leadership moving to {id}");
                Ok(0)
            }
        }
    })
}

/// A Go-style duration with one unit: `500ms`, `30s`, `10m`, `1h`.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number.parse().map_err(|_| format!("invalid duration {text:?}"))?;
    let ms = match unit {
        "ms" => n,
        "s" | "" => n.saturating_mul(1000),
        "m" => n.saturating_mul(60_000),
        "h" => n.saturating_mul(3_600_000),
        _ => return Err(format!("invalid duration unit in {text:?} (ms, s, m or h)")),
    };
    Ok(Duration::from_millis(ms))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn durations_take_etcds_units_and_refuse_others() {
        assert_eq!(parse_duration("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2h").unwrap(), Duration::from_secs(7200));
        assert!(parse_duration("10x").is_err());
        assert!(parse_duration("m").is_err());
        assert!(parse_duration("").is_err());
    }
}
