"""Column- and row-parallel linear layers: the two halves of a tensor-parallel matmul pair.

A column-parallel layer holds some output rows of ``W`` (``[out/T, in]``) and needs no
communication: its output is this rank's slice of the features (q/k/v heads, gate/up
columns). A row-parallel layer holds the matching input columns (``[out, in/T]``) and
sums the partial products over the ranks with one all-reduce; its bias is added once,
after the sum.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch
from torch import nn

from deepinfer_kit.comm.protocols import Communicator
from deepinfer_kit.models.invariant import PLAIN, Numerics
from deepinfer_kit.models.weights import take, take_slice

__all__ = ["RowBlock", "ColumnParallelLinear", "RowParallelLinear"]

Weights = Mapping[str, torch.Tensor]


@attrs.frozen(slots=True)
class RowBlock:
    """Rows ``[start, start + size)`` of checkpoint tensor ``<name>.weight`` (``[full, in]``)
    and of ``<name>.bias``, the next ``size`` rows of a column-parallel layer."""

    name: str
    start: int
    size: int
    full: int


class ColumnParallelLinear(nn.Module):
    """``y_t = x W_t^T (+ b_t)``: this rank's output features, no communication.

    ``W_t`` (``[sum(sizes), in]``) stacks the row blocks it loads (q, k and v heads, or
    gate and up columns), in order.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool,
                 dtype: torch.dtype, device: str | torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)
        self.numerics: Numerics = PLAIN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in]`` (every rank the same) -> ``[T, out/T]``, this rank's features."""
        return self.numerics.linear(x, self.weight, self.bias)

    def load_blocks(self, weights: Weights, blocks: Sequence[RowBlock]) -> None:
        """Fill the rows from ``blocks`` in order, reading only those rows of each tensor.

        Raises:
            CheckpointError: a tensor missing or not ``[full, in]`` (named).
        """
        in_features = self.weight.shape[1]
        with torch.no_grad():
            at = 0
            for b in blocks:
                rows = slice(at, at + b.size)
                self.weight[rows].copy_(take_slice(weights, f"{b.name}.weight", (b.full, in_features),
                                                   0, b.start, b.start + b.size))
                if self.bias is not None:
                    self.bias[rows].copy_(take_slice(weights, f"{b.name}.bias", (b.full,),
                                                     0, b.start, b.start + b.size))
                at += b.size


class RowParallelLinear(nn.Module):
    """``y = sum_t x_t W_t^T (+ b)``: this rank holds input columns ``[start, start + in/T)``
    of ``W`` (``[out, in]``); one all-reduce over ``comm`` per call.

    Args:
        in_features: the full input size (``T * in/T``).
        out_features: the output size (held whole).
        comm: the tensor-parallel group.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, comm: Communicator,
                 dtype: torch.dtype, device: str | torch.device) -> None:
        super().__init__()
        self.comm = comm
        self.full_in = in_features
        self.start, local = comm.rank * (in_features // comm.world_size), in_features // comm.world_size
        self.weight = nn.Parameter(torch.empty(out_features, local, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)
        self.numerics: Numerics = PLAIN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in/T]`` (this rank's features) -> ``[T, out]``, the same on every rank.

        Raises:
            CollectiveError: the all-reduce failed or timed out.
        """
        out = self.comm.all_reduce(self.numerics.linear(x, self.weight, None))
        return out if self.bias is None else out + self.bias

    def load_hf_weights(self, weights: Weights, prefix: str) -> None:
        """Load columns ``[start, start + in/T)`` of ``prefix + "weight"`` (only those are
        read) and the whole ``prefix + "bias"``; ``prefix`` ends with a dot.

        Raises:
            CheckpointError: a tensor missing or mis-shaped (named).
        """
        out_features, local = self.weight.shape
        with torch.no_grad():
            self.weight.copy_(take_slice(weights, f"{prefix}weight", (out_features, self.full_in),
                                         1, self.start, self.start + local))
            if self.bias is not None:
                self.bias.copy_(take(weights, f"{prefix}bias", (out_features,)))
