//! The fault tests' linearizability checker on hand-made histories: it must find violations,
//! accept what is linearizable only through an operation whose answer was lost, and decide
//! histories with dozens of lost answers in a bounded search (a kill-heavy run once kept it
//! busy for minutes); and the revision checker (etcd's header-revision contract, issue 36) finds
//! each kind of violation it names.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::history::{check, check_revisions, Event, Op, Out, RevEvent, Verdict};

fn at(base: Instant, ms: u64) -> Instant {
    base + Duration::from_millis(ms)
}

fn done(base: Instant, op: Op, out: Out, call: u64, ret: u64) -> Event {
    Event { key: 0, op, out, call: at(base, call), ret: Some(at(base, ret)) }
}

fn lost(base: Instant, op: Op, call: u64) -> Event {
    Event { key: 0, op, out: Out::Unknown, call: at(base, call), ret: None }
}

#[test]
fn a_read_of_a_value_never_written_is_found() {
    let b = Instant::now();
    let h = vec![done(b, Op::Put(1), Out::Ok, 0, 1), done(b, Op::Get, Out::Value(Some(2)), 2, 3)];
    assert_eq!(check(&h, 1000), Verdict::NotLinearizable);
}

#[test]
fn a_stale_read_after_a_completed_write_is_found() {
    let b = Instant::now();
    let h = vec![
        done(b, Op::Put(1), Out::Ok, 0, 1),
        done(b, Op::Put(2), Out::Ok, 2, 3),
        done(b, Op::Get, Out::Value(Some(1)), 4, 5),
    ];
    assert_eq!(check(&h, 1000), Verdict::NotLinearizable);
}

#[test]
fn a_lost_write_nobody_read_can_explain_a_failed_swap() {
    // The register holds 5; a write of 9 lost its answer; a later swap from 5 failed. Only the
    // lost write, applied in between, explains that (and 9 is never read: the checker folds it
    // into its one unseen value, which must still differ from 5).
    let b = Instant::now();
    let h = vec![
        done(b, Op::Put(5), Out::Ok, 0, 1),
        lost(b, Op::Put(9), 2),
        done(b, Op::Cas(5, 7), Out::Swapped(false), 10, 11),
    ];
    assert_eq!(check(&h, 1000), Verdict::Linearizable);
    // Without the lost write it is a violation.
    let h = vec![done(b, Op::Put(5), Out::Ok, 0, 1), done(b, Op::Cas(5, 7), Out::Swapped(false), 10, 11)];
    assert_eq!(check(&h, 1000), Verdict::NotLinearizable);
}

#[test]
fn a_lost_write_may_land_late_and_be_read() {
    let b = Instant::now();
    let h = vec![
        lost(b, Op::Put(3), 0),
        done(b, Op::Put(4), Out::Ok, 5, 6),
        done(b, Op::Get, Out::Value(Some(4)), 7, 8),
        done(b, Op::Get, Out::Value(Some(3)), 9, 10),
        done(b, Op::Get, Out::Value(Some(4)), 11, 12),
    ];
    // 3 lands after the first read and before the second, but 4 cannot come back after it.
    assert_eq!(check(&h, 1000), Verdict::NotLinearizable);
    let h = h[..4].to_vec();
    assert_eq!(check(&h, 1000), Verdict::Linearizable);
}

/// Forty writes lost their answers (a member killed under eight clients does that), none of
/// them ever read, then a violation. Without folding the unseen values and ordering the
/// interchangeable lost writes, proving the violation means visiting every subset of the
/// forty: 2^40 states. With them it takes a few hundred.
#[test]
fn many_lost_writes_do_not_blow_up_the_search() {
    let b = Instant::now();
    let mut h = vec![done(b, Op::Put(1), Out::Ok, 0, 1)];
    for i in 0..40 {
        h.push(lost(b, Op::Put(100 + i), 2 + i));
        h.push(lost(b, Op::Cas(1, 200 + i), 2 + i));
    }
    h.push(done(b, Op::Get, Out::Value(Some(1)), 100, 101));
    assert_eq!(check(&h, 10_000), Verdict::Linearizable, "the lost writes may all never have happened");
    h.push(done(b, Op::Get, Out::Value(Some(2)), 102, 103));
    assert_eq!(check(&h, 10_000), Verdict::NotLinearizable);
    // And one of the lost writes read later still linearizes.
    h.pop();
    h.push(done(b, Op::Get, Out::Value(Some(117)), 102, 103));
    assert_eq!(check(&h, 10_000), Verdict::Linearizable);
}

/// The history that stopped the search of a CI run (cluster_disks, seed 1795698026857595008:
/// 496 operations on one key, 35 writes with lost answers spread over 23 s of kills and power
/// losses). It must be decided, and it is linearizable.
#[test]
fn a_recorded_history_with_35_lost_writes_is_decided() {
    let text = include_str!("data/history-lost-answers.txt");
    let h = common::history::parse_dump(text).expect("parses");
    assert_eq!(h.len(), 496);
    let t = Instant::now();
    let verdict = check(&h, 4_000_000);
    eprintln!("{verdict:?} in {:?}", t.elapsed());
    assert_eq!(verdict, Verdict::Linearizable);
}

