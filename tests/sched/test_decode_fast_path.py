"""The plain-decode fast path (sched/decodes.py: a run's new blocks from one cache call,
its commit in bulk) makes the decisions of the general path, chunk for chunk.

Each workload runs twice over equal caches: once as shipped, once with the fast path
off (``plan_decodes`` plans nothing, so every chunk takes ``add_chunk``, a per-sequence
``allocate`` and the general commit). Plans (every chunk field, block tables included),
outputs and the cache's counters must be equal, under eviction and preemption pressure,
with stop ids, EOS, ``min_tokens``, stop strings (an observer), forks, penalties and aborts.
"""

from __future__ import annotations

import random
from typing import Any

import attrs
import pytest

from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.request import Request
from deepinfer_kit.sched import ContinuousBatchScheduler, SchedulePlan, StepResult
from deepinfer_kit.sched import planning
from deepinfer_kit.sched.records import ScheduledChunk, SchedulerConfig
from deepinfer_kit.sched.state import InflightPlan, SchedulerState
from deepinfer_kit.testing.sched_driver import make_request

P = 4


class _StopAt:
    """A stop-string observer stand-in: ends the sequence at its ``k``-th output."""

    def __init__(self, k: int) -> None:
        self.k = k

    def on_token(self, request: Request, finished: bool) -> str | None:
        return "<stop>" if not finished and len(request.output_token_ids) == self.k else None

    def fork(self, child: Request) -> _StopAt:
        return _StopAt(self.k)


def _requests(seed: int, count: int) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        params: dict[str, Any] = dict(
            max_tokens=rng.randint(1, 40),
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=rng.choice([(), (), (5,), (7, 11)]),
            n=rng.choice([1, 1, 1, 1, 2]),
        )
        params["min_tokens"] = min(rng.choice([0, 0, 0, 3]), params["max_tokens"])
        if rng.random() < 0.1:
            params["presence_penalty"] = 0.5
        req = make_request(
            f"r{i}", rng.randint(1, 30),
            prompt_seed=f"s{rng.randrange(4)}" if rng.random() < 0.5 else None, priority=rng.randrange(3),
            **params,
        )
        if rng.random() < 0.1:
            req.observer = _StopAt(rng.randint(1, 8))  # type: ignore[assignment]
        out.append(req)
    return out


def _no_fast_path(state: SchedulerState, entry: InflightPlan, i: int, budget: int) -> tuple[int, int]:
    return i, budget


def _run(seed: int, num_blocks: int, policy: str = "fcfs") -> list[Any]:
    """Everything observable of one run: per round the plan's fields and the outputs.
    Under the priority policy a victim is often a sequence already planned this round
    (its decode row or chunk leaves the plan)."""
    config = SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=40, max_model_len=64,
                             long_prefill_token_threshold=9, policy=policy)
    cache = _Logged.create(_cache_config(num_blocks))
    sched = ContinuousBatchScheduler(config, cache)
    rng = random.Random(seed + 1)
    pending = _requests(seed, 40)
    seen: list[Any] = []
    while pending or sched.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add(pending.pop(0))
        if rng.random() < 0.05 and sched.running:
            sched.abort(rng.choice(sched.running).request_id)
        plan = sched.schedule()
        result = StepResult([_tokens(seed, c) for c in plan.all_chunks()])
        outs = sched.commit(plan, result)
        seen.append((_plan_fields(plan), [_output_fields(o) for o in outs]))
        cache.check_integrity([*sched.running])
        assert len(seen) < 2000, "the run does not end (a sequence past its length limit?)"
    stats = cache.stats
    assert stats is not None
    seen.append(attrs.asdict(stats) if attrs.has(type(stats)) else repr(stats))
    seen.append(cache.log)  # the commit's publishes and frees, in the order it made them
    return seen


