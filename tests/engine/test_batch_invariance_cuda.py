"""Batch-invariant mode on a GPU (``cuda`` tier): BATCH_INVARIANCE_SUITE on the embedded
tiny-words model with the compiled Triton kernels (the invariant GEMM, paged attention and
MoE paths), in fp32 and bf16, and the default engine failing its first check there too."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepinfer_kit.engine.llm import LLM
from deepinfer_kit.testing.batch_invariance import BATCH_INVARIANCE_SUITE
from deepinfer_kit.testing.suite import Check

pytestmark = pytest.mark.cuda

_FACTORIES: dict[str, Any] = {}


def _factory(dtype: str) -> Any:
    # one factory object per dtype: the suite caches each factory's alone traces
    if dtype not in _FACTORIES:
        def factory(**overrides: Any) -> LLM:
            # a fixed pool: pytest-xdist workers share the GPU, so none may size it from
            # the free memory
            return LLM("tiny-words", batch_invariant=True, device="cuda", dtype=dtype,
                       num_blocks=1024, max_model_len=1024, **overrides)
        _FACTORIES[dtype] = factory
    return _FACTORIES[dtype]


@pytest.mark.parametrize("check", BATCH_INVARIANCE_SUITE.checks, ids=BATCH_INVARIANCE_SUITE.ids)
def test_the_suite_passes_on_cuda(check: Check[Any]) -> None:
    assert torch.cuda.is_available()
    check(_factory("float32"))


@pytest.mark.parametrize("name", ["batch_size_and_position", "chunked_prefill", "speculative_decoding"])
def test_bf16_on_cuda(name: str) -> None:
    check = next(c for c in BATCH_INVARIANCE_SUITE.checks if c.name == name)
    check(_factory("bfloat16"))
