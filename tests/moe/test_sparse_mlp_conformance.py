"""MoELayer (torch reference and Triton, with and without replica slots) passes the
SparseMLP conformance suite; a layer that counts padded rows, or hands out a new count
tensor each call, fails it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moe_layers import randomize_moe_layer

from deepinfer_kit.moe import MoEConfig, MoELayer
from deepinfer_kit.testing.sparse_mlp import SPARSE_MLP_SUITE
from deepinfer_kit.testing.suite import Check, ConformanceError


def _layer(impl: str, replicas: bool) -> Any:
    def factory(hidden: int) -> MoELayer:
        cfg = MoEConfig(hidden_size=hidden, num_experts=6, top_k=2, intermediate_size=20)
        layer = randomize_moe_layer(MoELayer(cfg, impl=impl), 7, 6, False)  # type: ignore[arg-type]
        if replicas:
            layer.use_replicas([0, 1, 2, 3, 4, 5, 0, 3])
        return layer

    return factory


@pytest.mark.parametrize("check", SPARSE_MLP_SUITE.checks, ids=SPARSE_MLP_SUITE.ids)
@pytest.mark.parametrize("impl, replicas", [("ref", False), ("ref", True),
                                            pytest.param("triton", False, marks=pytest.mark.triton),
                                            pytest.param("triton", True, marks=pytest.mark.triton)])
def test_moe_layer_conforms(check: Check, impl: str, replicas: bool) -> None:  # type: ignore[type-arg]
    check(_layer(impl, replicas))


class _CountsPadding(MoELayer):
    """Broken: ignores real_rows (padded rows counted)."""

    def forward(self, hidden: torch.Tensor, real_rows: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(hidden)


class _FreshCounts(MoELayer):
    """Broken: a new count tensor each call (a replay would leave stale counts)."""

    def forward(self, hidden: torch.Tensor, real_rows: torch.Tensor | None = None) -> torch.Tensor:
        out = super().forward(hidden, real_rows)
        if self.last_expert_counts is not None:
            self.last_expert_counts = self.last_expert_counts.clone()
        return out


@pytest.mark.parametrize("broken, check_name", [(_CountsPadding, "padded_rows_computed_but_not_counted"),
                                                (_FreshCounts, "counts_rewritten_in_place")])
def test_a_broken_layer_fails(broken: type[MoELayer], check_name: str) -> None:
    def factory(hidden: int) -> MoELayer:
        cfg = MoEConfig(hidden_size=hidden, num_experts=6, top_k=2, intermediate_size=20)
        return randomize_moe_layer(broken(cfg, impl="ref"), 7, 6, False)

    check = next(c for c in SPARSE_MLP_SUITE.checks if c.name == check_name)
    with pytest.raises(ConformanceError):
        check(factory)
