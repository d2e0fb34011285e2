//! etcd 3.6's server flags as `keel serve` (and a `keel` started under the name `etcd`) reads
//! them: one table, [`FLAGS`], says for every flag of etcd 3.6.16 whether KeelDB honours it,
//! accepts it only with the values that mean what KeelDB does, or refuses it; and a parser with
//! Go's `flag` package rules, which is what etcd uses (`-name x`, `--name=x`, bool flags take no
//! separate value, a repeated flag's last value wins, parsing stops at the first non-flag).
//!
//! This module owns the command line only: it turns arguments into the last value of each flag
//! and refuses what KeelDB does not do, naming the flag. It builds no configuration (that is
//! `serve.rs`) and never ignores a flag silently: a value KeelDB cannot honour is an error.

use std::collections::BTreeMap;
use std::fmt;

/// How a flag's value is read and compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A Go bool flag: `--f` is true, `--f=false` sets it; never takes the next argument.
    Bool,
    /// A Go duration (`500ms`, `1m0s`, `2h`).
    Duration,
    /// An integer.
    Number,
    /// Any text: paths, URLs, names, lists.
    Text,
}

/// What KeelDB does with a flag.
#[derive(Debug, Clone, Copy)]
pub enum Support {
    /// Honoured: `serve.rs` reads the value. The text is its help line.
    Used(&'static str),
    /// Accepted only with one of these values (compared as [`Kind`] values), each of which is
    /// what KeelDB does anyway; any other value is refused with the reason. An empty list
    /// refuses the flag whatever its value.
    Only(&'static [&'static str], &'static str),
    /// etcd's `--feature-gates`: accepted when every gate named has its default value.
    FeatureGates,
    /// A flag etcd 3.6 itself accepts and ignores (a warning, no effect); so does KeelDB.
    IgnoredByEtcd,
}

/// One flag: its name (without dashes), kind, and what KeelDB does with it. `etcd` is false
/// for KeelDB's own flags.
#[derive(Debug, Clone, Copy)]
pub struct Flag {
    pub name: &'static str,
    pub kind: Kind,
    pub support: Support,
    pub etcd: bool,
}

const fn used(name: &'static str, kind: Kind, help: &'static str) -> Flag {
    Flag { name, kind, support: Support::Used(help), etcd: true }
}

const fn only(name: &'static str, kind: Kind, values: &'static [&'static str], why: &'static str) -> Flag {
    Flag { name, kind, support: Support::Only(values, why), etcd: true }
}

const fn refused(name: &'static str, kind: Kind, why: &'static str) -> Flag {
    only(name, kind, &[], why)
}

const fn ignored(name: &'static str) -> Flag {
    Flag { name, kind: Kind::Bool, support: Support::IgnoredByEtcd, etcd: true }
}

const fn keel_only(name: &'static str, kind: Kind, help: &'static str) -> Flag {
    Flag { name, kind, support: Support::Used(help), etcd: false }
}

use Kind::{Bool as B, Duration as D, Number as N, Text as T};

const NO_DISCOVERY: &str = "KeelDB has no cluster discovery; list the members in --initial-cluster";
const NO_TRACING: &str = "KeelDB has no distributed tracing";
const NO_HTTP: &str = "KeelDB serves gRPC only: no HTTP, JSON gateway, metrics or pprof endpoints";
const NO_BBOLT: &str = "KeelDB has no bbolt backend (its state is a KeelDB store, committed by group commit)";
const NO_SLOW_LOG: &str = "KeelDB logs no slow-request warnings";
const NO_CORRUPT_CHECK: &str =
    "KeelDB does not compare hashes with other members (each store checks its own checksums)";
const NO_LEASE_CHECKPOINT: &str = "KeelDB has no lease checkpoints";
const NO_DEFRAG: &str = "KeelDB has nothing to defragment (Defragment is a no-op)";
const TLS_FILES: &str = "KeelDB takes only --cert-file/--key-file/--trusted-ca-file and the --peer-* equivalents";
const LOGS: &str = "KeelDB logs to stderr only, with no log files or rotation";

/// Every flag of etcd 3.6.16 (`embed.Config.AddFlags` and `etcdmain`), plus KeelDB's own,
/// with what KeelDB does with each. `keel serve --help` prints it; docs/CLUSTER.md explains it.
pub const FLAGS: &[Flag] = &[
    // Member.
    used("name", T, "this member's name (default: default)"),
    used("data-dir", T, "the member's Raft log and state (default: <name>.keel)"),
    only("wal-dir", T, &[""], "KeelDB keeps its Raft log in --data-dir"),
    used("snapshot-count", N, "applied entries between snapshots, at least (10000)"),
    keel_only(
        "snapshot-bytes-percent",
        N,
        "a snapshot also waits for writes of this share of its size, in percent (50; 0: the count alone)",
    ),
    used("heartbeat-interval", N, "Raft heartbeat, milliseconds (100)"),
    used("election-timeout", N, "Raft election timeout, milliseconds, at least 5 heartbeats (1000)"),
    only("initial-election-tick-advance", B, &["false"], "KeelDB does not fast-forward election ticks at boot"),
    used("listen-peer-urls", T, "URLs to listen on for peers (http://127.0.0.1:2380)"),
    used("listen-client-urls", T, "URLs to listen on for clients' gRPC (http://127.0.0.1:2379)"),
    only("listen-client-http-urls", T, &[""], NO_HTTP),
    only("max-snapshots", N, &["5"], "KeelDB manages its own snapshot files"),
    only("max-wals", N, &["5"], "KeelDB has no WAL files (its Raft log is a KeelDB store)"),
    only("memory-mlock", B, &["false"], "KeelDB does not lock its pages in memory"),
    only("experimental-memory-mlock", B, &["false"], "KeelDB does not lock its pages in memory"),
    refused("quota-backend-bytes", N, "KeelDB has no space quota and raises no NOSPACE alarm"),
    only("backend-bbolt-freelist-type", T, &["", "map"], NO_BBOLT),
    only("backend-batch-interval", D, &["0s"], NO_BBOLT),
    only("backend-batch-limit", N, &["0"], NO_BBOLT),
    only("max-txn-ops", N, &["128"], "KeelDB's limit of operations per transaction is fixed at 128"),
    used("max-request-bytes", N, "largest client request, bytes (1572864)"),
    used("max-concurrent-streams", N, "concurrent gRPC streams per client connection (4294967295)"),
    refused("grpc-keepalive-min-time", D, "KeelDB does not police client pings"),
    only("grpc-keepalive-interval", D, &["0s"], "KeelDB sends no keepalive pings to clients"),
    only("grpc-keepalive-timeout", D, &["20s"], "KeelDB sends no keepalive pings to clients"),
    only("socket-reuse-port", B, &["false"], "KeelDB does not set SO_REUSEPORT"),
    only("socket-reuse-address", B, &["true"], "KeelDB's listeners always set SO_REUSEADDR"),
    only("enable-grpc-gateway", B, &["false"], NO_HTTP),
    only("raft-read-timeout", D, &["5s"], "KeelDB's peer links have their own timeouts"),
    only("raft-write-timeout", D, &["5s"], "KeelDB's peer links have their own timeouts"),
    Flag { name: "feature-gates", kind: T, support: Support::FeatureGates, etcd: true },
    // Clustering.
    used("initial-advertise-peer-urls", T, "this member's peer URLs as the others see them (http://127.0.0.1:2380)"),
    used("initial-cluster", T, "name=peer-url,... of the founding members (this member alone)"),
    used("initial-cluster-state", T, "new, or existing to join a running cluster"),
    used("initial-cluster-token", T, "part of the cluster id (etcd-cluster)"),
    used(
        "advertise-client-urls",
        T,
        "this member's client URLs as clients see them; required with --listen-client-urls",
    ),
    only("discovery", T, &[""], NO_DISCOVERY),
    only("discovery-token", T, &[""], NO_DISCOVERY),
    only("discovery-endpoints", T, &[""], NO_DISCOVERY),
    only("discovery-dial-timeout", D, &["2s"], NO_DISCOVERY),
    only("discovery-request-timeout", D, &["5s"], NO_DISCOVERY),
    only("discovery-keepalive-time", D, &["2s"], NO_DISCOVERY),
    only("discovery-keepalive-timeout", D, &["6s"], NO_DISCOVERY),
    only("discovery-insecure-transport", B, &["true"], NO_DISCOVERY),
    only("discovery-insecure-skip-tls-verify", B, &["false"], NO_DISCOVERY),
    only("discovery-cert", T, &[""], NO_DISCOVERY),
    only("discovery-key", T, &[""], NO_DISCOVERY),
    only("discovery-cacert", T, &[""], NO_DISCOVERY),
    only("discovery-user", T, &[""], NO_DISCOVERY),
    only("discovery-password", T, &[""], NO_DISCOVERY),
    only("discovery-fallback", T, &["exit"], NO_DISCOVERY),
    only("discovery-proxy", T, &[""], NO_DISCOVERY),
    only("discovery-srv", T, &[""], NO_DISCOVERY),
    only("discovery-srv-name", T, &[""], NO_DISCOVERY),
    used("strict-reconfig-check", B, "Reject member changes that could lose quorum (default true)"),
    used(
        "pre-vote",
        B,
        "Ask the others before campaigning, so a rejoining member cannot depose a leader (default true)",
    ),
    used("auto-compaction-retention", T, "history to keep before automatic compaction (0: off)"),
    used("auto-compaction-mode", T, "periodic (a duration or hours) or revision (a count)"),
    only(
        "v2-deprecation",
        T,
        &["write-only", "write-only-skip-check", "write-only-drop-data", "gone"],
        "KeelDB has no v2 store",
    ),
    // Security.
    used("cert-file", T, "certificate served on https client URLs (PEM)"),
    used("key-file", T, "key of --cert-file (PEM)"),
    used("client-cert-auth", B, "refuse clients without a certificate signed by --trusted-ca-file"),
    only("client-cert-file", T, &[""], TLS_FILES),
    only("client-key-file", T, &[""], TLS_FILES),
    used("client-crl-file", T, "Certificate revocation list (PEM or DER) for client certificates"),
    used("client-cert-allowed-hostname", T, "Comma-separated host names a client certificate must be valid for"),
    used("trusted-ca-file", T, "CA that signs client certificates (PEM)"),
    used("auto-tls", B, "self-signed client certificate in <data-dir>/fixtures/client when no --cert-file"),
    used("peer-cert-file", T, "certificate served on https peer URLs and presented when dialling (PEM)"),
    used("peer-key-file", T, "key of --peer-cert-file (PEM)"),
    used("peer-client-cert-auth", B, "refuse peers without a certificate signed by --peer-trusted-ca-file"),
    only("peer-client-cert-file", T, &[""], TLS_FILES),
    only("peer-client-key-file", T, &[""], TLS_FILES),
    used("peer-trusted-ca-file", T, "CA that signs the other members' certificates (PEM)"),
    used("peer-cert-allowed-cn", T, "Comma-separated common names a peer certificate must have one of"),
    used("peer-cert-allowed-hostname", T, "Comma-separated host names a peer certificate must be valid for"),
    used("peer-auto-tls", B, "self-signed peer certificate in <data-dir>/fixtures/peer; peers dialled unverified"),
    used("self-signed-cert-validity", N, "years the auto-TLS certificates are valid (1)"),
    used("peer-crl-file", T, "Certificate revocation list (PEM or DER) for peer certificates"),
    used("cipher-suites", T, "Comma-separated TLS 1.2 cipher suites (Go's names; ECDHE with AES-GCM or ChaCha20)"),
    only("cors", T, &["*"], NO_HTTP),
    only("host-whitelist", T, &["*"], NO_HTTP),
    used("tls-min-version", T, "Minimum TLS version: TLS1.2 or TLS1.3 (older ones are refused)"),
    used("tls-max-version", T, "Maximum TLS version: TLS1.2 or TLS1.3 (empty: the newest)"),
    only(
        "peer-skip-client-san-verification",
        B,
        &["true"],
        "KeelDB does not check a dialling member's certificate names against its address",
    ),
    only(
        "experimental-peer-skip-client-san-verification",
        B,
        &["true"],
        "KeelDB does not check a dialling member's certificate names against its address",
    ),
    // Auth.
    only("auth-token", T, &["simple"], "KeelDB issues its own opaque tokens (etcd's 'simple'), not JWTs"),
    only("bcrypt-cost", N, &["10"], "KeelDB hashes passwords with bcrypt cost 10"),
    used("auth-token-ttl", N, "seconds an auth token stays valid (300)"),
    // Profiling and monitoring.
    only("enable-pprof", B, &["false"], NO_HTTP),
    only("metrics", T, &["basic"], NO_HTTP),
    only("listen-metrics-urls", T, &[""], NO_HTTP),
    // Logging.
    only("logger", T, &["zap"], LOGS),
    only("log-outputs", T, &["default", "stderr"], LOGS),
    used("log-level", T, "debug, info, warn, error, panic or fatal; warn and above silence start and stop messages"),
    refused(
        "log-format",
        T,
        "KeelDB's stderr is plain text lines, except etcd's start-up lines (the ready line) in zap JSON",
    ),
    only("enable-log-rotation", B, &["false"], LOGS),
    only(
        "log-rotation-config-json",
        T,
        &[r#"{"maxsize": 100, "maxage": 0, "maxbackups": 0, "localtime": false, "compress": false}"#],
        LOGS,
    ),
    only("warning-unary-request-duration", D, &["0s", "300ms"], NO_SLOW_LOG),
    only("experimental-warning-unary-request-duration", D, &["0s", "300ms"], NO_SLOW_LOG),
    only("warning-apply-duration", D, &["100ms"], NO_SLOW_LOG),
    only("experimental-warning-apply-duration", D, &["0s", "100ms"], NO_SLOW_LOG),
    // Distributed tracing.
    only("experimental-enable-distributed-tracing", B, &["false"], NO_TRACING),
    only("enable-distributed-tracing", B, &["false"], NO_TRACING),
    only("experimental-distributed-tracing-address", T, &["localhost:4317"], NO_TRACING),
    only("distributed-tracing-address", T, &["localhost:4317"], NO_TRACING),
    only("experimental-distributed-tracing-service-name", T, &["etcd"], NO_TRACING),
    only("distributed-tracing-service-name", T, &["etcd"], NO_TRACING),
    only("experimental-distributed-tracing-instance-id", T, &[""], NO_TRACING),
    only("distributed-tracing-instance-id", T, &[""], NO_TRACING),
    only("experimental-distributed-tracing-sampling-rate", N, &["0"], NO_TRACING),
    only("distributed-tracing-sampling-rate", N, &["0"], NO_TRACING),
    // Experimental features.
    // etcd's e2e ctl tests pass it to every member (ctlCtx.applyOpts); see serve.rs.
    used(
        "experimental-initial-corrupt-check",
        B,
        "true only on a member's first start, where etcd's check has nothing to compare; refused on a member with data",
    ),
    only("experimental-corrupt-check-time", D, &["0s"], NO_CORRUPT_CHECK),
    only("corrupt-check-time", D, &["0s"], NO_CORRUPT_CHECK),
    only("experimental-compact-hash-check-enabled", B, &["false"], NO_CORRUPT_CHECK),
    only("experimental-compact-hash-check-time", D, &["1m"], NO_CORRUPT_CHECK),
    only("compact-hash-check-time", D, &["1m"], NO_CORRUPT_CHECK),
    only("experimental-enable-lease-checkpoint", B, &["false"], NO_LEASE_CHECKPOINT),
    only("experimental-enable-lease-checkpoint-persist", B, &["false"], NO_LEASE_CHECKPOINT),
    only("experimental-compaction-batch-limit", N, &["0", "1000"], "KeelDB compacts in its own batches"),
    only("compaction-batch-limit", N, &["0", "1000"], "KeelDB compacts in its own batches"),
    only("experimental-compaction-sleep-interval", D, &["0s", "10ms"], "KeelDB compacts in its own batches"),
    only("compaction-sleep-interval", D, &["0s", "10ms"], "KeelDB compacts in its own batches"),
    used("watch-progress-notify-interval", D, "progress notifications to idle watchers that asked (10m; 0: 10m)"),
    used("experimental-watch-progress-notify-interval", D, "the same; wins when given, as in etcd"),
    only("experimental-downgrade-check-time", D, &["5s"], "KeelDB has no downgrade mode"),
    only("downgrade-check-time", D, &["5s"], "KeelDB has no downgrade mode"),
    only("experimental-txn-mode-write-with-shared-buffer", B, &["true"], NO_BBOLT),
    only("experimental-stop-grpc-service-on-defrag", B, &["false"], NO_DEFRAG),
    only("experimental-bootstrap-defrag-threshold-megabytes", N, &["0"], NO_DEFRAG),
    only("bootstrap-defrag-threshold-megabytes", N, &["0"], NO_DEFRAG),
    refused("max-learners", N, "KeelDB does not limit the number of learners"),
    only(
        "experimental-snapshot-catchup-entries",
        N,
        &["1000"],
        "KeelDB keeps 1000 log entries behind a snapshot for slow followers",
    ),
    only(
        "snapshot-catchup-entries",
        N,
        &["1000"],
        "KeelDB keeps 1000 log entries behind a snapshot for slow followers",
    ),
    // Unsafe.
    only("force-new-cluster", B, &["false"], "KeelDB cannot force a new one-member cluster from a data dir"),
    only("unsafe-no-fsync", B, &["false"], "KeelDB always syncs its Raft log and state"),
    // etcdmain's own.
    only("config-file", T, &[""], "KeelDB reads no configuration file; give the flags"),
    used("version", B, "print etcd's version lines and KeelDB's, then exit"),
    // Flags etcd 3.6 accepts and ignores (old etcd 2 flags, Go test flags).
    ignored("cluster-active-size"),
    ignored("cluster-remove-delay"),
    ignored("cluster-sync-interval"),
    ignored("config"),
    ignored("force"),
    ignored("max-result-buffer"),
    ignored("max-retry-attempts"),
    ignored("peer-heartbeat-interval"),
    ignored("peer-election-timeout"),
    ignored("retry-interval"),
    ignored("snapshot"),
    ignored("v"),
    ignored("vv"),
    ignored("test.coverprofile"),
    ignored("test.outputdir"),
];

/// etcd 3.6.16's feature gates and their defaults (`--feature-gates=Name=bool,...`).
const FEATURE_GATES: &[(&str, bool)] = &[
    ("AllAlpha", false),
    ("AllBeta", false),
    ("CompactHashCheck", false),
    ("InitialCorruptCheck", false),
    ("LeaseCheckpoint", false),
    ("LeaseCheckpointPersist", false),
    ("SetMemberLocalAddr", false),
    ("StopGRPCServiceOnDefrag", false),
    ("TxnModeWriteWithSharedBuffer", true),
];

/// A command line KeelDB will not run with.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FlagError {
    /// Not a flag of etcd 3.6 (nor of KeelDB): etcd exits with the same complaint.
    Unknown { flag: String },
    /// An etcd flag, or a value of one, that KeelDB does not support.
    Refused { flag: &'static str, value: String, why: String },
    /// A value flag with nothing after it.
    MissingValue { flag: &'static str },
    /// A value that does not parse as the flag's kind.
    BadValue { flag: &'static str, value: String, why: String },
    /// `---x`, `-=x`: not a flag's syntax.
    BadSyntax { arg: String },
    /// An argument after the flags (etcd takes none).
    Positional { arg: String },
    /// `ETCD_<FLAG>` in the environment beside the same flag on the command line (etcd exits).
    EnvConflict { var: String },
}

impl fmt::Display for FlagError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FlagError::Unknown { flag } => write!(f, "flag provided but not defined: -{flag}"),
            FlagError::Refused { flag, value, why } => {
                write!(f, "--{flag}={value}: KeelDB does not support this etcd flag")?;
                match lookup(flag).map(|fl| fl.support) {
                    Some(Support::Only(values, _)) if !values.is_empty() => {
                        let list: Vec<String> = values.iter().map(|v| format!("{v:?}")).collect();
                        write!(f, " with this value (only {}): {why}", list.join(" or "))
                    }
                    _ => write!(f, ": {why}"),
                }
            }
            FlagError::MissingValue { flag } => write!(f, "flag needs an argument: -{flag}"),
            FlagError::BadValue { flag, value, why } => match lookup(flag).map(|fl| fl.kind) {
                Some(Kind::Bool) => write!(f, "invalid boolean value {value:?} for -{flag}: {why}"),
                _ => write!(f, "invalid value {value:?} for flag -{flag}: {why}"),
            },
            FlagError::BadSyntax { arg } => write!(f, "bad flag syntax: {arg}"),
            FlagError::Positional { arg } => write!(f, "{arg:?} is not a valid flag"),
            FlagError::EnvConflict { var } => write!(
                f,
                "conflicting environment variable {var} is shadowed by corresponding command-line flag \
                 (either unset environment variable or disable flag)"
            ),
        }
    }
}

impl std::error::Error for FlagError {}

/// The table's row for `name`.
pub fn lookup(name: &str) -> Option<&'static Flag> {
    FLAGS.iter().find(|f| f.name == name)
}

/// A parsed command line: the last value given for each flag.
#[derive(Debug, Default, Clone)]
pub struct Parsed {
    values: BTreeMap<&'static str, String>,
    /// `-h`, `-help` or `--help` was given.
    pub help: bool,
}

impl Parsed {
    /// The last value given for `name` (bool flags: "true" or "false").
    pub fn get(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }

