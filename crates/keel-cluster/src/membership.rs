//! Membership changes as etcd makes them, on the leader (`Node::handle_admin` calls these), and
//! the tasks every member runs to follow membership: peer URLs for its peer clients, the
//! contact with each peer the strict check counts, and noticing that it was removed.
//!
//! etcd changes one member per configuration entry (no joint consensus), and a change takes
//! effect when it applies, so it commits under the old configuration: a one-member cluster
//! answers a voter add at once and can then commit nothing until the new member runs. openraft
//! makes a configuration effective when it is appended, so an add here is two entries: the
//! member as a learner (which commits under the old voters), then, for a voter, a single-step
//! configuration with it as a voter. On one member that second entry commits only once the new
//! member has joined and caught up, as in etcd, so it is answered as soon as the leader has
//! appended it; with two or more voters, once it applied. Every other change is one
//! single-step entry answered after it applied on the leader.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use openraft::async_runtime::WatchReceiver;
use openraft::errors::{ChangeMembershipError, ClientWriteError, RaftError};
use openraft::{ChangeMembers, EntryPayload, Membership, Precondition};

use crate::network::{AdminRequest, PeerRequest, PeerResponse};
use crate::node::{Node, NodeError};
use crate::reconfig::{self, MemberError, Voter};
use crate::types::{LogId, Member, StoredMembership, TypeConfig};

/// A member list: (id, member, voter).
pub(crate) type Members = Vec<(u64, Member, bool)>;

fn list(m: &Membership<u64, Member>) -> Members {
    let voters: BTreeSet<u64> = m.voter_ids().collect();
    m.nodes().map(|(id, n)| (*id, n.clone(), voters.contains(id))).collect()
}

/// openraft's refusal, typed: a member that does not lead sends the caller to the leader.
fn raft_error(e: RaftError<TypeConfig, ClientWriteError<TypeConfig>>) -> NodeError {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => NodeError::NotLeader(f.leader_id),
        // The entry was appended and then lost to a leader change: its fate is unknown.
        RaftError::APIError(ClientWriteError::LogEntryDiscarded(_)) => NodeError::Timeout,
        // Another change is still committing, or moved the membership since it was read.
        RaftError::APIError(ClientWriteError::ChangeMembershipError(ChangeMembershipError::InProgress(_)))
        | RaftError::APIError(ClientWriteError::PreconditionFailed(_)) => NodeError::Timeout,
        RaftError::APIError(e) => NodeError::Other(format!("etcdserver: {e}")),
        RaftError::Fatal(_) => NodeError::Stopped,
    }
}

impl Node {
    /// The membership as this member has appended it (the leader: every change it accepted).
    fn appended(&self) -> Arc<StoredMembership> {
        Arc::clone(&self.raft.metrics().borrow_watched().membership_config)
    }

    /// The members as this member has appended them.
    pub(crate) fn appended_members(&self) -> Members {
        list(self.appended().membership())
    }

    /// The voters as the strict check sees them from this member (the leader), with its own
    /// contact with each, which began whatever either one's role was then.
    fn voter_view(&self, m: &Membership<u64, Member>) -> Vec<Voter> {
        let published = self.sm.published_members();
        let now = tokio::time::Instant::now();
        m.voter_ids()
            .map(|id| {
                let me = id == self.id;
                Voter {
                    id,
                    started: me || published.get(&id).is_some_and(|p| !p.name.is_empty()),
                    active: me || self.reach.active(id, now),
                    connected: me || self.reach.connected(id, now),
                }
            })
            .collect()
    }

    fn check(&self, verdict: impl FnOnce() -> Result<(), MemberError>) -> Result<(), NodeError> {
        if self.config.strict_reconfig_check {
            verdict()?;
        }
        Ok(())
    }

