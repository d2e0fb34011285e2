//! The leader's front end: the one point every write on the leader passes, in the order it is
//! appended to the log, so that what the leader answers speculatively is what applying the log
//! will produce.
//!
//! Invariants:
//! - **Speculative order is log order.** Every proposal this member makes while it leads (etcd
//!   writes, forwarded writes, lease expiry, compaction, CURP commands, a new leader's
//!   re-proposals) is handed to Raft under one lock, so the log holds them in the order the
//!   front saw them.
//! - **An early answer is given only for a command in the log.** Handing a write to Raft
//!   does not append it: a leader whose lease has lapsed (its heartbeats were answered too
//!   late) refuses writes and stays leader. The answer waits until the log store has been
//!   handed the command by this leader in this term (`Submitted::appended`); a refused command
//!   is answered after it fails, never early. (Without this, found by `keelcheck fault --netns
//!   --curp-percent 50`: a write answered early was refused, later writes on its key committed,
//!   and the next leader re-proposed it after them.)
//! - **A speculative answer is the applied answer.** A CURP command is executed early only
//!   when nothing pending (proposed by this leader and not yet applied here) conflicts with it
//!   and the gate is open; the gate opens in a term only after every entry of earlier terms
//!   has applied here and the witnesses' commands have been proposed again (`recovery`). So
//!   the keys it reads and writes are exactly as the applied state shows them when it applies.
//!   Its revision is not known early (commands that commute may be re-proposed in another
//!   order by a new leader), so the early answer carries none; the synced answer does.
//! - **A read sees every write answered early.** A linearizable read waits until every
//!   command answered speculatively before it arrived has applied (`wait_speculative`), on
//!   any key: its header revision must count every write that completed before it, and a write
//!   answered early has no place in the revision order until it commits.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use openraft::impls::ProgressResponder;
use parking_lot::Mutex;

use super::witness::{self, Footprint};
use super::CommandId;
use crate::node::NodeError;
use crate::state_machine::Raft;
use crate::types::{Request, Response};

/// A write the leader proposed and has not yet applied.
struct Pending {
    footprint: Footprint,
    /// Answered before commit (or re-proposed after an earlier leader did): readers wait
    /// for it.
    speculative: bool,
    /// Set when it has applied (or its fate left this leader's hands).
    done: tokio::sync::watch::Receiver<bool>,
}

/// A speculated command waiting to be seen appended: the term it was speculated in, its
/// proposal number, and whom to tell.
type AppendWait = (u64, u64, tokio::sync::oneshot::Sender<()>);

/// What the front answers for a submitted write.
pub struct Submitted {
    /// The early answer of a CURP command executed speculatively (header revision 0). It may
    /// be given only once `appended` completes.
    pub speculative: Option<Response>,
    /// For a speculated command: completes once the command is in this leader's log, in this
    /// term; fails if Raft refused it (see the module doc).
    pub appended: Option<tokio::sync::oneshot::Receiver<()>>,
    /// Completes with the applied answer (or the error that ended the proposal).
    pub applied: tokio::sync::oneshot::Receiver<Result<Response, NodeError>>,
}

/// The leader's ordering point and its gate (see the module doc).
pub struct Front {
    /// Held while a write is checked and handed to Raft: the order of holders is log order.
    order: tokio::sync::Mutex<()>,
    pending: Arc<Mutex<HashMap<u64, Pending>>>,
    next: AtomicU64,
    /// `Some(term)`: this member leads in `term`, has recovered, and takes writes and
    /// speculation; `None`: writes wait (a new leader recovering) or go elsewhere.
    gate: tokio::sync::watch::Sender<Option<u64>>,
    /// Speculated commands waiting to be seen appended: id → (term, proposal number, waker).
    appends: Arc<Mutex<HashMap<CommandId, AppendWait>>>,
}

impl Default for Front {
    fn default() -> Self {
        Front::new()
    }
}

impl Front {
    pub fn new() -> Front {
        Front {
            order: tokio::sync::Mutex::new(()),
            pending: Arc::new(Mutex::new(HashMap::new())),
            next: AtomicU64::new(1),
            gate: tokio::sync::watch::channel(None).0,
            appends: Arc::default(),
        }
    }

    /// Told by the log store of CURP commands appended by leader `member` in `term` (this
    /// member's own appends are the ones that count: `me`).
    pub fn appended(&self, me: u64, items: &[(CommandId, u64, u64)]) {
        let mut appends = self.appends.lock();
        for (id, term, member) in items {
            if *member != me {
                continue;
            }
            if appends.get(id).is_some_and(|(t, _, _)| t == term) {
                if let Some((_, _, tx)) = appends.remove(id) {
                    let _ = tx.send(());
                }
            }
        }
    }

    /// Closes the gate (leadership lost, or a new term begins recovering).
    pub fn close(&self) {
        self.gate.send_replace(None);
    }

    /// Opens the gate for `term`: recovery is done.
    pub fn open(&self, term: u64) {
        self.gate.send_replace(Some(term));
    }

