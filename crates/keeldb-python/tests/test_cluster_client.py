"""keeldb.connect against real `keel serve` processes: one member, and a three-member cluster.

The `keel` binary comes from $KEEL_BIN, else target/debug/keel (built with
`cargo build -p keel-cli` when missing). Every member listens on free ports of its own
127.0.0.x loopback address and is killed when its fixture ends.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import threading
import time
import uuid
from typing import Dict, Iterator, List, Optional

import pytest

import keeldb

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BUILD_TIMEOUT = 1800  # seconds for `cargo build -p keel-cli` when the binary is missing
START_TIMEOUT = 60  # seconds for members to elect a leader and answer


def keel_binary() -> str:
    explicit = os.environ.get("KEEL_BIN")
    if explicit:
        return explicit
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    path = os.path.join(target, "debug", "keel")
    if not os.path.exists(path):
        cargo = shutil.which("cargo")
        assert cargo, "keel is not built and cargo is not on PATH; set KEEL_BIN"
        subprocess.run([cargo, "build", "-p", "keel-cli"], cwd=ROOT, check=True, timeout=BUILD_TIMEOUT)
    return path


def free_address() -> tuple:
    """A 127.0.0.x host of its own and two ports free on it (client, peer)."""
    host = f"127.0.0.{random.randint(2, 254)}"
    sockets = []
    try:
        for _ in range(2):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
        return (host,) + tuple(s.getsockname()[1] for s in sockets)
    finally:
        for s in sockets:
            s.close()


def dead_endpoint() -> str:
    """An address where nothing listens (connections are refused)."""
    host, port, _ = free_address()
    return f"http://{host}:{port}"


class Member:
    """One `keel serve` process."""

    def __init__(self, binary: str, name: str, workdir: str) -> None:
        self.binary = binary
        self.name = name
        host, client_port, peer_port = free_address()
        self.client_url = f"http://{host}:{client_port}"
        self.peer_url = f"http://{host}:{peer_port}"
        self.data_dir = os.path.join(workdir, f"{name}.keel")
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.proc: Optional[subprocess.Popen] = None

    def start(self, initial_cluster: str) -> None:
        args = [
            self.binary,
            "serve",
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

    def log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-4000:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.kill()
        self.proc.wait(timeout=30)


def wait_ready(members: List[Member]) -> None:
    """Until every member answers and knows the same leader."""
    deadline = time.monotonic() + START_TIMEOUT
    last: object = None
    while time.monotonic() < deadline:
        for m in members:
            if m.proc is not None and m.proc.poll() is not None:
                raise RuntimeError(f"keel serve {m.name} exited with {m.proc.returncode}:\n{m.log_tail()}")
        try:
            leaders = set()
            for m in members:
                with keeldb.connect([m.client_url], timeout=1.0) as c:
                    leaders.add(c.status().leader)
                    c.members()  # served only once the member published its client URLs
            if len(leaders) == 1 and 0 not in leaders:
                return
            last = f"leaders {leaders}"
        except keeldb.ClusterError as e:
            last = e
        time.sleep(0.1)
    logs = "\n".join(f"--- {m.name}\n{m.log_tail()}" for m in members)
    raise RuntimeError(f"the cluster did not become ready in {START_TIMEOUT} s ({last!r}):\n{logs}")


def start_cluster(workdir: str, names: List[str]) -> List[Member]:
    binary = keel_binary()
    members = [Member(binary, name, workdir) for name in names]
    initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
    try:
        for m in members:
            m.start(initial)
        wait_ready(members)
    except BaseException:
        for m in members:
            m.stop()
        raise
    return members


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Member]:
    """A one-member cluster, shared by the tests of this module (each uses its own keys)."""
    members = start_cluster(str(tmp_path_factory.mktemp("keel-one")), ["t"])
    yield members[0]
    members[0].stop()


@pytest.fixture
def client(server) -> Iterator[keeldb.Client]:
    with keeldb.connect([server.client_url], timeout=5.0) as c:
        yield c


@pytest.fixture
def ns() -> str:
    """A key prefix of this test's own."""
    return f"t/{uuid.uuid4().hex[:8]}/"


