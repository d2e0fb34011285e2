//! Which pooled commands a new leader proposes again, and in what order (replication.md, R-C).
//!
//! With n = 2f + 1 voters, a command completed on the fast path is in at least superquorum =
//! f + ⌈f/2⌉ + 1 pools, so in at least `t = superquorum − (n − c)` of any `c` pools collected
//! (`t = ⌈f/2⌉ + 1` for a majority, `c = f + 1`): every command found in `t` or more is
//! re-proposed. Two conflicting commands cannot both reach `t`: `2t > c` whenever `c ≥ f + 1`,
//! so some pool would hold both, which a witness never does (W1). Commands found in fewer did
//! not complete on the fast path; if they completed at all it was after commit, and then the
//! log has them.
//!
//! Order: if command a completed before command b was sent, every pool holding both received a
//! first (W3). The result follows the arrival order of the collected pool holding the most of
//! the chosen commands (for three members every chosen command is in both collected pools, so
//! that pool holds them all and real-time order is kept exactly); commands it lacks (five or more
//! members) are placed by the other pools' orders, and where those disagree in a cycle, by
//! earliest arrival position, then id. Fast answers carry no revision, so this order is visible
//! only as which of two non-conflicting writes got the lower revision.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::witness::Pooled;
use super::CommandId;

/// How many of `collected` pools (of `voters`) a command must be in to be re-proposed.
pub fn threshold(collected: usize, voters: usize) -> usize {
    let f = voters.saturating_sub(1) / 2;
    (f + f.div_ceil(2) + 1).saturating_sub(voters.saturating_sub(collected)).max(1)
}

/// The commands to propose again, in order, from the pools of `pools.len()` members (at least
/// a majority of `voters`, the new leader's own among them).
pub fn recover(pools: &[(u64, Vec<Pooled>)], voters: usize) -> Vec<Pooled> {
    recover_with_threshold(pools, threshold(pools.len(), voters))
}

/// [`recover`] with the threshold given (the model check breaks the rule with it, to show
/// that it would notice).
pub fn recover_with_threshold(pools: &[(u64, Vec<Pooled>)], need: usize) -> Vec<Pooled> {
    let mut count: HashMap<CommandId, usize> = HashMap::new();
    let mut first: HashMap<CommandId, Pooled> = HashMap::new();
    for (_, pool) in pools {
        let mut seen = BTreeSet::new();
        for p in pool {
            if seen.insert(p.id) {
                *count.entry(p.id).or_default() += 1;
                first.entry(p.id).or_insert_with(|| p.clone());
            }
        }
    }
    let chosen: BTreeSet<CommandId> = count.into_iter().filter(|(_, n)| *n >= need).map(|(id, _)| id).collect();
    if chosen.is_empty() {
        return Vec::new();
    }
    // Each pool's order of the chosen commands (by arrival number).
    let orders: Vec<Vec<CommandId>> = pools
        .iter()
        .map(|(_, pool)| {
            let mut v: Vec<&Pooled> = pool.iter().filter(|p| chosen.contains(&p.id)).collect();
            v.sort_by_key(|p| p.arrival);
            let mut ids: Vec<CommandId> = Vec::new();
            for p in v {
                if !ids.contains(&p.id) {
                    ids.push(p.id);
                }
            }
            ids
        })
        .collect();
    // The pool holding the most chosen commands leads: its order is kept as it is.
    let lead = orders.iter().enumerate().max_by_key(|(i, o)| (o.len(), std::cmp::Reverse(*i))).map_or(0, |(i, _)| i);
    let mut edges: BTreeMap<CommandId, BTreeSet<CommandId>> = BTreeMap::new();
    let mut indegree: BTreeMap<CommandId, usize> = chosen.iter().map(|id| (*id, 0)).collect();
    let mut position: BTreeMap<CommandId, usize> = BTreeMap::new();
    for (i, order) in orders.iter().enumerate() {
        for (at, id) in order.iter().enumerate() {
            let pos = if i == lead { at } else { at + order.len() };
            position.entry(*id).and_modify(|p| *p = (*p).min(pos)).or_insert(pos);
        }
        for pair in order.windows(2) {
            if let [a, b] = pair {
                if edges.entry(*a).or_default().insert(*b) {
                    *indegree.entry(*b).or_default() += 1;
                }
            }
        }
    }
    let rank = |id: &CommandId| (position.get(id).copied().unwrap_or(usize::MAX), *id);
    let mut out = Vec::with_capacity(chosen.len());
    let mut left: BTreeSet<CommandId> = chosen;
    while !left.is_empty() {
        // A command nothing left precedes; in a cycle, the earliest placed one.
        let next = left
            .iter()
            .filter(|id| indegree.get(id).copied().unwrap_or(0) == 0)
            .min_by_key(|id| rank(id))
            .or_else(|| left.iter().min_by_key(|id| rank(id)))
            .copied();
        let Some(next) = next else { break };
        left.remove(&next);
        for b in edges.get(&next).into_iter().flatten() {
            if let Some(d) = indegree.get_mut(b) {
                *d = d.saturating_sub(1);
            }
        }
        if let Some(p) = first.remove(&next) {
            out.push(p);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::types::RequestKind;

    fn cmd(seq: u64, arrival: u64) -> Pooled {
        Pooled { id: CommandId { client: 1, seq }, term: 1, kind: RequestKind::Put, body: Vec::new(), arrival }
    }
    fn pool(seqs: &[u64]) -> Vec<Pooled> {
        seqs.iter().enumerate().map(|(i, s)| cmd(*s, i as u64 + 1)).collect()
    }
    fn seqs(v: &[Pooled]) -> Vec<u64> {
        v.iter().map(|p| p.id.seq).collect()
    }

    #[test]
    fn thresholds_follow_the_superquorum() {
        // 3 voters: fast = 3 of 3 pools; of 2 collected, both; of 3, all three.
        assert_eq!((threshold(2, 3), threshold(3, 3)), (2, 3));
        // 5 voters: fast = 4 of 5; of 3 collected, 2; of 4, 3; of 5, 4.
        assert_eq!((threshold(3, 5), threshold(4, 5), threshold(5, 5)), (2, 3, 4));
        assert_eq!(threshold(1, 1), 1);
    }

    #[test]
    fn three_members_keep_the_leaders_pool_order() {
        // Both collected pools hold 1, 2 and 3 (in different orders for concurrent ones); 4 is
        // in one only (not fast), 5 in both.
        let got = recover(&[(1, pool(&[2, 1, 4, 3, 5])), (2, pool(&[1, 2, 3, 5]))], 3);
        assert_eq!(seqs(&got), [2, 1, 3, 5]);
        assert!(recover(&[(1, pool(&[9])), (2, pool(&[]))], 3).is_empty());
    }

    #[test]
    fn five_members_merge_orders_and_never_repeat() {
        // 1 before 2 wherever both are; 3 only in pools that lack 1.
        let got = recover(&[(1, pool(&[1, 2])), (2, pool(&[3, 1, 2])), (3, pool(&[3, 2, 2]))], 5);
        let s = seqs(&got);
        assert_eq!(s.len(), 3, "{s:?}");
        let at = |x: u64| s.iter().position(|v| *v == x).unwrap();
        assert!(at(1) < at(2) && at(3) < at(2), "{s:?}");
        // A cycle across pools (concurrent commands): everything still comes out once.
        let got = recover(&[(1, pool(&[1, 2])), (2, pool(&[2, 3])), (3, pool(&[3, 1]))], 5);
        assert_eq!(got.len(), 3);
    }
}
