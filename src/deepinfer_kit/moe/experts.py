"""Expert weights and compute: grouped SwiGLU routed experts and the dense shared expert."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

import torch
from torch import nn

from deepinfer_kit._kernels import Impl, resolve_impl
from deepinfer_kit.models.invariant import PLAIN, Numerics
from deepinfer_kit.moe.expert_variants import ExpertActivation, grouped_experts, routed_experts
from deepinfer_kit.moe.records import Routing
from deepinfer_kit.moe.ref_ops import grouped_swiglu, routed_swiglu, swiglu

__all__ = ["GroupedExperts", "SharedExpert"]

class _TritonExperts(Protocol):
    """The two entry points of ``moe.triton_ops`` (imported only when chosen)."""

    def grouped_swiglu(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                       counts: Sequence[int], *, invariant: bool = False,
                       gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                       activation: ExpertActivation | None = None) -> torch.Tensor: ...

    def routed_swiglu(self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor, *,
                      invariant: bool = False, gate_up_bias: torch.Tensor | None = None,
                      down_bias: torch.Tensor | None = None,
                      activation: ExpertActivation | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...


def _triton_kernels() -> _TritonExperts:
    # Lazy: importing deepinfer_kit must never import triton.
    from deepinfer_kit.moe import triton_ops

    return cast(_TritonExperts, triton_ops)


class GroupedExperts(nn.Module):
    """``S`` SwiGLU experts stored fused, computed over expert-contiguous rows.

    Weights: ``gate_up`` ``[S, 2I, H]`` (gate rows then up rows of each expert) and
    ``down`` ``[S, H, I]``, the layout of Hugging Face's fused experts, so a grouped GEMM
    reads each expert's weights as one contiguous block.

    With ``bias`` or a clamped ``activation`` (gpt-oss) both implementations run the
    variant: :mod:`~deepinfer_kit.moe.expert_variants` (reference) or the same Triton
    kernels with their bias and clamp options; otherwise the plain SwiGLU paths, unchanged.

    Args:
        num_slots: ``S``, experts held here (all ``E`` on one device).
        hidden_size: ``H``.
        intermediate_size: ``I``.
        impl: ``"auto" | "ref" | "triton"``, resolved once here (see :func:`deepinfer_kit._kernels.resolve_impl`).
        dtype: weight dtype.
        device: weight device.
        bias: hold ``gate_up_bias`` ``[S, 2I]`` (gate then up, like ``gate_up``) and
            ``down_bias`` ``[S, H]``, zeros until loaded.
        activation: the activation; ``None``: SwiGLU.
    """

    def __init__(
        self,
        num_slots: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        impl: Impl = "auto",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        bias: bool = False,
        activation: ExpertActivation | None = None,
    ) -> None:
        super().__init__()
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.impl = resolve_impl(impl, on_cuda=dev.type == "cuda")
        self._triton = _triton_kernels() if self.impl == "triton" else None
        self.numerics: Numerics = PLAIN  # the reference's matmul and activation (the model sets it)
        self.gate_up = nn.Parameter(
            torch.zeros(num_slots, 2 * intermediate_size, hidden_size, dtype=dtype, device=dev),
            requires_grad=False,
        )
        self.down = nn.Parameter(
            torch.zeros(num_slots, hidden_size, intermediate_size, dtype=dtype, device=dev),
            requires_grad=False,
        )
        self.gate_up_bias: nn.Parameter | None = None
        self.down_bias: nn.Parameter | None = None
        if bias:
            self.gate_up_bias = nn.Parameter(
                torch.zeros(num_slots, 2 * intermediate_size, dtype=dtype, device=dev), requires_grad=False)
            self.down_bias = nn.Parameter(
                torch.zeros(num_slots, hidden_size, dtype=dtype, device=dev), requires_grad=False)
        self.activation = activation if activation is not None else ExpertActivation()
        self.variant = bias or self.activation.clamped
        """Biases or a clamped activation: the ``expert_variants`` paths run."""

    def slot_tensors(self) -> tuple[nn.Parameter, ...]:
        """Every ``[S, ...]`` weight (``gate_up``, ``down``, then the biases when held): what
        moves with a slot when replicas or expert parallelism rearrange the slots."""
        extra = tuple(b for b in (self.gate_up_bias, self.down_bias) if b is not None)
        return (self.gate_up, self.down, *extra)

    def forward(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Run expert ``s`` on its ``counts[s]`` rows of ``x`` (``[M, H]``, grouped by slot).

        Returns:
            ``[M, H]`` unweighted expert outputs in the weight dtype. Mutates nothing.
        """
        x = x.to(self.gate_up.dtype)
        if self.variant:
            if self._triton is None:
                return grouped_experts(x, self.gate_up, self.down, counts, self.activation,
                                       gate_up_bias=self.gate_up_bias, down_bias=self.down_bias,
                                       numerics=self.numerics)
            return self._triton.grouped_swiglu(x, self.gate_up, self.down, counts,
                                               invariant=self.numerics.invariant,
                                               gate_up_bias=self.gate_up_bias, down_bias=self.down_bias,
                                               activation=self.activation)
        if self._triton is None:
            return grouped_swiglu(x, self.gate_up, self.down, counts, self.numerics)
        return self._triton.grouped_swiglu(x, self.gate_up, self.down, counts,
                                           invariant=self.numerics.invariant)

    def routed(self, hidden: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token through its ``k`` experts, weighted and summed; all slots local.

        Called by a layer whose experts all live here (ids are slots). With
        ``impl="triton"`` nothing reads the device from the host (CUDA-graph safe); with
        ``"ref"`` the per-expert counts are read once on the host. Mutates nothing.

        Args:
            hidden: ``[T, H]``.
            routing: ids ``[T, k]`` in ``[0, S)`` and weights ``[T, k]``, on the device
                of ``hidden``.

        Returns:
            ``(y [T, H] in the weight dtype, counts [S] int64)``: ``counts`` are copies
            per slot, on the device of ``hidden`` (``"triton"``) or the host (``"ref"``).

        Raises:
            ConfigError: (``"ref"`` only) an id outside ``[0, S)``; the Triton path does
                not check, since checking would read the device.
        """
        if self.variant:
            if self._triton is None:
                return routed_experts(hidden, routing.expert_ids, routing.weights, self.gate_up, self.down,
                                      self.activation, gate_up_bias=self.gate_up_bias,
                                      down_bias=self.down_bias, numerics=self.numerics)
            return self._triton.routed_swiglu(hidden, routing.expert_ids, routing.weights, self.gate_up,
                                              self.down, invariant=self.numerics.invariant,
                                              gate_up_bias=self.gate_up_bias, down_bias=self.down_bias,
                                              activation=self.activation)
        if self._triton is None:
            return routed_swiglu(hidden, routing.expert_ids, routing.weights, self.gate_up, self.down,
                                 self.numerics)
        return self._triton.routed_swiglu(hidden, routing.expert_ids, routing.weights, self.gate_up,
                                          self.down, invariant=self.numerics.invariant)


class SharedExpert(nn.Module):
    """The shared experts as one dense SwiGLU MLP, optionally scaled by a sigmoid gate.

    ``y = swiglu(x) * sigmoid(x @ gate^T)`` when gated (Qwen2-MoE), else ``swiglu(x)``.

    Args:
        hidden_size: ``H``.
        intermediate_size: total shared intermediate size ``I_s``.
        gated: add the ``[1, H]`` sigmoid gate.
        dtype: weight dtype.
        device: weight device.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        gated: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(
            torch.zeros(2 * intermediate_size, hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.down = nn.Parameter(
            torch.zeros(hidden_size, intermediate_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.gate: nn.Parameter | None = (
            nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device), requires_grad=False)
            if gated
            else None
        )
        self.numerics: Numerics = PLAIN  # the model sets the batch-invariant one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> ``[T, H]`` in the weight dtype. Mutates nothing."""
        x = x.to(self.gate_up.dtype)
        out = swiglu(x, self.gate_up, self.down, self.numerics)
        if self.gate is not None:
            out = out * self.numerics.sigmoid(self.numerics.linear(x, self.gate, None))
        return out
