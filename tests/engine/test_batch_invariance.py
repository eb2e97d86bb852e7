"""Batch-invariant mode on the real engine: BATCH_INVARIANCE_SUITE on the embedded
tiny-words model (every check), the default engine failing it, the refusals, expert
parallelism with EPLB and every supported family's tiny random checkpoint (slow)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.llm import LLM
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.testing.batch_invariance import (
    BATCH_INVARIANCE_SUITE, check_expert_parallel_with_eplb, check_tensor_parallel_is_refused,
)
from deepinfer_kit.testing.suite import Check, ConformanceError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from hf_models import FAMILIES, make_checkpoint  # noqa: E402


def tiny_words(**overrides: Any) -> LLM:
    return LLM("tiny-words", batch_invariant=True, **overrides)


def tiny_words_default(**overrides: Any) -> LLM:
    return LLM("tiny-words", **overrides)


@pytest.mark.parametrize("check", BATCH_INVARIANCE_SUITE.checks, ids=BATCH_INVARIANCE_SUITE.ids)
def test_the_suite_passes_in_batch_invariant_mode(check: Check[Any]) -> None:
    check(tiny_words)


def test_the_default_engine_fails_the_suite() -> None:
    with pytest.raises(ConformanceError, match="not batch-invariant: log-probabilities differ"):
        BATCH_INVARIANCE_SUITE.checks[0](tiny_words_default)


def test_tensor_parallel_is_refused() -> None:
    check_tensor_parallel_is_refused(tiny_words)
    with pytest.raises(ConfigError, match="batch_invariant=True with tensor_parallel=2"):
        EngineConfig(batch_invariant=True, tensor_parallel=2, worker="process")


@pytest.mark.slow
def test_expert_parallel_with_eplb() -> None:
    check_expert_parallel_with_eplb(tiny_words)


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("invariant_families")
    folders = {}
    for family in FAMILIES:
        folders[family] = root / family
        make_checkpoint(family, folders[family], seed=3)
    return folders


_FAMILY_CHECKS = ("batch_size_and_position", "chunked_prefill", "prefix_cache_hit_and_miss",
                  "speculative_decoding")


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family(family: str, family_folders: dict[str, Path]) -> None:
    folder = str(family_folders[family])

    def factory(**overrides: Any) -> LLM:
        return LLM(folder, batch_invariant=True, device="cpu", **overrides)

    # latent attention: two forms that round apart; Gemma 3: (1 + w) norms and GELU as torch
    # ops with no invariant kernels; both refused
    if family.startswith("deepseek_v3") or family == "gemma3":
        with pytest.raises(ConfigError, match="batch_invariant=True"):
            factory()
        return
    for check in BATCH_INVARIANCE_SUITE.checks:
        if check.name in _FAMILY_CHECKS:
            check(factory)
