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
from deepinfer_kit.sample.candidates import settle_ties, topk_candidates
from deepinfer_kit.sample.triton_nucleus import NUCLEUS_BLOCK, SPLITS, nucleus_kernel
from deepinfer_kit.sample.triton_rows import chunk_weights, row_max, row_start, row_total

__all__ = ["row_norm", "full_draw", "candidate_draw", "nucleus_draw", "NUCLEUS_CANDIDATES"]

_MAX_CANDIDATE_BLOCK = 1024


@triton.jit
def _row_norm_kernel(x_ptr, rows_ptr, inv_t_ptr, out_ptr, stride, V, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = x_ptr + tl.load(rows_ptr + pid).to(tl.int64) * stride
    inv_t = tl.load(inv_t_ptr + pid)
    top = row_max(base, V, BLOCK)
    tl.store(out_ptr + pid, row_total(base, V, top, inv_t, 0.0, BLOCK))


@triton.jit
def _full_draw_kernel(
    x_ptr, rows_ptr, inv_t_ptr, min_p_ptr, u_ptr, out_ptr, stride, V, BLOCK: tl.constexpr
):  # fmt: skip
    pid, base, inv_t, min_p, top = row_start(x_ptr, rows_ptr, inv_t_ptr, min_p_ptr, stride, V, BLOCK)
    total = row_total(base, V, top, inv_t, min_p, BLOCK)
    target = tl.load(u_ptr + pid) * total
    running = total * 0.0
    before = total * 0.0
    chosen = pid * 0  # loop-carried values start as tensors, not constants
    found = pid * 0
    for start in range(0, V, BLOCK):
        w = chunk_weights(base, start, V, top, inv_t, min_p, BLOCK)
        s = tl.sum(w, axis=0).to(tl.float64)
        hit = (found == 0) & (running + s > target)
        chosen = tl.where(hit, start, chosen)
        before = tl.where(hit, running, before)
        found = tl.where(hit, 1, found)
        running += s
    offs = tl.arange(0, BLOCK)
    w = chunk_weights(base, chosen, V, top, inv_t, min_p, BLOCK)
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


NUCLEUS_CANDIDATES = 1024
"""Width of the candidate set a top-p-only row is first drawn from (``torch.topk``): a
nucleus inside it is settled there; a wider one falls back to the whole-row search."""


def nucleus_draw(
    x: torch.Tensor,
    rows: torch.Tensor,
    inv_t: torch.Tensor,
    p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """``[n]`` int64 top-p / min-p draws over whole rows; see ``ref_ops.nucleus_draw``.

    Fixed shapes, nothing read back (it may be queued behind a forward or captured):

    1. ``z``: the row's weight (:func:`row_norm`, one pass, as the reference sums it);
    2. the ``W = min(NUCLEUS_CANDIDATES, V)`` largest logits (``torch.topk``, a parallel
       selection), in canonical order, the run tied at the last value settled by token id
       (``settle_ties``: one compare and prefix-count pass);
    3. :func:`candidate_draw` over them with ``z`` (top-p of the whole row's mass): ``W``
       candidates, four passes. A row whose nucleus closes inside them is exact there
       (the nucleus is a canonical prefix, and every token of it is a candidate). A row
       with ``p >= 1`` (top-p off: the nucleus is every token with ``w >= min_p``) is
       settled there only when fewer than ``W`` candidates survive min-p (or ``W = V``);
    4. one launch of ``nucleus_kernel``: each settled row stores its token, each other
       row (``kept = -1``: the mass was not reached in ``W`` candidates) is drawn over the
       whole row by the 19-pass bisection, one program per row.

    Per settled row that is about three passes over ``V`` (norm, selection, ties), all
    spread over the device, instead of nineteen serial passes in one program.
    """
    n, vocab = rows.shape[0], x.shape[1]
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    if n == 0:
        return out
    width = min(NUCLEUS_CANDIDATES, vocab)
    z = row_norm(x, rows, inv_t)
    vals, idx = topk_candidates(x, rows, width)
    idx = settle_ties(x, rows, vals, idx)
    no_k = torch.full((n,), vocab, dtype=torch.int64, device=x.device)
    tok, kept = candidate_draw(vals, idx, inv_t, no_k, p, min_p, z, u)
    if width < vocab:
        # top-p off (p >= 1): candidate_draw keeps all W candidates and calls the row
        # settled, but the row's nucleus is all of its tokens with w >= min_p; it lies
        # inside the candidates only when fewer than W of them survive min-p.
        kept.masked_fill_((p >= 1.0) & (kept >= width), -1)
    nucleus_kernel[(n,)](
        x, rows, inv_t.contiguous(), p.contiguous(), min_p.contiguous(), u.contiguous(), tok, kept,
        out, x.stride(0), vocab, BLOCK=NUCLEUS_BLOCK, SPLITS=SPLITS, Z_BLOCK=BLOCK,
    )  # fmt: skip
    return out
