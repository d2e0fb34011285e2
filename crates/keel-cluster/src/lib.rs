//! KeelDB replicated: each member keeps its Raft log and its state machine in KeelDB stores,
//! replicates through openraft, and serves etcd's v3 gRPC API, so `etcdctl`, etcd's client
//! libraries and etcd's `benchmark` tool work against it unchanged.
//!
//! See `docs/design/replication.md` for the failure cases and `docs/CLUSTER.md` for operation.

pub mod auth;
pub mod auth_api;
pub mod backup;
pub mod compactor;
pub mod config;
pub mod curp;
pub mod election_api;
pub mod etcd_api;
pub mod etcd_datadir;
pub mod etcd_snapshot;
pub mod files;
pub mod lease;
pub mod listener;
pub mod lock_api;
pub mod log_store;
mod membership;
pub mod mvcc;
pub mod network;
pub mod node;
pub mod reconfig;
mod rounds;
pub mod snapshot_file;
pub mod state_machine;
pub mod status_client;
pub mod tls;
pub mod types;
pub mod watch;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::proto::{PbClusterServer, PbKvServer, PbLeaseServer, PbMaintenanceServer, PbWatchServer};

pub use config::{ConfigError, ServeConfig, TlsFiles};
pub use node::{restore_snapshot, Node, NodeError, StartError};

/// A running member with its client listeners.
pub struct Server {
    pub node: Arc<Node>,
    /// The client addresses actually bound (port 0 in a URL picks a free port).
    pub client_addrs: Vec<SocketAddr>,
    /// How many client listeners have begun serving (see [`Server::ready`]).
    serving: tokio::sync::watch::Receiver<usize>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// The client listeners' tasks (also in `tasks`' place for `stop`).
    listeners: Vec<tokio::task::JoinHandle<()>>,
}

impl Server {
    /// Starts a member: stores, Raft, peer listener, client gRPC listeners, and the task that
    /// publishes this member's name and client URLs once a leader exists.
    pub async fn start(config: ServeConfig) -> Result<Server, StartError> {
        // Bad client TLS files fail the start before the member's stores are opened.
        config.validate()?;
        let client_tls = tls::client_listener_tls(&config.client_tls)?;
        let node = Node::start(config).await?;
        let api = etcd_api::Api { node: Arc::clone(&node) };
        let watch = watch::WatchService::new(Arc::clone(&node));
        let max = node.config.max_request_bytes + 64 * 1024;
        let mut client_addrs = Vec::new();
        let mut tasks = Vec::new();
        let mut listeners = Vec::new();
        // Like etcd, serve clients only once this member's name and client URLs are in the
        // replicated state (so MemberList shows every serving member's URLs); the listeners
        // are bound now so that the ports are this member's.
        let (published_tx, published_rx) = tokio::sync::watch::channel(false);
        let (serving_tx, serving) = tokio::sync::watch::channel(0usize);
        let bound_listeners = match listener::bind(&node.config.listen_client_urls, client_tls).await {
            Ok(l) => l,
            Err(e) => {
                node.shutdown().await;
                return Err(match e {
                    listener::ListenError::Bind { url, source } => StartError::Listen { url, source },
                    listener::ListenError::NoCertificate { url } => {
                        ConfigError::Invalid { flag: "--cert-file", why: format!("is required by {url}") }.into()
                    }
                });
            }
        };
        for bound in bound_listeners {
            match bound.endpoint() {
                Ok(listener::Endpoint::Tcp(addr)) => client_addrs.push(addr),
                Ok(listener::Endpoint::Unix(_)) => {}
                Err(source) => {
                    node.shutdown().await;
                    return Err(StartError::Listen { url: bound.urls.join(","), source });
                }
            }
            let incoming = bound.incoming();
            let builder = tonic::transport::Server::builder()
                .tcp_nodelay(true)
                .max_concurrent_streams(Some(node.config.max_concurrent_streams));
            let cert_auth = node.config.client_tls.client_cert_auth;
            // clientv3's require-leader metadata is honoured on every RPC (`etcd_api`), and a
            // verified client certificate names the user when no token does (`auth_api`).
            let leader_check = Arc::clone(&node);
            let router = builder
                .layer(tonic::service::InterceptorLayer::new(move |req: tonic::Request<()>| {
                    etcd_api::check_require_leader(&leader_check, req.metadata())?;
                    auth_api::cert_user(cert_auth, req)
                }))
                .add_service(PbKvServer::new(api.clone()).max_decoding_message_size(max))
                .add_service(PbClusterServer::new(api.clone()))
                .add_service(PbMaintenanceServer::new(api.clone()))
                .add_service(PbWatchServer::new(watch.clone()))
                .add_service(PbLeaseServer::new(api.clone()))
                .add_service(auth_api::AuthServer::new(api.clone()))
                .add_service(curp::service::CurpServer::new(Arc::clone(&node)))
                .add_service(lock_api::LockServer::new(api.clone(), Arc::clone(watch.hub())))
                .add_service(election_api::ElectionServer::new(api.clone(), Arc::clone(watch.hub())));
            let stop = Arc::clone(&node);
            let mut ready = published_rx.clone();
            let serving_tx = serving_tx.clone();
            listeners.push(tokio::spawn(async move {
                tokio::select! {
                    _ = ready.wait_for(|p| *p) => {}
                    _ = stop.stopped() => return,
                }
                // The listener is bound, so connections made from here on are accepted.
                serving_tx.send_modify(|n| *n += 1);
                if let Err(e) =
                    router.serve_with_incoming_shutdown(incoming, async move { stop.clients_closed().await }).await
                {
                    eprintln!("keel: client listener stopped: {e}");
                }
            }));
        }
        tasks.push(tokio::spawn(publish_attributes(Arc::clone(&node), published_tx)));
        tasks.push(tokio::spawn(compactor::run(
            Arc::clone(&node),
            node.config.auto_compaction,
            node.config.auto_compaction_interval,
        )));
        Ok(Server { node, client_addrs, serving, tasks, listeners })
    }

