"""The planner study's --quick path runs on the simulator and prints its full table and
the target checks (their PASS / FAIL is the study's result, not asserted here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_spec_planners.py"


def test_bench_spec_planners_quick_runs() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode in (0, 1), done.stderr  # 1: a target check printed FAIL
    out = done.stdout
    assert out.count(" per-request ") == 5 * 9, out  # C = 1..16, 9 rows each
    for line in ("fixed γ=8 below plain past saturation", "DSpark never below plain",
                 "DSpark >= best fixed γ at each C"):
        assert f"  {line}: " in out, out
    assert "x1.00  per-request" in out  # plain, the same-run baseline