    /// Whether a bool flag was given as true.
    pub fn is_true(&self, name: &str) -> bool {
        self.get(name) == Some("true")
    }
}

/// The environment variable that sets an etcd flag: `ETCD_` and the name in upper case with
/// `_` for `-` (etcd's `flags.FlagToEnv`).
pub fn env_name(flag: &str) -> String {
    format!("ETCD_{}", flag.to_uppercase().replace('-', "_"))
}

/// [`parse_with_env`] without an environment.
#[cfg(test)]
pub fn parse<S: AsRef<str>>(args: &[S]) -> Result<Parsed, FlagError> {
    parse_with_env(args, std::iter::empty())
}

/// Parses `args` (without the program or subcommand name) with Go's `flag` rules, then, as
/// etcd does, takes each etcd flag not on the command line from `ETCD_<FLAG>` in `env` (the
/// same flag in both is an error; unknown `ETCD_` variables are warned about), and checks every
/// value against [`FLAGS`]. Ignored legacy flags are reported on stderr, as etcd does.
pub fn parse_with_env<S: AsRef<str>>(
    args: &[S],
    env: impl Iterator<Item = (String, String)>,
) -> Result<Parsed, FlagError> {
    let mut parsed = parse_args(args)?;
    let on_command_line: Vec<&'static str> = parsed.values.keys().copied().collect();
    for (var, value) in env {
        if !var.starts_with("ETCD_") {
            continue;
        }
        if var == "ETCD_VERSION" {
            eprintln!(
                "keel: WARNING: cannot set special environment variable ETCD_VERSION={value} (ignored, as etcd does)"
            );
            continue;
        }
        let Some(flag) = FLAGS.iter().find(|f| f.etcd && env_name(f.name) == var) else {
            eprintln!("keel: WARNING: unrecognized environment variable {var}={value}");
            continue;
        };
        if on_command_line.contains(&flag.name) {
            return Err(FlagError::EnvConflict { var });
        }
        if value.is_empty() {
            continue;
        }
        let canonical = normalise(flag, &value)?;
        let value = if flag.kind == Kind::Bool { canonical } else { value };
        parsed.values.insert(flag.name, value);
    }
    check(&parsed)?;
    Ok(parsed)
}

/// The command line alone, Go's `flag` rules: the last value of each flag.
fn parse_args<S: AsRef<str>>(args: &[S]) -> Result<Parsed, FlagError> {
    let mut parsed = Parsed::default();
    let mut i = 0;
    while let Some(arg) = args.get(i).map(AsRef::as_ref) {
        i += 1;
        let Some(body) = arg.strip_prefix('-').filter(|b| !b.is_empty()) else {
            return Err(FlagError::Positional { arg: arg.to_string() });
        };
        let body = match body.strip_prefix('-') {
            Some("") => {
                // `--` ends the flags; etcd then refuses whatever follows.
                return match args.get(i) {
                    Some(rest) => Err(FlagError::Positional { arg: rest.as_ref().to_string() }),
                    None => Ok(parsed),
                };
            }
            Some(b) => b,
            None => body,
        };
        if body.starts_with('-') || body.starts_with('=') {
            return Err(FlagError::BadSyntax { arg: arg.to_string() });
        }
        let (name, inline) = match body.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (body, None),
        };
        let Some(flag) = lookup(name) else {
            if name == "h" || name == "help" {
                parsed.help = true;
                continue;
            }
            return Err(FlagError::Unknown { flag: name.to_string() });
        };
        let value = match (flag.kind, inline) {
            (_, Some(v)) => v.to_string(),
            (Kind::Bool, None) => "true".to_string(),
            (_, None) => {
                let v = args.get(i).ok_or(FlagError::MissingValue { flag: flag.name })?;
                i += 1;
                v.as_ref().to_string()
            }
        };
        // Checked now (etcd refuses a bad value at once); kept as given, except that bools
        // are kept as "true" or "false".
        let canonical = normalise(flag, &value)?;
        let value = if flag.kind == Kind::Bool { canonical } else { value };
        if let Support::IgnoredByEtcd = flag.support {
            eprintln!("keel: WARNING: flag {:?} is no longer supported (ignored, as etcd does).", flag.name);
        }
        parsed.values.insert(flag.name, value);
    }
    Ok(parsed)
}

