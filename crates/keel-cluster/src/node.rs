//! A running member: Raft, its stores, the peer listener, and the write and read paths the
//! client API uses.
//!
//! Writes are proposed by the leader; a follower forwards a client's write to the leader over
//! the peer link and relays the answer (as etcd does), so clients may talk to any member.
//! Linearizable reads take a read index from the leader (ReadIndex: the leader confirms it is
//! still leader with a quorum round after the read arrives) and wait until the local state
//! machine has applied it; serializable reads read the local state machine at once.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use keeldb::fs::FileSystem;
use openraft::async_runtime::WatchReceiver;
use openraft::base::BoxStream;
use openraft::raft::{AppendEntriesRequest, StreamAppendResult};
use openraft::{Config, ReadPolicy, SnapshotPolicy};
use parking_lot::Mutex;

use crate::config::{is_https, ConfigError, ServeConfig};
use crate::files;
use crate::log_store::LogStore;
use crate::network::{self, AdminRequest, CallError, Network, PeerClient, PeerHandler, PeerRequest, PeerResponse};
use crate::state_machine::Raft;
use crate::state_machine::{Shared, StateMachine};
use crate::tls::PeerTls;
use crate::types::{Member, Request, Response, TypeConfig};

mod leadership;

/// Errors of the write and read paths, mapped to etcd's gRPC statuses by the API. They travel
/// between members as they are (a follower relays the leader's), never as text to match.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum NodeError {
    /// No live leader was known before the request's deadline (election in progress, or no
    /// quorum); nothing was proposed.
    #[error("etcdserver: no leader")]
    NoLeader,
    /// The request was proposed but its fate is unknown (leader changed, timeout).
    #[error("etcdserver: request timed out")]
    Timeout,
    /// The node is stopping.
    #[error("etcdserver: server stopped")]
    Stopped,
    /// This member does not lead (the leader it knows, if any); nothing was appended.
    #[error("etcdserver: not leader")]
    NotLeader(Option<u64>),
    /// Anything else, with etcd-like text.
    #[error("{0}")]
    Other(String),
    /// A membership change the leader refused (etcd's errors, `reconfig`).
    #[error(transparent)]
    Member(#[from] crate::reconfig::MemberError),
    /// A leadership transfer did not complete in time.
    #[error("etcdserver: request timed out, leader transfer took too long")]
    LeaderTransferTimeout,
}

/// Triggers a snapshot whenever [`crate::state_machine::snapshot_due`] says one is due,
/// checked after every applied batch, until the member stops. A trigger while a build runs is
/// ignored by openraft; it is not repeated for the same snapshot within a second.
async fn snapshot_policy(node: Arc<Node>) {
    use std::sync::atomic::Ordering::Relaxed;
    let mut applied = node.sm.applied_tx.subscribe();
    let mut stopping = node.stopping.subscribe();
    let mut last_trigger: Option<(Option<u64>, tokio::time::Instant)> = None;
    // Also looks once a second: a trigger that came while a build ran was dropped, and no
    // further apply may come to look again.
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let changed = tokio::select! {
            c = applied.changed() => c.is_ok(),
            _ = tick.tick() => true,
            _ = stopping.wait_for(|s| *s) => false,
        };
        if !changed {
            return;
        }
        let applied_index = *applied.borrow_and_update();
        // The snapshot file's own index as well as openraft's: an install makes its file
        // `current` before its state applies, and openraft reports it only after; reading only
        // openraft's, the applies of an install looked like entries since no snapshot, and a
        // full build followed every install.
        let snapshot_index =
            node.sm.snaps.current_index().max(node.raft.metrics().borrow_watched().snapshot.map(|l| l.index));
        let entries_since = applied_index.saturating_sub(snapshot_index.unwrap_or(0));
        let bytes_since = node.sm.applied_bytes.load(Relaxed).saturating_sub(node.sm.snapshot_mark.load(Relaxed));
        let due = crate::state_machine::snapshot_due(
            entries_since,
            bytes_since,
            node.sm.snaps.current_len(),
            node.config.snapshot_count,
            node.config.snapshot_bytes_percent,
        );
        let recently =
            last_trigger.is_some_and(|(at, when)| at == snapshot_index && when.elapsed() < Duration::from_secs(1));
        if due && !recently {
            last_trigger = Some((snapshot_index, tokio::time::Instant::now()));
            if node.raft.trigger().snapshot().await.is_err() {
                return;
            }
        }
    }
}

/// Whether a store whose log is empty holds state: restored by `keel snapshot-restore` or
/// imported from an etcd data dir (a fresh store has revision 1 and no rows but metadata).
fn holds_restored_state(sm: &Shared) -> bool {
    let Ok((txn, revision)) = sm.read_now() else { return false };
    revision > 1
        || txn
            .tables()
            .iter()
            .filter(|t| t.as_str() != crate::mvcc::META)
            .any(|t| txn.scan(t, keeldb::ScanRange::all()).is_ok_and(|mut rows| rows.next().is_some()))
}

/// The file in `sm/` that says the store was restored and its state is not yet in a snapshot
/// that the log starts from. Written durably by the restore paths before the member's
/// identity; removed once the log before such a snapshot is purged.
pub(crate) const RESTORED: &str = "restored";

