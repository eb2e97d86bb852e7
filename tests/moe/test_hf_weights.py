"""load_hf_weights: both expert layouts; missing, mis-shaped and unexpected tensors are named."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kit.errors import CheckpointError
from deepinfer_kit.moe import MoEConfig, MoELayer

H, E, K, I_ = 8, 4, 2, 6
PREFIX = "model.layers.2.mlp."


def _per_expert(scheme: str = "gate_proj", *, shared: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    names = ("gate_proj", "up_proj", "down_proj") if scheme == "gate_proj" else ("w1", "w3", "w2")
    out = {PREFIX + "gate.weight": torch.randn(E, H, generator=gen)}
    for e in range(E):
        out[f"{PREFIX}experts.{e}.{names[0]}.weight"] = torch.randn(I_, H, generator=gen)
        out[f"{PREFIX}experts.{e}.{names[1]}.weight"] = torch.randn(I_, H, generator=gen)
        out[f"{PREFIX}experts.{e}.{names[2]}.weight"] = torch.randn(H, I_, generator=gen)
    if shared:
        for n, shape in (("gate_proj", (12, H)), ("up_proj", (12, H)), ("down_proj", (H, 12))):
            out[f"{PREFIX}shared_experts.{n}.weight"] = torch.randn(*shape, generator=gen)
    # another layer's tensors must be ignored, not reported
    out["model.layers.20.mlp.gate.weight"] = torch.randn(E, H, generator=gen)
    out["model.layers.2.self_attn.q_proj.weight"] = torch.randn(H, H, generator=gen)
    return out


def _config(**kw: object) -> MoEConfig:
    return MoEConfig(hidden_size=H, num_experts=E, top_k=K, intermediate_size=I_, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("scheme", ["gate_proj", "w1"])
def test_per_expert_and_fused_layouts_give_the_same_layer(scheme: str) -> None:
    weights = _per_expert(scheme)
    names = ("gate_proj", "up_proj", "down_proj") if scheme == "gate_proj" else ("w1", "w3", "w2")
    fused = {
        PREFIX + "gate.weight": weights[PREFIX + "gate.weight"],
        PREFIX + "experts.gate_up_proj": torch.stack(
            [torch.cat([weights[f"{PREFIX}experts.{e}.{names[0]}.weight"],
                        weights[f"{PREFIX}experts.{e}.{names[1]}.weight"]]) for e in range(E)]
        ),
        PREFIX + "experts.down_proj": torch.stack(
            [weights[f"{PREFIX}experts.{e}.{names[2]}.weight"] for e in range(E)]
        ),
    }
    a, b = MoELayer(_config(), impl="ref"), MoELayer(_config(), impl="ref")
    a.load_hf_weights(weights, PREFIX)
    b.load_hf_weights(fused, PREFIX.rstrip("."))
    x = torch.randn(9, H)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    assert a(x).abs().sum() > 0


def test_missing_tensor_is_named() -> None:
    weights = _per_expert()
    del weights[PREFIX + "experts.3.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight"):
        MoELayer(_config()).load_hf_weights(weights, PREFIX)


def test_mis_shaped_tensor_is_named() -> None:
    weights = _per_expert()
    weights[PREFIX + "experts.1.down_proj.weight"] = torch.zeros(H, I_ + 1)
    with pytest.raises(CheckpointError, match=r"experts\.1\.down_proj\.weight must have shape \[8, 6\], got \[8, 7\]"):
        MoELayer(_config()).load_hf_weights(weights, PREFIX)


def test_unexpected_tensor_is_named() -> None:
    weights = _per_expert(shared=True)
    with pytest.raises(CheckpointError, match=r"unexpected .*shared_experts\.down_proj\.weight"):
        MoELayer(_config()).load_hf_weights(weights, PREFIX)
    weights = _per_expert()
    weights[PREFIX + "experts.4.gate_proj.weight"] = torch.zeros(I_, H)
    with pytest.raises(CheckpointError, match=r"unexpected .*experts\.4\.gate_proj"):
        MoELayer(_config()).load_hf_weights(weights, PREFIX)


def test_deepseek_routing_needs_the_correction_bias() -> None:
    weights = _per_expert(shared=True)
    cfg = _config(routing="deepseek_v3", n_group=2, topk_group=1, num_shared_experts=1, shared_intermediate_size=12)
    with pytest.raises(CheckpointError, match=r"missing tensor .*gate\.e_score_correction_bias"):
        MoELayer(cfg).load_hf_weights(weights, PREFIX)
    weights[PREFIX + "gate.e_score_correction_bias"] = torch.randn(E)
    layer = MoELayer(cfg)
    layer.load_hf_weights(weights, PREFIX)
    bias = layer.gate.get_buffer("e_score_correction_bias")
    torch.testing.assert_close(bias, weights[PREFIX + "gate.e_score_correction_bias"])


def test_weights_are_cast_to_the_layer_dtype() -> None:
    layer = MoELayer(_config(), dtype=torch.bfloat16)
    layer.load_hf_weights(_per_expert(), PREFIX)
    assert layer.experts.gate_up.dtype == torch.bfloat16
    assert layer.gate.weight.dtype == torch.float32
    assert layer(torch.randn(3, H, dtype=torch.bfloat16)).dtype == torch.bfloat16