/// Refuses every flag whose last value KeelDB cannot honour (the last value, since an earlier
/// one of a repeated flag never takes effect).
fn check(parsed: &Parsed) -> Result<(), FlagError> {
    for (name, value) in &parsed.values {
        let Some(flag) = lookup(name) else { continue };
        let refuse = |why: String| FlagError::Refused { flag: flag.name, value: value.clone(), why };
        match flag.support {
            Support::Used(_) | Support::IgnoredByEtcd => {}
            Support::Only(allowed, why) => {
                let given = normalise(flag, value)?;
                let ok = allowed.iter().any(|a| normalise(flag, a).is_ok_and(|a| a == given));
                if !ok {
                    return Err(refuse(why.to_string()));
                }
            }
            Support::FeatureGates => check_gates(value).map_err(refuse)?,
        }
    }
    Ok(())
}

/// `Name=bool,...`: every gate must be one of etcd's and keep its default.
fn check_gates(value: &str) -> Result<(), String> {
    for part in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (gate, on) = part.split_once('=').ok_or_else(|| format!("{part:?} is not Name=true|false"))?;
        let on = parse_bool(on.trim()).ok_or_else(|| format!("{part:?} is not Name=true|false"))?;
        match FEATURE_GATES.iter().find(|(g, _)| *g == gate.trim()) {
            None => return Err(format!("unknown feature gate {gate:?}")),
            Some((_, default)) if *default != on => {
                return Err(format!("KeelDB runs with {gate}={default} only"));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// A value in its canonical form, so that values compare as the flag's kind does (`1m` and
/// `1m0s`, `true` and `T`, `010` and `10`); an unparseable value is an error, as in etcd.
fn normalise(flag: &'static Flag, value: &str) -> Result<String, FlagError> {
    let bad = |why: &str| FlagError::BadValue { flag: flag.name, value: value.to_string(), why: why.to_string() };
    Ok(match flag.kind {
        Kind::Bool => match parse_bool(value) {
            Some(b) => b.to_string(),
            None => return Err(bad("parse error")),
        },
        Kind::Duration => format!("{}ns", parse_go_duration(value).ok_or_else(|| bad("parse error"))?),
        Kind::Number => parse_go_int(value).ok_or_else(|| bad("parse error"))?.to_string(),
        Kind::Text => value.to_string(),
    })
}

/// Go's `strconv.ParseBool`.
fn parse_bool(text: &str) -> Option<bool> {
    match text {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

/// Go's `strconv.ParseInt(text, 0, 64)`, which etcd's integer flags use: an optional sign,
/// then decimal, `0x` hex, `0o` or leading-`0` octal, or `0b` binary; `_` may separate digits
/// after a base prefix.
pub fn parse_go_int(text: &str) -> Option<i128> {
    let (negative, body) = match text.strip_prefix('-') {
        Some(b) => (true, b),
        None => (false, text.strip_prefix('+').unwrap_or(text)),
    };
    let lower = body.to_ascii_lowercase();
    let (radix, digits, prefixed) = if let Some(d) = lower.strip_prefix("0x") {
        (16, d.to_string(), true)
    } else if let Some(d) = lower.strip_prefix("0o") {
        (8, d.to_string(), true)
    } else if let Some(d) = lower.strip_prefix("0b") {
        (2, d.to_string(), true)
    } else if lower.len() > 1 && lower.starts_with('0') {
        (8, lower[1..].to_string(), true)
    } else {
        (10, lower, false)
    };
    let digits = if prefixed { digits.replace('_', "") } else { digits };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    let n = i128::from_str_radix(&digits, radix).ok()?;
    Some(if negative { -n } else { n })
}

/// Go's `time.ParseDuration`, in nanoseconds: a sequence of decimal numbers with units (`ns`,
/// `us`, `µs`, `ms`, `s`, `m`, `h`), optionally signed; a bare `0` is allowed.
pub fn parse_go_duration(text: &str) -> Option<i128> {
    let (negative, mut rest) = match text.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, text.strip_prefix('+').unwrap_or(text)),
    };
    if rest == "0" {
        return Some(0);
    }
    if rest.is_empty() {
        return None;
    }
    let mut total: f64 = 0.0;
    while !rest.is_empty() {
        let number_len = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        let (number, after) = rest.split_at(number_len);
        if number.is_empty() || number == "." {
            return None;
        }
        let n: f64 = number.parse().ok()?;
        let unit_len = after.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let scale = match unit {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            _ => return None,
        };
        total += n * scale;
        rest = after;
    }
    let ns = total.round() as i128;
    Some(if negative { -ns } else { ns })
}

/// `keel serve --help`: the flags KeelDB honours, then every other etcd flag with the values
/// it accepts.
pub fn help() -> String {
    let mut out = String::from(
        "Usage: keel serve [flags]   (or a keel binary named `etcd`: etcd [flags])\n\n\
         Runs a KeelDB cluster member with etcd 3.6's flags: `--flag value`, `--flag=value`,\n\
         `-flag value` (Go style); a repeated flag's last value wins; bool flags take no\n\
         separate value (`--auto-tls`, `--auto-tls=false`). A flag not on the command line may\n\
         come from ETCD_<FLAG> in the environment (ETCD_INITIAL_CLUSTER=...), as with etcd.\n\
         See docs/CLUSTER.md.\n\nHonoured:\n",
    );
    for f in FLAGS {
        if let Support::Used(help) = f.support {
            let own = if f.etcd { "" } else { " (KeelDB's own)" };
            out += &format!("  --{:<44} {help}{own}\n", f.name);
        }
    }
    out += "\nAccepted only with the value(s) meaning what KeelDB does; refused otherwise:\n";
    for f in FLAGS {
        match f.support {
            Support::Only(values, why) if !values.is_empty() => {
                let list: Vec<String> = values.iter().map(|v| format!("{v:?}")).collect();
                out += &format!("  --{} {}   ({why})\n", f.name, list.join(" | "));
            }
            Support::FeatureGates => out += "  --feature-gates   (only gates at their etcd 3.6 defaults)\n",
            _ => {}
        }
    }
    out += "\nRefused (KeelDB does not support them):\n";
    for f in FLAGS {
        if let Support::Only([], why) = f.support {
            out += &format!("  --{}   ({why})\n", f.name);
        }
    }
    out += "\nAccepted and ignored, as etcd 3.6 ignores them:\n ";
    for f in FLAGS.iter().filter(|f| matches!(f.support, Support::IgnoredByEtcd)) {
        out += &format!(" --{}", f.name);
    }
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// etcd 3.6.16's flags, as its own flag set lists them (see the file's header).
    const ETCD_FLAGS: &str = include_str!("../tests/data/etcd-3.6.16-flags.txt");

    fn etcd_flags() -> Vec<(&'static str, &'static str, &'static str)> {
        ETCD_FLAGS
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .map(|l| {
                let mut parts = l.splitn(3, '\t');
                let name = parts.next().unwrap();
                let kind = parts.next().unwrap();
                let default = parts.next().unwrap_or("");
                (name, kind, default)
            })
            .collect()
    }

    fn refused_flag(result: Result<Parsed, FlagError>) -> Option<&'static str> {
        match result {
            Err(FlagError::Refused { flag, .. }) => Some(flag),
            _ => None,
        }
    }

    #[test]
    fn every_etcd_flag_is_in_the_table_with_its_kind() {
        let list = etcd_flags();
        assert!(list.len() >= 150, "the fixture lists {} flags", list.len());
        for (name, kind, _) in &list {
            let flag = lookup(name).unwrap_or_else(|| panic!("etcd flag --{name} is not in FLAGS"));
            assert!(flag.etcd, "--{name} is etcd's");
            assert_eq!(flag.kind == Kind::Bool, *kind == "bool", "--{name}: bool or not as in etcd");
        }
        for flag in FLAGS.iter().filter(|f| f.etcd) {
            assert!(list.iter().any(|(n, _, _)| *n == flag.name), "--{} is not an etcd 3.6.16 flag", flag.name);
        }
    }

    /// Walks the whole etcd list: every flag, at etcd's default and at another value, is
    /// either parsed or refused by its own name with KeelDB's message.
    #[test]
    fn every_etcd_flag_is_parsed_or_refused_by_name() {
        for (name, kind, default) in etcd_flags() {
            let mut tries = vec![if kind == "bool" { format!("--{name}") } else { format!("--{name}={default}") }];
            tries.push(if kind == "bool" { format!("-{name}=false") } else { format!("-{name}=7") });
            for arg in tries {
                match parse(&[arg.as_str()]) {
                    Ok(p) => assert!(p.get(name).is_some(), "{arg}: parsed but not recorded"),
                    Err(e @ FlagError::Refused { flag, .. }) => {
                        assert_eq!(flag, name, "{arg}: refused under another name");
                        let text = e.to_string();
                        assert!(
                            text.contains(&format!("--{name}")) && text.contains("KeelDB does not support"),
                            "{text}"
                        );
                    }
                    // A value that is not of the flag's kind ("7" as a URL is fine, as a
                    // duration it is not) is refused by name too, as etcd refuses it.
                    Err(FlagError::BadValue { flag, .. }) => assert_eq!(flag, name, "{arg}"),
                    Err(other) => panic!("{arg}: {other}"),
                }
            }
        }
    }

    #[test]
    fn unknown_flags_are_refused_like_etcd() {
        assert_eq!(parse(&["--enable-v2=true"]).unwrap_err(), FlagError::Unknown { flag: "enable-v2".into() });
        assert_eq!(parse(&["--no-such"]).unwrap_err().to_string(), "flag provided but not defined: -no-such");
    }

    #[test]
    fn repeated_flags_take_the_last_value() {
        let p = parse(&[
            "--initial-cluster-token=a",
            "--name",
            "x",
            "--initial-cluster-token",
            "b",
            "--name=y",
            "--client-cert-auth",
            "--client-cert-auth=false",
        ])
        .unwrap();
        assert_eq!(p.get("initial-cluster-token"), Some("b"));
        assert_eq!(p.get("name"), Some("y"));
        assert_eq!(p.get("client-cert-auth"), Some("false"));
        // Only the last value counts for refusal too: a refused value overridden is fine,
        // and a fine value overridden by a refused one is refused.
        assert!(parse(&["--force-new-cluster=true", "--force-new-cluster=false"]).is_ok());
        assert_eq!(
            refused_flag(parse(&["--force-new-cluster=false", "--force-new-cluster"])),
            Some("force-new-cluster")
        );
    }

    #[test]
    fn go_style_single_dash_and_equals_forms() {
        let p = parse(&["-name", "x", "-data-dir=/d", "--listen-peer-urls", "http://a:1", "-auto-tls"]).unwrap();
        assert_eq!(p.get("name"), Some("x"));
        assert_eq!(p.get("data-dir"), Some("/d"));
        assert_eq!(p.get("listen-peer-urls"), Some("http://a:1"));
        assert!(p.is_true("auto-tls"));
        // A value flag takes the next argument whatever it looks like, as Go's flag does.
        assert_eq!(parse(&["--name", "--data-dir"]).unwrap().get("name"), Some("--data-dir"));
        // A bool flag never takes the next argument: etcd refuses the stray word.
        assert_eq!(parse(&["--auto-tls", "false"]).unwrap_err(), FlagError::Positional { arg: "false".into() });
        assert_eq!(parse(&["---name=x"]).unwrap_err(), FlagError::BadSyntax { arg: "---name=x".into() });
        assert_eq!(parse(&["-=x"]).unwrap_err(), FlagError::BadSyntax { arg: "-=x".into() });
        assert_eq!(parse(&["--name"]).unwrap_err(), FlagError::MissingValue { flag: "name" });
        // etcd's words for bad values.
        let bad_bool = parse(&["--auto-tls=maybe"]).unwrap_err();
        assert!(matches!(bad_bool, FlagError::BadValue { flag: "auto-tls", .. }));
        assert_eq!(bad_bool.to_string(), "invalid boolean value \"maybe\" for -auto-tls: parse error");
        let bad_duration = parse(&["--compact-hash-check-time=10x"]).unwrap_err().to_string();
        assert_eq!(bad_duration, "invalid value \"10x\" for flag -compact-hash-check-time: parse error");
        assert!(parse(&["-h"]).unwrap().help && parse(&["--help"]).unwrap().help);
        assert!(parse(&["--"]).is_ok());
        assert!(matches!(parse(&["--", "x"]).unwrap_err(), FlagError::Positional { .. }));
    }

    #[test]
    fn refused_flags_name_themselves() {
        for (args, name) in [
            (&["--quota-backend-bytes=8589934592"][..], "quota-backend-bytes"),
            (&["--auth-token", "jwt,pub-key=a,priv-key=b,sign-method=RS256"], "auth-token"),
            (&["--listen-client-http-urls=http://localhost:1"], "listen-client-http-urls"),
            (&["--force-new-cluster"], "force-new-cluster"),
            (&["--wal-dir", "/w"], "wal-dir"),
            (&["--feature-gates=InitialCorruptCheck=true"], "feature-gates"),
            (&["--feature-gates=NoSuchGate=false"], "feature-gates"),
        ] {
            let err = parse(args).unwrap_err();
            assert_eq!(refused_flag(Err(err.clone())), Some(name), "{args:?}");
            assert!(err.to_string().contains("KeelDB does not support"), "{err}");
        }
        // Values equal to what KeelDB does are accepted, in any of the kind's spellings.
        for args in [
            &["--strict-reconfig-check=false"][..],
            &["--strict-reconfig-check"],
            &["--experimental-initial-corrupt-check=F"],
            &["--compact-hash-check-time=60s"],
            &["--max-txn-ops=0x80"],
            &["--feature-gates=TxnModeWriteWithSharedBuffer=true,InitialCorruptCheck=false"],
            &["--snapshot", "--v"],
        ] {
            assert!(parse(args).is_ok(), "{args:?}");
        }
    }

    #[test]
    fn environment_sets_flags_not_on_the_command_line_as_etcd_does() {
        let env = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        assert_eq!(env_name("initial-cluster-token"), "ETCD_INITIAL_CLUSTER_TOKEN");
        let p = parse_with_env(
            &["--name=x"],
            env(&[
                ("ETCD_DATA_DIR", "/d"),
                ("ETCD_AUTO_TLS", "true"),
                ("ETCD_NO_SUCH_FLAG", "1"),
                ("ETCD_VERSION", "1"),
                ("ETCD_WAL_DIR", ""),
                ("HOME", "/root"),
            ])
            .into_iter(),
        )
        .unwrap();
        assert_eq!(p.get("data-dir"), Some("/d"));
        assert!(p.is_true("auto-tls"));
        assert_eq!(p.get("version"), None);
        assert_eq!(p.get("wal-dir"), None);
        // The same flag on both sides is refused, as etcd refuses it.
        let both = parse_with_env(&["--name=x"], env(&[("ETCD_NAME", "y")]).into_iter());
        assert_eq!(both.unwrap_err(), FlagError::EnvConflict { var: "ETCD_NAME".into() });
        // Values from the environment are checked like the command line's.
        let refused = parse_with_env(&["--name=x"], env(&[("ETCD_FORCE_NEW_CLUSTER", "true")]).into_iter());
        assert_eq!(refused_flag(refused), Some("force-new-cluster"));
        let bad = parse_with_env(&["--name=x"], env(&[("ETCD_AUTO_TLS", "yes")]).into_iter());
        assert!(matches!(bad, Err(FlagError::BadValue { flag: "auto-tls", .. })));
    }

    #[test]
    fn go_integers_parse_as_go_does() {
        assert_eq!(parse_go_int("128"), Some(128));
        assert_eq!(parse_go_int("0x80"), Some(128));
        assert_eq!(parse_go_int("0200"), Some(128));
        assert_eq!(parse_go_int("0o200"), Some(128));
        assert_eq!(parse_go_int("0b1000_0000"), Some(128));
        assert_eq!(parse_go_int("-5"), Some(-5));
        assert_eq!(parse_go_int("0"), Some(0));
        assert_eq!(parse_go_int("0128"), None);
        assert_eq!(parse_go_int("1_000"), None);
        assert_eq!(parse_go_int(" 5"), None);
        assert_eq!(parse_go_int(""), None);
    }

    #[test]
    fn go_durations_parse_as_go_does() {
        assert_eq!(parse_go_duration("1m0s"), Some(60_000_000_000));
        assert_eq!(parse_go_duration("1m"), parse_go_duration("60s"));
        assert_eq!(parse_go_duration("1.5h"), Some(5_400_000_000_000));
        assert_eq!(parse_go_duration("300ms"), Some(300_000_000));
        assert_eq!(parse_go_duration("2h0m0s"), Some(7_200_000_000_000));
        assert_eq!(parse_go_duration("0"), Some(0));
        assert_eq!(parse_go_duration("10"), None);
        assert_eq!(parse_go_duration("10x"), None);
        assert_eq!(parse_go_duration(""), None);
    }

    #[test]
    fn help_lists_every_flag() {
        let text = help();
        for f in FLAGS {
            assert!(text.contains(&format!("--{}", f.name)), "--{} missing from help", f.name);
        }
    }
}
