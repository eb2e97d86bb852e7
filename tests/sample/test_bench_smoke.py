"""The sampler benchmark's --quick path runs and prints its table, tokens inside the sets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_sampler_quick_runs() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_sampler.py"), "--quick", "--impl", "ref"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith(("llm", "flat"))]
    assert len(rows) == 4, done.stdout
    assert all(line.rstrip().endswith("yes") and "x" in line for line in rows), done.stdout


def test_bench_sampler_sweep_quick_runs() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_sampler.py"), "--quick", "--sweep", "--impl", "ref"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line[:4].strip() in ("0.5", "1.0", "1.5")]
    assert len(rows) == 9, done.stdout
    assert all(line.rstrip().endswith("yes/peers yes") and "x |" in line for line in rows), done.stdout


def test_bench_sampler_issue_mix_quick_runs() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_sampler.py"), "--quick", "--issue-mix", "--impl", "ref"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith(("llm", "flat"))]
    assert len(rows) == 2 and all(" ms" in line for line in rows), done.stdout
