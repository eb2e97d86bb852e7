"""With chunked prefill off, a prompt exactly the size of what is left of a round's budget
(or of the whole budget) is scheduled whole in that round; one token under as well; one
over the whole budget is refused at ``add`` with ``error``; one over what is left waits for
the next round. And no scheduler returns an empty plan while work is waiting and fits."""

from __future__ import annotations

import random

import pytest

from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.cache.records import CacheConfig
from deepinfer_kit.sched import ContinuousBatchScheduler, StaticBatchScheduler
from deepinfer_kit.sched.records import SchedulePlan, SchedulerConfig
from deepinfer_kit.step import StepResult
from deepinfer_kit.testing.sched_driver import make_request

SCHEDULERS = {"continuous": ContinuousBatchScheduler, "static": StaticBatchScheduler}
BUDGET = 16


def _scheduler(kind: str, **config: int) -> ContinuousBatchScheduler | StaticBatchScheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=BUDGET, enable_chunked_prefill=False, **config)
    return SCHEDULERS[kind](cfg, BlockKVCacheManager.create(CacheConfig(block_size=4, num_blocks=64)))


def _commit(sched: ContinuousBatchScheduler | StaticBatchScheduler, plan: SchedulePlan) -> list[str]:
    outs = sched.commit(plan, StepResult([[7] * c.num_samples if c.sample else [] for c in plan.all_chunks()]))
    return [o.request_id for o in outs if o.finished]


def _rounds(sched: ContinuousBatchScheduler | StaticBatchScheduler) -> list[list[tuple[str, int, int]]]:
    rounds = []
    while sched.has_unfinished():
        plan = sched.schedule()
        chunks = [(c.request_id, c.start, c.num_tokens) for c in plan.all_chunks()]
        assert chunks, f"an empty plan while work waits (round {len(rounds)})"
        rounds.append(chunks)
        _commit(sched, plan)
        assert len(rounds) < 200
    return rounds


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
@pytest.mark.parametrize("prompt", [BUDGET - 1, BUDGET])
def test_a_prompt_up_to_the_whole_budget_runs_whole_in_the_first_round(kind: str, prompt: int) -> None:
    sched = _scheduler(kind)
    sched.add(make_request("a", prompt, max_tokens=2, ignore_eos=True))
    rounds = _rounds(sched)
    assert rounds[0] == [("a", 0, prompt)]
    assert len(rounds) == 2  # the prefill samples the first token, one decode the second


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_a_prompt_one_over_the_whole_budget_ends_with_an_error_at_once(kind: str) -> None:
    sched = _scheduler(kind)
    req = make_request("a", BUDGET + 1, max_tokens=2)
    sched.add(req)
    assert req.error is not None and "max_num_batched_tokens" in req.error
    plan = sched.schedule()
    assert _commit(sched, plan) == ["a"] and not sched.has_unfinished()


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
@pytest.mark.parametrize(("second", "together"), [(9, True), (10, True), (11, False)])
def test_a_prompt_equal_to_what_is_left_of_the_budget_shares_the_round(
    kind: str, second: int, together: bool
) -> None:
    """6 + 10 == 16: both prompts in the first round; 6 + 11: the second waits (it is never
    split), and then runs whole."""
    sched = _scheduler(kind)
    sched.add(make_request("a", 6, max_tokens=2, ignore_eos=True))
    sched.add(make_request("b", second, max_tokens=2, ignore_eos=True))
    rounds = _rounds(sched)
    prefills = [c for r in rounds for c in r if c[2] > 1]
    assert prefills == [("a", 0, 6), ("b", 0, second)]
    first = {rid for rid, _, _ in rounds[0]}
    assert first == ({"a", "b"} if together else {"a"}), rounds


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
@pytest.mark.parametrize("seed", range(6))
def test_never_an_empty_plan_while_work_waits_and_fits(kind: str, seed: int) -> None:
    """Random prompts of 1..BUDGET tokens (many exactly BUDGET or what is left of it),
    arriving between rounds: every round schedules something until all are done, never
    past the budget, and every prompt runs unsplit."""
    rng = random.Random(seed)
    sched = _scheduler(kind, max_num_seqs=4)
    lengths = [rng.choice([BUDGET, BUDGET, BUDGET - 1, rng.randint(1, BUDGET)]) for _ in range(14)]
    pending = [make_request(f"r{i}", n, max_tokens=rng.randint(1, 3), ignore_eos=True)
               for i, n in enumerate(lengths)]
    done: list[str] = []
    rounds = 0
    while pending or sched.has_unfinished():
        for _ in range(rng.randint(0, 2)):
            if pending:
                sched.add(pending.pop(0))
        if not sched.has_unfinished():
            continue
        plan = sched.schedule()
        chunks = list(plan.all_chunks())
        assert chunks, f"an empty plan while work waits (seed {seed}, round {rounds})"
        assert sum(c.num_tokens for c in chunks) <= BUDGET
        assert all(c.num_tokens == 1 or c.start == 0 for c in chunks)  # prefills unsplit
        done += _commit(sched, plan)
        rounds += 1
        assert rounds < 500
    assert sorted(done) == sorted(f"r{i}" for i in range(len(lengths)))
