"""The Drafter suite: the built-in drafters (prompt lookup, a draft model, the target's first
layers, DSpark heads), the tests' own and the example's pass; a drafter whose drafts depend
on its batch, or of the wrong shape, fails."""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer_kit.spec.drafters.ngram import NgramDrafter
from deepinfer_kit.spec.protocols import DraftSequence
from deepinfer_kit.spec.records import DraftProposal, SpecConfig
from deepinfer_kit.testing import DRAFTER_SUITE
from deepinfer_kit.testing.suite import Check

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import own_components as own  # noqa: E402
from my_components import BigramDrafter  # noqa: E402


@functools.cache
def _target(model: str) -> Any:
    from deepinfer_kit.engine.runner.assemble import build_tiny_model
    from deepinfer_kit.engine.runner.pool import load_model
    from deepinfer_kit.models.embedded import embedded_checkpoint

    if model == "tiny":
        return build_tiny_model()
    return load_model(embedded_checkpoint(model))


def _model_drafter(spec: dict[str, Any], model: str = "tiny") -> Any:
    from deepinfer_kit.engine.runner.drafters import build_drafter

    return build_drafter(SpecConfig(**spec), _target(model), seed=0, block_size=4, num_blocks=128,
                         max_num_seqs=8, max_model_len=256, dtype=torch.float32, device=torch.device("cpu"),
                         attention_impl="ref", moe_impl="ref")


DRAFTERS: dict[str, Any] = {
    "ngram": NgramDrafter,
    "draft_model": lambda: _model_drafter({"drafter": "draft_model", "draft_model": "tiny", "num_draft": 4}),
    "self": lambda: _model_drafter({"drafter": "self", "draft_layers": 1, "num_draft": 4}),
    "dspark": lambda: _model_drafter({"drafter": "dspark", "dspark_heads": "tiny-words", "num_draft": 4},
                                     "tiny-words"),
    "repeat_last": own.RepeatLastDrafter,
    "bigram": BigramDrafter,
}


@pytest.mark.parametrize("name", sorted(DRAFTERS))
@pytest.mark.parametrize("check", DRAFTER_SUITE.checks, ids=DRAFTER_SUITE.ids)
def test_drafters_pass_the_suite(check: Check[Any], name: str) -> None:
    check(DRAFTERS[name])


class _FirstRowDrafter:
    """Drafts every sequence from the batch's first one (a batch-dependent bug)."""

    def propose(self, requests: Sequence[DraftSequence], num_draft: int) -> DraftProposal:
        last = requests[0].all_token_ids[-1] if requests else 0
        return DraftProposal(torch.full((len(requests), num_draft), last, dtype=torch.int64),
                             [num_draft] * len(requests))


class _ShortRows(own.RepeatLastDrafter):
    """Returns one draft column fewer than asked."""

    def propose(self, requests: Sequence[DraftSequence], num_draft: int) -> DraftProposal:
        p = super().propose(requests, num_draft)
        return DraftProposal(p.token_ids[:, :-1], p.num_drafted)


@pytest.mark.parametrize("broken", [_FirstRowDrafter, _ShortRows])
def test_a_broken_drafter_fails(broken: Any) -> None:
    failed = 0
    for check in DRAFTER_SUITE:
        try:
            check(broken)
        except Exception:  # noqa: BLE001 - any failure of a check counts
            failed += 1
    assert failed >= 1
