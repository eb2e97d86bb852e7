"""Batch-invariant paged attention in torch (the CPU path of ``batch_invariant=True``):
each query row's output is bitwise the same whatever else the batch holds, however its
request's query is chunked (a decode row, a verify row, a prefill chunk of any size) and
whether its keys were cached.

How: a row's keys are read in chunks of :data:`CHUNK_KEYS` positions from position 0; the
scores of a chunk are one ``[rows, D] x [D, CHUNK_KEYS]`` product (``D`` and the chunk
fixed, the rows padded to at least ``invariant.MIN_ROWS``: each row summed alike at any
row count); the row's maximum is exact whatever the order; each chunk's exponentials are
summed over exactly ``CHUNK_KEYS`` positions (masked ones are exact zeros) and multiplied
into the values by another fixed-shape product; the chunks' partial sums are accumulated
one after the other in chunk order; chunks past the row's own last one (other rows' longer
contexts in the same call) hold exact zeros, so adding them changes no bit. Requests are grouped into
calls for speed; the grouping changes no row's arithmetic.

Same signature as ``ref_ops.paged_attention`` (the default reference, the test oracle);
shape symbols as there: ``T`` new tokens, ``R`` requests, ``NB`` blocks, ``P`` block size,
``Hq``/``Hkv`` heads, ``G = Hq / Hkv``, ``D`` head dim.
"""

from __future__ import annotations

import torch

from deepinfer_kit.models.invariant import MIN_ROWS
from deepinfer_kit.models.records import AttentionMetadata

__all__ = ["paged_attention", "CHUNK_KEYS"]

CHUNK_KEYS = 64
"""Key positions per chunk (fixed: a row's sums never depend on the batch)."""

_ROW_BLOCK = 128
"""Query tokens of one request per call (bounds the scores' memory on long prefills)."""

