"""Elementwise ops of the decoder that fuse well (RMSNorm, residual add + RMSNorm, SiLU-and-mul):
their torch references, and the choice between them and ``fused_triton``'s kernels.

The references are the spec and the test oracle of the kernels (same signatures) and the
numerics of the unfused model: ``add_rms_norm`` is ``x + residual`` then :func:`rms_norm`,
``silu_and_mul`` is ``silu(gate) * up``. Shape symbols: ``T`` rows (tokens), ``H`` the
normalized size, ``I`` the MLP intermediate size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import attrs
import torch
import torch.nn.functional as F

from deepinfer_kit._kernels import resolve_impl
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.invariant import invariant_silu

if TYPE_CHECKING:
    from deepinfer_kit.models.config import ModelConfig
    from deepinfer_kit.models.rope_kv import RopeKvOp

__all__ = [
    "rms_norm", "add_rms_norm", "silu_and_mul", "FusedOps", "REFERENCE_OPS", "select_fused_ops",
    "RmsNormOp", "AddRmsNormOp", "SiluAndMulOp", "invariant_silu_and_mul", "INVARIANT_REFERENCE_OPS",
    "offset_rms_norm", "offset_add_rms_norm", "gelu_tanh_and_mul", "family_ops",
]  # fmt: skip

RmsNormOp = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
"""``op(x, weight, eps) -> normed``."""
AddRmsNormOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float],
                        tuple[torch.Tensor, torch.Tensor]]
"""``op(x, residual, weight, eps) -> (normed, new_residual)``."""
SiluAndMulOp = Callable[[torch.Tensor], torch.Tensor]
"""``op(gate_up) -> out``."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, normalized in float32.

    Called by every norm of the reference model (and the per-head q/k norm of any model).
    The normalized value is cast back to ``x.dtype`` before the multiply by ``weight``
    (so bf16/fp16 round as Hugging Face models do).

    Args:
        x: ``[..., H]`` float32, bfloat16 or float16, any device.
        weight: ``[H]``, or any shape broadcasting against ``x`` (e.g. ``[heads, H]``),
            same dtype and device as ``x``.
        eps: added to the mean square.

    Returns:
        A new tensor shaped like ``x``, in ``x.dtype``. Mutates nothing.
    """
    if x.dtype == torch.float32:
        if weight.dim() == 1:
            return F.rms_norm(x, weight.shape, weight, eps)
        return F.rms_norm(x, (x.shape[-1],), None, eps) * weight
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out: torch.Tensor = weight * xf.to(x.dtype)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add a sublayer's output to the residual stream, then normalize the sum.

    Called by each decoder layer before attention (adding the previous layer's MLP
    output), before the MLP (adding the attention output) and by the final norm.

    Args:
        x: ``[T, H]`` the sublayer output, float32/bfloat16/float16, any device.
        residual: ``[T, H]`` the residual stream, same dtype and device.
        weight: ``[H]`` the norm weight, same dtype and device.
        eps: added to the mean square.

    Returns:
        ``(normed, new_residual)``, both new ``[T, H]`` tensors in ``x.dtype``:
        ``new_residual = x + residual`` (rounded to ``x.dtype``) and
        ``normed = rms_norm(new_residual, weight, eps)``. Mutates nothing.
    """
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: ``silu(gate) * up`` where ``gate_up = [gate | up]``.

    Called by the gated MLP between its fused gate/up projection and its down projection.

    Args:
        gate_up: ``[T, 2I]``, the gate in the first ``I`` columns and up in the last ``I``;
            float32/bfloat16/float16, any device.

    Returns:
        A new ``[T, I]`` tensor in ``gate_up.dtype`` (``silu`` rounded to the dtype, then
        the product rounded again, as torch's unfused ops do). Mutates nothing.
    """
    gate, up = torch.split(gate_up, gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: ``(x / sqrt(mean(x^2) + eps)) * (1 + weight)``, all in float32, then
    rounded once to ``x.dtype`` (the checkpoint stores the scale's offset from 1).

    Called by every norm of a ``ModelConfig.norm_offset`` model, the per-head q/k norm
    included. Same arguments and result shape as :func:`rms_norm` (``weight`` ``[H]`` or
    broadcasting, e.g. ``[heads, H]``); mutates nothing.
    """
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def offset_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm` with :func:`offset_rms_norm`: ``(offset_rms_norm(x + residual),
    x + residual)``, new ``[T, H]`` tensors in ``x.dtype``. Mutates nothing."""
    new_residual = x + residual
    return offset_rms_norm(new_residual, weight, eps), new_residual


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU activation: ``gelu_tanh(gate) * up`` where ``gate_up = [gate | up]`` (``gelu``
    with ``approximate="tanh"``, transformers' ``gelu_pytorch_tanh``).

    Called by the gated MLP of a ``ModelConfig.hidden_act == "gelu_pytorch_tanh"`` model.
    Same arguments, result and rounding as :func:`silu_and_mul`; mutates nothing.
    """
    gate, up = torch.split(gate_up, gate_up.shape[-1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


@attrs.frozen
class FusedOps:
    """The three ops one model uses, all reference or all Triton, chosen at construction.

    Attributes:
        impl: ``"ref"`` or ``"triton"``.
        rms_norm: see :func:`rms_norm` (the Triton kernel takes ``x`` ``[T, H]`` and a
            ``[H]`` weight only).
        add_rms_norm: see :func:`add_rms_norm`.
        silu_and_mul: see :func:`silu_and_mul`.
        rope_kv: the fused q/k norm + RoPE + KV write kernel (``rope_kv_triton``) with the
            Triton ops; ``None`` with the references, whose layers run the unfused ops
            (``rope_kv.rope_kv_write`` is the same composition, kept as the oracle).
    """

    impl: Literal["ref", "triton"]
    rms_norm: RmsNormOp
    add_rms_norm: AddRmsNormOp
    silu_and_mul: SiluAndMulOp
    rope_kv: RopeKvOp | None = None


REFERENCE_OPS = FusedOps("ref", rms_norm, add_rms_norm, silu_and_mul)
"""The torch references: the default of a layer built outside a model."""


def invariant_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_and_mul` with ``silu`` from ops that give an element the same value at
    any tensor size (``models.invariant.invariant_silu``; torch's ``silu`` rounds the
    elements of a vector loop's scalar tail differently). Same arguments and result shape;
    mutates nothing."""
    gate, up = torch.split(gate_up, gate_up.shape[-1] // 2, dim=-1)
    return invariant_silu(gate) * up


INVARIANT_REFERENCE_OPS = FusedOps("ref", rms_norm, add_rms_norm, invariant_silu_and_mul)
"""The torch references of the batch-invariant mode on the CPU (the norms are row kernels
already: each row computed alike at any row count)."""


def select_fused_ops(impl: str, *, on_cuda: bool, field: str = "fused_impl",
                     batch_invariant: bool = False) -> FusedOps:
    """Resolve ``impl`` once (see :func:`deepinfer_kit._kernels.resolve_impl`) and return
    the ops; imports ``fused_triton`` (and Triton) only when it is chosen.

    Called at model construction, never per step. With ``batch_invariant`` the references
    are :data:`INVARIANT_REFERENCE_OPS` (a CUDA kernel computes every element alike: the
    Triton ops stay).

    Raises:
        ConfigError: ``impl`` is not ``"auto"``, ``"ref"`` or ``"triton"``.
        DeviceUnavailableError: ``"triton"`` without CUDA and without the interpreter.
    """
    if resolve_impl(impl, on_cuda=on_cuda, field=field) == "ref":
        return INVARIANT_REFERENCE_OPS if batch_invariant else REFERENCE_OPS
    from deepinfer_kit.models import fused_triton, rope_kv_triton

    return FusedOps("triton", fused_triton.rms_norm, fused_triton.add_rms_norm,
                    fused_triton.silu_and_mul, rope_kv_triton.rope_kv_write)


def family_ops(config: ModelConfig, ops: FusedOps, *, batch_invariant: bool) -> FusedOps:
    """The ops a model of ``config`` runs, given the ``ops`` :func:`select_fused_ops` chose.

    Called once at model construction. Returns ``ops`` itself unless ``config`` has
    ``norm_offset`` or a GELU MLP (Gemma 3); then the torch references for its norms
    (:func:`offset_rms_norm`, :func:`offset_add_rms_norm`) and activation
    (:func:`gelu_tanh_and_mul`) — the Triton kernels compute ``w * x`` and SiLU — with no
    fused RoPE + KV write.

    Raises:
        ConfigError: ``batch_invariant`` with such a config (those ops have no
            batch-invariant kernels).
    """
    if not config.norm_offset and config.hidden_act == "silu":
        return ops
    if batch_invariant:
        raise ConfigError(
            f"batch_invariant=True is not supported for {config.model_type}: its (1 + weight) norms "
            f"and {config.hidden_act} MLP run as torch ops with no batch-invariant kernels")
    offset = config.norm_offset
    return FusedOps("ref", offset_rms_norm if offset else rms_norm,
                    offset_add_rms_norm if offset else add_rms_norm,
                    gelu_tanh_and_mul if config.hidden_act == "gelu_pytorch_tanh" else silu_and_mul)
