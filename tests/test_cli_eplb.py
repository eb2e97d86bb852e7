"""deepinfer-kit trace with live EPLB: per-step GPU loads and the heatmaps of a rebalance."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from deepinfer_kit.cli import main

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
ARGS = ["trace", "--model", "tiny", "--max-tokens", "8", "--eplb-interval", "3", "--eplb-window", "4",
        "--eplb-redundant", "4", "--eplb-gpus", "4"]


def _maps(out: str) -> dict[str, list[list[float]]]:
    """``{"before": rows, "after": rows}``: each row the GPU shares then mean/max."""
    maps: dict[str, list[list[float]]] = {}
    for name in ("before", "after"):
        block = out.split(f"{name} (")[1].splitlines()[2:4]
        maps[name] = [[float(x) for x in re.findall(r"(\d+\.\d+)", row)] for row in block]
    return maps


def test_trace_draws_the_load_per_gpu_before_and_after_a_rebalance(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(ARGS) == 0
    out = capsys.readouterr().out
    assert "expert copies per GPU, per MoE layer: [[" in out
    assert re.search(r"rebalance after step 3 \(\d+ rebalances; \d+ slots moved, \d+ bytes", out)
    maps = _maps(out)
    for rows in maps.values():
        assert len(rows) == 2 and all(len(r) == 5 for r in rows)  # 2 layers x (4 GPUs + mean/max)
        assert all(abs(sum(r[:4]) - 100.0) < 0.5 for r in rows)
    before = sum(r[4] for r in maps["before"])
    after = sum(r[4] for r in maps["after"])
    assert after > before  # the plan balances the window it was made from


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is optional and not installed")
def test_trace_writes_a_png_heatmap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "heat.png"
    assert main([*ARGS, "--heatmap", str(png)]) == 0
    assert f"heatmap written to {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(HAS_MATPLOTLIB, reason="checks the message shown without matplotlib")
def test_without_matplotlib_the_text_heatmap_still_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--heatmap", str(tmp_path / "heat.png")]) == 0
    out = capsys.readouterr().out
    assert "heatmap not written: a PNG heatmap needs matplotlib" in out and "after (new placement):" in out
    assert not (tmp_path / "heat.png").exists()


def test_indivisible_slots_exit_2_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "--model", "tiny", "--eplb-interval", "2", "--eplb-redundant", "1", "--eplb-gpus", "2"]) == 2
    assert "eplb.num_redundant=1 gives 8 experts + 1 = 9 slots" in capsys.readouterr().err
