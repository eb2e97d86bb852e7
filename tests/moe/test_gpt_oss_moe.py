"""gpt-oss's MoE in the kit's MoELayer: the biased top-k-then-softmax router, the experts'
interleaved ``gate_up_proj`` and biases, and the clamped SwiGLU, against a direct float64
formula and against transformers' ``GptOssMLP``; the Triton kernels' bias and clamp
options against the torch reference; slots (replicas) carry the biases."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.moe import MoEConfig, MoELayer, SoftmaxTopKRouter
from deepinfer_kit.moe.expert_variants import ExpertActivation, grouped_experts, routed_experts

E, H, INTER, K = 4, 16, 12, 2
ALPHA, LIMIT = 1.702, 1.0


def _config(**changes: Any) -> MoEConfig:
    hf = {"model_type": "gpt_oss", "hidden_size": H, "num_local_experts": E, "num_experts_per_tok": K,
          "intermediate_size": INTER, "swiglu_limit": LIMIT, "swiglu_alpha": ALPHA}
    return MoEConfig.from_hf(hf | changes)


def _hf_tensors(seed: int, prefix: str = "mlp.") -> dict[str, torch.Tensor]:
    """Random tensors in transformers' gpt-oss layout (gate/up interleaved in columns)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    return {prefix + "router.weight": draw(E, H, std=H ** -0.5), prefix + "router.bias": draw(E, std=0.5),
            prefix + "experts.gate_up_proj": draw(E, H, 2 * INTER, std=0.5),
            prefix + "experts.gate_up_proj_bias": draw(E, 2 * INTER, std=0.5),
            prefix + "experts.down_proj": draw(E, INTER, H, std=INTER ** -0.5),
            prefix + "experts.down_proj_bias": draw(E, H, std=0.5)}


def _formula(x: torch.Tensor, t: dict[str, torch.Tensor], *, split_halves: bool = False) -> torch.Tensor:
    """The gpt-oss MoE written out token by token in float64 (``split_halves``: the wrong
    reading of ``gate_up_proj``, gate = first half of the columns, up = second half)."""
    d = {k.removeprefix("mlp."): v.double() for k, v in t.items()}
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for row, xt in enumerate(x.double()):
        logits = d["router.weight"] @ xt + d["router.bias"]
        top = sorted(range(E), key=lambda e: -float(logits[e]))[:K]
        weights = torch.softmax(logits[top], dim=0)
        for w, e in zip(weights, top):
            gu = xt @ d["experts.gate_up_proj"][e] + d["experts.gate_up_proj_bias"][e]
            gate, up = (gu[:INTER], gu[INTER:]) if split_halves else (gu[0::2], gu[1::2])
            gate, up = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
            act = (up + 1) * gate * torch.sigmoid(ALPHA * gate)
            out[row] += w * (act @ d["experts.down_proj"][e] + d["experts.down_proj_bias"][e])
    return out


def _layer(impl: str = "ref", seed: int = 0) -> tuple[MoELayer, dict[str, torch.Tensor]]:
    tensors = _hf_tensors(seed)
    layer = MoELayer(_config(), impl=impl)  # type: ignore[arg-type]
    layer.load_hf_weights(tensors, "mlp.")
    return layer, tensors


def test_interleaved_gate_up_and_clamped_swiglu_match_the_float64_formula() -> None:
    layer, tensors = _layer()
    x = torch.randn(23, H, generator=torch.Generator().manual_seed(1))
    got = layer(x)
    want = _formula(x, tensors)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # the clamp bites on both sides of up and above on gate at these scales
    gu = torch.einsum("th,ehn->ten", x, tensors["mlp.experts.gate_up_proj"])
    assert (gu[..., 0::2] > LIMIT).any() and (gu[..., 1::2].abs() > LIMIT).any()
    # reading gate/up as halves instead of interleaved columns is far off
    assert (got.double() - _formula(x, tensors, split_halves=True)).abs().max() > 1e-2


def test_router_is_biased_topk_of_logits_then_softmax_over_k() -> None:
    gen = torch.Generator().manual_seed(2)
    router = SoftmaxTopKRouter(H, E, K, bias=True, softmax_after_topk=True)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=gen))
        assert router.bias is not None
        router.bias.copy_(torch.randn(E, generator=gen) * 2)
    x = torch.randn(40, H, generator=gen)
    routing = router(x)
    logits = x.double() @ router.weight.double().T + router.bias.double()
    values, ids = torch.topk(logits, K, dim=-1)
    assert torch.equal(routing.expert_ids, ids)
    torch.testing.assert_close(routing.weights.double(), torch.softmax(values, dim=-1), rtol=1e-6, atol=1e-7)
    unbiased = torch.topk(x.double() @ router.weight.double().T, K, dim=-1).indices
    assert not torch.equal(unbiased, ids)  # the bias changes which experts are picked


