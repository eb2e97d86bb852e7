"""Engine test fixtures: tiny transformers checkpoints (the oracle) and engine builders."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from hf_models import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, Any]]]:
    """``family -> (folder, transformers model)`` for a dense and an MoE family."""
    root = tmp_path_factory.mktemp("engine_ckpt")
    made = {}
    for family in ("qwen3", "qwen3_moe"):
        folder = root / family
        made[family] = (folder, make_checkpoint(family, folder, seed=1))
    yield made