def revision(client: keeldb.Client) -> int:
    return client.status().revision


# --- key-value semantics ----------------------------------------------------------------------


def test_put_get_and_versions(client, ns):
    k = ns + "k"
    assert client.get(k) is None
    assert client.get_kv(k) is None
    r1 = client.put(k, "v1")
    assert isinstance(r1, int) and r1 > 0
    assert client.get(k) == b"v1"
    kv = client.get_kv(k)
    assert (kv.key, kv.value) == (k.encode(), b"v1")
    assert (kv.create_revision, kv.mod_revision, kv.version, kv.lease) == (r1, r1, 1, 0)

    r2 = client.put(k.encode(), b"v2")  # bytes and str name the same key
    assert r2 == r1 + 1
    kv = client.get_kv(k)
    assert (kv.value, kv.create_revision, kv.mod_revision, kv.version) == (b"v2", r1, r2, 2)
    assert revision(client) == r2


def test_keys_and_values_str_bytes_and_unicode(client, ns):
    k = ns + "ключ"
    client.put(k, "значение \u2603")
    assert client.get(k.encode("utf-8")) == "значение \u2603".encode("utf-8")
    client.put(bytearray(k.encode()), b"\x00\xff")
    assert client.get(k) == b"\x00\xff"
    with pytest.raises(TypeError):
        client.put(1, b"x")
    with pytest.raises(TypeError):
        client.get(None)


def test_revisions_increase_by_one_per_write(client, ns):
    start = revision(client)
    revs = [client.put(ns + str(i), str(i)) for i in range(5)]
    assert revs == list(range(start + 1, start + 6))
    assert client.delete(ns + "0") == 1
    assert revision(client) == start + 6
    assert client.delete(ns + "0") == 0  # deleting nothing writes nothing
    assert revision(client) == start + 6
    assert client.put(ns + "0", "again") == start + 7
    kv = client.get_kv(ns + "0")
    assert (kv.create_revision, kv.version) == (start + 7, 1)  # a new life after the delete


def test_put_prev_kv(client, ns):
    k = ns + "p"
    rev, prev = client.put(k, "a", prev_kv=True)
    assert prev is None
    rev2, prev = client.put(k, "b", prev_kv=True)
    assert rev2 == rev + 1
    assert isinstance(prev, keeldb.KeyValue)
    assert (prev.key, prev.value, prev.mod_revision, prev.version) == (k.encode(), b"a", rev, 1)


def test_range_prefix_limit_sort_and_history(client, ns):
    for name in ["a", "b", "c", "d"]:
        client.put(ns + name, name.upper())
    before = client.put(ns + "b", "B2")
    client.put(ns + "b", "B3")
    client.put(ns + "z", "Z")

    kvs = client.range(ns + "a", ns + "c")  # [a, c)
    assert [(kv.key, kv.value) for kv in kvs] == [(ns.encode() + b"a", b"A"), (ns.encode() + b"b", b"B3")]
    assert [kv.key for kv in client.range(ns + "b")] == [ns.encode() + b"b"]  # end=None: one key
    assert len(client.range(ns, prefix=True)) == 5
    assert [kv.key[-1:] for kv in client.range(ns, prefix=True, limit=2)] == [b"a", b"b"]
    assert [kv.key[-1:] for kv in client.range(ns + "c", b"\0")][:3] == [b"c", b"d", b"z"]  # from key on
    desc = client.range(ns, prefix=True, sort=("key", "descend"))
    assert [kv.key[-1:] for kv in desc] == [b"z", b"d", b"c", b"b", b"a"]
    by_mod = client.range(ns, prefix=True, sort=("mod_revision", "descend"))
    assert [kv.key[-1:] for kv in by_mod][:2] == [b"z", b"b"]
    assert all(kv.value == b"" for kv in client.range(ns, prefix=True, keys_only=True))
    assert [kv.value for kv in client.range(ns + "b", revision=before)] == [b"B2"]
    assert [kv.value for kv in client.range(ns + "b", serializable=True)] == [b"B3"]
    assert client.range(ns + "nothing", prefix=True) == []
    everything = [kv.key for kv in client.range("", b"\0")]  # an empty start: from the first key
    assert [k for k in everything if k.startswith(ns.encode())] == [ns.encode() + c for c in [b"a", b"b", b"c", b"d", b"z"]]
    assert client.range("", ns + "b")[-1].key == ns.encode() + b"a"
    with pytest.raises(ValueError):
        client.range(ns, ns + "z", prefix=True)
    with pytest.raises(ValueError):
        client.range(ns, sort="size")