_GROUP_KEYS = 1 << 14
"""Key positions (requests x padded context) gathered per call of short queries."""


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each new token over its request's cached context, batch-invariant.

    Token ``i`` of request ``r`` sits at position ``p = seq_lens[r] - Q_r + i`` and attends
    to positions ``j <= p`` (and ``j > p - sliding_window`` when given); the new tokens'
    K/V must already be in the cache.

    Args:
        query: ``[T, Hq, D]``, rows ordered as ``meta.query_start_loc``.
        key_cache, value_cache: ``[NB, P, Hkv, D]`` one layer of the pool (slots never
            written must hold finite values: the pool is zero-initialised).
        meta: the batch layout.
        scale: multiplies ``q . k``.
        sliding_window: attend to at most this many most recent positions, or ``None``.

    Returns:
        ``[T, Hq, D]`` in ``query.dtype``. Mutates nothing.
    """
    out = torch.empty_like(query)
    qlens, slens = meta.query_lens_host, meta.seq_lens_host
    start, pieces = 0, []
    for r, (q, s) in enumerate(zip(qlens, slens)):
        for lo in range(0, q, _ROW_BLOCK):
            hi = min(q, lo + _ROW_BLOCK)
            # (request, first token row, rows, context length the rows need)
            pieces.append((r, start + lo, hi - lo, s - q + hi))
        start += q
    group: list[tuple[int, int, int, int]] = []
    keys = 0
    for piece in sorted(pieces, key=lambda p: -p[3]):
        width = -(-piece[3] // CHUNK_KEYS) * CHUNK_KEYS
        if group and (len(group) + 1) * max(keys, width) > _GROUP_KEYS:
            _attend(query, key_cache, value_cache, meta, group, scale, sliding_window, out)
            group, keys = [], 0
        group.append(piece)
        keys = max(keys, width)
    if group:
        _attend(query, key_cache, value_cache, meta, group, scale, sliding_window, out)
    return out


def _attend(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    pieces: list[tuple[int, int, int, int]],
    scale: float,
    window: int | None,
    out: torch.Tensor,
) -> None:
    """The rows of ``pieces`` (request, first row, rows, keys needed) in one call."""
    dev = query.device
    page, hkv, d = key_cache.shape[1:]
    hq = query.shape[1]
    g = hq // hkv
    num = len(pieces)
    reqs = torch.tensor([p[0] for p in pieces], dtype=torch.int64, device=dev)
    first = torch.tensor([p[1] for p in pieces], dtype=torch.int64, device=dev)
    counts = torch.tensor([p[2] for p in pieces], dtype=torch.int64, device=dev)
    needed = torch.tensor([p[3] for p in pieces], dtype=torch.int64, device=dev)
    qmax = max(p[2] for p in pieces)
    chunks = -(-max(p[3] for p in pieces) // CHUNK_KEYS)
    width = chunks * CHUNK_KEYS
    rows = max(MIN_ROWS, qmax * g)

    # keys and values of positions [0, width) of each piece's request (past its context:
    # slot 0 of the pool, finite and masked)
    pos = torch.arange(width, device=dev)
    tables = meta.block_tables.long()[reqs]  # [n, max_blocks]
    col = (pos // page).clamp_(max=tables.shape[1] - 1)
    slots = tables[:, col] * page + pos % page
    slots = torch.where(pos[None, :] < needed[:, None], slots, torch.zeros_like(slots))
    flat = slots.reshape(-1)
    k = key_cache.reshape(-1, hkv, d).index_select(0, flat).float().view(num, width, hkv, d)
    v = value_cache.reshape(-1, hkv, d).index_select(0, flat).float().view(num, width, hkv, d)

    # query rows: the G heads of a KV head are its rows (`real` of them), padded to `rows`
    # for the products only
    real = qmax * g
    step = torch.arange(qmax, device=dev)
    valid = step[None, :] < counts[:, None]  # [n, Qmax]
    token = first[:, None] + torch.minimum(step[None, :], counts[:, None] - 1)
    q = query[token].float().view(num, qmax, hkv, g, d).permute(0, 2, 1, 3, 4)
    q = q.reshape(num, hkv, real, d)
    if rows > real:
        q = torch.cat([q, q.new_zeros(num, hkv, rows - real, d)], dim=2)
    position = (needed - counts)[:, None] + torch.minimum(step[None, :], counts[:, None] - 1)  # [n, Qmax]
    row_pos = position[:, :, None].expand(num, qmax, g).reshape(num, real)

    # scores of every chunk in one product per (piece, head): [rows, D] x [D, W] (a row's
    # result does not depend on W, a multiple of the chunk, nor on the row count >= rows);
    # one call per KV head reads the gathered keys in place (rows hkv * D apart)
    qh = q.reshape(num, hkv, rows, d)
    scores = torch.stack([torch.bmm(qh[:, h], k[:, :, h].transpose(1, 2)) for h in range(hkv)], dim=1)
    scores = scores.view(num, hkv, rows, chunks, CHUNK_KEYS)[:, :, :real].permute(0, 1, 3, 2, 4)
    scores = scores.mul(scale)  # [n, Hkv, C#, real, C]
    key_pos = (torch.arange(chunks, device=dev)[:, None] * CHUNK_KEYS
               + torch.arange(CHUNK_KEYS, device=dev)[None, :])  # [C#, C]
    rp = row_pos[:, None, None, :, None]
    visible = key_pos[None, None, :, None, :] <= rp
    if window is not None:
        visible &= key_pos[None, None, :, None, :] > rp - window
    scores.masked_fill_(~visible, float("-inf"))
    peak = scores.amax(dim=(2, 4), keepdim=True)  # [n, Hkv, 1, real, 1], exact
    # the exponentials, written into the products' operand (rows past `real` stay zeros)
    padded = scores.new_zeros(num, hkv, chunks, rows, CHUNK_KEYS)
    probs = torch.exp(scores.sub_(peak), out=padded[:, :, :, :real])
    # chunk partial sums added in chunk order, one chunk after the other: chunks past a
    # row's own last one hold exact zeros (masked), so adding them changes no bit, and a
    # row's sums never depend on how many chunks the call spans
    sums = probs.sum(dim=-1)  # [n, Hkv, C#, real], each over exactly CHUNK_KEYS positions
    denom = sums[:, :, 0].clone()
    for c in range(1, chunks):
        denom += sums[:, :, c]
    vc = v.view(num, chunks, CHUNK_KEYS, hkv, d)
    heads_out = []
    for h in range(hkv):  # one fixed-shape [rows, C] x [C, D] product per chunk
        pv = torch.bmm(padded[:, h].reshape(num * chunks, rows, CHUNK_KEYS),
                       vc[:, :, :, h].reshape(num * chunks, CHUNK_KEYS, d)).view(num, chunks, rows, d)
        acc = pv[:, 0, :real].clone()
        for c in range(1, chunks):
            acc += pv[:, c, :real]
        heads_out.append(acc)
    res = torch.stack(heads_out, dim=1) / denom[..., None]  # [n, Hkv, Qmax * G, D]
    res = res.view(num, hkv, qmax, g, d).permute(0, 2, 1, 3, 4).reshape(num, qmax, hq, d)
    out[token[valid]] = res[valid].to(out.dtype)
