"""examples/python/task_graph.py runs to completion and its integrity check passes."""

from __future__ import annotations

import os
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "python", "task_graph.py")


def test_task_graph_example_runs(tmp_path):
    store = str(tmp_path / "store")
    result = subprocess.run([sys.executable, EXAMPLE, store], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "blocked (nothing written)" in result.stdout
    assert "tasks: 5, done: 5" in result.stdout
    assert "integrity: ok" in result.stdout
