"""With chunked prefill off, no scheduler splits a prompt that fits a round's budget."""

from __future__ import annotations

import pytest

from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.cache.records import CacheConfig
from deepinfer_kit.sched import ContinuousBatchScheduler, StaticBatchScheduler
from deepinfer_kit.sched.records import SchedulerConfig
from deepinfer_kit.step import StepResult
from deepinfer_kit.testing.sched_driver import make_request

SCHEDULERS = {"continuous": ContinuousBatchScheduler, "static": StaticBatchScheduler}


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_prompts_wait_for_a_round_with_room(kind: str) -> None:
    config = SchedulerConfig(max_num_batched_tokens=16, enable_chunked_prefill=False)
    cache = BlockKVCacheManager.create(CacheConfig(block_size=4, num_blocks=32))
    sched = SCHEDULERS[kind](config, cache)
    for rid in ("a", "b"):
        sched.add(make_request(rid, 10, max_tokens=2, ignore_eos=True))
    rounds = []
    while sched.has_unfinished():
        plan = sched.schedule()
        rounds.append([(c.request_id, c.start, c.num_tokens) for c in plan.all_chunks()])
        sched.commit(plan, StepResult([[7] * c.num_samples if c.sample else [] for c in plan.all_chunks()]))
    prefills = [chunk for r in rounds for chunk in r if chunk[2] > 1]
    assert prefills == [("a", 0, 10), ("b", 0, 10)], rounds
    assert all(sum(n for _, _, n in r) <= 16 for r in rounds)
