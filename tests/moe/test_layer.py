"""MoELayer: the grouped path equals a per-token, per-expert loop; counts; bad input."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from deepinfer_kit.errors import ConfigError, DeviceUnavailableError
from moe_layers import randomize_moe_layer

from deepinfer_kit.moe import Dispatched, LocalDispatcher, MoEConfig, MoELayer, Routing


def _random_layer(seed: int, impl: str = "ref", dtype: torch.dtype = torch.float32) -> MoELayer:
    rng = random.Random(seed)
    experts = rng.choice([4, 8])
    deepseek = rng.random() < 0.5
    shared = rng.choice([0, 1, 2])
    cfg = MoEConfig(
        hidden_size=rng.choice([16, 24]), num_experts=experts, top_k=rng.randint(1, 3),
        intermediate_size=rng.choice([8, 20]), routing="deepseek_v3" if deepseek else "softmax",
        norm_topk_prob=rng.random() < 0.5, n_group=2 if deepseek else 1, topk_group=2 if deepseek else 1,
        routed_scaling_factor=1.5 if deepseek else 1.0, num_shared_experts=shared,
        shared_intermediate_size=12 * shared, shared_expert_gate=bool(shared) and rng.random() < 0.5,
    )
    layer = MoELayer(cfg, impl=impl, dtype=dtype)  # type: ignore[arg-type]
    return randomize_moe_layer(layer, seed, experts, deepseek)


def _loop_reference(layer: MoELayer, hidden: torch.Tensor) -> torch.Tensor:
    """y_t = sum_j w_tj SwiGLU_{e_tj}(x_t) + shared(x_t), one token and expert at a time, fp64."""
    routing = layer.gate(hidden)
    x = hidden.double()
    gate_up, down = layer.experts.gate_up.double(), layer.experts.down.double()
    inter = down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(routing.expert_ids[t].tolist(), routing.weights[t].tolist()):
            h = gate_up[e] @ x[t]
            out[t] += w * (down[e] @ (F.silu(h[:inter]) * h[inter:]))
    shared = layer.shared_experts
    if shared is not None:
        h = x @ shared.gate_up.double().t()
        i_s = shared.down.shape[1]
        s = (F.silu(h[:, :i_s]) * h[:, i_s:]) @ shared.down.double().t()
        if shared.gate is not None:
            s = s * torch.sigmoid(x @ shared.gate.double().t())
        out += s
    return out


@pytest.mark.parametrize("seed", range(12))
def test_grouped_path_equals_per_token_loop_fp32(seed: int) -> None:
    layer = _random_layer(seed)
    hidden = torch.randn(random.Random(seed).randint(1, 40), layer.config.hidden_size)
    got = layer(hidden)
    torch.testing.assert_close(got.double(), _loop_reference(layer, hidden), rtol=1e-5, atol=1e-5)
    counts = layer.last_expert_counts
    assert counts is not None and counts.shape == (layer.config.num_experts,)
    assert int(counts.sum()) == hidden.shape[0] * layer.config.top_k


def test_bf16_layer_within_stated_tolerance() -> None:
    layer = _random_layer(3, dtype=torch.bfloat16)
    hidden = torch.randn(30, layer.config.hidden_size)
    got = layer(hidden.bfloat16())
    assert got.dtype == torch.bfloat16
    # bf16 weights/activations: about 3 significant digits
    torch.testing.assert_close(got.double(), _loop_reference(layer, hidden.bfloat16().float()), rtol=3e-2, atol=3e-2)


@pytest.mark.triton
@pytest.mark.parametrize("seed", range(3))
def test_triton_layer_equals_ref_layer(seed: int) -> None:
    ref = _random_layer(seed, impl="ref")
    tri = _random_layer(seed, impl="triton")
    assert tri.experts.impl == "triton"
    hidden = torch.randn(25, ref.config.hidden_size)
    torch.testing.assert_close(tri(hidden), ref(hidden), rtol=1e-4, atol=1e-5)


def test_impl_choice_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = MoEConfig(hidden_size=8, num_experts=4, top_k=2, intermediate_size=4)
    assert MoELayer(cfg, impl="auto").experts.impl == "ref"  # auto = triton only on CUDA
    with pytest.raises(ConfigError, match="impl must be one of"):
        MoELayer(cfg, impl="cuda")  # type: ignore[arg-type]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(DeviceUnavailableError, match="impl='triton'"):
        MoELayer(cfg, impl="triton")


def test_bad_hidden_shape_rejected() -> None:
    layer = MoELayer(MoEConfig(hidden_size=8, num_experts=4, top_k=2, intermediate_size=4))
    with pytest.raises(ConfigError, match=r"hidden must be \[\.\.\., 8\], got \[2, 3, 7\]"):
        layer(torch.zeros(2, 3, 7))
    with pytest.raises(ConfigError, match=r"hidden must be \[\.\.\., 8\], got \[\]"):
        layer(torch.zeros(()))
    assert layer(torch.zeros(0, 8)).shape == (0, 8)
    assert layer(torch.zeros(3, 0, 8)).shape == (3, 0, 8)


@pytest.mark.parametrize("shape", [(8,), (2, 5), (3, 1, 4), (2, 2, 2, 3)])
def test_any_leading_shape_equals_the_flattened_tokens(shape: tuple[int, ...]) -> None:
    layer = _random_layer(3)
    hidden = torch.randn(*shape, layer.config.hidden_size, generator=torch.Generator().manual_seed(1))
    flat = layer(hidden.reshape(-1, layer.config.hidden_size))
    counts = layer.last_expert_counts
    out = layer(hidden)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    assert torch.equal(out, flat.reshape(hidden.shape))
    assert torch.equal(torch.as_tensor(layer.last_expert_counts), torch.as_tensor(counts))
    one = layer(hidden.reshape(-1, layer.config.hidden_size)[0])  # a single token [H]
    assert one.shape == (layer.config.hidden_size,) and torch.allclose(one, flat[0], atol=1e-6)


class _Delegating:
    """Not a LocalDispatcher, so the layer takes the dispatch -> experts -> combine plan."""

    def __init__(self, experts: int) -> None:
        self.inner = LocalDispatcher(experts)
        self.local_experts = self.inner.local_experts

    def dispatch(self, hidden: torch.Tensor, routing: Routing) -> Dispatched:
        return self.inner.dispatch(hidden, routing)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return self.inner.combine(expert_out, dispatched)


@pytest.mark.parametrize("seed", range(6))
def test_dispatcher_plan_equals_fused_local_plan(seed: int) -> None:
    fused = _random_layer(seed)
    general = MoELayer(fused.config, impl="ref", dispatcher=_Delegating(fused.config.num_experts))
    general.load_state_dict(fused.state_dict())
    hidden = torch.randn(33, fused.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(general(hidden), fused(hidden), rtol=1e-5, atol=1e-6)
    assert general.last_expert_counts is not None and fused.last_expert_counts is not None
    assert torch.equal(general.last_expert_counts, fused.last_expert_counts)
