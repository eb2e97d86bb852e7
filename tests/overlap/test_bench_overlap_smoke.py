"""The overlap benchmark's --quick path runs, and both engines give the same tokens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_overlap.py"


def test_bench_overlap_quick_runs_and_agrees() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True,
                          timeout=300, check=True)
    rows = [line for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2, done.stdout
    assert all(row.split()[-1] == "True" for row in rows), done.stdout