    /// Resolves `true` once this member has published its name and client URLs and every
    /// client listener serves (where etcd logs "ready to serve client requests"), or `false`
    /// if the member stops first.
    pub async fn ready(&self) -> bool {
        let mut serving = self.serving.clone();
        let all = self.listeners.len();
        tokio::select! {
            r = serving.wait_for(|n| *n >= all) => r.is_ok(),
            _ = self.node.stopped() => false,
        }
    }

    /// Stops Raft, then client service (open connections get a GOAWAY and up to 2 s to
    /// finish), and waits until the member's stores are closed.
    pub async fn stop(self) {
        self.node.shutdown().await;
        for t in self.tasks.into_iter().chain(self.listeners) {
            let abort = t.abort_handle();
            if tokio::time::timeout(Duration::from_secs(2), t).await.is_err() {
                abort.abort();
            }
        }
    }
}

impl Server {
    /// Stops as etcd does on SIGTERM: a leader first hands leadership to the most caught-up
    /// voter (at most `bound`); then client listeners stop taking requests and finish those
    /// under way, and the member applies what its log holds (at most `bound` for both; Raft
    /// runs meanwhile); then [`Server::stop`]. Returns the new leader if this member handed leadership over.
    pub async fn stop_gracefully(mut self, bound: Duration) -> Option<u64> {
        let new = self.node.hand_over(bound).await;
        self.node.close_clients();
        let deadline = tokio::time::Instant::now() + bound;
        for t in std::mem::take(&mut self.listeners) {
            let abort = t.abort_handle();
            if tokio::time::timeout_at(deadline, t).await.is_err() {
                abort.abort();
            }
        }
        // Writes other members forwarded here are answered too, once applied.
        self.node.settle(deadline).await;
        self.stop().await;
        new
    }
}

/// Records this member's name and client URLs in the replicated state (as etcd's members
/// publish theirs), retrying every second until it is there or the member stops.
async fn publish_attributes(node: Arc<Node>, done: tokio::sync::watch::Sender<bool>) {
    let body = match bincode::serialize(&(node.id, node.config.me())) {
        Ok(b) => b,
        Err(_) => return,
    };
    loop {
        let published = node.sm.published_members();
        if published.get(&node.id) == Some(&node.config.me()) {
            done.send_replace(true);
            return;
        }
        let req = types::Request::new(types::RequestKind::Publish, body.clone());
        // Each attempt is bounded by an election timeout, not the request timeout: a proposal
        // caught in the first election (sent to a member that stopped leading) would otherwise
        // hold the ready line for 5 s. Publishing again is harmless: the loop checks first
        // whether an earlier attempt was applied.
        let attempt = node.config.election_timeout.max(Duration::from_millis(500));
        tokio::select! {
            r = tokio::time::timeout(attempt, node.write(req)) => if let Ok(Ok(types::Response::Ok(_))) = r {
                done.send_replace(true);
                return;
            },
            _ = node.stopped() => return,
        }
        tokio::select! {
            _ = tokio::time::sleep(node.config.heartbeat_interval * 2) => {}
            _ = node.stopped() => return,
        }
    }
}