def test_delete_prefix_and_range_end(client, ns):
    for name in ["a", "b", "c", "d", "e"]:
        client.put(ns + name, name)
    start = revision(client)
    assert client.delete(ns + "a", range_end=ns + "c") == 2  # a, b
    assert revision(client) == start + 1  # one delete is one revision, however many keys
    assert client.delete(ns + "c") == 1
    assert client.delete(ns, prefix=True) == 2  # d, e
    assert client.range(ns, prefix=True) == []
    with pytest.raises(ValueError):
        client.delete(ns, prefix=True, range_end=ns + "z")


def test_txn_compare_success_failure(client, ns):
    lock = ns + "lock"
    acquire = dict(
        compare=[keeldb.Compare.version(lock, "==", 0)],
        success=[keeldb.Op.put(lock, "me"), keeldb.Op.put(ns + "owner", "me"), keeldb.Op.get(lock)],
        failure=[keeldb.Op.get(lock), keeldb.Op.get(ns, prefix=True)],
    )
    start = revision(client)
    r = client.txn(**acquire)
    assert r.succeeded and bool(r) is True
    assert r.revision == start + 1  # two puts, one revision
    rev_a, rev_b, got = r.responses
    assert rev_a == rev_b == r.revision
    assert [(kv.value, kv.version, kv.mod_revision) for kv in got] == [(b"me", 1, r.revision)]

    r2 = client.txn(**acquire)
    assert not r2.succeeded
    assert r2.revision == r.revision  # a read-only branch writes nothing
    held, everything = r2.responses
    assert [kv.value for kv in held] == [b"me"]
    assert sorted(kv.key for kv in everything) == [lock.encode(), (ns + "owner").encode()]

    kv = client.get_kv(lock)
    checks = [
        (keeldb.Compare.value(lock, "==", "me"), True),
        (keeldb.Compare.value(lock, "!=", b"me"), False),
        (keeldb.Compare.mod_revision(lock, "==", kv.mod_revision), True),
        (keeldb.Compare.mod_revision(lock, "<", kv.mod_revision), False),
        (keeldb.Compare.create_revision(lock, ">", 0), True),
        (keeldb.Compare.version(lock, ">", 1), False),
        (keeldb.Compare.lease(lock, "==", 0), True),
    ]
    for cmp, expected in checks:
        assert client.txn(compare=[cmp]).succeeded is expected, repr(cmp)

    r3 = client.txn(
        compare=[keeldb.Compare.value(lock, "==", "me")],
        success=[
            keeldb.Op.delete(lock),
            keeldb.Op.put(ns + "owner", "nobody", prev_kv=True),
            keeldb.Op.txn(success=[keeldb.Op.get(ns + "owner")]),
        ],
    )
    deleted, (rev, prev), inner = r3.responses
    assert deleted == 1 and rev == r3.revision == r.revision + 1
    assert prev.value == b"me"
    assert isinstance(inner, keeldb.TxnResult) and inner.succeeded
    assert [kv.value for kv in inner.responses[0]] == [b"nobody"]
    assert client.get(lock) is None


def test_txn_duplicate_key_is_invalid_request(client, ns):
    start = revision(client)
    with pytest.raises(keeldb.InvalidRequest) as info:
        client.txn(success=[keeldb.Op.put(ns + "d", "1"), keeldb.Op.put(ns + "d", "2")])
    assert isinstance(info.value, keeldb.ClusterError) and isinstance(info.value, ValueError)
    assert "duplicate key" in str(info.value)
    assert revision(client) == start  # nothing applied
    assert client.get(ns + "d") is None


