//! Which leader this member reports and routes to, and how leadership is handed over.
//!
//! openraft keeps a committed vote until a higher one arrives: a leader cut off from its quorum
//! stays leader (it only refuses new proposals once its quorum lease lapses), and a follower cut
//! off from the leader keeps naming it while its Pre-Vote rounds fail. etcd instead steps an
//! isolated leader down after an election timeout (CheckQuorum) and clears a follower's leader
//! when it starts to campaign, so `Status` says `leader 0` and requests fail with `no leader`.
//! [`follow`] keeps the member's *live* leader that way: openraft's leader, as long as this
//! member has had word of it (a leader: a quorum's acknowledgement; a follower: an append)
//! within one election timeout. It never changes Raft's state; it only decides what this member
//! says and where it sends requests.
//!
//! Hand-over (etcd's leadership transfer on a graceful stop, and `MoveLeader`) asks openraft to
//! transfer to a caught-up voter and waits, bounded, until another member leads.

use std::sync::Arc;
use std::time::Duration;

use openraft::async_runtime::WatchReceiver;
use openraft::Instant as _;
use tokio::time::Instant;

use super::{Node, NodeError};

/// What [`judge`] needs to know about this member's view of leadership.
#[derive(Debug, Clone, Copy)]
pub(crate) struct View {
    pub me: u64,
    /// openraft's leader (a committed vote's).
    pub leader: Option<u64>,
    /// When this member, as leader of this term, was last acknowledged by a quorum.
    pub quorum_acked: Option<Instant>,
    /// Since when this member has led this term (as this task first saw it).
    pub leading_since: Option<Instant>,
    /// When this member last accepted an append (or heartbeat) from a leader.
    pub leader_contact: Option<Instant>,
    /// This member is the only voter: its own acknowledgement is a quorum.
    pub sole_voter: bool,
}

/// The live leader of `view` at `now`: openraft's leader if this member heard from it (or, as
/// leader, from a quorum) within `lease`; else none.
pub(crate) fn judge(view: &View, now: Instant, lease: Duration) -> Option<u64> {
    let leader = view.leader?;
    let fresh = |t: Option<Instant>| t.is_some_and(|t| now.saturating_duration_since(t) < lease);
    let live = if leader == view.me {
        // A new leader has one lease to collect its first quorum acknowledgement.
        view.sole_voter || fresh(view.quorum_acked) || fresh(view.leading_since)
    } else {
        fresh(view.leader_contact)
    };
    live.then_some(leader)
}

/// Keeps `node.live_leader` current until the member stops: on every change of openraft's
/// metrics, and every half heartbeat (a lease lapses without any change to announce it).
pub(super) async fn follow(node: Arc<Node>) {
    let lease = node.config.election_timeout;
    let tick = (node.config.heartbeat_interval / 2).max(Duration::from_millis(5));
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut metrics = node.raft.metrics();
    let mut leading: Option<(u64, Instant)> = None;
    let mut contact: Option<Instant> = None;
    let mut seen: (Option<u64>, u64) = (None, 0);
    loop {
        // openraft's instants convert to ages, and ages to our instants.
        let now = Instant::now();
        // The voters as appended (openraft counts a configuration from its append): a sole voter
        // that appended a second one needs that one's acknowledgement from then on.
        let (leader, term, acked, sole_voter) = {
            let m = metrics.borrow_watched();
            (
                m.current_leader,
                m.current_term,
                m.last_quorum_acked.as_ref().and_then(|t| now.checked_sub(t.elapsed())),
                m.membership_config.membership().voter_ids().eq([node.id]),
            )
        };
        if leader == Some(node.id) {
            if leading.is_none_or(|(t, _)| t != term) {
                leading = Some((term, now));
            }
        } else {
            leading = None;
        }
        // The follower's last contact with its leader lives in openraft's core: asked on every
        // tick, and at once when the leader or term changes (a cached time would belong to the
        // previous leader).
        let ticked = tokio::select! {
            biased;
            _ = node.stopped() => break,
            _ = interval.tick() => true,
            c = metrics.changed() => {
                if c.is_err() {
                    break;
                }
                false
            }
        };
        if ticked || seen != (leader, term) {
            seen = (leader, term);
            contact = match node.raft.with_raft_state(|st| st.vote_last_modified().map(|t| t.elapsed())).await {
                Ok(age) => age.and_then(|age| Instant::now().checked_sub(age)),
                Err(_) => break,
            };
        }
        let view = View {
            me: node.id,
            leader,
            quorum_acked: acked,
            leading_since: leading.map(|(_, at)| at),
            leader_contact: contact,
            sole_voter,
        };
        let live = judge(&view, now, lease);
        node.live_leader.send_if_modified(|l| {
            let changed = *l != live;
            *l = live;
            changed
        });
    }
    node.live_leader.send_replace(None);
}

impl Node {
    /// The leader this member reports and routes to: openraft's, unless this member has not
    /// heard from it (or, leading, from a quorum) within an election timeout.
    pub fn live_leader(&self) -> Option<u64> {
        *self.live_leader.borrow()
    }

