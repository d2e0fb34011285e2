//! A new leader's CURP recovery, run each time this member becomes leader in a new term:
//!
//! 1. The front is closed: no write is proposed and no read index given until step 5.
//! 2. Fence: this member's witness and those of other voters, until a majority (this member
//!    included) have answered, raise their fence to the new term and hand over their pools.
//!    A record of an older term arriving after that is refused, so a command of an older term
//!    can complete on the fast path only if it reached each fenced witness before its fence,
//!    and then it is in the pools collected.
//! 3. Wait until the new term's blank entry has applied here: every entry of earlier terms
//!    that will ever commit has then applied, and the dedup table shows which commands have.
//! 4. Re-propose, in the order `recovery::recover` gives, every command found in enough of
//!    the collected pools that has no dedup record, and wait until they have applied. (Applying
//!    is idempotent per command id, so a command that raced into the log by another way still
//!    applies once.) If Raft refused any (a lapsed lease: the member may stay leader), start
//!    again from step 2.
//! 5. Open the front for the term: new writes follow the re-proposals in the log.
//! 6. The re-proposals are committed, so no later leader needs them from the witnesses: tell
//!    every witness to forget commands of earlier terms.
//!
//! Leadership lost at any step aborts the task; the next leader starts over from step 1 with
//! the witnesses' pools as they are (step 6 had not run, so nothing it needs was forgotten).

use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use openraft::async_runtime::WatchReceiver;
use openraft::ReadPolicy;

use super::witness::Pooled;
use crate::network::{PeerRequest, PeerResponse};
use crate::node::Node;

/// Follows leadership for the member's life.
pub async fn run(node: Arc<Node>) {
    let mut rx = node.raft.metrics();
    let mut recovering: Option<(u64, tokio::task::JoinHandle<()>)> = None;
    loop {
        let (leader, term) = {
            let m = rx.borrow_watched();
            (m.current_leader, m.current_term)
        };
        let leads = leader == Some(node.id);
        let current = recovering.as_ref().map(|(t, _)| *t);
        if !leads || current != Some(term) {
            if let Some((_, task)) = recovering.take() {
                task.abort();
                node.front.close();
            }
        }
        if leads && recovering.is_none() {
            node.front.close();
            recovering = Some((term, tokio::spawn(recover(Arc::clone(&node), term))));
        }
        tokio::select! {
            changed = rx.changed() => if changed.is_err() { break },
            _ = node.stopped() => break,
        }
    }
    if let Some((_, task)) = recovering {
        task.abort();
    }
    node.front.close();
}

/// Steps 2–6 for `term`; retries the fence until a majority answers, and steps 2–4 until every
/// re-proposal has applied (the task is aborted if leadership moves on).
async fn recover(node: Arc<Node>, term: u64) {
    let timeout = node.config.election_timeout * 2;
    loop {
        let (pools, voters) = loop {
            match fence_majority(&node, term, timeout).await {
                Some(found) => break found,
                None => tokio::time::sleep(node.config.heartbeat_interval).await,
            }
        };
        // Step 3: the blank entry of this term (openraft's read index is at least it).
        let index = loop {
            match node.raft.ensure_linearizable(ReadPolicy::ReadIndex).await {
                Ok(read) => break read.log_id().index,
                Err(_) => tokio::time::sleep(node.config.heartbeat_interval).await,
            }
        };
        let mut applied = node.sm.applied_tx.subscribe();
        if applied.wait_for(|a| *a >= index).await.is_err() {
            return;
        }
        // Step 4.
        let found = super::recovery::recover(&pools, voters);
        let mut waits = Vec::new();
        for cmd in found {
            if matches!(node.sm.curp_result(cmd.id), Ok(Some(_))) {
                continue;
            }
            let command = super::Command { id: cmd.id, first_incomplete: 0, kind: cmd.kind, body: cmd.body.clone() };
            let Ok(req) = command.to_request() else { continue };
            match node.front.submit(&node.raft, &node.sm, req, None, true).await {
                Ok(s) => waits.push(s.applied),
                // Raft stopped: leadership is over; the next leader recovers again.
                Err(_) => return,
            }
        }
        let reproposed = waits.len();
        // The re-proposals must be in the log, before any new write, before the front opens:
        // Raft may refuse a proposal while this member stays leader (a lapsed lease), and a
        // new write on a refused command's keys would then commit before it, though the
        // command was answered first. Waiting until they apply is the simple way to know.
        let mut all_applied = true;
        for w in waits {
            all_applied &= matches!(w.await, Ok(Ok(_)));
        }
        if !all_applied {
            tokio::time::sleep(node.config.heartbeat_interval).await;
            continue;
        }
        if reproposed > 0 {
            eprintln!(
                "keel: member {:x} leads term {term}: re-proposed {reproposed} commands from the witnesses",
                node.id
            );
        }
        break;
    }
    // Step 5.
    node.front.open(term);
    // Step 6: the re-proposals have applied (no later leader needs them from the witnesses).
    node.witness.drop_below(term);
    let others: Vec<u64> = node.voters().into_iter().filter(|id| *id != node.id).collect();
    let req = PeerRequest::CurpDropBelow { term };
    let calls: FuturesUnordered<_> = others.iter().map(|id| node.call_peer(*id, &req, timeout)).collect();
    // Best effort: a witness that misses it keeps old entries until the next recovery (they
    // only cost fast paths on their keys; recovery finds them applied).
    let _ = calls.collect::<Vec<_>>().await;
}

/// Fences this member's witness and the other voters' for `term`; returns the pools of a
/// majority (exactly a majority: the recovery rule counts within that many) and the number of
/// voters, or `None` if fewer than a majority answered.
async fn fence_majority(node: &Arc<Node>, term: u64, timeout: Duration) -> Option<(Vec<(u64, Vec<Pooled>)>, usize)> {
    let voters = node.voters();
    let majority = voters.len() / 2 + 1;
    let mut pools = Vec::with_capacity(majority);
    if voters.contains(&node.id) {
        // Counted only once the fence is durable (W5).
        let (pool, ticket) = node.witness.fence(term);
        if ticket.durable().await.is_ok() {
            pools.push((node.id, pool));
        }
    }
    let req = PeerRequest::CurpFence { term };
    let mut calls: FuturesUnordered<_> = voters
        .iter()
        .filter(|id| **id != node.id)
        .map(|id| {
            let id = *id;
            let req = &req;
            async move { (id, node.call_peer(id, req, timeout).await) }
        })
        .collect();
    while pools.len() < majority {
        match calls.next().await {
            Some((id, Ok(PeerResponse::CurpPool(pool)))) => pools.push((id, pool)),
            Some(_) => {}
            None => return None,
        }
    }
    Some((pools, voters.len()))
}