def test_future_revision(client, ns):
    client.put(ns + "f", "x")
    with pytest.raises(keeldb.FutureRevision):
        client.range(ns + "f", revision=revision(client) + 1000)


def test_empty_key_is_invalid_request(client):
    with pytest.raises(keeldb.InvalidRequest):
        client.put(b"", b"x")


def test_status_members_leader(client, server):
    st = client.status()
    assert isinstance(st, keeldb.MemberStatus)
    assert st.endpoint == server.client_url
    assert st.leader == st.member_id != 0
    assert client.leader() == st.member_id
    assert st.revision >= 1 and st.raft_term >= 1 and st.version
    (m,) = client.members()
    assert (m.id, m.name, m.is_learner) == (st.member_id, "t", False)
    assert m.client_urls == [server.client_url] and m.peer_urls == [server.peer_url]


# --- endpoints, failures and the client's life cycle ------------------------------------------


def test_dead_endpoints_raise_unavailable_within_the_timeout():
    c = keeldb.connect([dead_endpoint(), dead_endpoint()], timeout=1.0)  # lazy: does not fail here
    for call in (lambda: c.put("k", "v"), lambda: c.get("k"), c.status):
        t0 = time.monotonic()
        with pytest.raises(keeldb.Unavailable) as info:
            call()
        elapsed = time.monotonic() - t0
        assert 0.9 < elapsed < 2.0, elapsed  # retried with backoff until the timeout, no longer
        assert isinstance(info.value, ConnectionError) and isinstance(info.value, keeldb.ClusterError)
    c.close()


