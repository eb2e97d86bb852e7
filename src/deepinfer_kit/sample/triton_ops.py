# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton kernels of the sampler's hot path: row normalizers, the inverse-CDF draw over
the whole vocabulary, and top-k / top-p / min-p filtering plus the draw over candidates.

Same signatures and semantics as ``ref_ops.py`` (the spec). One program per row, looping
over the row in chunks of ``BLOCK`` tokens, so a row's arithmetic never depends on the
other rows of the call. Imported only when a sampler is built with the Triton
implementation, so ``import deepinfer_kit`` never imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kit.sample.blocked import BLOCK

__all__ = ["row_norm", "full_draw", "candidate_draw", "nucleus_draw"]

_MAX_CANDIDATE_BLOCK = 1024


@triton.jit
def _row_max(base, V, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        v = tl.load(base + start + offs, mask=start + offs < V, other=float("-inf"))
        m = tl.maximum(m, v)
    top = tl.max(m, axis=0)
    return tl.where(top == float("-inf"), 0.0, top)


@triton.jit
def _row_start(x_ptr, rows_ptr, inv_t_ptr, min_p_ptr, stride, V, BLOCK: tl.constexpr):
    """This program's row: its index, base pointer, ``1 / T``, min-p and finite maximum."""
    pid = tl.program_id(0)
    base = x_ptr + tl.load(rows_ptr + pid).to(tl.int64) * stride
    return pid, base, tl.load(inv_t_ptr + pid), tl.load(min_p_ptr + pid), _row_max(base, V, BLOCK)


@triton.jit
def _chunk_weights(base, start, V, top, inv_t, min_p, BLOCK: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    v = tl.load(base + offs, mask=offs < V, other=float("-inf"))
    w = tl.exp((v - top) * inv_t)
    return tl.where(w < min_p, 0.0, w)


@triton.jit
def _row_total(base, V, top, inv_t, min_p, BLOCK: tl.constexpr):
    """float64 sum of the row's weights, chunk sums in float32 (as ``ref_ops._block_sums``)."""
    total = tl.sum(tl.zeros([BLOCK], tl.float64), axis=0)
    for start in range(0, V, BLOCK):
        w = _chunk_weights(base, start, V, top, inv_t, min_p, BLOCK)
        total += tl.sum(w, axis=0).to(tl.float64)
    return total


@triton.jit
def _row_norm_kernel(x_ptr, rows_ptr, inv_t_ptr, out_ptr, stride, V, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = x_ptr + tl.load(rows_ptr + pid).to(tl.int64) * stride
    inv_t = tl.load(inv_t_ptr + pid)
    top = _row_max(base, V, BLOCK)
    tl.store(out_ptr + pid, _row_total(base, V, top, inv_t, 0.0, BLOCK))


@triton.jit
def _full_draw_kernel(
    x_ptr, rows_ptr, inv_t_ptr, min_p_ptr, u_ptr, out_ptr, stride, V, BLOCK: tl.constexpr
):  # fmt: skip
    pid, base, inv_t, min_p, top = _row_start(x_ptr, rows_ptr, inv_t_ptr, min_p_ptr, stride, V, BLOCK)
    total = _row_total(base, V, top, inv_t, min_p, BLOCK)
    target = tl.load(u_ptr + pid) * total
    running = total * 0.0
    before = total * 0.0
    chosen = pid * 0  # loop-carried values start as tensors, not constants
    found = pid * 0
    for start in range(0, V, BLOCK):
        w = _chunk_weights(base, start, V, top, inv_t, min_p, BLOCK)
        s = tl.sum(w, axis=0).to(tl.float64)
        hit = (found == 0) & (running + s > target)
        chosen = tl.where(hit, start, chosen)
        before = tl.where(hit, running, before)
        found = tl.where(hit, 1, found)
        running += s
    offs = tl.arange(0, BLOCK)
    w = _chunk_weights(base, chosen, V, top, inv_t, min_p, BLOCK)
    cum = tl.cumsum(w.to(tl.float64), axis=0)
    j = tl.min(tl.where(cum > target - before, offs, BLOCK), axis=0)
    last = tl.max(tl.where(w > 0, offs, -1), axis=0)
    token = chosen + tl.minimum(j, last)
    token = tl.where(total > 0, token, 0)
    tl.store(out_ptr + pid, token.to(tl.int64))


@triton.jit
def _candidate_chunk(vbase, start, W, limit, top, inv_t, running, BLOCK: tl.constexpr):
    """Positions, weights and inclusive in-top-k prefix sums of one chunk of candidates,
    and the running sum after it."""
    j = start + tl.arange(0, BLOCK)
    w = tl.exp((tl.load(vbase + j, mask=j < W, other=float("-inf")) - top) * inv_t)
    w64 = tl.where(j < limit, w, 0.0).to(tl.float64)
    cum = running + tl.cumsum(w64, axis=0)
    return j, w, cum, running + tl.sum(w64, axis=0)


@triton.jit
def _candidate_kernel(
    vals_ptr, idx_ptr, inv_t_ptr, k_ptr, p_ptr, min_p_ptr, z_ptr, u_ptr,
    tok_ptr, kept_ptr, W, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    vbase = vals_ptr + pid.to(tl.int64) * W
    top = tl.load(vbase)
    top = tl.where(top == float("-inf"), 0.0, top)
    inv_t = tl.load(inv_t_ptr + pid)
    k = tl.load(k_ptr + pid)
    limit = tl.minimum(k, W)
    p = tl.load(p_ptr + pid)
    min_p = tl.load(min_p_ptr + pid)
    zero = tl.sum(tl.zeros([BLOCK], tl.float64), axis=0)
    in_k_total = zero
    good = pid * 0
    for start in range(0, W, BLOCK):
        j, w, cum, in_k_total = _candidate_chunk(vbase, start, W, limit, top, inv_t, in_k_total, BLOCK)
        good += tl.sum(((w >= min_p) & (w > 0)).to(tl.int32), axis=0)
    z = tl.load(z_ptr + pid)
    thresh = p * tl.where(z > 0, z, in_k_total)
    below = pid * 0
    running = zero
    for start in range(0, W, BLOCK):
        j, w, cum, running = _candidate_chunk(vbase, start, W, limit, top, inv_t, running, BLOCK)
        below += tl.sum(((cum < thresh) & (j < limit)).to(tl.int32), axis=0)
    use_p = p < 1.0
    crossed = use_p & (below < limit)
    n_top = tl.where(crossed, below + 1, limit)
    kept = tl.minimum(n_top, good)
    end = tl.maximum(kept - 1, 0)
    total = zero
    running = zero
    for start in range(0, W, BLOCK):
        j, w, cum, running = _candidate_chunk(vbase, start, W, limit, top, inv_t, running, BLOCK)
        total += tl.sum(tl.where(j == end, cum, 0.0), axis=0)
    target = tl.load(u_ptr + pid) * total
    pick = pid * 0 + W
    running = zero
    for start in range(0, W, BLOCK):
        j, w, cum, running = _candidate_chunk(vbase, start, W, limit, top, inv_t, running, BLOCK)
        pick = tl.minimum(pick, tl.min(tl.where((cum > target) & (j < W), j, W), axis=0))
    pick = tl.minimum(pick, end)
    token = tl.load(idx_ptr + pid.to(tl.int64) * W + pick)
    token = tl.where(kept > 0, token, 0)
    reached = crossed | (p >= 1.0) | (k <= W)
    tl.store(tok_ptr + pid, token)
    tl.store(kept_ptr + pid, tl.where(reached, kept, -1).to(tl.int64))


def row_norm(x: torch.Tensor, rows: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
    """``[n]`` float64 softmax denominators; see ``ref_ops.row_norm``."""
    out = torch.empty(rows.shape[0], dtype=torch.float64, device=x.device)
    if rows.numel():
        _row_norm_kernel[(rows.shape[0],)](
            x, rows, inv_t.contiguous(), out, x.stride(0), x.shape[1], BLOCK=BLOCK
        )
    return out


def full_draw(
    x: torch.Tensor,
    rows: torch.Tensor,
    inv_t: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """``[n]`` int64 tokens by inverse CDF over the vocabulary; see ``ref_ops.full_draw``."""
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=x.device)
    if rows.numel():
        _full_draw_kernel[(rows.shape[0],)](
            x, rows, inv_t.contiguous(), min_p.contiguous(), u.contiguous(), out,
            x.stride(0), x.shape[1], BLOCK=BLOCK,
        )  # fmt: skip
    return out


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
    """Top-k / top-p / min-p over sorted candidates, then the draw; see
    ``ref_ops.candidate_draw``."""
    n, width = vals.shape
    tokens = torch.empty(n, dtype=torch.int64, device=vals.device)
    kept = torch.empty(n, dtype=torch.int64, device=vals.device)
    if n:
        block = min(triton.next_power_of_2(width), _MAX_CANDIDATE_BLOCK)
        _candidate_kernel[(n,)](
            vals.contiguous(), idx.contiguous(), inv_t.contiguous(), k.contiguous(),
            p.contiguous(), min_p.contiguous(), z.contiguous(), u.contiguous(),
            tokens, kept, width, BLOCK=block,
        )  # fmt: skip
    return tokens, kept


_SPLITS = 16  # keys probed per pass of the nucleus search: 4 bits, 8 passes for 32-bit keys
_NUCLEUS_BLOCK = 256


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
    its tie rank, the number of tokens at that key and one token's weight there."""
    lanes = tl.arange(0, SPLITS)
    lo = floor_key * 0
    above = target * 0.0
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
    w_at = target * 0.0
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
def _nucleus_kernel(
    x_ptr, rows_ptr, inv_t_ptr, p_ptr, min_p_ptr, u_ptr, out_ptr, stride, V,
    BLOCK: tl.constexpr, SPLITS: tl.constexpr, Z_BLOCK: tl.constexpr,
):  # fmt: skip
    pid, base, inv_t, min_p, top = _row_start(x_ptr, rows_ptr, inv_t_ptr, min_p_ptr, stride, V, BLOCK)
    none = tl.full([], -1, tl.int64)
    zero = tl.load(p_ptr + pid) * 0.0
    z = _row_total(base, V, top, inv_t, 0.0, Z_BLOCK)  # in the chunks of _row_norm_kernel
    cut, cut_rank, ties, above, w_at = _nucleus_search(
        base, V, top, inv_t, min_p, tl.load(p_ptr + pid) * z, 0, none, zero, BLOCK, SPLITS,
    )  # fmt: skip
    mass = above + cut_rank.to(tl.float64) * w_at
    # the draw searches the nucleus: keys above the cut, plus cut_rank tokens at it
    key, rank, _, _, _ = _nucleus_search(
        base, V, top, inv_t, min_p, tl.load(u_ptr + pid) * mass, 1, cut, cut_rank.to(tl.float64) * w_at,
        BLOCK, SPLITS,
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


def nucleus_draw(
    x: torch.Tensor,
    rows: torch.Tensor,
    inv_t: torch.Tensor,
    p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """``[n]`` int64 top-p / min-p draws over whole rows; see ``ref_ops.nucleus_draw``.

    One program per row: one pass sums the row's weight (as ``row_norm``), then eight
    passes of 16-way bisection on the logits' order keys find each crossing (the top-p
    cut, then the draw), with weights summed in float64.
    """
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=x.device)
    if rows.numel():
        _nucleus_kernel[(rows.shape[0],)](
            x, rows, inv_t.contiguous(), p.contiguous(), min_p.contiguous(), u.contiguous(), out,
            x.stride(0), x.shape[1], BLOCK=_NUCLEUS_BLOCK, SPLITS=_SPLITS, Z_BLOCK=BLOCK,
        )  # fmt: skip
    return out
