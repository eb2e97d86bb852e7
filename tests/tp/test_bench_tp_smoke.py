"""bench_tp runs at T = 1 and 2 on gloo and prints a row per T whose per-rank weight bytes
stay under dense / T plus the replicated parts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_tp.py"


@pytest.mark.slow  # spawns three rank processes, each importing torch
def test_bench_tp_quick_prints_a_row_per_world() -> None:
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p))
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--worlds", "1,2"],
                          capture_output=True, text=True, timeout=900, check=False, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["1", "2"], done.stdout
    for row in rows:
        assert float(row[1]) > 0 and float(row[4]) > 0 and row[-1] == "ok", row
        held, limit, dense = (int(v.replace(",", "")) for v in row[7:10])
        assert held <= limit and (row[0] == "1" or held < dense)
