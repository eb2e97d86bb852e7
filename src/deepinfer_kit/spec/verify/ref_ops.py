"""Torch reference ops of verification: greedy accept-while-equal, the strict
rejection-sampling step and the random streams they draw from. They are the spec the
Triton kernels of ``triton_ops.py`` reproduce (same signatures).

Shape symbols: ``R`` requests, ``G`` draft width (``γ``), ``V`` vocabulary, ``n`` rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer_kit.sample.rng import mix64, row_uniforms

__all__ = ["accept_uniforms", "inverse_cdf", "greedy_verify", "rejection_sample"]

_ACCEPT_SALT = 0x632BE59BD9B4E019  # separates the acceptance stream from the sampler's


def accept_uniforms(
    seeds: Sequence[int | None],
    positions: Sequence[int],
    generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """``[n]`` float64 in ``[0, 1)``: the acceptance test's uniform for each row.

    A stream of its own, independent of the draw's (``sample.rng.row_uniforms``, which a
    recovered or bonus token uses so that it matches plain sampling): seeded rows use
    ``seeded_uniform(mix64(seed ^ salt) >> 1, position)`` (batch-invariant); unseeded rows
    consume one double each from ``generator``.
    """
    keyed = [None if s is None else mix64(s ^ _ACCEPT_SALT) >> 1 for s in seeds]
    return row_uniforms(keyed, positions, generator, device)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of non-negative ``weights [n, V]`` (unnormalised) with
    uniforms ``u [n]``: the first token whose cumulative weight exceeds ``u * total``.

    The result is always a token with positive weight (so ``< V``), whatever the rounding
    of the cumulative sum; a row of zeros gives token 0.

    Returns:
        ``[n]`` int64.
    """
    vocab = weights.shape[1]
    cum = torch.cumsum(weights.double(), dim=1)
    target = (u.double() * cum[:, -1]).unsqueeze(1)
    tok = torch.searchsorted(cum, target, right=True).squeeze(1)
    cols = torch.arange(vocab, device=weights.device)
    last = torch.where(weights > 0, cols, torch.full_like(cols, -1)).amax(dim=1)
    first = torch.where(weights > 0, cols, torch.full_like(cols, vocab)).amin(dim=1)
    tok = torch.minimum(torch.maximum(tok, first), last)
    return tok.clamp(min=0)


def rejection_sample(
    target: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    lengths: torch.Tensor,
    u_accept: torch.Tensor,
    u_draw: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Strict speculative rejection sampling of ``R`` requests at once.

    Draft ``j < lengths[r]`` is accepted when ``u_accept[r, j] * p_d(d_j) < p_t(d_j)``
    (probability ``min(1, p_t / p_d)``), while every earlier one was. At the first
    rejection ``j`` the token is drawn from ``normalise(max(0, p_t[j] - p_d[j]))`` (from
    ``p_t[j]`` if that is all zero, which exact arithmetic rules out); when all
    ``lengths[r]`` drafts are accepted, a bonus token is drawn from ``p_t[lengths[r]]``.
    Both draws use ``u_draw[r, j]`` at the row ``j`` drawn from. The emitted tokens then
    follow the target distribution exactly, whatever the draft distribution.

    Args:
        target: ``[R, G + 1, V]`` float64 target probabilities ``p_t`` per position.
        draft_probs: ``[R, G, V]`` float64 draft probabilities ``p_d``.
        draft_ids: ``[R, G]`` int64 drafted tokens (each drawn from ``p_d``).
        lengths: ``[R]`` int64 drafts verified, in ``[0, G]``.
        u_accept: ``[R, G]`` float64 uniforms of the acceptance tests.
        u_draw: ``[R, G + 1]`` float64 uniforms of the recovered / bonus draw.

    Returns:
        ``(num_accepted [R] int64 in [0, lengths], token [R] int64 in [0, V))``.
    """
    num_req, width = draft_ids.shape
    vocab = target.shape[2]
    dev = target.device
    if width:
        pt_d = target[:, :width].gather(2, draft_ids.unsqueeze(2)).squeeze(2)
        pd_d = draft_probs.gather(2, draft_ids.unsqueeze(2)).squeeze(2)
        ok = (u_accept * pd_d < pt_d) & (torch.arange(width, device=dev) < lengths.unsqueeze(1))
        num_acc = torch.cumprod(ok.to(torch.int64), dim=1).sum(dim=1)
    else:
        num_acc = torch.zeros(num_req, dtype=torch.int64, device=dev)
    at = num_acc.view(num_req, 1, 1).expand(num_req, 1, vocab)
    p_t = target.gather(1, at).squeeze(1)
    dist = p_t
    if width:
        p_d = draft_probs.gather(1, at.clamp(max=width - 1)).squeeze(1)
        rejected = (num_acc < lengths).unsqueeze(1)
        residual = torch.clamp(p_t - p_d, min=0.0)
        empty = (residual.sum(dim=1, keepdim=True) <= 0) | ~rejected
        dist = torch.where(empty, p_t, residual)
    u = u_draw.gather(1, num_acc.unsqueeze(1)).squeeze(1)
    return num_acc, inverse_cdf(dist, u)


def greedy_verify(
    logits: torch.Tensor,
    offsets: torch.Tensor,
    draft_ids: torch.Tensor,
    lengths: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of ``R`` requests at once: draft ``j < lengths[r]`` is accepted
    while it equals the argmax (lowest id on ties) of its row and every earlier one was;
    then the argmax of the first mismatching row (or of the bonus row) is emitted.

    Args:
        logits: ``[M, V]`` float32 target logits (after penalties), request-major: request
            ``r`` owns rows ``offsets[r] .. offsets[r] + lengths[r]``.
        offsets: ``[R]`` int64 first row of each request.
        draft_ids: ``[R, G]`` int64 drafted tokens (entries past ``lengths[r]`` ignored).
        lengths: ``[R]`` int64 drafts verified, in ``[0, G]``.

    Returns:
        ``(num_accepted [R] int64 in [0, lengths], token [R] int64 in [0, V))``.
    """
    top = logits.argmax(dim=-1)
    num_req, width = draft_ids.shape
    if width:
        cols = torch.arange(width, device=logits.device)
        at = offsets.unsqueeze(1) + torch.minimum(cols.unsqueeze(0), lengths.unsqueeze(1))
        ok = (top[at] == draft_ids) & (cols < lengths.unsqueeze(1))
        num_acc = torch.cumprod(ok.to(torch.int64), dim=1).sum(dim=1)
    else:
        num_acc = torch.zeros(num_req, dtype=torch.int64, device=logits.device)
    return num_acc, top[offsets + num_acc]
