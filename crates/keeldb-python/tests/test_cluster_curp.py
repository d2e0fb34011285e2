"""Client.curp_put against three real `keel serve` processes: writes on distinct keys complete on
the fast path (one round trip) and are read at once; a key written twice in a row is answered
from the recorded results, never applied twice; bad input is refused. Every wait is bounded."""

from __future__ import annotations

import uuid
from typing import Iterator, List

import pytest

import keeldb
from test_cluster_client import Member, start_cluster


@pytest.fixture(scope="module")
def trio(tmp_path_factory) -> Iterator[List[Member]]:
    members = start_cluster(str(tmp_path_factory.mktemp("curp")), ["u1", "u2", "u3"])
    yield members
    for m in members:
        m.stop()


@pytest.fixture
def client(trio) -> Iterator[keeldb.Client]:
    with keeldb.connect([m.client_url for m in trio], timeout=10.0) as c:
        yield c


def test_fast_writes_are_read_at_once(client):
    ns = f"curp-{uuid.uuid4().hex[:8]}/"
    client.curp_put(ns + "warm", b"up")  # learns the leader and the term
    answers = []
    for i in range(20):
        key = f"{ns}k{i}".encode()
        answers.append(client.curp_put(key, f"v{i}".encode()))
        assert client.get(key) == f"v{i}".encode()
    fast, slow = client.curp_counts()
    assert fast + slow == 21
    assert fast >= 15, (fast, slow)
    assert sum(a is None for a in answers) >= 15, answers  # fast: no revision yet
    revision = client.curp_put(ns + "last", b"x", wait=True)
    assert isinstance(revision, int) and revision > 0
    assert client.get_kv(ns + "last").mod_revision == revision


def test_each_write_applies_once(client):
    key = f"curp-{uuid.uuid4().hex[:8]}/hot"
    for i in range(30):
        client.curp_put(key, str(i).encode())
    kv = client.get_kv(key)
    assert kv.value == b"29"
    assert kv.version == 30


def test_bad_input_is_refused(client):
    with pytest.raises(keeldb.InvalidRequest):
        client.curp_put(b"", b"v")
    with pytest.raises(TypeError):
        client.curp_put(1, b"v")  # type: ignore[arg-type]


def test_weak_writes_are_read_by_their_session_and_settle(client):
    ns = f"weak-{uuid.uuid4().hex[:8]}/"
    for i in range(10):
        key = f"{ns}k{i}".encode()
        client.curp_weak_put(key, f"v{i}".encode())
        assert client.curp_weak_get(key) == f"v{i}".encode()  # read-your-writes, at once
    assert client.curp_weak_get(ns + "never") is None
    client.curp_settle()
    for i in range(10):  # applied: every client's linearizable reads see them
        assert client.get(f"{ns}k{i}".encode()) == f"v{i}".encode()
    with pytest.raises(keeldb.InvalidRequest):
        client.curp_weak_put(b"", b"v")
    with pytest.raises(keeldb.InvalidRequest):
        client.curp_weak_get(b"")
