//! History survives a restart: random puts and deletes with history kept, checkpoints, floor
//! moves, and reopens at random points (clean close, `kill -9`, power loss, a crash in the
//! middle of a checkpoint) on the simulated disk. After each reopen every state at or above the
//! recovered floor matches a model that keeps every commit's state, the change feed after the
//! floor matches the model's writes commit by commit (and, in order, the feed the store had
//! before), and the floor is the one the last checkpoint recorded.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use keel_testkit::rng::SimRng;
use keel_testkit::sim::SimFs;
use keeldb::{Change, ChangeKind, Database, Durability, Error, Options, ScanRange};

type State = BTreeMap<(String, Vec<u8>), Vec<u8>>;
/// One commit's writes, as the feed must report them: the last write of each key.
type Writes = BTreeMap<(String, Vec<u8>), Option<Vec<u8>>>;

const STORE: &str = "/data/store";

fn options(fs: &SimFs, keep_history: bool) -> Options {
    Options {
        durability: Durability::Relaxed,
        fs: Arc::new(fs.clone()),
        background_threads: false,
        keep_history,
        ..Options::default()
    }
}

fn state_at(db: &Database, ts: u64) -> State {
    let rx = db.begin_read_at(ts).unwrap();
    let mut out = State::new();
    for table in rx.tables() {
        for item in rx.scan(&table, ScanRange::all()).unwrap() {
            let (k, v) = item.unwrap();
            out.insert((table.clone(), k), v);
        }
    }
    out
}

fn feed(db: &Database, after: u64) -> Vec<Change> {
    let mut out: Vec<Change> = Vec::new();
    let mut from = after;
    loop {
        let page = db.changes_since(from, 64).unwrap();
        let Some(last) = page.last() else { return out };
        from = last.ts;
        out.extend(page);
    }
}

fn by_commit(changes: &[Change]) -> BTreeMap<u64, Writes> {
    let mut out: BTreeMap<u64, Writes> = BTreeMap::new();
    for c in changes {
        let value = match &c.kind {
            ChangeKind::Put(v) => Some(v.clone()),
            ChangeKind::Delete => None,
            ChangeKind::DropTable => panic!("no table is dropped in this workload"),
        };
        let fresh = out.entry(c.ts).or_default().insert((c.table.to_string(), c.key.clone()), value).is_none();
        assert!(fresh, "the feed reports a key twice in commit {}", c.ts);
    }
    out
}

/// The store under test and the model of everything it committed.
struct Run {
    fs: SimFs,
    db: Option<Database>,
    rng: SimRng,
    states: BTreeMap<u64, State>,
    writes: BTreeMap<u64, Writes>,
    /// The floor the newest checkpoint recorded (0: none yet), which a reopen restores.
    checkpoint_floor: u64,
    checkpoint_ts: Option<u64>,
    /// Tables created so far (by a put).
    tables: std::collections::BTreeSet<String>,
    seed: u64,
}

impl Run {
    fn new(seed: u64) -> Run {
        let fs = SimFs::new(seed);
        fs.create_dir_durable(Path::new("/data")).unwrap();
        let db = Database::open(STORE, options(&fs, true)).unwrap();
        let mut states = BTreeMap::new();
        states.insert(db.stats().last_commit_ts, State::new());
        Run {
            fs,
            db: Some(db),
            rng: SimRng::new(seed),
            states,
            writes: BTreeMap::new(),
            checkpoint_floor: 0,
            checkpoint_ts: None,
            tables: Default::default(),
            seed,
        }
    }

    fn db(&self) -> &Database {
        self.db.as_ref().unwrap()
    }

    fn commit(&mut self) {
        let mut state = self.states.values().last().cloned().unwrap_or_default();
        let mut writes = Writes::new();
        let mut tx = self.db().begin_write().unwrap();
        for _ in 0..self.rng.range(1, 5) {
            let table = format!("t{}", self.rng.below(3));
            let key = format!("k{:02}", self.rng.below(24)).into_bytes();
            // Deletes only in tables that exist: one in a table the commit creates (or in none)
            // changes nothing and is not in the feed, as it is not in the WAL.
            if self.rng.chance(0.25) && self.tables.contains(&table) {
                tx.delete(&table, &key).unwrap();
                state.remove(&(table.clone(), key.clone()));
                writes.insert((table, key), None);
            } else {
                let value = format!("v{}", self.rng.below(100_000)).into_bytes();
                tx.put(&table, &key, &value).unwrap();
                state.insert((table.clone(), key.clone()), value.clone());
                writes.insert((table, key), Some(value));
            }
        }
        let ts = tx.commit().unwrap().ts;
        self.tables.extend(writes.iter().filter(|(_, v)| v.is_some()).map(|((t, _), _)| t.clone()));
        self.states.insert(ts, state);
        self.writes.insert(ts, writes);
    }

    fn floor(&self) -> u64 {
        self.db().history_floor().unwrap()
    }

    fn last_ts(&self) -> u64 {
        self.db().stats().last_commit_ts
    }

    fn checkpoint(&mut self) {
        let floor = self.floor();
        let ts = self.db().checkpoint().unwrap().ts;
        // A checkpoint at the timestamp of the last one is that one (its floor stays).
        if self.checkpoint_ts != Some(ts) {
            self.checkpoint_floor = floor;
            self.checkpoint_ts = Some(ts);
        }
    }

