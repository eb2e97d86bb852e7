# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Batch-invariant Triton paged attention: each query row's output is bitwise the same
whatever else the batch holds and however its request's query is chunked.

Same contract as ``ref_ops.paged_attention``; re-exported as
``triton_ops.paged_attention_invariant`` (what ``PagedAttention(batch_invariant=True)``
runs on the Triton path). What the default kernel (``triton_ops``) lets the batch decide,
this one fixes:

* **Tiles.** ``BLOCK_M`` (query rows per program), ``BLOCK_N`` (keys per step) and
  ``BLOCK_D`` follow from the head layout and the device only (:func:`invariant_tile_config`),
  the same for a decode row, a verify chunk and a prefill chunk.
* **Splits.** A row's keys are cut into splits at fixed multiples of
  ``splits.INVARIANT_SPLIT_KEYS`` (never ``seq_len / count``). Each split's ``(m, l, acc)``
  starts fresh and walks its keys in ``BLOCK_N`` steps from the split's start; a step the
  row cannot see (past its causal limit) leaves its state exactly as it was. The splits
  are merged in increasing order by one rule (the same expressions in both kernels, with
  explicit ``fma`` so that no contraction is left to the compiler, and an IEEE division
  at the end), either in the query tile's own program or, when the batch has few
  programs, by a second kernel over partials written by one program per split. Folding a
  split into an empty state gives the split itself, and an empty split leaves a state
  bitwise unchanged, so both give the same bits: the parallelism is the batch's choice,
  the arithmetic is the row's own. (The merge is written out in both kernels rather than
  shared through a ``@triton.jit`` helper: the interpreter re-patches Triton on every
  helper call, which made the CPU tests several times slower.)
