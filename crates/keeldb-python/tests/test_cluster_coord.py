"""keeldb.connect's leases, watches and locks against real `keel serve` processes (or, with
KEELDB_COORD_ETCD=path/to/etcd, against etcd itself: the same tests must pass on both).

Members come from test_cluster_client's helpers (their own 127.0.0.x addresses, killed at the
end). Every wait is bounded.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from typing import Iterator, List

import pytest

import keeldb
from test_cluster_client import Member, free_address, keel_binary, start_cluster, wait_ready


class EtcdMember(Member):
    """An etcd process with the same interface as Member (for checking the tests themselves)."""

    def start(self, initial_cluster: str) -> None:
        args = [
            self.binary,
            "--name", self.name,
            "--data-dir", self.data_dir,
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", initial_cluster,
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def start(workdir: str, names: List[str]) -> List[Member]:
    etcd = os.environ.get("KEELDB_COORD_ETCD")
    if not etcd:
        return start_cluster(workdir, names)
    members = [EtcdMember(etcd, n, workdir) for n in names]
    initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
    for m in members:
        m.start(initial)
    wait_ready(members)
    return members


@pytest.fixture(scope="module")
def trio(tmp_path_factory) -> Iterator[List[Member]]:
    members = start(str(tmp_path_factory.mktemp("coord")), ["c1", "c2", "c3"])
    yield members
    for m in members:
        m.stop()


@pytest.fixture
def client(trio) -> Iterator[keeldb.Client]:
    with keeldb.connect([m.client_url for m in trio], timeout=10.0) as c:
        yield c


@pytest.fixture
def ns() -> str:
    return f"coord-{uuid.uuid4().hex[:8]}/"


def test_lease_keys_go_with_the_lease(client, ns):
    lease = client.lease(30)
    assert lease.ttl >= 30 and lease.id in client.leases()
    client.put(ns + "a", "1", lease=lease.id)
    client.put(ns + "b", "2", lease=lease.id)
    assert client.get_kv(ns + "a").lease == lease.id
    info = lease.time_to_live(keys=True)
    assert info.granted_ttl >= 30 and 0 < info.ttl <= info.granted_ttl
    assert sorted(info.keys) == [(ns + "a").encode(), (ns + "b").encode()]
    before = client.status().revision
    lease.revoke()
    assert client.range(ns, prefix=True) == []
    # Both keys went in one revision.
    assert client.status().revision == before + 1
    assert lease.id not in client.leases()
    with pytest.raises(keeldb.LeaseNotFound):
        lease.revoke()
    with pytest.raises(keeldb.LeaseNotFound):
        lease.refresh()


def test_put_with_an_unknown_lease_writes_nothing(client, ns):
    with pytest.raises(keeldb.LeaseNotFound):
        client.put(ns + "k", "v", lease=0x7EADBEEF)
    assert client.get(ns + "k") is None


def test_a_lease_not_kept_alive_expires_and_a_kept_one_does_not(client, ns):
    kept = client.lease(2)
    kept.keep_alive()
    dropped = client.lease(2)
    client.put(ns + "kept", "x", lease=kept.id)
    client.put(ns + "dropped", "x", lease=dropped.id)
    deadline = time.monotonic() + 20  # TTL + an election timeout + slack for a slow machine
    while client.get(ns + "dropped") is not None:
        assert time.monotonic() < deadline, "an unrefreshed 2 s lease outlived 20 s"
        time.sleep(0.2)
    assert client.get(ns + "kept") == b"x" and not kept.expired
    kept.revoke()
    assert client.get(ns + "kept") is None


def test_lease_context_manager_revokes(client, ns):
    with client.lease(30) as lease:
        client.put(ns + "k", "v", lease=lease.id)
        assert lease.refresh() >= 29
    assert client.get(ns + "k") is None and lease.expired


def test_watch_replays_history_then_follows(client, ns):
    first = client.put(ns + "a", "1")
    client.put(ns + "b", "2")
    client.delete(ns + "a")
    with client.watch(ns, prefix=True, start_revision=first, prev_kv=True) as w:
        got = [w.get(timeout=10) for _ in range(3)]
        assert [(e.kind, e.key, e.revision) for e in got] == [
            ("put", (ns + "a").encode(), first),
            ("put", (ns + "b").encode(), first + 1),
            ("delete", (ns + "a").encode(), first + 2),
        ]
        assert got[2].prev_kv.value == b"1"
        later = client.put(ns + "c", "3")
        e = w.get(timeout=10)
        assert (e.kind, e.key, e.value, e.revision) == ("put", (ns + "c").encode(), b"3", later)
        assert w.get(timeout=0.3) is None  # nothing more
    with pytest.raises(keeldb.ClosedError):
        w.get(timeout=1)


def test_watch_filters_and_single_key(client, ns):
    with client.watch(ns + "k", no_put=True) as w:
        client.put(ns + "k", "v")
        client.put(ns + "other", "v")
        assert client.delete(ns + "k") == 1
        e = w.get(timeout=10)
        assert e.kind == "delete" and e.key == (ns + "k").encode()


def test_watch_from_a_compacted_revision_raises_compacted(trio, ns):
    # One member for the whole test: a compaction is answered once the leader has applied it,
    # and a follower applies it up to a heartbeat later (as in etcd); a watch created there in
    # between legitimately starts from the old revision. So wait until this member refuses
    # the old revision, then watch from it.
    with keeldb.connect([trio[0].client_url], timeout=10.0) as client:
        old = client.put(ns + "k", "1")
        new = client.put(ns + "k", "2")
        client.compact(new)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.range(ns + "k", revision=old, serializable=True)
            except keeldb.Compacted:
                break
            assert time.monotonic() < deadline, "the member never applied the compaction"
            time.sleep(0.05)
        w = client.watch(ns + "k", start_revision=old)
        with pytest.raises(keeldb.Compacted):
            w.get(timeout=10)
        w.cancel()


def test_watch_iterates(client, ns):
    w = client.watch(ns, prefix=True)
    time.sleep(0.5)  # the watch starts "from now": let it be created before writing
    revs = [client.put(ns + str(i), str(i)) for i in range(5)]
    seen = []
    for e in w:
        seen.append(e.revision)
        if len(seen) == 5:
            break
    w.cancel()
    assert seen == revs


def test_lock_excludes_and_hands_over(client, ns):
    name = ns + "lock"
    inside = []
    overlap = []
    errors = []

    def worker(i: int) -> None:
        try:
            with keeldb.connect(client.endpoints, timeout=10.0) as c:
                for _ in range(3):
                    lock = c.lock(name, ttl=10)
                    assert lock.acquire(timeout=60)
                    inside.append(i)
                    if len(inside) > 1:
                        overlap.append(list(inside))
                    time.sleep(0.02)
                    inside.remove(i)
                    lock.release()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert not overlap, f"two holders at once: {overlap}"
    assert client.range(name + "/", prefix=True) == []


def test_lock_acquire_times_out_and_leaves_nothing(client, ns):
    name = ns + "busy"
    holder = client.lock(name)
    assert holder.acquire(timeout=10) and holder.held
    other = client.lock(name)
    t0 = time.monotonic()
    assert not other.acquire(timeout=1.0)
    assert time.monotonic() - t0 < 8
    assert len(client.range(name + "/", prefix=True)) == 1
    holder.release()
    assert other.acquire(timeout=10)
    other.release()
    with pytest.raises(ValueError):
        other.release()


def test_bad_arguments(client):
    with pytest.raises(ValueError):
        client.lease(0)
    with pytest.raises(ValueError):
        client.lock("")
    with pytest.raises(ValueError):
        client.watch("")
    with pytest.raises(ValueError):
        client.watch("a", "b", prefix=True)


def test_closing_a_client_under_running_background_tasks_panics_nothing(trio, ns, capfd):
    # A lease keep-alive and a watch run on the client's runtime. Closing the client and then
    # dropping them leaves each task holding the last reference to the runtime; it used to be
    # dropped on its own worker thread, which tokio refuses with a panic on stderr.
    for _ in range(5):
        c = keeldb.connect([m.client_url for m in trio], timeout=10.0)
        lease = c.lease(30)
        lease.keep_alive()
        w = c.watch(ns + "w", prefix=True)
        c.put(ns + "w/1", "x")
        c.close()
        del lease, w
        time.sleep(0.3)  # the aborted keep-alive and the watch task end on the runtime
    captured = capfd.readouterr()
    assert "panicked" not in captured.err, captured.err
