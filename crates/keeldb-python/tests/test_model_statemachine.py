"""A hypothesis state machine drives the key-value API (puts, deletes, commits, rollbacks,
point reads, range scans with every bound combination, old snapshots, close and reopen) and
checks every observation against a plain dict model."""

from __future__ import annotations

import shutil
import tempfile

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import keeldb

TABLES = st.sampled_from(["t1", "t2"])
# A small alphabet so that keys collide, share prefixes and straddle bounds.
KEYS = st.one_of(st.sampled_from([b"", b"a", b"ab", b"abc", b"b", b"ba", b"\x00", b"\xff", b"\xff\xff"]), st.binary(max_size=3))
VALUES = st.binary(max_size=8)
BOUND = st.one_of(st.none(), KEYS)


def model_scan(view, table, start, stop, prefix, reverse):
    keys = sorted(k for (t, k) in view if t == table)
    keys = [
        k
        for k in keys
        if (start is None or k >= start) and (stop is None or k < stop) and (prefix is None or k.startswith(prefix))
    ]
    if reverse:
        keys.reverse()
    return [(k, view[(table, k)]) for k in keys]


class KeyValueMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="keeldb-sm-")
        self.path = self.dir + "/store"
        self.db = keeldb.open(self.path, durability="relaxed")
        self.committed: dict = {}
        self.tx = None
        self.pending: dict = {}
        self.snapshot = None  # (read transaction, the model when it was taken)

    def view(self):
        return self.pending if self.tx is not None else self.committed

    def writer(self):
        if self.tx is None:
            self.tx = self.db.write()
            self.pending = dict(self.committed)
        return self.tx

    @rule(table=TABLES, key=KEYS, value=VALUES)
    def put(self, table, key, value):
        self.writer().put(table, key, value)
        self.pending[(table, key)] = value

    @rule(table=TABLES, key=KEYS)
    def delete(self, table, key):
        self.writer().delete(table, key)
        self.pending.pop((table, key), None)

    @precondition(lambda self: self.tx is not None)
    @rule()
    def commit(self):
        self.tx.commit()
        self.committed, self.tx = self.pending, None

    @precondition(lambda self: self.tx is not None)
    @rule()
    def rollback(self):
        self.tx.rollback()
        self.tx = None

    @rule(table=TABLES, key=KEYS)
    def get(self, table, key):
        reader = self.tx if self.tx is not None else self.db.read()
        assert reader.get(table, key) == self.view().get((table, key))

    @rule(table=TABLES, start=BOUND, stop=BOUND, prefix=BOUND, reverse=st.booleans())
    def scan(self, table, start, stop, prefix, reverse):
        reader = self.tx if self.tx is not None else self.db.read()
        got = list(reader.scan(table, start=start, stop=stop, prefix=prefix, reverse=reverse))
        assert got == model_scan(self.view(), table, start, stop, prefix, reverse)

    @rule()
    def take_snapshot(self):
        if self.snapshot is not None:
            self.snapshot[0].close()
        self.snapshot = (self.db.read(), dict(self.committed))

    @precondition(lambda self: self.snapshot is not None)
    @rule(table=TABLES)
    def old_snapshot_is_unchanged(self, table):
        rx, model = self.snapshot
        assert list(rx.scan(table)) == model_scan(model, table, None, None, None, False)

    @rule()
    def reopen(self):
        if self.tx is not None:
            self.tx.rollback()
            self.tx = None
        if self.snapshot is not None:
            self.snapshot[0].close()
            self.snapshot = None
        self.db.close()
        self.db = keeldb.open(self.path, durability="relaxed")

    @invariant()
    def committed_state_matches(self):
        with self.db.read() as rx:
            for table in ("t1", "t2"):
                assert list(rx.scan(table)) == model_scan(self.committed, table, None, None, None, False)

    def teardown(self):
        try:
            self.db.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


KeyValueMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestKeyValueMachine = KeyValueMachine.TestCase
