"""Smoke run of benchmarks/bench_attention.py --quick: it runs and every path agrees."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_attention.py"


def test_quick_benchmark_runs_and_paths_agree() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--threads", "1"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    rows = [line for line in done.stdout.splitlines() if re.search(r"\dx\s", line)]
    assert any(line.startswith("PagedAttention impl=ref") for line in rows), done.stdout
    diffs = [float(line.split()[-1]) for line in rows]
    assert len(diffs) >= 3 and max(diffs) < 1e-4, done.stdout
    assert "fused q/k norm + RoPE + KV write: skipped (CUDA only)" in done.stdout
