//! A member's configuration: etcd's member flags, parsed and checked, and the ids derived from
//! them.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use keeldb::fs::{FileSystem, StdFs};

use crate::types::Member;

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
}

/// The flag names of one [`TlsFiles`], for error messages.
#[derive(Debug, Clone, Copy)]
pub struct TlsFlags {
    pub cert_file: &'static str,
    pub key_file: &'static str,
    pub trusted_ca_file: &'static str,
    pub client_cert_auth: &'static str,
}

/// etcd's flags for client TLS.
pub const CLIENT_TLS_FLAGS: TlsFlags = TlsFlags {
    cert_file: "--cert-file",
    key_file: "--key-file",
    trusted_ca_file: "--trusted-ca-file",
    client_cert_auth: "--client-cert-auth",
};

/// etcd's flags for peer TLS.
pub const PEER_TLS_FLAGS: TlsFlags = TlsFlags {
    cert_file: "--peer-cert-file",
    key_file: "--peer-key-file",
    trusted_ca_file: "--peer-trusted-ca-file",
    client_cert_auth: "--peer-client-cert-auth",
};

/// Whether a URL asks for TLS.
pub fn is_https(url: &str) -> bool {
    url.starts_with("https://")
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
            if peer && self.trusted_ca_file.is_none() {
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
    pub auto_compaction: crate::compactor::AutoCompaction,
    /// How often the compactor looks, instead of the mode's own interval (tests; no flag).
    pub auto_compaction_interval: Option<Duration>,
    /// How often an idle watcher that asked for progress notifications gets one (etcd's
    /// `--watch-progress-notify-interval`, 10 minutes).
    pub watch_progress_notify_interval: Duration,
    /// Bytes of CURP weak writes (request bodies) this member may hold queued for the leader
    /// over all sessions (`curp::weak`; 64 MiB; no flag).
    pub curp_weak_queue_bytes: usize,
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
            auth_token_ttl: Duration::from_secs(crate::auth::TOKEN_TTL_S),
            client_tls: TlsFiles::default(),
            peer_tls: TlsFiles::default(),
            fs: Arc::new(StdFs),
            auto_compaction: crate::compactor::AutoCompaction::Off,
            auto_compaction_interval: None,
            watch_progress_notify_interval: Duration::from_secs(600),
            curp_weak_queue_bytes: crate::curp::weak::MAX_QUEUED_BYTES,
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

fn hash(parts: &[&str]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update(&[0]);
    }
    // Zero means "no member" in etcd's API.
    h.digest().max(1)
}

/// A member's id: from its name, peer URLs and the cluster token (etcd derives it from the
/// URLs and token the same way, so restarting with the same flags gives the same id).
pub fn member_id(name: &str, peer_urls: &[String], token: &str) -> u64 {
    let mut parts = vec![token, name];
    parts.extend(peer_urls.iter().map(String::as_str));
    hash(&parts)
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
        member_id(&self.name, &self.initial_advertise_peer_urls, &self.initial_cluster_token)
    }

    /// The cluster id: from the token and the initial members.
    pub fn cluster_id(&self) -> u64 {
        let mut parts = vec![self.initial_cluster_token.clone()];
        if !self.join_existing {
            for (n, urls) in &self.initial_cluster {
                parts.push(format!("{n}={}", urls.join(",")));
            }
        }
        hash(&parts.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// The initial members with their ids (clients' URLs are known only for this member).
    pub fn initial_members(&self) -> BTreeMap<u64, Member> {
        self.initial_cluster
            .iter()
            .map(|(name, urls)| {
                let client_urls = if *name == self.name { self.advertise_client_urls.clone() } else { Vec::new() };
                (
                    member_id(name, urls, &self.initial_cluster_token),
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

    #[test]
    fn ids_depend_on_token_name_and_urls() {
        let urls = vec!["http://127.0.0.1:2380".to_string()];
        let a = member_id("a", &urls, "t1");
        assert_eq!(a, member_id("a", &urls, "t1"));
        assert_ne!(a, member_id("a", &urls, "t2"));
        assert_ne!(a, member_id("b", &urls, "t1"));
        assert_ne!(a, 0);
    }

    #[test]
    fn a_member_missing_from_the_initial_cluster_is_refused() {
        let mut c = ServeConfig::default();
        assert!(c.validate().is_ok());
        c.name = "other".into();
        assert!(matches!(c.validate(), Err(ConfigError::Invalid { flag: "--initial-cluster", .. })));
    }

    #[test]
    fn https_urls_need_their_tls_flags_and_http_urls_allow_them() {
        let files = TlsFiles {
            cert_file: Some("c.pem".into()),
            key_file: Some("k.pem".into()),
            trusted_ca_file: Some("ca.pem".into()),
            client_cert_auth: true,
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
        c.peer_tls = files;
        assert!(c.validate().is_ok());
    }
}
