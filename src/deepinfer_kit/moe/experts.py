"""Expert weights and compute: grouped SwiGLU routed experts and the dense shared expert."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import nn

from deepinfer_kit._kernels import Impl, resolve_impl
from deepinfer_kit.moe.ref_ops import grouped_swiglu, swiglu

__all__ = ["GroupedExperts", "SharedExpert"]

GroupedFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Sequence[int]], torch.Tensor]


def _grouped_fn(impl: Literal["ref", "triton"]) -> GroupedFn:
    if impl == "ref":
        return grouped_swiglu
    # Lazy: importing deepinfer_kit must never import triton.
    from deepinfer_kit.moe.triton_ops import grouped_swiglu as triton_grouped_swiglu

    return triton_grouped_swiglu


class GroupedExperts(nn.Module):
    """``S`` SwiGLU experts stored fused, computed over expert-contiguous rows.

    Weights: ``gate_up`` ``[S, 2I, H]`` (gate rows then up rows of each expert) and
    ``down`` ``[S, H, I]``, the layout of Hugging Face's fused experts, so a grouped GEMM
    reads each expert's weights as one contiguous block.

    Args:
        num_slots: ``S``, experts held here (all ``E`` on one device).
        hidden_size: ``H``.
        intermediate_size: ``I``.
        impl: ``"auto" | "ref" | "triton"``, resolved once here (see :func:`deepinfer_kit._kernels.resolve_impl`).
        dtype: weight dtype.
        device: weight device.
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
    ) -> None:
        super().__init__()
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.impl = resolve_impl(impl, on_cuda=dev.type == "cuda")
        self._grouped = _grouped_fn(self.impl)
        self.gate_up = nn.Parameter(
            torch.zeros(num_slots, 2 * intermediate_size, hidden_size, dtype=dtype, device=dev),
            requires_grad=False,
        )
        self.down = nn.Parameter(
            torch.zeros(num_slots, hidden_size, intermediate_size, dtype=dtype, device=dev),
            requires_grad=False,
        )

    def forward(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Run expert ``s`` on its ``counts[s]`` rows of ``x`` (``[M, H]``, grouped by slot).

        Returns:
            ``[M, H]`` unweighted expert outputs in the weight dtype. Mutates nothing.
        """
        return self._grouped(x.to(self.gate_up.dtype), self.gate_up, self.down, counts)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> ``[T, H]`` in the weight dtype. Mutates nothing."""
        x = x.to(self.gate_up.dtype)
        out = swiglu(x, self.gate_up, self.down)
        if self.gate is not None:
            out = out * torch.sigmoid(torch.mm(x, self.gate.t()))
        return out
