//! Membership changes as etcd decides them: the typed errors of `member add/remove/update/
//! promote` (etcd's texts and gRPC codes), etcd's strict reconfiguration check
//! (`--strict-reconfig-check`) and the reachability it counts, and the learner's readiness for
//! a promotion.
//!
//! The checks are pure functions of a [`Voter`] list, so the quorum arithmetic is tested here;
//! `Node::handle_admin` gathers the list on the leader from [`Reachability`], which every
//! member keeps whatever its role. Nothing here talks to Raft or a peer.

use std::collections::BTreeMap;
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// How long a peer must have been reachable to count as connected (etcd's `HealthInterval`).
pub const HEALTH_INTERVAL: Duration = Duration::from_secs(5);

/// A learner may be promoted once its log holds this share of the leader's (etcd's
/// `readyPercentThreshold`).
pub const LEARNER_READY_SHARE: f64 = 0.9;

/// Most learners a cluster may have at once (etcd's default `--max-learners`).
pub const MAX_LEARNERS: usize = 1;

/// Why a membership change was refused, as etcd says it (`rpctypes/error.go`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum MemberError {
    #[error("etcdserver: member not found")]
    NotFound,
    #[error("etcdserver: member ID already exist")]
    IdExists,
    #[error("etcdserver: Peer URLs already exists")]
    PeerUrlExists,
    #[error("etcdserver: re-configuration failed due to not enough started members")]
    NotEnoughStarted,
    #[error("etcdserver: unhealthy cluster")]
    Unhealthy,
    #[error("etcdserver: can only promote a learner member")]
    NotLearner,
    #[error("etcdserver: can only promote a learner member which is in sync with leader")]
    LearnerNotReady,
    #[error("etcdserver: too many learner members in cluster")]
    TooManyLearners,
}

impl MemberError {
    /// The gRPC status etcd answers with (`v3rpc/util.go`).
    pub fn status(self) -> tonic::Status {
        let text = self.to_string();
        match self {
            MemberError::NotFound => tonic::Status::not_found(text),
            MemberError::Unhealthy => tonic::Status::unavailable(text),
            // etcd's table maps this one to its client-side error value, not a status, so
            // gRPC sends it as Unknown; etcdctl shows the text either way.
            MemberError::NotEnoughStarted => tonic::Status::unknown(text),
            MemberError::IdExists
            | MemberError::PeerUrlExists
            | MemberError::NotLearner
            | MemberError::LearnerNotReady
            | MemberError::TooManyLearners => tonic::Status::failed_precondition(text),
        }
    }
}

/// A voting member as the strict check sees it from the leader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Voter {
    pub id: u64,
    /// It has published its name (etcd's `IsStarted`).
    pub started: bool,
    /// The leader is in contact with it now (etcd's transport `ActiveSince` is set).
    pub active: bool,
    /// The leader has been in unbroken contact with it for at least [`HEALTH_INTERVAL`],
    /// counted from before the leader was elected if the contact began then (or it is the
    /// leader).
    pub connected: bool,
}

fn quorum(n: usize) -> usize {
    n / 2 + 1
}

/// etcd's `mayAddMember`: a voter add needs enough started members for the larger quorum
/// (a one-member cluster may always add one), and any add needs the leader connected to a
/// quorum of the membership with the new member counted as down.
pub fn may_add(voters: &[Voter], learner: bool) -> Result<(), MemberError> {
    if !learner {
        let members = voters.len() + 1;
        let started = voters.iter().filter(|v| v.started).count();
        if !(started == 1 && members == 2) && started < quorum(members) {
            return Err(MemberError::NotEnoughStarted);
        }
    }
    let connected = voters.iter().filter(|v| v.connected).count();
    if voters.len() > 1 && connected < quorum(voters.len() + 1) {
        return Err(MemberError::Unhealthy);
    }
    Ok(())
}

