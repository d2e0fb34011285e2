//! A member's configuration: etcd's member flags, parsed and checked, and the ids derived from
//! them.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

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
    /// Applied entries between snapshots (etcd's `--snapshot-count`).
    pub snapshot_count: u64,
    /// Largest request a client may send (etcd's `--max-request-bytes`).
    pub max_request_bytes: usize,
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
            max_request_bytes: 1536 * 1024,
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
}
