"""Torch reference ops of the moe package: routing rules and grouped SwiGLU experts.

These are the spec: the Triton kernel in ``triton_ops.py`` has the same signature and is
tested against them. Shape symbols: ``T`` tokens, ``H`` hidden, ``E`` experts, ``k`` top-k,
``I`` expert intermediate size, ``M`` token copies grouped by expert.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from deepinfer_kit.moe.local_dispatcher import sort_by_expert, unpermute_and_sum
from deepinfer_kit.moe.records import Routing

if TYPE_CHECKING:
    from deepinfer_kit.models.invariant import Numerics

__all__ = [
    "softmax_topk",
    "topk_softmax",
    "deepseek_v3_topk",
    "grouped_swiglu",
    "swiglu",
    "gather_swiglu_scatter",
    "routed_swiglu",
]


def softmax_topk(
    logits: torch.Tensor, top_k: int, *, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, keep the ``k`` largest (Mixtral, Qwen-MoE).

    Args:
        logits: ``[T, E]`` router logits (any float dtype; computed in float32).
        top_k: ``k``.
        renormalize: divide the kept weights by their sum.

    Returns:
        ``(expert_ids [T, k] int64, weights [T, k] float32)``, largest weight first.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the ``k`` largest logits, then a softmax over those ``k`` only (gpt-oss).

    Selects the same experts as :func:`softmax_topk` (softmax is monotone) and, up to
    rounding, the same weights as its renormalized form; this is the order transformers'
    ``GptOssTopKRouter`` computes in.

    Args:
        logits: ``[T, E]`` router logits (any float dtype; computed in float32).
        top_k: ``k``.

    Returns:
        ``(expert_ids [T, k] int64, weights [T, k] float32)``, largest weight first.
    """
    values, ids = torch.topk(logits.float(), top_k, dim=-1)
    return ids, torch.softmax(values, dim=-1)


def deepseek_v3_topk(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    *,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
    sigmoid: Callable[[torch.Tensor], torch.Tensor] = torch.sigmoid,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: biased, group-limited selection; unbiased combine weights.

    Scores are ``sigmoid(logits)``. Selection ranks ``scores + bias``; with ``n_group > 1``
    each group's score is the sum of its top-2 biased scores, only the ``topk_group`` best
    groups stay, and experts of the other groups are set to ``-inf`` (never 0: a 0 could
    still beat negative biased scores). The combine weights are the *unbiased* scores of the
    chosen experts, renormalized when asked, times ``scaling``.

    Args:
        logits: ``[T, E]`` router logits.
        bias: ``[E]`` float32 selection bias (``e_score_correction_bias``).
        top_k: ``k``.
        n_group: expert groups (``E`` divisible by it).
        topk_group: groups kept per token.
        renormalize: divide the chosen scores by their sum.
        scaling: ``routed_scaling_factor``.
        sigmoid: the scores' sigmoid (the batch-invariant mode's, ``models.invariant``).

    Returns:
        ``(expert_ids [T, k] int64, weights [T, k] float32)``.
    """
    scores = sigmoid(logits.float())
    choice = scores + bias.float()
    if n_group > 1:
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.topk(group_scores, topk_group, dim=-1).indices
        masked = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
        choice = grouped.masked_fill(masked.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


def _mm(x: torch.Tensor, weight: torch.Tensor, numerics: Numerics | None) -> torch.Tensor:
    """``x weight^T``: ``torch.mm`` by default, else through ``numerics.linear`` (the
    batch-invariant mode's padded product, ``models.invariant``)."""
    return torch.mm(x, weight.t()) if numerics is None else numerics.linear(x, weight, None)


def _silu(x: torch.Tensor, numerics: Numerics | None) -> torch.Tensor:
    """``silu(x)``: ``F.silu`` by default, else ``numerics.silu``."""
    return F.silu(x) if numerics is None else numerics.silu(x)


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
           numerics: Numerics | None = None) -> torch.Tensor:
    """One SwiGLU MLP: ``down(silu(x W_g^T) * (x W_u^T))``.

    Args:
        x: ``[N, H]``.
        gate_up: ``[2I, H]``, gate rows first, then up rows.
        down: ``[H, I]``.
        numerics: the matmul and activation (``None``: ``torch.mm`` and ``F.silu``).

    Returns:
        ``[N, H]`` in the dtype of ``x``.
    """
    inter = down.shape[1]
    h = _mm(x, gate_up, numerics)
    act = _silu(h[:, :inter], numerics).mul_(h[:, inter:])
    return _mm(act, down, numerics)


