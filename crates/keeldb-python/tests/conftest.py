"""Shared fixtures: every test gets its own store directory under pytest's tmp_path."""

from __future__ import annotations

import os
from typing import Iterator

import pytest

import keeldb


@pytest.fixture
def path(tmp_path) -> str:
    return os.path.join(str(tmp_path), "store")


@pytest.fixture
def db(path) -> Iterator[keeldb.Database]:
    """A store in relaxed mode (the tests exercise semantics, not fsync latency)."""
    handle = keeldb.open(path, durability="relaxed")
    yield handle
    try:
        handle.close()
    except keeldb.ClosedError:
        pass
