"""Batch-invariant numerics: a row's result does not depend on how many rows share the call,
where the row sits among them, or how the work is split over threads.

Three things on the CPU make a row's result depend on its batch, each measured on this
kit's torch build:

- **GEMM kernels by shape.** A product of one row runs a GEMV, one of two or three rows
  another kernel; with 5-7 or 9-11 rows the last one to three rows take a remainder
  kernel; each sums a row's ``K`` products in its own order. From 12 rows on (measured up
  to 1,100 rows, every weight shape of the models) every row is summed alike whatever
  the row count, place or company. So every product is padded to at least
  :data:`MIN_ROWS` rows with its other dimensions fixed by the weights
  (:func:`invariant_linear`; the attention fixes its key chunk, ``attention.invariant_ref``).
- **Vector loops with scalar tails.** An elementwise op runs vector code over most of a
  tensor and scalar code over the last few elements (or those at a thread's chunk end);
  for ``silu`` and ``sigmoid`` the two differ in the last bit, so an element's value
  depends on the tensor's size. :func:`invariant_silu` and :func:`invariant_sigmoid` are
  built from ``exp`` and basic arithmetic, whose vector and scalar paths agree (``exp``'s
  checked by :func:`probe_row_invariance`; ``+ - * /`` are correctly rounded either way).
- Row-wise kernels (``rms_norm``, ``softmax``, ``log_softmax``) already compute each row
  alike: kept as they are.

:class:`Numerics` carries the choice (the plain ops, or the invariant ones) to every module
that multiplies or activates (``numerics`` attribute, :class:`UsesNumerics`); the model
sets it once, at construction (:func:`select_numerics`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_kit.errors import ConfigError

__all__ = ["MIN_ROWS", "MIN_COLS", "LinearOp", "Numerics", "PLAIN", "INVARIANT", "plain_linear", "invariant_linear",
           "invariant_silu", "invariant_sigmoid", "select_numerics", "probe_row_invariance",
           "UsesNumerics", "set_numerics"]

MIN_ROWS = 16
"""Rows a batch-invariant product is padded to at least (12 suffice on MKL; 16 leaves room)."""

MIN_COLS = 16
"""Output columns a batch-invariant product is padded to at least: a one-column product
(a gate's ``[1, H]`` weight) sums its rows by the row count's parity."""

LinearOp = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""``op(x [T, K], weight [N, K], bias [N] | None) -> [T, N]``: ``x W^T (+ b)``."""

UnaryOp = Callable[[torch.Tensor], torch.Tensor]


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``: the default mode's matmul (whatever kernel the library picks)."""
    return F.linear(x, weight, bias)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ b)`` with ``x`` padded to at least :data:`MIN_ROWS` rows and ``W`` to at
    least :data:`MIN_COLS` output columns, so each row's result is the same at any row
    count (the padding is computed and dropped).

    Args:
        x: ``[T, K]`` (``T >= 0``), any float dtype and device.
        weight: ``[N, K]``, same dtype and device.
        bias: ``[N]`` or ``None``.

    Returns:
        ``[T, N]`` in ``x.dtype``. Mutates nothing.
    """
    rows, cols = x.shape[0], weight.shape[0]
    if cols < MIN_COLS:
        weight = torch.cat([weight, weight.new_zeros(MIN_COLS - cols, weight.shape[1])])
        bias = None if bias is None else torch.cat([bias, bias.new_zeros(MIN_COLS - cols)])
    if rows < MIN_ROWS:
        x = torch.cat([x, x.new_zeros(MIN_ROWS - rows, *x.shape[1:])])
    out = F.linear(x, weight, bias)
    return out if rows >= MIN_ROWS and cols >= MIN_COLS else out[:rows, :cols]


def invariant_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` from ops whose vector and scalar paths agree (module
    docstring); a new tensor like ``x``. Mutates nothing."""
    return torch.reciprocal(torch.exp(-x).add_(1.0))


def invariant_silu(x: torch.Tensor) -> torch.Tensor:
    """``x / (1 + exp(-x))``, as :func:`invariant_sigmoid`; a new tensor like ``x``."""
    return x / torch.exp(-x).add_(1.0)


@attrs.frozen
class Numerics:
    """The ops a model's matmuls and activations go through.

    Attributes:
        linear: ``x W^T (+ b)`` (:data:`LinearOp`).
        silu: ``silu(x)`` elementwise.
        sigmoid: ``sigmoid(x)`` elementwise.
        invariant: whether these are the batch-invariant ops.
    """

    linear: LinearOp
    silu: UnaryOp
    sigmoid: UnaryOp
    invariant: bool