/// A restored store holds state that no log entry carries, so a member added later, which
/// replays the log from its first entry, would never see it (etcd's TestIssue6361). Once the
/// initial membership has applied, the state goes into a snapshot and the log it covers is
/// purged: every later member then starts from that snapshot. Then `marker` is removed; until
/// then every start does this again (a crash in between loses nothing). Ends when the member
/// stops.
async fn snapshot_restored_state(node: Arc<Node>, marker: PathBuf) {
    let mut metrics = node.raft.metrics();
    let mut stopping = node.stopping.subscribe();
    let mut triggered = false;
    let mut purging = false;
    loop {
        let (applied, snapshot, purged) = {
            let m = metrics.borrow_watched();
            (m.last_applied.map(|l| l.index), m.snapshot.map(|l| l.index), m.purged.map(|l| l.index))
        };
        match (applied, snapshot) {
            (_, Some(index)) if purged >= Some(index) => {
                if node.config.fs.exists(&marker).unwrap_or(false) {
                    let removed = node.config.fs.remove_file(&marker);
                    let parent = marker.parent().map(Path::to_path_buf).unwrap_or_default();
                    if let Err(e) = removed.and_then(|()| node.config.fs.sync_dir(&parent)) {
                        eprintln!("keel: {}: {e}", marker.display());
                    }
                }
                return;
            }
            (_, Some(index)) if !purging => {
                purging = node.raft.trigger().purge_log(index).await.is_ok();
                if !purging {
                    return;
                }
            }
            (Some(_), None) if !triggered => {
                triggered = node.raft.trigger().snapshot().await.is_ok();
                if !triggered {
                    return;
                }
            }
            _ => {}
        }
        let go_on = tokio::select! {
            c = metrics.changed() => c.is_ok(),
            _ = stopping.wait_for(|s| *s) => false,
        };
        if !go_on {
            return;
        }
    }
}

/// The member's identity file: which cluster and member a data directory belongs to.
const IDENTITY: &str = "identity";

/// A running member.
pub struct Node {
    pub id: u64,
    pub cluster_id: u64,
    pub config: ServeConfig,
    pub raft: Raft,
    pub sm: Arc<Shared>,
    pub log: LogStore,
    /// Idle connections to each member for forwarded requests (one request per connection
    /// at a time; concurrent requests open more).
    peers: Mutex<BTreeMap<u64, Vec<PeerClient>>>,
    pub(crate) request_timeout: Duration,
    /// TLS for peer links (empty when no `--peer-cert-file` is given).
    peer_tls: PeerTls,
    /// The leader's ordering point for every write (`curp::front`).
    pub front: crate::curp::front::Front,
    /// This member's CURP witness pool (`curp::witness`).
    pub witness: Arc<crate::curp::witness::Witness>,
    /// The weak-write queues of the CURP sessions bound to this member (`curp::weak`).
    pub weak: crate::curp::weak::Weak,
    /// Set once when the member stops; listeners and connections end on it.
    pub stopping: tokio::sync::watch::Sender<bool>,
    /// Why the member stopped on its own (Raft hit a storage error), if it did.
    pub fatal: Mutex<Option<String>>,
    /// The read-index rounds this member's linearizable reads share (`rounds`).
    read_rounds: crate::rounds::Rounds<Result<u64, NodeError>>,
    /// This member, for the task that runs those rounds.
    me: std::sync::Weak<Node>,
    /// Since when this member has been in contact with each peer (the strict reconfiguration
    /// check), kept whatever its role.
    pub(crate) reach: crate::reconfig::Reachability,
    /// Each member's current peer URL, for the peer clients (`membership::follow`).
    pub(crate) book: network::AddressBook,
    /// Set when this member found itself removed from the cluster and stopped.
    pub removed: std::sync::atomic::AtomicBool,
    /// The leader this member reports and routes to (`leadership`).
    live_leader: tokio::sync::watch::Sender<Option<u64>>,
    /// Set when client listeners are to stop taking requests (a graceful stop's second step).
    clients_closing: tokio::sync::watch::Sender<bool>,
}

fn io_cfg(dir: &Path, e: std::io::Error) -> ConfigError {
    ConfigError::Io { dir: dir.display().to_string(), source: e }
}

/// Checks (or writes, for a new directory) the identity file. The directory and the file are
/// made durable before the stores are created in it: a power loss must not take the member's
/// directory away with everything the member acknowledged inside it.
fn claim_data_dir(
    fs: &dyn FileSystem,
    dir: &Path,
    cluster_id: u64,
    member_id: u64,
    name: &str,
) -> Result<(), ConfigError> {
    files::create_dir_durably(fs, dir).map_err(|e| io_cfg(dir, e))?;
    let path = dir.join(IDENTITY);
    let expected = identity_text(cluster_id, member_id, name);
    match files::read(fs, &path).map_err(|e| io_cfg(dir, e))? {
        Some(found) => {
            let found = String::from_utf8_lossy(&found).trim().to_string();
            if found != expected {
                return Err(ConfigError::ForeignDataDir { dir: dir.display().to_string(), found, expected });
            }
            Ok(())
        }
        None => {
            if !fs.list_dir(dir).map_err(|e| io_cfg(dir, e))?.is_empty() {
                return Err(ConfigError::ForeignDataDir {
                    dir: dir.display().to_string(),
                    found: "files that are not a KeelDB member's".into(),
                    expected,
                });
            }
            files::write_durably(fs, &path, format!("{expected}\n").as_bytes()).map_err(|e| io_cfg(dir, e))
        }
    }
}

fn identity_text(cluster_id: u64, member_id: u64, name: &str) -> String {
    format!("cluster {cluster_id:016x} member {member_id:016x} ({name})")
}

/// A data directory etcd's tools made (`etcdutl snapshot restore`, an etcd member's own) is
/// imported as this member's initial state (`etcd_datadir`) before anything else reads it; a
/// member that imported one and stopped before setting etcd's files aside finishes that.
fn import_etcd_dir(config: &ServeConfig, member_dir: &Path) -> Result<(), StartError> {
    let fs = config.fs.as_ref();
    if !crate::etcd_datadir::has_etcd_files(fs, member_dir).map_err(|e| io_cfg(member_dir, e))? {
        return Ok(());
    }
    if fs.exists(&member_dir.join(IDENTITY)).map_err(|e| io_cfg(member_dir, e))? {
        return Ok(crate::etcd_datadir::set_aside(fs, member_dir)?);
    }
    let line = format!("{}\n", identity_text(config.cluster_id(), config.member_id(), &config.name));
    let done = crate::etcd_datadir::import(config, member_dir, &member_dir.join(IDENTITY), &line)?;
    eprintln!(
        "keel: imported etcd data dir {} (consistent index {}, {} keys, revision {}, compacted at {}); \
         etcd's files are kept in {}",
        config.data_dir.display(),
        done.consistent_index,
        done.keys,
        done.revision,
        done.compact_revision,
        member_dir.join(crate::etcd_datadir::IMPORTED).display()
    );
    Ok(())
}

