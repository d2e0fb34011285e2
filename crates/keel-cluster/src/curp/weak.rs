//! Weak (causal) operations at a session's bound replica, any member (seed 002's CURP-HO).
//!
//! A weak write is a plain Put. Its bound replica accepts it into the session's queue and
//! answers at once; a task per session forwards the queue to the leader in sequence order,
//! one command at a time (the next once the previous has applied on the leader), each as the
//! session's own CURP command (so a resent copy applies once). Until a write has applied *here*
//! the session's weak reads at this replica see it through the overlay; nobody else's do.
//!
//! A weak read is a point read of this replica's applied state, no older than the revision the
//! session has seen and after the session's last strong write has applied here.
//!
//! What that keeps, per session (docs/design/replication.md, section W):
//! - read-your-writes: the overlay is consulted before the state, and an entry leaves the
//!   overlay only after its command applied here, so a read finds the write in one or the other;
//! - monotonic reads: reads wait for `min_revision`;
//! - monotonic writes and writes-follow-reads: a session's weak writes are proposed one after
//!   another, each after the previous applied, and after everything the session had read (reads
//!   see applied state only), so log order extends the session's order;
//! - no read of a write never made: another session sees a weak write only once it applied.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tonic::Status;

use super::{Command, CommandId};
use crate::node::{Node, NodeError};
use crate::types::Response;

/// Weak writes one session may have accepted here and not yet applied.
pub const MAX_QUEUED: usize = 1024;
pub use crate::config::CURP_WEAK_MAX_QUEUED_BYTES as MAX_QUEUED_BYTES;
/// Sessions with weak writes this replica tracks at once.
pub const MAX_SESSIONS: usize = 10_000;
/// A session with nothing queued is forgotten after this long without a weak write.
const IDLE: Duration = Duration::from_secs(60);

#[derive(Default)]
struct Session {
    /// Accepted and not yet applied here, in sequence order.
    queue: VecDeque<Command>,
    /// The newest queued value per key: (sequence number, value).
    overlay: BTreeMap<Vec<u8>, (u64, Vec<u8>)>,
    /// The highest sequence number forwarded and applied on the leader (in the log).
    applied_through: u64,
    /// A forwarding task runs for this session.
    forwarding: bool,
    last_used: Option<Instant>,
}

/// The weak-write queues of the sessions bound to this member.
#[derive(Default)]
pub struct Weak {
    sessions: Mutex<HashMap<u64, Session>>,
    /// Bytes of the request bodies queued over all sessions.
    queued_bytes: std::sync::atomic::AtomicUsize,
}

/// A weak read's answer.
pub struct Read {
    pub value: Option<(Vec<u8>, i64)>,
    pub pending: bool,
    pub revision: i64,
    pub applied_through: u64,
}

impl Weak {
    pub fn new() -> Weak {
        Weak::default()
    }