    /// The term the gate is open for.
    pub fn open_term(&self) -> Option<u64> {
        *self.gate.borrow()
    }

    /// Waits (at most `timeout`) until the gate is open for `term`.
    pub async fn wait_open(&self, term: u64, timeout: Duration) -> bool {
        let mut rx = self.gate.subscribe();
        let open = tokio::time::timeout(timeout, async { rx.wait_for(|g| *g == Some(term)).await.is_ok() }).await;
        open.unwrap_or(false)
    }

    /// Number of writes proposed and not yet applied.
    pub fn pending(&self) -> usize {
        self.pending.lock().len()
    }

    /// Hands `req` to Raft in front order. With `speculate`, a CURP command that conflicts
    /// with nothing pending (and arrives while the gate is open in `term`) is executed
    /// against the applied state and answered at once. `readers_wait`: linearizable reads
    /// wait for it to apply even if it is not answered early (a new leader's re-proposal of
    /// a write an earlier leader answered early).
    pub async fn submit(
        &self,
        raft: &Raft,
        sm: &crate::state_machine::Shared,
        req: Request,
        speculate: Option<u64>,
        readers_wait: bool,
    ) -> Result<Submitted, NodeError> {
        let footprint = witness::footprint(req.kind, &req.body);
        let order = self.order.lock().await;
        let may_speculate = speculate.is_some() && self.open_term() == speculate;
        let speculative = if may_speculate
            && !self.pending.lock().values().any(|p| witness::conflicts(&p.footprint, &footprint))
        {
            super::Command::from_request(&req).and_then(|cmd| crate::state_machine::speculate(sm, cmd.kind, &cmd.body))
        } else {
            None
        };
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        // An early answer waits until the command is in the log: Raft may still refuse it
        // (a leader whose lease lapsed refuses writes and stays leader), and an answer for a
        // command that never reached the log would let later writes on its keys commit before
        // it, to be re-proposed after them by the next leader.
        let (appended, speculated_id) = match (&speculative, speculate) {
            (Some(_), Some(term)) => match super::Command::from_request(&req) {
                Some(cmd) => {
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    self.appends.lock().insert(cmd.id, (term, n, tx));
                    (Some(rx), Some(cmd.id))
                }
                None => (None, None),
            },
            _ => (None, None),
        };
        let (responder, rx) = ProgressResponder::complete_only();
        if let Err(e) = raft.client_write_ff(req, Some(responder)).await {
            if let Some(id) = speculated_id {
                forget_append(&self.appends, id, n);
            }
            return Err(NodeError::Other(e.to_string()));
        }
        let (done_tx, done_rx) = tokio::sync::watch::channel(false);
        let speculative_for_readers = readers_wait || speculative.is_some();
        self.pending.lock().insert(n, Pending { footprint, speculative: speculative_for_readers, done: done_rx });
        drop(order);
        let (tx, applied) = tokio::sync::oneshot::channel();
        let pending = Arc::clone(&self.pending);
        let appends = Arc::clone(&self.appends);
        tokio::spawn(async move {
            let result = match rx.await {
                Ok(Ok(resp)) => Ok(resp.data),
                // Refused before it was appended: safe to send elsewhere.
                Ok(Err(openraft::errors::ClientWriteError::ForwardToLeader(f))) => {
                    Err(NodeError::NotLeader(f.leader_id))
                }
                Ok(Err(_)) => Err(NodeError::Timeout),
                Err(_) => Err(NodeError::Timeout),
            };
            pending.lock().remove(&n);
            // Refused (or applied without being seen appended in this term): no early answer.
            if let Some(id) = speculated_id {
                forget_append(&appends, id, n);
            }
            done_tx.send_replace(true);
            let _ = tx.send(result);
        });
        Ok(Submitted { speculative, appended, applied })
    }

    /// Waits until every write answered speculatively before now that conflicts with `read`
    /// (every one, for `None`) has applied (or left this leader's hands), at most `timeout`;
    /// false on timeout.
    pub async fn wait_speculative(&self, read: Option<&Footprint>, timeout: Duration) -> bool {
        let waits: Vec<_> = self
            .pending
            .lock()
            .values()
            .filter(|p| p.speculative && read.is_none_or(|r| witness::conflicts(&p.footprint, r)))
            .map(|p| p.done.clone())
            .collect();
        let all = async {
            for mut w in waits {
                let _ = w.wait_for(|d| *d).await;
            }
        };
        tokio::time::timeout(timeout, all).await.is_ok()
    }
}

/// Drops proposal `n`'s wait for `id` to be appended (its receiver then fails), unless a later
/// proposal of the same id has replaced it.
fn forget_append(appends: &Mutex<HashMap<CommandId, AppendWait>>, id: CommandId, n: u64) {
    let mut a = appends.lock();
    if a.get(&id).is_some_and(|(_, m, _)| *m == n) {
        a.remove(&id);
    }
}
