"""Speculative sampling through the whole engine samples what plain sampling samples.

Default tier: the real model drafters' confidences never read the token they describe (the
non-anticipating condition, checked directly on real models). Slow tier: every drafter x
planner on tiny-words — the model drafters' real confidences feed the real planners (and the
draft model's own early stop), the scheduler verifies, the runner rejection-samples; seeded
requests of one prompt, the first output positions compared (chi-square, TV) with plain
sampling on other seeds."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from deepinfer_kit import build_engine
from deepinfer_kit.spec.records import DraftView
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.spec.records import SpsCurve
from deepinfer_kit.testing.spec_engine import compare_engine_samples, engine_samples

PARAMS = SamplingParams(temperature=0.8, top_p=0.9, top_k=20)
PROMPT = list(b"The cat ")


def _check(base: dict[str, Any], spec: dict[str, Any], n: int, positions: int) -> None:
    most = positions + spec["num_draft"]  # room for drafts at every compared position
    plain, _ = engine_samples(base, PROMPT, PARAMS, range(n), positions, most)
    fast, counts = engine_samples({**base, "speculative": spec}, PROMPT, PARAMS,
                                  range(n, 2 * n), positions, most)
    assert counts["verified"] > 0 and counts["accepted"] > 0, counts
    for c in compare_engine_samples(fast, plain):
        assert c.p_value > 1e-3, (spec, c)


@pytest.mark.parametrize("name", ["self", "draft_model", "dspark"])
def test_a_model_drafters_confidence_never_reads_the_token_it_confides_in(name: str) -> None:
    """Sequences that share a context but not a seed draw different drafts; the confidence
    of draft ``j`` must be the same for every sequence whose drafts before ``j`` agree (it
    may read ``x_0 .. x_{j-1}``, never ``x_j``)."""
    model = "tiny-words" if name == "dspark" else "tiny"
    spec = {"self": {"drafter": "self", "draft_layers": 1},
            "draft_model": {"drafter": "draft_model", "draft_model": "tiny"},
            "dspark": {"drafter": "dspark", "dspark_heads": "tiny-words"}}[name]
    engine = build_engine(model=model, speculative={**spec, "num_draft": 3}, num_blocks=256)
    assert engine.runner.drafting is not None
    drafter = engine.runner.drafting.speculation.drafter
    prompt = list(b"The cat ")
    views = [DraftView(f"s{i}", prompt, (), prompt, attrs.evolve(PARAMS, seed=i), i, None)
             for i in range(48)]
    proposal = drafter.propose(views, 3)
    assert proposal.confidence is not None
    ids, conf = proposal.token_ids.tolist(), proposal.confidence.tolist()
    assert len({row[0] for row in ids}) > 1, "the seeds must draw different first drafts"
    for j in range(3):
        by_prefix: dict[tuple[int, ...], set[float]] = {}
        for row, c, made in zip(ids, conf, proposal.num_drafted):
            if made > j:
                by_prefix.setdefault(tuple(row[:j]), set()).add(round(c[j], 6))
        spread = {k: v for k, v in by_prefix.items() if len(v) > 1}
        assert not spread, f"draft {j}: one context, several confidences: {spread}"


WORDS = {"model": "tiny-words", "max_num_seqs": 256, "max_num_batched_tokens": 4096}
SPECS = {
    "self-threshold": {"drafter": "self", "draft_layers": 1, "planner": "threshold", "threshold": 0.1},
    "self-dspark": {"drafter": "self", "draft_layers": 1, "planner": "dspark",
                    "sps": SpsCurve((1, 128, 512, 2048), (100.0, 100.0, 50.0, 12.0))},
    "dspark-threshold": {"drafter": "dspark", "dspark_heads": "tiny-words", "planner": "threshold",
                         "threshold": 0.1},
    "dspark-step": {"drafter": "dspark", "dspark_heads": "tiny-words", "planner": "threshold",
                    "threshold": 0.5, "threshold_rule": "step"},
    "ngram-fixed": {"drafter": "ngram", "planner": "fixed"},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_drafter_and_planner_is_exact_on_tiny_words(name: str) -> None:
    # the first output token comes from the prefill: positions 2 and 3 are the speculative ones
    _check(WORDS, {**SPECS[name], "num_draft": 4}, 3000, 3)