    /// Waits until a live leader is known, at most until `deadline`: `NoLeader` then.
    pub(crate) async fn wait_live_leader(&self, deadline: Instant) -> Result<u64, NodeError> {
        let mut rx = self.live_leader.subscribe();
        let mut stopping = self.stopping.subscribe();
        let wait = async {
            tokio::select! {
                r = rx.wait_for(|l| l.is_some()) => r.ok().and_then(|l| *l).ok_or(NodeError::Stopped),
                _ = stopping.wait_for(|s| *s) => Err(NodeError::Stopped),
            }
        };
        tokio::time::timeout_at(deadline, wait).await.unwrap_or(Err(NoLeader))
    }

    /// Waits until the live leader differs from `from`, at most until `deadline`.
    pub(crate) async fn wait_leader_change(&self, from: Option<u64>, deadline: Instant) {
        let mut rx = self.live_leader.subscribe();
        let _ = tokio::time::timeout_at(deadline, rx.wait_for(|l| *l != from)).await;
    }

    /// Completes once this member has had no live leader for three election timeouts in a
    /// row: etcd then ends require-leader streams (not at the first missed heartbeat, since a
    /// stream costs more to reopen than a request waiting out an election).
    pub(crate) async fn leader_lost(&self) {
        let mut rx = self.live_leader.subscribe();
        loop {
            if rx.wait_for(|l| l.is_none()).await.is_err() {
                return;
            }
            let lost_for = self.config.election_timeout * 3;
            if tokio::time::timeout(lost_for, rx.wait_for(|l| l.is_some())).await.is_err() {
                return;
            }
        }
    }

    /// The voter (other than this member) to hand leadership to: one that acknowledged within
    /// an election timeout, holding the most of this leader's log; `None` when this member does
    /// not lead or no other voter acknowledged lately. With it, whether that voter holds the
    /// whole log (openraft's target ignores a transfer until it does, and meanwhile the leader
    /// sends no heartbeats, so the other voters time out and elect: a second term, and a
    /// leader nobody chose).
    pub(crate) fn handover_target(&self) -> Option<(u64, bool)> {
        let m = self.raft.metrics().borrow_watched().clone();
        if m.current_leader != Some(self.id) {
            return None;
        }
        let lease = self.config.election_timeout;
        let replication = m.replication.unwrap_or_default();
        let heartbeat = m.heartbeat.unwrap_or_default();
        let last = m.last_log_index.unwrap_or(0);
        // Among those, the caught-up one heard from last: a member that stopped a moment ago
        // (the previous leader, still acknowledging while it settled) has an older answer than
        // every live one, which answer each heartbeat.
        self.voters()
            .into_iter()
            .filter(|id| *id != self.id)
            .filter_map(|id| {
                let acked = heartbeat.get(&id).copied().flatten().filter(|t| t.elapsed() < lease)?;
                let index = replication.get(&id).copied().flatten().map_or(0, |l| l.index);
                Some((id, index >= last, acked))
            })
            .max_by_key(|(_, caught_up, acked)| (*caught_up, *acked))
            .map(|(id, caught_up, _)| (id, caught_up))
    }

    /// Waits (until `deadline`) for a voter that acknowledged lately and holds this leader's
    /// whole log, and returns it; at the deadline, the best voter that acknowledged lately.
    async fn caught_up_target(&self, deadline: Instant) -> Option<u64> {
        let mut metrics = self.raft.metrics();
        loop {
            match self.handover_target() {
                Some((id, true)) => return Some(id),
                Some((id, false)) if Instant::now() >= deadline => return Some(id),
                None if Instant::now() >= deadline => return None,
                _ => {}
            }
            // Replication and heartbeat progress both show in the metrics; Raft gone, no target.
            if let Ok(Err(_)) = tokio::time::timeout_at(deadline, metrics.changed()).await {
                return None;
            }
        }
    }

    /// Asks openraft to hand leadership to `target` and waits until another member leads, at
    /// most until `deadline`. The request is repeated every two heartbeats: the target ignores
    /// a transfer whose last log it does not hold yet (the newest entries may still be on
    /// their way), and openraft does not retry. Returns the new leader.
    pub(crate) async fn transfer_leadership(&self, target: u64, deadline: Instant) -> Result<u64, NodeError> {
        let retry = (self.config.heartbeat_interval * 2).max(Duration::from_millis(20));
        let mut metrics = self.raft.metrics();
        // First let the target receive the whole log (bounded): a transfer it cannot take yet
        // stops the leader's heartbeats for nothing (see `handover_target`).
        let catch_up = deadline.min(Instant::now() + self.config.election_timeout / 2);
        loop {
            let m = metrics.borrow_watched().clone();
            let matched = m.replication.as_ref().and_then(|r| r.get(&target).copied().flatten()).map_or(0, |l| l.index);
            if matched >= m.last_log_index.unwrap_or(0) || Instant::now() >= catch_up {
                break;
            }
            if tokio::time::timeout_at(catch_up, metrics.changed()).await.is_ok_and(|r| r.is_err()) {
                return Err(NodeError::Stopped);
            }
        }
        loop {
            let leader = metrics.borrow_watched().current_leader;
            match leader {
                Some(l) if l != self.id => return Ok(l),
                Some(_) if Instant::now() < deadline => {
                    self.raft.trigger().transfer_leader(target).await.map_err(|_| NodeError::Stopped)?;
                }
                // Between leaders (the target's election is under way): wait for its result.
                None if Instant::now() < deadline => {}
                _ => return Err(NodeError::LeaderTransferTimeout),
            }
            let until = deadline.min(Instant::now() + retry);
            let moved = async {
                while metrics.borrow_watched().current_leader == leader {
                    if metrics.changed().await.is_err() {
                        return Err(NodeError::Stopped);
                    }
                }
                Ok(())
            };
            if let Ok(Err(e)) = tokio::time::timeout_at(until, moved).await {
                return Err(e);
            }
        }
    }

