"""Smoke test of benchmarks/bench_scheduler.py: both schedulers run both workloads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_scheduler.py"


def test_bench_scheduler_runs() -> None:
    spec = importlib.util.spec_from_file_location("bench_scheduler", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for workload in ("decode", "mixed"):
        for kind in ("ours", "naive"):
            us, running = bench.measure(kind, workload, 8, 5, 0)
            assert us > 0 and running > 0
