//! Client histories of the fault tests and their linearizability check: clients doing put,
//! linearizable get and compare-and-swap on a few keys record each call and its answer; the
//! history is checked per key as a register (a Wing–Gong search with memoization; an operation
//! whose answer was lost may take effect at any point after it began, or never).

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, ConnectOptions, Txn, TxnOp};
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone)]
pub enum Op {
    Put(u64),
    Get,
    Cas(u64, u64),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Out {
    Ok,
    Value(Option<u64>),
    Swapped(bool),
    Unknown,
}

#[derive(Debug, Clone)]
pub struct Event {
    pub key: usize,
    pub op: Op,
    pub out: Out,
    pub call: Instant,
    pub ret: Option<Instant>,
}

/// Visited search states: (completed operations applied, register value) to the per-group
/// counts of lost-answer operations applied in each visit.
type Visited = std::collections::HashMap<(Vec<u64>, Option<u64>), Vec<Vec<u16>>>;

/// A value no operation of the history ever compares against (see [`check`]).
const UNSEEN: u64 = u64::MAX - 1;

/// How many search states [`check`] visits per key before it gives up.
pub const STATE_BUDGET: usize = 4_000_000;

/// What the search concluded for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Linearizable,
    NotLinearizable,
    /// The state budget ran out first.
    GaveUp,
}

/// Whether `events` (one key) can be linearized as a register.
pub fn linearizable(events: &[Event]) -> bool {
    check(events, STATE_BUDGET) == Verdict::Linearizable
}

