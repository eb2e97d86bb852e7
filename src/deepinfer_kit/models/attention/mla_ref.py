"""Multi-head latent attention (MLA, DeepSeek-V3) over a keys-only latent pool: the torch
reference of its two forms and how a step's requests are split between them.

Each cached row is ``[latent (C), rotated shared key (dr)]``, one per token and layer
(``PagedKVCache(..., 1, C + dr, keys_only=True)``). ``kv_b_proj``'s weight ``[Hq * (dn +
dv), C]`` expands a latent into head ``h``'s no-RoPE key ``W_uk[h] c`` (``dn`` dims) and
value ``W_uv[h] c`` (``dv`` dims). Head ``h`` of a query ``(q_nope, q_rope)`` scores a
context row ``(c, k_rope)`` by ``q_nope . W_uk[h] c + q_rope . k_rope``; both forms compute
that and the softmax-weighted values exactly, in two association orders:

- expanded (:func:`expanded_attention`, prefill): gather the context rows, expand them
  through ``kv_b_proj`` into per-head keys ``[S, Hq, dn + dr]`` and values ``[S, Hq, dv]``,
  causal attention. ``O(S * C * Hq * (dn + dv))`` for the expansion, then
  ``O(Q * S * Hq * (dn + dr + dv))``;
- absorbed (:func:`absorbed_attention`, decode): fold ``W_uk`` into the query
  (``q_latent[h] = W_uk[h]^T q_nope[h]``), attend with ``[q_latent, q_rope]`` to the rows
  themselves (multi-query attention: one KV head of ``C + dr`` dims, the latent part as the
  value), then ``W_uv[h]`` on each head's latent output. No per-head K/V is materialised;
  ``O(Q * S * Hq * (2 C + dr))``. The attention over the rows is :func:`latent_attention`
  (the reference: the kit's paged attention with the rows as keys and values, which also
  sums the ``dr`` rotary value dims it then drops) or the Triton kernel of the same
  signature (``mla_triton``), chosen once by :func:`select_latent_op`.

The absorbed form expands nothing but reads ``2 C + dr`` dims per (query, key) pair; the
expanded form pays the expansion once per context token, then ``dn + dr + dv`` per pair:
absorbed suits few query tokens, expanded long chunks. :func:`split_forms` sends requests
with at most ``max_absorbed`` new tokens (decodes) to the absorbed form and the rest
(prefill chunks) to the expanded one.
Shape symbols: ``T`` new tokens, ``R`` requests, ``Hq`` heads, ``NB`` blocks, ``P`` block
size, ``S`` context length, ``Q`` query length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import attrs
import torch
import torch.nn.functional as F

from deepinfer_kit._kernels import resolve_impl
from deepinfer_kit.models.attention.ref_ops import paged_attention
from deepinfer_kit.models.records import AttentionMetadata

__all__ = ["FormSplit", "split_forms", "expanded_attention", "absorbed_attention", "LatentOp",
           "latent_attention", "select_latent_op"]

LatentOp = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float, int], torch.Tensor]
"""``op(query [T, Hq, C + dr], rows [NB, P, 1, C + dr], meta, scale, C) -> [T, Hq, C]``:
:func:`latent_attention` or its Triton kernel."""


@attrs.frozen(slots=True)
class FormSplit:
    """Which requests of a step take which form (host-side; see :func:`split_forms`).

    Attributes:
        absorbed: the layout of the absorbed requests alone (``meta`` itself when every
            request is absorbed), ``None`` when none is.
        absorbed_rows: ``[T_a]`` int64 rows of the step's tokens that ``absorbed`` lays out,
            in its order; ``None`` when those are all the step's rows.
        expanded: ``(request, first row)`` of each expanded request.
    """

    absorbed: AttentionMetadata | None
    absorbed_rows: torch.Tensor | None
    expanded: tuple[tuple[int, int], ...]


def split_forms(meta: AttentionMetadata, max_absorbed: int) -> FormSplit:
    """Split a step's requests: query length ``<= max_absorbed`` -> absorbed, longer ->
    expanded. A step of only absorbed requests (a decode round, captured or not) keeps
    ``meta`` and reads nothing but ``meta.max_query_len``; a mixed step builds the absorbed
    requests' own metadata (host lists, a few small device gathers). Called once per layer
    forward; mutates nothing."""
    if meta.max_query_len <= max_absorbed:
        return FormSplit(meta, None, ())
    qlens = meta.query_lens_host
    starts = [0] * len(qlens)
    for r in range(1, len(qlens)):
        starts[r] = starts[r - 1] + qlens[r - 1]
    expanded = tuple((r, starts[r]) for r, q in enumerate(qlens) if q > max_absorbed)
    picked = [r for r, q in enumerate(qlens) if 0 < q <= max_absorbed]
    if not picked:
        return FormSplit(None, None, expanded)
    dev = meta.seq_lens.device
    rows = [i for r in picked for i in range(starts[r], starts[r] + qlens[r])]
    row_ids = torch.tensor(rows, dtype=torch.int64, device=dev)
    sel = torch.tensor(picked, dtype=torch.int64, device=dev)
    sub_q = [qlens[r] for r in picked]
    sub_s = [meta.seq_lens_host[r] for r in picked]
    loc = [0]
    for q in sub_q:
        loc.append(loc[-1] + q)
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping[row_ids],
        block_tables=meta.block_tables.index_select(0, sel),
        query_start_loc=torch.tensor(loc, dtype=meta.query_start_loc.dtype, device=dev),
        seq_lens=meta.seq_lens.index_select(0, sel),
        max_query_len=max(sub_q),
        max_seq_len=max(sub_s),
        query_lens_host=sub_q,
        seq_lens_host=sub_s,
    )
    return FormSplit(sub, row_ids, expanded)


def _context_rows(latent_cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The ``[S, W]`` cached rows of one request (its block table row ``table``)."""
    page = latent_cache.shape[1]
    blocks = table[: -(-seq_len // page)].long()
    return latent_cache[blocks].flatten(0, 1)[:seq_len, 0]


def expanded_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
                       kv_b_weight: torch.Tensor, meta: AttentionMetadata,
                       requests: tuple[tuple[int, int], ...], scale: float,
                       out: torch.Tensor) -> None:
    """The expanded form of ``requests`` (``(request, first row)`` pairs), written into
    ``out``'s rows; other rows untouched.

    Each request's context rows (its new tokens' included: written before the call) are
    gathered, their latents expanded through ``kv_b_weight`` in the model dtype (as
    transformers does), and its ``Q`` queries at positions ``S - Q .. S - 1`` attend
    causally with fp32 scores and softmax.

    Args:
        q_nope: ``[T, Hq, dn]``; q_rope: ``[T, Hq, dr]`` (rotated), the step's queries.
        latent_cache: ``[NB, P, 1, C + dr]`` this layer's rows.
        kv_b_weight: ``[Hq * (dn + dv), C]``, ``kv_b_proj.weight``.
        meta: the step's layout (block tables, host query and context lengths).
        scale: the softmax scale.
        out: ``[T, Hq, dv]``; mutated in the requests' rows.
    """
    heads, dn = q_nope.shape[1], q_nope.shape[2]
    width = kv_b_weight.shape[1]
    dv = kv_b_weight.shape[0] // heads - dn
    for r, start in requests:
        qlen, slen = meta.query_lens_host[r], meta.seq_lens_host[r]
        rows = _context_rows(latent_cache, meta.block_tables[r], slen)  # [S, C + dr]
        kv = F.linear(rows[:, :width].to(kv_b_weight.dtype), kv_b_weight).view(slen, heads, dn + dv)
        k_rope = rows[:, None, width:].float().expand(slen, heads, rows.shape[1] - width)
        k = torch.cat([kv[..., :dn].float(), k_rope], dim=-1).transpose(0, 1)  # [Hq, S, dn + dr]
        v = kv[..., dn:].float().transpose(0, 1)  # [Hq, S, dv]
        q = torch.cat([q_nope[start:start + qlen], q_rope[start:start + qlen]], dim=-1)
        q = q.float().transpose(0, 1)  # [Hq, Q, dn + dr]
        if qlen == slen:
            res = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            pos = torch.arange(slen - qlen, slen, device=q.device)[:, None]
            mask = torch.arange(slen, device=q.device)[None, :] <= pos
            res = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[start:start + qlen] = res.transpose(0, 1).to(out.dtype)


def latent_attention(query: torch.Tensor, rows: torch.Tensor, meta: AttentionMetadata, scale: float,
                     latent_dim: int) -> torch.Tensor:
    """Causal attention of absorbed queries ``[T, Hq, C + dr]`` over the latent rows
    ``[NB, P, 1, C + dr]`` (keys: the whole row; values: its first ``latent_dim`` dims):
    ``[T, Hq, C]`` in ``query.dtype``, fp32 scores and softmax. The torch reference of
    ``mla_triton.latent_attention``; mutates nothing."""
    return paged_attention(query, rows, rows, meta, scale)[..., :latent_dim]


def select_latent_op(impl: str, device: torch.device | str) -> tuple[LatentOp, Literal["ref", "triton"]]:
    """The absorbed attention's op for ``impl`` (``"auto"``: Triton on CUDA), once at
    construction. Raises ConfigError (unknown ``impl``) or DeviceUnavailableError
    (``"triton"`` without CUDA and without the interpreter)."""
    if resolve_impl(impl, on_cuda=torch.device(device).type == "cuda") == "ref":
        return latent_attention, "ref"
    from deepinfer_kit.models.attention import mla_triton

    return mla_triton.latent_attention, "triton"


def absorbed_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
                       kv_b_weight: torch.Tensor, meta: AttentionMetadata, scale: float,
                       op: LatentOp = latent_attention) -> torch.Tensor:
    """The absorbed form of every request of ``meta``: ``[T, Hq, dv]`` in ``q_nope.dtype``.

    ``q_latent = W_uk^T q_nope`` per head (a batched matmul in the model dtype), then
    ``op([q_latent, q_rope], rows, meta, scale, C)``, then ``W_uv`` per head. Capturable
    in a CUDA graph when ``op`` is (no host read of device data). Mutates nothing.

    Args:
        q_nope: ``[T, Hq, dn]``; q_rope: ``[T, Hq, dr]`` (rotated), rows in ``meta`` order.
        latent_cache: ``[NB, P, 1, C + dr]`` this layer's rows (the new tokens' written).
        kv_b_weight: ``[Hq * (dn + dv), C]``, ``kv_b_proj.weight``.
        meta: the layout of these rows' requests.
        scale: the softmax scale.
        op: the attention over the rows (:func:`select_latent_op`).
    """
    tokens, heads, dn = q_nope.shape
    width = kv_b_weight.shape[1]
    w = kv_b_weight.view(heads, -1, width)  # [Hq, dn + dv, C]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w[:, :dn])  # [Hq, T, C]
    query = torch.cat([q_latent.transpose(0, 1), q_rope.to(q_latent.dtype)], dim=-1)
    latent_out = op(query, latent_cache, meta, scale, width)  # [T, Hq, C]
    out = torch.bmm(latent_out.transpose(0, 1), w[:, dn:].transpose(1, 2))  # [Hq, T, dv]
    return out.transpose(0, 1)
