"""sample(): the tensor-level entry point, against the batch sampler it wraps."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sample import SamplingBatch, SamplingParams, VectorizedSampler, sample


def _logits(rows: int = 8, vocab: int = 500, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_per_row_tensors_draw_what_the_batch_sampler_draws() -> None:
    logits = _logits()
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.5, 1.0, 0.7, 1.2, 2.0])
    top_k = torch.tensor([0, 5, 0, 50, -1, 1, 400, 0])
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 0.95, 1.0, 0.3, 0.99])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.05, 0.0, 0.0, 0.2])
    seeds = torch.arange(8) * 1000 + 7
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    got = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                 seeds=seeds, positions=positions, impl="ref")  # fmt: skip
    params = [
        SamplingParams(temperature=float(t), top_k=int(k), top_p=float(p), min_p=float(m), seed=int(s))
        for t, k, p, m, s in zip(temperature, top_k, top_p, min_p, seeds)
    ]
    want = VectorizedSampler("ref")(logits, SamplingBatch.build(params, positions=positions.tolist()))
    assert got.shape == (8,) and got.dtype == torch.int64
    assert torch.equal(got, want.token_ids)
    assert int(got[0]) == int(logits[0].argmax())  # temperature 0 is greedy


def test_scalars_broadcast_like_repeated_tensors() -> None:
    logits = _logits(seed=1)
    seeds = list(range(8))
    scalar = sample(logits, temperature=0.8, top_k=40, top_p=0.9, min_p=0.01, seeds=seeds, impl="ref")
    rows = sample(logits, temperature=torch.full((8,), 0.8), top_k=torch.full((8,), 40),
                  top_p=[0.9] * 8, min_p=torch.tensor(0.01), seeds=torch.tensor(seeds), impl="ref")  # fmt: skip
    assert torch.equal(scalar, rows)


def test_seeded_rows_are_batch_invariant_and_unseeded_rows_use_the_generator() -> None:
    logits = _logits(rows=16, vocab=3000, seed=2)
    seeds: list[int | None] = [None] * 16
    seeds[9] = 123
    together = sample(logits, top_p=0.9, seeds=seeds, positions=4, generator=torch.Generator().manual_seed(5))
    alone = sample(logits[9:10], top_p=0.9, seeds=[123], positions=4)
    assert int(together[9]) == int(alone[0])
    again = sample(logits, top_p=0.9, seeds=seeds, positions=4, generator=torch.Generator().manual_seed(5))
    assert torch.equal(together, again)
    steps = [int(sample(logits[9:10], top_p=0.9, seeds=[123], positions=[j])[0]) for j in range(10)]
    assert len(set(steps)) > 1  # the position keys the stream: successive steps differ


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": torch.ones(3)}, r"temperature must be a scalar or of shape \[8\], got shape \(3,\)"),
        ({"top_p": [0.9] * 7}, r"top_p must be a scalar or hold 8 values, got 7"),
        ({"top_p": torch.tensor([0.9] * 7 + [0.0])}, r"top_p must be in \(0, 1\], got 0.0 \(row 7\)"),
        ({"top_k": torch.full((8,), 2.5)}, r"top_k must be an int, got 2.5 \(row 0\)"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1.5 \(row 0\)"),
        ({"temperature": -1.0}, r"temperature must be >= 0, got -1.0 \(row 0\)"),
        ({"seeds": [1] * 8 + [2]}, r"seeds must be a scalar or hold 8 values, got 9"),
        ({"positions": -1}, r"positions must be ints >= 0, got -1 \(row 0\)"),
        ({"top_k": "5"}, r"top_k must be a number, a sequence or a tensor, got '5'"),
    ],
)
def test_bad_arguments_name_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        sample(_logits(), impl="ref", **kwargs)  # type: ignore[arg-type]


def test_bad_logits_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"logits must be a \[B, V\] tensor with V >= 1, got \(5,\)"):
        sample(torch.zeros(5))
    with pytest.raises(ConfigError, match="logits must be floating point, got dtype torch.int64"):
        sample(torch.zeros(2, 5, dtype=torch.int64))
