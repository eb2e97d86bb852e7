"""A draw on the Triton ops (the CUDA path) queues behind the forward without waiting for
it: no op of the sampler reads device memory on the host (on CUDA that would stall the
host until the forward is done), for every kind of row but the two that are host work by
design (penalties' histories, threshold sets of a k above 2047). Tokens equal the naive
sampler's. (The torch reference ops, the CPU path, read the host where it is free.)"""

from __future__ import annotations

import random

import attrs
import pytest
import torch

from host_reads import no_host_reads

from deepinfer_kit.sample import NaiveSampler, SamplingParams, VectorizedSampler
from deepinfer_kit.testing.sample import make_batch


def _rows(seed: int) -> list[SamplingParams]:
    rng = random.Random(seed)
    kinds = [
        lambda: SamplingParams(temperature=0.0),
        lambda: SamplingParams(temperature=0.8),
        lambda: SamplingParams(temperature=0.7, top_p=0.8),
        lambda: SamplingParams(temperature=1.0, top_k=rng.choice([2, 40, 50, 100])),
        lambda: SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),
        lambda: SamplingParams(temperature=1.3, min_p=0.1),
        lambda: SamplingParams(temperature=1.0, top_k=5, logprobs=3),
    ]
    rows = [rng.choice(kinds)() for _ in range(24)]
    return [attrs.evolve(p, seed=rng.randrange(99)) for p in rows]  # seeded: the naive sampler draws alike


@pytest.mark.triton
@pytest.mark.parametrize("ties", [False, True])
def test_a_draw_reads_nothing_back(ties: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(24, 300, generator=gen) * 3
    if ties:  # few distinct values: the top-k cut falls inside a run of ties
        logits = torch.round(logits)
    params = _rows(int(ties))
    batch = make_batch(params, positions=list(range(24)))
    with no_host_reads():
        got = VectorizedSampler("triton")(logits, batch)
    want = NaiveSampler()(logits, make_batch(params, positions=list(range(24))))
    assert torch.equal(got.token_ids, want.token_ids)


@pytest.mark.triton
def test_a_top_k_cut_inside_a_run_of_ties_keeps_the_lowest_ids_without_reading_back() -> None:
    logits = torch.tensor([[3.0] + [2.0] * 200 + [0.0] * 50] * 120)
    params = [SamplingParams(top_k=50, temperature=100.0, seed=s) for s in range(120)]
    with no_host_reads():
        drawn = VectorizedSampler("triton")(logits, make_batch(params)).token_ids
    tokens = drawn.tolist()
    assert max(tokens) < 50 and len(set(tokens)) > 30  # ties ranked by token id: the lowest 49 kept
