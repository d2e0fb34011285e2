//! Applying commands from a replicated log, in log order, through the same pipeline as
//! transactions.
//!
//! A [`Command`] is a list of writes guarded by conditions ("this key currently holds this
//! value, or is absent"). It carries no snapshot: whether it applies depends only on the state
//! produced by every command before it in the log, so every replica that applies the same log
//! reaches the same state, digest and outcomes. Its conditions are evaluated by the leader at
//! sequencing time against the published index (the leader first waits until everything
//! sequenced before this batch is published, which is a memory-only step) and the writes of
//! earlier commits in the same batch. A command whose condition fails still takes its
//! timestamp and logs a frame that holds only its log position, so the applied position always
//! names the last command decided, and replaying the log decides nothing differently.
//!
//! The position rides in the same WAL frame as the command's writes (and in checkpoints), so
//! recovery restores exactly the position of the last command whose writes survived. This
//! module never reaches the database handle; `db.rs` exposes it as `Database::apply_batch`.

use std::sync::Arc;

use super::request::{CommitRequest, TableApply, TableSet, TableWrites};
use super::waiter::{Outcome, Waiter};
use super::Committer;
use crate::error::{Error, Result};
use crate::index::Key;
use crate::options::{check_key, check_table_name, check_value, Durability, Isolation};
use crate::types::{FastMap, LogPosition};

/// A condition of a [`Command`]: `key` in `table` currently holds `expected` (`None`: the key
/// is absent, or the table does not exist).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    /// The table.
    pub table: String,
    /// The key.
    pub key: Vec<u8>,
    /// The value the key must hold; `None` means it must be absent.
    pub expected: Option<Vec<u8>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Write {
    Put { table: String, key: Vec<u8>, value: Vec<u8> },
    Delete { table: String, key: Vec<u8> },
}

/// A deterministic command from a replicated log: writes applied only if every condition holds
/// against the state in log order. Built with [`Command::new`] and the builder methods.
/// Writes may target the engine's reserved tables (for example a deduplication table of
/// client ids, sequence numbers and results), so such records commit with the command.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Command {
    conditions: Vec<Condition>,
    writes: Vec<Write>,
}

impl Command {
    /// An empty command (it still advances the applied position).
    pub fn new() -> Command {
        Command::default()
    }

    /// Sets `key` to `value` in `table` (later writes to the same key win).
    pub fn put(mut self, table: impl Into<String>, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> Command {
        self.writes.push(Write::Put { table: table.into(), key: key.into(), value: value.into() });
        self
    }

    /// Deletes `key` from `table`.
    pub fn delete(mut self, table: impl Into<String>, key: impl Into<Vec<u8>>) -> Command {
        self.writes.push(Write::Delete { table: table.into(), key: key.into() });
        self
    }

    /// Adds a condition: `key` in `table` must hold `expected` (`None`: be absent).
    pub fn expect(mut self, table: impl Into<String>, key: impl Into<Vec<u8>>, expected: Option<Vec<u8>>) -> Command {
        self.conditions.push(Condition { table: table.into(), key: key.into(), expected });
        self
    }

    /// The conditions, in the order they are evaluated.
    pub fn conditions(&self) -> &[Condition] {
        &self.conditions
    }

    /// Checks every name, key and value against the limits; nothing is queued if one fails.
    fn check(&self) -> Result<()> {
        for c in &self.conditions {
            check_table_name(&c.table)?;
            check_key(&c.key)?;
        }
        for w in &self.writes {
            match w {
                Write::Put { table, key, value } => {
                    check_table_name(table)?;
                    check_key(key)?;
                    check_value(value)?;
                }
                Write::Delete { table, key } => {
                    check_table_name(table)?;
                    check_key(key)?;
                }
            }
        }
        Ok(())
    }

    /// The request the pipeline sequences. `names` interns table names across a batch, so a
    /// log whose commands write the same few tables allocates each name once.
    fn into_request(self, position: LogPosition, durability: Durability, names: &mut Vec<Arc<str>>) -> CommitRequest {
        let mut tables = TableSet::default();
        for w in self.writes {
            let (table, key, value) = match w {
                Write::Put { table, key, value } => (table, key, Some(value)),
                Write::Delete { table, key } => (table, key, None),
            };
            match tables.get_mut(table.as_str()) {
                Some(tw) => {
                    tw.writes.insert(&key, value.as_deref());
                }
                None => {
                    let mut tw = TableWrites::default();
                    tw.writes.insert(&key, value.as_deref());
                    tables.insert(intern(names, &table), tw);
                }
            }
        }
        CommitRequest {
            start_ts: 0,
            durability,
            isolation: Isolation::Snapshot,
            tables,
            reads: Vec::new(),
            apply: Some(ApplyPart { position, conditions: self.conditions }),
        }
    }
}

fn intern(names: &mut Vec<Arc<str>>, name: &str) -> Arc<str> {
    if let Some(n) = names.iter().find(|n| &***n == name) {
        return Arc::clone(n);
    }
    let n: Arc<str> = Arc::from(name);
    if names.len() < 16 {
        names.push(Arc::clone(&n));
    }
    n
}

/// How an applied command ended. Either way its position is now applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ApplyOutcome {
    /// Every condition held; the writes are committed at `ts`.
    Applied {
        /// The commit timestamp.
        ts: u64,
    },
    /// Condition number `condition` (0-based) did not hold; nothing but the position was
    /// written (at `ts`).
    ConditionFailed {
        /// The commit timestamp of the position-only frame.
        ts: u64,
        /// Index into [`Command::conditions`].
        condition: usize,
    },
}

