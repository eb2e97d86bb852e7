"""Every example runs to completion (each checks its own result and exits non-zero if wrong),
and the prefix-cache example prints the concrete hits and block counts its text describes."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))

PREFIX_CACHE_LINES = [
    "A publishes [0, 1, 2]",
    "B matches 8 of 12 tokens in blocks [0, 1]",
    "same tokens under cache salt 'tenant-2': []",
    "free 5, evictable 3",
    "evicted [2, 1] -> A now matches [0]",
    "PrefixCacheStats(queries=3, query_blocks=9, hit_blocks=3, inserted_blocks=3, evicted_blocks=2)",
]


def _run(path: Path, args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    runpy.run_path(str(path), run_name="__main__")
    return capsys.readouterr().out


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(path, [], monkeypatch, capsys).strip(), f"{path.name} printed nothing"


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_prefix_cache_example_prints_its_hits_and_counts(
    index: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = next(p for p in EXAMPLES if p.stem == "prefix_cache_alone")
    assert _run(path, ["--index", index], monkeypatch, capsys).splitlines() == PREFIX_CACHE_LINES
