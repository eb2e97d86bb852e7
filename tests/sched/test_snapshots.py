"""Plans are snapshots: committing one round never changes what a later, already planned
round feeds (TESTING.md regression 12: the host mutated output ids while the device step
read them), and a plan never hands out a live request."""

from __future__ import annotations

import copy
from typing import Any

from deepinfer_kit.request import Request
from deepinfer_kit.sched import ContinuousBatchScheduler, SchedulerConfig, StepResult
from deepinfer_kit.testing.sched_driver import make_request


def _frozen(plan: Any) -> list[tuple[Any, ...]]:
    return [
        (c.request_id, c.start, c.num_tokens, list(c.token_ids), list(c.block_table),
         c.num_placeholders, c.output_position, tuple(c.output_token_ids))
        for c in plan.chunks
    ]


def test_committing_a_round_leaves_the_next_planned_round_untouched(make_cache: Any) -> None:
    sched = ContinuousBatchScheduler(SchedulerConfig(max_num_batched_tokens=64), make_cache(32, 4))
    reqs = [make_request(f"r{i}", 3 + i, max_tokens=12, ignore_eos=True, presence_penalty=0.5)
            for i in range(3)]
    for req in reqs:
        sched.add(req)
    first = sched.schedule()
    sched.commit(first, StepResult([[7] for _ in first.chunks]))
    k = sched.schedule()  # decodes with their tokens known
    k1 = sched.schedule()  # decodes whose token k is still sampling: placeholders
    assert all(c.num_placeholders == 1 for c in k1.chunks)
    before_k, before_k1 = copy.deepcopy(_frozen(k)), copy.deepcopy(_frozen(k1))
    sched.commit(k, StepResult([[8] for _ in k.chunks]))  # appends, publishes, may free
    assert _frozen(k) == before_k and _frozen(k1) == before_k1
    assert all(req.output_token_ids == [7, 8] for req in reqs)
    for chunk in k1.chunks:
        assert not isinstance(getattr(chunk, "request", None), Request)
        assert chunk.output_token_ids == (7,)  # the in-flight 8 is the runner's to add
        assert chunk.output_position == 2
