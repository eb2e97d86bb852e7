"""Torch reference of ``nucleus_draw``: top-p, min-p and the draw over whole rows in a fixed
number of passes, whatever the nucleus width (re-exported by ``ref_ops.py``).

Shape symbols: ``n`` rows handled by one call, ``N`` rows of the logits, ``V`` vocabulary,
``C`` tokens gathered from the crossing bins of a row.
"""

from __future__ import annotations

import attrs
import torch

from deepinfer_kit.sample.blocked import BLOCK, blocked_reduce

__all__ = ["BINS_PER_NAT", "nucleus_draw", "slab_rows"]

BINS_PER_NAT = 256
"""Resolution of the log-weight histogram of :func:`nucleus_draw` (bins per unit of
``log w``)."""
_NBINS = 104 * BINS_PER_NAT + 1  # float32 weights below e^-104 are 0: the last bin is dead
_NUCLEUS_ROWS = 4  # rows per slab at least: its [rows, V] temporaries stay in cache and are reused
_SLAB_ROWS_MAX = 64
_SLAB_BYTES = 16 << 20  # a slab's temporaries at most (4 rows of a 150k vocabulary)


def slab_rows(vocab: int) -> int:
    """Rows one slab of :func:`nucleus_draw` handles: 4 at a large vocabulary, up to 64
    at a small one, where the per-slab calls, not the row, cost most (the ``[rows,
    NBINS]`` histogram then dominates the temporaries). A row's token does not depend on
    the slab it is drawn in. Pure."""
    per_row = 24 * vocab + 8 * _NBINS  # d, key (f32), bins (i64), w64 (f64); hist (f64)
    return max(_NUCLEUS_ROWS, min(_SLAB_ROWS_MAX, _SLAB_BYTES // per_row))
_WIDEN = 1e-12  # relative: the draw's bin range allows for the cut's float rounding


def _search(sorted_: torch.Tensor, values: torch.Tensor, right: bool) -> torch.Tensor:
    """``[n]`` row-wise ``searchsorted`` of one value per row."""
    return torch.searchsorted(sorted_, values.unsqueeze(1).contiguous(), right=right).squeeze(1)


def _crossing_bins(
    cum: torch.Tensor, target: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bin of the top-p cut, and the range of bins the draw can fall in.

    The cut is the first bin whose cumulative weight reaches ``target`` (the last bin with
    weight when the row falls short). The nucleus weight lies between the cumulative
    weight before that bin and through it, so the draw's target ``u * mass`` lies in a
    known range, and so does its bin (never past the cut).

    Returns:
        ``(cut [n], draw_lo [n], draw_hi [n])`` int64 bin indices.
    """
    last = _search(cum, cum[:, -1], right=False)
    cut = torch.minimum(_search(cum, target, right=False), last)
    before = cum.gather(1, (cut - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    before = torch.where(cut > 0, before, torch.zeros_like(before))
    through = cum.gather(1, cut.unsqueeze(1)).squeeze(1)
    lo = torch.minimum(_search(cum, u * before * (1.0 - _WIDEN), right=True), cut)
    hi = torch.minimum(_search(cum, u * through * (1.0 + _WIDEN), right=True), cut)
    return cut, lo, hi


def _chosen(cut: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``[n, _NBINS]`` bool: bin ``cut`` and bins ``lo..hi`` of each row."""
    n = cut.shape[0]
    span = int((hi - lo).max()) + 1
    cols = torch.minimum(lo.unsqueeze(1) + torch.arange(span, device=cut.device), hi.unsqueeze(1))
    chosen = torch.zeros((n, _NBINS), dtype=torch.bool, device=cut.device)
    chosen.scatter_(1, torch.cat([cols, cut.unsqueeze(1)], dim=1), True)
    return chosen


def _nonzero_rows(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``mask.nonzero(as_tuple=True)`` of a sparse contiguous ``[n, V]`` bool mask, in the
    same (row-major) order: the scan reads the mask as 8-byte words first and looks
    inside the nonzero ones only (about 3x faster for a few hundred hits per row)."""
    n, v = mask.shape
    if v % 8 or not mask.is_contiguous():
        row, col = mask.nonzero(as_tuple=True)
        return row, col
    word_row, word = mask.view(torch.int64).nonzero(as_tuple=True)
    hit, byte = mask.view(n, v // 8, 8)[word_row, word].nonzero(as_tuple=True)
    return word_row[hit], word[hit] * 8 + byte


def _gather_members(
    x: torch.Tensor, rows: torch.Tensor, bins: torch.Tensor, w: torch.Tensor, chosen: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens of the chosen bins of each row, in canonical order.

    Args:
        x: ``[N, V]`` the logits (the canonical order is by these, ties by id).
        rows: ``[n]`` int64 the rows of ``x`` of this slab.
        bins: ``[n, V]`` int64 bin of every token.
        w: ``[n, V]`` float32 weights.
        chosen: ``[n, _NBINS]`` bool, the bins to gather.

    Returns:
        ``(ids [n, C], w [n, C] float64, bin [n, C])``: tokens with positive weight first,
        in canonical order (their bins then never decrease), then padding of weight 0 and
        bin ``_NBINS``.
    """
    n = rows.shape[0]
    hit_row, hit_col = _nonzero_rows(chosen.gather(1, bins))
    sizes = torch.bincount(hit_row, minlength=n)
    width = max(int(sizes.max()), 1)
    slot = torch.arange(hit_row.shape[0], device=x.device) - (torch.cumsum(sizes, 0) - sizes)[hit_row]
    wv = w[hit_row, hit_col]
    live = wv > 0
    vals = torch.full((n, width), float("-inf"), dtype=x.dtype, device=x.device)
    ids = torch.zeros((n, width), dtype=torch.int64, device=x.device)
    ww = torch.zeros((n, width), dtype=torch.float64, device=x.device)
    bb = torch.full((n, width), _NBINS, dtype=torch.int64, device=x.device)
    real = torch.where(live, x[rows[hit_row], hit_col], torch.full_like(wv, float("-inf")))
    vals[hit_row, slot], ids[hit_row, slot], ww[hit_row, slot] = real, hit_col, wv.double()
    own = bins[hit_row, hit_col]
    bb[hit_row, slot] = torch.where(live, own, torch.full_like(own, _NBINS))
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return ids.gather(1, order), ww.gather(1, order), bb.gather(1, order)


def _running_weights(cum: torch.Tensor, ww: torch.Tensor, bb: torch.Tensor) -> torch.Tensor:
    """``[n, C]`` float64 running weight of the row through each gathered token: the
    cumulative weight of the bins before its own, plus its bin's tokens up to it
    (``+inf`` for padding, so the row stays sorted)."""
    cw = torch.cumsum(ww, dim=-1)
    start = torch.searchsorted(bb, bb, right=False)  # first gathered token of the same bin
    inside = cw - torch.where(start > 0, cw.gather(1, (start - 1).clamp(min=0)), torch.zeros_like(cw))
    before = cum.gather(1, (bb - 1).clamp(min=0, max=_NBINS - 1))
    run = torch.where(bb > 0, before, torch.zeros_like(before)) + inside
    return torch.where(bb < _NBINS, run, torch.full_like(run, float("inf")))


@attrs.define(slots=True, eq=False)
class _Scratch:
    """Temporaries of one slab of rows, allocated once per call and reused."""

    d: torch.Tensor  # [slab, V] float32: log-weights, then weights
    key: torch.Tensor  # [slab, V] float32: scaled log-weights
    bins: torch.Tensor  # [slab, V] int64 (the histogram's scatter index)
    w64: torch.Tensor  # [slab, V] float64
    hist: torch.Tensor  # [slab, _NBINS] float64

    @classmethod
    def make(cls, slab: int, vocab: int, device: torch.device) -> _Scratch:
        d = torch.empty((slab, vocab), dtype=torch.float32, device=device)
        return cls(
            d=d,
            key=torch.empty_like(d),
            bins=torch.empty((slab, vocab), dtype=torch.int64, device=device),
            w64=torch.empty((slab, vocab), dtype=torch.float64, device=device),
            hist=torch.empty((slab, _NBINS), dtype=torch.float64, device=device),
        )


def _slab_draw(
    x: torch.Tensor, rows: torch.Tensor, row_ids: list[int], inv_t: torch.Tensor, p: torch.Tensor,
    min_p: torch.Tensor, u: torch.Tensor, s: _Scratch,
) -> torch.Tensor:  # fmt: skip
    """``[r]`` tokens of ``r <= slab`` rows (``row_ids``: ``rows`` on the host; the other
    arguments as :func:`nucleus_draw`'s)."""
    r = len(row_ids)
    d, bins, w64 = s.d[:r], s.bins[:r], s.w64[:r]
    if row_ids == list(range(row_ids[0], row_ids[0] + r)):  # consecutive rows: one view
        parts = [(x[row_ids[0] : row_ids[0] + r], d)]
    else:
        parts = [(x[row : row + 1], d[i : i + 1]) for i, row in enumerate(row_ids)]
    for src, dst in parts:  # no copy of the logits: d = x - max straight from x
        top = src.amax(dim=-1, keepdim=True)
        torch.sub(src, torch.where(torch.isneginf(top), torch.zeros_like(top), top), out=dst)
    d.mul_(inv_t.unsqueeze(1))
    key = torch.mul(d, -float(BINS_PER_NAT), out=s.key[:r]).clamp_(max=_NBINS - 1)
    bins.copy_(key)
    w = d.exp_()
    z = blocked_reduce(w, BLOCK, "sum").double().sum(dim=-1)  # as ref_ops.row_norm
    if bool((min_p > 0).any()):
        w.masked_fill_(w < min_p.unsqueeze(1), 0.0)
    w64.copy_(w)
    # One scatter for the slab (rows in parallel, each summed in token order, as a
    # per-row bincount would): about half of bincount's time per row.
    cum = s.hist[:r].zero_().scatter_add_(1, bins, w64).cumsum(dim=-1)
    # top-p off (p >= 1): no cut, the nucleus is the whole row (its last bin and token with
    # weight), never a comparison of p * z with the histogram's differently rounded sums
    target = torch.where(p >= 1.0, torch.full_like(z, float("inf")), p * z)
    cut, draw_lo, draw_hi = _crossing_bins(cum, target, u)
    ids, ww, bb = _gather_members(x, rows, bins, w, _chosen(cut, draw_lo, draw_hi))
    run = _running_weights(cum, ww, bb)
    live = (ww > 0).sum(dim=-1)
    j = torch.minimum(_search(run, target, right=False), live - 1).clamp_(min=0)
    mass = torch.where(live > 0, run.gather(1, j.unsqueeze(1)).squeeze(1), torch.zeros_like(u))
    k = torch.minimum(_search(run, u * mass, right=True), j)
    tokens = ids.gather(1, k.unsqueeze(1)).squeeze(1)
    return torch.where(mass > 0, tokens, torch.zeros_like(tokens))


def nucleus_draw(
    x: torch.Tensor,
    rows: torch.Tensor,
    inv_t: torch.Tensor,
    p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """Top-p, then min-p, then the draw over whole rows without sorting them: a cost that
    does not grow with the nucleus.

    Draws what ``ref_ops.candidate_draw`` draws over the row's full canonical order with
    top-k off and ``z = ref_ops.row_norm`` (up to float rounding at a boundary): the
    nucleus is the canonical prefix ending at the first token whose running weight
    reaches ``p * z`` (the whole row when it never does, and always when ``p >= 1``: top-p
    off compares no sums), cut to the tokens with ``w >= min_p``; the token is the first
    of the nucleus whose running weight exceeds ``u`` times the nucleus weight. So a
    ``p >= 1`` row draws over every token with ``w >= min_p`` in canonical order (by
    logit, ties by id) — not ``full_draw``'s vocabulary order. ``z`` is
    summed here from the same weights, exactly as ``row_norm`` sums it. One pass bins
    every token by its log-weight ``(x - max) * inv_t`` (:data:`BINS_PER_NAT` bins per
    unit; bins follow the canonical order, ties share a bin) and sums the weight per bin
    in float64. The cumulative bin weights give the bin of the top-p cut, and — since the
    nucleus weight lies between the weight before that bin and through it — the few bins
    the draw can fall in. One more pass gathers the tokens of those bins; only they are
    sorted (by logit, ties by id) and summed one by one, which settles both crossings.
    The work is a fixed number of passes over the row plus a sort of those bins' tokens
    (their number depends on how dense the logits are at the crossings, not on the
    nucleus width). Rows are handled each on its own (:func:`slab_rows` at a time,
    reusing the temporaries), so a row's token never depends on the others.

    Args:
        x: ``[N, V]`` float32 logits (after penalties), contiguous; read only.
        rows: ``[n]`` int64 row indices into ``x``.
        inv_t: ``[n]`` float32 ``1 / temperature``.
        p: ``[n]`` float64 top-p in ``(0, 1]``.
        min_p: ``[n]`` float32 in ``[0, 1]``.
        u: ``[n]`` float64 uniforms in ``[0, 1)``.

    Returns:
        ``[n]`` int64 tokens; ``0`` for an all ``-inf`` row.
    """
    n = rows.shape[0]
    out = torch.zeros(n, dtype=torch.int64, device=x.device)
    if n == 0:
        return out
    step = slab_rows(x.shape[1])
    scratch = _Scratch.make(min(n, step), x.shape[1], x.device)
    row_ids = rows.tolist()
    for lo in range(0, n, step):
        part = slice(lo, min(n, lo + step))
        out[part] = _slab_draw(
            x, rows[part], row_ids[part], inv_t[part], p[part], min_p[part], u[part], scratch
        )
    return out
