"""PagedAttention: the attention op of every model layer, reading K/V from the block pool.

Chooses the torch reference or the Triton kernels once, at construction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

from deepinfer_kit._kernels import resolve_impl
from deepinfer_kit._validators import require_ints_at_least
from deepinfer_kit.errors import ConfigError, InvariantError
from deepinfer_kit.models.records import AttentionMetadata

__all__ = ["PagedAttention", "AttentionOp"]

AttentionOp = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float, "int | None"],
    torch.Tensor,
]
"""``op(query, key_cache, value_cache, meta, scale, sliding_window) -> out``."""


class PagedAttention:
    """Causal attention of a step's new tokens over their requests' paged context.

    Stateless after construction; one instance per layer or shared by all layers. The
    model writes the new tokens' K/V to the pool (``PagedKVCache.write``) *before* calling
    it. Handles, mixed in one batch: prefill from position 0, prefill of a chunk after a
    cached prefix, decode (one new token) and multi-token decode (speculative verify).

    Args:
        num_heads: ``Hq`` query heads.
        num_kv_heads: ``Hkv`` KV heads; ``Hq`` must be a multiple (GQA / MQA).
        head_dim: ``D``.
        scale: softmax scale, usually ``D ** -0.5``.
        impl: ``"auto"`` (Triton when ``device`` is CUDA), ``"ref"`` or ``"triton"``.
        sinks: ``[Hq]`` attention-sink logits (gpt-oss: a learned per-head logit added to
            each row's softmax denominator, with no value), or ``None``; both
            implementations; refused with ``batch_invariant``.
        sliding_window: attend only to the last ``sliding_window`` positions (the token
            itself included); the torch reference and the Triton kernel both (with
            ``batch_invariant`` the invariant torch reference, on any device).
        device: where the tensors will live; ``None`` means CUDA when available. Only
            used to resolve ``impl="auto"``.
        batch_invariant: each row's output is bitwise the same whatever else the batch
            holds, however its request's query is chunked (decode row, verify row, prefill
            chunk) and whether its keys were cached: the reference's
            ``invariant_ref.paged_attention`` (keys in fixed chunks, padded products), or
            the Triton kernel with splits of a fixed key count
            (``triton_ops.paged_attention_invariant``).

    Raises:
        ConfigError: a size is not a positive int, ``num_heads % num_kv_heads != 0``,
            ``scale`` is not a positive finite number, ``impl`` is unknown, or
            ``sliding_window`` is not a positive int.
        DeviceUnavailableError: ``impl="triton"`` without CUDA and without
            ``TRITON_INTERPRET=1``, or Triton is not installed.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        impl: Literal["auto", "ref", "triton"] = "auto",
        sliding_window: int | None = None,
        device: torch.device | str | None = None,
        batch_invariant: bool = False,
        sinks: torch.Tensor | None = None,
    ) -> None:
        fields = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
        if sliding_window is not None:
            fields["sliding_window"] = sliding_window
        require_ints_at_least(1, **fields)
        if num_heads % num_kv_heads:
            raise ConfigError(
                f"num_heads must be a multiple of num_kv_heads ({num_kv_heads}), got {num_heads}"
            )
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
            math.isfinite(scale) and scale > 0
        ):
            raise ConfigError(f"scale must be a positive finite number, got {scale!r}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = float(scale)
        self.sliding_window = sliding_window
        if sinks is not None:
            if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (num_heads,) \
                    or not sinks.is_floating_point():
                raise ConfigError(f"sinks must be a float [{num_heads}] tensor (one logit per query head), "
                                  f"got {sinks!r}")
            if batch_invariant:
                raise ConfigError("sinks are not supported with batch_invariant=True (the invariant "
                                  "kernels have no sink term)")
        self.sinks = sinks
        self.batch_invariant = batch_invariant
        self._op, self.impl = _select_op(impl, device, sliding_window, batch_invariant)

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Attend each new token to positions ``[0, its position]`` of its request.

        Args:
            query: ``[T, Hq, D]``, the new tokens of all requests flattened in
                ``meta.query_start_loc`` order.
            key_cache, value_cache: ``[NB, P, Hkv, D]``, this layer's pool (already holding
                the new tokens' K/V at ``meta.slot_mapping``).
            meta: the batch layout.

        Returns:
            ``[T, Hq, D]`` in ``query.dtype``, on ``query``'s device. Mutates nothing.

        Raises:
            InvariantError: shapes disagree with the heads / head dim given at construction.
        """
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if (
            query.dim() != 3
            or query.shape[1:] != (hq, d)
            or key_cache.dim() != 4
            or key_cache.shape[2:] != (hkv, d)
            or value_cache.shape != key_cache.shape
        ):
            raise InvariantError(
                f"PagedAttention(Hq={hq}, Hkv={hkv}, D={d}) got query {list(query.shape)}, "
                f"key_cache {list(key_cache.shape)}, value_cache {list(value_cache.shape)}"
            )
        if self.sinks is not None:  # both implementations take sinks by keyword (the ops' contract)
            op: Callable[..., torch.Tensor] = self._op
            sinks = self.sinks.to(device=query.device, dtype=torch.float32)
            return op(query, key_cache, value_cache, meta, self.scale, self.sliding_window, sinks=sinks)
        return self._op(query, key_cache, value_cache, meta, self.scale, self.sliding_window)


def _select_op(
    impl: str, device: torch.device | str | None, window: int | None, invariant: bool = False
) -> tuple[AttentionOp, Literal["ref", "triton"]]:
    on_cuda = (
        torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    )
    choice = resolve_impl(impl, on_cuda=on_cuda)
    if choice == "ref" or (invariant and window is not None):  # the invariant kernel has no window
        if invariant:
            from deepinfer_kit.models.attention import invariant_ref

            return invariant_ref.paged_attention, "ref"
        from deepinfer_kit.models.attention import ref_ops

        return ref_ops.paged_attention, "ref"
    import deepinfer_kit.models.attention.triton_ops as triton_ops

    return (triton_ops.paged_attention_invariant if invariant else triton_ops.paged_attention), "triton"
