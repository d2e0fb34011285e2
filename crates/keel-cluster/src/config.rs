//! A member's configuration: etcd's member flags, parsed and checked, and the ids derived from
//! them.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use keeldb::fs::{FileSystem, StdFs};

use crate::types::Member;

/// etcd's simple-token lifetime (`--auth-token-ttl`, seconds).
pub const TOKEN_TTL_S: u64 = 300;

/// How many bytes of weakly ordered CURP commands a member queues at most (the default of
/// `curp_weak_queue_bytes`).
pub const CURP_WEAK_MAX_QUEUED_BYTES: usize = 64 << 20;

/// Errors in a member's configuration or data directory.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A flag value that cannot be used.
    #[error("invalid {flag}: {why}")]
    Invalid { flag: &'static str, why: String },
    /// The data directory was made by another cluster or for another member.
    #[error("data dir {dir} belongs to {found}, not to {expected}; use a new --data-dir or the original flags")]
    ForeignDataDir { dir: String, found: String, expected: String },
    /// I/O on the data directory.
    #[error("data dir {dir}: {source}")]
    Io { dir: String, source: std::io::Error },
    /// A certificate, key or CA file that cannot be read or used.
    #[error("{flag} {path}: {why}")]
    Tls { flag: &'static str, path: String, why: String },
}

/// etcd's TLS flags for one kind of traffic (clients, or peers). Empty means plaintext only.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// This member's certificate chain (PEM), presented to whoever connects; on peer links
    /// also presented when this member dials another (for `--peer-client-cert-auth`).
    pub cert_file: Option<PathBuf>,
    /// The private key of `cert_file` (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key_file: Option<PathBuf>,
    /// CA certificates (PEM) that sign the other side's certificates: clients' for
    /// `client_cert_auth`; on peer links also the other members' server certificates.
    pub trusted_ca_file: Option<PathBuf>,
    /// Refuse a TLS connection whose certificate is missing or not signed by `trusted_ca_file`.
    pub client_cert_auth: bool,
    /// Certificates revoked by this list (PEM or DER) are refused (`--client-crl-file`,
    /// `--peer-crl-file`). Read when the member starts.
    pub crl_file: Option<PathBuf>,
    /// Only certificates with one of these subject common names are accepted
    /// (`--peer-cert-allowed-cn`; peers only).
    pub allowed_cns: Vec<String>,
    /// Only certificates valid for one of these host names or IP addresses are accepted
    /// (`--peer-cert-allowed-hostname`, `--client-cert-allowed-hostname`).
    pub allowed_hostnames: Vec<String>,
    /// `--tls-min-version` / `--tls-max-version`: `TLS1.2` or `TLS1.3` (empty: TLS1.2 and the
    /// newest); etcd's older versions are refused at start.
    pub min_version: String,
    pub max_version: String,
    /// `--cipher-suites`: Go's names of the suites allowed (empty: every suite rustls has).
    pub cipher_suites: Vec<String>,
    /// Dial without verifying the other side's certificate: set with `--peer-auto-tls`, whose
    /// self-signed certificates no CA vouches for (etcd dials them the same way). Encryption
    /// only; `trusted_ca_file` is then not needed for https peer URLs.
    pub insecure_skip_verify: bool,
}

/// The flag names of one [`TlsFiles`], for error messages.
#[derive(Debug, Clone, Copy)]
pub struct TlsFlags {
    pub cert_file: &'static str,
    pub key_file: &'static str,
    pub trusted_ca_file: &'static str,
    pub client_cert_auth: &'static str,
    pub crl_file: &'static str,
    pub allowed_cns: &'static str,
    pub allowed_hostnames: &'static str,
}

/// etcd's flags for client TLS.
pub const CLIENT_TLS_FLAGS: TlsFlags = TlsFlags {
    cert_file: "--cert-file",
    key_file: "--key-file",
    trusted_ca_file: "--trusted-ca-file",
    client_cert_auth: "--client-cert-auth",
    crl_file: "--client-crl-file",
    allowed_cns: "--client-cert-allowed-cn",
    allowed_hostnames: "--client-cert-allowed-hostname",
};

