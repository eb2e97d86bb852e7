"""A user-written scheduling policy plugged into ContinuousBatchScheduler.

Shortest-prompt-first admission and a cheapest-to-recompute preemption victim, each a
plain callable satisfying a Protocol of ``deepinfer_kit.sched`` (mypy --strict checks it
below). First a fake step loop feeds random tokens, so the script shows what the policy
changes (rounds until each request's first token) against FCFS, then runs the Scheduler
conformance suite on the custom-policy scheduler; last, the same scheduler drives the real
engine on the embedded tiny model, whose greedy outputs match the default scheduler's.

    .venv/bin/python examples/custom_scheduler.py
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.cache.protocols import KVCacheManager
from deepinfer_kit.cache.records import CacheConfig
from deepinfer_kit.request import Request
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sched import (
    AdmissionPolicy,
    ContinuousBatchScheduler,
    PreemptionPolicy,
    Scheduler,
    SchedulerConfig,
    StepResult,
)
from deepinfer_kit.testing.sched import SCHEDULER_SUITE


class ShortestPromptFirst:
    """Admit the request with the fewest prompt tokens first (ties: arrival order).

    Cuts the mean time to first token when prompt lengths vary; long prompts can wait
    while short ones keep arriving (no aging here).
    """

    def __call__(self, request: Request) -> tuple[float, ...]:
        return (request.num_prompt_tokens, request.arrival_time)


def cheapest_to_recompute(running: Sequence[Request]) -> Request:
    """Preempt the running request with the fewest tokens to recompute on resume."""
    return min(reversed(running), key=lambda r: r.num_tokens)


if TYPE_CHECKING:
    _admission: AdmissionPolicy = ShortestPromptFirst()
    _victim: PreemptionPolicy = cheapest_to_recompute


def build(config: SchedulerConfig, num_blocks: int, block_size: int, custom: bool) -> Scheduler:
    """A continuous-batching scheduler over a fresh cache, with our policy or FCFS."""
    cache = BlockKVCacheManager.create(CacheConfig(block_size=block_size, num_blocks=num_blocks))
    if not custom:
        return ContinuousBatchScheduler(config, cache)
    return ContinuousBatchScheduler(
        config, cache, admission=ShortestPromptFirst(), victim=cheapest_to_recompute
    )


def first_token_rounds(sched: Scheduler, seed: int) -> list[int]:
    """Add 64 requests at once, run a fake step loop; rounds until each first token."""
    rng = random.Random(seed)
    for i in range(64):
        prompt = [rng.randrange(1, 1000) for _ in range(rng.choice([8, 16, 400, 900]))]
        params = SamplingParams(temperature=1.0, max_tokens=rng.randint(4, 32))
        sched.add(Request(f"r{i}", prompt, params, arrival_time=float(i), eos_token_id=0))
    first: dict[str, int] = {}
    rounds = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        tokens = [[rng.randrange(1, 1000)] * c.num_samples if c.sample else [] for c in plan.all_chunks()]
        sched.commit(plan, StepResult(tokens))
        rounds += 1
        for chunk in plan.all_chunks():
            if chunk.sample:
                first.setdefault(chunk.request_id, rounds)
    return list(first.values())


def run_engine(custom: bool) -> dict[str, list[int]]:
    """Greedy generation on the tiny model with the custom (or default) scheduler."""
    import torch

    from deepinfer_kit import Components, build_engine

    torch.set_num_threads(1)

    # Policies reach the engine through Components, like every other component; the
    # engine builds its one scheduler (and cache manager) around them.
    mine = Components(admission_policy=ShortestPromptFirst(), preemption_policy=cheapest_to_recompute)
    engine = build_engine(
        model="tiny", num_blocks=24, block_size=8, max_model_len=160, max_num_seqs=4,
        components=mine if custom else None,
    )
    rng = random.Random(1)
    for i in range(12):
        prompt = [rng.randrange(1, 256) for _ in range(rng.choice([4, 12, 60, 100]))]
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    outputs = {o.request_id: o.outputs[0].token_ids for o in engine.run()}
    engine.check_idle()
    return outputs


def main() -> None:
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512)
    for custom in (False, True):
        ttft = first_token_rounds(build(config, 256, 16, custom), seed=0)
        name = "shortest-prompt-first" if custom else "fcfs"
        print(
            f"{name:>22}: mean {statistics.mean(ttft):6.1f} rounds to first token, "
            f"p90 {sorted(ttft)[int(0.9 * len(ttft))]}"
        )
    SCHEDULER_SUITE.run(
        lambda cfg, cache: ContinuousBatchScheduler(
            cfg, cache, admission=ShortestPromptFirst(), victim=cheapest_to_recompute
        )
    )
    print(f"conformance: all {len(SCHEDULER_SUITE)} Scheduler checks pass with the custom policy")
    same = run_engine(custom=True) == run_engine(custom=False)
    print(f"engine on the tiny model: greedy outputs identical to the default scheduler: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
