"""Candidate sets for top-k / top-p rows, sorted by logit (highest first, ties by token id).

Three ways to get them, cheapest first:

* :func:`topk_candidates` — ``torch.topk`` of a fixed width ``W``: a partial selection,
  never a sort of the vocabulary. Exact for the prefix of candidates whose logit is
  strictly above the ``W``-th largest (ties at the ``W``-th value may be cut arbitrarily).
* :func:`threshold_candidates` — a value-closed upper set ``{x >= tau}`` (every token at
  least as likely as a member is a member), with ``tau`` read off a strided subsample so
  the set should hold ``k`` tokens. One compare pass over the row and a sort of the
  members only; the caller verifies the set was big enough.
* :func:`sorted_candidates` — a stable sort of the whole row (the last resort).
"""

from __future__ import annotations

import torch

from deepinfer_kit.sample.blocked import blocked_reduce

__all__ = [
    "SUBSAMPLE_STRIDE",
    "TOPK_BLOCK",
    "block_maxima",
    "topk_candidates",
    "threshold_candidates",
    "sorted_candidates",
    "settle_ties",
]

SUBSAMPLE_STRIDE = 8
"""Every this-many-th token sizes a threshold set (see :func:`threshold_candidates`)."""
TOPK_BLOCK = 64
"""Tokens per block of :func:`block_maxima` (the pre-selection of :func:`topk_candidates`)."""