    /// Appends `voters` and `nodes` as one uniform configuration, if the membership is still
    /// the one `base` names; returns once it applied on this member.
    async fn append_single(
        &self,
        voters: BTreeSet<u64>,
        nodes: BTreeMap<u64, Member>,
        base: Option<LogId>,
    ) -> Result<Members, NodeError> {
        let m = Membership::new(vec![voters], nodes).map_err(|e| NodeError::Other(format!("etcdserver: {e}")))?;
        let answer = self
            .raft
            .append_membership(
                m,
                EntryPayload::Blank,
                [Precondition::LastMembershipLogId { last_membership_log_id: base }],
            )
            .await
            .map_err(raft_error)?;
        Ok(answer.membership.as_ref().map(list).unwrap_or_else(|| self.appended_members()))
    }

    /// The current single configuration: its voters, its nodes and its entry. A joint one (left
    /// by a change an older keel began) is finished by openraft's own change first.
    async fn single(&self) -> Result<(BTreeSet<u64>, BTreeMap<u64, Member>, Option<LogId>), NodeError> {
        let mut stored = self.appended();
        if stored.membership().get_joint_config().len() > 1 {
            let voters: BTreeSet<u64> = stored.membership().voter_ids().collect();
            self.raft.change_membership(ChangeMembers::ReplaceAllVoters(voters), true).await.map_err(raft_error)?;
            stored = self.appended();
        }
        let m = stored.membership();
        let nodes = m.nodes().map(|(id, n)| (*id, n.clone())).collect();
        Ok((m.voter_ids().collect(), nodes, *stored.log_id()))
    }

    pub(crate) async fn add_member(&self, id: u64, member: &Member, learner: bool) -> Result<Members, NodeError> {
        let (voters, nodes, _) = self.single().await?;
        if nodes.contains_key(&id) {
            return Err(MemberError::IdExists.into());
        }
        if nodes.values().any(|m| m.peer_urls.iter().any(|u| member.peer_urls.contains(u))) {
            return Err(MemberError::PeerUrlExists.into());
        }
        if learner && nodes.len().saturating_sub(voters.len()) >= reconfig::MAX_LEARNERS {
            return Err(MemberError::TooManyLearners.into());
        }
        let m = self.appended();
        self.check(|| reconfig::may_add(&self.voter_view(m.membership()), learner))?;
        // As a learner first: that entry commits under the current voters.
        self.raft.add_learner(id, member.clone(), false).await.map_err(raft_error)?;
        if learner {
            return Ok(self.appended_members());
        }
        let (mut voters, nodes, base) = self.single().await?;
        // Two or more voters make a quorum of the larger configuration without the new member:
        // the add is answered once it applied, as etcd answers.
        if voters.len() >= 2 {
            voters.insert(id);
            return self.append_single(voters, nodes, base).await;
        }
        voters.insert(id);
        // One voter: the entry commits only once the new member runs and has caught up. The
        // add is answered once it is appended (etcd's entry is applied by then), and commits
        // in the background.
        let mut metrics = self.raft.metrics();
        let raft = self.raft.clone();
        let proposal = tokio::spawn(async move {
            let m = Membership::new(vec![voters], nodes).map_err(|e| NodeError::Other(format!("etcdserver: {e}")))?;
            let precondition = Precondition::LastMembershipLogId { last_membership_log_id: base };
            raft.append_membership(m, EntryPayload::Blank, [precondition]).await.map_err(raft_error).map(|_| ())
        });
        let appended = metrics.wait_until(|m| m.membership_config.membership().voter_ids().any(|v| v == id));
        tokio::select! {
            r = appended => match r {
                Ok(_) => Ok(self.appended_members()),
                Err(_) => Err(NodeError::Stopped),
            },
            r = proposal => match r {
                Ok(Ok(())) => Ok(self.appended_members()),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(NodeError::Stopped),
            },
        }
    }