impl ApplyOutcome {
    /// The commit timestamp the command took.
    pub fn ts(&self) -> u64 {
        match *self {
            ApplyOutcome::Applied { ts } | ApplyOutcome::ConditionFailed { ts, .. } => ts,
        }
    }
}

/// The log-order part of a commit request.
#[derive(Debug)]
pub(crate) struct ApplyPart {
    pub position: LogPosition,
    pub conditions: Vec<Condition>,
}

/// Writes of commits sequenced earlier in the same batch, for evaluating conditions: per
/// table, the key's newest value (`None`: deleted), and whether the table was dropped.
#[derive(Debug, Default)]
pub(crate) struct BatchOverlay {
    tables: FastMap<Arc<str>, TableOverlay>,
}

#[derive(Debug, Default)]
struct TableOverlay {
    dropped: bool,
    writes: FastMap<Key, Option<Vec<u8>>>,
}

impl BatchOverlay {
    /// Records a sequenced commit's effects.
    pub fn record(&mut self, tables: &[TableApply]) {
        for ta in tables {
            if ta.drop_id.is_none() && ta.writes.is_empty() {
                continue;
            }
            let t = self.tables.entry(Arc::clone(&ta.name)).or_default();
            if ta.drop_id.is_some() {
                t.dropped = true;
                t.writes.clear();
            }
            for (k, v) in &ta.writes {
                t.writes.insert(k.clone(), v.map(<[u8]>::to_vec));
            }
        }
    }

    /// What this batch wrote to the key: `Some(value or None)`, or `None` if it did not touch
    /// it (then the published index decides).
    fn get(&self, table: &str, key: &[u8]) -> Option<Option<Vec<u8>>> {
        let t = self.tables.get(table)?;
        match t.writes.get(key) {
            Some(v) => Some(v.clone()),
            None if t.dropped => Some(None),
            None => None,
        }
    }
}

impl Committer {
    /// Evaluates conditions in order; returns the first that fails. Reads the published index
    /// (which the caller made current) under the overlay of this batch's earlier writes.
    pub(super) fn first_failed_condition(&self, conditions: &[Condition], overlay: &BatchOverlay) -> Option<usize> {
        let view = &self.published;
        let visible = view.visible_ts();
        conditions.iter().position(|c| {
            let current = overlay.get(&c.table, &c.key).unwrap_or_else(|| {
                let catalog = view.catalog.read();
                catalog.table_at(&c.table, visible).and_then(|t| t.data.read().get(&c.key, visible))
            });
            current != c.expected
        })
    }

    /// Waits until every commit sequenced before the current batch is published, so the index
    /// is the exact state conditions must be evaluated against. Earlier batches have finished
    /// their I/O (leadership passes only after it), so this waits only for memory-only
    /// publication; a poisoned database fails the batch instead.
    pub(super) fn wait_published(&self, last_ts: u64) {
        while self.published.visible_ts() < last_ts && !self.is_poisoned() {
            std::thread::yield_now();
        }
    }

    /// Applies commands in log order as one group (one WAL write; one fdatasync if the
    /// durability asks for it), each with its own timestamp. Blocks until all are decided.
    /// A command that breaks a limit gets its error and is not queued; the others proceed.
    pub fn apply_commands(
        &self,
        commands: Vec<(LogPosition, Command)>,
        durability: Durability,
    ) -> Vec<Result<ApplyOutcome>> {
        enum Entry {
            Decided(Result<ApplyOutcome>),
            Queued(Arc<Waiter>),
        }
        let mut entries = Vec::with_capacity(commands.len());
        let mut requests = Vec::with_capacity(commands.len());
        let mut names = Vec::new();
        let thread = std::thread::current();
        for (position, command) in commands {
            match command.check() {
                Err(e) => entries.push(Entry::Decided(Err(e))),
                Ok(()) => {
                    let waiter = Waiter::for_thread(&thread);
                    requests.push((command.into_request(position, durability, &mut names), Arc::clone(&waiter)));
                    entries.push(Entry::Queued(waiter));
                }
            }
        }
        let refused = match self.enqueue_many(requests) {
            Ok(true) => {
                self.lead_while_work(true);
                false
            }
            Ok(false) => false,
            Err(_) => true,
        };
        entries
            .into_iter()
            .map(|entry| match entry {
                Entry::Decided(result) => result,
                Entry::Queued(_) if refused => Err(self.check_writable().err().unwrap_or(Error::Closed)),
                Entry::Queued(waiter) => apply_result(self.wait_outcome(&waiter)),
            })
            .collect()
    }
}

fn apply_result(outcome: Outcome) -> Result<ApplyOutcome> {
    match outcome {
        Outcome::Applied { ts, failed_condition: None } | Outcome::Committed(ts) => Ok(ApplyOutcome::Applied { ts }),
        Outcome::Applied { ts, failed_condition: Some(condition) } => {
            Ok(ApplyOutcome::ConditionFailed { ts, condition })
        }
        other => other.into_result().map(|ts| ApplyOutcome::Applied { ts }),
    }
}
