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

from typing import Literal

import torch

__all__ = ["BLOCK", "blocked_reduce", "row_norm", "full_draw", "candidate_draw", "nucleus_draw", "BINS_PER_NAT"]

BLOCK = 1024
"""Tokens per block of the blocked row sums (and of the Triton kernels' chunks)."""


def _weights(x: torch.Tensor, rows: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
    """``[n, V]`` float32 ``exp((x[rows] - rowmax) * inv_t)``; an all ``-inf`` row gives 0s."""
    w = x[rows]
    top = w.amax(dim=-1, keepdim=True)
    w.sub_(torch.where(torch.isneginf(top), torch.zeros_like(top), top))
    if bool((inv_t != 1.0).any()):
        w.mul_(inv_t.unsqueeze(1))
    return w.exp_()


def blocked_reduce(t: torch.Tensor, block: int, how: Literal["sum", "amax"]) -> torch.Tensor:
    """``[n, ceil(V / block)]`` sums or maxima of consecutive ``block``-token slices of
    ``t [n, V]`` (the last slice may be shorter); each slice is reduced on its own, so the
    result for a row does not depend on the other rows."""
    n, vocab = t.shape
    full = vocab // block
    parts = []
    if full:
        parts.append(getattr(t[:, : full * block].reshape(n, full, block), how)(dim=-1))
    if vocab > full * block:
        parts.append(getattr(t[:, full * block :], how)(dim=-1, keepdim=True))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


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





BINS_PER_NAT = 256
"""Resolution of the log-weight histogram of :func:`nucleus_draw` (bins per unit of
``log w``)."""
_NBINS = 104 * BINS_PER_NAT + 1  # float32 weights below e^-104 are 0: the last bin is dead
_NUCLEUS_ROWS = 16  # rows per slice of nucleus_draw (bounds its [rows, V] temporaries)


def _settle(
    xr: torch.Tensor, w: torch.Tensor, bins: torch.Tensor, cum: torch.Tensor,
    target: torch.Tensor, strict: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first token, in canonical order, whose running weight reaches ``target``.

    The bin comes from the cumulative bin weights ``cum`` (the last bin with weight when
    the row falls short); only that bin's tokens are then put in canonical order (stable
    sort by logit of the tokens taken in id order) and summed one by one.

    Returns:
        ``(bin [n], ids [n, C] int64, run [n, C] float64, j [n])``: the bin's tokens in
        canonical order (padded with weight 0), the running weight through each of them
        (bins before included), and the position of the crossing token.
    """
    n = cum.shape[0]
    goal = target.unsqueeze(1).contiguous()
    last = torch.searchsorted(cum, cum[:, -1:].contiguous()).squeeze(1)  # last bin with weight
    b = torch.minimum(torch.searchsorted(cum, goal, right=strict).squeeze(1), last)
    before = cum.gather(1, (b - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    before = torch.where(b > 0, before, torch.zeros_like(before))
    member = (bins == b.unsqueeze(1)) & (w > 0)
    hit_row, hit_col = member.nonzero(as_tuple=True)
    sizes = torch.bincount(hit_row, minlength=n)
    width = max(int(sizes.max()) if n else 0, 1)
    slot = torch.arange(hit_row.shape[0], device=w.device) - (torch.cumsum(sizes, 0) - sizes)[hit_row]
    vals = torch.full((n, width), float("-inf"), dtype=xr.dtype, device=w.device)
    ids = torch.zeros((n, width), dtype=torch.int64, device=w.device)
    ww = torch.zeros((n, width), dtype=torch.float64, device=w.device)
    vals[hit_row, slot], ids[hit_row, slot] = xr[hit_row, hit_col], hit_col
    ww[hit_row, slot] = w[hit_row, hit_col].double()
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    ids, run = ids.gather(1, order), before.unsqueeze(1) + torch.cumsum(ww.gather(1, order), dim=-1)
    j = torch.searchsorted(run, goal, right=strict).squeeze(1)
    return b, ids, run, torch.minimum(j, (sizes - 1).clamp(min=0))


def nucleus_draw(
    x: torch.Tensor,
    rows: torch.Tensor,
    inv_t: torch.Tensor,
    p: torch.Tensor,
    min_p: torch.Tensor,
    z: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """Top-p, then min-p, then the draw over whole rows without sorting them: a cost that
    does not grow with the nucleus.

    Draws what :func:`candidate_draw` draws over the row's full canonical order with
    top-k off (up to float rounding at a boundary): the nucleus is the canonical prefix
    ending at the first token whose running weight reaches ``p * z``, cut to the tokens
    with ``w >= min_p``; the token is the first of the nucleus whose running weight
    exceeds ``u`` times the nucleus weight. One pass bins every token by its log-weight
    ``(x - max) * inv_t`` (:data:`BINS_PER_NAT` bins per unit; bins follow the canonical
    order, ties share a bin) and sums the weight per bin in float64; each of the two
    crossings (the top-p cut, then the draw) then reads the bin holding it off the
    cumulative bin weights and sorts only that bin's tokens, so ties keep the id rule.
    The work is a few passes over the row plus sorts of one bin (its size depends on how
    dense the logits are at the crossing, not on the nucleus width). Rows are handled
    each on its own (in slices of 16), so a row's token never depends on the others.

    Args:
        x: ``[N, V]`` float32 logits (after penalties), contiguous; read only.
        rows: ``[n]`` int64 row indices into ``x``.
        inv_t: ``[n]`` float32 ``1 / temperature``.
        p: ``[n]`` float64 top-p in ``(0, 1]``.
        min_p: ``[n]`` float32 in ``[0, 1]``.
        z: ``[n]`` float64 :func:`row_norm` of the rows.
        u: ``[n]`` float64 uniforms in ``[0, 1)``.

    Returns:
        ``[n]`` int64 tokens; ``0`` for an all ``-inf`` row.
    """
    out = [torch.zeros(0, dtype=torch.int64, device=x.device)]
    for lo in range(0, rows.shape[0], _NUCLEUS_ROWS):
        part = slice(lo, lo + _NUCLEUS_ROWS)
        xr = x[rows[part]]
        n = xr.shape[0]
        top = xr.amax(dim=-1, keepdim=True)
        d = (xr - torch.where(torch.isneginf(top), torch.zeros_like(top), top)) * inv_t[part].unsqueeze(1)
        bins = (d * -float(BINS_PER_NAT)).clamp_(max=_NBINS - 1).long()
        w = d.exp_()
        w.masked_fill_(w < min_p[part].unsqueeze(1), 0.0)
        base = torch.arange(n, device=x.device).unsqueeze(1) * _NBINS
        hist = torch.bincount((base + bins).flatten(), w.flatten().double(), minlength=n * _NBINS)
        cum = hist.view(n, _NBINS).cumsum(dim=-1)
        b, _, run, j = _settle(xr, w, bins, cum, p[part] * z[part], strict=False)
        mass = run.gather(1, j.unsqueeze(1)).squeeze(1)
        cut_bins = torch.arange(_NBINS, device=x.device).unsqueeze(0)
        cum = torch.where(cut_bins < b.unsqueeze(1), cum, mass.unsqueeze(1))
        b2, ids, run, j2 = _settle(xr, w, bins, cum, u[part] * mass, strict=True)
        j2 = torch.where(b2 == b, torch.minimum(j2, j), j2)
        tokens = ids.gather(1, j2.unsqueeze(1)).squeeze(1)
        out.append(torch.where(mass > 0, tokens, torch.zeros_like(tokens)))
    return torch.cat(out)