/// etcd's `mayRemoveMember` for a voter (learners are removed without a check): the members
/// left must have a started quorum (so the last member is never removed), and unless the
/// member removed is down already, the leader must stay connected to a quorum without it.
pub fn may_remove(voters: &[Voter], id: u64, me: u64) -> Result<(), MemberError> {
    let rest: Vec<&Voter> = voters.iter().filter(|v| v.id != id).collect();
    if rest.iter().filter(|v| v.started).count() < quorum(rest.len()) {
        return Err(MemberError::NotEnoughStarted);
    }
    let removed_active = voters.iter().any(|v| v.id == id && v.active);
    if id != me && !removed_active {
        return Ok(());
    }
    let connected = voters.iter().filter(|v| v.connected).count();
    if connected.saturating_sub(1) < 1 + (voters.len().saturating_sub(1)) / 2 {
        return Err(MemberError::Unhealthy);
    }
    Ok(())
}

/// etcd's `IsReadyToPromoteMember`: the learner, counted as started, and the started voters
/// must make a quorum of the membership after the promotion.
pub fn may_promote(voters: &[Voter]) -> Result<(), MemberError> {
    let started = 1 + voters.iter().filter(|v| v.started).count();
    if started < quorum(voters.len() + 1) {
        return Err(MemberError::NotEnoughStarted);
    }
    Ok(())
}

/// etcd's `isLearnerReady`: the learner's matched index against the leader's.
pub fn learner_ready(learner_matched: Option<u64>, leader_matched: Option<u64>) -> Result<(), MemberError> {
    let leader = leader_matched.unwrap_or(0);
    if leader == 0 {
        return Ok(());
    }
    let share = learner_matched.unwrap_or(0) as f64 / leader as f64;
    if share < LEARNER_READY_SHARE {
        return Err(MemberError::LearnerNotReady);
    }
    Ok(())
}

/// Since when this member has been in unbroken contact with each peer, whatever either one's
/// role (etcd's rafthttp `ActiveSince`, which its transport keeps for every peer across
/// leader changes). Contact is any peer message that arrived from the peer, any answer it
/// gave, and, on a leader, its acknowledged heartbeats (`membership::keep_contact` gathers
/// them and probes a peer it has not heard from lately). Contact is broken by a silence
/// longer than `fresh` (the election timeout) or a failed probe; the peer then counts again
/// from its next contact, and as connected [`HEALTH_INTERVAL`] after that.
pub struct Reachability {
    fresh: Duration,
    contact: Mutex<BTreeMap<u64, Contact>>,
}

/// One peer's unbroken contact: when it began and the latest message in it.
#[derive(Clone, Copy)]
struct Contact {
    since: Instant,
    last: Instant,
}

impl Reachability {
    /// Contact with a peer is broken when nothing was heard from it for `fresh`.
    pub fn new(fresh: Duration) -> Reachability {
        Reachability { fresh, contact: Mutex::new(BTreeMap::new()) }
    }

    /// Records that `id` was heard from at `at` (which may lie before the latest contact).
    pub fn heard(&self, id: u64, at: Instant) {
        let mut contact = self.contact.lock();
        let c = contact.entry(id).or_insert(Contact { since: at, last: at });
        if at.saturating_duration_since(c.last) > self.fresh {
            c.since = at;
        }
        c.last = c.last.max(at);
    }

    /// Records that `id` could not be reached: its contact is broken now.
    pub fn lost(&self, id: u64) {
        self.contact.lock().remove(&id);
    }

    /// Forgets every peer `keep` refuses (members that left).
    pub fn retain(&self, keep: impl Fn(u64) -> bool) {
        self.contact.lock().retain(|id, _| keep(*id));
    }

    /// When `id` was last heard from in its current contact, if it has one.
    pub fn last_heard(&self, id: u64) -> Option<Instant> {
        self.contact.lock().get(&id).map(|c| c.last)
    }

    /// Since when `id` has been in unbroken contact by `now` (None: not in contact).
    fn since(&self, id: u64, now: Instant) -> Option<Instant> {
        let contact = self.contact.lock();
        let c = contact.get(&id)?;
        (now.saturating_duration_since(c.last) <= self.fresh).then_some(c.since)
    }

    /// Whether this member is in contact with `id` at `now`.
    pub fn active(&self, id: u64, now: Instant) -> bool {
        self.since(id, now).is_some()
    }