/// The Wing–Gong search for one key's history as a register: puts set, gets read, a cas swaps
/// only when the value equals its expectation. Operations whose answer was lost may take
/// effect at any point after their call, or never. Two reductions keep kill-heavy histories
/// (dozens of lost answers at once) from an exponential search; both keep the verdict:
/// - A written value that no get returned and no cas expected is interchangeable with any
///   other such value, so all of them become one value, `UNSEEN`.
/// - Lost-answer operations with the same effect after that (`Put(UNSEEN)`, or `Cas(e, n)`
///   with the same `e` and `n`) are interchangeable, and the one called first can go wherever
///   a later one can (nothing but its call bounds it). So they are applied in call order: a
///   later one only once the earlier ones are applied. That turns 2^k subsets into k + 1.
///
/// Without them a 10-second kill with eight clients made a history that ran for minutes.
pub fn check(events: &[Event], budget: usize) -> Verdict {
    // A read whose answer was lost constrains nothing.
    let mut events: Vec<Event> =
        events.iter().filter(|e| !(matches!(e.op, Op::Get) && e.out == Out::Unknown)).cloned().collect();
    events.sort_by_key(|e| e.call);
    let mut observed: HashSet<u64> = HashSet::new();
    for e in &events {
        match (&e.op, &e.out) {
            (Op::Get, Out::Value(Some(v))) => {
                observed.insert(*v);
            }
            (Op::Cas(exp, _), _) => {
                observed.insert(*exp);
            }
            _ => {}
        }
    }
    let seen = |v: u64| if observed.contains(&v) { v } else { UNSEEN };
    for e in &mut events {
        e.op = match e.op {
            Op::Put(v) => Op::Put(seen(v)),
            Op::Cas(exp, new) => Op::Cas(exp, seen(new)),
            Op::Get => Op::Get,
        };
    }
    let n = events.len();
    let completed: Vec<bool> = events.iter().map(|e| e.ret.is_some()).collect();
    let to_complete = completed.iter().filter(|c| **c).count();
    // For a lost-answer operation: its group of operations with the same effect, and the
    // previous one (by call) in that group.
    let mut group_ids: std::collections::HashMap<(u8, u64, u64), usize> = std::collections::HashMap::new();
    let mut last_in: Vec<usize> = Vec::new();
    let mut group: Vec<Option<usize>> = vec![None; n];
    let mut before: Vec<Option<usize>> = vec![None; n];
    for (i, e) in events.iter().enumerate() {
        if e.out != Out::Unknown {
            continue;
        }
        let effect = match e.op {
            Op::Put(v) => (0, v, 0),
            Op::Cas(exp, new) => (1, exp, new),
            Op::Get => continue,
        };
        let next = group_ids.len();
        let g = *group_ids.entry(effect).or_insert(next);
        if g == last_in.len() {
            last_in.push(i);
        } else {
            before[i] = Some(last_in[g]);
            last_in[g] = i;
        }
        group[i] = Some(g);
    }
    let groups = last_in.len();
    let words = n.div_ceil(64).max(1);
    let mut completed_mask = vec![0u64; words];
    for i in (0..n).filter(|&i| completed[i]) {
        completed_mask[i / 64] |= 1 << (i % 64);
    }
    // Visited states, keyed by (completed operations applied, register value), each with the
    // per-group counts of lost-answer operations applied. A state that applied at least as many
    // of every group as a visited one with the same key can do nothing that one could not:
    // its remaining operations are a subset (by the group order, the earliest-called ones are
    // what it lacks), the horizon depends only on completed operations, and "never" is always
    // allowed for the lost ones. So it is skipped.
    let mut visited: Visited = std::collections::HashMap::new();
    let mut states = 0usize;
    // Depth-first: (applied set, register value, completed operations applied).
    let mut stack: Vec<(Vec<u64>, Option<u64>, usize)> = vec![(vec![0; words], None, 0)];
    let mut candidates: Vec<usize> = Vec::new();
    while let Some((done, value, finished)) = stack.pop() {
        if finished == to_complete {
            return Verdict::Linearizable;
        }
        let is_done = |i: usize| done[i / 64] >> (i % 64) & 1 == 1;
        let mut counts = vec![0u16; groups];
        for i in (0..n).filter(|&i| is_done(i)) {
            if let Some(g) = group[i] {
                counts[g] += 1;
            }
        }
        let key: Vec<u64> = done.iter().zip(&completed_mask).map(|(d, m)| d & m).collect();
        let seen = visited.entry((key, value)).or_default();
        if seen.iter().any(|old| old.iter().zip(&counts).all(|(o, c)| o <= c)) {
            continue;
        }
        seen.push(counts);
        states += 1;
        if states > budget {
            return Verdict::GaveUp;
        }
        // The earliest return among completed operations not yet applied: nothing called
        // after it may go first.
        let horizon = (0..n).filter(|&i| completed[i] && !is_done(i)).filter_map(|i| events[i].ret).min();
        candidates.clear();
        for i in 0..n {
            if horizon.is_some_and(|h| events[i].call > h) {
                break; // sorted by call
            }
            if is_done(i) || before[i].is_some_and(|b| !is_done(b)) {
                continue;
            }
            candidates.push(i);
        }
        // Tried first (pushed last): completed operations, earliest called first; real-time
        // order is almost always a linearization. Lost-answer operations last: "never" is
        // always allowed for them.
        let order =
            candidates.iter().filter(|&&i| !completed[i]).chain(candidates.iter().filter(|&&i| completed[i]).rev());
        for &i in order {
            let e = &events[i];
            let next = match (&e.op, &e.out) {
                (Op::Put(v), Out::Ok | Out::Unknown) => Some(Some(*v)),
                (Op::Get, Out::Value(v)) => (*v == value).then_some(value),
                (Op::Cas(exp, new), Out::Swapped(true)) => (value == Some(*exp)).then_some(Some(*new)),
                (Op::Cas(exp, _), Out::Swapped(false)) => (value != Some(*exp)).then_some(value),
                (Op::Cas(exp, new), Out::Unknown) => Some(if value == Some(*exp) { Some(*new) } else { value }),
                _ => None,
            };
            if let Some(v) = next {
                let mut d = done.clone();
                d[i / 64] |= 1 << (i % 64);
                stack.push((d, v, finished + usize::from(completed[i])));
            }
        }
    }
    Verdict::NotLinearizable
}

