"""Torch reference of paged attention: gather each request's context from its block table,
then masked causal attention with fp32 accumulation.

The spec and test oracle of ``triton_ops.py`` (same signature), and the path that runs on
CPU. Requests with short queries (decode, speculative verification) are batched into one
padded attention call; longer ones (prefill chunks) run one request at a time through
``scaled_dot_product_attention``. Shape symbols: ``T`` new tokens, ``R`` requests, ``NB``
blocks, ``P`` block size, ``Hq`` query heads, ``Hkv`` KV heads, ``G = Hq / Hkv``, ``D``
head dim, ``S`` context length, ``Q`` query length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_kit.models.records import AttentionMetadata

__all__ = ["paged_attention", "BATCHED_MAX_QUERY_LEN"]

BATCHED_MAX_QUERY_LEN = 16
"""Requests with at most this many new tokens go through the batched (padded) path."""


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each new token over its request's cached context.

    New token ``i`` of request ``r`` sits at position ``p = seq_lens[r] - Q_r + i`` and
    attends to positions ``j <= p`` (and ``j > p - sliding_window`` when given). The new
    tokens' K/V must already be in the cache.

    Args:
        query: ``[T, Hq, D]``, rows ordered as ``meta.query_start_loc``.
        key_cache, value_cache: ``[NB, P, Hkv, D]`` one layer of the pool; slots that are
            never written must hold finite values (the pool is zero-initialised).
        meta: the batch layout; ``block_tables`` covers every request's ``seq_lens``.
        scale: multiplies ``q . k`` (usually ``D ** -0.5``).
        sliding_window: attend to at most this many most recent positions, or ``None``.

    Returns:
        ``[T, Hq, D]`` in ``query.dtype``.
    """
    out = torch.empty_like(query)
    qlens = meta.query_lens_host
    short = [r for r, q in enumerate(qlens) if 0 < q <= BATCHED_MAX_QUERY_LEN]
    if short:
        _attend_batched(query, key_cache, value_cache, meta, short, scale, sliding_window, out)
    if meta.max_query_len > BATCHED_MAX_QUERY_LEN:
        starts = _host_starts(qlens)
        for r, qlen in enumerate(qlens):
            if qlen > BATCHED_MAX_QUERY_LEN:
                _attend_one(
                    query, key_cache, value_cache, meta, r, starts[r], scale, sliding_window, out
                )
    return out


def _host_starts(qlens: list[int]) -> list[int]:
    starts = [0] * len(qlens)
    for r in range(1, len(qlens)):
        starts[r] = starts[r - 1] + qlens[r - 1]
    return starts


def _attend_one(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    r: int,
    start: int,
    scale: float,
    window: int | None,
    out: torch.Tensor,
) -> None:
    """One request, exact context length, via SDPA (memory efficient for long prefill)."""
    qlen, slen = meta.query_lens_host[r], meta.seq_lens_host[r]
    p = key_cache.shape[1]
    blocks = meta.block_tables[r, : -(-slen // p)].long()
    k = key_cache[blocks].flatten(0, 1)[:slen].transpose(0, 1).float()  # [Hkv, S, D]
    v = value_cache[blocks].flatten(0, 1)[:slen].transpose(0, 1).float()
    q = query[start : start + qlen].transpose(0, 1).float()  # [Hq, Q, D]
    groups = q.shape[0] // k.shape[0]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=0)
        v = v.repeat_interleave(groups, dim=0)
    if qlen == slen and window is None:
        res = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        pos = torch.arange(slen - qlen, slen, device=query.device)[:, None]
        mask = _allowed(pos, torch.arange(slen, device=query.device), window)
        res = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out[start : start + qlen] = res.transpose(0, 1).to(out.dtype)


def _allowed(pos: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """Bool mask: key position ``keys`` is visible from query position ``pos`` (broadcast)."""
    mask = keys <= pos
    if window is not None:
        mask &= keys > pos - window
    return mask


def _attend_batched(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    reqs: list[int],
    scale: float,
    window: int | None,
    out: torch.Tensor,
) -> None:
    """Requests ``reqs`` padded to ``[R, Qmax]`` queries and ``[R, Smax]`` keys, one matmul."""
    dev = query.device
    p, hkv, d = key_cache.shape[1:]
    hq = query.shape[1]
    g = hq // hkv
    qmax = max(meta.query_lens_host[r] for r in reqs)
    smax = max(meta.seq_lens_host[r] for r in reqs)
    nblk = -(-smax // p)
    rows_all = len(reqs) == meta.num_requests
    sel = slice(None) if rows_all else torch.tensor(reqs, dtype=torch.int64, device=dev)
    tables = meta.block_tables[sel, :nblk].long()
    seq_lens = meta.seq_lens[sel].long()
    qsl = meta.query_start_loc.long()
    starts, qlens = qsl[:-1][sel], (qsl[1:] - qsl[:-1])[sel]
    nreq = tables.shape[0]

    # [R, Hkv, Smax', D]: keys padded to whole blocks; masked below.
    k = key_cache[tables].view(nreq, nblk * p, hkv, d).transpose(1, 2).float()
    v = value_cache[tables].view(nreq, nblk * p, hkv, d).transpose(1, 2).float()
    step = torch.arange(qmax, device=dev)
    if qmax == 1:
        rows = starts[:, None]
    else:  # padded query rows repeat the request's last token; their output is dropped
        rows = starts[:, None] + torch.minimum(step, qlens[:, None] - 1)
    q = query[rows].float()  # [R, Qmax, Hq, D]
    q = q.view(nreq, qmax, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(nreq, hkv, qmax * g, d)

    pos = (seq_lens - qlens)[:, None] + torch.minimum(step, qlens[:, None] - 1)  # [R, Qmax]
    keys = torch.arange(nblk * p, device=dev)
    mask = _allowed(pos[:, :, None], keys, window)  # [R, Qmax, Smax']
    mask = mask[:, None, :, None, :].expand(nreq, 1, qmax, g, nblk * p)
    mask = mask.reshape(nreq, 1, qmax * g, nblk * p)

    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    scores.masked_fill_(~mask, float("-inf"))
    res = torch.matmul(torch.softmax(scores, dim=-1), v)  # [R, Hkv, Qmax * G, D]
    res = res.view(nreq, hkv, qmax, g, d).permute(0, 2, 1, 3, 4).reshape(nreq, qmax, hq, d)
    res = res.to(out.dtype)
    if qmax == 1 and rows_all:
        out.copy_(res.view_as(out))
    elif qmax == 1:
        out[rows[:, 0]] = res[:, 0]
    else:
        valid = step[None, :] < qlens[:, None]
        out[rows[valid]] = res[valid]
