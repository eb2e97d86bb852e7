"""The speculative benchmark's --quick path runs (it exits non-zero if spec != plain)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_spec.py"


def test_bench_spec_quick_runs() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True,
                          timeout=300, check=True)
    assert done.stdout.count("mean acceptance length") == 19, done.stdout


def test_bench_spec_overlap_rows_run_and_equal_plain() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--only", "tiny-words", "--overlap"],
                          capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.count("mean acceptance length") == 14, done.stdout
    assert "ngram γ=4, worker process overlap" in done.stdout