class _Logged(BlockKVCacheManager):
    """The cache manager, logging the calls a commit makes (publishes and frees) in order:
    the fast path must make them in the general path's order, not just end equal."""

    log: list[tuple[str, str, int]]

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> Any:
        made = super().create(*args, **kwargs)
        made.__class__ = cls
        made.log = []
        return made

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        self.log.append(("publish", request.request_id, num_tokens))
        super().cache_full_blocks(request, num_tokens)

    def free(self, request: Request) -> None:
        self.log.append(("free", request.request_id, 0))
        super().free(request)


def _tokens(seed: int, chunk: ScheduledChunk) -> list[int]:
    """The chunk's sampled tokens, a function of its sequence and position only: the
    batch order (decode rows first on the fast path, planning order without it) does not
    change what a sequence draws."""
    if not chunk.sample:
        return []
    rng = random.Random(f"{seed}/{chunk.request_id}/{chunk.start}")
    return [rng.choice([0, 5, 7, 11]) if rng.random() < 0.08 else rng.randrange(12, 99)
            for _ in range(chunk.num_samples)]


def _cache_config(num_blocks: int) -> Any:
    from deepinfer_kit.cache.records import CacheConfig

    return CacheConfig(block_size=P, num_blocks=num_blocks)


def _plan_fields(plan: SchedulePlan) -> Any:
    """The plan's chunks by sequence (the batch puts decode rows first: the order differs
    with the fast path off; what each sequence gets must not)."""
    chunks = sorted((
        {k: (list(v) if isinstance(v, (list, tuple)) else v)
         for k, v in attrs.asdict(c, recurse=False).items() if k != "sampling"}
        for c in plan.all_chunks()
    ), key=lambda c: c["request_id"])
    return (chunks, list(plan.block_copies), list(plan.preempted_ids), list(plan.finished_ids),
            plan.num_batched_tokens, plan.num_cached_tokens)


def _output_fields(out: RequestOutput) -> Any:
    return (out.request_id, [(c.index, list(c.token_ids), c.finish_reason, c.stop_reason)
                             for c in out.outputs])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("num_blocks", "policy"), [(14, "fcfs"), (40, "fcfs"), (400, "fcfs"), (14, "priority"),
                                                    (24, "priority")])
def test_fast_path_makes_the_general_paths_decisions(
    seed: int, num_blocks: int, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as m:
        m.setattr(planning, "plan_decodes", _no_fast_path)
        slow = _run(seed, num_blocks, policy)
    fast = _run(seed, num_blocks, policy)
    assert len(fast) == len(slow)
    for step, (a, b) in enumerate(zip(fast, slow)):
        assert a == b, f"seed {seed}, {num_blocks} blocks: round {step} differs"


def test_fast_path_runs_and_pressure_is_real(monkeypatch: pytest.MonkeyPatch) -> None:
    # The comparison above is only worth something if the fast path and preemption ran.
    calls = {"grow": 0}
    real = BlockKVCacheManager.allocate_next_blocks

    def counting(self: BlockKVCacheManager, requests: Any) -> int:
        calls["grow"] += len(requests)
        return real(self, requests)

    monkeypatch.setattr(BlockKVCacheManager, "allocate_next_blocks", counting)
    rounds = _run(0, 14)
    assert calls["grow"] > 0
    assert any(r[0][2] for r in rounds[:-1]), "no preemption under the small pool"


def test_a_decode_given_two_tokens_raises_as_the_general_path() -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    sched = ContinuousBatchScheduler(config, BlockKVCacheManager.create(_cache_config(32)))
    for i in range(3):
        sched.add(make_request(f"d{i}", 5, max_tokens=10, ignore_eos=True))
    plan = sched.schedule()
    sched.commit(plan, StepResult([[20] for _ in plan.chunks]))
    plan = sched.schedule()
    assert plan.decodes.request_ids == ["d0", "d1", "d2"] and not plan.chunks  # the fast path's rows
    from deepinfer_kit.errors import InvariantError

    tokens = [[21], [22, 23], [24]]
    with pytest.raises(InvariantError, match=r"chunk 1 \(d1\) expects 1 token"):
        sched.commit(plan, StepResult(tokens))