* **Counts.** The number of split programs (``splits.invariant_num_splits`` of the
  batch's longest context) and of query tiles are runtime arguments, never specialized,
  so no count compiles a kernel of its own; a shorter row's extra splits are empty and
  merge as exact no-ops (``m = -inf, l = 0, acc = 0``).

Imported only with the Triton implementation (``import deepinfer_kit`` never imports
Triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kit.models.attention import splits
from deepinfer_kit.models.records import AttentionMetadata

__all__ = ["paged_attention_invariant", "invariant_tile_config"]


@triton.jit(do_not_specialize=["table_stride", "num_m_tiles", "grid_splits"])
def _invariant_attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_out_ptr, part_ml_ptr,
    tables_ptr, qstart_ptr, seqlen_ptr,
    sm_scale,
    q_st, q_sh, k_sb, k_sp, k_sh, v_sb, v_sp, v_sh, o_st, o_sh, table_stride,
    num_m_tiles, grid_splits,
    NUM_HQ: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Program ``(request, kv head, m_tile + split * num_m_tiles)``. With ``grid_splits
    == 1`` it merges all its tile's splits and stores the output; else it runs split
    ``split`` (the last split program also any splits past the grid) and stores the state
    as partial ``split`` ([T, Hq, grid_splits, D] and [T, Hq, grid_splits, 2])."""
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
    limit = seq_len - q_len + last_tok + 1  # keys [0, limit) are visible to some row here
    tile_splits = tl.cdiv(limit, SPLIT_KEYS)
    # one split per program; the last program (the only one when grid_splits == 1) also
    # takes every split past the grid
    end = tl.where(split == grid_splits - 1, tl.maximum(tile_splits, split + 1), split + 1)

    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_M], tl.float32)
    acc_run = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = tables_ptr + req.to(tl.int64) * table_stride
    for s_idx in range(split, end):
        lo = s_idx * SPLIT_KEYS
        hi = tl.minimum(lo + SPLIT_KEYS, limit)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
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
            s = tl.where((j[None, :] <= pos[:, None]) & j_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            # a step this row cannot see keeps (m, l, acc) exactly: alpha is 1, p is 0
            alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_safe))
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        # fold the split into the running state (the merge rule, as _invariant_merge_kernel)
        m_new = tl.maximum(m_run, m_i)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (-inf) - (-inf) is never formed
        a = tl.where(m_run == m_new, 1.0, tl.exp2(m_run - m_safe))
        b = tl.where(m_i == m_new, 1.0, tl.exp2(m_i - m_safe))
        l_run = tl.fma(l_i, b, l_run * a)
        acc_run = tl.fma(acc, b[:, None], acc_run * a[:, None])
        m_run = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if grid_splits == 1:
        tl.store(
            out_ptr + t_idx[:, None] * o_st + head[:, None] * o_sh + d[None, :],
            tl.math.div_rn(acc_run, tl.where(l_run == 0.0, 1.0, l_run)[:, None])
            .to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        part = (t_idx * NUM_HQ + head) * grid_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], acc_run, mask=out_mask)
        tl.store(part_ml_ptr + part * 2, m_run, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_run, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _invariant_merge_kernel(
    part_out_ptr, part_ml_ptr, out_ptr, o_st, o_sh, num_splits,
    NUM_HQ: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program ``(token, query head)``: folds the ``num_splits`` partials in increasing
    order by the merge rule of the tile program (the same expressions), then divides."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m_run = tl.full([1], float("-inf"), tl.float32)
    l_run = tl.zeros([1], tl.float32)
    acc_run = tl.zeros([1, BLOCK_D], tl.float32)
    base = (t * NUM_HQ + h) * num_splits
    for s_idx in range(0, num_splits):
        part = base + s_idx
        m_s = tl.load(part_ml_ptr + part * 2 + tl.zeros([1], tl.int64))
        l_s = tl.load(part_ml_ptr + part * 2 + 1 + tl.zeros([1], tl.int64))
        acc_s = tl.load(part_out_ptr + part * HEAD_DIM + d[None, :], mask=d_ok[None, :], other=0.0)
        # the merge rule, as the tile program folds its own splits
        m_new = tl.maximum(m_run, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.where(m_run == m_new, 1.0, tl.exp2(m_run - m_safe))
        b = tl.where(m_s == m_new, 1.0, tl.exp2(m_s - m_safe))
        l_run = tl.fma(l_s, b, l_run * a)
        acc_run = tl.fma(acc_s, b[:, None], acc_run * a[:, None])
        m_run = m_new
    res = tl.math.div_rn(acc_run, tl.where(l_run == 0.0, 1.0, l_run)[:, None])
    tl.store(out_ptr + t * o_st + h * o_sh + d[None, :], res.to(out_ptr.dtype.element_ty),
             mask=d_ok[None, :])


def invariant_tile_config(groups: int, head_dim: int, on_cuda: bool) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_D)`` of the invariant kernel, asked by
    :func:`paged_attention_invariant` at every call: at least 16 query rows (a whole GQA
    group), 64 keys per step on CUDA (32 under the interpreter), the head padded to a power
    of two. A function of the model's head layout and the device only, never of a batch's
    sizes. ``splits.INVARIANT_SPLIT_KEYS`` is a multiple of both key steps. Pure."""
    block_m = max(16, triton.next_power_of_2(groups))
    return block_m, 64 if on_cuda else 32, max(16, triton.next_power_of_2(head_dim))


def paged_attention_invariant(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    *,
    split_programs: bool | None = None,
) -> torch.Tensor:
    """Causal paged attention whose every output row depends only on its own query, its
    request's keys and values up to its position, and ``scale``; see
    ``ref_ops.paged_attention`` for the contract (the module docstring for how).

    Called by ``PagedAttention(batch_invariant=True)`` on the Triton path, once per layer
    and step. Mutates nothing but the new output. fp32 inputs use IEEE fp32 dot products
    (no TF32).

    Args:
        query: ``[T, Hq, D]`` on CUDA (or the CPU under the interpreter).
        key_cache, value_cache: ``[NB, P, Hkv, D]``, same dtype and device.
        meta: the batch layout. Of its host fields, ``num_requests`` and
            ``max_query_len`` (which must bound every query length) size the grid, and
            ``max_seq_len`` the split programs: it must bound every ``seq_lens`` entry
            (a replayed CUDA graph's larger bound is fine: the extra splits are empty);
            an understated one stays correct (the last split program takes the rest)
            but is no longer bitwise invariant. A request with query length 0 writes
            nothing.
        scale: multiplies ``q . k``.
        sliding_window: must be ``None``.
        split_programs: spread each row's splits over programs (partials merged by a
            second kernel), or merge them in the query tile's program; ``None`` chooses by
            ``splits.invariant_split_programs`` (only decode-like batches with few
            programs split). The output is bitwise the same either way.

    Returns:
        ``[T, Hq, D]`` in ``query.dtype``.

    Raises:
        ValueError: ``sliding_window`` is given.
    """
    if sliding_window is not None:
        raise ValueError("the Triton paged attention does not implement sliding_window")
    num_tokens, num_hq, head_dim = query.shape
    page, num_hkv = key_cache.shape[1], key_cache.shape[2]
    groups = num_hq // num_hkv
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    block_m, block_n, block_d = invariant_tile_config(groups, head_dim, query.is_cuda)
    num_m_tiles = max(1, triton.cdiv(meta.max_query_len * groups, block_m))
    if split_programs is None:
        split_programs = splits.invariant_split_programs(
            meta.max_query_len, meta.num_requests, meta.max_seq_len, num_hkv,
            splits.split_target(query.device))  # fmt: skip
    grid_splits = splits.invariant_num_splits(meta.max_seq_len) if split_programs else 1
    shape = (num_tokens, num_hq, grid_splits) if grid_splits > 1 else (1, 1, 1)
    part_out = torch.empty((*shape, head_dim), dtype=torch.float32, device=query.device)
    part_ml = torch.empty((*shape, 2), dtype=torch.float32, device=query.device)
    grid = (meta.num_requests, num_hkv, num_m_tiles * grid_splits)
    _invariant_attn_kernel[grid](
        query, key_cache, value_cache, out, part_out, part_ml,
        meta.block_tables, meta.query_start_loc, meta.seq_lens,
        scale,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        out.stride(0), out.stride(1), meta.block_tables.stride(0),
        num_m_tiles, grid_splits,
        NUM_HQ=num_hq, GROUPS=groups, HEAD_DIM=head_dim, PAGE=page,
        SPLIT_KEYS=splits.INVARIANT_SPLIT_KEYS,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION="ieee" if query.dtype == torch.float32 else None,
    )  # fmt: skip
    if grid_splits > 1:
        _invariant_merge_kernel[(num_tokens, num_hq)](
            part_out, part_ml, out, out.stride(0), out.stride(1), grid_splits,
            NUM_HQ=num_hq, HEAD_DIM=head_dim, BLOCK_D=block_d,
        )  # fmt: skip
    return out
