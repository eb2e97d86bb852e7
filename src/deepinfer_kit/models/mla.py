"""LatentSelfAttention: DeepSeek-V3's multi-head latent attention (MLA) of one layer over
a keys-only latent KV pool.

Per step: the query and latent down-projections (``q_a_proj`` and ``kv_a_proj_with_mqa``
fused into one matmul when ``q_lora_rank`` is set), ``q_a_layernorm`` -> ``q_b_proj`` (or
one ``q_proj``), ``kv_a_layernorm`` on the latent, RoPE on the queries' rotary dims and
on the shared rotary key, one cache row per token ``[latent, rotated key]`` written to
cache layer ``layer``, then attention in the expanded form for prefill chunks and the
absorbed form for decodes (``models.attention.mla_ref``), and ``o_proj``.

Checkpoints lay the rotary dims out as interleaved pairs (``rope_interleave``); loading
permutes those projection rows (and biases) once to ``[evens, odds]``, after which the
"rotate half" rotation of ``models.rope`` gives exactly transformers'
``apply_rotary_pos_emb_interleave`` (which de-interleaves the same way). Queries and
cached keys both carry the de-interleaved layout; the scores are unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from deepinfer_kit._kernels import Impl
from deepinfer_kit.comm.protocols import Communicator
from deepinfer_kit.errors import ConfigError, InvariantError
from deepinfer_kit.models.attention.mla_ref import (
    absorbed_attention,
    expanded_attention,
    select_latent_op,
    split_forms,
)
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.fused_ops import REFERENCE_OPS, FusedOps
from deepinfer_kit.models.layers import Linear, RMSNorm
from deepinfer_kit.models.mla_config import LATENT_NORM_EPS
from deepinfer_kit.models.protocols import PagedKVStore
from deepinfer_kit.models.records import AttentionMetadata
from deepinfer_kit.models.rope import RotaryEmbedding

__all__ = ["LatentSelfAttention", "ABSORBED_MAX_QUERY_LEN"]

Weights = Mapping[str, torch.Tensor]

ABSORBED_MAX_QUERY_LEN = 1
"""Requests with at most this many new tokens take the absorbed form (decodes); longer
ones (prefill chunks, speculative verification) the expanded form. Per query token the
absorbed form reads ``2 C + dr`` dims per head and context token, the expanded one
``dn + dr + dv`` plus a one-off ``C * Hq * (dn + dv)`` expansion per context token: for
DeepSeek-V3's sizes (``C`` 512, ``dn`` = ``dv`` 128, ``dr`` 64, 128 heads) the expanded
form is cheaper from about 170 query tokens of one request on; the 1 here keeps every
multi-token chunk expanded (the form transformers computes)."""


class LatentSelfAttention(nn.Module):
    """Multi-head latent attention of one layer (``config.mla``) over the latent pool.

    Same call contract as :class:`~deepinfer_kit.models.layers.PagedSelfAttention`. The
    pool must hold one row of ``kv_lora_rank + qk_rope_head_dim`` per token
    (``ModelConfig.cache_row``: ``PagedKVCache(..., 1, C + dr, keys_only=True)``).

    Args:
        config: a config with ``mla`` set.
        layer: the cache layer it writes and reads.
        rotary: the model's rotary embedding (``qk_rope_head_dim`` rotary dims).
        attention_impl: ``"auto" | "ref" | "triton"`` of the absorbed form's attention
            over the latent rows (``mla_ref.select_latent_op``, chosen once here; the Triton
            kernel is ``mla_triton``); the expanded form is the torch reference.
        ops: the norms' implementation (reference or Triton, chosen by the model).
        max_absorbed: see :data:`ABSORBED_MAX_QUERY_LEN` (an attribute; tests vary it).

    Attributes:
        impl: ``"ref"`` or ``"triton"``, the absorbed form's attention chosen here.

    Raises:
        ConfigError: ``config.mla`` is None; a tensor-parallel group of more than one rank
            (``tensor_parallel_size``: the latent attention is not sharded);
            ``batch_invariant`` (the two forms round differently, so a row's logits would
            depend on whether its request is decoding or prefilling).
    """

    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding, *,
                 attention_impl: Impl, dtype: torch.dtype, device: str | torch.device,
                 ops: FusedOps = REFERENCE_OPS, tp: Communicator | None = None,
                 batch_invariant: bool = False, max_absorbed: int = ABSORBED_MAX_QUERY_LEN) -> None:
        super().__init__()
        mla = config.mla
        if mla is None:
            raise ConfigError(f"LatentSelfAttention needs config.mla, got None for {config.model_type!r}")
        if tp is not None and tp.world_size > 1:
            raise ConfigError(
                f"tensor_parallel_size={tp.world_size} (EngineConfig.tensor_parallel) with "
                f"{config.architecture}: its multi-head latent attention is not sharded over "
                f"ranks; use tensor_parallel_size=1")
        if batch_invariant:
            raise ConfigError(
                f"batch_invariant=True with {config.architecture}: its latent attention takes "
                f"the expanded form for prefill and the absorbed form for decode, which round "
                f"differently; use batch_invariant=False")
        self.layer, self.mla, self.rotary = layer, mla, rotary
        self.num_heads, self.max_absorbed = config.num_heads, max_absorbed
        hidden, heads, bias = config.hidden_size, config.num_heads, mla.attention_bias
        q_size = heads * mla.qk_head_dim
        self.q_lora = mla.q_lora_rank
        # q_a_proj and kv_a_proj_with_mqa read the same input: one matmul (both biased alike).
        first = self.q_lora if self.q_lora is not None else 0
        self.a_proj = Linear(hidden, first + mla.latent_row, bias=bias, dtype=dtype, device=device)
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        self.q_proj: Linear | None = None
        if self.q_lora is not None:
            self.q_a_layernorm = RMSNorm(self.q_lora, LATENT_NORM_EPS, dtype=dtype, device=device, ops=ops)
            self.q_b_proj = Linear(self.q_lora, q_size, bias=False, dtype=dtype, device=device)
        else:
            self.q_proj = Linear(hidden, q_size, bias=False, dtype=dtype, device=device)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, dtype=dtype, device=device, ops=ops)
        self.kv_b_proj = Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                bias=False, dtype=dtype, device=device)
        self.o_proj = Linear(heads * mla.v_head_dim, hidden, bias=bias, dtype=dtype, device=device)
        self.scale = mla.softmax_scale(config.rope)
        self.latent_op, self.impl = select_latent_op(attention_impl, device)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: PagedKVStore, meta: AttentionMetadata) -> torch.Tensor:
        """``hidden`` ``[T, H]`` -> ``[T, H]``; writes ``T`` latent rows into cache layer
        ``layer`` first. ``cos``/``sin``: :meth:`RotaryEmbedding.cos_sin` of the batch
        positions, ``[T, 1, dr]``.

        Raises:
            InvariantError: ``kv_cache``'s layer is not ``[NB, P, 1, C + dr]`` (e.g. a
                per-head K/V pool).
        """
        mla, tokens, heads = self.mla, hidden.shape[0], self.num_heads
        dn, width = mla.qk_nope_head_dim, mla.kv_lora_rank
        rows = kv_cache.key_cache(self.layer)
        if rows.dim() != 4 or rows.shape[2:] != (1, mla.latent_row):
            raise InvariantError(
                f"multi-head latent attention (layer {self.layer}) needs a latent KV pool of "
                f"[NB, P, 1, {mla.latent_row}] per layer (ModelConfig.cache_row: "
                f"PagedKVCache(..., 1, {mla.latent_row}, keys_only=True)), got {list(rows.shape)}")
        a = self.a_proj.forward(hidden)
        first = 0 if self.q_lora is None else self.q_lora
        if self.q_b_proj is not None and self.q_a_layernorm is not None:
            q = self.q_b_proj.forward(self.q_a_layernorm.forward(a[:, :first]))
        else:
            assert self.q_proj is not None
            q = self.q_proj.forward(hidden)
        q = q.view(tokens, heads, mla.qk_head_dim)
        latent = self.kv_a_layernorm.forward(a[:, first:first + width])
        # The shared rotary key rotates as one more head beside the queries' rotary dims.
        rotated = self.rotary.rotate(torch.cat([q[..., dn:], a[:, None, first + width:]], dim=1), cos, sin)
        row = torch.cat([latent, rotated[:, heads]], dim=-1)[:, None]  # [T, 1, C + dr]
        kv_cache.write(self.layer, row, row, meta.slot_mapping)
        q_nope, q_rope = q[..., :dn], rotated[:, :heads]
        split = split_forms(meta, self.max_absorbed)
        weight = self.kv_b_proj.weight
        if split.absorbed is not None and split.absorbed_rows is None:
            out = absorbed_attention(q_nope, q_rope, rows, weight, split.absorbed, self.scale, self.latent_op)
        else:
            out = q.new_empty(tokens, heads, mla.v_head_dim)
            if split.absorbed is not None and split.absorbed_rows is not None:
                ids = split.absorbed_rows
                out[ids] = absorbed_attention(q_nope[ids], q_rope[ids], rows, weight, split.absorbed,
                                              self.scale, self.latent_op)
            expanded_attention(q_nope, q_rope, rows, weight, meta, split.expanded, self.scale, out)
        return self.o_proj.forward(out.reshape(tokens, heads * mla.v_head_dim))

    def load_hf_weights(self, weights: Weights, prefix: str) -> None:
        """Load ``prefix`` (``model.layers.<i>.self_attn.``) ``q_a_proj``,
        ``q_a_layernorm``, ``q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa``,
        ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; with ``rope_interleave`` the rotary
        rows of the query and latent projections are de-interleaved as they are copied.

        Raises:
            CheckpointError: a missing or mis-shaped tensor (named).
        """
        mla = self.mla
        kv_a = f"{prefix}kv_a_proj_with_mqa"
        if self.q_lora is not None:
            self.a_proj.load_parts(weights, [f"{prefix}q_a_proj", kv_a], [self.q_lora, mla.latent_row])
            assert self.q_a_layernorm is not None and self.q_b_proj is not None
            self.q_a_layernorm.load_hf_weights(weights, f"{prefix}q_a_layernorm.")
            self.q_b_proj.load_hf_weights(weights, f"{prefix}q_b_proj.")
            q_weight = self.q_b_proj.weight
        else:
            self.a_proj.load_parts(weights, [kv_a], [mla.latent_row])
            assert self.q_proj is not None
            self.q_proj.load_hf_weights(weights, f"{prefix}q_proj.")
            q_weight = self.q_proj.weight
        self.kv_a_layernorm.load_hf_weights(weights, f"{prefix}kv_a_layernorm.")
        self.kv_b_proj.load_hf_weights(weights, f"{prefix}kv_b_proj.")
        self.o_proj.load_hf_weights(weights, f"{prefix}o_proj.")
        if mla.rope_interleave:
            self._deinterleave(q_weight)

    @torch.no_grad()
    def _deinterleave(self, q_weight: torch.Tensor) -> None:
        """Reorder the rotary rows ``(x0, x1), (x2, x3), ...`` to ``(x0, x2, ..., x1, x3,
        ...)``: each head's last ``dr`` rows of the query projection, and the last ``dr``
        rows (and bias) of the fused latent projection. In place."""
        mla, dr = self.mla, self.mla.qk_rope_head_dim
        order = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)]).to(q_weight.device)
        per_head = q_weight.view(self.num_heads, mla.qk_head_dim, -1)
        per_head[:, mla.qk_nope_head_dim:] = per_head[:, mla.qk_nope_head_dim:][:, order]
        for param in (self.a_proj.weight, self.a_proj.bias):
            if param is not None:
                param[-dr:] = param[-dr:][order]
