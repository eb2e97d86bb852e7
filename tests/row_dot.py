"""A Triton-interpreter ``tl.dot`` that sums each output row as a GPU dot does: alone.

The interpreter runs ``tl.dot`` as ``numpy.matmul(a, b) + acc``, and numpy's BLAS
(OpenBLAS) sums a row differently by its place in the tile (its microkernel takes rows in
groups, the last group another way), so under the plain interpreter a row's result moves
with its place in a batch even in a kernel whose tiles and loops are fixed. A GPU's dot
treats every row of a tile alike (one instruction sequence for all rows). The
batch-invariance tests of the kernels therefore run the interpreter with :func:`row_dot`:
each tile product summed over its ``K`` in order, in fp32, row by row independent of the
others, then added to the accumulator, as the interpreter's own dot adds its block sum.
What they prove under it is the kernel's part (fixed tiles, fixed key and ``K`` order,
splits and merges); the dot's own part is what the ``cuda`` tests check natively.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest


def _as_f32(handle: Any) -> np.ndarray:
    import triton.language as tl

    if handle.dtype.scalar == tl.bfloat16:  # stored as the high half of a float32
        return (handle.data.astype(np.uint32) << 16).view(np.float32)
    return handle.data.astype(np.float32)


def row_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
    """``d + a @ b`` with every row of ``a @ b`` summed over ``K`` in order (fp32)."""
    from triton.runtime.interpreter import TensorHandle

    x, y = _as_f32(a), _as_f32(b)
    total = np.zeros(x.shape[:-1] + y.shape[-1:], dtype=np.float32)
    for k in range(x.shape[-1]):
        total = total + x[..., :, k : k + 1] * y[..., k : k + 1, :]
    return TensorHandle((d.data + total).astype(d.data.dtype), d.dtype.scalar)


@pytest.fixture
def row_invariant_dot(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run the interpreter's ``tl.dot`` as :func:`row_dot` for the test."""
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", row_dot)
    yield
