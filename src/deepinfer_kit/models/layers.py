"""Building blocks of the decoder: Linear, RMSNorm, the gated MLP and paged self-attention.

Parameters are allocated uninitialized (``torch.empty``) on the target device and dtype and
filled by ``load_hf_weights(weights, prefix)``, which reads Hugging Face tensor names
(``prefix + "q_proj.weight"``, ...) and raises :class:`CheckpointError` naming a missing or
mis-shaped tensor. q/k/v and gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from deepinfer_kit._kernels import Impl
from deepinfer_kit.comm.protocols import Communicator
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.attention import PagedAttention
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.fused_ops import REFERENCE_OPS, FusedOps, offset_rms_norm, rms_norm
from deepinfer_kit.models.invariant import PLAIN, Numerics
from deepinfer_kit.models.parallel.linear import ColumnParallelLinear, RowBlock, RowParallelLinear
from deepinfer_kit.models.parallel.shard import attention_shard, split_even
from deepinfer_kit.models.protocols import PagedKVStore
from deepinfer_kit.models.records import AttentionMetadata
from deepinfer_kit.models.rope import RotaryEmbedding
from deepinfer_kit.models.rope_kv import RopeKvOp
from deepinfer_kit.models.weights import take, take_slice

__all__ = ["Linear", "RMSNorm", "GatedMLP", "PagedSelfAttention", "Impl"]

Weights = Mapping[str, torch.Tensor]


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` ``[out, in]``; uninitialized until loaded.

    ``numerics.linear`` computes it (:data:`~deepinfer_kit.models.invariant.PLAIN`; the
    model sets the batch-invariant numerics once, at construction).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool,
                 dtype: torch.dtype, device: str | torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.numerics: Numerics = PLAIN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in]`` -> ``[T, out]``."""
        return self.numerics.linear(x, self.weight, self.bias)

    def load_parts(self, weights: Weights, names: list[str], sizes: list[int]) -> None:
        """Fill the rows from the tensors ``names`` (``<name>.weight`` / ``<name>.bias``),
        stacked in order; ``sizes`` are their row counts. Raises CheckpointError."""
        in_features = self.weight.shape[1]
        with torch.no_grad():
            start = 0
            for name, size in zip(names, sizes):
                rows = slice(start, start + size)
                self.weight[rows].copy_(take(weights, f"{name}.weight", (size, in_features)))
                if self.bias is not None:
                    self.bias[rows].copy_(take(weights, f"{name}.bias", (size,)))
                start += size

    def load_hf_weights(self, weights: Weights, prefix: str) -> None:
        """Load ``prefix + "weight"`` (and ``"bias"``); ``prefix`` ends with a dot."""
        self.load_parts(weights, [prefix.removesuffix(".")], [self.weight.shape[0]])


