"""Smoke test of benchmarks/bench_kv_tiers.py: the --quick path runs on the tiny model, every
config generates the device-only run's tokens, and each tier added serves at least as many
prompt tokens from a cache (counts only: no timing checked)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kv_tiers.py"
CONFIGS = ("device only", "+host", "+host+disk", "+host+disk write_back")


def test_quick_run_same_tokens_and_hits_grow_with_tiers() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    assert "tokens identical: True" in out, out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("config"))
    rows = {}
    for line in lines[start + 2:start + 2 + len(CONFIGS)]:
        name = next(c for c in sorted(CONFIGS, key=len, reverse=True) if line.startswith(c))
        cols = line[len(name):].split()
        rows[name] = (float(cols[0].rstrip("%")), cols[5], cols[6], cols[-1])  # hit rate, host/disk hits, same
    assert set(rows) == set(CONFIGS), out
    hit = {name: r[0] for name, r in rows.items()}
    assert hit["device only"] < hit["+host"] < hit["+host+disk"], out
    assert abs(hit["+host+disk write_back"] - hit["+host+disk"]) <= 1.0, out  # the disk holds the working set
    assert int(rows["+host"][1]) > 0 and int(rows["+host+disk"][2]) > 0, out
    assert all(r[3] == "True" for r in rows.values()), out
