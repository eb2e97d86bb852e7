# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton kernels of verification: greedy accept-while-equal and strict rejection sampling.

Same signatures and semantics as ``ref_ops.py`` (the spec). One program per request,
looping over its verified positions and over each vocabulary row in chunks of ``BLOCK``
tokens, so one request's arithmetic never depends on the others of the call. Imported
only when a verifier is built with the Triton implementation, so ``import deepinfer_kit``
never imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["greedy_verify", "rejection_sample"]

BLOCK = 1024


@triton.jit
def _row_argmax(base, V, BLOCK: tl.constexpr):
    """Index of the row's largest value, lowest on ties; 0 for an all ``-inf`` row."""
    offs = tl.arange(0, BLOCK)
    best = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    where = tl.sum(tl.zeros([BLOCK], tl.int64), axis=0)
    for start in range(0, V, BLOCK):
        v = tl.load(base + start + offs, mask=start + offs < V, other=float("-inf"))
        m = tl.max(v, axis=0)
        i = tl.min(tl.where(v == m, start + offs, V), axis=0).to(tl.int64)
        better = m > best  # strict: an earlier chunk keeps a tie
        where = tl.where(better, i, where)
        best = tl.maximum(best, m)
    return where


@triton.jit
def _greedy_kernel(
    x_ptr, off_ptr, ids_ptr, len_ptr, acc_ptr, tok_ptr, stride, G, V, BLOCK: tl.constexpr
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    n = tl.load(len_ptr + r)
    first = tl.load(off_ptr + r)
    acc = n * 0
    alive = n * 0 + 1
    tok = n * 0
    for j in range(0, n + 1):
        top = _row_argmax(x_ptr + (first + j) * stride, V, BLOCK)
        d = tl.load(ids_ptr + r * G + j, mask=j < n, other=-1)
        match = (j < n) & (top == d)
        tok = tl.where((alive == 1) & ~match, top, tok)
        alive = tl.where(match, alive, 0)
        acc += alive
    tl.store(acc_ptr + r, acc)
    tl.store(tok_ptr + r, tok)


@triton.jit
def _weights(t_row, d_row, start, V, use_d, BLOCK: tl.constexpr):
    """One chunk of ``max(0, p_t - p_d)`` (``p_t`` alone where ``use_d`` is false)."""
    offs = start + tl.arange(0, BLOCK)
    pt = tl.load(t_row + offs, mask=offs < V, other=0.0)
    pd = tl.load(d_row + offs, mask=offs < tl.where(use_d, V, 0), other=0.0)
    return offs, tl.maximum(pt - pd, 0.0)


@triton.jit
def _rejection_kernel(
    t_ptr, d_ptr, ids_ptr, len_ptr, ua_ptr, ud_ptr, acc_ptr, tok_ptr, G, V, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    n = tl.load(len_ptr + r)
    t_base = t_ptr + r * (G + 1) * V
    d_base = d_ptr + r * G * V
    acc = n * 0
    alive = n * 0 + 1
    for j in range(0, n):
        d = tl.load(ids_ptr + r * G + j)
        pt = tl.load(t_base + j * V + d)
        pd = tl.load(d_base + j * V + d)
        ok = tl.load(ua_ptr + r * G + j) * pd < pt
        alive = tl.where(ok, alive, 0)
        acc += alive
    rejected = acc < n
    t_row = t_base + acc * V
    d_row = d_base + tl.minimum(acc, G - 1) * V
    zero = tl.sum(tl.zeros([BLOCK], tl.float64), axis=0)
    residual = zero
    for start in range(0, V, BLOCK):
        offs, w = _weights(t_row, d_row, start, V, rejected, BLOCK)
        residual += tl.sum(w, axis=0)
    use_d = rejected & (residual > 0)
    total = zero
    lo = n * 0 + V
    hi = n * 0 - 1
    for start in range(0, V, BLOCK):
        offs, w = _weights(t_row, d_row, start, V, use_d, BLOCK)
        total += tl.sum(w, axis=0)
        lo = tl.minimum(lo, tl.min(tl.where(w > 0, offs, V), axis=0).to(tl.int64))
        hi = tl.maximum(hi, tl.max(tl.where(w > 0, offs, -1), axis=0).to(tl.int64))
    target = tl.load(ud_ptr + r * (G + 1) + acc) * total
    running = zero
    below = n * 0
    for start in range(0, V, BLOCK):
        offs, w = _weights(t_row, d_row, start, V, use_d, BLOCK)
        cum = running + tl.cumsum(w, axis=0)
        below += tl.sum(((cum <= target) & (offs < V)).to(tl.int64), axis=0)
        running += tl.sum(w, axis=0)
    tok = tl.maximum(tl.minimum(tl.maximum(below, lo), hi), 0)
    tl.store(acc_ptr + r, acc)
    tl.store(tok_ptr + r, tok)


def greedy_verify(
    logits: torch.Tensor,
    offsets: torch.Tensor,
    draft_ids: torch.Tensor,
    lengths: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`deepinfer_kit.spec.verify.ref_ops.greedy_verify` (the spec); ``logits`` must be
    contiguous float32."""
    num_req, width = draft_ids.shape
    dev = logits.device
    acc = torch.empty(num_req, dtype=torch.int64, device=dev)
    tok = torch.empty(num_req, dtype=torch.int64, device=dev)
    if num_req:
        ids = draft_ids.contiguous() if width else torch.zeros(1, dtype=torch.int64, device=dev)
        _greedy_kernel[(num_req,)](
            logits, offsets.contiguous(), ids, lengths.contiguous(), acc, tok,
            logits.stride(0), width, logits.shape[1], BLOCK=BLOCK,
        )
    return acc, tok


def rejection_sample(
    target: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    lengths: torch.Tensor,
    u_accept: torch.Tensor,
    u_draw: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`deepinfer_kit.spec.verify.ref_ops.rejection_sample` (the spec). The cumulative
    sums run per ``BLOCK`` chunk, so a draw may differ from the reference only where
    ``u * total`` falls within float64 rounding of a token boundary."""
    num_req, width = draft_ids.shape
    dev = target.device
    acc = torch.empty(num_req, dtype=torch.int64, device=dev)
    tok = torch.empty(num_req, dtype=torch.int64, device=dev)
    if num_req:
        dummy = torch.zeros(1, dtype=torch.float64, device=dev)
        _rejection_kernel[(num_req,)](
            target.contiguous(), draft_probs.contiguous() if width else dummy,
            draft_ids.contiguous() if width else dummy.long(), lengths.contiguous(),
            u_accept.contiguous() if width else dummy, u_draw.contiguous(), acc, tok,
            width, target.shape[2], BLOCK=BLOCK,
        )
    return acc, tok
