"""Test-wide setup: Triton kernels run under the interpreter except in a GPU run of the
``cuda`` tier.

The default tier builds its tensors on the CPU (it is the tier CI runs), so its Triton
kernels must run under the interpreter on every machine, a GPU one included: a compiled
kernel cannot read CPU tensors. ``pytest -m cuda`` on a GPU machine leaves the interpreter
off, so its tests run the compiled kernels on CUDA tensors against their torch references.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiers import selects_cuda_tier  # noqa: E402

# Tests run tiny ops, where one intra-op thread is fastest; under pytest-xdist every worker
# takes its own core instead of oversubscribing them.
torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    # Before any test module imports a kernel module: @triton.jit reads it at decoration.
    if not (torch.cuda.is_available() and selects_cuda_tier(config.option.markexpr or "")):
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
