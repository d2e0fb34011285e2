#!/usr/bin/env python3
"""Seed 004's benchmark table from Python: KeelDB side by side with Python's sqlite3.

For each durability mode, KeelDB and sqlite3 (WAL mode, matching `synchronous`) run the same
task-graph operations in one process run, on the same file system:

    keeldb sync      <->  sqlite3 WAL, synchronous=FULL    (every commit fsynced)
    keeldb periodic  <->  sqlite3 WAL, synchronous=NORMAL  (fsync later, process-crash safe)
    keeldb relaxed   <->  sqlite3 WAL, synchronous=OFF     (no fsync on commit)

Operations (as in seed 004): create one task (a node with properties) per transaction, read one
task, a 5-operation transaction (2 creates, 1 dependency edge, 1 status update, 1 read), and a
transaction creating 100 tasks. Then commits/s of single-create transactions from 1, 4 and 16
Python threads in sync mode (sqlite3: one connection per thread, BEGIN IMMEDIATE).

Both sides are measured as a Python user sees them: KeelDB encodes the properties dict in Rust,
sqlite3 stores `json.dumps(props)` and reads back with `json.loads`.

    .venv/bin/python crates/keeldb-python/bench/bench_seed004.py [--quick] [--dir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import keeldb

MODES = [("sync", "FULL"), ("periodic", "NORMAL"), ("relaxed", "OFF")]
SEED004_BALANCED_CREATE_MS = 17.24


def props(i: int) -> dict:
    return {"title": f"task {i}", "status": "todo", "priority": i % 5, "tags": ["seed", "004"]}


# ---- the two systems behind one small interface --------------------------------------------


class Keel:
    name = "keeldb"

    def __init__(self, path: str, mode: str):
        self.db = keeldb.open(path, durability=mode)
        self.ids: list = []

    def create(self, i: int) -> None:
        with self.db.write() as tx:
            self.ids.append(tx.add_node("task", props(i)))

    def read(self, node_id: int) -> dict:
        with self.db.read() as rx:
            return rx.get_node(node_id).props

    def txn5(self, i: int) -> None:
        with self.db.write() as tx:
            a = tx.add_node("task", props(i))
            b = tx.add_node("task", props(i + 1))
            tx.add_edge(b, a, "depends_on")
            tx.update_node(self.ids[i % len(self.ids)], {"status": "doing"}, merge=True)
            tx.get_node(self.ids[(i * 7) % len(self.ids)])

    def bulk(self, i: int, n: int = 100) -> None:
        with self.db.write() as tx:
            for j in range(n):
                tx.add_node("task", props(i + j))

    def worker(self):
        return self.create

    def close(self) -> None:
        self.db.close()


class Sqlite:
    name = "sqlite"

    def __init__(self, path: str, synchronous: str):
        os.makedirs(path, exist_ok=True)
        self.file = os.path.join(path, "db.sqlite")
        self.synchronous = synchronous
        self.conn = self.connect()
        self.conn.executescript(
            """
            CREATE TABLE IF NOT EXISTS nodes (id INTEGER PRIMARY KEY, label TEXT NOT NULL, props TEXT NOT NULL);
            CREATE INDEX IF NOT EXISTS nodes_label ON nodes(label);
            CREATE TABLE IF NOT EXISTS edges (id INTEGER PRIMARY KEY, src INTEGER NOT NULL, dst INTEGER NOT NULL,
                                              type TEXT NOT NULL, props TEXT NOT NULL);
            CREATE INDEX IF NOT EXISTS edges_out ON edges(src, type);
            CREATE INDEX IF NOT EXISTS edges_in ON edges(dst, type);
            """
        )
        self.ids: list = []

    def connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.file, timeout=60, isolation_level="IMMEDIATE", check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self.synchronous}")
        return conn

    def create(self, i: int, conn: sqlite3.Connection | None = None) -> None:
        conn = conn or self.conn
        cur = conn.execute("INSERT INTO nodes(label, props) VALUES (?, ?)", ("task", json.dumps(props(i))))
        conn.commit()
        if conn is self.conn:
            self.ids.append(cur.lastrowid)

    def read(self, node_id: int) -> dict:
        row = self.conn.execute("SELECT label, props FROM nodes WHERE id = ?", (node_id,)).fetchone()
        return json.loads(row[1])

    def txn5(self, i: int) -> None:
        c = self.conn
        a = c.execute("INSERT INTO nodes(label, props) VALUES (?, ?)", ("task", json.dumps(props(i)))).lastrowid
        b = c.execute("INSERT INTO nodes(label, props) VALUES (?, ?)", ("task", json.dumps(props(i + 1)))).lastrowid
        c.execute("INSERT INTO edges(src, dst, type, props) VALUES (?, ?, 'depends_on', '{}')", (b, a))
        c.execute("UPDATE nodes SET props = json_set(props, '$.status', 'doing') WHERE id = ?", (self.ids[i % len(self.ids)],))
        json.loads(c.execute("SELECT props FROM nodes WHERE id = ?", (self.ids[(i * 7) % len(self.ids)],)).fetchone()[0])
        c.commit()

    def bulk(self, i: int, n: int = 100) -> None:
        self.conn.executemany(
            "INSERT INTO nodes(label, props) VALUES (?, ?)", [("task", json.dumps(props(i + j))) for j in range(n)]
        )
        self.conn.commit()

    def worker(self):
        conn = self.connect()
        return lambda i: self.create(i, conn)

    def close(self) -> None:
        self.conn.close()


# ---- measurement ---------------------------------------------------------------------------


def timed(fn, count: int, start: int = 0) -> list:
    """Per-call latencies in microseconds."""
    out = []
    clock = time.perf_counter_ns
    for i in range(start, start + count):
        t0 = clock()
        fn(i)
        out.append((clock() - t0) / 1000.0)
    return out


def summary(lat: list) -> dict:
    s = sorted(lat)
    return {
        "avg": statistics.fmean(s),
        "min": s[0],
        "max": s[-1],
        "p50": s[len(s) // 2],
        "p99": s[min(len(s) - 1, int(len(s) * 0.99))],
    }


def run_latency_suites(systems: list, counts: dict, rounds: int = 10) -> list:
    """Runs every operation on every system, interleaved in `rounds` blocks so that background
    load on a shared machine hits all systems alike. Returns one result dict per system."""
    for system in systems:
        timed(system.create, 50)  # warm-up, and ids to read and update
    lat = [{op: [] for op in ("create", "read", "txn5", "bulk100")} for _ in systems]
    ops = [
        ("create", lambda sys_: sys_.create, 10**3),
        ("read", lambda sys_: (lambda i: sys_.read(sys_.ids[(i * 7919) % len(sys_.ids)])), 0),
        ("txn5", lambda sys_: sys_.txn5, 10**6),
        ("bulk100", lambda sys_: (lambda i: sys_.bulk(i * 100)), 10**7),
    ]
    for op, make, base in ops:
        per_round = max(1, counts[{"bulk100": "bulk"}.get(op, op)] // rounds)
        for r in range(rounds):
            for slot, system in enumerate(systems):
                lat[slot][op] += timed(make(system), per_round, base + r * per_round)
    return [{op: summary(v) for op, v in res.items()} for res in lat]


def run_threads(make_system, threads: int, seconds: float) -> float:
    system = make_system()
    barrier = threading.Barrier(threads + 1)
    stop = threading.Event()
    counts = [0] * threads

    def loop(slot: int) -> None:
        work = system.worker()
        barrier.wait()
        i = slot * 10**9
        while not stop.is_set():
            work(i)
            i += 1
        counts[slot] = i - slot * 10**9

    pool = [threading.Thread(target=loop, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - t0
    system.close()
    return sum(counts) / elapsed


# ---- machine description -------------------------------------------------------------------


def filesystem_of(path: str) -> str:
    path = os.path.realpath(path)
    best = ("", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and path.startswith(parts[1]) and len(parts[1]) > len(best[0]):
                    best = (parts[1], parts[2])
    except OSError:
        pass
    return best[1]


def fdatasync_p50_us(directory: str, rounds: int = 200) -> float:
    fd = os.open(os.path.join(directory, "fsync-probe"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    lat = []
    try:
        for i in range(rounds):
            os.pwrite(fd, b"x" * 4096, i * 4096)
            t0 = time.perf_counter_ns()
            os.fdatasync(fd)
            lat.append((time.perf_counter_ns() - t0) / 1000.0)
    finally:
        os.close(fd)
    return sorted(lat)[len(lat) // 2]


def git_commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except OSError:
        return "?"


# ---- report --------------------------------------------------------------------------------


def fmt_us(us: float) -> str:
    return f"{us / 1000:.3f} ms" if us >= 1000 else f"{us:.1f} µs"


def print_mode_table(mode: str, sync: str, keel: dict, lite: dict) -> None:
    """One seed-004-style table; the last column is how many times better KeelDB is (shorter
    latency or higher throughput), so > 1× favours KeelDB either way."""
    print(f"\n### `{mode}` (KeelDB) vs sqlite3 WAL `synchronous={sync}`\n")
    print("| operation | KeelDB | sqlite3 | KeelDB advantage |")
    print("|---|---:|---:|---:|")
    rows = [
        ("Create task (avg)", "create", "avg"),
        ("Create task (min)", "create", "min"),
        ("Create task (max)", "create", "max"),
        ("Create task (p50)", "create", "p50"),
        ("Create task (p99)", "create", "p99"),
        ("Read task (avg)", "read", "avg"),
        ("Transaction (5 ops, avg)", "txn5", "avg"),
        ("Bulk 100 tasks (avg)", "bulk100", "avg"),
    ]
    for label, op, stat in rows:
        k, s = keel[op][stat], lite[op][stat]
        print(f"| {label} | {fmt_us(k)} | {fmt_us(s)} | {s / k:.2f}× |")
    k, s = keel["bulk100"]["avg"] / 100, lite["bulk100"]["avg"] / 100
    print(f"| Per task in bulk | {fmt_us(k)} | {fmt_us(s)} | {s / k:.2f}× |")
    for label, op, per in [("Single creates/s", "create", 1), ("Bulk creates/s", "bulk100", 100), ("Reads/s", "read", 1)]:
        k, s = per * 1e6 / keel[op]["avg"], per * 1e6 / lite[op]["avg"]
        print(f"| {label} | {k:,.0f} | {s:,.0f} | {k / s:.2f}× |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations and 1 s per thread run")
    ap.add_argument("--dir", help="directory on the file system to measure (default: a temp dir)")
    ap.add_argument("--json", help="write keel-bench/1 rows to this file")
    ap.add_argument("--thread-seconds", type=float, default=None)
    args = ap.parse_args()

    base = tempfile.mkdtemp(prefix="keeldb-bench-", dir=args.dir)
    scale = 0.25 if args.quick else 1.0
    thread_seconds = args.thread_seconds or (1.0 if args.quick else 3.0)
    counts_by_mode = {
        "sync": {"create": 500, "read": 20000, "txn5": 300, "bulk": 40},
        "periodic": {"create": 5000, "read": 20000, "txn5": 3000, "bulk": 200},
        "relaxed": {"create": 5000, "read": 20000, "txn5": 3000, "bulk": 200},
    }
    rows = []
    try:
        fsync_us = fdatasync_p50_us(base)
        print("## KeelDB from Python vs sqlite3 (seed 004 operations)\n")
        print(f"- machine: {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, file system {filesystem_of(base)}, "
              f"raw fdatasync p50 {fsync_us:.0f} µs")
        print(f"- Python {platform.python_version()}, sqlite {sqlite3.sqlite_version}, keeldb {keeldb.__version__} "
              f"(commit {git_commit()})")
        print(f"- command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
        print(f"- load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (other work on the machine shows up as tail latency)")
        print("- operations of both systems are interleaved in 10 blocks each, so background load hits both alike")
        results = {}
        for mode, sync in MODES:
            counts = {k: max(10, int(v * scale)) for k, v in counts_by_mode[mode].items()}
            keel = Keel(os.path.join(base, f"keel-{mode}"), mode)
            lite = Sqlite(os.path.join(base, f"sqlite-{mode}"), sync)
            kres, sres = run_latency_suites([keel, lite], counts)
            keel.close()
            lite.close()
            results[mode] = (kres, sres)
            print_mode_table(mode, sync, kres, sres)
            for system, res, config in [("keeldb", kres, mode), ("sqlite", sres, f"wal-{sync.lower()}")]:
                for op, stats in res.items():
                    for stat, value in stats.items():
                        rows.append({"suite": "python-seed004", "system": system, "config": config, "case": op,
                                     "metric": f"{stat}_us", "value": value})

        print(f"\n### Commits/s from Python threads, `sync` vs sqlite3 WAL `synchronous=FULL` ({thread_seconds:g} s each)\n")
        print("| threads | KeelDB commits/s | × 1 thread | sqlite3 commits/s | × 1 thread | KeelDB / sqlite3 |")
        print("|---:|---:|---:|---:|---:|---:|")
        one = {}
        for threads in (1, 4, 16):
            k = run_threads(lambda: Keel(os.path.join(base, f"keel-thr-{threads}"), "sync"), threads, thread_seconds)
            s = run_threads(lambda: Sqlite(os.path.join(base, f"sqlite-thr-{threads}"), "FULL"), threads, thread_seconds)
            one.setdefault("k", k)
            one.setdefault("s", s)
            print(f"| {threads} | {k:,.0f} | {k / one['k']:.2f}× | {s:,.0f} | {s / one['s']:.2f}× | {k / s:.2f}× |")
            rows.append({"suite": "python-threads", "system": "keeldb", "config": "sync", "case": f"threads_{threads}",
                         "metric": "commits_per_s", "value": k})
            rows.append({"suite": "python-threads", "system": "sqlite", "config": "wal-full", "case": f"threads_{threads}",
                         "metric": "commits_per_s", "value": s})

        ksync, ssync = results["sync"][0]["create"]["avg"], results["sync"][1]["create"]["avg"]
        krelaxed = results["relaxed"][0]["create"]["avg"]
        print("\n### Goals\n")
        print(f"- sync single create {fmt_us(ksync)} vs sqlite3 WAL FULL {fmt_us(ssync)}: "
              f"{'met' if ksync <= ssync else 'missed'} ({ssync / ksync:.2f}×)")
        print(f"- vs seed 004 BALANCED {SEED004_BALANCED_CREATE_MS} ms: {SEED004_BALANCED_CREATE_MS * 1000 / ksync:,.0f}× faster "
              f"({'met' if SEED004_BALANCED_CREATE_MS * 1000 / ksync >= 10 else 'missed'}, goal ≥ 10×)")
        print(f"- relaxed single create {fmt_us(krelaxed)}: {'met' if krelaxed < 10 else 'missed'} (goal < 10 µs)")
        if args.json:
            machine = {"cpus": os.cpu_count(), "os": f"{platform.system()} {platform.release()}",
                       "filesystem": filesystem_of(base), "fdatasync_us_p50": fsync_us}
            with open(args.json, "w") as f:
                json.dump({"schema": "keel-bench/1", "machine": machine, "rows": rows}, f, indent=1)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
