//! A model check of CURP's recovery rule on the real witness pools and `recovery::recover`:
//! every order in which the leader's own record and the other witnesses' records of a few
//! commands can arrive, with a new leader fencing any majority at any point (the old leader
//! going on afterwards), and messages lost in the random part. Checked for every run:
//! 1. every command that completed on the fast path (leader + superquorum − 1 witnesses in the
//!    old term) is recovered from the fenced majority's pools;
//! 2. no two recovered commands conflict;
//! 3. a command that completed before another was first sent comes first.
//!
//! A broken threshold (one less) is shown to be caught.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use etcd_client::proto::PbPutRequest;
use keel_cluster::curp::recovery::{recover_with_threshold, threshold};
use keel_cluster::curp::witness::{conflicts, footprint, Pooled, Witness};
use keel_cluster::curp::CommandId;
use keel_cluster::types::RequestKind;
use prost::Message;
use rand::{Rng, SeedableRng};

fn superquorum(n: usize) -> usize {
    let f = (n - 1) / 2;
    f + f.div_ceil(2) + 1
}

/// One scenario: `keys[i]` is the key command i writes (equal keys conflict).
struct Scenario {
    n: usize,
    keys: Vec<&'static str>,
    /// Check property 3 (exact for three members only).
    order: bool,
}

#[derive(Debug)]
#[allow(dead_code)] // the fields are for the failure message
enum Broken {
    Lost(u64),
    Conflict(u64, u64),
    Order(u64, u64),
}

/// Runs one interleaving: `events` are (command, member) record deliveries in order (member 0
/// is the old leader), `fence_at` the position where `majority` is fenced; returns what broke.
fn run(
    s: &Scenario,
    events: &[(usize, usize)],
    fence_at: usize,
    majority: &[usize],
    need_delta: isize,
) -> Option<Broken> {
    let check_order = s.order;
    let pools: Vec<Witness> = (0..s.n).map(|_| Witness::new()).collect();
    let body =
        |i: usize| PbPutRequest { key: s.keys[i].into(), value: b"v".to_vec(), ..Default::default() }.encode_to_vec();
    let id = |i: usize| CommandId { client: 1, seq: i as u64 + 1 };
    let mut accepted = vec![vec![false; s.n]; s.keys.len()];
    let mut completed: Vec<Option<usize>> = vec![None; s.keys.len()];
    let mut first_sent: Vec<Option<usize>> = vec![None; s.keys.len()];
    let mut collected: Vec<(u64, Vec<Pooled>)> = Vec::new();
    for (p, &(c, m)) in events.iter().enumerate() {
        if p == fence_at {
            collected = majority.iter().map(|m| (*m as u64, pools[*m].fence(2).0)).collect();
        }
        first_sent[c].get_or_insert(p);
        accepted[c][m] = pools[m].record(id(c), 1, RequestKind::Put, body(c)).is_ok();
        for (i, acc) in accepted.iter().enumerate() {
            let others = acc.iter().skip(1).filter(|a| **a).count();
            if completed[i].is_none() && acc[0] && others + 1 >= superquorum(s.n) {
                completed[i] = Some(p);
            }
        }
    }
    if fence_at >= events.len() {
        collected = majority.iter().map(|m| (*m as u64, pools[*m].fence(2).0)).collect();
    }
    let need = (threshold(collected.len(), s.n) as isize + need_delta).max(1) as usize;
    let got = recover_with_threshold(&collected, need);
    let seqs: Vec<u64> = got.iter().map(|p| p.id.seq).collect();
    for (i, done) in completed.iter().enumerate() {
        if done.is_some() && !seqs.contains(&(i as u64 + 1)) {
            return Some(Broken::Lost(i as u64 + 1));
        }
    }
    for (x, a) in got.iter().enumerate() {
        for b in &got[x + 1..] {
            if conflicts(&footprint(a.kind, &a.body), &footprint(b.kind, &b.body)) {
                return Some(Broken::Conflict(a.id.seq, b.id.seq));
            }
        }
    }
    for (a, done) in completed.iter().enumerate() {
        for (b, sent) in first_sent.iter().enumerate() {
            let (Some(done), Some(sent)) = (done, sent) else { continue };
            if check_order && a != b && done < sent {
                let pa = seqs.iter().position(|s| *s == a as u64 + 1);
                let pb = seqs.iter().position(|s| *s == b as u64 + 1);
                if let (Some(pa), Some(pb)) = (pa, pb) {
                    if pa > pb {
                        return Some(Broken::Order(a as u64 + 1, b as u64 + 1));
                    }
                }
            }
        }
    }
    None
}

