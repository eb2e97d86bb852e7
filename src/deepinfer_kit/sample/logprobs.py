"""Logprobs of the drawn tokens under the model's raw distribution, and the top-K alternatives."""

from __future__ import annotations

import torch

from deepinfer_kit.sample.blocked import BLOCK, blocked_reduce
from deepinfer_kit.sample.records import SampleResult

__all__ = ["attach_logprobs", "row_logsumexp"]


def row_logsumexp(raw: torch.Tensor) -> torch.Tensor:
    """``[N]`` float32 ``logsumexp`` of each row of ``raw``, batch-invariant: a row's value
    is bitwise the same whatever other rows share the call.

    ``torch.logsumexp`` is not: its reduction kernel (CUDA) or thread split (CPU, one row
    over 32768 elements) follows the number of rows, which moved logprobs by ~1e-6 between a
    request alone and in a batch on a GPU. Here the row's maximum (exact in any order) plus
    the log of the sampler's softmax denominator ``Z = sum exp(x - max)``, summed in float64
    by a fixed per-row order: the sampler's Triton ``row_norm`` (one program per row) on
    CUDA, its torch reference (fixed blocks of ``BLOCK`` tokens) elsewhere. The kernel
    follows the tensor's device, so a CPU tensor never reaches a compiled kernel. A row of
    all ``-inf`` gives 0 (so its logprobs stay ``-inf``, never NaN). Mutates nothing.

    Args:
        raw: ``[N, V]`` float32 logits, any device.
    """
    x = raw.contiguous()
    top = x.amax(dim=-1)
    if x.is_cuda:
        from deepinfer_kit.sample import triton_ops

        num = x.shape[0]
        z = triton_ops.row_norm(x, torch.arange(num, device=x.device),
                                torch.ones(num, dtype=torch.float32, device=x.device))
    else:  # ref_ops.row_norm at temperature 1, without its host read of the temperatures
        shift = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
        z = blocked_reduce(torch.exp(x - shift[:, None]), BLOCK, "sum").double().sum(dim=-1)
    lse = (top.double() + torch.log(z)).to(torch.float32)
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def attach_logprobs(result: SampleResult, raw: torch.Tensor, num_top: int) -> None:
    """Fill ``result``'s logprob fields from the raw logits (before any penalty or filter).

    ``logprob = raw[token] - logsumexp(raw)`` (:func:`row_logsumexp`, batch-invariant); ``rank = 1 + #{v : raw[v] > raw[token]}``
    (ties share the better rank); the top ``K = min(num_top, V)`` tokens come sorted by
    logprob, highest first. A row whose logits are all ``-inf`` reports ``-inf``, never NaN.

    Args:
        result: ``token_ids`` ``[N]`` already set; its other fields are overwritten.
        raw: ``[N, V]`` float32 raw logits.
        num_top: ``K >= 0``, the largest ``logprobs`` any row asked for.
    """
    lse = row_logsumexp(raw)
    chosen = raw.gather(1, result.token_ids.unsqueeze(1)).squeeze(1)
    result.logprobs = chosen - lse
    result.ranks = (raw > chosen.unsqueeze(1)).sum(dim=-1) + 1
    top = min(num_top, raw.shape[1])
    values, ids = torch.topk(raw, top, dim=-1, sorted=True)
    result.top_token_ids = ids
    result.top_logprobs = values - lse.unsqueeze(1)
