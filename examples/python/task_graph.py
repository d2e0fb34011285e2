#!/usr/bin/env python3
"""A task graph on KeelDB, in the spirit of the GoT task tracker (tasks, decisions, dependency
edges, status changes in transactions, an integrity check at the end).

    python examples/python/task_graph.py [STORE_DIR]

Without STORE_DIR it works in a temporary directory. Every change is one transaction in `sync`
durability: when a call returns, the change survives a crash or power loss. At the end the
store is closed and checked with `keel verify` (or keeldb.verify when the binary is not built).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import keeldb


def create_plan(db: keeldb.Database) -> dict:
    """Tasks, a decision and their dependencies, created atomically: all or nothing."""
    with db.write() as tx:
        ids = {}
        for name, priority in [("design schema", 1), ("write storage", 1), ("write API", 2), ("write docs", 3), ("release", 1)]:
            ids[name] = tx.add_node("task", {"title": name, "status": "todo", "priority": priority})
        ids["use keeldb"] = tx.add_node("decision", {"text": "store the task graph in KeelDB", "by": "team"})
        for task, needs in [
            ("write storage", "design schema"),
            ("write API", "write storage"),
            ("write docs", "write API"),
            ("release", "write API"),
            ("release", "write docs"),
        ]:
            tx.add_edge(ids[task], ids[needs], "depends_on")
        tx.add_edge(ids["write storage"], ids["use keeldb"], "decided_by", {"note": "see ADR-1"})
        tx.put("log", b"%020d" % time.time_ns(), b"plan created")
    return ids


def ready_tasks(rx: keeldb.ReadTransaction) -> list:
    """Tasks still to do whose every dependency is done: one neighbour read per task, O(degree)."""
    ready = []
    for task in rx.nodes(label="task"):
        if task["status"] != "todo":
            continue
        deps = rx.neighbors(task.id, direction="out", type="depends_on")
        if all(rx.get_node(d)["status"] == "done" for d in deps):
            ready.append(task)
    return ready


class Blocked(Exception):
    pass


def complete(db: keeldb.Database, task_id: int) -> None:
    """Marks a task done if its dependencies are done, and logs it, in one transaction.
    `transact` retries on a conflict with a concurrent writer; an exception rolls back."""

    def change(tx: keeldb.WriteTransaction) -> None:
        task = tx.get_node(task_id)
        for dep in tx.neighbors(task_id, direction="out", type="depends_on"):
            if tx.get_node(dep)["status"] != "done":
                raise Blocked(f"{task['title']!r} waits for {tx.get_node(dep)['title']!r}")
        tx.update_node(task_id, {"status": "done", "done_at": time.time()}, merge=True)
        tx.put("log", b"%020d" % time.time_ns(), f"done: {task['title']}".encode())

    db.transact(change)


def keel_binary() -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for candidate in [shutil.which("keel"), os.path.join(root, "target", "release", "keel"), os.path.join(root, "target", "debug", "keel")]:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def integrity_check(path: str) -> bool:
    keel = keel_binary()
    if keel:
        result = subprocess.run([keel, "verify", path], capture_output=True, text=True)
        print(f"$ keel verify {path}\n{result.stdout.strip()}")
        return result.returncode == 0
    report = keeldb.verify(path)
    print(f"keeldb.verify({path!r}):\n{report}")
    return report.intact


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.mkdtemp(prefix="task-graph-"), "store")
    db = keeldb.open(path, durability="sync")
    ids = create_plan(db)
    names = {v: k for k, v in ids.items()}

    try:
        complete(db, ids["release"])
    except Blocked as e:
        print(f"blocked (nothing written): {e}")

    step = 0
    while True:
        with db.read() as rx:
            ready = ready_tasks(rx)
        if not ready:
            break
        step += 1
        task = min(ready, key=lambda t: (t["priority"], t.id))
        complete(db, task.id)
        print(f"step {step}: done {task['title']!r}")

    with db.write() as tx:  # a later decision supersedes the first one
        adr2 = tx.add_node("decision", {"text": "keep KeelDB, add replication later", "by": "team"})
        tx.add_edge(adr2, ids["use keeldb"], "supersedes")

    with db.read() as rx:
        statuses = [t["status"] for t in rx.nodes(label="task")]
        print(f"tasks: {len(statuses)}, done: {statuses.count('done')}")
        print("release depends on:", sorted(names[n] for n in rx.neighbors(ids["release"], type="depends_on")))
        print("decisions:", [d["text"] for d in rx.nodes(label="decision")])
        print("superseded by:", [rx.get_node(n)["text"] for n in rx.neighbors(ids["use keeldb"], direction="in", type="supersedes")])
        print("log entries:", len(list(rx.scan("log"))))
    db.close()

    intact = integrity_check(path)
    print("integrity:", "ok" if intact else "CORRUPTION FOUND")
    return 0 if intact and statuses.count("done") == len(statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
