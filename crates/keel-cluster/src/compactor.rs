//! Automatic compaction, as etcd's `--auto-compaction-mode` and `--auto-compaction-retention`.
//!
//! Only the leader proposes, and it proposes an ordinary `Compact` entry, so compaction stays a
//! log decision every member applies at the same revision (a follower never compacts on its
//! own). Every member samples its revision on the same clock so that a member that becomes
//! leader already knows which revision was current a retention window ago.
//!
//! - `revision` mode: every [`AutoCompaction::interval`] (5 minutes, as etcd), compact to
//!   `current - retention` when that is above the compacted revision.
//! - `periodic` mode: a revision sample every tenth of the retention window (at least every
//!   100 ms, at most every hour); at each sample, compact to the newest sample that is at least
//!   one window old. History younger than the window is always kept.
//!
//! A proposal that fails (no leader, a leader change) is simply tried at the next tick; one
//! that finds the revision already compacted is not an error.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::proto::PbCompactionRequest;
use prost::Message;

pub use crate::config::AutoCompaction;
use crate::node::Node;
use crate::types::{Request, RequestKind, Response};

/// etcd's check interval in revision mode.
pub const REVISION_MODE_INTERVAL: Duration = Duration::from_secs(300);

impl AutoCompaction {
    /// How often the compactor looks.
    pub fn interval(&self) -> Option<Duration> {
        match self {
            AutoCompaction::Off => None,
            AutoCompaction::Periodic(d) => Some((*d / 10).clamp(Duration::from_millis(100), Duration::from_secs(3600))),
            AutoCompaction::Revisions(_) => Some(REVISION_MODE_INTERVAL),
        }
    }
}

/// The decision of one tick, kept apart from the clock and the node so it can be tested.
#[derive(Debug, Default)]
pub struct Planner {
    samples: VecDeque<(Instant, i64)>,
}

impl Planner {
    /// Records the revision at `now` and returns the revision to compact to, if any.
    pub fn tick(&mut self, policy: AutoCompaction, now: Instant, revision: i64, compacted: i64) -> Option<i64> {
        let target = match policy {
            AutoCompaction::Off => return None,
            AutoCompaction::Revisions(keep) => revision - keep,
            AutoCompaction::Periodic(window) => {
                self.samples.push_back((now, revision));
                // The newest sample at least one window old; older ones are no longer needed.
                let old_enough = self.samples.iter().rposition(|(t, _)| now.duration_since(*t) >= window)?;
                self.samples.drain(..old_enough);
                self.samples.front().map(|s| s.1)?
            }
        };
        (target > compacted).then_some(target)
    }
}

/// Runs the compactor until the member stops (nothing to do when `policy` is off).
pub async fn run(node: Arc<Node>, policy: AutoCompaction, interval: Option<Duration>) {
    let Some(interval) = interval.or(policy.interval()) else { return };
    let mut planner = Planner::default();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = node.stopped() => return,
        }
        let (revision, compacted) = {
            let p = node.sm.progress.lock();
            (p.revision, p.compact_revision)
        };
        let Some(target) = planner.tick(policy, Instant::now(), revision, compacted) else { continue };
        if node.leader() != Some(node.id) {
            continue;
        }
        let body = PbCompactionRequest { revision: target, physical: false }.encode_to_vec();
        match node.write(Request::new(RequestKind::Compact, body)).await {
            Ok(Response::Ok(_)) => eprintln!("keel: auto-compaction: compacted to revision {target}"),
            // Already compacted there (a manual compaction won the race): nothing to do.
            Ok(Response::Err(_)) => {}
            Err(e) => eprintln!("keel: auto-compaction to revision {target} not done ({e}); will retry"),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn flags_parse_as_etcd_reads_them() {
        use AutoCompaction::*;
        assert_eq!(AutoCompaction::parse("periodic", "0").unwrap(), Off);
        assert_eq!(AutoCompaction::parse("periodic", "1").unwrap(), Periodic(Duration::from_secs(3600)));
        assert_eq!(AutoCompaction::parse("periodic", "30m").unwrap(), Periodic(Duration::from_secs(1800)));
        assert_eq!(AutoCompaction::parse("periodic", "1h30m").unwrap(), Periodic(Duration::from_secs(5400)));
        assert_eq!(AutoCompaction::parse("periodic", "500ms").unwrap(), Periodic(Duration::from_millis(500)));
        assert_eq!(AutoCompaction::parse("revision", "1000").unwrap(), Revisions(1000));
        assert_eq!(AutoCompaction::parse("revision", "0").unwrap(), Off);
        for (mode, bad) in [
            ("periodic", "abc"),
            ("periodic", "5x"),
            ("periodic", ""),
            ("periodic", "m"),
            ("revision", "1h"),
            ("revision", "-3"),
            ("hourly", "1"),
        ] {
            assert!(AutoCompaction::parse(mode, bad).is_err(), "{mode} {bad} accepted");
        }
    }

    #[test]
    fn revision_mode_keeps_the_newest_revisions() {
        let mut p = Planner::default();
        let now = Instant::now();
        let policy = AutoCompaction::Revisions(100);
        assert_eq!(p.tick(policy, now, 50, 0), None);
        assert_eq!(p.tick(policy, now, 150, 0), Some(50));
        assert_eq!(p.tick(policy, now, 150, 50), None, "nothing new to compact");
    }

    #[test]
    fn periodic_mode_keeps_a_window_of_history() {
        let mut p = Planner::default();
        let t0 = Instant::now();
        let policy = AutoCompaction::Periodic(Duration::from_secs(10));
        let s = Duration::from_secs;
        assert_eq!(p.tick(policy, t0, 5, 0), None);
        assert_eq!(p.tick(policy, t0 + s(5), 20, 0), None, "no sample is a window old yet");
        assert_eq!(p.tick(policy, t0 + s(10), 30, 0), Some(5));
        assert_eq!(p.tick(policy, t0 + s(16), 40, 5), Some(20), "the newest sample at least 10 s old");
        assert_eq!(p.tick(policy, t0 + s(17), 41, 20), None, "younger history is kept");
        assert!(p.samples.len() <= 4, "old samples are dropped: {}", p.samples.len());
    }
}
