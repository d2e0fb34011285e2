//! What the in-process cluster tests share: a loopback address of their own, a member's
//! configuration, and (in `history`) the fault tests' clients and linearizability checker.
#![allow(dead_code)]

pub mod history;

use std::path::Path;
use std::time::Duration;

use keel_cluster::ServeConfig;

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
        max_request_bytes: 64 * 1024,
        ..ServeConfig::default()
    }
}
