//! What the in-process cluster tests share: a loopback address of their own, a member's
//! configuration, (in `history`) the fault tests' clients and linearizability checker, and (in
//! `causal`) the checker of weak sessions.
#![allow(dead_code)]

pub mod causal;
pub mod history;

use std::path::Path;
use std::time::{Duration, Instant};

use keel_cluster::{ServeConfig, Server};

/// A loopback address of one test's own (127.x.y.z, distinct per `first_octet` and process), so
/// fixed ports never collide with other tests or a running etcd.
pub fn loopback_ip(first_octet: u8) -> String {
    let pid = std::process::id();
    format!("127.{first_octet}.{}.{}", (pid >> 8) as u8, (pid as u8).max(2) & 0xfe)
}

/// Member `i` of `names` on `ip`: client URLs at `client_port + n`, peer URLs at
/// `peer_port + n` (`scheme` http or https), fast Raft timing, small snapshots and requests.
pub fn member_config(
    dir: &Path,
    scheme: &str,
    ip: &str,
    (client_port, peer_port): (u16, u16),
    names: &[&str],
    i: usize,
    token: &str,
) -> ServeConfig {
    let url = |base: u16, n: usize| format!("{scheme}://{ip}:{}", base as usize + n);
    ServeConfig {
        name: names[i].to_string(),
        data_dir: dir.join(names[i]),
        listen_client_urls: vec![url(client_port, i)],
        advertise_client_urls: vec![url(client_port, i)],
        listen_peer_urls: vec![url(peer_port, i)],
        initial_advertise_peer_urls: vec![url(peer_port, i)],
        initial_cluster: names
            .iter()
            .enumerate()
            .map(|(n, name)| (name.to_string(), vec![url(peer_port, n)]))
            .collect(),
        initial_cluster_token: token.into(),
        join_existing: false,
        heartbeat_interval: Duration::from_millis(50),
        election_timeout: Duration::from_millis(400),
        snapshot_count: 50,
        // The count alone: the fault tests want snapshots (and installs) often, whatever the
        // state's size. `cluster_snapshots` tests the default share.
        snapshot_bytes_percent: 0,
        max_request_bytes: 64 * 1024,
        ..ServeConfig::default()
    }
}

/// Starts a member, retrying for `secs`: a stopped member's ports may take a moment to free.
/// Its stores may not: `Server::stop` closes them, so a locked store fails at once.
pub async fn start_retrying(cfg: ServeConfig, secs: u64) -> Server {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        match Server::start(cfg.clone()).await {
            Ok(s) => return s,
            Err(e) if Instant::now() < deadline && !e.to_string().contains("locked by another open handle") => {
                eprintln!("retrying start: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("member did not start: {e}"),
        }
    }
}

/// Waits up to `secs` for every running member to name the same leader, one of them.
pub async fn wait_leader(servers: &[Option<Server>], secs: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let leaders: Vec<Option<u64>> = servers.iter().flatten().map(|s| s.node.leader()).collect();
        if let Some(Some(l)) = leaders.first() {
            if leaders.iter().all(|x| *x == Some(*l)) && servers.iter().flatten().any(|s| s.node.id == *l) {
                return *l;
            }
        }
        assert!(Instant::now() < deadline, "no agreed leader: {leaders:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
