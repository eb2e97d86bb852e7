"""Every bad speculative configuration is a ConfigError naming the field, raised before any
weights load (and, with a worker process, before any worker starts)."""

from __future__ import annotations

from typing import Any

import pytest

from deepinfer_kit import build_engine
from deepinfer_kit.engine.runner import assemble
from deepinfer_kit.engine.runner import pool as runner_pool
from deepinfer_kit.errors import CheckpointError, ConfigError


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading any model fails the test: the checks must come first."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("weights were loaded before the speculative config was checked")

    for module in (assemble, runner_pool):
        monkeypatch.setattr(module, "load_model", refuse)
        monkeypatch.setattr(module, "build_tiny_model", refuse)


@pytest.mark.parametrize(("spec", "config", "message"), [
    ({"drafter": "ngram", "num_draft": 10**9}, {}, r"speculative.num_draft must be an int in \[1, 64\]"),
    ({"drafter": "self", "draft_layers": 1, "num_draft": 64}, {"max_model_len": 64},
     r"speculative.num_draft must be below the model's length limit \(64\), got 64"),
    ({"drafter": "self", "draft_layers": 9}, {}, r"draft_layers must be an int in \[1, 2\].*got 9"),
    ({"drafter": "dspark", "dspark_heads": "tiny-words", "num_draft": 5}, {"model": "tiny-words"},
     r"num_draft must be <= 4 \(the DSpark heads' positions\), got 5"),
    ({"drafter": "dspark", "dspark_heads": "/no/such/heads.safetensors"}, {"model": "tiny-words"},
     "no such file"),
    ({"drafter": "ngram", "planner": "threshold", "threshold_rule": "each"}, {}, "threshold_rule"),
])
def test_bad_speculative_configs_fail_before_any_weights_load(
        no_weights: None, spec: dict[str, Any], config: dict[str, Any], message: str) -> None:
    with pytest.raises((ConfigError, CheckpointError), match=message):
        build_engine(speculative=spec, **config)


def test_the_same_checks_come_first_with_a_worker_process(no_weights: None) -> None:
    with pytest.raises(ConfigError, match="draft_layers must be an int in"):
        build_engine(worker="process", speculative={"drafter": "self", "draft_layers": 9})