    /// Accepts weak write `cmd` (checked: a plain Put of `key`, `value`). Idempotent for a copy
    /// resent. Returns the session's applied-through mark.
    pub fn accept(&self, node: &Arc<Node>, cmd: Command, key: Vec<u8>, value: Vec<u8>) -> Result<u64, Status> {
        let id = cmd.id;
        let mut sessions = self.sessions.lock();
        if !sessions.contains_key(&id.client) && sessions.len() >= MAX_SESSIONS {
            let now = Instant::now();
            sessions.retain(|_, s| {
                s.forwarding || !s.queue.is_empty() || s.last_used.is_some_and(|t| now.duration_since(t) < IDLE)
            });
            if sessions.len() >= MAX_SESSIONS {
                return Err(Status::resource_exhausted("keel: this replica tracks too many weak sessions"));
            }
        }
        let s = sessions.entry(id.client).or_default();
        s.last_used = Some(Instant::now());
        if id.seq <= s.applied_through || s.queue.iter().any(|c| c.id == id) {
            return Ok(s.applied_through);
        }
        if s.queue.back().is_some_and(|last| last.id.seq > id.seq) {
            return Err(Status::failed_precondition(format!(
                "keel: weak write {id} arrived after a later one of its session; resend in order"
            )));
        }
        // Applied already (a copy resent after this replica restarted): nothing to forward.
        if matches!(node.sm.curp_applied(id), Ok(true)) {
            return Ok(s.applied_through);
        }
        if s.queue.len() >= MAX_QUEUED {
            return Err(Status::resource_exhausted(format!(
                "keel: the session has {MAX_QUEUED} weak writes not yet applied at this replica"
            )));
        }
        let bytes = cmd.body.len();
        let limit = node.config.curp_weak_queue_bytes;
        if self.queued_bytes.load(std::sync::atomic::Ordering::Relaxed) + bytes > limit {
            return Err(Status::resource_exhausted(format!(
                "keel: this replica holds {} KiB of weak writes not yet applied; try again later",
                limit >> 10
            )));
        }
        self.queued_bytes.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        s.overlay.insert(key, (id.seq, value));
        s.queue.push_back(cmd);
        if !s.forwarding {
            s.forwarding = true;
            tokio::spawn(forward(Arc::clone(node), id.client));
        }
        Ok(s.applied_through)
    }

    /// The session's queued (sequence number, value) of `key`, if any, and its applied-through
    /// mark.
    fn overlay(&self, client: u64, key: &[u8]) -> (Option<(u64, Vec<u8>)>, u64) {
        let sessions = self.sessions.lock();
        match sessions.get(&client) {
            Some(s) => (s.overlay.get(key).cloned(), s.applied_through),
            None => (None, 0),
        }
    }

    /// `id`, the head of its session's queue, has applied on the leader: it is in the log, so
    /// the next one may be forwarded. Its overlay entry stays until it has applied here.
    fn forwarded(&self, id: CommandId) {
        let mut sessions = self.sessions.lock();
        let Some(s) = sessions.get_mut(&id.client) else { return };
        if s.queue.front().is_some_and(|c| c.id == id) {
            if let Some(c) = s.queue.pop_front() {
                self.queued_bytes.fetch_sub(c.body.len(), std::sync::atomic::Ordering::Relaxed);
            }
        }
        s.applied_through = s.applied_through.max(id.seq);
    }

    /// Drops the session's overlay entries up to `seq`: their commands have applied here.
    fn sweep(&self, client: u64, seq: u64) {
        if let Some(s) = self.sessions.lock().get_mut(&client) {
            s.overlay.retain(|_, (q, _)| *q > seq);
        }
    }

    /// The next command to forward for `client`, or None (and the task ends) when the queue
    /// is empty.
    fn next(&self, client: u64) -> Option<Command> {
        let mut sessions = self.sessions.lock();
        let s = sessions.get_mut(&client)?;
        match s.queue.front() {
            Some(c) => Some(c.clone()),
            None => {
                s.forwarding = false;
                None
            }
        }
    }

    /// The session's forwarding task ends (this member stops; its queue stays, and the session
    /// resends to another member).
    fn stop(&self, client: u64) {
        if let Some(s) = self.sessions.lock().get_mut(&client) {
            s.forwarding = false;
        }
    }

