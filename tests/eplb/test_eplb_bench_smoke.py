"""The selector benchmarks run and print their tables (shape and signs, never timings)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = str(ROOT / "benchmarks" / "bench_eplb_engine.py")


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_selector_cost_mode_prints_a_row_per_selector() -> None:
    out = _run("--selector-cost", "--repeats", "1", "--requests", "2", "--tokens", "6", "--ranks", "2")
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split()[:1] in (["static"], ["even"], ["balanced"])}
    assert sorted(rows) == ["balanced", "even", "static"], out
    assert all(row[3].endswith("%") and row[4].endswith("%") for row in rows.values()), out
    assert "greedy tokens identical across selectors: True" in out


@pytest.mark.slow
def test_expert_parallel_mode_prints_rows_and_the_copies_balance() -> None:
    out = _run("--ranks", "2", "--requests", "2", "--tokens", "6", "--repeats", "1")
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["static"], ["even"], ["balanced"])]
    assert [r[0] for r in rows] == ["static", "even", "balanced"], out
    balance = {r[0]: float(r[-2]) for r in rows}
    assert balance["balanced"] >= balance["static"], out
    assert "greedy tokens identical: True" in out