/// The plain search the reductions must agree with: any operation whose call precedes every
/// pending completed operation's return may go next; a lost-answer one may also never happen.
fn reference(events: &[Event], done: &mut Vec<bool>, value: Option<u64>) -> bool {
    let pending = |i: usize, done: &[bool]| !done[i] && events[i].ret.is_some();
    if (0..events.len()).all(|i| !pending(i, done)) {
        return true;
    }
    let horizon = (0..events.len()).filter(|&i| pending(i, done)).filter_map(|i| events[i].ret).min();
    for i in 0..events.len() {
        if done[i] || horizon.is_some_and(|h| events[i].call > h) {
            continue;
        }
        let e = &events[i];
        let next = match (&e.op, &e.out) {
            (Op::Put(v), Out::Ok | Out::Unknown) => Some(Some(*v)),
            (Op::Get, Out::Value(v)) => (*v == value).then_some(value),
            (Op::Get, Out::Unknown) => Some(value),
            (Op::Cas(x, n), Out::Swapped(true)) => (value == Some(*x)).then_some(Some(*n)),
            (Op::Cas(x, _), Out::Swapped(false)) => (value != Some(*x)).then_some(value),
            (Op::Cas(x, n), Out::Unknown) => Some(if value == Some(*x) { Some(*n) } else { value }),
            _ => None,
        };
        if let Some(v) = next {
            done[i] = true;
            let ok = reference(events, done, v);
            done[i] = false;
            if ok {
                return true;
            }
        }
    }
    false
}

/// Random small histories (values from a tiny domain, so writes repeat and lost writes share
/// effects; a third of the answers lost): the reduced search and the plain one agree.
#[test]
fn the_reductions_agree_with_the_plain_search() {
    use rand::{Rng, SeedableRng};
    let (mut yes, mut no) = (0, 0);
    for seed in 0..3000u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let b = Instant::now();
        let n = rng.gen_range(1..=8);
        let h: Vec<Event> = (0..n)
            .map(|_| {
                let call = rng.gen_range(0..20u64);
                let ret = call + rng.gen_range(1..8u64);
                let (op, out) = match rng.gen_range(0..3) {
                    0 => (Op::Put(rng.gen_range(1..6)), Out::Ok),
                    1 => (Op::Get, Out::Value(Some(rng.gen_range(0..4)).filter(|v| *v != 0))),
                    _ => (Op::Cas(rng.gen_range(0..4), rng.gen_range(1..6)), Out::Swapped(rng.gen_bool(0.5))),
                };
                if rng.gen_range(0..3) == 0 {
                    lost(b, op, call)
                } else {
                    done(b, op, out, call, ret)
                }
            })
            .collect();
        let want = reference(&h, &mut vec![false; h.len()], None);
        let got = check(&h, 1_000_000);
        assert_eq!(got, if want { Verdict::Linearizable } else { Verdict::NotLinearizable }, "seed {seed}: {h:#?}");
        if want {
            yes += 1;
        } else {
            no += 1;
        }
    }
    assert!(yes > 300 && no > 300, "both verdicts exercised: {yes} / {no}");
}

fn rev(
    base: Instant,
    member: &str,
    serializable: bool,
    call: u64,
    ret: Option<u64>,
    header: i64,
    body: i64,
) -> RevEvent {
    RevEvent { member: member.into(), serializable, call: at(base, call), ret: ret.map(|r| at(base, r)), header, body }
}

#[test]
fn a_header_below_its_body_is_found() {
    let b = Instant::now();
    let good = vec![rev(b, "m1", false, 0, Some(1), 7, 7), rev(b, "m1", true, 2, Some(3), 9, 4)];
    assert_eq!(check_revisions(&good), Vec::<String>::new());
    // A linearizable get returning a key with mod_revision 76 under header 73 (issue 36).
    let bad = vec![rev(b, "m1", false, 0, Some(1), 73, 76)];
    assert_eq!(check_revisions(&bad).len(), 1);
    let bad = vec![rev(b, "m2", true, 0, Some(1), 5, 6)];
    assert_eq!(check_revisions(&bad).len(), 1);
}

#[test]
fn a_header_going_back_in_real_time_is_found_across_members_and_keys() {
    let b = Instant::now();
    // Overlapping operations may report either order; later ones may not go back.
    let good = vec![
        rev(b, "m1", false, 0, Some(10), 9, 9),
        rev(b, "m2", false, 5, Some(8), 8, 0),
        rev(b, "m3", false, 11, Some(12), 9, 3),
    ];
    assert_eq!(check_revisions(&good), Vec::<String>::new());
    let bad = vec![rev(b, "m1", false, 0, Some(10), 9, 9), rev(b, "m2", false, 11, Some(12), 8, 8)];
    assert_eq!(check_revisions(&bad).len(), 1);
    // A failed operation bounds nothing.
    let lost = vec![rev(b, "m1", false, 0, None, 0, 0), rev(b, "m2", false, 11, Some(12), 8, 8)];
    assert_eq!(check_revisions(&lost), Vec::<String>::new());
}

#[test]
fn a_serializable_header_going_back_on_one_member_is_found_unless_it_may_have_restarted() {
    let b = Instant::now();
    // Serializable reads on different members may disagree; linearizable ones do not bound them.
    let good = vec![
        rev(b, "m1", true, 0, Some(1), 9, 0),
        rev(b, "m2", true, 2, Some(3), 5, 0),
        rev(b, "m1", false, 4, Some(5), 12, 0),
        rev(b, "m1", true, 6, Some(7), 9, 0),
    ];
    assert_eq!(check_revisions(&good), Vec::<String>::new());
    let bad = vec![rev(b, "m1", true, 0, Some(1), 9, 0), rev(b, "m1", true, 6, Some(7), 8, 0)];
    assert_eq!(check_revisions(&bad).len(), 1);
    // A failure on the member between them: it may have restarted from an older state.
    let restarted = vec![
        rev(b, "m1", true, 0, Some(1), 9, 0),
        rev(b, "m1", false, 3, None, 0, 0),
        rev(b, "m1", true, 6, Some(7), 8, 0),
    ];
    assert_eq!(check_revisions(&restarted), Vec::<String>::new());
}