    /// Whether this member has been in contact with `id` for at least [`HEALTH_INTERVAL`].
    pub fn connected(&self, id: u64, now: Instant) -> bool {
        self.since(id, now).is_some_and(|t| now.saturating_duration_since(t) >= HEALTH_INTERVAL)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn voter(id: u64, started: bool, connected: bool) -> Voter {
        Voter { id, started, active: connected, connected }
    }

    #[test]
    fn errors_carry_etcds_codes() {
        assert_eq!(MemberError::NotEnoughStarted.status().code(), tonic::Code::Unknown);
        assert_eq!(MemberError::Unhealthy.status().code(), tonic::Code::Unavailable);
        assert_eq!(MemberError::NotFound.status().code(), tonic::Code::NotFound);
        assert_eq!(MemberError::LearnerNotReady.status().code(), tonic::Code::FailedPrecondition);
    }

    #[test]
    fn one_member_may_add_a_voter_but_not_a_second_before_the_first_starts() {
        assert_eq!(may_add(&[voter(1, true, true)], false), Ok(()));
        // The first added member has not started (no name yet): 1 of 3 started.
        assert_eq!(may_add(&[voter(1, true, true), voter(2, false, false)], false), Err(MemberError::NotEnoughStarted));
    }

    #[test]
    fn add_refused_while_a_member_is_not_connected_long_enough() {
        let three = [voter(1, true, true), voter(2, true, true), voter(3, true, false)];
        // 2 connected of 4 after the add: below a quorum of 3.
        assert_eq!(may_add(&three, true), Err(MemberError::Unhealthy));
        let all = [voter(1, true, true), voter(2, true, true), voter(3, true, true)];
        assert_eq!(may_add(&all, false), Ok(()));
    }

    #[test]
    fn the_last_member_is_never_removed() {
        assert_eq!(may_remove(&[voter(1, true, true)], 1, 1), Err(MemberError::NotEnoughStarted));
    }

    #[test]
    fn a_down_member_may_be_removed_but_not_a_live_one_with_another_down() {
        let v = [
            voter(1, true, true),
            voter(2, true, true),
            Voter { id: 3, started: true, active: false, connected: false },
        ];
        assert_eq!(may_remove(&v, 3, 1), Ok(()));
        assert_eq!(may_remove(&v, 2, 1), Err(MemberError::Unhealthy));
        let all = [voter(1, true, true), voter(2, true, true), voter(3, true, true)];
        assert_eq!(may_remove(&all, 2, 1), Ok(()));
    }

    #[test]
    fn promote_counts_the_learner_as_started() {
        assert_eq!(may_promote(&[voter(1, true, true)]), Ok(()));
        assert_eq!(
            may_promote(&[voter(1, true, true), voter(2, false, false), voter(3, false, false)]),
            Err(MemberError::NotEnoughStarted)
        );
    }

    #[test]
    fn a_lagging_learner_is_not_ready() {
        assert_eq!(learner_ready(Some(50), Some(100)), Err(MemberError::LearnerNotReady));
        assert_eq!(learner_ready(None, Some(100)), Err(MemberError::LearnerNotReady));
        assert_eq!(learner_ready(Some(95), Some(100)), Ok(()));
    }

    #[test]
    fn contact_counts_from_its_start_and_a_silence_or_failure_breaks_it() {
        let fresh = Duration::from_millis(500);
        let r = Reachability::new(fresh);
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        assert!(!r.active(2, t0));
        r.heard(2, t0);
        assert!(r.active(2, t0 + ms(400)) && !r.connected(2, t0 + ms(400)));
        // Heard every 400 ms: unbroken, connected once 5 s have passed since the first.
        for i in 1..=13 {
            r.heard(2, t0 + ms(400 * i));
        }
        assert!(r.connected(2, t0 + HEALTH_INTERVAL));
        // A late report of an older message neither breaks nor extends the contact.
        r.heard(2, t0 + ms(100));
        assert!(r.connected(2, t0 + ms(5300)));
        // Silent for longer than `fresh`: not active, and counted again from its return.
        assert!(!r.active(2, t0 + ms(5800)));
        r.heard(2, t0 + ms(6000));
        assert!(r.active(2, t0 + ms(6000)) && !r.connected(2, t0 + ms(6400)));
        for i in 1..=13 {
            r.heard(2, t0 + ms(6000 + 400 * i));
        }
        assert!(r.connected(2, t0 + ms(11200)));
        // A failed probe breaks the contact at once.
        r.lost(2);
        assert!(!r.active(2, t0 + ms(11200)));
        r.heard(3, t0);
        r.retain(|id| id != 3);
        assert_eq!(r.last_heard(3), None);
    }
}