/// The cluster and member id a data directory's identity file records, if it has one.
fn read_identity(fs: &dyn FileSystem, dir: &Path) -> Result<Option<(u64, u64, String)>, ConfigError> {
    let found = match files::read(fs, &dir.join(IDENTITY)).map_err(|e| io_cfg(dir, e))? {
        Some(f) => String::from_utf8_lossy(&f).into_owned(),
        None => return Ok(None),
    };
    let bad = || ConfigError::ForeignDataDir {
        dir: dir.display().to_string(),
        found: found.trim().to_string(),
        expected: "cluster <hex> member <hex> (<name>)".into(),
    };
    let mut words = found.trim().splitn(5, ' ');
    let (Some("cluster"), Some(cid), Some("member"), Some(mid), Some(name)) =
        (words.next(), words.next(), words.next(), words.next(), words.next())
    else {
        return Err(bad());
    };
    let cid = u64::from_str_radix(cid, 16).map_err(|_| bad())?;
    let mid = u64::from_str_radix(mid, 16).map_err(|_| bad())?;
    let name = name.strip_prefix('(').and_then(|n| n.strip_suffix(')')).ok_or_else(bad)?;
    Ok(Some((cid, mid, name.to_string())))
}

/// Which cluster and member this start is: from the flags for a new cluster; for a member
/// joining with `--initial-cluster-state existing`, from its data directory if it has one
/// (the directory wins over the flags, as in etcd) or else from a running member, which knows
/// the id `member add` gave these peer URLs.
async fn resolve_identity(config: &ServeConfig, tls: &PeerTls, member_dir: &Path) -> Result<(u64, u64), StartError> {
    let recorded = read_identity(config.fs.as_ref(), member_dir)?;
    if !config.join_existing {
        // A directory made before ids were derived as etcd derives them records other ids:
        // it keeps them (claim_data_dir still refuses another member's directory by name).
        return Ok(match recorded {
            Some((cid, mid, name)) if name == config.name => (cid, mid),
            _ => (config.cluster_id(), config.member_id()),
        });
    }
    if let Some((cid, mid, name)) = recorded {
        if name != config.name {
            return Err(ConfigError::ForeignDataDir {
                dir: member_dir.display().to_string(),
                found: format!("member {name:?}"),
                expected: format!("member {:?}", config.name),
            }
            .into());
        }
        return Ok((cid, mid));
    }
    let mine = &config.initial_advertise_peer_urls;
    let others: Vec<String> = config
        .initial_cluster
        .iter()
        .filter(|(name, _)| **name != config.name)
        .flat_map(|(_, urls)| urls.iter().cloned())
        .collect();
    if others.is_empty() {
        return Err(StartError::Join("--initial-cluster names no other member to join".into()));
    }
    let deadline = tokio::time::Instant::now() + config.election_timeout * 30;
    let mut last = String::new();
    while tokio::time::Instant::now() < deadline {
        for addr in &others {
            match network::discover(tls, addr, mine, config.election_timeout * 2).await {
                Ok(network::Discovered::Member { cluster_id, member_id }) => return Ok((cluster_id, member_id)),
                // A member that answers but does not know us: `member add` was not run (or
                // this member's membership view is old); another member may know better.
                Ok(network::Discovered::Unknown(why)) => last = format!("{addr}: {why}"),
                Err(e) => last = format!("{addr}: {e}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(StartError::Join(format!("no member of the cluster knows peer URLs {mine:?} (last answer: {last})")))
}

/// Makes `config.data_dir` a founding member of a new cluster whose state is `checkpoint` (a
/// `Maintenance.Snapshot` stream, as `etcdctl snapshot save` writes it from keel, or etcd's own
/// bbolt snapshot from etcd 3.4–3.6, see `etcd_snapshot`): like `etcdutl snapshot
/// restore`, run once per member with that member's flags, then start each with `keel serve`
/// and the same flags. Refuses a data directory that already holds anything. Returns the
/// revision the new cluster continues from.
pub fn restore_snapshot(config: &ServeConfig, snapshot: &[u8]) -> Result<i64, StartError> {
    config.validate()?;
    // etcd's snapshots (bbolt) are read and checked whole before the data dir is touched.
    let etcd = match crate::etcd_snapshot::is_etcd_snapshot(snapshot) {
        true => Some(crate::etcd_snapshot::read(snapshot)?),
        false => None,
    };
    let checkpoint = match etcd {
        Some(_) => &[][..],
        None => crate::backup::decode(snapshot).map_err(StartError::Restore)?,
    };
    if config.join_existing {
        return Err(StartError::Join("a restored member founds a new cluster: use --initial-cluster-state new".into()));
    }
    let fs = config.fs.as_ref();
    let member_dir = config.data_dir.join("member");
    if fs.exists(&member_dir).map_err(|e| io_cfg(&member_dir, e))? {
        return Err(StartError::Restore(format!(
            "{} already holds a member; restore into a new --data-dir",
            config.data_dir.display()
        )));
    }
    let restored = claim_data_dir(fs, &member_dir, config.cluster_id(), config.member_id(), &config.name)
        .map_err(StartError::from)
        .and_then(|()| match &etcd {
            Some(state) => Ok(crate::etcd_snapshot::restore(&member_dir.join("sm"), state, Arc::clone(&config.fs))?),
            None => crate::state_machine::restore(&member_dir.join("sm"), checkpoint, Arc::clone(&config.fs))
                .map_err(|e| io_cfg(&member_dir, e).into()),
        })
        .and_then(|revision| {
            files::write_durably(fs, &member_dir.join("sm").join(RESTORED), b"").map_err(|e| io_cfg(&member_dir, e))?;
            Ok(revision)
        });
    if restored.is_err() {
        // The directory did not exist before: leave nothing half made.
        let _ = files::remove_tree(fs, &member_dir);
    }
    restored
}

/// Errors starting a member.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("raft: {0}")]
    Raft(String),
    #[error("cannot listen on {url}: {source}")]
    Listen { url: String, source: std::io::Error },
    #[error("cannot join the cluster: {0}")]
    Join(String),
    #[error("cannot restore: {0}")]
    Restore(String),
    /// Not a source: the message already carries it, and a reporter printing the chain would
    /// say it twice.
    #[error("cannot restore the etcd snapshot: {0}")]
    EtcdSnapshot(crate::etcd_snapshot::Error),
    /// Not a source, as above.
    #[error("cannot import the etcd data dir: {0}")]
    EtcdDataDir(crate::etcd_datadir::ImportError),
}

impl From<crate::etcd_datadir::ImportError> for StartError {
    fn from(e: crate::etcd_datadir::ImportError) -> StartError {
        StartError::EtcdDataDir(e)
    }
}

impl From<crate::etcd_snapshot::Error> for StartError {
    fn from(e: crate::etcd_snapshot::Error) -> StartError {
        StartError::EtcdSnapshot(e)
    }
}

impl Node {
    /// Opens the member's stores, starts Raft and the peer listener. For a new cluster, the
    /// member proposes the initial membership (every initial member does the same; openraft
    /// accepts the first and the rest find the log no longer empty).
    pub async fn start(config: ServeConfig) -> Result<Arc<Node>, StartError> {
        config.validate()?;
        // Certificate files are read before anything on disk is touched.
        let peer_tls = PeerTls::load(&config.peer_tls)?;
        let member_dir: PathBuf = config.data_dir.join("member");
        import_etcd_dir(&config, &member_dir)?;
        let (cluster_id, id) = resolve_identity(&config, &peer_tls, &member_dir).await?;
        claim_data_dir(config.fs.as_ref(), &member_dir, cluster_id, id, &config.name)?;
        let log =
            LogStore::open(&member_dir.join("raft"), Arc::clone(&config.fs)).map_err(|e| io_cfg(&member_dir, e))?;
        let log_was_empty = log.is_empty();
        let sm =
            StateMachine::open(&member_dir.join("sm"), Arc::clone(&config.fs)).map_err(|e| io_cfg(&member_dir, e))?;
        let shared = Arc::clone(&sm.shared);
        // The CURP witness's pool, as it was at the last stop, less what has applied since.
        let witness = {
            let sm = Arc::clone(&shared);
            let w =
                crate::curp::witness::Witness::open(&member_dir.join("witness"), Arc::clone(&config.fs), move |id| {
                    matches!(sm.curp_applied(id), Ok(true))
                })
                .map_err(|e| io_cfg(&member_dir, e))?;
            Arc::new(w)
        };
        let election_ms = config.election_timeout.as_millis() as u64;
        let raft_config = Config {
            cluster_name: format!("{cluster_id:016x}"),
            heartbeat_interval: config.heartbeat_interval.as_millis() as u64,
            // A follower campaigns once the leader's lease (openraft: `election_timeout_max`)
            // has lapsed and then its own randomised timeout (`min..max`) has passed. With
            // etcd's range (`--election-timeout` to twice it) that was 3 to 4 election timeouts
            // after the leader's last heartbeat, where etcd campaigns after 1 to 2; half of it
            // to all of it gives 1.5 to 2, and the lease stays one election timeout (the time
            // an isolated leader keeps accepting writes, as etcd's CheckQuorum).
            election_timeout_min: (election_ms / 2).max(config.heartbeat_interval.as_millis() as u64 + 1),
            election_timeout_max: election_ms,
            enable_pre_vote: Some(config.pre_vote),
            // Snapshots are triggered by `snapshot_policy` below: a count alone would export
            // the whole state every `snapshot_count` entries, whatever its size.
            snapshot_policy: SnapshotPolicy::Never,
            max_in_snapshot_log_to_keep: 1000,
            install_snapshot_timeout: 60_000,
            // Snapshot files travel in chunks of this size (`network.rs`).
            snapshot_max_chunk_size: crate::snapshot_file::IO_CHUNK as u64,
            // A leader restarted after kill -9 must not resume leadership from its persisted
            // vote: its committed id is saved lazily and its state machine is relaxed, so it
            // could serve linearizable reads from a state older than acknowledged writes
            // (openraft documents exactly this; our 200-round fault run hit it). An election
            // teaches it the commit point first.
            enable_leader_restore: Some(false),
            ..Config::default()
        };
        let raft_config = Arc::new(raft_config.validate().map_err(|e| StartError::Raft(e.to_string()))?);
        let book = network::AddressBook::default();
        let network = Network { cluster_id, me: id, tls: peer_tls.clone(), book: Arc::clone(&book) };
        let raft =
            Raft::new(id, raft_config, network, log.clone(), sm).await.map_err(|e| StartError::Raft(e.to_string()))?;
        #[cfg(feature = "raft-stats")]
        if std::env::var_os("KEEL_RAFT_STATS").is_some() {
            // A profiling aid: where each entry's time goes (proposed, persisted, committed,
            // applied) and how large the append and apply batches are.
            let r = raft.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    if let Ok(s) = r.runtime_stats().await {
                        eprintln!("RAFTSTATS {id}\n{}", s.display().human_readable());
                    }
                }
            });
        }
        let node = Arc::new_cyclic(|me| Node {
            me: me.clone(),
            read_rounds: Default::default(),
            id,
            cluster_id,
            request_timeout: config.election_timeout * 5,
            reach: crate::reconfig::Reachability::new(config.election_timeout),
            config,
            raft,
            sm: shared,
            log,
            peers: Mutex::new(BTreeMap::new()),
            peer_tls,
            stopping: tokio::sync::watch::channel(false).0,
            fatal: Mutex::new(None),
            front: crate::curp::front::Front::new(),
            witness,
            weak: crate::curp::weak::Weak::new(),
            book,
            removed: Default::default(),
            live_leader: tokio::sync::watch::channel(None).0,
            clients_closing: tokio::sync::watch::channel(false).0,
        });
        // Keeps the live leader: openraft's, less one this member has lost touch with.
        tokio::spawn(leadership::follow(Arc::clone(&node)));
        // The front learns which speculated commands this member appended as leader.
        let weak_node = Arc::downgrade(&node);
        node.log.set_on_append(Arc::new(move |items| {
            if let Some(n) = weak_node.upgrade() {
                n.front.appended(n.id, items);
            }
        }));
        // The witness forgets each CURP command once this member has applied it.
        let w = Arc::clone(&node.witness);
        *node.sm.on_curp_applied.write() = Some(Arc::new(move |ids| w.applied(ids)));
        // Follows leadership: closes the front when the term changes, runs CURP recovery
        // when this member becomes leader, then opens it.
        tokio::spawn(crate::curp::takeover::run(Arc::clone(&node)));
        for url in &node.config.listen_peer_urls {
            let listener = crate::tls::PeerListener::bind(url)
                .await
                .map_err(|e| StartError::Listen { url: url.clone(), source: e })?;
            tokio::spawn(accept_peers(listener, Arc::clone(&node), is_https(url)));
        }
        // A storage error stops Raft on this member for good: say so, once, and stop the
        // member (its listeners end and `keel serve` exits non-zero) instead of leaving a
        // process that accepts connections and never answers.
        let watch = Arc::clone(&node);
        tokio::spawn(async move {
            let mut rx = watch.raft.metrics();
            loop {
                if let Err(e) = &rx.borrow_watched().running_state {
                    if !*watch.stopping.borrow() {
                        let why = format!("raft stopped on member {:x}: {e}", watch.id);
                        eprintln!("keel: {why}");
                        *watch.fatal.lock() = Some(why);
                        watch.stopping.send_replace(true);
                    }
                    return;
                }
                let changed = tokio::select! {
                    c = rx.changed() => c.is_ok(),
                    _ = watch.stopped() => false,
                };
                if !changed {
                    return;
                }
            }
        });
        // Follows membership: peer URLs, reachability for the strict check, and removal.
        crate::membership::follow(&node);
        // Follows leadership: holds lease deadlines while leading and revokes expired leases.
        tokio::spawn(crate::lease::run(Arc::clone(&node)));
        // Decides when to build a snapshot (openraft's own policy is off: `snapshot_due`).
        tokio::spawn(snapshot_policy(Arc::clone(&node)));
        // A new cluster's members propose the initial membership once, while their log is
        // empty: a fresh data directory, or one made by `keel snapshot restore` (state, no log).
        if log_was_empty && !node.config.join_existing {
            let members = node.config.initial_members();
            // A second member's initialize fails harmlessly once the log has the first's entry.
            let _ = node.raft.initialize(members).await;
        }
        let marker = member_dir.join("sm").join(RESTORED);
        let marked = node.config.fs.exists(&marker).map_err(|e| io_cfg(&member_dir, e))?;
        if !node.config.join_existing && (marked || (log_was_empty && holds_restored_state(&node.sm))) {
            tokio::spawn(snapshot_restored_state(Arc::clone(&node), marker));
        }
        Ok(node)
    }

    /// Stops Raft, tells listeners and connections to end, and closes the member's three
    /// stores (Raft log, witness pool, state). When it returns the data directory is unlocked,
    /// though tasks still holding a handle to the member (a connection finishing, a
    /// replication task of the stopped Raft) may not have ended; their store calls now fail.
    pub async fn shutdown(&self) {
        self.stopping.send_replace(true);
        // In its own task: openraft (0.10.0-alpha.37) can panic while it stops after a storage
        // error. A Raft call that is waiting for the stopped core to finish and is cancelled (a
        // peer connection or client request dropped because the member is stopping) leaves
        // the core's state "joining" with no one to finish it; the next call then hits an
        // `unreachable!` and poisons the core's lock, and every later call, this shutdown
        // included, panics on it. The member is stopping either way; its caller must not panic.
        let raft = self.raft.clone();
        if let Err(e) = tokio::spawn(async move { raft.shutdown().await }).await {
            eprintln!("keel: raft shutdown on member {:x} failed: {e}", self.id);
        }
        self.peers.lock().clear();
        self.log.close().await;
        self.witness.close().await;
        // Every clone of the state store is closed with it (`Database::close`). An error says
        // it was closed already, or that its clean-close mark could not be written (a poisoned
        // store): the next open recovers without the mark.
        let sm = self.sm.db.clone();
        let why = match tokio::task::spawn_blocking(move || sm.close()).await {
            Ok(Ok(())) | Ok(Err(keeldb::Error::Closed)) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(e) => Some(e.to_string()),
        };
        if let Some(why) = why {
            eprintln!("keel: closing the state store of member {:x}: {why}", self.id);
        }
    }

    /// Tells client listeners to stop taking requests and finish those under way; the member
    /// itself keeps running.
    pub fn close_clients(&self) {
        self.clients_closing.send_replace(true);
    }

    /// Completes once client listeners are to close: [`Node::close_clients`] or the member
    /// stopping.
    pub async fn clients_closed(&self) {
        let mut closing = self.clients_closing.subscribe();
        tokio::select! {
            _ = closing.wait_for(|c| *c) => {}
            _ = self.stopped() => {}
        }
    }

    /// Completes once the member is stopping.
    pub async fn stopped(&self) {
        let mut rx = self.stopping.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// The leader as this member knows it.
    pub fn leader(&self) -> Option<u64> {
        self.raft.metrics().borrow_watched().current_leader
    }

    /// The Raft term as this member knows it.
    pub fn term(&self) -> u64 {
        self.raft.metrics().borrow_watched().current_term
    }

    /// Members as the last applied membership lists them: (id, member, voter).
    pub fn members(&self) -> Vec<(u64, Member, bool)> {
        let p = self.sm.progress.lock();
        let m = p.membership.membership();
        let voters: std::collections::BTreeSet<u64> = m.voter_ids().collect();
        m.nodes().map(|(id, node)| (*id, node.clone(), voters.contains(id))).collect()
    }

    fn take_peer(&self, id: u64) -> Option<PeerClient> {
        if let Some(c) = self.peers.lock().get_mut(&id).and_then(Vec::pop) {
            return Some(c);
        }
        let member = self.members().into_iter().find(|(i, _, _)| *i == id)?.1;
        Some(
            PeerClient::new(self.cluster_id, self.id, id, &member, self.peer_tls.clone())
                .with_book(Arc::clone(&self.book)),
        )
    }

    fn put_peer(&self, id: u64, client: PeerClient) {
        let mut peers = self.peers.lock();
        let idle = peers.entry(id).or_default();
        if idle.len() < 64 {
            idle.push(client);
        }
    }

    /// Sends one request to member `id` over an idle (or new) peer connection.
    pub(crate) async fn call_peer(
        &self,
        id: u64,
        req: &PeerRequest,
        timeout: Duration,
    ) -> Result<PeerResponse, String> {
        let Some(mut peer) = self.take_peer(id) else { return Err(format!("member {id:x} is unknown")) };
        let result = peer.call(req, timeout).await;
        self.put_peer(id, peer);
        result.map_err(|e| e.to_string())
    }

    /// Asks member `id` for a [`PeerRequest::Ping`] and records the outcome for the strict
    /// reconfiguration check: an answer is contact; a refused connection breaks contact at
    /// once (etcd's transport notices a closed stream as soon); a slow or lost answer only
    /// fails to extend it, so a busy machine does not reset the 5 s count. A peer that does
    /// not list this member has it ask the leader whether it was removed, as etcd's peers
    /// answer a removed member's messages with "removed" and it stops. Whether it answered.
    pub(crate) async fn probe(&self, id: u64) -> bool {
        let Some(mut peer) = self.take_peer(id) else { return false };
        let result = peer.call(&PeerRequest::Ping, self.config.election_timeout).await;
        self.put_peer(id, peer);
        match result {
            Ok(PeerResponse::Pong { listed }) => {
                self.reach.heard(id, tokio::time::Instant::now());
                if !listed {
                    self.stop_if_removed().await;
                }
                true
            }
            Err(CallError::Unreachable(_)) => {
                self.reach.lost(id);
                false
            }
            Ok(_) | Err(_) => false,
        }
    }

    /// Voting members' ids, as the last applied membership lists them.
    pub fn voters(&self) -> Vec<u64> {
        // Asked on every CURP call: the ids alone, without cloning each member's URLs.
        self.sm.progress.lock().membership.membership().voter_ids().collect()
    }

    /// Sends `req` to the leader (which may be this member): a write, a read index or an
    /// administrative change. Waits for a live leader and follows leader changes until
    /// `deadline`; `NoLeader` if none was found by then. A write whose answer was lost after it
    /// was sent fails with `Timeout` (its fate is unknown); one that never left this member
    /// is retried.
    pub(crate) async fn to_leader_until(
        &self,
        req: PeerRequest,
        deadline: tokio::time::Instant,
    ) -> Result<PeerResponse, NodeError> {
        let mut last_err = NodeError::NoLeader;
        while tokio::time::Instant::now() < deadline {
            let leader = self.wait_live_leader(deadline).await?;
            let resp = if leader == self.id {
                self.handle_local(&req).await
            } else {
                let Some(mut peer) = self.take_peer(leader) else { return Err(NodeError::NoLeader) };
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                let result = peer.call(&req, left).await;
                self.put_peer(leader, peer);
                match result {
                    Ok(r) => r,
                    Err(CallError::Unreachable(_)) => {
                        // Not sent: the leader may be gone; wait for the next one.
                        self.wait_leader_change(Some(leader), deadline.min(retry_at(50))).await;
                        continue;
                    }
                    Err(e) => {
                        if matches!(req, PeerRequest::Forward(_)) {
                            return Err(NodeError::Timeout);
                        }
                        last_err = NodeError::Other(e.to_string());
                        tokio::time::sleep_until(deadline.min(retry_at(50))).await;
                        continue;
                    }
                }
            };
            match resp {
                PeerResponse::NotLeader(_) => {
                    // The member asked no longer leads (or is handing over): wait until this
                    // member learns of another leader (within an election timeout: it may also
                    // be elected again), then ask again. Not asked again at once: a member that
                    // handed leadership over is about to stop, and a write sent to it as it
                    // closes its connections would end with an unknown outcome.
                    let until = deadline.min(tokio::time::Instant::now() + self.config.election_timeout);
                    self.wait_leader_change(Some(leader), until).await;
                    last_err = NodeError::NoLeader;
                }
                PeerResponse::Refused(e) => return Err(e),
                PeerResponse::Error(e) => return Err(NodeError::Other(e)),
                other => return Ok(other),
            }
        }
        Err(last_err)
    }

    /// [`Node::to_leader_until`] within the request timeout.
    pub(crate) async fn to_leader(&self, req: PeerRequest) -> Result<PeerResponse, NodeError> {
        self.to_leader_until(req, self.default_deadline()).await
    }

    /// The deadline of a request that gives none: the request timeout from now.
    pub(crate) fn default_deadline(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.request_timeout
    }

    /// Proposes a write and returns what applying it produced.
    pub async fn write(&self, req: Request) -> Result<Response, NodeError> {
        self.write_until(req, self.default_deadline()).await
    }

    /// [`Node::write`], waiting for a leader at most until `deadline`.
    pub async fn write_until(&self, req: Request, deadline: tokio::time::Instant) -> Result<Response, NodeError> {
        match self.to_leader_until(PeerRequest::Forward(req), deadline).await? {
            PeerResponse::Forward(r) => Ok(r),
            other => Err(NodeError::Other(format!("unexpected answer {other:?}"))),
        }
    }

    /// Waits until a linearizable read may be served from the local state machine. The read
    /// index comes from a round shared with the other reads waiting on this member, one that
    /// started after this read arrived (`rounds`).
    pub async fn read_barrier(&self) -> Result<(), NodeError> {
        self.read_barrier_until(self.default_deadline()).await
    }

    /// [`Node::read_barrier`], waiting for a leader at most until `deadline` (a round joined
    /// may have started with a later one).
    pub async fn read_barrier_until(&self, deadline: tokio::time::Instant) -> Result<(), NodeError> {
        let node = self.me.upgrade().ok_or(NodeError::Stopped)?;
        let round = move || {
            let node = Arc::clone(&node);
            async move { node.fetch_read_index(deadline).await }
        };
        let index = self.read_rounds.join(round).await.ok_or(NodeError::Stopped)??;
        let mut rx = self.sm.applied_tx.subscribe();
        let result = tokio::time::timeout(self.request_timeout, rx.wait_for(|applied| *applied >= index)).await;
        match result {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(_)) => Err(NodeError::Stopped),
            Err(_) => Err(NodeError::Timeout),
        }
    }

    /// One read-index round: the leader's read index, fetched now.
    async fn fetch_read_index(&self, deadline: tokio::time::Instant) -> Result<u64, NodeError> {
        match self.to_leader_until(PeerRequest::ReadIndex, deadline).await? {
            PeerResponse::ReadIndex(i) => Ok(i),
            other => Err(NodeError::Other(format!("unexpected answer {other:?}"))),
        }
    }

    /// Carries out a membership change on the leader; the membership after it, as the leader
    /// has it.
    pub async fn admin(&self, req: AdminRequest) -> Result<Vec<(u64, Member, bool)>, NodeError> {
        match self.to_leader(PeerRequest::Admin(req)).await? {
            PeerResponse::Admin(m) => Ok(m),
            PeerResponse::AdminRefused(e) => Err(NodeError::Member(e)),
            other => Err(NodeError::Other(format!("unexpected answer {other:?}"))),
        }
    }

    /// Proposes `req` on this member, which believes it leads: waits (bounded) until a new
    /// leader's CURP recovery is done, then hands it to the front in log order (see
    /// `curp::front`). `speculate`: the term a CURP client believes current, to answer early.
    pub(crate) async fn propose(
        &self,
        req: Request,
        speculate: Option<u64>,
    ) -> Result<crate::curp::front::Submitted, NodeError> {
        let (leader, term) = {
            let m = self.raft.metrics();
            let m = m.borrow_watched();
            (m.current_leader, m.current_term)
        };
        if leader != Some(self.id) {
            return Err(NodeError::NotLeader(leader));
        }
        if !self.front.wait_open(term, self.request_timeout).await {
            // Nothing was submitted: the leader is not ready (or no longer leads).
            return Err(if self.leader() == Some(self.id) {
                NodeError::NoLeader
            } else {
                NodeError::NotLeader(self.leader())
            });
        }
        self.front.submit(&self.raft, &self.sm, req, speculate.filter(|t| *t == term), false).await
    }

    /// A read index on this member, which believes it leads: once recovery is done and every
    /// write answered early has applied, the index openraft's ReadIndex gives.
    async fn leader_read_index(&self) -> Result<u64, PeerResponse> {
        let term = self.term();
        if self.leader() == Some(self.id)
            && (!self.front.wait_open(term, self.request_timeout).await
                || !self.front.wait_speculative(None, self.request_timeout).await)
        {
            return Err(PeerResponse::Refused(NodeError::NoLeader));
        }
        match self.raft.ensure_linearizable(ReadPolicy::ReadIndex).await {
            Ok(read) => Ok(read.log_id().index),
            Err(e) => match e.forward_to_leader() {
                Some(f) => Err(PeerResponse::NotLeader(f.leader_id)),
                None => Err(PeerResponse::Error(format!("etcdserver: {e}"))),
            },
        }
    }

    /// Handles a leader-only request on this member (which believes it leads).
    async fn handle_local(&self, req: &PeerRequest) -> PeerResponse {
        match req {
            PeerRequest::Forward(r) => match self.propose(r.clone(), None).await {
                Ok(submitted) => match submitted.applied.await {
                    Ok(Ok(resp)) => PeerResponse::Forward(resp),
                    Ok(Err(NodeError::NotLeader(l))) => PeerResponse::NotLeader(l),
                    Ok(Err(e)) => PeerResponse::Refused(e),
                    Err(_) => PeerResponse::Refused(NodeError::Timeout),
                },
                Err(NodeError::NotLeader(l)) => PeerResponse::NotLeader(l),
                Err(e) => PeerResponse::Refused(e),
            },
            PeerRequest::ReadIndex => match self.leader_read_index().await {
                Ok(index) => PeerResponse::ReadIndex(index),
                Err(r) => r,
            },
            PeerRequest::Admin(a) => self.handle_admin(a).await,
            PeerRequest::LeaseKeepAlive(ids) => crate::lease::keep_alive_on_leader(self, ids).await,
            PeerRequest::LeaseTimeToLive { id, keys } => crate::lease::time_to_live_on_leader(self, *id, *keys).await,
            _ => PeerResponse::Error("not a leader request".into()),
        }
    }

    async fn handle_admin(&self, req: &AdminRequest) -> PeerResponse {
        let result = match req {
            AdminRequest::AddMember { id, member, learner } => self.add_member(*id, member, *learner).await,
            AdminRequest::RemoveMember { id } => self.remove_member(*id).await,
            AdminRequest::PromoteMember { id } => self.promote_member(*id).await,
            AdminRequest::UpdateMember { id, peer_urls } => self.update_member(*id, peer_urls).await,
            AdminRequest::Members => Ok(self.appended_members()),
        };
        match result {
            Ok(members) => PeerResponse::Admin(members),
            Err(NodeError::Member(e)) => PeerResponse::AdminRefused(e),
            Err(NodeError::NotLeader(l)) => PeerResponse::NotLeader(l),
            Err(e) => PeerResponse::Error(e.to_string()),
        }
    }
}

