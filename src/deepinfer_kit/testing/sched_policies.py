"""Conformance suites for the scheduler's injected policies: AdmissionPolicy (the waiting
queue's sort key), PreemptionPolicy (the victim rule) and BatchingPolicy (when and what a
round admits). Each checks the policy's own contract, then runs scheduler checks of
:data:`~deepinfer_kit.testing.sched.SCHEDULER_SUITE` on a :class:`BatchScheduler` built with
it (the policies are what the engine's ``Components`` takes)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from deepinfer_kit.request import Request
from deepinfer_kit.sched.batching import ContinuousBatching
from deepinfer_kit.sched.protocols import AdmissionPolicy, BatchingPolicy, PreemptionPolicy, SchedulerFactory
from deepinfer_kit.sched.records import SchedulerConfig
from deepinfer_kit.sched.scheduler import BatchScheduler
from deepinfer_kit.step import StepResult
from deepinfer_kit.testing.sched import SCHEDULER_SUITE, build_scheduler
from deepinfer_kit.testing.sched_driver import make_request
from deepinfer_kit.testing.suite import Suite, expect

__all__ = [
    "AdmissionFactory", "PreemptionFactory", "BatchingFactory",
    "ADMISSION_POLICY_SUITE", "PREEMPTION_POLICY_SUITE", "BATCHING_POLICY_SUITE",
]

AdmissionFactory = Callable[[], AdmissionPolicy]
"""``factory()`` -> an admission policy."""
PreemptionFactory = Callable[[], PreemptionPolicy]
"""``factory()`` -> a preemption (victim) policy."""
BatchingFactory = Callable[[], BatchingPolicy]
"""``factory()`` -> a batching policy, fresh."""

ADMISSION_POLICY_SUITE: Suite[AdmissionFactory] = Suite("AdmissionPolicy", "factory() -> AdmissionPolicy")
PREEMPTION_POLICY_SUITE: Suite[PreemptionFactory] = Suite("PreemptionPolicy", "factory() -> PreemptionPolicy")
BATCHING_POLICY_SUITE: Suite[BatchingFactory] = Suite("BatchingPolicy", "factory() -> BatchingPolicy")


def _requests(seed: int, n: int = 12) -> list[Request]:
    rng = random.Random(seed)
    return [make_request(f"r{i}", rng.randint(1, 60), priority=rng.randint(-3, 3),
                         arrival=rng.random() * 10, max_tokens=rng.randint(1, 8)) for i in range(n)]


def _state(r: Request) -> tuple[object, ...]:
    return (r.request_id, tuple(r.all_token_ids), r.status, r.priority, r.arrival_time,
            r.num_computed_tokens, tuple(r.block_table))


# ---- AdmissionPolicy ------------------------------------------------------------------------


@ADMISSION_POLICY_SUITE.check
def check_the_key_is_a_tuple_of_finite_numbers(factory: AdmissionFactory) -> None:
    policy = factory()
    for r in _requests(0):
        key = policy(r)
        expect(isinstance(key, tuple) and len(key) >= 1, f"{r.request_id}: the key must be a non-empty tuple, got {key!r}")
        expect(all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in key),
               f"{r.request_id}: every key element must be a finite int or float, got {key!r}")


@ADMISSION_POLICY_SUITE.check
def check_the_key_is_pure(factory: AdmissionFactory) -> None:
    policy = factory()
    for r in _requests(1):
        before = _state(r)
        first, second = policy(r), policy(r)
        expect(first == second, f"{r.request_id}: the same request must get the same key, got {first} then {second}")
        expect(_state(r) == before, f"{r.request_id}: computing the key must not change the request")


@ADMISSION_POLICY_SUITE.check
def check_the_scheduler_admits_in_key_order(factory: AdmissionFactory) -> None:
    policy = factory()
    reqs = _requests(2)
    want = [r.request_id for r in sorted(reqs, key=policy)]  # stable: ties keep add order
    sched = build_scheduler(lambda cfg, cache: BatchScheduler(cfg, cache, ContinuousBatching(),
                                                              admission=factory()),
                            SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), 256, 4)
    for r in reqs:
        sched.add(r)
    order: list[str] = []
    while sched.has_unfinished():
        plan = sched.schedule()
        for c in plan.all_chunks():
            if c.request_id not in order:
                order.append(c.request_id)
        sched.commit(plan, StepResult([[7] * c.num_samples if c.sample else [] for c in plan.all_chunks()]))
    expect(order == want, f"one seat: requests must be admitted in key order {want}, got {order}")


def _with_admission(factory: AdmissionFactory) -> SchedulerFactory:
    return lambda cfg, cache: BatchScheduler(cfg, cache, ContinuousBatching(), admission=factory())


# ---- PreemptionPolicy -----------------------------------------------------------------------


@PREEMPTION_POLICY_SUITE.check
def check_the_victim_is_one_of_the_running_and_nothing_changes(factory: PreemptionFactory) -> None:
    policy = factory()
    for size in (1, 2, 7):
        running = _requests(size, size)
        before = [_state(r) for r in running]
        ids = [id(r) for r in running]
        victim = policy(running)
        expect(any(victim is r for r in running), f"the victim must be one of the running requests, got {victim!r}")
        expect([id(r) for r in running] == ids and [_state(r) for r in running] == before,
               "choosing a victim must not change the running list or its requests")
        expect(policy(running) is victim, "the same running list must give the same victim")


def _with_victim(factory: PreemptionFactory) -> SchedulerFactory:
    return lambda cfg, cache: BatchScheduler(cfg, cache, ContinuousBatching(), victim=factory())


# ---- BatchingPolicy -------------------------------------------------------------------------


@BATCHING_POLICY_SUITE.check
def check_preemptive_is_a_bool_and_never_fits_a_reason_or_none(factory: BatchingFactory) -> None:
    policy = factory()
    expect(isinstance(policy.preemptive, bool), f"preemptive must be a bool, got {policy.preemptive!r}")
    sched = build_scheduler(lambda cfg, cache: BatchScheduler(cfg, cache, factory()),
                            SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256), 64, 4)
    state = sched.state  # type: ignore[attr-defined]
    for r in _requests(3):
        reason = policy.never_fits(r, state)
        expect(reason is None or (isinstance(reason, str) and reason != ""),
               f"never_fits must return None or a non-empty reason, got {reason!r}")


def _with_batching(factory: BatchingFactory) -> SchedulerFactory:
    return lambda cfg, cache: BatchScheduler(cfg, cache, factory())


def _adopt(suite: Suite[Any], names: tuple[str, ...] | None, make: Callable[[Any], SchedulerFactory]) -> None:
    """Add SCHEDULER_SUITE's checks (those named in ``names``; all when ``None``) to
    ``suite``, each run on the scheduler ``make`` builds around the policy factory."""
    for check in SCHEDULER_SUITE:
        if names is not None and check.name not in names:
            continue

        def adopted(factory: Any, _check: Callable[[SchedulerFactory], None] = check.fn) -> None:
            _check(make(factory))

        adopted.__name__ = f"check_scheduler_{check.name}"
        suite.check(adopted)


_adopt(ADMISSION_POLICY_SUITE, ("every_request_gets_its_tokens", "random_operation_sequences",
                                "abort_in_every_state"), _with_admission)
_adopt(PREEMPTION_POLICY_SUITE, ("tiny_pool_finishes_everything", "random_operation_sequences"),
       _with_victim)
_adopt(BATCHING_POLICY_SUITE, None, _with_batching)
