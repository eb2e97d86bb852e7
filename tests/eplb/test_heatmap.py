"""text_heatmap: shares, shades on one scale, balancedness per layer."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kit.eplb.heatmap import SHADES, text_heatmap
from deepinfer_kit.errors import ConfigError


def test_cells_show_shares_shades_and_balancedness() -> None:
    lines = text_heatmap(torch.tensor([[1, 3], [2, 2], [0, 0]]), "t").splitlines()
    assert lines[0] == "t" and lines[1].split()[:3] == ["layer", "gpu0", "gpu1"]
    assert lines[2] == f"    0 {SHADES[3] * 2} 25.0%{SHADES[9] * 2} 75.0%   0.667"
    assert lines[3] == f"    1 {SHADES[6] * 2} 50.0%{SHADES[6] * 2} 50.0%   1.000"
    assert lines[4].split()[-1] == "1.000"  # an idle layer is balanced


def test_a_shared_scale_keeps_two_maps_comparable() -> None:
    light = text_heatmap(torch.tensor([[1.0, 1.0]]), "t", scale=10.0).splitlines()[2]
    assert light.startswith(f"    0 {SHADES[1] * 2} 50.0%")


def test_load_must_be_two_dimensional() -> None:
    with pytest.raises(ConfigError, match=r"load must be \[L, G\], got shape \(3,\)"):
        text_heatmap(torch.ones(3), "t")
