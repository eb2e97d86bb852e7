"""Conformance suite for Sampler."""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.protocols import Sampler
from deepinfer_kit.sample.records import SamplingBatch
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["SamplerFactory", "SAMPLER_SUITE", "make_batch"]

SamplerFactory = Callable[[], Sampler]
"""``factory()`` -> a sampler (CPU tensors are used by the checks)."""

SAMPLER_SUITE: Suite[SamplerFactory] = Suite("Sampler", "factory() -> Sampler")


def make_batch(params: list[SamplingParams], *, seeds: list[int | None] | None = None) -> SamplingBatch:
    """A batch of fresh rows (no history) with the given parameters."""
    n = len(params)
    return SamplingBatch(
        params=params,
        seeds=seeds if seeds is not None else [p.seed for p in params],
        positions=[0] * n,
        prompt_token_ids=[[] for _ in range(n)],
        output_token_ids=[[] for _ in range(n)],
        eos_token_ids=[None] * n,
    )


@SAMPLER_SUITE.check
def check_greedy_is_argmax(factory: SamplerFactory) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    result = factory()(logits, make_batch([SamplingParams(temperature=0.0)] * 6))
    expect(result.token_ids.shape == (6,), f"token_ids shape: got {tuple(result.token_ids.shape)}")
    expect(result.token_ids.dtype == torch.int64, f"token_ids dtype: got {result.token_ids.dtype}")
    expect(
        torch.equal(result.token_ids, logits.argmax(dim=-1)),
        "greedy rows must return the argmax",
    )
