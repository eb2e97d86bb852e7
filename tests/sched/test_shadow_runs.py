"""End-to-end runs through a fake model whose KV lives in the block slots.

Preemption by recompute, overlap (placeholders, one step in flight), speculative chunks
and static batching must all give exactly the tokens of a plain continuous run with a
pool large enough to never preempt. Every round also checks the block accounting.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import pytest
from sched_shadow import SlotModel, greedy_continuation

from deepinfer_kit.sched import ContinuousBatchScheduler, StaticBatchScheduler
from deepinfer_kit.sched.scheduler import BatchScheduler
from deepinfer_kit.sched.records import SchedulerConfig
from deepinfer_kit.testing.sched_driver import SchedulerDriver, make_request

P = 4
Outcome = dict[tuple[str, int], tuple[tuple[int, ...], str | None]]


def workload(seed: int, count: int = 24) -> list[dict[str, Any]]:
    """Mixed prompts (some sharing prefixes), lengths, n > 1, min_tokens, EOS on/off."""
    rng = random.Random(seed)
    reqs = []
    for i in range(count):
        reqs.append(
            dict(
                request_id=f"w{i}",
                prompt_len=rng.randint(1, 22),
                prompt_seed=f"shared{rng.randrange(3)}" if rng.random() < 0.4 else None,
                max_tokens=rng.randint(1, 14),
                min_tokens=rng.choice([0, 0, 2]),
                n=rng.choice([1, 1, 1, 2, 3]),
                ignore_eos=rng.random() < 0.5,
            )
        )
    return reqs


def _add_all(sched: BatchScheduler, reqs: list[dict[str, Any]]) -> None:
    for spec in reqs:
        spec = dict(spec)
        sched.add(make_request(spec.pop("request_id"), spec.pop("prompt_len"), **spec))


def run(
    cls: type[BatchScheduler],
    num_blocks: int,
    reqs: list[dict[str, Any]],
    make_cache: Any,
    *,
    config: SchedulerConfig | None = None,
    overlap: bool = False,
    draft_rng: random.Random | None = None,
) -> tuple[Outcome, int]:
    """Run ``reqs`` to completion; returns the completions and the preemption count."""
    cfg = config or SchedulerConfig(
        max_num_seqs=6, max_num_batched_tokens=32, long_prefill_token_threshold=12
    )
    cache = make_cache(num_blocks, P)
    sched = cls(cfg, cache)
    model = SlotModel(num_blocks, P, sched.get,
                      draft=(lambda req, room: _draft(req, room, draft_rng)) if draft_rng is not None else None)
    if draft_rng is not None:
        sched.reserve_drafts(4)  # the model drafts into this room, as the runner does
    drv = SchedulerDriver(sched, cfg, model=model)
    _add_all(sched, reqs)
    preempted = 0
    in_flight: deque[Any] = deque()
    for _ in range(5000):
        if not sched.has_unfinished():
            while in_flight:  # flush
                drv.commit(*in_flight.popleft())
            break
        plan = sched.schedule() if overlap else drv.schedule()
        preempted += len(plan.preempted_ids)
        in_flight.append((plan, model(plan)))
        if len(in_flight) > (1 if overlap else 0):
            drv.commit(*in_flight.popleft())
        if overlap:
            cache.check_integrity()
        elif not in_flight:
            cache.check_integrity(sched.running)
    else:
        raise AssertionError("run did not finish")
    cache.check_integrity(())  # idle: every block unreferenced
    assert cache.num_free_blocks == num_blocks
    return {k: (tuple(c.token_ids), c.finish_reason) for k, c in drv.completions.items()}, preempted


def _draft(req: Any, room: int, rng: random.Random, vocab: int = 50) -> list[int]:
    """Drafts for a decode with ``room``: the true continuation, corrupted at a random point."""
    drafts = greedy_continuation(req.all_token_ids, rng.randint(0, room), vocab)
    if drafts and rng.random() < 0.5:
        drafts[rng.randrange(len(drafts))] = rng.randrange(1, vocab)
    return drafts


@pytest.mark.parametrize("seed", range(4))
def test_preemption_gives_the_same_tokens(seed: int, make_cache: Any) -> None:
    reqs = workload(seed)
    want, none = run(ContinuousBatchScheduler, 400, reqs, make_cache)
    assert none == 0
    got, preempted = run(ContinuousBatchScheduler, 14, reqs, make_cache)
    assert preempted > 0, "the tiny pool must force preemptions"
    assert got == want
    assert len(want) == sum(r["n"] for r in reqs)


@pytest.mark.parametrize("seed", range(3))
def test_static_batching_gives_the_same_tokens(seed: int, make_cache: Any) -> None:
    reqs = workload(seed, 16)
    want, _ = run(ContinuousBatchScheduler, 400, reqs, make_cache)
    got, preempted = run(StaticBatchScheduler, 40, reqs, make_cache)
    assert preempted == 0 and got == want


@pytest.mark.parametrize("seed", range(3))
def test_overlap_gives_the_same_tokens(seed: int, make_cache: Any) -> None:
    reqs = workload(seed)
    want, _ = run(ContinuousBatchScheduler, 400, reqs, make_cache)
    assert run(ContinuousBatchScheduler, 400, reqs, make_cache, overlap=True)[0] == want
    got, preempted = run(ContinuousBatchScheduler, 16, reqs, make_cache, overlap=True)
    assert preempted > 0 and got == want


@pytest.mark.parametrize("seed", range(3))
def test_speculative_chunks_give_the_same_tokens(seed: int, make_cache: Any) -> None:
    reqs = workload(seed)
    want, _ = run(ContinuousBatchScheduler, 400, reqs, make_cache)
    got, _ = run(ContinuousBatchScheduler, 400, reqs, make_cache, draft_rng=random.Random(seed))
    assert got == want
    got, preempted = run(
        ContinuousBatchScheduler, 14, reqs, make_cache, draft_rng=random.Random(seed)
    )
    assert preempted > 0 and got == want