class RMSNorm(nn.Module):
    """``y = w * x / sqrt(mean(x^2) + eps)`` over the last dim, computed in float32.

    ``ops`` (reference or Triton, chosen once by the model) runs the norm and the fused
    residual add + norm.
    """

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: str | torch.device,
                 ops: FusedOps = REFERENCE_OPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps
        self.shape = (size,)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, size]`` -> a new ``[T, size]`` tensor, same dtype and device."""
        return self.ops.rms_norm(x, self.weight, self.eps)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: adds a sublayer's output ``x`` ``[T, size]``
        to the residual stream ``[T, size]`` and normalizes the sum, in one pass with the
        Triton ops. Returns new tensors; mutates nothing."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)

    def load_hf_weights(self, weights: Weights, prefix: str) -> None:
        """Load ``prefix + "weight"``. Raises CheckpointError."""
        with torch.no_grad():
            self.weight.copy_(take(weights, f"{prefix}weight", self.shape))


class GatedMLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul and
    the activation one ``ops.silu_and_mul`` (reference or Triton, chosen once by the model).

    With ``tp`` (a tensor-parallel group of ``T`` ranks) this rank holds columns
    ``[t*I/T, (t+1)*I/T)`` of gate and up (column-parallel) and the matching rows of down
    (row-parallel: one all-reduce per call). Raises ConfigError when ``T`` does not
    divide ``intermediate_size``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool,
                 dtype: torch.dtype, device: str | torch.device,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 ops: FusedOps = REFERENCE_OPS, tp: Communicator | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.full_intermediate = intermediate_size
        self.start = 0
        if tp is not None:
            self.start, intermediate_size = split_even(intermediate_size, tp.world_size, tp.rank,
                                                       "intermediate_size")
        self.intermediate_size = intermediate_size
        self.tp = tp
        self.gate_up: Linear | ColumnParallelLinear = (
            Linear(hidden_size, 2 * intermediate_size, bias=bias, dtype=dtype, device=device) if tp is None
            else ColumnParallelLinear(hidden_size, 2 * intermediate_size, bias=bias, dtype=dtype, device=device))
        self.down: Linear | RowParallelLinear = (
            Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype, device=device) if tp is None
            else RowParallelLinear(self.full_intermediate, hidden_size, bias=bias, comm=tp, dtype=dtype,
                                   device=device))
        self.names = names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]`` -> ``[T, H]``."""
        return self.down.forward(self.ops.silu_and_mul(self.gate_up.forward(x)))

    def load_hf_weights(self, weights: Weights, prefix: str) -> None:
        """Load ``prefix + gate_proj/up_proj/down_proj``. Raises CheckpointError."""
        gate, up, down = self.names
        size = self.intermediate_size
        if isinstance(self.gate_up, ColumnParallelLinear):
            self.gate_up.load_blocks(weights, [RowBlock(prefix + n, self.start, size, self.full_intermediate)
                                               for n in (gate, up)])
        else:
            self.gate_up.load_parts(weights, [prefix + gate, prefix + up], [size, size])
        self.down.load_hf_weights(weights, f"{prefix}{down}.")


