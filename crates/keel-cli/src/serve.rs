//! `keel serve` (a cluster member, started with etcd's flags) and `keel cluster ...` (member
//! administration through the etcd v3 API).
//!
//! The member's flags are read by `etcd_flags` (Go's flag rules, etcd's flag table); this file
//! turns their values into a [`ServeConfig`], runs the member, and prints etcd's version and
//! ready lines where etcd's tooling looks for them.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};
use keel_cluster::config::parse_initial_cluster;
use keel_cluster::{ServeConfig, TlsFiles};

use crate::etcd_flags::{self, Parsed};
use crate::Failure;

/// The etcd release whose flags, version output and start-up lines KeelDB follows.
pub const ETCD_VERSION: &str = "3.6.16";

/// `keel serve`'s arguments: etcd's member flags, read with Go's flag rules by `etcd_flags`
/// rather than by clap (`keel serve --help` lists what KeelDB does with each).
#[derive(Debug, Args)]
#[command(disable_help_flag = true, disable_version_flag = true)]
pub struct ServeCommand {
    /// etcd 3.6's server flags, e.g. `--name n1 --data-dir /var/lib/n1 ...`.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0.., value_name = "ETCD_FLAGS")]
    args: Vec<String>,
}

/// `keel serve --version` (and `etcd --version`): etcd's four lines, so that tools reading the
/// etcd version (etcd's e2e framework parses `etcd Version:`) see the release KeelDB follows,
/// then KeelDB's own version.
pub fn version_text() -> String {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        other => other,
    };
    format!(
        "etcd Version: {ETCD_VERSION}\nGit SHA: Not provided (KeelDB)\nGo Version: none (KeelDB is written in Rust)\n\
         Go OS/Arch: {}/{arch}\nKeelDB Version: {}\n",
        std::env::consts::OS,
        env!("CARGO_PKG_VERSION")
    )
}

/// One line in etcd's zap JSON log shape, on stderr: etcd's tests and scripts match these
/// messages (etcd's e2e framework waits for "ready to serve client requests").
fn log_json(msg: &str, fields: &[(&str, String)]) {
    let mut line = format!(
        "{{\"level\":\"info\",\"ts\":\"{}\",\"caller\":\"keel-cli/serve.rs\",\"msg\":{}",
        rfc3339_now(),
        json_string(msg)
    );
    for (k, v) in fields {
        line += &format!(",{}:{}", json_string(k), json_string(v));
    }
    line.push('}');
    eprintln!("{line}");
}

fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out += "\\\"",
            '\\' => out += "\\\\",
            c if (c as u32) < 0x20 => out += &format!("\\u{:04x}", c as u32),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The UTC time as zap prints it: `2026-01-02T03:04:05.123456Z`.
fn rfc3339_now() -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = now.as_secs();
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        rest / 3600,
        rest / 60 % 60,
        rest % 60,
        now.subsec_micros()
    )
}

/// A flag's value that does not fit KeelDB's type for it.
fn bad_value(flag: &str, value: &str, why: impl std::fmt::Display) -> Failure {
    Failure::usage(anyhow::anyhow!("invalid value {value:?} for flag --{flag}: {why}"))
}

/// An integer flag, read as Go reads it (`0x10`, `010`), within `T`'s range.
fn number<T: TryFrom<i128>>(p: &Parsed, flag: &str, default: T) -> Result<T, Failure> {
    let Some(v) = p.get(flag) else { return Ok(default) };
    let n = etcd_flags::parse_go_int(v).ok_or_else(|| bad_value(flag, v, "parse error"))?;
    T::try_from(n).map_err(|_| bad_value(flag, v, "out of range"))
}

fn text(p: &Parsed, flag: &str, default: &str) -> String {
    p.get(flag).unwrap_or(default).to_string()
}

