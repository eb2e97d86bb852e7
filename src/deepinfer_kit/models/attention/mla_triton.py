# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton kernel of the absorbed MLA attention: multi-query attention of absorbed queries
over the latent rows, the latent part read once per key tile as both key and value.

Same signature and semantics as ``mla_ref.latent_attention`` (the spec). A program owns
one query token of one request and a tile of ``BLOCK_H`` heads; it walks the token's
causal context in tiles of ``BLOCK_N`` keys, gathering each key's row through the block
table, scores ``q_latent . c + q_rope . k_rope`` (two dots: the latent and rotary dims
apart, each padded to a power of two), and accumulates ``p @ c`` with an online softmax.
The generic paged kernel would hold the whole ``C + dr`` row as one head (576 dims for
DeepSeek-V3: more shared memory than an H200 has) and also sum the rotary value dims.

Only ``meta.num_requests`` and ``meta.max_query_len`` (the grid) are read on the host;
context lengths come from ``meta.seq_lens`` on the device, so a captured decode graph
replays with any lengths. No split of the context: one program per (token, head tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kit.models.records import AttentionMetadata

__all__ = ["latent_attention"]

BLOCK_H = 16
"""Heads per program (``tl.dot`` needs 16 rows)."""


@triton.jit(do_not_specialize=["table_stride"])
def _latent_attn_kernel(
    q_ptr, rows_ptr, out_ptr, tables_ptr, qstart_ptr, seqlen_ptr, sm_scale,
    q_st, q_sh, r_sb, r_sp, o_st, o_sh, table_stride,
    NUM_HQ: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0)
    tok = tl.program_id(2)
    q_start = tl.load(qstart_ptr + req)
    q_len = tl.load(qstart_ptr + req + 1) - q_start
    if tok >= q_len:  # past this request's tokens (or a padded request)
        return
    pos = tl.load(seqlen_ptr + req) - q_len + tok  # the causal limit
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < NUM_HQ
    c = tl.arange(0, BLOCK_C)
    c_ok = c < LATENT
    r = tl.arange(0, BLOCK_R)
    r_ok = r < ROPE
    row = (q_start + tok).to(tl.int64)
    q_base = q_ptr + row * q_st + heads[:, None] * q_sh
    q_lat = tl.load(q_base + c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    q_rot = tl.load(q_base + LATENT + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
    for start in range(0, pos + 1, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n <= pos
        block = tl.load(tables_ptr + req * table_stride + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        base = rows_ptr + block * r_sb + (n % PAGE) * r_sp
        k_lat = tl.load(base[:, None] + c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
        k_rot = tl.load(base[:, None] + LATENT + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
        s += tl.dot(q_rot, tl.trans(k_rot), input_precision=PRECISION)
        s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat, input_precision=PRECISION)
        m_i = m_new
    res = acc / l_i[:, None]
    tl.store(out_ptr + row * o_st + heads[:, None] * o_sh + c[None, :], res.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & c_ok[None, :])


def latent_attention(query: torch.Tensor, rows: torch.Tensor, meta: AttentionMetadata, scale: float,
                     latent_dim: int) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, Hq, C + dr]`` over the latent rows ``[NB, P, 1,
    C + dr]``, values the rows' first ``C`` dims; see ``mla_ref.latent_attention``.

    Returns:
        ``[T, Hq, C]`` in ``query.dtype`` (fp32 inputs use IEEE fp32 dot products).
        Mutates nothing.
    """
    tokens, heads, width = query.shape
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty((tokens, heads, latent_dim), dtype=query.dtype, device=query.device)
    if tokens == 0:
        return out
    rope = width - latent_dim
    on_cuda = query.is_cuda
    grid = (meta.num_requests, triton.cdiv(heads, BLOCK_H), max(meta.max_query_len, 1))
    _latent_attn_kernel[grid](
        query, rows, out, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
        query.stride(0), query.stride(1), rows.stride(0), rows.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0),
        NUM_HQ=heads, LATENT=latent_dim, ROPE=rope, PAGE=rows.shape[1], BLOCK_H=BLOCK_H,
        BLOCK_N=32 if on_cuda else 16, BLOCK_C=max(16, triton.next_power_of_2(latent_dim)),
        BLOCK_R=max(16, triton.next_power_of_2(rope)),
        PRECISION="ieee" if query.dtype == torch.float32 else None,
    )  # fmt: skip
    return out