/// Reads back a history written by [`assert_linearizable`] (call and return in milliseconds,
/// `-` for none, the operation and its outcome), for replaying a failure in a test.
pub fn parse_dump(text: &str) -> Option<Vec<Event>> {
    let base = Instant::now();
    let at = |ms: &str| -> Option<Instant> { Some(base + Duration::from_secs_f64(ms.parse::<f64>().ok()? / 1000.0)) };
    let num = |s: &str| s.trim().parse::<u64>().ok();
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut parts = line.split_whitespace();
        let call = at(parts.next()?)?;
        let ret = match parts.next()? {
            "-" => None,
            ms => Some(at(ms)?),
        };
        let rest: String = parts.collect::<Vec<_>>().join(" ");
        let (op, outcome) = rest.split_once(" -> ")?;
        let op = if op == "Get" {
            Op::Get
        } else if let Some(v) = op.strip_prefix("Put(").and_then(|x| x.strip_suffix(')')) {
            Op::Put(num(v)?)
        } else {
            let (a, b) = op.strip_prefix("Cas(")?.strip_suffix(')')?.split_once(',')?;
            Op::Cas(num(a)?, num(b)?)
        };
        let outcome = match outcome {
            "Ok" => Out::Ok,
            "Unknown" => Out::Unknown,
            "Value(None)" => Out::Value(None),
            "Swapped(true)" => Out::Swapped(true),
            "Swapped(false)" => Out::Swapped(false),
            v => Out::Value(Some(num(v.strip_prefix("Value(Some(")?.strip_suffix("))")?)?)),
        };
        out.push(Event { key: 0, op, out: outcome, call, ret });
    }
    Some(out)
}

/// Checks every key's history; panics naming the seed and the first key that fails.
pub fn assert_linearizable(history: &[Event], keys: usize, seed: u64) {
    for key in 0..keys {
        let events: Vec<Event> = history.iter().filter(|e| e.key == key).cloned().collect();
        let verdict = check(&events, STATE_BUDGET);
        if verdict != Verdict::Linearizable {
            // The key's history, by call time, for whoever debugs it.
            let t0 = history.iter().map(|e| e.call).min().unwrap_or_else(Instant::now);
            let mut sorted = events.clone();
            sorted.sort_by_key(|e| e.call);
            let ms = |t: Instant| t.duration_since(t0).as_secs_f64() * 1000.0;
            let text: String = sorted
                .iter()
                .map(|e| {
                    format!(
                        "{:10.3} {:>10} {:?} -> {:?}\n",
                        ms(e.call),
                        e.ret.map_or("-".into(), |r| format!("{:.3}", ms(r))),
                        e.op,
                        e.out
                    )
                })
                .collect();
            let path = std::env::temp_dir().join(format!("keel-history-{seed}-key{key}.txt"));
            let _ = std::fs::write(&path, text);
            panic!(
                "seed {seed}: key{key} history: {verdict:?} ({} events, {STATE_BUDGET} states at most; written to {})",
                events.len(),
                path.display()
            );
        }
    }
}

/// What one client shares with the test: the history, the value counter (values are unique
/// across clients), the acknowledged writes of unique keys (`acked/<client>/<n>`), which
/// must all be present at the end, and a flag that stops the clients early.
#[derive(Clone, Default)]
pub struct Shared {
    pub history: Arc<Mutex<Vec<Event>>>,
    /// The header revision of every answer and the largest revision in its body, for
    /// [`check_revisions`].
    pub revisions: Arc<Mutex<Vec<RevEvent>>>,
    pub counter: Arc<AtomicU64>,
    pub acked: Arc<Mutex<Vec<String>>>,
    pub stop: Arc<AtomicBool>,
}

/// How one client runs: `keys` register keys, until `deadline` or `max_ops` operations; with
/// `unique_puts`, one operation in eight writes a fresh key and records it once acknowledged.
#[derive(Clone)]
pub struct ClientPlan {
    pub url: String,
    pub seed: u64,
    pub client: u64,
    pub keys: usize,
    pub deadline: Instant,
    pub max_ops: usize,
    pub unique_puts: bool,
    /// Per-call timeout: long enough for an election, short enough that a dead member's
    /// clients move on.
    pub timeout: Duration,
}

