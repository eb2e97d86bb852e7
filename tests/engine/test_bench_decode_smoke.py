"""The decode benchmark runs on CPU with the small shape and prints its full table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_decode.py"
HEADER = ["batch", "system", "1-tok", "ms", "ms/step", "tok/s", "roofline", "ms", "of",
          "roofline", "engine/this", "agree"]


def test_bench_decode_cpu_smoke_prints_positive_table() -> None:
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p))
    done = subprocess.run(
        [sys.executable, str(BENCH), "--device", "cpu", "--batch-sizes", "1", "4",
         "--prompt-len", "8", "--new-tokens", "16", "--repeats", "1", "--copy-mib", "16"],
        capture_output=True, text=True, timeout=600, check=False, env=env,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.split() == HEADER for line in lines), done.stdout
    rows = [line.split() for line in lines if line.strip()[:1].isdigit()]
    systems = [(int(r[0]), " ".join(r[1:3]) if r[1] == "transformers" else r[1]) for r in rows]
    assert systems == [(1, "engine"), (1, "transformers eager"),
                       (4, "engine"), (4, "transformers eager")], done.stdout
    for row in rows:
        numbers = row[-7:-1]  # 1-tok ms, ms/step, tok/s, roofline ms, of roofline, engine/this
        values = [float(x.rstrip("%x")) for x in numbers]
        assert all(v > 0 for v in values), row
        agreed, total = row[-1].split("/")
        assert 0 <= int(agreed) <= int(total) == 16, row
    assert "copy bandwidth:" in done.stdout and "counted as 2 x bytes / time" in done.stdout
