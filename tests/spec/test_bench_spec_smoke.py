"""The speculative benchmark's --quick path runs (it exits non-zero if spec != plain)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_spec.py"


def test_bench_spec_quick_runs() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--profile"], capture_output=True, text=True,
                          timeout=300, check=True)
    assert done.stdout.count("mean acceptance length") == 20, done.stdout
    splits = re.findall(r"drafting (-?\d+)%, target step \(forward \+ verify\) (-?\d+)%, "
                        r"host \(schedule, commit, bookkeeping\) (-?\d+)%", done.stdout)
    assert len(splits) == 20, done.stdout
    for split in splits:  # each a share of the run: none counted twice
        assert all(0 <= int(p) <= 100 for p in split) and 98 <= sum(map(int, split)) <= 102, split


def test_bench_spec_overlap_rows_run_and_equal_plain() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--only", "tiny-words", "--overlap"],
                          capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.count("mean acceptance length") == 15, done.stdout
    assert "ngram γ=4, worker process overlap" in done.stdout