/// Connects to `plan.url`, retrying until it answers or the client should stop.
async fn connect(plan: &ClientPlan, shared: &Shared) -> Option<Client> {
    let opts = ConnectOptions::new().with_timeout(plan.timeout).with_connect_timeout(Duration::from_secs(1));
    while Instant::now() < plan.deadline && !shared.stop.load(Ordering::Relaxed) {
        if let Ok(c) = Client::connect([plan.url.as_str()], Some(opts.clone())).await {
            return Some(c);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// Runs one client to its deadline, its operation budget or the stop flag. After a failed
/// call it pauses and reconnects (its member may have restarted), so a member that is down
/// costs a few unknown outcomes, not thousands.
pub async fn run_client(plan: ClientPlan, shared: Shared) {
    let Some(mut client) = connect(&plan, &shared).await else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(plan.seed ^ (plan.client << 32));
    let mut last_seen: BTreeMap<usize, u64> = BTreeMap::new();
    let mut ops = 0usize;
    let mut unique = 0u64;
    let next = || shared.counter.fetch_add(1, Ordering::Relaxed);
    let mut failed = false;
    while Instant::now() < plan.deadline && ops < plan.max_ops && !shared.stop.load(Ordering::Relaxed) {
        if std::mem::take(&mut failed) {
            tokio::time::sleep(Duration::from_millis(100)).await;
            match connect(&plan, &shared).await {
                Some(c) => client = c,
                None => return,
            }
        }
        ops += 1;
        if plan.unique_puts && rng.gen_range(0..8) == 0 {
            let k = format!("acked/{}/{unique}", plan.client);
            unique += 1;
            match client.put(k.as_str(), "1", None).await {
                Ok(_) => shared.acked.lock().push(k),
                Err(_) => failed = true,
            }
            continue;
        }
        let key = rng.gen_range(0..plan.keys);
        let k = format!("key{key}");
        let call = Instant::now();
        // The answer's header revision and the largest revision in its body (0: none).
        let mut revs = None;
        let (op, out) = match rng.gen_range(0..4) {
            0 => {
                let v = next();
                let out = match client.put(k.as_str(), v.to_string(), None).await {
                    Ok(r) => {
                        revs = Some((r.header().map_or(0, |h| h.revision()), 0));
                        Out::Ok
                    }
                    Err(_) => Out::Unknown,
                };
                (Op::Put(v), out)
            }
            1 => {
                let out = match client.get(k.as_str(), None).await {
                    Ok(r) => {
                        revs = Some((r.header().map_or(0, |h| h.revision()), max_mod(r.kvs())));
                        let v = r.kvs().first().map(|kv| parse(kv.value()));
                        if let Some(v) = v {
                            last_seen.insert(key, v);
                        }
                        Out::Value(v)
                    }
                    Err(_) => Out::Unknown,
                };
                (Op::Get, out)
            }
            2 => {
                // A serializable get: answered by this member alone, so it is outside the
                // linearizability check; only its revisions are checked.
                let opts = etcd_client::GetOptions::new().with_serializable();
                match client.get(k.as_str(), Some(opts)).await {
                    Ok(r) => {
                        let (header, body) = (r.header().map_or(0, |h| h.revision()), max_mod(r.kvs()));
                        shared.revisions.lock().push(RevEvent {
                            member: plan.url.clone(),
                            serializable: true,
                            call,
                            ret: Some(Instant::now()),
                            header,
                            body,
                        });
                    }
                    Err(_) => {
                        failed = true;
                        shared.revisions.lock().push(RevEvent::failed(&plan.url, true, call));
                    }
                }
                continue;
            }
            _ => {
                let exp = last_seen.get(&key).copied().unwrap_or(0);
                let new = next();
                let txn = Txn::new()
                    .when([Compare::value(k.as_str(), CompareOp::Equal, exp.to_string())])
                    .and_then([TxnOp::put(k.as_str(), new.to_string(), None)])
                    .or_else([TxnOp::get(k.as_str(), None)]);
                let out = match client.txn(txn).await {
                    Ok(r) => {
                        revs = Some((r.header().map_or(0, |h| h.revision()), txn_max_mod(r.op_responses())));
                        Out::Swapped(r.succeeded())
                    }
                    Err(_) => Out::Unknown,
                };
                (Op::Cas(exp, new), out)
            }
        };
        failed = out == Out::Unknown;
        let ret = (!failed).then(Instant::now);
        let rev = match revs {
            Some((header, body)) => RevEvent { member: plan.url.clone(), serializable: false, call, ret, header, body },
            None => RevEvent::failed(&plan.url, false, call),
        };
        shared.revisions.lock().push(rev);
        shared.history.lock().push(Event { key, op, out, call, ret });
    }
}

fn max_mod(kvs: &[etcd_client::KeyValue]) -> i64 {
    kvs.iter().map(|kv| kv.mod_revision().max(kv.create_revision())).max().unwrap_or(0)
}

/// The largest revision in a txn's answers, nested ones included.
fn txn_max_mod(ops: Vec<etcd_client::TxnOpResponse>) -> i64 {
    ops.into_iter()
        .map(|op| match op {
            etcd_client::TxnOpResponse::Get(r) => max_mod(r.kvs()),
            etcd_client::TxnOpResponse::Put(r) => r.prev_key().map_or(0, |kv| kv.mod_revision()),
            etcd_client::TxnOpResponse::Delete(r) => max_mod(r.prev_kvs()),
            etcd_client::TxnOpResponse::Txn(t) => txn_max_mod(t.op_responses()),
        })
        .max()
        .unwrap_or(0)
}

/// One answer's revisions, for [`check_revisions`]: its header revision and the largest
/// `mod_revision` (or `create_revision`) in its body, or a failure (`ret` none).
#[derive(Debug, Clone)]
pub struct RevEvent {
    /// The member the client talks to.
    pub member: String,
    /// A serializable read (answered by the member alone); otherwise a linearizable operation.
    pub serializable: bool,
    pub call: Instant,
    pub ret: Option<Instant>,
    pub header: i64,
    pub body: i64,
}

impl RevEvent {
    fn failed(member: &str, serializable: bool, call: Instant) -> RevEvent {
        RevEvent { member: member.to_string(), serializable, call, ret: None, header: 0, body: 0 }
    }
}

/// etcd's revision contract on a history's answers (issue 36), as violations:
/// 1. every answer's header revision is at least every revision in its body;
/// 2. a linearizable operation called after another returned reports a header revision at
///    least that one's, whatever keys either touched;
/// 3. on one member, a serializable read called after another serializable read on it
///    returned reports a header revision at least that one's, unless the member may have
///    restarted in between (some operation on it failed in that span).
pub fn check_revisions(events: &[RevEvent]) -> Vec<String> {
    let mut violations = Vec::new();
    let done: Vec<&RevEvent> = events.iter().filter(|e| e.ret.is_some()).collect();
    for e in &done {
        if e.header < e.body || e.header < 1 {
            violations.push(format!("header revision {} below its body's revision {}: {e:?}", e.header, e.body));
        }
    }
    // Rule 2: sweep the linearizable operations by call time, knowing the largest header of
    // every one that returned before.
    let mut by_call: Vec<&RevEvent> = done.iter().copied().filter(|e| !e.serializable).collect();
    let mut by_ret = by_call.clone();
    by_call.sort_by_key(|e| e.call);
    by_ret.sort_by_key(|e| e.ret);
    let (mut next, mut floor): (usize, Option<&RevEvent>) = (0, None);
    for b in &by_call {
        while let Some(a) = by_ret.get(next).filter(|a| a.ret < Some(b.call)) {
            if floor.is_none_or(|f| a.header > f.header) {
                floor = Some(a);
            }
            next += 1;
        }
        if let Some(a) = floor.filter(|a| b.header < a.header) {
            violations.push(format!(
                "header revision went back from {} to {} across operations in real-time order: {a:?} then {b:?}",
                a.header, b.header
            ));
        }
    }
    // Rule 3, per member.
    let members: std::collections::BTreeSet<&str> = events.iter().map(|e| e.member.as_str()).collect();
    for member in members {
        let failures: Vec<Instant> =
            events.iter().filter(|e| e.member == member && e.ret.is_none()).map(|e| e.call).collect();
        let mut reads: Vec<&RevEvent> = done.iter().copied().filter(|e| e.serializable && e.member == member).collect();
        reads.sort_by_key(|e| e.call);
        for (i, b) in reads.iter().enumerate() {
            let earlier = reads[..i].iter().filter(|a| a.ret < Some(b.call) && a.header > b.header);
            let restarted = |a: &&&RevEvent| failures.iter().any(|f| *f >= a.call && Some(*f) <= b.ret);
            if let Some(a) = earlier.filter(|a| !restarted(a)).max_by_key(|a| a.header) {
                violations.push(format!(
                    "serializable header revision went back on {member} from {} to {}: {a:?} then {b:?}",
                    a.header, b.header
                ));
            }
        }
    }
    violations
}

/// Panics naming the seed and the first violations of [`check_revisions`].
pub fn assert_revisions(events: &[RevEvent], seed: u64) {
    let violations = check_revisions(events);
    assert!(
        violations.is_empty(),
        "seed {seed}: {} revision violations in {} answers, first: {:#?}",
        violations.len(),
        events.len(),
        &violations[..violations.len().min(5)]
    );
}

/// A register value as the clients write it.
pub fn parse(value: &[u8]) -> u64 {
    std::str::from_utf8(value).ok().and_then(|s| s.parse().ok()).unwrap_or(u64::MAX)
}