/// etcd's flags for peer TLS.
pub const PEER_TLS_FLAGS: TlsFlags = TlsFlags {
    cert_file: "--peer-cert-file",
    key_file: "--peer-key-file",
    trusted_ca_file: "--peer-trusted-ca-file",
    client_cert_auth: "--peer-client-cert-auth",
    crl_file: "--peer-crl-file",
    allowed_cns: "--peer-cert-allowed-cn",
    allowed_hostnames: "--peer-cert-allowed-hostname",
};

/// Whether a URL asks for a Unix domain socket (`unix://path`, `unixs://path` with TLS): as
/// etcd, everything after the scheme is the socket's file name (`unix://localhost:2379` is the
/// file `localhost:2379` in the working directory).
pub fn is_unix(url: &str) -> bool {
    url.starts_with("unix://") || url.starts_with("unixs://")
}

/// Whether a URL asks for TLS.
pub fn is_https(url: &str) -> bool {
    url.starts_with("https://") || url.starts_with("unixs://")
}

impl TlsFiles {
    /// Checks the flags against each other and against the URLs that use them (`urls`: flag
    /// name and URLs). An https URL needs a certificate and key (and, on peer links, a CA to
    /// verify other members); cert flags beside only http URLs are allowed, as in etcd.
    fn validate(&self, flags: TlsFlags, urls: &[(&'static str, &[String])], peer: bool) -> Result<(), ConfigError> {
        match (&self.cert_file, &self.key_file) {
            (Some(_), None) => {
                return Err(ConfigError::Invalid {
                    flag: flags.key_file,
                    why: format!("is required with {}", flags.cert_file),
                })
            }
            (None, Some(_)) => {
                return Err(ConfigError::Invalid {
                    flag: flags.cert_file,
                    why: format!("is required with {}", flags.key_file),
                })
            }
            _ => {}
        }
        if !self.allowed_cns.is_empty() && !self.allowed_hostnames.is_empty() {
            return Err(ConfigError::Invalid {
                flag: flags.allowed_cns,
                why: format!("and {} are mutually exclusive", flags.allowed_hostnames),
            });
        }
        for (flag, version) in [("--tls-min-version", &self.min_version), ("--tls-max-version", &self.max_version)] {
            if !matches!(version.as_str(), "" | "TLS1.2" | "TLS1.3") {
                return Err(ConfigError::Invalid {
                    flag,
                    why: format!("{version:?}: KeelDB supports TLS1.2 and TLS1.3 (rustls has no older versions)"),
                });
            }
        }
        if self.min_version == "TLS1.3" && self.max_version == "TLS1.2" {
            return Err(ConfigError::Invalid { flag: "--tls-min-version", why: "is above --tls-max-version".into() });
        }
        if self.client_cert_auth && self.trusted_ca_file.is_none() {
            return Err(ConfigError::Invalid {
                flag: flags.client_cert_auth,
                why: format!("needs {} (the CA that signs the certificates to accept)", flags.trusted_ca_file),
            });
        }
        for (flag, list) in urls {
            let Some(url) = list.iter().find(|u| is_https(u)) else { continue };
            if self.cert_file.is_none() {
                return Err(ConfigError::Invalid {
                    flag: flags.cert_file,
                    why: format!("is required by the https URL {url} in {flag}"),
                });
            }
            if peer && self.trusted_ca_file.is_none() && !self.insecure_skip_verify {
                return Err(ConfigError::Invalid {
                    flag: flags.trusted_ca_file,
                    why: format!(
                        "is required by the https URL {url} in {flag}: members verify each other against it \
                         (KeelDB does not use the system's roots)"
                    ),
                });
            }
        }
        Ok(())
    }
}

/// How a member starts, as etcd's flags say.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub name: String,
    pub data_dir: PathBuf,
    pub listen_client_urls: Vec<String>,
    pub advertise_client_urls: Vec<String>,
    pub listen_peer_urls: Vec<String>,
    pub initial_advertise_peer_urls: Vec<String>,
    /// `name=peer-url[,name=peer-url...]`, parsed.
    pub initial_cluster: BTreeMap<String, Vec<String>>,
    pub initial_cluster_token: String,
    /// `true` for `--initial-cluster-state existing` (joining a running cluster).
    pub join_existing: bool,
    pub heartbeat_interval: Duration,
    pub election_timeout: Duration,
    /// Applied entries between snapshots (etcd's `--snapshot-count`): a floor, see
    /// `snapshot_bytes_percent`.
    pub snapshot_count: u64,
    /// A snapshot also waits until the entries applied since the last one carry this share of
    /// its size, in percent (`--snapshot-bytes-percent`, 50; 0: the count alone decides). A
    /// snapshot writes the whole state, so this keeps its cost in proportion to the writes
    /// (`state_machine::snapshot_due`).
    pub snapshot_bytes_percent: u64,
    /// Largest request a client may send (etcd's `--max-request-bytes`).
    pub max_request_bytes: usize,
    /// How long an auth token stays valid (etcd's `--auth-token-ttl`, 300 s).
    pub auth_token_ttl: Duration,
    /// TLS for client traffic (`--cert-file`, `--key-file`, `--trusted-ca-file`,
    /// `--client-cert-auth`); used by the https URLs in `listen_client_urls`.
    pub client_tls: TlsFiles,
    /// TLS for peer traffic (`--peer-cert-file` ...); used by https peer URLs.
    pub peer_tls: TlsFiles,
    /// The file system every file under `data_dir` goes through: the Raft log and state
    /// machine stores, the identity and snapshot files. The real one ([`StdFs`]) unless a test
    /// or an embedding program gives another (the in-process cluster tests give each member a
    /// simulated disk from `keel-testkit`). No flag sets it.
    pub fs: Arc<dyn FileSystem>,
    /// `--auto-compaction-mode` and `--auto-compaction-retention` (off by default, as etcd).
    pub auto_compaction: AutoCompaction,
    /// How often the compactor looks, instead of the mode's own interval (tests; no flag).
    pub auto_compaction_interval: Option<Duration>,
    /// How often an idle watcher that asked for progress notifications gets one (etcd's
    /// `--watch-progress-notify-interval`, 10 minutes).
    pub watch_progress_notify_interval: Duration,
    /// Bytes of CURP weak writes (request bodies) this member may hold queued for the leader
    /// over all sessions (`curp::weak`; 64 MiB; no flag).
    pub curp_weak_queue_bytes: usize,
    /// etcd's `--strict-reconfig-check` (default true): refuse a member add, remove or promote
    /// that would leave fewer started or connected members than a quorum (`reconfig`).
    pub strict_reconfig_check: bool,
    /// Concurrent gRPC streams one client connection may hold open (etcd's
    /// `--max-concurrent-streams`, unlimited: 2^32 - 1).
    pub max_concurrent_streams: u32,
    /// Whether a member whose election timer fires first asks the others whether they would
    /// vote for it, and campaigns only if a quorum would (etcd's `--pre-vote`, on by default):
    /// a member rejoining after a partition then does not depose a healthy leader.
    pub pre_vote: bool,
}

impl Default for ServeConfig {
    /// A one-member cluster on loopback, like a bare `etcd`.
    fn default() -> Self {
        let name = "default".to_string();
        let peer = "http://127.0.0.1:2380".to_string();
        ServeConfig {
            data_dir: PathBuf::from("default.keel"),
            listen_client_urls: vec!["http://127.0.0.1:2379".into()],
            advertise_client_urls: vec!["http://127.0.0.1:2379".into()],
            listen_peer_urls: vec![peer.clone()],
            initial_advertise_peer_urls: vec![peer.clone()],
            initial_cluster: BTreeMap::from([(name.clone(), vec![peer])]),
            initial_cluster_token: "keel-cluster".into(),
            join_existing: false,
            heartbeat_interval: Duration::from_millis(100),
            election_timeout: Duration::from_millis(1000),
            snapshot_count: 10_000,
            snapshot_bytes_percent: 50,
            max_request_bytes: 1536 * 1024,
            auth_token_ttl: Duration::from_secs(TOKEN_TTL_S),
            client_tls: TlsFiles::default(),
            peer_tls: TlsFiles::default(),
            fs: Arc::new(StdFs),
            auto_compaction: AutoCompaction::Off,
            auto_compaction_interval: None,
            watch_progress_notify_interval: Duration::from_secs(600),
            curp_weak_queue_bytes: CURP_WEAK_MAX_QUEUED_BYTES,
            max_concurrent_streams: u32::MAX,
            strict_reconfig_check: true,
            pre_vote: true,
            name,
        }
    }
}

/// Parses `--initial-cluster`: `n1=http://a:2380,n2=http://b:2380` (a name may repeat for
/// several URLs, as in etcd).
pub fn parse_initial_cluster(text: &str) -> Result<BTreeMap<String, Vec<String>>, ConfigError> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, url) = part.split_once('=').ok_or_else(|| ConfigError::Invalid {
            flag: "--initial-cluster",
            why: format!("{part:?} is not name=url"),
        })?;
        check_url("--initial-cluster", url)?;
        out.entry(name.to_string()).or_default().push(url.to_string());
    }
    if out.is_empty() {
        return Err(ConfigError::Invalid { flag: "--initial-cluster", why: "names no member".into() });
    }
    Ok(out)
}