def _canonical(vals: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort candidates by value descending, ties by ascending token id."""
    by_id = torch.argsort(idx, dim=-1)
    vals, idx = vals.gather(1, by_id), idx.gather(1, by_id)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return vals.gather(1, order), idx.gather(1, order)


def block_maxima(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The largest logit of every ``TOPK_BLOCK``-token block of the selected rows.

    Reads ``x`` once (all ``N`` rows, no copy) when the rows are at least a quarter of the
    batch, else copies just those rows.

    Args:
        x: ``[N, V]`` float32, contiguous; read only.
        rows: ``[n]`` int64 row indices.

    Returns:
        ``[n, ceil(V / TOPK_BLOCK)]`` float32.
    """
    if 4 * rows.shape[0] >= x.shape[0]:
        return blocked_reduce(x, TOPK_BLOCK, "amax")[rows]
    return blocked_reduce(x[rows], TOPK_BLOCK, "amax")


def topk_candidates(
    x: torch.Tensor, rows: torch.Tensor, width: int, maxima: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``width`` largest logits of each selected row, in canonical order.

    With ``maxima`` (:func:`block_maxima` of the same rows), only the ``width`` blocks with
    the largest maxima are searched: every token above the ``width``-th largest value lives
    in one of them, and each of them holds a token at least that large, so the values
    returned are exactly the row's top ``width`` (ties at the last value may be cut
    arbitrarily, as with ``torch.topk``).

    Args:
        x: ``[N, V]`` float32; read only.
        rows: ``[n]`` int64 row indices.
        width: ``W`` with ``1 <= W <= V``.
        maxima: optional ``[n, ceil(V / TOPK_BLOCK)]`` block maxima of ``rows``.

    Returns:
        ``(vals [n, W] float32, idx [n, W] int64)``.
    """
    vocab = x.shape[1]
    if maxima is None or width * TOPK_BLOCK >= vocab:
        vals, idx = torch.topk(x[rows], width, dim=-1, sorted=False)
        return _canonical(vals, idx)
    blocks = torch.topk(maxima, width, dim=-1, sorted=False).indices
    cols = (blocks.unsqueeze(2) * TOPK_BLOCK + torch.arange(TOPK_BLOCK, device=x.device)).flatten(1)
    inside = cols < vocab
    cols = cols.clamp_(max=vocab - 1)
    pool = x[rows.unsqueeze(1), cols].masked_fill_(~inside, float("-inf"))
    vals, pick = torch.topk(pool, width, dim=-1, sorted=False)
    return _canonical(vals, cols.gather(1, pick))


def settle_ties(x: torch.Tensor, rows: torch.Tensor, vals: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The ids of :func:`topk_candidates`' ``W`` candidates in exact canonical order.

    Every token above the last candidate value ``c = vals[:, -1]`` is a candidate, but
    ``torch.topk`` keeps an arbitrary subset of the tokens equal to ``c``, while canonical
    order ranks ties by token id: the run of candidates equal to ``c`` (the last ones,
    ``vals`` being sorted) gets the lowest ids of the whole row that hold ``c``. Fixed
    shapes, no host read (the draw can be queued behind a forward without waiting for
    it, and captured): one comparison and one prefix count over the selected rows.

    Args:
        x: ``[N, V]`` float32, the logits the candidates were taken from; read only.
        rows: ``[n]`` int64 row indices.
        vals, idx: ``[n, W]`` canonical candidates of those rows (:func:`topk_candidates`).

    Returns:
        ``[n, W]`` int64 ids (``idx`` outside the tied run).
    """
    n, width = vals.shape
    if n == 0:
        return idx
    last = vals[:, -1:]
    tied = vals == last  # a run at the end: vals descend
    run_start = width - tied.sum(dim=1, keepdim=True)
    holders = torch.cumsum((x[rows] == last).to(torch.int32), dim=1, dtype=torch.int32)  # [n, V]
    nth = (torch.arange(width, device=vals.device) - run_start).clamp_(min=0) + 1
    lowest = torch.searchsorted(holders, nth.to(torch.int32))  # the position of the nth holder
    return torch.where(tied, lowest, idx)


def sorted_candidates(x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token of each selected row, in canonical order (``[n, V]`` each)."""
    vals, idx = torch.sort(x[rows], dim=-1, descending=True, stable=True)
    return vals, idx


def _compact(
    member: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack each row's members to the left, in column order, padding with ``-inf``.

    Returns ``(vals [n, C], ids [n, C], sizes [n])`` with ``C`` the largest row's count;
    ``ids`` are the members' columns, or ``ids[row, column]`` when ``ids`` is given.
    """
    n = member.shape[0]
    hit_row, hit_col = member.nonzero(as_tuple=True)
    sizes = torch.bincount(hit_row, minlength=n)
    width = int(sizes.max()) if n else 0
    slot = torch.arange(hit_row.shape[0], device=vals.device) - (torch.cumsum(sizes, 0) - sizes)[hit_row]
    out_vals = torch.full((n, width), float("-inf"), dtype=vals.dtype, device=vals.device)
    out_ids = torch.zeros((n, width), dtype=torch.int64, device=vals.device)
    out_vals[hit_row, slot] = vals[hit_row, hit_col]
    out_ids[hit_row, slot] = hit_col if ids is None else ids[hit_row, hit_col]
    return out_vals, out_ids, sizes


def threshold_candidates(
    x: torch.Tensor,
    rows: torch.Tensor,
    need_count: torch.Tensor,
    margin: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A value-closed upper set ``{x >= tau}`` per row holding ``need_count`` tokens (a
    top-k too wide for :func:`topk_candidates`), sized from a subsample.

    Every ``SUBSAMPLE_STRIDE``-th token estimates how deep the set must reach. Candidates
    down to ``margin`` times that depth are gathered, then the tightest of a few thresholds
    between the estimate and that depth whose exact count suffices is kept, and only its
    members are sorted. (Top-p rows never come here: ``nucleus_draw`` settles them in a
    fixed number of passes.)

    Args:
        x: ``[N, V]`` float32; read only.
        rows: ``[n]`` int64 row indices (rows with a finite maximum).
        need_count: ``[n]`` int64 tokens needed (top-k).
        margin: how many times deeper than the estimate the gathered set reaches (``> 1``).

    Returns:
        ``(vals [n, C] float32, idx [n, C] int64, ok [n] bool)`` in canonical order, ``C``
        the largest set, shorter rows padded with ``-inf`` (ids meaningless). ``ok`` is
        False for a row whose gathered set fell short (retry with a larger ``margin``).
    """
    xr = x[rows]
    sub = xr[:, ::SUBSAMPLE_STRIDE]
    ns = sub.shape[1]
    base = need_count.double() / SUBSAMPLE_STRIDE
    depth = int(torch.ceil(base.max() * margin)) + 9 if base.numel() else 9
    depth = min(ns, depth)
    top_sub = torch.topk(sub, depth, dim=-1, sorted=True).values
    factors = torch.tensor([1.0, 1.15, 1.35, 1.6, margin], dtype=torch.float64, device=x.device)
    ranks = (torch.ceil(base.unsqueeze(1) * factors) + 8).long()
    levels = top_sub.gather(1, ranks.clamp(max=depth - 1))
    levels = torch.where(ranks >= ns, torch.full_like(levels, float("-inf")), levels)
    vals, ids, sizes = _compact(xr >= levels[:, -1:], xr, None)
    nlev = levels.shape[1]
    # bucket b = how many levels a candidate reaches (levels descend: level i needs b >= nlev - i)
    bucket = torch.searchsorted(levels.flip(-1).contiguous(), vals, right=True)
    real = torch.arange(vals.shape[1], device=x.device) < sizes.unsqueeze(1)
    bucket = torch.where(real, bucket, torch.zeros_like(bucket))
    counts = torch.zeros(vals.shape[0], nlev + 1, dtype=torch.int64, device=x.device)
    counts.scatter_add_(1, bucket, torch.ones_like(bucket))
    counts = counts.flip(-1).cumsum(-1)[:, :nlev]  # [:, i]: candidates reaching level i
    enough = counts >= need_count.unsqueeze(1)
    ok = enough[:, -1]
    choice = torch.argmax(enough.to(torch.int8), dim=-1, keepdim=True)
    vals, ids, _ = _compact(vals >= levels.gather(1, choice), vals, ids)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return vals.gather(1, order), ids.gather(1, order), ok
