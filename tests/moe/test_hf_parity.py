"""MoELayer equals transformers' own MoE blocks (same weights, fp32 tolerance)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from _moe_hf import ARCHS, layer_from_saved, tiny_model  # noqa: E402

from deepinfer_kit.moe import MoEConfig, MoELayer  # noqa: E402


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_layer_loaded_from_save_pretrained_matches_hf_block(arch: str, tmp_path: Path) -> None:
    model = tiny_model(arch)
    layer = layer_from_saved(model, tmp_path, arch, impl="ref")
    block = model.model.layers[0].mlp
    hidden = torch.randn(37, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = block(hidden.unsqueeze(0)).squeeze(0)
        got = layer(hidden)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    counts = layer.last_expert_counts
    assert counts is not None and int(counts.sum()) == 37 * layer.config.top_k


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_fused_state_dict_layout_loads_too(arch: str) -> None:
    model = tiny_model(arch, experts_implementation="grouped_mm", seed=3)
    state = model.state_dict()
    config = MoEConfig.from_hf(model.config.to_dict())
    layer = MoELayer(config, impl="ref")
    layer.load_hf_weights(state, "model.layers.0.mlp.")
    hidden = torch.randn(20, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model.model.layers[0].mlp(hidden.unsqueeze(0)).squeeze(0)
    torch.testing.assert_close(layer(hidden), expected, rtol=1e-5, atol=1e-6)

