//! A checker for weak (causal) sessions against the log: every applied put of the checked keys
//! (key, unique value, revision), read back after the run, is the total order the sessions'
//! operations must fit. Checked per session, in session order:
//!
//! - no read of a write never made: a value read is in the log at the revision the read
//!   reported, or is the session's own write, reported pending;
//! - no lost and no doubled write: every write that completed is in the log exactly once;
//! - read-your-writes: a read of a key the session wrote returns that write or a later one;
//! - monotonic reads: a read returns no value older than the newest write of that key at or
//!   below the highest revision the session has already observed (through reads, or its own
//!   strong writes);
//! - monotonic writes and writes-follow-reads: the session's writes are in the log in session
//!   order, each above every revision the session had read before it.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// One operation of a weak session, in session order.
#[derive(Debug, Clone)]
pub enum SessionOp {
    /// A put of the unique `value`; `strong` says which path; `ok` whether it completed.
    Put { key: usize, value: u64, strong: bool, ok: bool },
    /// A weak read: the value and revision it returned (revision 0 with `pending`).
    Get { key: usize, got: Option<(u64, i64)>, pending: bool },
}

/// Applied puts as recorded: (key, value, revision).
pub type Puts = Vec<(usize, u64, i64)>;

/// The log of the checked keys: value → (key, revision).
pub type Log = HashMap<u64, (usize, i64)>;

/// Builds the log from applied puts (key, value, revision); a value twice is a double apply.
pub fn log_of(puts: &[(usize, u64, i64)]) -> Result<Log, String> {
    let mut log = Log::new();
    for &(key, value, rev) in puts {
        if let Some(old) = log.insert(value, (key, rev)) {
            return Err(format!("value {value} applied twice: at revision {} and {rev}", old.1));
        }
    }
    Ok(log)
}

/// Checks every session against `log`; returns the first anomaly.
pub fn check(log: &Log, sessions: &[Vec<SessionOp>]) -> Result<(), String> {
    // Per key, the revisions of its writes, ascending.
    let mut by_key: BTreeMap<usize, Vec<i64>> = BTreeMap::new();
    for &(key, rev) in log.values() {
        by_key.entry(key).or_default().push(rev);
    }
    for revs in by_key.values_mut() {
        revs.sort_unstable();
    }
    let newest_at_or_below = |key: usize, at: i64| -> i64 {
        by_key.get(&key).map_or(0, |revs| revs.iter().copied().take_while(|r| *r <= at).last().unwrap_or(0))
    };
    for (s, ops) in sessions.iter().enumerate() {
        // The highest revision the session has observed.
        let mut seen = 0i64;
        // The session's own writes, by key: the latest write's value (and whether it applied).
        let mut own: HashMap<usize, u64> = HashMap::new();
        let mut own_values: HashMap<u64, usize> = HashMap::new();
        let mut last_write_rev = 0i64;
        for (i, op) in ops.iter().enumerate() {
            let at = format!("session {s}, op {i} ({op:?})");
            match op {
                SessionOp::Put { key, value, strong, ok } => {
                    // Read-your-writes is owed for writes that completed; after one whose fate
                    // is unknown the key is not checked until the next completed write.
                    if *ok {
                        own.insert(*key, *value);
                    } else {
                        own.remove(key);
                    }
                    own_values.insert(*value, *key);
                    match log.get(value) {
                        Some(&(k, _)) if k != *key => return Err(format!("{at}: applied to key {k}")),
                        // A write whose fate the session never learned may land anywhere later
                        // (a timed-out command recovered from the witnesses by a new leader).
                        Some(_) if !*ok => {}
                        Some(&(_, rev)) => {
                            if rev <= last_write_rev {
                                return Err(format!(
                                    "{at}: at revision {rev}, not after the session's previous write ({last_write_rev})"
                                ));
                            }
                            if rev <= seen {
                                return Err(format!(
                                    "{at}: at revision {rev}, not after what the session had read ({seen})"
                                ));
                            }
                            last_write_rev = rev;
                            // A completed strong write counts as observed: the session's
                            // next weak read waits until it has applied.
                            if *strong && *ok {
                                seen = seen.max(rev);
                            }
                        }
                        None if *ok => return Err(format!("{at}: completed but never applied (lost)")),
                        None => {}
                    }
                }
                SessionOp::Get { key, got, pending: true } => {
                    // The session's own write, not yet applied where it was read.
                    let Some((v, _)) = got else { return Err(format!("{at}: pending without a value")) };
                    if own_values.get(v) != Some(key) {
                        return Err(format!("{at}: pending value {v} is not the session's own write of the key"));
                    }
                    if own.get(key).is_some_and(|w| w != v) {
                        return Err(format!("{at}: pending value {v} is not the session's latest write of the key"));
                    }
                }
                SessionOp::Get { key, got, pending: false } => {
                    let rev = match got {
                        Some((v, r)) => match log.get(v) {
                            Some(&(k, lr)) if k == *key && lr == *r => lr,
                            Some(&(k, lr)) => {
                                return Err(format!(
                                    "{at}: value {v} is key {k}'s write at revision {lr}, read as key {key} at {r}"
                                ))
                            }
                            None => return Err(format!("{at}: read value {v}, which no write made")),
                        },
                        None => 0,
                    };
                    // Read-your-writes.
                    if let Some(w) = own.get(key) {
                        let w_rev = log.get(w).map_or(i64::MAX, |e| e.1);
                        if rev < w_rev {
                            return Err(format!("{at}: the session's own write {w} (revision {w_rev}) not seen"));
                        }
                    }
                    // Monotonic reads, against everything observed so far.
                    let floor = newest_at_or_below(*key, seen);
                    if rev < floor {
                        return Err(format!(
                            "{at}: returned revision {rev}, older than the key's write at {floor} (the session had seen {seen})"
                        ));
                    }
                    seen = seen.max(rev);
                }
            }
        }
    }
    Ok(())
}

