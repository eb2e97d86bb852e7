"""Smoke test of benchmarks/bench_plan_codec.py: both forms cross, and the columns are the
smaller message (a size, not a time: nothing here depends on the machine's speed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_bench_plan_codec_runs() -> None:
    sys.path.insert(0, str(BENCHMARKS))  # it imports bench_scheduler's helpers
    try:
        spec = importlib.util.spec_from_file_location("bench_plan_codec", BENCHMARKS / "bench_plan_codec.py")
        assert spec is not None and spec.loader is not None
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        best = bench.measure(16, 5)
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert set(best) == {"columns", "records", "pickle"}
    assert all(us > 0 and size > 0 for us, size in best.values())
    assert best["columns"][1] < best["records"][1]
