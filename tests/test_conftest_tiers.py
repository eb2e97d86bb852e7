"""The rule that keeps compiled Triton kernels away from CPU tensors: only a run that
selects the ``cuda`` tier leaves the interpreter off."""

from __future__ import annotations

import os

import pytest
from tiers import selects_cuda_tier


@pytest.mark.parametrize(
    ("markexpr", "cuda"),
    [("not slow and not cuda", False), ("", False), ("slow", False), ("cuda", True),
     ("cuda and triton", True), ("triton or cuda", True), ("not cuda", False)],
)
def test_only_the_cuda_tier_runs_compiled_kernels(markexpr: str, cuda: bool) -> None:
    assert selects_cuda_tier(markexpr) is cuda


def test_the_default_tier_runs_under_the_interpreter() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