/// A comma-separated URL list, each URL once (etcd keeps a set).
fn urls(p: &Parsed, flag: &str, default: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for u in p.get(flag).unwrap_or(default).split(',').map(str::trim).filter(|u| !u.is_empty()) {
        if !out.iter().any(|o| o == u) {
            out.push(u.to_string());
        }
    }
    out
}

/// A comma-separated list flag (empty entries dropped).
fn list(p: &Parsed, flag: &str) -> Vec<String> {
    p.get(flag).unwrap_or("").split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect()
}

/// The TLS settings both sides share: versions and cipher suites.
fn tls_policy(p: &Parsed) -> TlsFiles {
    TlsFiles {
        min_version: p.get("tls-min-version").unwrap_or("").to_string(),
        max_version: p.get("tls-max-version").unwrap_or("").to_string(),
        cipher_suites: list(p, "cipher-suites"),
        ..TlsFiles::default()
    }
}

fn path(p: &Parsed, flag: &str) -> Option<PathBuf> {
    p.get(flag).filter(|v| !v.is_empty()).map(PathBuf::from)
}

fn duration(p: &Parsed, flag: &str) -> Result<Option<Duration>, Failure> {
    let Some(v) = p.get(flag) else { return Ok(None) };
    let ns = etcd_flags::parse_go_duration(v).ok_or_else(|| bad_value(flag, v, "invalid duration"))?;
    let ns = u64::try_from(ns).map_err(|_| bad_value(flag, v, "negative duration"))?;
    Ok(Some(Duration::from_nanos(ns)))
}

/// A member as its flags describe it: the configuration, and what `serve` does around it.
#[derive(Debug)]
struct Member {
    config: ServeConfig,
    /// `--log-level` warn or above: no start and stop messages.
    quiet: bool,
    /// `--auto-tls`, `--peer-auto-tls` and `--self-signed-cert-validity`.
    auto_tls: bool,
    peer_auto_tls: bool,
    cert_validity_years: u32,
    /// `--experimental-initial-corrupt-check` (see [`Member::check_initial_corrupt_check`]).
    initial_corrupt_check: bool,
}