fn majorities(n: usize) -> Vec<Vec<usize>> {
    let size = n / 2 + 1;
    (0u32..1 << n)
        .filter(|m| m.count_ones() as usize == size)
        .map(|m| (0..n).filter(|i| m >> i & 1 == 1).collect())
        .collect()
}

/// Every permutation of `items` (Heap's algorithm), fed to `f`.
fn permutations(items: &mut Vec<(usize, usize)>, k: usize, f: &mut impl FnMut(&[(usize, usize)])) {
    if k <= 1 {
        f(items);
        return;
    }
    for i in 0..k {
        permutations(items, k - 1, f);
        let j = if k.is_multiple_of(2) { i } else { 0 };
        items.swap(j, k - 1);
    }
}

/// Exhaustive for three members and two commands: every delivery order, fence point and majority.
fn exhaustive(s: &Scenario, need_delta: isize) -> (usize, Vec<Broken>) {
    let mut events: Vec<(usize, usize)> = (0..s.keys.len()).flat_map(|c| (0..s.n).map(move |m| (c, m))).collect();
    let mut runs = 0;
    let mut broken = Vec::new();
    let len = events.len();
    let majors = majorities(s.n);
    permutations(&mut events, len, &mut |order| {
        for fence_at in 0..=order.len() {
            for m in &majors {
                runs += 1;
                if let Some(b) = run(s, order, fence_at, m, need_delta) {
                    broken.push(b);
                }
            }
        }
    });
    (runs, broken)
}

/// Random interleavings with lost deliveries, for more members and commands.
fn random(s: &Scenario, runs: usize, seed: u64, need_delta: isize) -> Vec<Broken> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let majors = majorities(s.n);
    let mut broken = Vec::new();
    for _ in 0..runs {
        let mut events: Vec<(usize, usize)> = (0..s.keys.len())
            .flat_map(|c| (0..s.n).map(move |m| (c, m)))
            .filter(|_| rng.gen_range(0..10) > 0)
            .collect();
        for i in (1..events.len()).rev() {
            events.swap(i, rng.gen_range(0..=i));
        }
        let fence_at = rng.gen_range(0..=events.len());
        let m = &majors[rng.gen_range(0..majors.len())];
        if let Some(b) = run(s, &events, fence_at, m, need_delta) {
            broken.push(b);
        }
    }
    broken
}

#[test]
fn recovery_keeps_every_fast_write_never_two_conflicting_and_real_time_order() {
    let mut total = 0;
    for keys in [vec!["a", "a"], vec!["a", "b"]] {
        let (runs, broken) = exhaustive(&Scenario { n: 3, keys, order: true }, 0);
        assert!(broken.is_empty(), "{:?}", &broken[..broken.len().min(5)]);
        total += runs;
    }
    for (n, keys) in [(3, vec!["a", "a", "b"]), (5, vec!["a", "a"]), (5, vec!["a", "b", "a"]), (5, vec!["a", "b", "c"])]
    {
        let broken = random(&Scenario { n, keys, order: n == 3 }, 20_000, 7 + n as u64, 0);
        assert!(broken.is_empty(), "n={n}: {:?}", &broken[..broken.len().min(5)]);
        total += 20_000;
    }
    eprintln!("{total} runs checked");
}

/// With five members the merged order of recovered commands can put a command before one that
/// completed before it was sent (the only effect: which of two commuting writes gets the lower
/// revision). This test documents it; if the rule is made exact, it fails and should go.
#[test]
fn five_members_can_reorder_recovered_commands() {
    let broken = random(&Scenario { n: 5, keys: vec!["a", "b", "c"], order: true }, 20_000, 11, 0);
    assert!(broken.iter().all(|b| matches!(b, Broken::Order(..))), "{:?}", &broken[..broken.len().min(5)]);
    assert!(!broken.is_empty(), "no reordering found: the five-member order may be exact now");
    eprintln!("{} of 20000 five-member runs reordered recovered commands", broken.len());
}

#[test]
fn a_threshold_one_lower_is_caught() {
    // Three members: the rule needs both collected pools; with one, two conflicting commands,
    // each in one pool, would both be re-proposed.
    let (_, broken) = exhaustive(&Scenario { n: 3, keys: vec!["a", "a"], order: true }, -1);
    assert!(broken.iter().any(|b| matches!(b, Broken::Conflict(..))), "{} broken", broken.len());
    let broken = random(&Scenario { n: 5, keys: vec!["a", "a"], order: false }, 20_000, 3, -1);
    assert!(broken.iter().any(|b| matches!(b, Broken::Conflict(..))));
}
