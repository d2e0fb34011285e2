"""Python threads share the database: commits from many threads in sync mode all land, and
because the GIL is released while a commit waits for its fsync, threads share fsyncs
(group commit) instead of taking turns."""

from __future__ import annotations

import threading

import keeldb


def test_threads_committing_in_sync_mode_share_fsyncs(path):
    threads, per_thread = 8, 40
    db = keeldb.open(path, durability="sync")
    errors = []

    def worker(w):
        try:
            for i in range(per_thread):
                with db.write() as tx:
                    tx.add_node("task", {"worker": w, "i": i})
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    pool = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert errors == []
    with db.read() as rx:
        assert len(list(rx.nodes(label="task"))) == threads * per_thread
    stats = db.stats()
    # Every transaction committed; fewer fsyncs than commits means they were shared, which can
    # only happen if a thread waiting for its fsync let the others run.
    assert stats["commits"] >= threads * per_thread
    assert stats["wal_syncs"] < stats["commits"]
    db.close()


def test_readers_see_consistent_snapshots_while_writers_commit(path):
    db = keeldb.open(path, durability="relaxed")
    with db.write() as tx:
        tx.put("acct", b"a", b"100")
        tx.put("acct", b"b", b"0")
    stop = threading.Event()
    bad = []

    def transfer():
        while not stop.is_set():
            def move(tx):
                a, b = int(tx.get("acct", b"a")), int(tx.get("acct", b"b"))
                tx.put("acct", b"a", str(a - 1).encode())
                tx.put("acct", b"b", str(b + 1).encode())
            db.transact(move)

    def audit():
        for _ in range(300):
            with db.read() as rx:
                total = sum(int(v) for _, v in rx.scan("acct"))
                if total != 100:
                    bad.append(total)

    writers = [threading.Thread(target=transfer) for _ in range(2)]
    for t in writers:
        t.start()
    audit()
    stop.set()
    for t in writers:
        t.join()
    assert bad == []
    db.close()


def test_one_read_snapshot_is_shared_by_threads(path):
    db = keeldb.open(path, durability="relaxed")
    with db.write() as tx:
        hub = tx.add_node("hub")
        for i in range(20000):
            tx.put("t", i.to_bytes(4, "big"), b"x" * 32)
        for _ in range(300):
            tx.add_edge(hub, tx.add_node("leaf"), "has")
    rx = db.read()
    with db.write() as tx:  # after the snapshot: the readers must not see it
        tx.delete_node(hub)
        tx.put("t", b"\xff\xff\xff\xff", b"late")
    outcomes = []

    def read_all():
        try:
            outcomes.append((sum(1 for _ in rx.scan("t")), rx.degree(hub), len(list(rx.nodes(label="leaf")))))
        except Exception as e:  # pragma: no cover - reported below
            outcomes.append(e)

    pool = [threading.Thread(target=read_all) for _ in range(4)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert outcomes == [(20000, 300, 300)] * 4
    rx.close()
    db.close()


def test_a_write_transaction_used_by_two_threads_at_once_is_an_error_not_a_deadlock(path):
    db = keeldb.open(path, durability="relaxed")
    with db.write() as tx:
        for i in range(20000):
            tx.put("t", i.to_bytes(4, "big"), b"x" * 32)
    tx = db.write()
    outcomes = []

    def scan_all():
        try:
            outcomes.append(sum(1 for _ in tx.scan("t")))
        except RuntimeError as e:
            outcomes.append(e)

    pool = [threading.Thread(target=scan_all) for _ in range(4)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    # Each thread either finished its scan or was told the transaction was busy; none hung.
    assert len(outcomes) == 4
    assert all(o == 20000 or isinstance(o, RuntimeError) for o in outcomes)
    tx.rollback()
    db.close()