/// Accepts `http://host:port` and `https://host:port`.
pub fn check_url(flag: &'static str, url: &str) -> Result<(), ConfigError> {
    // (peer URLs given by clients, `member add`, never name a unix socket: see `validate`.)
    if let Some(path) = url.strip_prefix("unix://").or_else(|| url.strip_prefix("unixs://")) {
        if path.is_empty() {
            return Err(ConfigError::Invalid { flag, why: format!("{url:?} names no socket file") });
        }
        return Ok(());
    }
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .ok_or_else(|| ConfigError::Invalid { flag, why: format!("{url:?} is not an http:// or https:// URL") })?;
    let rest = rest.trim_end_matches('/');
    let (host, port) =
        rest.rsplit_once(':').ok_or_else(|| ConfigError::Invalid { flag, why: format!("{url:?} has no port") })?;
    if host.is_empty() || port.parse::<u16>().is_err() {
        return Err(ConfigError::Invalid { flag, why: format!("{url:?} has no valid host:port") });
    }
    Ok(())
}

/// A member's id exactly as etcd computes it (`computeMemberID`): the first eight bytes,
/// big-endian, of SHA-1 over the member's peer URLs sorted and concatenated, then the cluster
/// token, then, for a member added to a running cluster, the Unix time of the add in decimal
/// (so re-adding the same URLs gives a new id). The name takes no part. The same flags give
/// the same ids as etcd, and output that embeds them matches.
pub fn member_id(peer_urls: &[String], token: &str, added_at_unix_s: Option<u64>) -> u64 {
    use sha1::Digest;
    let mut urls: Vec<&str> = peer_urls.iter().map(String::as_str).collect();
    urls.sort_unstable();
    let mut h = sha1::Sha1::new();
    h.update(urls.concat().as_bytes());
    h.update(token.as_bytes());
    if let Some(t) = added_at_unix_s {
        h.update(t.to_string().as_bytes());
    }
    first_u64(&h.finalize())
}