def grouped_swiglu(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts: Sequence[int],
    numerics: Numerics | None = None,
) -> torch.Tensor:
    """SwiGLU experts over expert-contiguous rows: rows of expert ``e`` use its weights.

    A loop over experts with rows; each runs two ``torch.mm`` on a contiguous slice, writing
    into one preallocated output (no per-expert concatenation).

    Args:
        x: ``[M, H]`` rows grouped by expert (expert 0's ``counts[0]`` rows first).
        gate_up: ``[E, 2I, H]`` gate and up weights of each expert.
        down: ``[E, H, I]`` down weights.
        counts: ``E`` host ints summing to ``M``.
        numerics: the matmul and activation (``None``: ``torch.mm`` and ``F.silu``; the
            batch-invariant ones make a row's output independent of how many rows share
            its expert).

    Returns:
        ``[M, H]`` expert outputs aligned with ``x`` (unweighted).
    """
    out = torch.empty(x.shape[0], down.shape[1], dtype=x.dtype, device=x.device)
    inter = down.shape[2]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        h = _mm(x[start:end], gate_up[expert], numerics)
        act = _silu(h[:, :inter], numerics).mul_(h[:, inter:])
        if numerics is None:
            torch.mm(act, down[expert].t(), out=out[start:end])
        else:
            out[start:end] = numerics.linear(act, down[expert], None)
        start = end
    return out


def gather_swiglu_scatter(
    hidden: torch.Tensor,
    token_index: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts: Sequence[int],
    numerics: Numerics | None = None,
) -> torch.Tensor:
    """Single-device routed experts without materializing the permuted copies.

    For each expert with rows: gather its tokens from ``hidden``, run its SwiGLU, scale by
    the combine weights and ``index_add_`` into the output. Each expert's block stays in
    cache between the gather, the two GEMMs and the scatter, which is what makes this the
    fast CPU path. Equals ``combine(grouped_swiglu(dispatch(hidden)))``.

    Args:
        hidden: ``[T, H]``.
        token_index: ``[M]`` int64, the token of each copy, grouped by expert.
        weights: ``[M]`` combine weight of each copy.
        gate_up: ``[E, 2I, H]``.
        down: ``[E, H, I]``.
        counts: ``E`` host ints summing to ``M``.
        numerics: the matmul and activation (``None``: ``torch.mm`` and ``F.silu``). A
            token's ``k`` copies are added in increasing expert order whatever the batch,
            so the sum is batch-invariant whenever these are.

    Returns:
        ``[T, H]`` in the weight dtype: ``sum_j w_tj E_{e_tj}(x_t)``.
    """
    x = hidden.to(gate_up.dtype)
    out = torch.zeros(x.shape[0], down.shape[1], dtype=x.dtype, device=x.device)
    inter = down.shape[2]
    w = weights.to(x.dtype).unsqueeze(1)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        rows = token_index[start:end]
        h = _mm(x.index_select(0, rows), gate_up[expert], numerics)
        act = _silu(h[:, :inter], numerics).mul_(h[:, inter:]).mul_(w[start:end])
        out.index_add_(0, rows, _mm(act, down[expert], numerics))
        start = end
    return out


def routed_swiglu(
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    numerics: Numerics | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed experts and their weighted combine: sort, host counts, gather-compute-scatter.

    The spec of ``triton_ops.routed_swiglu``: same arguments and result, except that
    ``counts`` come back on the host (one device sync, free on the CPU, where this is the
    fast path). Mutates nothing.

    Args:
        hidden: ``[T, H]``.
        expert_ids: ``[T, k]`` int64 ids in ``[0, E)``.
        weights: ``[T, k]`` combine weights.
        gate_up: ``[E, 2I, H]``.
        down: ``[E, H, I]``.
        numerics: as :func:`gather_swiglu_scatter`.

    Returns:
        ``(y [T, H] in the weight dtype, counts [E] int64 on the host)``.

    Raises:
        ConfigError: an id outside ``[0, E)``.
    """
    order, counts = sort_by_expert(Routing(expert_ids=expert_ids, weights=weights), gate_up.shape[0])
    top_k = expert_ids.shape[1]
    if numerics is not None and numerics.invariant:
        # each copy's output, then the routing-order sum the dispatchers' combine takes: the
        # same bits on one device, with replicas, or with the experts split over ranks
        rows = grouped_swiglu(hidden.to(gate_up.dtype).index_select(0, order // top_k), gate_up, down,
                              counts.tolist(), numerics)
        return unpermute_and_sum(rows, order, weights), counts
    out = gather_swiglu_scatter(
        hidden, order // top_k, weights.reshape(-1).index_select(0, order), gate_up, down, counts.tolist(),
        numerics,
    )
    return out, counts
