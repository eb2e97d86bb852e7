"""The DSpark training script (slow tier): a short run (``--short``, ~20 s on one thread)
writes heads that load for tiny-words, with fitted STS temperatures, the same tensors twice, and
reports the survival's calibration error per position before and after STS (too little data
in a short run for the error to fall reliably; the shipped heads' calibration is tested in
tests/engine/test_dspark_drafter.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer_kit.spec.drafters.dspark_heads import load_heads

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _train(out: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_dspark.py"), "--short",
                           "--out", str(out)], capture_output=True, text=True, timeout=600,
                          check=True, env=env)
    return done.stdout


def test_short_training_run_is_reproducible_and_calibrates(tmp_path: Path) -> None:
    log = _train(tmp_path / "a.safetensors")
    _train(tmp_path / "b.safetensors")
    a, b = (load_heads(tmp_path / f"{x}.safetensors", vocab_size=259, hidden_size=128,
                       num_layers=4) for x in "ab")
    for name, tensor in a.tensors().items():  # the header's key order may differ, not the values
        assert torch.equal(tensor, b.tensors()[name]), name
    heads = a
    assert heads.num_positions == 4 and heads.backbone_layers == 2
    assert not bool((heads.temperature == 1).all())
    assert heads.temperature_greedy is not None  # one calibration per decoding mode
    ece = [(float(b), float(a)) for b, a in re.findall(r"ECE before ([\d.]+) after ([\d.]+)", log)]
    assert len(ece) == 8 and all(0 <= v <= 1 for pair in ece for v in pair), log
    assert log.count("sampled position") == 4 and log.count("greedy position") == 4
    assert "held-out:" in log and "mean accepted drafts per block of 4" in log