/// A cluster's id exactly as etcd computes it (`genID`): the first eight bytes, big-endian, of
/// SHA-1 over the sorted member ids, each as eight big-endian bytes.
pub fn cluster_id(member_ids: impl IntoIterator<Item = u64>) -> u64 {
    use sha1::Digest;
    let mut ids: Vec<u64> = member_ids.into_iter().collect();
    ids.sort_unstable();
    let mut h = sha1::Sha1::new();
    for id in ids {
        h.update(id.to_be_bytes());
    }
    first_u64(&h.finalize())
}

/// The first eight bytes of a digest as a big-endian number; zero (etcd's "no member") as one.
fn first_u64(digest: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(digest.get(..8).unwrap_or(&[0; 8]));
    u64::from_be_bytes(b).max(1)
}

impl ServeConfig {
    /// Checks the flags against each other.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.name.is_empty() {
            return Err(ConfigError::Invalid { flag: "--name", why: "is empty".into() });
        }
        for (flag, urls) in [
            ("--listen-client-urls", &self.listen_client_urls),
            ("--advertise-client-urls", &self.advertise_client_urls),
            ("--listen-peer-urls", &self.listen_peer_urls),
            ("--initial-advertise-peer-urls", &self.initial_advertise_peer_urls),
        ] {
            if urls.is_empty() {
                return Err(ConfigError::Invalid { flag, why: "names no URL".into() });
            }
            for u in urls {
                check_url(flag, u)?;
            }
        }
        let mine = self.initial_cluster.get(&self.name).ok_or_else(|| ConfigError::Invalid {
            flag: "--initial-cluster",
            why: format!("does not name this member ({:?})", self.name),
        })?;
        let mut a = mine.clone();
        let mut b = self.initial_advertise_peer_urls.clone();
        a.sort();
        b.sort();
        if a != b {
            return Err(ConfigError::Invalid {
                flag: "--initial-cluster",
                why: format!("lists {:?} for {:?} but --initial-advertise-peer-urls is {:?}", mine, self.name, b),
            });
        }
        self.client_tls.validate(
            CLIENT_TLS_FLAGS,
            &[
                ("--listen-client-urls", &self.listen_client_urls),
                ("--advertise-client-urls", &self.advertise_client_urls),
            ],
            false,
        )?;
        let cluster_urls: Vec<String> = self.initial_cluster.values().flatten().cloned().collect();
        self.peer_tls.validate(
            PEER_TLS_FLAGS,
            &[
                ("--listen-peer-urls", &self.listen_peer_urls),
                ("--initial-advertise-peer-urls", &self.initial_advertise_peer_urls),
                ("--initial-cluster", &cluster_urls),
            ],
            true,
        )?;
        if self.election_timeout < self.heartbeat_interval * 5 {
            return Err(ConfigError::Invalid {
                flag: "--election-timeout",
                why: "must be at least 5 × --heartbeat-interval".into(),
            });
        }
        Ok(())
    }

    /// This member's id.
    pub fn member_id(&self) -> u64 {
        // etcd takes the member's own entry of --initial-cluster (it must match the advertised
        // peer URLs, which validate() checks).
        let urls = self
            .initial_cluster
            .iter()
            .find(|(name, _)| **name == self.name)
            .map_or(&self.initial_advertise_peer_urls, |(_, urls)| urls);
        member_id(urls, &self.initial_cluster_token, None)
    }

    /// The cluster id: from the token and the initial members.
    pub fn cluster_id(&self) -> u64 {
        // A joining member learns the real id from the cluster (node.rs: resolve_identity).
        cluster_id(self.initial_members().into_keys())
    }

    /// The initial members with their ids (clients' URLs are known only for this member).
    pub fn initial_members(&self) -> BTreeMap<u64, Member> {
        self.initial_cluster
            .iter()
            .map(|(name, urls)| {
                let client_urls = if *name == self.name { self.advertise_client_urls.clone() } else { Vec::new() };
                (
                    member_id(urls, &self.initial_cluster_token, None),
                    Member { name: name.clone(), peer_urls: urls.clone(), client_urls },
                )
            })
            .collect()
    }

    /// This member as others see it.
    pub fn me(&self) -> Member {
        Member {
            name: self.name.clone(),
            peer_urls: self.initial_advertise_peer_urls.clone(),
            client_urls: self.advertise_client_urls.clone(),
        }
    }
}

