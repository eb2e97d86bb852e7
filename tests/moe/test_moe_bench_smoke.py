"""The MoE benchmark's --quick path runs and prints its ratio table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_moe_quick_runs() -> None:
    pytest.importorskip("transformers")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_moe.py"), "--quick", "--archs", "qwen3_moe", "glm4_moe"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith(("qwen3_moe", "glm4_moe"))]
    assert len(rows) == 2 and all(line.endswith(tuple("0123456789")) for line in rows), done.stdout