impl Member {
    fn from_flags(p: &Parsed) -> Result<Member, Failure> {
        let name = text(p, "name", "default");
        // As etcd: listening on chosen client URLs without saying which to advertise is an
        // error, not a silent advertisement of the default.
        if p.get("listen-client-urls").is_some() && p.get("advertise-client-urls").is_none() {
            return Err(Failure::usage(anyhow::anyhow!(
                "--advertise-client-urls is required when --listen-client-urls is set explicitly"
            )));
        }
        let initial_advertise_peer_urls = urls(p, "initial-advertise-peer-urls", "http://127.0.0.1:2380");
        let initial_cluster = match p.get("initial-cluster").filter(|v| !v.is_empty()) {
            Some(text) => parse_initial_cluster(text).map_err(Failure::usage)?,
            None => [(name.clone(), initial_advertise_peer_urls.clone())].into_iter().collect(),
        };
        let join_existing = match p.get("initial-cluster-state").unwrap_or("new") {
            "new" => false,
            "existing" => true,
            other => return Err(bad_value("initial-cluster-state", other, "valid values are \"new\", \"existing\"")),
        };
        let log_level = text(p, "log-level", "info");
        if !["debug", "info", "warn", "error", "panic", "fatal"].contains(&log_level.as_str()) {
            return Err(bad_value("log-level", &log_level, "debug, info, warn, error, panic or fatal"));
        }
        let auto_compaction = keel_cluster::compactor::AutoCompaction::parse(
            &text(p, "auto-compaction-mode", "periodic"),
            &text(p, "auto-compaction-retention", "0"),
        )
        .map_err(Failure::usage)?;
        // etcd: the experimental spelling, when given, wins; 0 means the default, 10 minutes.
        let progress = match duration(p, "experimental-watch-progress-notify-interval")? {
            Some(d) => Some(d),
            None => duration(p, "watch-progress-notify-interval")?,
        };
        let defaults = ServeConfig::default();
        let config = ServeConfig {
            auto_compaction,
            data_dir: path(p, "data-dir").unwrap_or_else(|| PathBuf::from(format!("{name}.keel"))),
            listen_client_urls: urls(p, "listen-client-urls", "http://127.0.0.1:2379"),
            advertise_client_urls: urls(p, "advertise-client-urls", "http://127.0.0.1:2379"),
            listen_peer_urls: urls(p, "listen-peer-urls", "http://127.0.0.1:2380"),
            initial_advertise_peer_urls,
            initial_cluster,
            initial_cluster_token: text(p, "initial-cluster-token", "etcd-cluster"),
            join_existing,
            heartbeat_interval: Duration::from_millis(number(p, "heartbeat-interval", 100u64)?),
            election_timeout: Duration::from_millis(number(p, "election-timeout", 1000u64)?),
            snapshot_count: number(p, "snapshot-count", 10_000u64)?.max(1),
            snapshot_bytes_percent: number(p, "snapshot-bytes-percent", 50u64)?,
            max_request_bytes: number(p, "max-request-bytes", 1536 * 1024usize)?,
            auth_token_ttl: Duration::from_secs(number(p, "auth-token-ttl", 300u64)?.max(1)),
            client_tls: TlsFiles {
                cert_file: path(p, "cert-file"),
                key_file: path(p, "key-file"),
                trusted_ca_file: path(p, "trusted-ca-file"),
                client_cert_auth: p.is_true("client-cert-auth"),
                crl_file: path(p, "client-crl-file"),
                allowed_hostnames: list(p, "client-cert-allowed-hostname"),
                ..tls_policy(p)
            },
            peer_tls: TlsFiles {
                cert_file: path(p, "peer-cert-file"),
                key_file: path(p, "peer-key-file"),
                trusted_ca_file: path(p, "peer-trusted-ca-file"),
                client_cert_auth: p.is_true("peer-client-cert-auth"),
                crl_file: path(p, "peer-crl-file"),
                allowed_cns: list(p, "peer-cert-allowed-cn"),
                allowed_hostnames: list(p, "peer-cert-allowed-hostname"),
                ..tls_policy(p)
            },
            name,
            fs: defaults.fs,
            auto_compaction_interval: None,
            watch_progress_notify_interval: progress
                .filter(|d| !d.is_zero())
                .unwrap_or(defaults.watch_progress_notify_interval),
            curp_weak_queue_bytes: defaults.curp_weak_queue_bytes,
            // etcd's default is true: only an explicit false turns the check off.
            strict_reconfig_check: p.get("strict-reconfig-check") != Some("false"),
            max_concurrent_streams: number(p, "max-concurrent-streams", u32::MAX)?,
            // etcd's default is true: a member that could not win an election does not start one.
            pre_vote: p.get("pre-vote") != Some("false"),
        };
        Ok(Member {
            config,
            quiet: matches!(log_level.as_str(), "warn" | "error" | "panic" | "fatal"),
            auto_tls: p.is_true("auto-tls"),
            peer_auto_tls: p.is_true("peer-auto-tls"),
            cert_validity_years: number(p, "self-signed-cert-validity", 1u32)?,
            initial_corrupt_check: p.is_true("experimental-initial-corrupt-check"),
        })
    }

    /// etcd's initial corruption check compares this member's KV hash at its revision with
    /// its peers' before serving. KeelDB does not compare hashes with peers, so it takes the
    /// flag only where etcd's check has nothing to compare: a member's first start, whose
    /// empty state every peer also had at that revision (the check cannot fail there). On a
    /// member with data, the flag is refused.
    fn check_initial_corrupt_check(&self) -> Result<(), Failure> {
        let member_dir = self.config.data_dir.join("member");
        if self.initial_corrupt_check && member_dir.exists() {
            return Err(Failure::usage(anyhow::anyhow!(
                "--experimental-initial-corrupt-check=true: KeelDB does not support this etcd flag on a member \
                 with data ({}): it does not compare hashes with other members (on a member's first start, \
                 where etcd's check has nothing to compare, it is accepted)",
                member_dir.display()
            )));
        }
        Ok(())
    }