/// What `--auto-compaction-*` asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AutoCompaction {
    /// Retention 0: no automatic compaction (etcd's default).
    #[default]
    Off,
    /// Keep this much time of history.
    Periodic(Duration),
    /// Keep this many revisions of history.
    Revisions(i64),
}

impl AutoCompaction {
    /// Parses etcd's flags: mode `periodic` (the default) takes a duration (`90s`, `30m`,
    /// `1h`) or a bare number of hours; mode `revision` takes a number of revisions. `0`
    /// turns compaction off in either mode.
    pub fn parse(mode: &str, retention: &str) -> Result<AutoCompaction, ConfigError> {
        let bad = |why: &str| ConfigError::Invalid { flag: "--auto-compaction-retention", why: why.to_string() };
        let retention = retention.trim();
        match mode {
            "periodic" => {
                let d = parse_duration(retention).ok_or_else(|| {
                    bad(&format!("{retention:?} is not a duration (like 30m, 1h) or a number of hours"))
                })?;
                Ok(if d.is_zero() { AutoCompaction::Off } else { AutoCompaction::Periodic(d) })
            }
            "revision" => {
                let n: i64 = retention
                    .parse()
                    .ok()
                    .filter(|n| *n >= 0)
                    .ok_or_else(|| bad(&format!("{retention:?} is not a number of revisions")))?;
                Ok(if n == 0 { AutoCompaction::Off } else { AutoCompaction::Revisions(n) })
            }
            other => Err(ConfigError::Invalid {
                flag: "--auto-compaction-mode",
                why: format!("{other:?} is neither periodic nor revision"),
            }),
        }
    }
}

