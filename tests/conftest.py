"""Test-wide setup: Triton kernels run under the interpreter when there is no GPU."""

from __future__ import annotations

import os

import pytest
import torch

# Tests run tiny ops, where one intra-op thread is fastest; under pytest-xdist every worker
# takes its own core instead of oversubscribing them.
torch.set_num_threads(1)

if not torch.cuda.is_available():
    # Must be set before triton is first imported: @triton.jit reads it at decoration.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
