"""Conformance suite for SparseMLP (a sparse decoder layer's mixture-of-experts MLP).

Checks need a ``factory(hidden_size)`` returning a sparse MLP on the CPU with fixed,
non-trivial random weights (every call the same weights). They check the shapes, that
``last_expert_counts`` counts each routed copy once, that padded rows (``real_rows``
False: a static decode round's) are computed like any row but left out of the counts,
and that the count tensor is the same object from one forward to the next (rewritten in
place: what lets a CUDA graph's replay leave its counts where a reader finds them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.protocols import SparseMLP
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["SparseMLPFactory", "SPARSE_MLP_SUITE"]

SparseMLPFactory = Callable[[int], SparseMLP]
"""``factory(hidden_size)`` -> a sparse MLP on the CPU with fixed random weights."""

SPARSE_MLP_SUITE: Suite[SparseMLPFactory] = Suite("SparseMLP", "factory(hidden_size) -> SparseMLP")

_HIDDEN = 32


def _hidden(tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(tokens, _HIDDEN, generator=torch.Generator().manual_seed(seed))


def _counts(mlp: SparseMLP) -> torch.Tensor:
    counts = mlp.last_expert_counts
    expect(counts is not None, "last_expert_counts must be set after a call")
    assert counts is not None
    return counts.detach().to("cpu", torch.int64).clone()


@SPARSE_MLP_SUITE.check
def check_shapes_and_counts(factory: SparseMLPFactory) -> None:
    mlp = factory(_HIDDEN)
    expect(mlp.last_expert_counts is None, "last_expert_counts must be None before any call")
    out = mlp(_hidden(9))
    expect(out.shape == (9, _HIDDEN), f"output shape {tuple(out.shape)}, want (9, {_HIDDEN})")
    expect(out.dtype == torch.float32, f"output dtype {out.dtype}, want the input's float32")
    nine = _counts(mlp)
    expect(nine.dim() == 1 and bool((nine >= 0).all()), f"counts must be [E] and >= 0, got {nine.tolist()}")
    per_token = int(nine.sum()) // 9
    expect(per_token >= 1 and int(nine.sum()) == 9 * per_token,
           f"counts must sum to T * k copies, got {int(nine.sum())} for T = 9")
    mlp(_hidden(4, seed=1))
    expect(int(_counts(mlp).sum()) == 4 * per_token, "counts must hold the last call's copies only")
    empty = mlp(_hidden(0))
    expect(empty.shape == (0, _HIDDEN), f"an empty batch must give [0, H], got {tuple(empty.shape)}")
    expect(int(_counts(mlp).sum()) == 0, "an empty batch routes nothing")


@SPARSE_MLP_SUITE.check
def check_tokens_routed_independently(factory: SparseMLPFactory) -> None:
    mlp = factory(_HIDDEN)
    hidden = _hidden(12, seed=2)
    whole = mlp(hidden)
    both = _counts(mlp)
    first = mlp(hidden[:5])
    head = _counts(mlp)
    mlp(hidden[5:])
    expect(torch.equal(both, head + _counts(mlp)), "a batch's counts must be the sum of its parts'")
    expect(torch.allclose(first, whole[:5], rtol=1e-4, atol=1e-5), "a token's output must not depend on its batch")


@SPARSE_MLP_SUITE.check
def check_padded_rows_computed_but_not_counted(factory: SparseMLPFactory) -> None:
    mlp = factory(_HIDDEN)
    hidden = _hidden(10, seed=3)
    real = torch.tensor([True, False, True, True, False, False, True, False, True, True])
    want = mlp(hidden)
    got = mlp(hidden, real)
    expect(torch.allclose(got, want, rtol=1e-5, atol=1e-6), "real_rows must not change any row's output")
    masked = _counts(mlp)
    mlp(hidden[real])
    expect(torch.equal(masked, _counts(mlp)),
           "with real_rows, the counts must be those of the real rows alone")
    mlp(hidden, torch.ones(10, dtype=torch.bool))
    all_real = _counts(mlp)
    mlp(hidden)
    expect(torch.equal(all_real, _counts(mlp)), "every row real must count as no mask")


@SPARSE_MLP_SUITE.check
def check_counts_rewritten_in_place(factory: SparseMLPFactory) -> None:
    mlp = factory(_HIDDEN)
    mlp(_hidden(6))
    first = mlp.last_expert_counts
    mlp(_hidden(7, seed=4), torch.ones(7, dtype=torch.bool))
    mlp(_hidden(3, seed=5))
    expect(mlp.last_expert_counts is first,
           "last_expert_counts must stay the same tensor, rewritten by each call")


@SPARSE_MLP_SUITE.check
def check_bad_real_rows_rejected(factory: SparseMLPFactory) -> None:
    mlp = factory(_HIDDEN)
    for bad in (torch.ones(4, dtype=torch.bool), torch.ones(5, dtype=torch.int64)):
        try:
            mlp(_hidden(5), bad)
        except ConfigError:
            continue
        expect(False, f"real_rows {tuple(bad.shape)} {bad.dtype} for 5 tokens must raise ConfigError")
