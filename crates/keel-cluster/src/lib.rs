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
pub mod etcd_api;
pub mod files;
pub mod lease;
pub mod log_store;
pub mod mvcc;
pub mod network;
pub mod node;
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
        for url in &node.config.listen_client_urls {
            let addr = network::url_addr(url);
            let listener = tokio::net::TcpListener::bind(&addr)
                .await
                .map_err(|e| StartError::Listen { url: url.clone(), source: e })?;
            client_addrs.push(listener.local_addr().map_err(|e| StartError::Listen { url: url.clone(), source: e })?);
            // Without TCP_NODELAY small gRPC replies wait for the peer's delayed ACK (40 ms).
            let incoming =
                tokio_stream::StreamExt::map(tokio_stream::wrappers::TcpListenerStream::new(listener), |s| {
                    s.and_then(|s| s.set_nodelay(true).map(|()| s))
                });
            let mut builder = tonic::transport::Server::builder().tcp_nodelay(true);
            if config::is_https(url) {
                // validate() refuses an https URL without --cert-file, and
                // client_listener_tls() already built this configuration once.
                let Some(tls) = &client_tls else {
                    node.shutdown().await;
                    return Err(
                        ConfigError::Invalid { flag: "--cert-file", why: format!("is required by {url}") }.into()
                    );
                };
                builder = match builder.tls_config(tls.clone()) {
                    Ok(b) => b,
                    Err(e) => {
                        node.shutdown().await;
                        return Err(
                            ConfigError::Tls { flag: "--cert-file", path: String::new(), why: e.to_string() }.into()
                        );
                    }
                };
            }
            // clientv3's require-leader metadata is honoured on every RPC (`etcd_api`).
            let leader_check = Arc::clone(&node);
            let router = builder
                .layer(tonic::service::InterceptorLayer::new(move |req: tonic::Request<()>| {
                    etcd_api::check_require_leader(&leader_check, req.metadata()).map(|()| req)
                }))
                .add_service(PbKvServer::new(api.clone()).max_decoding_message_size(max))
                .add_service(PbClusterServer::new(api.clone()))
                .add_service(PbMaintenanceServer::new(api.clone()))
                .add_service(PbWatchServer::new(watch.clone()))
                .add_service(PbLeaseServer::new(api.clone()))
                .add_service(auth_api::AuthServer::new(api.clone()))
                .add_service(curp::service::CurpServer::new(Arc::clone(&node)));
            let stop = Arc::clone(&node);
            let mut ready = published_rx.clone();
            listeners.push(tokio::spawn(async move {
                tokio::select! {
                    _ = ready.wait_for(|p| *p) => {}
                    _ = stop.stopped() => return,
                }
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
        Ok(Server { node, client_addrs, tasks, listeners })
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
        tokio::select! {
            r = node.write(req) => if let Ok(types::Response::Ok(_)) = r {
                done.send_replace(true);
                return;
            },
            _ = node.stopped() => return,
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = node.stopped() => return,
        }
    }
}