class PagedSelfAttention(nn.Module):
    """Self-attention of one layer over the paged KV cache.

    Order per step: fused q/k/v projection, optional per-head q/k RMSNorm, RoPE, write the
    new keys/values into cache layer ``layer``, paged causal attention over each request's
    context, output projection. Queries and keys are adjacent in the fused projection, so
    their norm and rotation run as one op over ``Hq + Hkv`` heads. With ``rope_kv`` (the
    fused kernel, chosen once by the model) the norm, rotation and cache write are one
    launch that stores into :meth:`PagedKVStore.slot_caches`. The q/k norm is
    ``fused_ops.offset_rms_norm`` when ``config.norm_offset`` (Gemma 3) and the softmax
    scale ``config.attn_scale`` when set (else ``head_dim ** -0.5``).

    With ``tp`` (a tensor-parallel group) this rank holds the heads of
    :func:`~deepinfer_kit.models.parallel.shard.attention_shard`: q/k/v column-parallel by
    heads, its cache layer only those KV heads, o_proj row-parallel (one all-reduce).
    Raises ConfigError when the heads do not split over the group.

    With ``config.attention_sinks`` (gpt-oss) it holds ``sinks`` ``[Hq]`` (its own query
    heads' entries under ``tp``), passed to :class:`PagedAttention`; ConfigError with
    ``batch_invariant`` (no invariant kernel has the sink term).
    """

    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding, *,
                 attention_impl: Impl, dtype: torch.dtype, device: str | torch.device,
                 rope_kv: RopeKvOp | None = None, tp: Communicator | None = None,
                 batch_invariant: bool = False) -> None:
        super().__init__()
        self.layer = layer
        self.rope_kv = rope_kv
        self.config = config
        self.shard = attention_shard(config, tp.world_size, tp.rank) if tp is not None else None
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads, config.num_kv_heads, config.head_dim)
        if self.shard is not None:
            self.num_heads, self.num_kv_heads = self.shard.num_heads, self.shard.num_kv_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.sizes = [q_size, kv_size, kv_size]
        self.qkv_proj: Linear | ColumnParallelLinear = (Linear if tp is None else ColumnParallelLinear)(
            config.hidden_size, sum(self.sizes), bias=config.qkv_bias, dtype=dtype, device=device)
        self.o_proj: Linear | RowParallelLinear = (
            Linear(q_size, config.hidden_size, bias=config.o_bias, dtype=dtype, device=device)
            if tp is None else RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size,
                                                 bias=config.o_bias, comm=tp, dtype=dtype, device=device))
        self.eps = config.rms_norm_eps
        # gpt-oss: a learned sink logit per query head (this rank's heads) in the softmax denominator.
        self.sinks: nn.Parameter | None = None
        if config.attention_sinks:
            if batch_invariant:
                raise ConfigError(f"batch_invariant=True is not supported for {config.architecture}: its "
                                  f"attention sinks have no batch-invariant kernel")
            self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=dtype, device=device), requires_grad=False)
        # q_norm.weight repeated over the Hq query heads, then k_norm.weight over the Hkv heads.
        self.qk_norm_weight = (
            nn.Parameter(torch.ones(self.num_heads + self.num_kv_heads, self.head_dim, dtype=dtype,
                                    device=device), requires_grad=False)
            if config.qk_norm else None)
        self.qk_norm = offset_rms_norm if config.norm_offset else rms_norm
        self.rotary = rotary
        scale = self.head_dim**-0.5 if config.attn_scale is None else config.attn_scale
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   scale, impl=attention_impl,
                                   sliding_window=config.sliding_window(layer), device=device,
                                   batch_invariant=batch_invariant, sinks=self.sinks)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: PagedKVStore, meta: AttentionMetadata) -> torch.Tensor:
        """``hidden`` ``[T, H]`` -> ``[T, H]``; writes ``T`` keys/values into the cache.

        ``cos``/``sin`` are :meth:`RotaryEmbedding.cos_sin` of the batch positions.
        """
        tokens, hq, hkv, d = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(hidden)
        if self.rope_kv is not None:
            keys, values = kv_cache.slot_caches(self.layer)
            q = self.rope_kv(qkv, self.qk_norm_weight, self.eps, cos, sin, keys, values,
                             meta.slot_mapping, hq)
        else:
            qk = qkv[:, : (hq + hkv) * d].view(tokens, hq + hkv, d)
            v = qkv[:, (hq + hkv) * d:].view(tokens, hkv, d)
            if self.qk_norm_weight is not None:
                qk = self.qk_norm(qk, self.qk_norm_weight, self.eps)
            qk = self.rotary.rotate(qk, cos, sin)
            q = qk[:, :hq]
            kv_cache.write(self.layer, qk[:, hq:], v, meta.slot_mapping)
        out = self.attn(q, kv_cache.key_cache(self.layer), kv_cache.value_cache(self.layer), meta)
        return self.o_proj.forward(out.reshape(tokens, hq * d))

    def load_hf_weights(self, weights: Weights, prefix: str) -> None:
        """Load ``prefix + q_proj/k_proj/v_proj/o_proj`` (and ``q_norm``/``k_norm``, and
        this rank's entries of ``sinks`` ``[num_heads]``).

        Raises:
            CheckpointError: a missing or mis-shaped tensor (named).
        """
        if isinstance(self.qkv_proj, ColumnParallelLinear):
            self.qkv_proj.load_blocks(weights, self._head_blocks(prefix))
        else:
            self.qkv_proj.load_parts(weights, [f"{prefix}{p}_proj" for p in "qkv"], self.sizes)
        self.o_proj.load_hf_weights(weights, f"{prefix}o_proj.")
        if self.sinks is not None:
            start = self.shard.q_start if self.shard is not None else 0
            with torch.no_grad():
                self.sinks.copy_(take_slice(weights, f"{prefix}sinks", (self.config.num_heads,), 0,
                                            start, start + self.num_heads))
        if self.qk_norm_weight is not None:
            shape = (self.head_dim,)
            with torch.no_grad():
                self.qk_norm_weight[: self.num_heads].copy_(take(weights, f"{prefix}q_norm.weight", shape))
                self.qk_norm_weight[self.num_heads:].copy_(take(weights, f"{prefix}k_norm.weight", shape))

    def _head_blocks(self, prefix: str) -> list[RowBlock]:
        """This rank's rows of q_proj, k_proj and v_proj (its heads)."""
        shard, d, c = self.shard, self.head_dim, self.config
        assert shard is not None
        q = RowBlock(f"{prefix}q_proj", shard.q_start * d, shard.num_heads * d, c.num_heads * d)
        kv = [RowBlock(f"{prefix}{p}_proj", shard.kv_start * d, shard.num_kv_heads * d, c.num_kv_heads * d)
              for p in "kv"]
        return [q, *kv]