    fn raise_floor(&mut self) {
        let (floor, last) = (self.floor(), self.last_ts());
        let to = self.rng.range(floor, last);
        assert_eq!(self.db().retain_history_since(to).unwrap(), to);
    }

    /// Reopens after `how` and checks the recovered history; returns the recovered floor.
    fn reopen(&mut self, how: Reopen) -> u64 {
        let db = self.db.take().unwrap();
        let floor_before = db.history_floor().unwrap();
        let feed_before = feed(&db, floor_before);
        match how {
            Reopen::Clean => db.close().unwrap(),
            Reopen::Kill => {
                self.fs.kill_process();
                drop(db);
            }
            Reopen::PowerLoss => {
                self.fs.crash();
                drop(db);
            }
        }
        self.db = Some(Database::open(STORE, options(&self.fs, true)).unwrap());
        let last = self.last_ts();
        let seed = self.seed;
        assert!(self.states.contains_key(&last), "seed {seed}: reopened at {last}, a timestamp never committed");
        self.forget_after(last);
        self.check(floor_before, &feed_before, how);
        self.floor()
    }

    /// Power loss may take the relaxed tail: the model forgets it too (tables included).
    fn forget_after(&mut self, last: u64) {
        self.states.retain(|&ts, _| ts <= last);
        self.writes.retain(|&ts, _| ts <= last);
        self.tables = self
            .writes
            .values()
            .flat_map(|w| w.iter().filter(|(_, v)| v.is_some()).map(|((t, _), _)| t.clone()))
            .collect();
    }

    fn check(&self, floor_before: u64, feed_before: &[Change], how: Reopen) {
        let (db, seed, last) = (self.db(), self.seed, self.last_ts());
        let floor = self.floor();
        assert_eq!(floor, self.checkpoint_floor, "seed {seed} ({how:?}): the floor is the last checkpoint's");
        assert!(floor <= floor_before, "seed {seed}: the floor rose across the reopen");
        if floor > 0 {
            assert!(
                matches!(db.begin_read_at(floor - 1), Err(Error::Compacted { .. })),
                "seed {seed}: below the floor"
            );
        }
        for (&ts, expected) in self.states.range(floor..) {
            assert_eq!(&state_at(db, ts), expected, "seed {seed} ({how:?}): state at ts {ts}, floor {floor}");
        }
        let expected: BTreeMap<u64, Writes> = self.writes.range(floor + 1..).map(|(&ts, w)| (ts, w.clone())).collect();
        assert_eq!(by_commit(&feed(db, floor)), expected, "seed {seed} ({how:?}): feed after {floor}");
        // The same changes, in the same order within each commit, as before the reopen.
        let kept: Vec<&Change> = feed_before.iter().filter(|c| c.ts <= last).collect();
        let now = feed(db, floor_before.min(last));
        assert_eq!(now.iter().collect::<Vec<_>>(), kept, "seed {seed} ({how:?}): feed order after {floor_before}");
    }
}

#[derive(Debug, Clone, Copy)]
enum Reopen {
    Clean,
    Kill,
    PowerLoss,
}

#[test]
fn random_history_survives_random_reopens() {
    let mut reopened = [0u32; 3];
    for seed in 0..10u64 {
        let mut run = Run::new(seed);
        for _ in 0..400 {
            match run.rng.below(100) {
                0..=74 => run.commit(),
                75..=81 => run.checkpoint(),
                82..=88 => run.raise_floor(),
                89..=92 => {
                    run.reopen(Reopen::Clean);
                    reopened[0] += 1;
                }
                93..=96 => {
                    run.reopen(Reopen::Kill);
                    reopened[1] += 1;
                }
                _ => {
                    run.reopen(Reopen::PowerLoss);
                    reopened[2] += 1;
                }
            }
        }
        run.reopen(Reopen::Clean);
    }
    assert!(reopened.iter().all(|&n| n > 5), "every kind of reopen ran: {reopened:?}");
}

/// A crash at every point of a checkpoint's writing: the reopened store has either the old
/// checkpoint's history or the new one's, and it is whole.
#[test]
fn a_crash_anywhere_in_a_checkpoint_keeps_a_whole_history() {
    let mut outcomes = [0u32; 2];
    for seed in 0..40u64 {
        let mut run = Run::new(1000 + seed);
        for _ in 0..60 {
            run.commit();
        }
        run.checkpoint();
        for _ in 0..40 {
            run.commit();
        }
        run.raise_floor();
        for _ in 0..40 {
            run.commit();
        }
        let db = run.db.take().unwrap();
        let (floor_before, previous) = (db.history_floor().unwrap(), run.checkpoint_floor);
        let feed_before = feed(&db, floor_before);
        run.fs.stop_after_ops(seed);
        let finished = db.checkpoint().is_ok();
        run.fs.crash();
        drop(db);
        run.db = Some(Database::open(STORE, options(&run.fs, true)).unwrap());
        run.forget_after(run.last_ts());
        // Which checkpoint survived decides the floor: the new one (floor_before) or the old.
        let floor = run.floor();
        assert!(floor == previous || floor == floor_before, "seed {seed}: floor {floor}");
        assert!(!finished || floor == floor_before, "seed {seed}: a finished checkpoint was lost");
        outcomes[usize::from(floor == floor_before)] += 1;
        run.checkpoint_floor = floor;
        run.check(floor_before, &feed_before, Reopen::PowerLoss);
    }
    assert!(outcomes.iter().all(|&n| n > 0), "both outcomes happened: {outcomes:?}");
}
