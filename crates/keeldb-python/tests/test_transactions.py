"""Transactions from Python: context managers, explicit ends, snapshots, conflicts and
`transact` retries, options, errors, and the exception hierarchy."""

from __future__ import annotations

import threading

import pytest

import keeldb


def test_with_block_commits_on_normal_exit_and_rolls_back_on_exception(db):
    with db.write() as tx:
        tx.put("t", b"kept", b"1")

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with db.write() as tx:
            tx.put("t", b"discarded", b"1")
            raise Boom()
    with db.read() as rx:
        assert rx.get("t", b"kept") == b"1"
        assert rx.get("t", b"discarded") is None


def test_explicit_commit_and_rollback_end_the_transaction(db):
    tx = db.write()
    tx.put("t", b"a", b"1")
    ts = tx.commit()
    assert isinstance(ts, int) and ts > 0
    assert not tx.active
    with pytest.raises(keeldb.TransactionDoneError):
        tx.put("t", b"b", b"2")
    with pytest.raises(keeldb.TransactionDoneError):
        tx.commit()
    tx.rollback()  # idempotent

    with db.write() as tx:
        tx.put("t", b"c", b"3")
        tx.rollback()  # ending inside the block is respected: nothing is committed
    with db.read() as rx:
        assert rx.get("t", b"a") == b"1"
        assert rx.get("t", b"c") is None

    with db.write() as tx:
        tx.put("t", b"d", b"4")
        tx.commit()  # an explicit commit inside the block stands
    with db.read() as rx:
        assert rx.get("t", b"d") == b"4"


def test_dropped_write_transaction_rolls_back(db):
    tx = db.write()
    tx.put("t", b"a", b"1")
    del tx
    with db.read() as rx:
        assert rx.get("t", b"a") is None


def test_read_is_a_snapshot(db):
    with db.write() as tx:
        tx.put("t", b"a", b"old")
    rx = db.read()
    with db.write() as tx:
        tx.put("t", b"a", b"new")
        tx.put("t", b"b", b"new")
    assert rx.get("t", b"a") == b"old"
    assert list(rx.scan("t")) == [(b"a", b"old")]
    rx.close()
    with pytest.raises(keeldb.TransactionDoneError):
        rx.get("t", b"a")
    with db.read() as rx2:
        assert rx2.get("t", b"a") == b"new"
        assert rx2.snapshot_ts > 0


def test_write_write_conflict_raises_conflict_error(db):
    a, b = db.write(), db.write()
    a.put("t", b"k", b"a")
    b.put("t", b"k", b"b")
    a.commit()
    with pytest.raises(keeldb.ConflictError):
        b.commit()
    with db.read() as rx:
        assert rx.get("t", b"k") == b"a"


def test_serializable_prevents_write_skew(db):
    with db.write() as tx:
        tx.put("oncall", b"alice", b"1")
        tx.put("oncall", b"bob", b"1")
    a = db.write(isolation="serializable")
    b = db.write(isolation="serializable")
    assert len(list(a.scan("oncall"))) == 2
    assert len(list(b.scan("oncall"))) == 2
    a.delete("oncall", b"alice")
    b.delete("oncall", b"bob")
    a.commit()
    with pytest.raises(keeldb.ConflictError):
        b.commit()


def test_transact_retries_conflicts_and_returns_the_result(db):
    threads, increments = 4, 50

    def bump(tx):
        value = int(tx.get("c", b"n", b"0"))
        tx.put("c", b"n", str(value + 1).encode())
        return value + 1

    def worker():
        for _ in range(increments):
            db.transact(bump)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    with db.read() as rx:
        assert int(rx.get("c", b"n")) == threads * increments
    assert db.transact(bump) == threads * increments + 1


def test_transact_does_not_retry_other_errors_and_rolls_back(db):
    calls = []

    def fail(tx):
        calls.append(1)
        tx.put("t", b"k", b"v")
        raise KeyError("nope")

    with pytest.raises(KeyError):
        db.transact(fail)
    assert len(calls) == 1
    with db.read() as rx:
        assert rx.get("t", b"k") is None