    pub(crate) async fn remove_member(&self, id: u64) -> Result<Members, NodeError> {
        let (mut voters, mut nodes, base) = self.single().await?;
        if !nodes.contains_key(&id) {
            return Err(MemberError::NotFound.into());
        }
        if voters.contains(&id) {
            let m = self.appended();
            let view = self.voter_view(m.membership());
            // Without the check etcd's Raft would fail on an empty configuration; keel refuses.
            if voters.len() == 1 {
                return Err(MemberError::NotEnoughStarted.into());
            }
            self.check(|| reconfig::may_remove(&view, id, self.id))?;
        }
        voters.remove(&id);
        nodes.remove(&id);
        self.append_single(voters, nodes, base).await
    }

    pub(crate) async fn promote_member(&self, id: u64) -> Result<Members, NodeError> {
        let (mut voters, nodes, base) = self.single().await?;
        if !nodes.contains_key(&id) {
            return Err(MemberError::NotFound.into());
        }
        if voters.contains(&id) {
            return Err(MemberError::NotLearner.into());
        }
        let (learner_matched, leader_matched) = {
            let m = self.raft.metrics();
            let m = m.borrow_watched();
            let matched = m.replication.as_ref().and_then(|r| r.get(&id).cloned()).flatten().map(|l| l.index);
            (matched, m.last_log_index)
        };
        reconfig::learner_ready(learner_matched, leader_matched)?;
        let m = self.appended();
        self.check(|| reconfig::may_promote(&self.voter_view(m.membership())))?;
        voters.insert(id);
        self.append_single(voters, nodes, base).await
    }

    pub(crate) async fn update_member(&self, id: u64, peer_urls: &[String]) -> Result<Members, NodeError> {
        let (_, nodes, _) = self.single().await?;
        let Some(current) = nodes.get(&id) else { return Err(MemberError::NotFound.into()) };
        if nodes.iter().any(|(other, m)| *other != id && m.peer_urls.iter().any(|u| peer_urls.contains(u))) {
            return Err(MemberError::PeerUrlExists.into());
        }
        let member = Member { peer_urls: peer_urls.to_vec(), ..current.clone() };
        let change = ChangeMembers::SetNodes(BTreeMap::from([(id, member)]));
        let answer = self.raft.change_membership(change, false).await.map_err(raft_error)?;
        Ok(answer.membership.as_ref().map(list).unwrap_or_else(|| self.appended_members()))
    }

    /// Asks the others for the leader's membership (at most one hop: a member asked names its
    /// leader) and stops this member if it is not in it. Whether it stopped.
    pub(crate) async fn stop_if_removed(&self) -> bool {
        let others: Vec<u64> = self.members().into_iter().map(|(id, _, _)| id).filter(|id| *id != self.id).collect();
        for peer in others {
            let mut target = peer;
            for _ in 0..2 {
                match self
                    .call_peer(target, &PeerRequest::Admin(AdminRequest::Members), self.config.election_timeout)
                    .await
                {
                    Ok(PeerResponse::Admin(members)) => {
                        if !members.is_empty() && !members.iter().any(|(id, _, _)| *id == self.id) {
                            self.stop_removed();
                            return true;
                        }
                        break;
                    }
                    Ok(PeerResponse::NotLeader(Some(l))) if l != self.id => target = l,
                    _ => break,
                }
            }
        }
        false
    }

    /// Stops this member for good, as etcd stops a removed member (it exits 0 after saying so).
    fn stop_removed(&self) {
        if self.removed.swap(true, Ordering::SeqCst) || *self.stopping.borrow() {
            return;
        }
        eprintln!("keel: the member has been permanently removed from the cluster");
        eprintln!("keel: data-dir used by this member must be removed");
        self.stopping.send_replace(true);
    }
}

/// Starts the tasks that follow membership on `node` until it stops.
pub(crate) fn follow(node: &Arc<Node>) {
    tokio::spawn(follow_membership(Arc::clone(node)));
    tokio::spawn(keep_contact(Arc::clone(node)));
    tokio::spawn(ask_when_leaderless(Arc::clone(node)));
}

