"""Smoke test of benchmarks/bench_prefix_cache.py: the --quick path runs, and every
deepinfer index reproduces the exact-LRU model's hits on both traces under both publish
patterns (no timing checked)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_prefix_cache.py"


def test_quick_run_matches_the_exact_lru_model() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--no-peers", "--requests", "120"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith("deepinfer")]
    # (2 indexes x 2 publish patterns + the one-call row, token pattern only) x 2 traces
    assert len(rows) == (2 * 2 + 1) * 2, out
    for row in rows:
        assert row.split()[-1] == "0", f"requests differing from the exact-LRU model: {row}"