    /// Serves a weak point read for session `client`.
    pub async fn read(
        &self,
        node: &Arc<Node>,
        client: u64,
        key: Vec<u8>,
        min_revision: i64,
        after_seq: u64,
    ) -> Result<Read, Status> {
        if key.is_empty() {
            return Err(Status::invalid_argument("etcdserver: key is not provided"));
        }
        let deadline = tokio::time::Instant::now() + node.request_timeout;
        let mut applied = node.sm.applied_tx.subscribe();
        loop {
            let caught_up = node.sm.revision() >= min_revision
                && (after_seq == 0
                    || node
                        .sm
                        .curp_applied(CommandId { client, seq: after_seq })
                        .map_err(|e| Status::internal(e.to_string()))?);
            if caught_up {
                break;
            }
            match tokio::time::timeout_at(deadline, applied.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(crate::etcd_api::node_status(NodeError::Stopped)),
                Err(_) => {
                    return Err(Status::unavailable(
                        "keel: this replica has not caught up with the session yet; read elsewhere or later",
                    ))
                }
            }
        }
        // The overlay before the state: an entry leaves the overlay only after its command
        // applied, so a read that misses it here finds it in the state read next. An entry
        // whose command has applied (its forwarder has not caught up yet) is passed over: the
        // state has it, or a later write of the session that came after it.
        let (own, applied_through) = self.overlay(client, &key);
        if let Some((seq, v)) = own {
            let id = CommandId { client, seq };
            if !node.sm.curp_applied(id).map_err(|e| Status::internal(e.to_string()))? {
                return Ok(Read {
                    value: Some((v, 0)),
                    pending: true,
                    revision: node.sm.visible_revision(),
                    applied_through,
                });
            }
        }
        let sm = Arc::clone(&node.sm);
        crate::etcd_api::read_off_runtime(true, move || {
            let (mut txn, current) = sm.read_at(0)?;
            let req = etcd_client::proto::PbRangeRequest { key, ..Default::default() };
            let resp = crate::mvcc::range(&mut txn, &req, current)?;
            let value = resp.kvs.into_iter().next().map(|kv| (kv.value, kv.mod_revision));
            Ok::<_, crate::types::ApplyError>(Read { value, pending: false, revision: current, applied_through })
        })
        .await?
        .map_err(crate::etcd_api::apply_status)
    }
}

/// Forwards `client`'s queued weak writes to the leader in order, each once the previous one
/// has applied there (so it is in the log before the next is proposed), until the queue is
/// empty or this member stops; then waits until they have applied here and drops their
/// overlay entries. (Waiting for each to apply here before forwarding the next cost a
/// heartbeat per write: a follower learns the commit index with the next append.)
async fn forward(node: Arc<Node>, client: u64) {
    let mut stopping = node.stopping.subscribe();
    let mut applied = node.sm.applied_tx.subscribe();
    // Forwarded, not yet seen applied here, in order.
    let mut unconfirmed: std::collections::VecDeque<CommandId> = std::collections::VecDeque::new();
    let confirm = |unconfirmed: &mut std::collections::VecDeque<CommandId>| {
        let mut through = None;
        while let Some(id) = unconfirmed.front().copied() {
            if !matches!(node.sm.curp_applied(id), Ok(true)) {
                break;
            }
            through = Some(id.seq);
            unconfirmed.pop_front();
        }
        if let Some(seq) = through {
            node.weak.sweep(client, seq);
        }
    };
    while let Some(cmd) = node.weak.next(client) {
        if *stopping.borrow_and_update() {
            node.weak.stop(client);
            return;
        }
        let request = match cmd.to_request() {
            Ok(r) => r,
            Err(_) => {
                node.weak.forwarded(cmd.id);
                continue;
            }
        };
        match node.write(request).await {
            // Applied, or refused as it applied (an etcd error, or below its session's floor:
            // applied before): either way the log has decided it. The session learns an
            // error from the command's record (`WaitSynced`).
            Ok(Response::Ok(_)) | Ok(Response::Err(_)) => {}
            // Unknown fate or no leader: the same command again (it applies once).
            Err(NodeError::Stopped) => {
                node.weak.stop(client);
                return;
            }
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        }
        node.weak.forwarded(cmd.id);
        unconfirmed.push_back(cmd.id);
        confirm(&mut unconfirmed);
    }
    // The queue is empty (a later write starts a new task): the overlay entries of what was
    // forwarded go once it has applied here.
    while !unconfirmed.is_empty() {
        confirm(&mut unconfirmed);
        if unconfirmed.is_empty() {
            break;
        }
        tokio::select! {
            r = applied.changed() => if r.is_err() { return },
            _ = stopping.changed() => return,
        }
    }
}