/// Keeps the address book current and stops the member once a committed membership leaves
/// it out (after a second, as etcd, so that a removed leader's answer goes out first).
async fn follow_membership(node: Arc<Node>) {
    let mut rx = node.raft.metrics();
    let mut was_member = false;
    loop {
        let removed = {
            let m = rx.borrow_watched();
            let book: BTreeMap<u64, String> = m
                .membership_config
                .membership()
                .nodes()
                .filter_map(|(id, n)| n.peer_urls.first().map(|u| (*id, u.clone())))
                .collect();
            *node.book.write() = book;
            let committed = m.committed_membership_config.membership();
            let listed = committed.nodes().any(|(id, _)| *id == node.id);
            was_member |= listed;
            was_member && !listed && committed.nodes().next().is_some()
        };
        if removed {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => node.stop_removed(),
                _ = node.stopped() => {}
            }
            return;
        }
        let changed = tokio::select! {
            c = rx.changed() => c.is_ok(),
            _ = node.stopped() => false,
        };
        if !changed {
            return;
        }
    }
}

/// Keeps [`reconfig::Reachability`] current on every member, whatever its role, as etcd's
/// transport keeps a stream with every peer. A leader's acknowledged heartbeats count as
/// contact; any peer not heard from for a probe interval (the longer of a heartbeat interval
/// and a quarter of the election timeout) is sent a [`PeerRequest::Ping`]. Followers hear the
/// leader's heartbeats and the probed member hears the probe, so in a steady cluster only
/// followers probe, about once per pair of them per interval; nothing here touches the write
/// path.
async fn keep_contact(node: Arc<Node>) {
    let interval = node.config.heartbeat_interval.max(node.config.election_timeout / 4);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Probes under way, one per peer at most: a peer that does not answer must not hold up
    // the probes of the others.
    let mut probes = tokio::task::JoinSet::new();
    let mut probing = BTreeSet::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = node.stopped() => return,
        }
        while let Some(done) = probes.try_join_next() {
            if let Ok(id) = done {
                probing.remove(&id);
            }
        }
        if probes.is_empty() {
            probing.clear();
        }
        let now = tokio::time::Instant::now();
        let (acked, peers) = {
            let m = node.raft.metrics();
            let m = m.borrow_watched();
            let acked: Vec<(u64, tokio::time::Instant)> = m
                .heartbeat
                .iter()
                .flat_map(|h| h.iter())
                .filter_map(|(id, at)| {
                    let ago = openraft::Instant::elapsed(&**at.as_ref()?);
                    Some((*id, now.checked_sub(ago)?))
                })
                .collect();
            let peers: BTreeSet<u64> =
                m.membership_config.membership().nodes().map(|(id, _)| *id).filter(|id| *id != node.id).collect();
            (acked, peers)
        };
        for (id, at) in acked {
            node.reach.heard(id, at);
        }
        node.reach.retain(|id| peers.contains(&id));
        for id in peers {
            let quiet = node.reach.last_heard(id).is_none_or(|t| now.saturating_duration_since(t) >= interval);
            if quiet && probing.insert(id) {
                let node = Arc::clone(&node);
                probes.spawn(async move {
                    let _ = node.probe(id).await;
                    id
                });
            }
        }
    }
}

/// A removed follower may never receive the entry that removes it (the leader stops
/// replicating to it at once). When it hears from no leader for a while it asks the others
/// for the leader's membership, and stops if it is not in it (etcd's peers tell a removed
/// member so).
async fn ask_when_leaderless(node: Arc<Node>) {
    let pause = node.config.election_timeout * 3;
    let mut leaderless_since: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(node.config.election_timeout) => {}
            _ = node.stopped() => return,
        }
        // The live leader (`leadership`): openraft keeps naming a leader it no longer hears from.
        if node.live_leader().is_some() {
            leaderless_since = None;
            continue;
        }
        let since = *leaderless_since.get_or_insert_with(tokio::time::Instant::now);
        if since.elapsed() < pause {
            continue;
        }
        if node.stop_if_removed().await {
            return;
        }
        leaderless_since = Some(tokio::time::Instant::now());
    }
}
