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


def test_bench_spec_planners_staircase_quick_runs() -> None:
    """``--staircase``: the rule table and the padded serving rows, with DeepInfer's rows
    when its sdist is found and the line saying why not otherwise."""
    done = subprocess.run([sys.executable, str(BENCH), "--staircase", "--quick", "--cases", "20"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr
    out = done.stdout
    assert "planner rule on 20 random staircases" in out, out
    assert "kit: whole walk, previous round's budget " in out and "kit: early stop (before) " in out
    assert out.count("  dspark whole walk ") == 2, out  # C = 4 and 16
    peer = "DeepInfer MTPVarlen::schedule" in out
    assert peer != ("DeepInfer rows skipped" in out), out
