"""The speculative distribution check on a real engine: many seeded requests of one prompt
sampled with and without speculation, compared position by position.

The component suite (:mod:`deepinfer_kit.testing.spec_distribution`) runs the drafting
step, the planners and the verifier over a toy model; this runs the whole engine — the
model drafters over their own KV, the planners on the drafters' real confidences, the
scheduler's verified chunks, the runner's verification — on a real checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.testing.spec_stats import SampleComparison, compare_samples

__all__ = ["engine_samples", "compare_engine_samples"]


def engine_samples(engine_config: Mapping[str, Any], prompt: Sequence[int], params: SamplingParams,
                   seeds: Sequence[int], positions: int,
                   max_tokens: int | None = None) -> tuple[list[list[int]], dict[str, int]]:
    """Build an engine from ``engine_config`` (``build_engine`` keywords), run one request
    per seed (``params`` with that seed, EOS ignored) and return each request's first
    ``positions`` tokens, in seed order, with the drafts verified and accepted.

    Requests generate ``max_tokens`` (default ``positions + 8``): a request's last tokens
    leave no room for drafts, so generating only the compared positions would verify no
    draft at the later ones.

    The engine ends idle (its idle check runs), so a run that leaks fails here.
    """
    from deepinfer_kit import build_engine

    verified = accepted = 0

    def count(trace: Any) -> None:
        nonlocal verified, accepted
        verified += trace.num_drafted
        accepted += trace.num_accepted

    engine = build_engine(**dict(engine_config), trace=count)
    try:
        for i, seed in enumerate(seeds):
            engine.add_request(f"s{i}", list(prompt), attrs.evolve(
                params, seed=seed, max_tokens=max_tokens or positions + 8, ignore_eos=True))
        outs = {o.request_id: o.outputs[0].token_ids for o in engine.run()}
        engine.check_idle()
    finally:
        engine.close()
    return ([list(outs[f"s{i}"][:positions]) for i in range(len(seeds))],
            {"verified": verified, "accepted": accepted})


def compare_engine_samples(fast: Sequence[Sequence[int]],
                           plain: Sequence[Sequence[int]]) -> list[SampleComparison]:
    """Per output position, the two samples compared (chi-square and TV)."""
    positions = min(len(fast[0]), len(plain[0]))
    return [compare_samples(p, [o[p] for o in fast], [o[p] for o in plain]) for p in range(positions)]