    /// Waits (until `deadline`) until this member has applied every entry its log holds now:
    /// a write it proposed as leader, or a follower forwarded to it, is answered before it
    /// stops (its new leader commits them; the hand-over made sure that leader holds them).
    /// Without a live leader nothing in the log commits (a member left alone, a voter added
    /// and not yet started): it waits no longer than there is one, as etcd does not wait.
    pub async fn settle(&self, deadline: Instant) {
        let last = self.raft.metrics().borrow_watched().last_log_index.unwrap_or(0);
        let mut applied = self.sm.applied_tx.subscribe();
        let mut live = self.live_leader.subscribe();
        tokio::select! {
            _ = tokio::time::timeout_at(deadline, applied.wait_for(|a| *a >= last)) => {}
            _ = live.wait_for(|l| l.is_none()) => {}
        }
        // The other members route to the new leader once its first heartbeats reach them;
        // until then a write they send here is answered "not leader" (and sent on) rather
        // than cut off by this member's connections closing.
        let grace = self.config.heartbeat_interval * 2;
        tokio::time::sleep_until(deadline.min(Instant::now() + grace)).await;
    }

    /// A graceful stop's first step (etcd transfers leadership before it stops): if this member
    /// leads, hands leadership to the most caught-up voter and waits for it, at most `bound`.
    /// Returns the new leader, if the hand-over happened.
    pub async fn hand_over(&self, bound: Duration) -> Option<u64> {
        let deadline = Instant::now() + bound;
        self.handover_target()?;
        // A third of the bound to find a caught-up voter; the transfer has the rest.
        let target = self.caught_up_target(Instant::now() + bound / 3).await?;
        // A member that stopped a moment ago may still look recent in openraft's heartbeat
        // times; etcd's transport knows at once that its stream closed, and a probe tells the same.
        if !self.probe(target).await {
            return None;
        }
        let new = self.transfer_leadership(target, deadline).await.ok()?;
        // Wait (within the same bound) until this member also routes to the new leader, so that
        // requests still arriving here are forwarded instead of refused.
        self.wait_leader_change(Some(self.id), deadline).await;
        Some(new)
    }
}

use NodeError::NoLeader;

#[cfg(test)]
mod tests {
    use super::*;

    fn view(leader: Option<u64>) -> View {
        View { me: 1, leader, quorum_acked: None, leading_since: None, leader_contact: None, sole_voter: false }
    }

    #[test]
    fn a_leader_without_a_quorums_word_within_the_lease_is_not_live() {
        let lease = Duration::from_millis(1000);
        let t0 = Instant::now();
        let later = t0 + Duration::from_millis(1500);
        let leader = View { quorum_acked: Some(t0), leading_since: Some(t0), ..view(Some(1)) };
        assert_eq!(judge(&leader, t0 + Duration::from_millis(500), lease), Some(1));
        assert_eq!(judge(&leader, later, lease), None);
        let acked_again = View { quorum_acked: Some(later - Duration::from_millis(100)), ..leader };
        assert_eq!(judge(&acked_again, later, lease), Some(1));
        // A new leader has one lease for its first acknowledgement; a sole voter needs none.
        let fresh = View { leading_since: Some(t0), ..view(Some(1)) };
        assert_eq!(judge(&fresh, t0 + Duration::from_millis(10), lease), Some(1));
        assert_eq!(judge(&fresh, later, lease), None);
        assert_eq!(judge(&View { sole_voter: true, ..fresh }, later, lease), Some(1));
    }

    #[test]
    fn a_follower_names_its_leader_only_while_it_hears_from_it() {
        let lease = Duration::from_millis(1000);
        let t0 = Instant::now();
        let follower = View { leader_contact: Some(t0), ..view(Some(2)) };
        assert_eq!(judge(&follower, t0 + Duration::from_millis(900), lease), Some(2));
        assert_eq!(judge(&follower, t0 + Duration::from_millis(1100), lease), None);
        assert_eq!(judge(&view(Some(2)), t0, lease), None, "never heard from it since start");
        assert_eq!(judge(&view(None), t0, lease), None);
    }
}
