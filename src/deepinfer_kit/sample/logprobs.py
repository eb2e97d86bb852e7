"""Logprobs of the drawn tokens under the model's raw distribution, and the top-K alternatives."""

from __future__ import annotations

import torch

from deepinfer_kit.sample.records import SampleResult

__all__ = ["attach_logprobs"]


def attach_logprobs(result: SampleResult, raw: torch.Tensor, num_top: int) -> None:
    """Fill ``result``'s logprob fields from the raw logits (before any penalty or filter).

    ``logprob = raw[token] - logsumexp(raw)``; ``rank = 1 + #{v : raw[v] > raw[token]}``
    (ties share the better rank); the top ``K = min(num_top, V)`` tokens come sorted by
    logprob, highest first. A row whose logits are all ``-inf`` reports ``-inf``, never NaN.

    Args:
        result: ``token_ids`` ``[N]`` already set; its other fields are overwritten.
        raw: ``[N, V]`` float32 raw logits.
        num_top: ``K >= 0``, the largest ``logprobs`` any row asked for.
    """
    lse = torch.logsumexp(raw, dim=-1)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    chosen = raw.gather(1, result.token_ids.unsqueeze(1)).squeeze(1)
    result.logprobs = chosen - lse
    result.ranks = (raw > chosen.unsqueeze(1)).sum(dim=-1) + 1
    top = min(num_top, raw.shape[1])
    values, ids = torch.topk(raw, top, dim=-1, sorted=True)
    result.top_token_ids = ids
    result.top_logprobs = values - lse.unsqueeze(1)
