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

use crate::config::ConfigError;
use crate::node::Node;
use crate::types::{Request, RequestKind, Response};

/// What `--auto-compaction-*` asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AutoCompaction {
    /// Retention 0: no automatic compaction (etcd's default).
    #[default]
    Off,
    /// Keep this much time of history.
    Periodic(Duration),
    /// Keep this many revisions of history.
    Revisions(i64),
}

/// etcd's check interval in revision mode.
pub const REVISION_MODE_INTERVAL: Duration = Duration::from_secs(300);

impl AutoCompaction {
    /// Parses etcd's flags: mode `periodic` (the default) takes a duration (`90s`, `30m`,
    /// `1h`) or a bare number of hours; mode `revision` takes a number of revisions. `0`
    /// turns compaction off in either mode.
    pub fn parse(mode: &str, retention: &str) -> Result<AutoCompaction, ConfigError> {
        let bad = |why: &str| ConfigError::Invalid { flag: "--auto-compaction-retention", why: why.to_string() };
        let retention = retention.trim();
        match mode {
            "periodic" => {
                let d = parse_duration(retention).ok_or_else(|| {
                    bad(&format!("{retention:?} is not a duration (like 30m, 1h) or a number of hours"))
                })?;
                Ok(if d.is_zero() { AutoCompaction::Off } else { AutoCompaction::Periodic(d) })
            }
            "revision" => {
                let n: i64 = retention
                    .parse()
                    .ok()
                    .filter(|n| *n >= 0)
                    .ok_or_else(|| bad(&format!("{retention:?} is not a number of revisions")))?;
                Ok(if n == 0 { AutoCompaction::Off } else { AutoCompaction::Revisions(n) })
            }
            other => Err(ConfigError::Invalid {
                flag: "--auto-compaction-mode",
                why: format!("{other:?} is neither periodic nor revision"),
            }),
        }
    }

    /// How often the compactor looks.
    pub fn interval(&self) -> Option<Duration> {
        match self {
            AutoCompaction::Off => None,
            AutoCompaction::Periodic(d) => Some((*d / 10).clamp(Duration::from_millis(100), Duration::from_secs(3600))),
            AutoCompaction::Revisions(_) => Some(REVISION_MODE_INTERVAL),
        }
    }
}

/// `1h`, `30m`, `90s`, `500ms`, `1h30m`, or a bare number of hours (etcd's periodic unit).
fn parse_duration(text: &str) -> Option<Duration> {
    if let Ok(hours) = text.parse::<u64>() {
        return hours.checked_mul(3600).map(Duration::from_secs);
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit())?;
        if digits == 0 {
            return None;
        }
        let n: u64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let unit = match &rest[..unit_len] {
            "h" => Duration::from_secs(3600),
            "m" => Duration::from_secs(60),
            "s" => Duration::from_secs(1),
            "ms" => Duration::from_millis(1),
            _ => return None,
        };
        total = total.checked_add(unit.checked_mul(u32::try_from(n).ok()?)?)?;
        rest = &rest[unit_len..];
    }
    Some(total)
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
