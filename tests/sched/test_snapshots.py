"""Plans are snapshots: committing one round never changes what a later, already planned
round feeds (TESTING.md regression 12: the host mutated output ids while the device step
read them), and a plan never hands out a live request."""

from __future__ import annotations

import copy
import random
from typing import Any

from deepinfer_kit.request import Request
from deepinfer_kit.sched import ContinuousBatchScheduler, SchedulerConfig, StepResult
from deepinfer_kit.testing.sched_driver import SchedulerDriver, make_request


def _frozen(plan: Any) -> list[tuple[Any, ...]]:
    return [
        (c.request_id, c.start, c.num_tokens, list(c.token_ids), list(c.block_table),
         c.num_placeholders, c.output_position, tuple(c.output_token_ids))
        for c in plan.all_chunks()
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
    assert all(c.num_placeholders == 1 for c in k1.all_chunks())
    before_k, before_k1 = copy.deepcopy(_frozen(k)), copy.deepcopy(_frozen(k1))
    sched.commit(k, StepResult([[8] for _ in k.all_chunks()]))  # appends, publishes, may free
    assert _frozen(k) == before_k and _frozen(k1) == before_k1
    assert all(req.output_token_ids == [7, 8] for req in reqs)
    for chunk in k1.all_chunks():
        assert not isinstance(getattr(chunk, "request", None), Request)
        assert chunk.output_token_ids == (7,)  # the in-flight 8 is the runner's to add
        assert chunk.output_position == 2


def _check_tables(sched: Any, plan: Any, last: dict[str, list[int]]) -> int:
    """Each chunk's table equals its sequence's live table when planned and is never the
    live list; returns how many chunks reuse the previous round's snapshot object."""
    shared = 0
    for c in plan.all_chunks():
        live = sched.get(c.request_id).block_table
        assert c.block_table == live and c.block_table is not live, (plan.step_id, c)
        shared += c.block_table is last.get(c.request_id)
        last[c.request_id] = c.block_table
    return shared


def test_shared_table_snapshots_match_the_live_table_through_forks_drafts_preemptions(
    make_cache: Any,
) -> None:
    """A block-table snapshot is reused across rounds while the table is unchanged; it
    must be replaced whenever a block is added, copied on write (forks), rolled back
    (rejected drafts) or released (preemption), over random runs on a tiny pool."""
    shared = preempted = 0
    for seed in range(12):
        rng = random.Random(seed)
        config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=64,
                                 long_prefill_token_threshold=8)
        sched = ContinuousBatchScheduler(config, make_cache(14, 4))
        sched.reserve_drafts(1)  # the step "drafts" into part of the decodes' room
        drv = SchedulerDriver(sched, config, seed=seed, block_size=4, model=_some_drafts_accepted(rng))
        for i in range(10):
            sched.add(make_request(f"r{i}", rng.randrange(2, 14), prompt_seed=str(i % 3),
                                   max_tokens=rng.randrange(4, 24), ignore_eos=True,
                                   n=rng.choice((1, 1, 2)), seed=seed))
        last: dict[str, list[int]] = {}
        for _ in range(500):
            if not sched.has_unfinished():
                break
            plan = drv.schedule()
            shared += _check_tables(sched, plan, last)
            preempted += len(plan.preempted_ids)
            drv.commit(plan)
        assert not sched.has_unfinished()
        sched.cache.check_integrity(())
    assert shared > 100 and preempted > 0, (shared, preempted)


def _some_drafts_accepted(rng: random.Random) -> Any:
    """A step that drafts part of each decode's room and accepts part of those (so some
    drafts are rolled back, shrinking the table), then one more token."""

    def step(plan: Any) -> StepResult:
        tokens, drafted, drafts = [], [], []
        for c in plan.all_chunks():
            if not c.sample:
                tokens.append([])
                drafted.append(0)
                drafts.append(())
                continue
            spec = tuple(rng.randrange(1, 100) for _ in range(c.draft_room if rng.random() < 0.3 else 0))
            kept = rng.randint(0, len(spec))
            tokens.append([*spec[:kept], rng.randrange(1, 100)] if c.num_samples == 1
                          else [rng.randrange(1, 100) for _ in range(c.num_samples)])
            drafted.append(len(spec) if c.num_samples == 1 else 0)
            drafts.append(spec if c.num_samples == 1 else ())
        return StepResult(tokens, num_drafted=drafted, drafts=drafts) if any(drafted) else StepResult(tokens)

    return step
