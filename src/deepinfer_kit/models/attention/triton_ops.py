# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton paged attention: one kernel for prefill, chunked prefill, decode and multi-token
decode, with an optional split of the context (split-K) for decode-heavy batches.

Same signature and semantics as ``ref_ops.paged_attention`` (the spec). A program owns one
request, one KV head and a tile of ``BLOCK_M`` query rows, where row ``m`` is query token
``m // G`` with query head ``kv_head * G + m % G``; so the ``G`` query heads sharing a KV
head read each K/V tile once (GQA). Keys are gathered per position through the block
table (``slot = table[j // P] * P + j % P``), so any block size works. Imported only when
``PagedAttention`` is built with the Triton implementation.

Per-step sizes are runtime values, so a new batch shape reuses the compiled kernel and a
CUDA graph captured with one batch replays correctly with others: the number of query
tiles is a runtime argument (never specialized), and each program computes its context
split from its own request's ``seq_lens`` entry. Only the head layout, block sizes and the
split count are ``tl.constexpr``.

The batch-invariant variant (fixed tiles, splits of a fixed key count merged in a fixed
order) lives in ``triton_invariant`` and is re-exported here as
:func:`paged_attention_invariant`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kit.models.attention import splits
from deepinfer_kit.models.attention.splits import choose_num_splits
from deepinfer_kit.models.attention.triton_invariant import paged_attention_invariant
from deepinfer_kit.models.records import AttentionMetadata

__all__ = ["paged_attention", "paged_attention_invariant", "choose_num_splits"]

@triton.jit(do_not_specialize=["table_stride", "num_m_tiles", "window"])
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_out_ptr, part_ml_ptr,
    tables_ptr, qstart_ptr, seqlen_ptr, sinks_ptr,
    sm_scale,
    q_st, q_sh, k_sb, k_sp, k_sh, v_sb, v_sp, v_sh, o_st, o_sh, table_stride,
    num_m_tiles, window,
    NUM_HQ: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0)
    kvh = tl.program_id(1)
    m_tile = tl.program_id(2) % num_m_tiles
    split = tl.program_id(2) // num_m_tiles

    q_start = tl.load(qstart_ptr + req)
    q_len = tl.load(qstart_ptr + req + 1) - q_start
    seq_len = tl.load(seqlen_ptr + req)
    row0 = m_tile * BLOCK_M
    if row0 >= q_len * GROUPS:  # past this request's rows, or a padded request (q_len 0)
        return

    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len * GROUPS
    tok = rows // GROUPS
    head = kvh * GROUPS + rows % GROUPS
    pos = seq_len - q_len + tok  # causal limit of each row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    t_idx = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + t_idx[:, None] * q_st + head[:, None] * q_sh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain

    last_tok = tl.minimum(q_len - 1, (row0 + BLOCK_M - 1) // GROUPS)
    # This request's own split length, a multiple of BLOCK_N so tiles never straddle two
    # splits; a split past the causal limit is empty and stores (m, l) = (-inf, 0).
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len - q_len + last_tok + 1)
    # sliding window: a row at p sees (p - window, p]; tiles before the tile's first row's
    # window start are skipped (the start rounded down to a tile, so splits stay aligned)
    first_pos = seq_len - q_len + row0 // GROUPS
    lo = tl.maximum(lo, ((first_pos - window + 1) // BLOCK_N) * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = tables_ptr + req.to(tl.int64) * table_stride
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        blk = tl.load(table + j // PAGE, mask=j_ok, other=0).to(tl.int64)
        off = j % PAGE
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + blk[:, None] * k_sb + off[:, None] * k_sp + kvh * k_sh + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_ptr + blk[:, None] * v_sb + off[:, None] * v_sp + kvh * v_sh + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = (j[None, :] <= pos[:, None]) & (j[None, :] > pos[:, None] - window) & j_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        if HAS_SINKS:  # the sink: one more term of the denominator, with no value
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            m_f = tl.maximum(m_i, sink)
            rescale = tl.exp2(m_i - m_f)
            l_i = l_i * rescale + tl.exp2(sink - m_f)
            acc = acc * rescale[:, None]
        res = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + t_idx[:, None] * o_st + head[:, None] * o_sh + d[None, :],
            res.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:  # partials [T, Hq, S, D] and (m, l) [T, Hq, S, 2], merged by _merge_splits_kernel
        part = (t_idx * NUM_HQ + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_ml_ptr, out_ptr, sinks_ptr, o_st, o_sh,
    NUM_HQ: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    part = (t * NUM_HQ + h) * NUM_SPLITS + s
    m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_all = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m_all, sink)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_all))  # empty splits weigh 0
    den = tl.sum(l_s * w, 0)
    if HAS_SINKS:
        den += tl.exp2(sink - m_all)
    res = tl.sum(acc * w[:, None], 0) / tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + t * o_st + h * o_sh + d, res.to(out_ptr.dtype.element_ty), mask=d_ok)


def tile_config(max_query_len: int, groups: int, head_dim: int, on_cuda: bool) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_D)`` of the attention kernel: 16 query rows per tile when
    a request's rows (query tokens x the GQA group) fit in 16 (decode, short verify), else
    64; 64 keys per tile on CUDA (32 under the interpreter); the head padded to a power of
    two. A function of sizes only, so warm-up and capture see the launches serving does.
    The shared memory each needs on sm_90 is checked by compiling it for that target
    (``tests/engine/test_kernel_smem.py``)."""
    block_m = 16 if max_query_len * groups <= 16 else 64
    block_n = 64 if on_cuda else 32
    return block_m, block_n, max(16, triton.next_power_of_2(head_dim))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    *,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention; see ``ref_ops.paged_attention`` for the contract.

    ``sliding_window``: a row at position ``p`` attends to ``(p - W, p]`` (key tiles wholly
    before the window are not read); ``None``: the whole causal context. ``sinks``: ``[Hq]``
    attention-sink logits on the query's device, as in ``ref_ops.paged_attention`` (one
    more denominator term per head, folded in after the keys or at the split merge).
    ``num_splits`` forces the split-K factor (``None``: ``splits.choose_num_splits`` with
    ``splits.split_target`` of the device; warm-up enumerates the same choices). fp32
    inputs use IEEE fp32 dot products (no TF32), so they match the reference tightly.

    Of the host fields of ``meta`` only ``num_requests`` and ``max_query_len`` (which
    must bound every request's query length: it sizes the grid) are read, plus
    ``max_seq_len`` when ``num_splits`` is ``None``; the kernel takes every context
    length from ``meta.seq_lens`` on the device. So the call is correct with a stale or
    too large ``max_seq_len`` (a replayed CUDA graph). A request with query length 0 (a
    padded row) writes nothing.

    Returns:
        ``[T, Hq, D]`` in ``query.dtype``.
    """
    window = sliding_window if sliding_window is not None else 1 << 30
    num_tokens, num_hq, head_dim = query.shape
    page, num_hkv = key_cache.shape[1], key_cache.shape[2]
    groups = num_hq // num_hkv
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(meta, num_hkv, splits.split_target(query.device))
    block_m, block_n, block_d = tile_config(meta.max_query_len, groups, head_dim, query.is_cuda)
    num_m_tiles = max(1, triton.cdiv(meta.max_query_len * groups, block_m))
    if num_splits > 1:
        part_out = torch.empty(
            (num_tokens, num_hq, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_ml = torch.empty(
            (num_tokens, num_hq, num_splits, 2), dtype=torch.float32, device=query.device
        )
    else:
        part_out = part_ml = out  # unused by the kernel when NUM_SPLITS == 1
    sink_arg = sinks.contiguous() if sinks is not None else out  # unread when there are none
    grid = (meta.num_requests, num_hkv, num_m_tiles * num_splits)
    _paged_attn_kernel[grid](
        query, key_cache, value_cache, out, part_out, part_ml,
        meta.block_tables, meta.query_start_loc, meta.seq_lens, sink_arg,
        scale,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        out.stride(0), out.stride(1), meta.block_tables.stride(0),
        num_m_tiles, window,
        NUM_HQ=num_hq, GROUPS=groups, HEAD_DIM=head_dim, PAGE=page,
        NUM_SPLITS=num_splits, HAS_SINKS=sinks is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION="ieee" if query.dtype == torch.float32 else None,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_hq)](
            part_out, part_ml, out, sink_arg, out.stride(0), out.stride(1),
            NUM_HQ=num_hq, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, HAS_SINKS=sinks is not None,
        )  # fmt: skip
    return out