    /// `--auto-tls`/`--peer-auto-tls`, as etcd: self-signed certificates in
    /// `<data-dir>/fixtures/client` and `/peer` for the listen URLs' hosts, unless certificate
    /// files are given (which then win, with a warning). Peers with auto TLS are dialled
    /// without verifying their certificates, as etcd dials them.
    fn make_auto_tls(&mut self) -> Result<(), Failure> {
        let c = &mut self.config;
        if self.auto_tls {
            if c.client_tls.cert_file.is_some() || c.client_tls.key_file.is_some() {
                eprintln!("keel: ignoring --auto-tls since --cert-file/--key-file are given");
            } else {
                let dir = c.data_dir.join("fixtures").join("client");
                let (cert, key) =
                    keel_cluster::tls::self_signed("--auto-tls", &dir, &c.listen_client_urls, self.cert_validity_years)
                        .map_err(Failure::usage)?;
                c.client_tls.cert_file = Some(cert);
                c.client_tls.key_file = Some(key);
            }
        }
        if self.peer_auto_tls {
            if c.peer_tls.cert_file.is_some() || c.peer_tls.key_file.is_some() {
                eprintln!("keel: ignoring --peer-auto-tls since --peer-cert-file/--peer-key-file are given");
            } else {
                let dir = c.data_dir.join("fixtures").join("peer");
                let (cert, key) = keel_cluster::tls::self_signed(
                    "--peer-auto-tls",
                    &dir,
                    &c.listen_peer_urls,
                    self.cert_validity_years,
                )
                .map_err(Failure::usage)?;
                c.peer_tls.cert_file = Some(cert);
                c.peer_tls.key_file = Some(key);
                c.peer_tls.insecure_skip_verify = true;
            }
        }
        Ok(())
    }
}

/// What a `keel serve` command line asks for.
#[derive(Debug)]
enum Request {
    Help,
    Version,
    Run(Box<Member>),
}

fn request(args: &[String]) -> Result<Request, Failure> {
    if let Some(sub @ ("gateway" | "grpc-proxy")) = args.first().map(String::as_str) {
        return Err(Failure::usage(anyhow::anyhow!("KeelDB does not support etcd's `{sub}` command")));
    }
    let parsed = etcd_flags::parse_with_env(args, std::env::vars()).map_err(Failure::usage)?;
    if parsed.help {
        return Ok(Request::Help);
    }
    if parsed.is_true("version") {
        return Ok(Request::Version);
    }
    Ok(Request::Run(Box::new(Member::from_flags(&parsed)?)))
}

fn runtime() -> Result<tokio::runtime::Runtime, Failure> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(Failure::runtime)
}

/// `keel serve ARGS` (and `etcd ARGS` when the binary is started under that name): help,
/// version, or a member until SIGINT or SIGTERM.
pub fn serve(cmd: ServeCommand) -> Result<u8, Failure> {
    serve_args(&cmd.args)
}