/// A value as the tests write it (decimal); anything else reads as u64::MAX.
pub fn parse(value: &[u8]) -> u64 {
    std::str::from_utf8(value).ok().and_then(|s| s.parse().ok()).unwrap_or(u64::MAX)
}

/// Records every put of the keys `prefix`N (N, value, revision) from revision `from` on, through a
/// watch that moves to another member when its member stops (resuming after the last revision
/// it saw; members keep history only since their start, so a watch from revision 1 at the end
/// would be refused by a member that restarted). Returns once it has seen revision `head`, sent
/// when the run is over.
pub async fn record_log(
    urls: Vec<String>,
    prefix: &'static str,
    from: i64,
    mut head: tokio::sync::watch::Receiver<i64>,
) -> Result<Puts, String> {
    let mut puts = Vec::new();
    let mut next = from;
    let mut cancels = 0;
    for attempt in 0usize.. {
        let done = |next: i64, head: i64| head > 0 && next > head;
        if done(next, *head.borrow()) {
            return Ok(puts);
        }
        if attempt > 2_000 {
            return Err(format!("the recording watch gave up at revision {next}"));
        }
        let url = &urls[attempt % urls.len()];
        let opts = etcd_client::WatchOptions::new().with_prefix().with_start_revision(next);
        let stream = async {
            let mut c = etcd_client::Client::connect([url.as_str()], None).await.ok()?;
            c.watch(prefix, Some(opts)).await.ok()
        };
        let Ok(Some(mut stream)) = tokio::time::timeout(Duration::from_secs(2), stream).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        loop {
            tokio::select! {
                msg = stream.message() => match msg {
                    Ok(Some(resp)) if resp.canceled() => {
                        // This member's history starts after `next`: try another.
                        cancels += 1;
                        if cancels > 50 {
                            return Err(format!("every member refused a watch from revision {next}: {}", resp.cancel_reason()));
                        }
                        break;
                    }
                    Ok(Some(resp)) => {
                        for e in resp.events() {
                            let Some(kv) = e.kv() else { continue };
                            next = next.max(kv.mod_revision() + 1);
                            if e.event_type() == etcd_client::EventType::Put {
                                let key = std::str::from_utf8(kv.key()).unwrap().trim_start_matches(prefix).parse().unwrap();
                                puts.push((key, parse(kv.value()), kv.mod_revision()));
                            }
                        }
                    }
                    _ => break,
                },
                r = head.changed() => if r.is_err() { return Err("the test went away".into()) },
            }
            if done(next, *head.borrow()) {
                return Ok(puts);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err("unreachable".into())
}

/// Waits for each weak session's task, then until its writes have applied (`tries` attempts of
/// `settle`); returns the sessions' histories, or says which one did not settle.
pub async fn settle_all(
    tasks: Vec<tokio::task::JoinHandle<(keel_curp::client::Client, Vec<SessionOp>)>>,
    tries: usize,
) -> Result<Vec<Vec<SessionOp>>, String> {
    let mut sessions = Vec::new();
    for (i, t) in tasks.into_iter().enumerate() {
        let (client, ops) = t.await.map_err(|e| format!("weak session {i}: {e}"))?;
        let mut settled = false;
        for _ in 0..tries {
            if client.settle().await.is_ok() {
                settled = true;
                break;
            }
        }
        if !settled {
            return Err(format!("weak session {i}'s writes did not apply after the faults"));
        }
        sessions.push(ops);
    }
    Ok(sessions)
}

/// Ends a [`record_log`] run: reads the newest put of the keys `prefix`N (asking the members
/// again while they recover), sends it as the head, and returns the log once recorded that far.
pub async fn close_log(
    urls: &[String],
    prefix: &str,
    start_rev: i64,
    head: tokio::sync::watch::Sender<i64>,
    recorder: tokio::task::JoinHandle<Result<Puts, String>>,
) -> Result<Log, String> {
    let mut newest = None;
    for _ in 0..50 {
        let Ok(mut c) = etcd_client::Client::connect(urls, None).await else { continue };
        if let Ok(now) = c.get(prefix, Some(etcd_client::GetOptions::new().with_prefix())).await {
            // The latest of each key's current value is the newest put of any.
            newest = Some(now.kvs().iter().map(|kv| kv.mod_revision()).max().unwrap_or(start_rev));
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    head.send_replace(newest.ok_or("no member answered a read after the faults")?);
    let puts = tokio::time::timeout(Duration::from_secs(60), recorder)
        .await
        .map_err(|_| "the recording watch did not catch up".to_string())?
        .map_err(|e| e.to_string())??;
    log_of(&puts)
}