def test_transact_gives_up_after_max_attempts(db):
    calls = []

    def always_conflicts(tx):
        calls.append(1)
        raise keeldb.ConflictError("simulated")

    with pytest.raises(keeldb.ConflictError):
        db.transact(always_conflicts, max_attempts=3)
    assert len(calls) == 3


@pytest.mark.parametrize("mode", ["sync", "periodic", "periodic:5", "relaxed"])
def test_durability_modes_open_and_commit(tmp_path, mode):
    with keeldb.open(str(tmp_path / mode.replace(":", "_")), durability=mode) as db:
        with db.write() as tx:
            tx.put("t", b"k", b"v")
        with db.write(durability="sync") as tx:  # per-transaction override
            tx.put("t", b"k2", b"v")
        with db.read() as rx:
            assert rx.get("t", b"k2") == b"v"


@pytest.mark.parametrize(
    "kwargs", [{"durability": "fast"}, {"durability": "periodic:0"}, {"isolation": "strict"}, {"commit_delay": -1.0}]
)
def test_bad_options_are_value_errors(path, kwargs):
    with pytest.raises(ValueError):
        keeldb.open(path, **kwargs)


def test_second_open_is_locked_and_closed_handle_raises(path):
    db = keeldb.open(path, durability="relaxed")
    with pytest.raises(keeldb.LockedError):
        keeldb.open(path)
    db.close()
    with pytest.raises(keeldb.ClosedError):
        db.write()
    with keeldb.open(path) as again:  # the lock was released
        assert again.path.endswith("store")


def test_not_a_store(tmp_path):
    (tmp_path / "stranger.txt").write_text("hello")
    with pytest.raises(keeldb.NotAStoreError):
        keeldb.open(str(tmp_path))


def test_exception_hierarchy():
    for name in [
        "ConflictError", "CorruptionError", "LockedError", "PoisonedError", "LimitError", "InvalidArgumentError",
        "NotFoundError", "NotAStoreError", "UnsupportedVersionError", "ClosedError", "TransactionDoneError",
        "CpuBudgetError", "TxnTimeoutError", "IoError",
    ]:
        assert issubclass(getattr(keeldb, name), keeldb.Error), name
    assert issubclass(keeldb.LimitError, ValueError)
    assert issubclass(keeldb.NotFoundError, LookupError)
    assert issubclass(keeldb.IoError, OSError)
    assert issubclass(keeldb.TxnTimeoutError, TimeoutError)


def test_checkpoint_stats_next_id_and_verify(path):
    db = keeldb.open(path)
    with db.write() as tx:
        tx.put("t", b"k", b"v")
    ids = {db.next_id() for _ in range(1000)}
    assert len(ids) == 1000 and 0 not in ids
    info = db.checkpoint()
    assert info["entries"] >= 1
    stats = db.stats()
    assert stats["tables"]["t"]["keys"] == 1
    assert stats["commits"] >= 1
    digest = db.digest()
    with pytest.raises(keeldb.LockedError):
        keeldb.verify(path)
    db.close()
    report = keeldb.verify(path)
    assert report.intact and bool(report)
    assert report.problems == []
    assert report.digest == digest
    assert "intact" in str(report)


def test_verify_reports_corruption(path):
    import glob
    import os

    db = keeldb.open(path)
    for i in range(20):
        with db.write() as tx:
            tx.put("t", b"k%d" % i, b"v" * 100)
    db.checkpoint()
    db.close()
    checkpoints = sorted(glob.glob(os.path.join(path, "*checkpoint*")) + glob.glob(os.path.join(path, "*.ckpt")))
    target = checkpoints[-1] if checkpoints else sorted(glob.glob(os.path.join(path, "wal*")))[0]
    with open(target, "r+b") as f:
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0xFF]))
    report = keeldb.verify(path)
    assert not report.intact
    assert report.problems


def test_cpu_budget_and_timeout_options_are_accepted(db):
    with db.write(tag="job-1", cpu_budget=10.0, timeout=10.0) as tx:
        tx.put("t", b"k", b"v")
    with db.read(tag="job-1", timeout=10.0) as rx:
        assert rx.get("t", b"k") == b"v"