class FakeServer:
    """A TCP listener that is no etcd: it never answers (`mode="silent"`: connections wait in
    the backlog), or reads what arrives and hangs up (`mode="hang-up"`)."""

    def __init__(self, mode: str) -> None:
        host, _, _ = free_address()
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        if mode == "hang-up":
            threading.Thread(target=self._hang_up, daemon=True).start()

    def _hang_up(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.settimeout(0.2)
            try:
                while conn.recv(65536):
                    pass
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("mode", ["silent", "hang-up"])
def test_a_write_with_unknown_outcome_is_never_retried(server, ns, mode):
    """The first endpoint takes the request and then fails: the put may have been applied
    there, so the client raises Timeout instead of resending it to the live second endpoint."""
    fake = FakeServer(mode)
    try:
        with keeldb.connect([fake.url, server.client_url], timeout=1.0) as c:
            t0 = time.monotonic()
            with pytest.raises(keeldb.Timeout) as info:
                c.put(ns + "k", "v")
            assert time.monotonic() - t0 < 2.5
            assert "may or may not have been applied" in str(info.value)
            assert isinstance(info.value, TimeoutError)
        with keeldb.connect([server.client_url]) as c:
            assert c.get(ns + "k") is None  # not resent to the live member
        if mode == "hang-up":
            with keeldb.connect([fake.url, server.client_url], timeout=5.0) as c:
                assert c.get(ns + "k") is None  # a read is retried on the next endpoint
        else:
            with keeldb.connect([fake.url], timeout=0.5) as c:
                with pytest.raises(keeldb.Timeout):  # no answer at all: the read's deadline passes
                    c.get(ns + "k")
    finally:
        fake.close()


def test_first_endpoint_dead_second_alive(server, ns):
    with keeldb.connect(f"{dead_endpoint()},{server.client_url}", timeout=5.0) as c:
        assert len(c.endpoints) == 2
        t0 = time.monotonic()
        rev = c.put(ns + "k", "v")  # a refused connection is safe to retry, even for a write
        assert c.get(ns + "k") == b"v"
        assert c.get_kv(ns + "k").mod_revision == rev
        assert c.status().endpoint == server.client_url
        assert time.monotonic() - t0 < 3.0


def test_closed_client_and_context_manager(server):
    with keeldb.connect([server.client_url]) as c:
        assert not c.closed
        assert "keeldb.Client" in repr(c)
    assert c.closed
    with pytest.raises(keeldb.ClosedError):
        c.get("k")
    c.close()  # idempotent


def test_connect_arguments():
    with pytest.raises(ValueError):
        keeldb.connect([])
    with pytest.raises(ValueError):
        keeldb.connect(["127.0.0.1:2379"], timeout=0)
    with pytest.raises(ValueError):
        keeldb.connect(["https://127.0.0.1:2379"])
    with pytest.raises(TypeError):
        keeldb.connect(2379)
    with pytest.raises(ValueError):
        keeldb.Compare.version("k", "<=", 1)


def test_threads_share_one_client(client, ns):
    """The GIL is released while a call waits: threads' writes all land, at distinct revisions."""
    revs: Dict[int, int] = {}
    errors: List[BaseException] = []

    def writer(t: int) -> None:
        try:
            for i in range(20):
                revs[t * 100 + i] = client.put(f"{ns}{t}/{i}", str(i))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(set(revs.values())) == 80
    assert len(client.range(ns, prefix=True)) == 80


# --- three members ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trio(tmp_path_factory) -> Iterator[List[Member]]:
    members = start_cluster(str(tmp_path_factory.mktemp("keel-three")), ["a", "b", "c"])
    yield members
    for m in members:
        m.stop()


def test_three_members_write_through_a_follower(trio, ns):
    statuses = {}
    for m in trio:
        with keeldb.connect([m.client_url], timeout=10.0) as c:
            statuses[m.name] = c.status()
    leader_id = statuses["a"].leader
    assert {s.leader for s in statuses.values()} == {leader_id}
    follower = next(m for m in trio if statuses[m.name].member_id != leader_id)

    with keeldb.connect([follower.client_url], timeout=10.0) as c:
        assert c.leader() == leader_id
        assert sorted(m.name for m in c.members()) == ["a", "b", "c"]
        start = c.status().revision
        r1 = c.put(ns + "x", "1")
        r2 = c.put(ns + "x", "2")
        assert (r1, r2) == (start + 1, start + 2)
        r = c.txn(
            compare=[keeldb.Compare.mod_revision(ns + "x", "==", r2)],
            success=[keeldb.Op.put(ns + "y", "from-follower"), keeldb.Op.delete(ns + "x")],
        )
        assert r.succeeded and r.revision == r2 + 1
        with pytest.raises(keeldb.InvalidRequest):
            c.txn(success=[keeldb.Op.put(ns + "z", "1"), keeldb.Op.delete(ns + "z")])

    # Every member, asked alone, sees the writes (linearizable reads).
    for m in trio:
        with keeldb.connect([m.client_url], timeout=10.0) as c:
            assert c.get(ns + "x") is None, m.name
            kv = c.get_kv(ns + "y")
            assert (kv.value, kv.mod_revision) == (b"from-follower", r2 + 1), m.name

    # A client given every endpoint keeps working when one member is down (a follower here).
    other = next(m for m in trio if m is not follower and statuses[m.name].member_id != leader_id)
    urls = [m.client_url for m in trio]
    other.stop()
    with keeldb.connect([other.client_url] + [u for u in urls if u != other.client_url], timeout=10.0) as c:
        assert c.put(ns + "after", "ok") == r2 + 2
        assert c.get(ns + "after") == b"ok"


def test_readme_example_runs(server, capsys):
    """The cluster client example of crates/keeldb-python/README.md, against the test member."""
    readme = os.path.join(os.path.dirname(__file__), "..", "README.md")
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    section = text.split("## The cluster client", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    endpoints = '["http://10.0.0.1:2379", "http://10.0.0.2:2379"]'
    assert endpoints in code
    with keeldb.connect([server.client_url]) as c:
        c.delete("config/", prefix=True)
    exec(compile(code.replace(endpoints, repr([server.client_url])), readme, "exec"), {})
    assert "swapped at" in capsys.readouterr().out
