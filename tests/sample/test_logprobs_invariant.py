"""Logprobs are batch-invariant: ``row_logsumexp`` gives a row bitwise the same value alone
or among other rows at any place (torch.logsumexp's CUDA reduction follows the row count),
close to the float64 log-sum-exp, 0 for an all ``-inf`` row; attach_logprobs uses it."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kit.sample.logprobs import attach_logprobs, row_logsumexp
from deepinfer_kit.sample.records import SampleResult


def _logits(device: str, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(40, vocab, generator=gen) * 4
    x[3, ::3] = float("-inf")
    return x.to(device)


def _check_rows_alone_and_together(device: str, vocab: int) -> None:
    x = _logits(device, vocab)
    together = row_logsumexp(x)
    for i in (0, 3, 17, 39):
        assert torch.equal(row_logsumexp(x[i : i + 1]), together[i : i + 1]), i
        assert torch.equal(row_logsumexp(x[: i + 1])[i], together[i]), i
    want = torch.logsumexp(x.double(), dim=-1)
    assert torch.allclose(together.double(), want, rtol=0, atol=4e-6)


@pytest.mark.parametrize("vocab", [7, 1024, 5000, 151936])
def test_a_row_is_the_same_alone_or_in_a_batch(vocab: int) -> None:
    _check_rows_alone_and_together("cpu", vocab)


def test_an_all_minus_inf_row() -> None:
    x = torch.full((2, 50), float("-inf"))
    x[1, 4] = 0.0
    assert row_logsumexp(x).tolist() == [0.0, 0.0]
    result = SampleResult(token_ids=torch.tensor([0, 4]))
    attach_logprobs(result, x, 2)
    assert result.logprobs is not None and result.logprobs.tolist() == [float("-inf"), 0.0]


@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [7, 5000, 151936])
def test_on_cuda_a_row_is_the_same_alone_or_in_a_batch(vocab: int) -> None:
    _check_rows_alone_and_together("cuda", vocab)
