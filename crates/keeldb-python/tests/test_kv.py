"""The key-value API: bytes in and out, ordered range scans, tables, limits, persistence."""

from __future__ import annotations

import pytest

import keeldb


def put_all(db, table, items):
    with db.write() as tx:
        for k, v in items:
            tx.put(table, k, v)


def test_put_get_delete_and_default(db):
    with db.write() as tx:
        tx.put("t", b"a", b"1")
        tx.put("t", b"b", b"")
        assert tx.get("t", b"a") == b"1"  # read-your-own-writes
    with db.read() as rx:
        assert rx.get("t", b"a") == b"1"
        assert rx.get("t", b"b") == b""
        assert rx.get("t", b"zz") is None
        assert rx.get("t", b"zz", b"dflt") == b"dflt"
        assert rx.get("missing-table", b"a") is None
    with db.write() as tx:
        tx.delete("t", b"a")
        tx.delete("t", b"never-there")
    with db.read() as rx:
        assert rx.get("t", b"a") is None


def test_get_many_agrees_with_get_key_by_key(db):
    put_all(db, "t", [(b"k%03d" % i, b"v%d" % i) for i in range(0, 200, 2)] + [(b"empty", b"")])
    keys = [b"k%03d" % i for i in range(200)] + [b"empty", b"", b"k000"]
    with db.write() as tx:
        tx.put("t", b"k001", b"own")  # read-your-own-writes
        tx.delete("t", b"k002")
        assert tx.get_many("t", keys) == [tx.get("t", k) for k in keys]
        assert tx.get_many("t", [b"k001", b"k002"]) == [b"own", None]
    with db.read() as rx:
        got = rx.get_many("t", keys)
        assert got == [rx.get("t", k) for k in keys]
        # k001 and k002 as the write above committed them; k003 never written.
        assert got[0] == b"v0" and got[1] == b"own" and got[2] is None and got[3] is None and got[200] == b""
        assert rx.get_many("t", keys[:5], default=b"-") == [b"v0", b"own", b"-", b"-", b"v4"]
        assert rx.get_many("t", []) == []
        assert rx.get_many("missing-table", [b"a", b"b"]) == [None, None]
    rx = db.read()
    rx.close()
    with pytest.raises(keeldb.TransactionDoneError):
        rx.get_many("t", [b"k000"])


@pytest.mark.parametrize(
    "call",
    [
        lambda tx: tx.get_many("t", ["str-key"]),
        lambda tx: tx.get_many("t", b"not-a-list-of-keys"),
        lambda tx: tx.get_many("t", "str"),
        lambda tx: tx.put("t", "str-key", b"v"),
        lambda tx: tx.put("t", b"k", "str-value"),
        lambda tx: tx.put("t", 1, b"v"),
        lambda tx: tx.get("t", "str-key"),
        lambda tx: tx.delete("t", "str-key"),
        lambda tx: tx.put(b"bytes-table", b"k", b"v"),
        lambda tx: list(tx.scan("t", start="a")),
    ],
)
def test_keys_and_values_must_be_bytes(db, call):
    tx = db.write()
    with pytest.raises(TypeError):
        call(tx)
    tx.rollback()


def test_scan_bounds_prefix_and_reverse(db):
    keys = [b"a", b"ab", b"abc", b"b", b"ba", b"c", b"\xff", b"\xff\x00"]
    put_all(db, "t", [(k, k.upper()) for k in keys])
    with db.read() as rx:
        assert [k for k, _ in rx.scan("t")] == sorted(keys)
        assert [k for k, _ in rx.scan("t", reverse=True)] == sorted(keys, reverse=True)
        assert [k for k, _ in rx.scan("t", start=b"ab", stop=b"ba")] == [b"ab", b"abc", b"b"]
        assert [k for k, _ in rx.scan("t", prefix=b"a")] == [b"a", b"ab", b"abc"]
        assert [k for k, _ in rx.scan("t", prefix=b"a", start=b"ab", reverse=True)] == [b"abc", b"ab"]
        assert [k for k, _ in rx.scan("t", prefix=b"\xff")] == [b"\xff", b"\xff\x00"]
        assert list(rx.scan("t", start=b"c", stop=b"a")) == []
        assert list(rx.scan("nope")) == []
        assert dict(rx.scan("t", prefix=b"b")) == {b"b": b"B", b"ba": b"BA"}


def test_scan_crosses_chunk_boundaries_in_both_directions(db):
    n = 5000  # more than several internal chunks
    put_all(db, "big", [(i.to_bytes(4, "big"), str(i).encode()) for i in range(n)])
    with db.read() as rx:
        forward = list(rx.scan("big"))
        assert len(forward) == n
        assert [int.from_bytes(k, "big") for k, _ in forward] == list(range(n))
        backward = [int.from_bytes(k, "big") for k, _ in rx.scan("big", reverse=True)]
        assert backward == list(range(n - 1, -1, -1))
        middle = [int(v) for _, v in rx.scan("big", start=(1000).to_bytes(4, "big"), stop=(4000).to_bytes(4, "big"))]
        assert middle == list(range(1000, 4000))


def test_scan_in_a_write_transaction_sees_its_own_writes(db):
    put_all(db, "t", [(b"a", b"1"), (b"c", b"3")])
    with db.write() as tx:
        tx.put("t", b"b", b"2")
        tx.delete("t", b"c")
        assert list(tx.scan("t")) == [(b"a", b"1"), (b"b", b"2")]


def test_iterator_stays_valid_while_the_transaction_writes(db):
    put_all(db, "t", [(bytes([i]), b"x") for i in range(200)])
    with db.write() as tx:
        seen = 0
        for key, _ in tx.scan("t"):
            tx.put("other", key, b"copy")
            seen += 1
        assert seen == 200
    with db.read() as rx:
        assert len(list(rx.scan("other"))) == 200


def test_tables_and_drop_table(db):
    put_all(db, "b", [(b"k", b"v")])
    put_all(db, "a", [(b"k", b"v")])
    with db.write() as tx:
        tx.add_node("n")  # graph tables are hidden
    with db.read() as rx:
        assert rx.tables() == ["a", "b"]
    with db.write() as tx:
        assert tx.drop_table("a") is True
        assert tx.drop_table("zzz") is False
    with db.read() as rx:
        assert rx.tables() == ["b"]


def test_limits_raise_limit_error_and_write_nothing(db):
    with db.write() as tx:
        with pytest.raises(keeldb.LimitError):
            tx.put("t", b"k" * (64 * 1024 + 1), b"v")
        with pytest.raises(ValueError):  # LimitError is also a ValueError
            tx.put("x" * 256, b"k", b"v")
        with pytest.raises(keeldb.InvalidArgumentError):
            tx.put("", b"k", b"v")
        tx.put("t", b"ok", b"v")
    with db.read() as rx:
        assert list(rx.scan("t")) == [(b"ok", b"v")]


def test_data_survives_close_and_reopen(path):
    db = keeldb.open(path)  # sync
    put_all(db, "t", [(b"k%d" % i, b"v%d" % i) for i in range(100)])
    db.close()
    with keeldb.open(path) as db2:
        with db2.read() as rx:
            assert rx.get("t", b"k42") == b"v42"
            assert len(list(rx.scan("t"))) == 100
