# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton kernels of the top-p draw over a whole row: the exact fallback of
``triton_ops.nucleus_draw`` for the rows whose nucleus is wider than their candidate set.

A bisection on the logits' order keys (float bits made monotone, 32-bit) finds each
crossing in eight passes of 16 probes, with weights summed in float64, so its cost does
not grow with the nucleus; it runs one program per row, serially over the vocabulary,
which is why it is only the fallback.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_kit.sample.triton_rows import row_start, row_total

__all__ = ["NUCLEUS_BLOCK", "SPLITS", "nucleus_kernel"]

SPLITS = 16  # keys probed per pass of the nucleus search: 4 bits, 8 passes for 32-bit keys
NUCLEUS_BLOCK = 256


@triton.jit
def _nucleus_chunk(base, start, V, top, inv_t, min_p, BLOCK: tl.constexpr):
    """Order keys (int64 in ``[0, 2**32)``, as ``ref_ops``' float order) and weights of a chunk."""
    offs = start + tl.arange(0, BLOCK)
    v = tl.load(base + offs, mask=offs < V, other=float("-inf"))
    w = tl.exp((v - top) * inv_t)
    w = tl.where((w < min_p) | (offs >= V), 0.0, w)
    bits = (v + 0.0).to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) + 2147483648
    return offs, key, w


@triton.jit
def _nucleus_search(
    base, V, top, inv_t, min_p, target, strict, floor_key, floor_mass, BLOCK: tl.constexpr,
    SPLITS: tl.constexpr,
):  # fmt: skip
    """The key of the first token (canonical order, weight > 0, keys above ``floor_key``
    plus ``floor_mass`` for the tokens kept at it) whose running weight reaches ``target``,
    its tie rank, the number of tokens at that key and one token's weight there. A target
    the row's total never reaches (``+inf`` included) settles on the last token with
    weight."""
    lanes = tl.arange(0, SPLITS)
    lo = floor_key * 0
    above = floor_mass * 0.0  # not target * 0: target may be +inf (top-p off)
    use_gt = strict
    for level in tl.static_range(8):
        step = tl.full([], 1, tl.int64) << (28 - 4 * level)
        splits = lo + lanes.to(tl.int64) * step
        acc = tl.zeros([SPLITS], tl.float64)
        for start in range(0, V, BLOCK):
            offs, key, w = _nucleus_chunk(base, start, V, top, inv_t, min_p, BLOCK)
            keep = (key[:, None] >= splits[None, :]) & (key > floor_key)[:, None]
            acc += tl.sum(tl.where(keep, w.to(tl.float64)[:, None], 0.0), axis=0)
        acc += tl.where(splits <= floor_key, floor_mass, 0.0)
        if level == 0:  # short of the target: settle on the last token with weight
            total = tl.sum(tl.where(lanes == 0, acc, 0.0), axis=0)
            short = tl.where(use_gt != 0, target >= total, target > total)
            target = tl.where(short, total, target)
            use_gt = tl.where(short, 0, use_gt)
        meets = tl.where(use_gt != 0, acc > target, acc >= target)
        pick = tl.maximum(tl.sum(meets.to(tl.int32), axis=0) - 1, 0)
        nxt = tl.sum(tl.where(lanes == pick + 1, acc, 0.0), axis=0)
        above = tl.where(pick < SPLITS - 1, nxt, above)
        lo = lo + pick.to(tl.int64) * step
    ties = lo * 0
    w_at = floor_mass * 0.0
    for start in range(0, V, BLOCK):
        offs, key, w = _nucleus_chunk(base, start, V, top, inv_t, min_p, BLOCK)
        at = (key == lo) & (w > 0)
        ties += tl.sum(at.to(tl.int64), axis=0)
        w_at = tl.maximum(w_at, tl.max(tl.where(at, w, 0.0), axis=0).to(tl.float64))
    need = (target - above) / tl.where(w_at > 0, w_at, 1.0)
    rank = tl.where(use_gt != 0, tl.floor(need) + 1, tl.ceil(need)).to(tl.int64)
    ties = tl.maximum(ties, 1)
    return lo, tl.minimum(tl.maximum(rank, 1), ties), ties, above, w_at


@triton.jit
def nucleus_kernel(
    x_ptr, rows_ptr, inv_t_ptr, p_ptr, min_p_ptr, u_ptr, tok_ptr, kept_ptr, out_ptr, stride, V,
    BLOCK: tl.constexpr, SPLITS: tl.constexpr, Z_BLOCK: tl.constexpr,
):  # fmt: skip
    """A row the candidate draw settled (``kept >= 0``) keeps its token; any other row (its
    nucleus is wider than the candidates) is drawn here over the whole row: one pass for
    the normalizer, eight 16-way bisection passes on the order keys for the top-p cut,
    eight for the draw, two for ties."""
    pid = tl.program_id(0)
    if tl.load(kept_ptr + pid) >= 0:
        tl.store(out_ptr + pid, tl.load(tok_ptr + pid))
    else:
        pid, base, inv_t, min_p, top = row_start(x_ptr, rows_ptr, inv_t_ptr, min_p_ptr, stride, V, BLOCK)
        none = tl.full([], -1, tl.int64)
        p = tl.load(p_ptr + pid)
        zero = p * 0.0
        z = row_total(base, V, top, inv_t, 0.0, Z_BLOCK)  # in the chunks of _row_norm_kernel
        # p >= 1: no cut, the nucleus is the whole row (the search settles on its last
        # token with weight), never a comparison of two differently rounded sums
        cut_at = tl.where(p >= 1.0, float("inf"), p * z)
        cut, cut_rank, ties, above, w_at = _nucleus_search(
            base, V, top, inv_t, min_p, cut_at, 0, none, zero, BLOCK, SPLITS,
        )  # fmt: skip
        mass = above + cut_rank.to(tl.float64) * w_at
        # the draw searches the nucleus: keys above the cut, plus cut_rank tokens at it
        key, rank, _, _, _ = _nucleus_search(
            base, V, top, inv_t, min_p, tl.load(u_ptr + pid) * mass, 1, cut,
            cut_rank.to(tl.float64) * w_at, BLOCK, SPLITS,
        )  # fmt: skip
        rank = tl.where(key == cut, tl.minimum(rank, cut_rank), rank)
        seen = rank * 0
        token = rank * 0
        for start in range(0, V, BLOCK):
            offs, k, w = _nucleus_chunk(base, start, V, top, inv_t, min_p, BLOCK)
            at = (k == key) & (w > 0)
            run = seen + tl.cumsum(at.to(tl.int64), axis=0)
            token += tl.sum(tl.where(at & (run == rank), offs, 0), axis=0).to(tl.int64)
            seen += tl.sum(at.to(tl.int64), axis=0)
        tl.store(out_ptr + pid, tl.where(mass > 0, token, 0))