def test_layer_matches_transformers_gpt_oss_mlp() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    hf_config = transformers.GptOssConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E,
                                          num_experts_per_tok=K, swiglu_limit=LIMIT)
    block = GptOssMLP(hf_config).eval()
    with torch.no_grad():
        for name, param in block.named_parameters():
            param.copy_(_hf_tensors(3, prefix="")[name])
    layer = MoELayer(MoEConfig.from_hf(hf_config.to_dict()), impl="ref")
    layer.load_hf_weights({"mlp." + k: v for k, v in block.state_dict().items()}, "mlp.")
    x = torch.randn(19, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want, _ = block(x.unsqueeze(0))
    torch.testing.assert_close(layer(x), want.squeeze(0), rtol=1e-5, atol=1e-6)


@pytest.mark.triton
def test_triton_bias_and_clamp_options_equal_the_reference() -> None:
    from deepinfer_kit.moe import triton_ops

    ex = _layer()[0].experts
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(21, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(21)])
    weights = torch.rand(21, K, generator=gen)
    act = ExpertActivation("clamped_swiglu", ALPHA, LIMIT)
    gub, db = ex.gate_up_bias, ex.down_bias
    want, counts = routed_experts(x, ids, weights, ex.gate_up, ex.down, act, gate_up_bias=gub, down_bias=db)
    got, got_counts = triton_ops.routed_swiglu(x, ids, weights, ex.gate_up, ex.down, activation=act,
                                               gate_up_bias=gub, down_bias=db)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert got_counts.tolist() == counts.tolist()
    grouped = [3, 0, 9, 5]
    rows = torch.randn(sum(grouped), H, generator=gen)
    torch.testing.assert_close(
        triton_ops.grouped_swiglu(rows, ex.gate_up, ex.down, grouped, activation=act, gate_up_bias=gub, down_bias=db),
        grouped_experts(rows, ex.gate_up, ex.down, grouped, act, gate_up_bias=gub, down_bias=db), rtol=1e-4, atol=1e-5)


def test_replica_slots_carry_the_biases() -> None:
    layer, _ = _layer(seed=6)
    x = torch.randn(17, H, generator=torch.Generator().manual_seed(7))
    before = layer(x)
    layer.use_replicas([0, 1, 2, 3, 1, 2])
    assert layer.experts.gate_up_bias is not None and layer.experts.gate_up_bias.shape[0] == 6
    torch.testing.assert_close(layer(x), before, rtol=0, atol=1e-6)
    layer.apply_placement([3, 2, 1, 0, 0, 3])
    torch.testing.assert_close(layer(x), before, rtol=0, atol=1e-6)


class _Delegating:
    """A dispatcher that is not a LocalDispatcher: the layer takes its dispatch -> grouped
    experts -> combine plan (the expert-parallel one) instead of the one-call routed path."""

    def __init__(self) -> None:
        from deepinfer_kit.moe import LocalDispatcher

        self.inner = LocalDispatcher(E)

    @property
    def local_experts(self) -> tuple[int, ...]:
        return tuple(self.inner.local_experts)

    def dispatch(self, hidden: torch.Tensor, routing: Any) -> Any:
        return self.inner.dispatch(hidden, routing)

    def combine(self, expert_out: torch.Tensor, dispatched: Any) -> torch.Tensor:
        return self.inner.combine(expert_out, dispatched)


def test_dispatch_grouped_combine_plan_equals_the_routed_one() -> None:
    layer, tensors = _layer(seed=8)
    split = MoELayer(_config(), impl="ref", dispatcher=_Delegating())
    split.load_hf_weights(tensors, "mlp.")
    x = torch.randn(15, H, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(split(x), layer(x), rtol=1e-5, atol=1e-6)


def test_other_families_keep_the_plain_layer() -> None:
    layer = MoELayer(MoEConfig(hidden_size=H, num_experts=E, top_k=K, intermediate_size=INTER), impl="ref")
    assert not layer.experts.variant and layer.gate.bias is None
    assert sorted(n for n, _ in layer.named_parameters()) == ["experts.down", "experts.gate_up", "gate.weight"]


def test_from_hf_reads_the_gpt_oss_options() -> None:
    cfg = _config(swiglu_limit=7.0)
    assert (cfg.routing, cfg.router_bias, cfg.expert_bias, cfg.expert_activation, cfg.expert_layout) == (
        "topk_softmax", True, True, "clamped_swiglu", "gpt_oss")
    assert (cfg.swiglu_alpha, cfg.swiglu_limit, cfg.num_shared_experts) == (ALPHA, 7.0, 0)


@pytest.mark.parametrize(("changes", "message"), [
    ({"routing": "deepseek_v3", "router_bias": True}, "router_bias needs a softmax routing"),
    ({"expert_activation": "gelu"}, "expert_activation must be one of"),
    ({"swiglu_limit": 0.0}, "swiglu_limit must be finite and > 0, got 0.0"),
    ({"swiglu_alpha": float("inf")}, "swiglu_alpha must be finite and > 0"),
    ({"expert_layout": "interleaved"}, "expert_layout must be one of"),
    ({"expert_layout": "gpt_oss", "num_shared_experts": 1, "shared_intermediate_size": 8},
     "expert_layout 'gpt_oss' has no shared experts"),
])
def test_bad_gpt_oss_fields_are_named(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        MoEConfig(hidden_size=H, num_experts=E, top_k=K, intermediate_size=INTER, **changes)


def test_missing_expert_bias_is_named() -> None:
    tensors = _hf_tensors(0)
    del tensors["mlp.experts.down_proj_bias"]
    from deepinfer_kit.errors import CheckpointError

    with pytest.raises(CheckpointError, match="mlp.experts.down_proj_bias"):
        MoELayer(_config(), impl="ref").load_hf_weights(tensors, "mlp.")
