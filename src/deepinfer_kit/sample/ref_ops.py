"""Torch reference ops of the sampler's hot path: row normalizers, the inverse-CDF draw over
the whole vocabulary, and top-k / top-p / min-p filtering plus the draw over a candidate set.

They are the spec and the test oracle of the Triton kernels in ``triton_ops.py`` (same
signatures). Shape symbols: ``n`` rows handled by one call, ``N`` rows of the logits,
``V`` vocabulary, ``W`` candidates per row.

Weights are ``w = exp((x - max) / T)`` (so the top token has ``w = 1`` and no row is ever
normalized to NaN); all cumulative sums are float64. Full rows are summed in blocks of
``BLOCK`` tokens so a row's arithmetic does not depend on how many rows share the call.
"""

from __future__ import annotations

import torch

from deepinfer_kit.sample.blocked import BLOCK, blocked_reduce
from deepinfer_kit.sample.ref_nucleus import BINS_PER_NAT, nucleus_draw

__all__ = ["BLOCK", "blocked_reduce", "row_norm", "full_draw", "candidate_draw", "nucleus_draw", "BINS_PER_NAT"]


def _weights(x: torch.Tensor, rows: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
    """``[n, V]`` float32 ``exp((x[rows] - rowmax) * inv_t)``; an all ``-inf`` row gives 0s."""
    w = x[rows]
    top = w.amax(dim=-1, keepdim=True)
    w.sub_(torch.where(torch.isneginf(top), torch.zeros_like(top), top))
    if bool((inv_t != 1.0).any()):
        w.mul_(inv_t.unsqueeze(1))
    return w.exp_()


def _block_sums(w: torch.Tensor) -> torch.Tensor:
    """``[n, ceil(V / BLOCK)]`` float64 sums of consecutive ``BLOCK``-token slices of ``w``."""
    return blocked_reduce(w, BLOCK, "sum").double()


def row_norm(x: torch.Tensor, rows: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
    """Sum of the weights of each selected row: the softmax denominator at temperature.

    Args:
        x: ``[N, V]`` float32 logits (after penalties), contiguous; read only.
        rows: ``[n]`` int64 row indices into ``x``.
        inv_t: ``[n]`` float32 ``1 / temperature``.

    Returns:
        ``[n]`` float64 ``Z = sum_v exp((x[r, v] - max_v x[r]) * inv_t)`` (``>= 1`` unless
        the row is all ``-inf``, then 0).
    """
    return _block_sums(_weights(x, rows, inv_t)).sum(dim=-1)


def full_draw(
    x: torch.Tensor,
    rows: torch.Tensor,
    inv_t: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """Draw one token per row from the whole vocabulary by inverse CDF in vocabulary order.

    Token ``v`` has weight ``w_v`` (zero when ``w_v < min_p``, the min-p filter); the token
    drawn is the first ``v`` whose cumulative weight exceeds ``u * sum(w)``. No sort.

    Args:
        x: ``[N, V]`` float32 logits (after penalties), contiguous; read only.
        rows: ``[n]`` int64 row indices into ``x``.
        inv_t: ``[n]`` float32 ``1 / temperature``.
        min_p: ``[n]`` float32 in ``[0, 1]``.
        u: ``[n]`` float64 uniforms in ``[0, 1)``.

    Returns:
        ``[n]`` int64 tokens; ``0`` for an all ``-inf`` row (the argmax).
    """
    n, vocab = rows.shape[0], x.shape[1]
    w = _weights(x, rows, inv_t)
    if bool((min_p > 0).any()):
        w.masked_fill_(w < min_p.unsqueeze(1), 0.0)
    cum_blocks = torch.cumsum(_block_sums(w), dim=-1)
    total = cum_blocks[:, -1]
    target = u * total
    nblocks = cum_blocks.shape[1]
    block = torch.searchsorted(cum_blocks, target.unsqueeze(1), right=True).squeeze(1)
    block = block.clamp_(max=nblocks - 1)
    before = cum_blocks.gather(1, (block - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    before = torch.where(block > 0, before, torch.zeros_like(before))
    offs = torch.arange(min(BLOCK, vocab), device=x.device)
    cols = block.unsqueeze(1) * BLOCK + offs
    inside = cols < vocab
    wb = w.gather(1, cols.clamp(max=vocab - 1)).masked_fill_(~inside, 0.0)
    inner = torch.cumsum(wb.double(), dim=-1)
    j = torch.searchsorted(inner, (target - before).unsqueeze(1), right=True).squeeze(1)
    last = torch.where(wb > 0, offs, torch.full_like(offs, -1)).amax(dim=-1)
    j = torch.minimum(j, last)
    tokens = block * BLOCK + j
    empty = total <= 0
    return torch.where(empty, torch.zeros_like(tokens), tokens) if n else tokens


def candidate_draw(
    vals: torch.Tensor,
    idx: torch.Tensor,
    inv_t: torch.Tensor,
    k: torch.Tensor,
    p: torch.Tensor,
    min_p: torch.Tensor,
    z: torch.Tensor,
    u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, then top-p, then min-p over sorted candidates, then the inverse-CDF draw.

    Candidates come sorted by logit, highest first (ties by token id), with ``vals[:, 0]``
    the row's maximum. With ``w_j = exp((vals_j - vals_0) * inv_t)`` and ``S_j`` the
    inclusive prefix sum of ``w`` over the first ``min(k, W)`` candidates:

    * top-k keeps positions ``j < k``;
    * top-p keeps ``j`` while ``S_{j-1} < p * Z``, where ``Z = z`` when ``z > 0`` (the
      whole row's weight: top-p without top-k) else ``S_{k-1}`` (renormalized top-k);
    * min-p keeps ``w_j >= min_p`` (``p_j >= min_p * p_max``);
    * the token is the first kept ``j`` whose cumulative kept weight exceeds ``u * total``.

    Args:
        vals: ``[n, W]`` float32 candidate logits, sorted as above (``-inf`` padding last).
        idx: ``[n, W]`` int64 their token ids.
        inv_t: ``[n]`` float32 ``1 / temperature``.
        k: ``[n]`` int64 top-k (``>= W`` when top-k is off for the row).
        p: ``[n]`` float64 top-p in ``(0, 1]`` (``1`` is off).
        min_p: ``[n]`` float32 in ``[0, 1]``.
        z: ``[n]`` float64 whole-row weight for top-p-only rows, ``0`` otherwise.
        u: ``[n]`` float64 uniforms in ``[0, 1)``.

    Returns:
        ``(tokens [n] int64, kept [n] int64)``: ``kept`` is the number of candidates left
        with positive weight, ``0`` for an all ``-inf`` row (whose token is 0), and ``-1`` when top-p's mass
        was not reached inside the ``W`` candidates while ``k > W`` (the caller must give
        that row more candidates; its token is then meaningless).
    """
    width = vals.shape[1]
    top = vals[:, :1]
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    w = torch.exp((vals - top) * inv_t.unsqueeze(1))
    limit = torch.clamp(k, max=width)
    in_k = torch.arange(width, device=vals.device) < limit.unsqueeze(1)
    cum = torch.cumsum(torch.where(in_k, w, torch.zeros_like(w)).double(), dim=-1)
    last = (limit - 1).unsqueeze(1)
    norm = torch.where(z > 0, z, cum.gather(1, last).squeeze(1))
    use_p = p < 1.0
    below = ((cum < (p * norm).unsqueeze(1)) & in_k).sum(dim=-1)
    crossed = use_p & (below < limit)
    n_top = torch.where(crossed, below + 1, limit)
    good = ((w >= min_p.unsqueeze(1)) & (w > 0)).sum(dim=-1)
    kept = torch.minimum(n_top, good)
    end = (kept - 1).clamp(min=0).unsqueeze(1)
    target = u * cum.gather(1, end).squeeze(1)
    j = torch.searchsorted(cum, target.unsqueeze(1), right=True)
    tokens = idx.gather(1, torch.minimum(j, end)).squeeze(1)
    tokens = torch.where(kept > 0, tokens, torch.zeros_like(tokens))
    reached = crossed | ~use_p | (k <= width)
    return tokens, torch.where(reached, kept, torch.full_like(kept, -1))
