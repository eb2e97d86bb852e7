"""Padded rows (``real_rows`` False, a static decode round's) are computed like any row but
left out of the layer's expert and slot counts, counted on the device; the count tensors
are the same objects from one forward to the next (a captured graph's replay rewrites
them in place)."""

from __future__ import annotations

import random

import pytest
import torch

from moe_layers import make_layer, no_host_reads

from deepinfer_kit.errors import ConfigError


def _mask(seed: int, tokens: int) -> torch.Tensor:
    rng = random.Random(seed)
    real = torch.tensor([rng.random() < 0.6 for _ in range(tokens)])
    real[0] = True
    return real


def _replica_map(seed: int, experts: int) -> list[int]:
    rng = random.Random(seed)
    return list(range(experts)) + [rng.randrange(experts) for _ in range(3)]


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("replicas", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_padded_rows_are_computed_but_not_counted(seed: int, replicas: bool, impl: str) -> None:
    layer = make_layer(seed, shared=seed == 1, impl=impl)
    alone = make_layer(seed, shared=seed == 1, impl=impl)
    if replicas:
        layer.use_replicas(_replica_map(seed, layer.config.num_experts))
        alone.use_replicas(_replica_map(seed, layer.config.num_experts))
    hidden = torch.randn(19, layer.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    real = _mask(seed, 19)
    want = layer(hidden)
    unmasked = layer.last_expert_counts
    assert unmasked is not None
    unmasked = unmasked.clone()
    kept = layer.last_expert_counts
    if impl == "triton":
        with no_host_reads():
            out = layer(hidden, real)
    else:
        out = layer(hidden, real)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)  # the mask changes no row
    alone(hidden[real])
    assert alone.last_expert_counts is not None and layer.last_expert_counts is not None
    assert torch.equal(layer.last_expert_counts.cpu(), alone.last_expert_counts.cpu())
    k = layer.config.top_k
    assert int(layer.last_expert_counts.sum()) == int(real.sum()) * k
    assert int(unmasked.sum()) == 19 * k
    assert layer.last_expert_counts is kept  # one tensor, rewritten in place
    if replicas:
        assert layer.last_slot_counts is not None
        assert int(layer.last_slot_counts.sum()) == int(real.sum()) * k
    layer(hidden, torch.ones(19, dtype=torch.bool))
    assert int(layer.last_expert_counts.sum()) == 19 * k


def test_real_rows_must_be_one_bool_per_token() -> None:
    layer = make_layer(0, shared=False, impl="ref")
    hidden = torch.randn(5, layer.config.hidden_size)
    with pytest.raises(ConfigError, match=r"real_rows must be \[5\] bool"):
        layer(hidden, torch.ones(4, dtype=torch.bool))
    with pytest.raises(ConfigError, match=r"real_rows must be \[5\] bool"):
        layer(hidden, torch.ones(5, dtype=torch.int64))
