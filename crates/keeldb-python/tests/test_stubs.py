"""The type stubs name exactly the public methods the native module has, so they cannot drift."""

from __future__ import annotations

import ast
import os

import keeldb

STUB = os.path.join(os.path.dirname(__file__), "..", "python", "keeldb", "_keeldb.pyi")
DUNDERS = {"__enter__", "__exit__", "__getitem__", "__bool__"}


def test_stub_classes_match_the_native_classes():
    with open(STUB) as f:
        tree = ast.parse(f.read())
    stub = {c.name: {f.name for f in c.body if isinstance(f, ast.FunctionDef)} for c in tree.body if isinstance(c, ast.ClassDef)}
    assert set(stub) == {
        "Database",
        "ReadTransaction",
        "WriteTransaction",
        "Node",
        "Edge",
        "VerifyReport",
        "Client",
        "KeyValue",
        "MemberStatus",
        "Member",
        "TxnResult",
        "Compare",
        "Op",
        "Lease",
        "LeaseInfo",
        "Watch",
        "WatchEvent",
        "Lock",
    }
    for name, methods in stub.items():
        cls = getattr(keeldb, name)
        inherited = set().union(*(stub.get(base.__name__, set()) for base in cls.__mro__[1:]))
        public = {m for m in dir(cls) if not m.startswith("_") or m in DUNDERS}
        assert public - methods - inherited == set(), f"{name}: methods without a stub"
        assert methods - set(dir(cls)) == set(), f"{name}: stubs without a method"
    functions = {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}
    assert functions == {"open", "verify", "connect"}