/// `1h`, `30m`, `90s`, `500ms`, `1h30m`, or a bare number of hours (etcd's periodic unit).
fn parse_duration(text: &str) -> Option<Duration> {
    if let Ok(hours) = text.parse::<u64>() {
        return hours.checked_mul(3600).map(Duration::from_secs);
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit())?;
        if digits == 0 {
            return None;
        }
        let n: u64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let unit = match &rest[..unit_len] {
            "h" => Duration::from_secs(3600),
            "m" => Duration::from_secs(60),
            "s" => Duration::from_secs(1),
            "ms" => Duration::from_millis(1),
            _ => return None,
        };
        total = total.checked_add(unit.checked_mul(u32::try_from(n).ok()?)?)?;
        rest = &rest[unit_len..];
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initial_cluster_parses_and_rejects_bad_members() {
        let c = parse_initial_cluster("a=http://127.0.0.1:1,b=http://127.0.0.1:2").unwrap_or_default();
        assert_eq!(c.len(), 2);
        assert!(parse_initial_cluster("a").is_err());
        assert!(parse_initial_cluster("a=ftp://x:1").is_err());
        assert!(parse_initial_cluster("a=http://x").is_err());
        assert!(parse_initial_cluster("").is_err());
    }

    /// The ids etcd 3.6.16 gave `--name n1 --initial-cluster-token tok-x --initial-cluster
    /// n1=http://127.0.0.1:23801,n2=http://127.0.0.1:23802,n3=http://127.0.0.1:23803` (from its
    /// log: local-member-id, added-peer-id, cluster-id).
    #[test]
    fn ids_are_the_ones_etcd_derives_from_the_same_flags() {
        let mut c = ServeConfig {
            name: "n1".into(),
            initial_cluster_token: "tok-x".into(),
            initial_advertise_peer_urls: vec!["http://127.0.0.1:23801".into()],
            ..ServeConfig::default()
        };
        c.initial_cluster =
            parse_initial_cluster("n1=http://127.0.0.1:23801,n2=http://127.0.0.1:23802,n3=http://127.0.0.1:23803")
                .unwrap();
        assert_eq!(c.member_id(), 0x3f87d1e9930d82d9);
        let ids: Vec<u64> = c.initial_members().into_keys().collect();
        assert_eq!(ids, vec![0x2ce5679b4e0d6116, 0x3f87d1e9930d82d9, 0xad16c60c0e4f80f4]);
        assert_eq!(c.cluster_id(), 0x834f70e5e236bc3d);
        // An added member's id also depends on when it was added; the name never counts.
        let urls = vec!["http://127.0.0.1:2380".to_string()];
        assert_ne!(member_id(&urls, "t", Some(1)), member_id(&urls, "t", Some(2)));
        assert_ne!(member_id(&urls, "t1", None), member_id(&urls, "t2", None));
    }

    #[test]
    fn a_member_missing_from_the_initial_cluster_is_refused() {
        let mut c = ServeConfig::default();
        assert!(c.validate().is_ok());
        c.name = "other".into();
        assert!(matches!(c.validate(), Err(ConfigError::Invalid { flag: "--initial-cluster", .. })));
    }

    #[test]
    fn tls_versions_and_allowed_names_are_checked_at_start() {
        let mut c = ServeConfig::default();
        c.peer_tls.min_version = "TLS1.1".into();
        assert!(matches!(c.validate(), Err(ConfigError::Invalid { flag: "--tls-min-version", .. })));
        c.peer_tls.min_version = "TLS1.3".into();
        c.peer_tls.max_version = "TLS1.2".into();
        assert!(matches!(c.validate(), Err(ConfigError::Invalid { flag: "--tls-min-version", .. })));
        c.peer_tls.max_version = String::new();
        assert!(c.validate().is_ok());
        c.peer_tls.allowed_cns = vec!["a".into()];
        c.peer_tls.allowed_hostnames = vec!["b".into()];
        assert!(matches!(c.validate(), Err(ConfigError::Invalid { flag: "--peer-cert-allowed-cn", .. })));
        c.peer_tls.allowed_hostnames.clear();
        // Peer links run over Unix sockets too, as etcd's (`unix://host:port` names a file).
        c.listen_peer_urls = vec!["unix://localhost:20001".into()];
        c.initial_advertise_peer_urls = c.listen_peer_urls.clone();
        c.initial_cluster.insert(c.name.clone(), c.listen_peer_urls.clone());
        assert!(c.validate().is_ok(), "{:?}", c.validate());
    }

    #[test]
    fn https_urls_need_their_tls_flags_and_http_urls_allow_them() {
        let files = TlsFiles {
            cert_file: Some("c.pem".into()),
            key_file: Some("k.pem".into()),
            trusted_ca_file: Some("ca.pem".into()),
            client_cert_auth: true,
            ..TlsFiles::default()
        };
        let invalid_flag = |c: &ServeConfig| match c.validate() {
            Err(ConfigError::Invalid { flag, .. }) => Some(flag),
            _ => None,
        };
        // Cert flags beside http URLs: allowed, as in etcd.
        let mut c = ServeConfig { client_tls: files.clone(), peer_tls: files.clone(), ..ServeConfig::default() };
        assert!(c.validate().is_ok());
        c.listen_client_urls = vec!["https://127.0.0.1:2379".into()];
        assert!(c.validate().is_ok());
        c.client_tls.cert_file = None;
        assert_eq!(invalid_flag(&c), Some("--cert-file"));
        c.client_tls = TlsFiles { key_file: None, ..files.clone() };
        assert_eq!(invalid_flag(&c), Some("--key-file"));
        c.client_tls = TlsFiles { trusted_ca_file: None, ..files.clone() };
        assert_eq!(invalid_flag(&c), Some("--client-cert-auth"));
        c.client_tls = TlsFiles { trusted_ca_file: None, client_cert_auth: false, ..files.clone() };
        assert!(c.validate().is_ok());
        // A peer in --initial-cluster with an https URL needs a CA to verify it.
        c.initial_cluster.insert("other".into(), vec!["https://127.0.0.2:2380".into()]);
        c.peer_tls = TlsFiles { trusted_ca_file: None, client_cert_auth: false, ..files.clone() };
        assert_eq!(invalid_flag(&c), Some("--peer-trusted-ca-file"));
        c.peer_tls = TlsFiles::default();
        assert_eq!(invalid_flag(&c), Some("--peer-cert-file"));
        // --peer-auto-tls: self-signed certificates, dialled without a CA.
        c.peer_tls =
            TlsFiles { trusted_ca_file: None, client_cert_auth: false, insecure_skip_verify: true, ..files.clone() };
        assert!(c.validate().is_ok());
        c.peer_tls = files;
        assert!(c.validate().is_ok());
    }
}