PLAIN = Numerics(plain_linear, F.silu, torch.sigmoid, False)
"""The default mode's ops."""

INVARIANT = Numerics(invariant_linear, invariant_silu, invariant_sigmoid, True)
"""The batch-invariant ops of the CPU."""


@runtime_checkable
class UsesNumerics(Protocol):
    """A module whose matmuls and activations go through its ``numerics`` (the linear
    layers, the model's LM head, the MoE routers and experts)."""

    numerics: Numerics


def set_numerics(module: nn.Module, numerics: Numerics) -> int:
    """Set ``numerics`` on ``module`` and every submodule that has one
    (:class:`UsesNumerics`); returns how many. Called once by the model's constructor."""
    count = 0
    for sub in module.modules():
        if isinstance(sub, UsesNumerics):
            sub.numerics = numerics
            count += 1
    return count


def select_numerics(batch_invariant: bool, device: torch.device | str) -> Numerics:
    """The numerics of a model: :data:`PLAIN`, or with ``batch_invariant`` :data:`INVARIANT`
    on the CPU and, on CUDA, the fixed-tile Triton GEMM (``models.invariant_triton``: a
    cuBLAS GEMM's reduction order changes with the row count) with the plain activations
    (a CUDA elementwise kernel computes every element alike). Called once at model
    construction.

    Raises:
        ConfigError: ``batch_invariant`` on the CPU where :func:`probe_row_invariance`
            fails (this machine's kernels sum or round a row differently by batch).
    """
    if not batch_invariant:
        return PLAIN
    dev = torch.device(device)
    if dev.type == "cuda":
        from deepinfer_kit.models import invariant_triton

        linear: LinearOp = invariant_triton.linear
        return Numerics(linear, F.silu, torch.sigmoid, True)
    failure = probe_row_invariance(dev)
    if failure is not None:
        raise ConfigError(f"batch_invariant=True: {failure}; the mode cannot be guaranteed on this machine")
    return INVARIANT


_PROBED: dict[str, str | None] = {}


def probe_row_invariance(device: torch.device) -> str | None:
    """Check, once per device type, the properties the invariant ops rest on: a padded
    product sums each row alike at every row count from :data:`MIN_ROWS` on, in any
    position, batched or not, with fixed ``K`` and ``N``; ``exp`` gives an element the same
    value at any tensor size (vector body or tail). ``None`` when they hold, else what
    failed. A few dozen small float32 calls."""
    key = device.type
    if key not in _PROBED:
        _PROBED[key] = _probe(device)
    return _PROBED[key]


def _probe(device: torch.device) -> str | None:
    gen = torch.Generator().manual_seed(0)
    for k, n in ((16, 64), (64, 1), (64, 8), (64, 64), (64, 192), (128, 256), (256, 1024)):
        w = torch.randn(n, k, generator=gen).to(device)
        row = torch.randn(1, k, generator=gen).to(device)
        ref = invariant_linear(row, w)
        for rows in (*range(2, MIN_ROWS + 20), 64, 257, 1000):
            others = torch.randn(rows, k, generator=gen).to(device)
            for place in sorted({0, rows // 2, rows - 3, rows - 2, rows - 1} - {-1, -2, -3}):
                x = others.clone()
                x[place] = row[0]
                if not torch.equal(invariant_linear(x, w)[place:place + 1], ref):
                    return (f"row {place} of a padded [{rows}, {k}] x [{k}, {n}] product differs "
                            f"from the same row alone")
        x = torch.cat([row, torch.randn(MIN_ROWS - 1, k, generator=gen).to(device)])
        batched = torch.bmm(x.expand(5, -1, -1), w.t().expand(5, -1, -1))
        if not torch.equal(batched[2, :1], F.linear(x, w)[:1]):
            return f"a batched [{MIN_ROWS}, {k}] x [{k}, {n}] product differs from the same unbatched"
    values = (torch.randn(70_003, generator=gen) * 4).to(device)
    whole = torch.exp(values)
    for size in (1, 7, 31, 33, 65, 1000, 40_000):
        if not torch.equal(torch.exp(values[:size].clone()), whole[:size]):
            return f"exp of the first {size} elements alone differs from the same elements in a longer tensor"
    return None