/// Runs etcd's command line `args` (without the program name).
pub fn serve_args(args: &[String]) -> Result<u8, Failure> {
    let mut member = match request(args)? {
        Request::Help => {
            print!("{}", etcd_flags::help());
            return Ok(0);
        }
        Request::Version => {
            print!("{}", version_text());
            return Ok(0);
        }
        Request::Run(member) => member,
    };
    member.check_initial_corrupt_check()?;
    // The self-signed certificates first: https URLs with auto TLS need them to validate.
    member.make_auto_tls()?;
    member.config.validate().map_err(Failure::usage)?;
    let quiet = member.quiet;
    let config = member.config;
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
        if !quiet {
            eprintln!(
                "keel: member {:x} ({}) of cluster {:x} listening for clients on {:?}",
                server.node.id, server.node.config.name, server.node.cluster_id, server.client_addrs
            );
        }
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(Failure::runtime)?;
        let announce = async {
            // etcd prints its ready line at any log level (its e2e framework waits for it).
            if server.ready().await {
                log_json("ready to serve client requests", &[]);
                for (url, addr) in server.node.config.listen_client_urls.iter().zip(&server.client_addrs) {
                    let how = if keel_cluster::config::is_https(url) {
                        "serving client traffic securely"
                    } else {
                        "serving client traffic insecurely; this is strongly discouraged!"
                    };
                    log_json(how, &[("traffic", "grpc".into()), ("address", addr.to_string())]);
                }
            }
            std::future::pending::<()>().await
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
            _ = server.node.stopped() => {}
            _ = announce => {}
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
    /// A snapshot from `keel cluster snapshot-save` or `etcdctl snapshot save` against keel, or
    /// one `etcdctl snapshot save` took from etcd 3.4–3.6 (etcd's bbolt file: the migration path).
    snapshot: PathBuf,
    /// The member's flags, exactly as it will be started with `keel serve`.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0.., value_name = "ETCD_FLAGS")]
    member: Vec<String>,
}

/// Writes the restored data directory; the member then starts with `keel serve` and the same
/// flags.
pub fn snapshot_restore(cmd: RestoreCommand) -> Result<u8, Failure> {
    let member = match request(&cmd.member)? {
        Request::Run(member) => member,
        Request::Help | Request::Version => {
            return Err(Failure::usage(anyhow::anyhow!(
                "snapshot-restore takes a snapshot file and the member's flags"
            )))
        }
    };
    let config = member.config;
    config.validate().map_err(Failure::usage)?;
    let bytes =
        std::fs::read(&cmd.snapshot).map_err(|e| Failure::usage(anyhow::anyhow!("{}: {e}", cmd.snapshot.display())))?;
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

    fn member(args: &[&str]) -> Result<Member, Failure> {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        match request(&args)? {
            Request::Run(m) => Ok(*m),
            other => panic!("not a run: {other:?}"),
        }
    }

    #[test]
    fn etcd_command_lines_become_the_member_config() {
        let m = member(&[
            "-name=n1",
            "--data-dir",
            "/d/n1",
            "--initial-cluster-token=a",
            "--initial-cluster-token=b",
            "--listen-client-urls=http://127.0.0.1:1,http://127.0.0.1:1",
            "--advertise-client-urls=http://127.0.0.1:1",
            "--listen-peer-urls=https://127.0.0.1:2",
            "--initial-advertise-peer-urls=https://127.0.0.1:2",
            "--initial-cluster=n1=https://127.0.0.1:2",
            "--initial-cluster-state=existing",
            "--heartbeat-interval=0x32",
            "--election-timeout=500",
            "--watch-progress-notify-interval=0s",
            "--peer-auto-tls",
            "--self-signed-cert-validity=3",
            "--log-level=warn",
            "--max-concurrent-streams=100",
            "--strict-reconfig-check=false",
            "--client-crl-file=/c/revoked.crl",
            "--peer-cert-allowed-cn=etcd-peer,other",
            "--tls-min-version=TLS1.3",
            "--cipher-suites=TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
        ])
        .unwrap();
        let c = &m.config;
        assert_eq!((c.name.as_str(), c.data_dir.to_str()), ("n1", Some("/d/n1")));
        assert_eq!(c.initial_cluster_token, "b");
        assert_eq!(c.listen_client_urls, ["http://127.0.0.1:1"]);
        assert!(c.join_existing);
        assert_eq!(c.heartbeat_interval, Duration::from_millis(50));
        // etcd's 0 means its default, ten minutes.
        assert_eq!(c.watch_progress_notify_interval, Duration::from_secs(600));
        assert!(m.peer_auto_tls && !m.auto_tls && m.quiet);
        assert_eq!(m.cert_validity_years, 3);
        assert_eq!(c.max_concurrent_streams, 100);
        assert!(!c.strict_reconfig_check);
        assert_eq!(c.client_tls.crl_file.as_deref(), Some(std::path::Path::new("/c/revoked.crl")));
        assert_eq!(c.peer_tls.allowed_cns, ["etcd-peer", "other"]);
        assert_eq!((c.client_tls.min_version.as_str(), c.peer_tls.min_version.as_str()), ("TLS1.3", "TLS1.3"));
        assert_eq!(c.peer_tls.cipher_suites, ["TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256"]);
        // Defaults as etcd's.
        let d = member(&[]).unwrap().config;
        assert!(d.strict_reconfig_check);
        assert_eq!(d.max_concurrent_streams, u32::MAX);
        // The experimental spelling wins, as in etcd.
        let m = member(&["--watch-progress-notify-interval=1m", "--experimental-watch-progress-notify-interval=1.5s"])
            .unwrap();
        assert_eq!(m.config.watch_progress_notify_interval, Duration::from_millis(1500));
        // Listening on chosen client URLs without advertising any is refused, as etcd does.
        let err = member(&["--listen-client-urls=http://127.0.0.1:1"]).unwrap_err();
        assert!(err.error.to_string().contains("--advertise-client-urls is required"), "{:#}", err.error);
        for bad in [&["--initial-cluster-state=maybe"][..], &["--heartbeat-interval=-1"], &["--log-level=loud"]] {
            assert_eq!(member(bad).unwrap_err().code, crate::EXIT_USAGE, "{bad:?}");
        }
    }

    #[test]
    fn initial_corrupt_check_is_taken_on_a_first_start_only() {
        let dir = tempfile::tempdir().unwrap();
        let data_arg = format!("--data-dir={}", dir.path().join("m").display());
        let m = member(&[data_arg.as_str(), "--experimental-initial-corrupt-check"]).unwrap();
        m.check_initial_corrupt_check().unwrap();
        std::fs::create_dir_all(dir.path().join("m").join("member")).unwrap();
        let err = m.check_initial_corrupt_check().unwrap_err();
        assert_eq!(err.code, crate::EXIT_USAGE);
        assert!(err.error.to_string().contains("--experimental-initial-corrupt-check"), "{:#}", err.error);
        // Without the flag, a member with data starts as before.
        let plain = member(&[data_arg.as_str(), "--experimental-initial-corrupt-check=false"]).unwrap();
        plain.check_initial_corrupt_check().unwrap();
    }

    #[test]
    fn auto_tls_makes_certificates_only_without_files() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("m");
        let data_arg = format!("--data-dir={}", data.display());
        let mut m = member(&[data_arg.as_str(), "--auto-tls", "--peer-auto-tls"]).unwrap();
        m.make_auto_tls().unwrap();
        let client = data.join("fixtures").join("client");
        assert_eq!(m.config.client_tls.cert_file.as_deref(), Some(client.join("cert.pem").as_path()));
        assert!(m.config.peer_tls.insecure_skip_verify && !m.config.client_tls.insecure_skip_verify);
        let first = std::fs::read(client.join("cert.pem")).unwrap();
        // A restart reuses the pair, as etcd does.
        let mut again = member(&[data_arg.as_str(), "--auto-tls"]).unwrap();
        again.make_auto_tls().unwrap();
        assert_eq!(std::fs::read(client.join("cert.pem")).unwrap(), first);
        // Given files win over --auto-tls.
        let mut given = member(&[data_arg.as_str(), "--auto-tls", "--cert-file=/c.pem", "--key-file=/k.pem"]).unwrap();
        given.make_auto_tls().unwrap();
        assert_eq!(given.config.client_tls.cert_file.as_deref(), Some(std::path::Path::new("/c.pem")));
    }

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