impl PeerHandler for Node {
    fn discover(&self, peer_urls: &[String]) -> network::Discovered {
        let mut wanted = peer_urls.to_vec();
        wanted.sort();
        for (id, member, _) in self.members() {
            let mut urls = member.peer_urls.clone();
            urls.sort();
            if urls == wanted {
                return network::Discovered::Member { cluster_id: self.cluster_id, member_id: id };
            }
        }
        network::Discovered::Unknown(format!(
            "no member has peer URLs {peer_urls:?}; add it first (etcdctl member add / keel cluster add)"
        ))
    }

    fn stream_append(
        &self,
        from: u64,
        input: BoxStream<'static, AppendEntriesRequest<TypeConfig>>,
    ) -> BoxStream<'static, Result<StreamAppendResult<TypeConfig>, String>> {
        // A stream opens per heartbeat and per burst of appends: contact with the leader.
        self.reach.heard(from, tokio::time::Instant::now());
        Box::pin(self.raft.stream_append(input).map(|r| r.map_err(|fatal| fatal.to_string())))
    }

    fn snapshot_file(&self) -> std::io::Result<crate::snapshot_file::SnapshotFile> {
        self.sm.incoming_snapshot()
    }

    async fn install_snapshot(
        &self,
        vote: crate::types::Vote,
        meta: crate::types::SnapshotMeta,
        file: crate::snapshot_file::SnapshotFile,
    ) -> PeerResponse {
        match self.raft.install_full_snapshot(vote, openraft::Snapshot { meta, snapshot: file }).await {
            Ok(r) => PeerResponse::Snapshot(r),
            Err(e) => PeerResponse::Error(e.to_string()),
        }
    }

    async fn handle(&self, from: u64, req: PeerRequest) -> PeerResponse {
        let fatal = |e: String| PeerResponse::Error(e);
        self.reach.heard(from, tokio::time::Instant::now());
        match req {
            PeerRequest::Ping => {
                let listed =
                    self.raft.metrics().borrow_watched().membership_config.membership().get_node(&from).is_some();
                PeerResponse::Pong { listed }
            }
            PeerRequest::Append(r) => match self.raft.append_entries(r).await {
                Ok(r) => PeerResponse::Append(r),
                Err(e) => fatal(e.to_string()),
            },
            PeerRequest::Vote(r) => match self.raft.vote(r).await {
                Ok(r) => PeerResponse::Vote(r),
                Err(e) => fatal(e.to_string()),
            },
            PeerRequest::PreVote(r) => match self.raft.pre_vote(r).await {
                Ok(r) => PeerResponse::Vote(r),
                Err(e) => fatal(e.to_string()),
            },
            // Snapshot chunks are received per connection (`network::serve_peer`).
            PeerRequest::SnapshotChunk(_) => PeerResponse::Error("a snapshot chunk outside a transfer".into()),
            PeerRequest::TransferLeader(r) => match self.raft.handle_transfer_leader(r).await {
                Ok(r) => PeerResponse::TransferLeader(r),
                Err(e) => fatal(e.to_string()),
            },
            // A new leader's CURP recovery: fence this witness and hand over its pool.
            // The pool goes only once the fence is durable (W5).
            PeerRequest::CurpFence { term } => {
                let (pool, ticket) = self.witness.fence(term);
                match ticket.durable().await {
                    Ok(()) => PeerResponse::CurpPool(pool),
                    Err(e) => PeerResponse::Error(e.to_string()),
                }
            }
            PeerRequest::CurpDropBelow { term } => {
                self.witness.drop_below(term);
                PeerResponse::CurpPool(Vec::new())
            }
            other => {
                if self.leader() != Some(self.id) {
                    return PeerResponse::NotLeader(self.leader());
                }
                self.handle_local(&other).await
            }
        }
    }
}

/// `ms` milliseconds from now: when a request that found no leader looks again at the latest.
fn retry_at(ms: u64) -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_millis(ms)
}

async fn accept_peers(listener: crate::tls::PeerListener, node: Arc<Node>, https: bool) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = node.stopped() => return,
        };
        match accepted {
            Ok(stream) => {
                let node = Arc::clone(&node);
                tokio::spawn(async move {
                    let (cluster_id, me) = (node.cluster_id, node.id);
                    let stop = Arc::clone(&node);
                    let served = tokio::select! {
                        r = async {
                            let stream = node.peer_tls.accept(stream, https).await?;
                            network::serve_peer(stream, cluster_id, me, node).await
                        } => r,
                        _ = stop.stopped() => Ok(()),
                    };
                    if let Err(e) = served {
                        if e.kind() != std::io::ErrorKind::UnexpectedEof
                            && e.kind() != std::io::ErrorKind::ConnectionReset
                        {
                            eprintln!("keel: peer connection closed: {e}");
                        }
                    }
                });
            }
            Err(e) => {
                eprintln!("keel: peer accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}
