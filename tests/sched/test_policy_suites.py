"""The scheduler policies' suites: the built-in policies and the tests' own pass them; a
policy that breaks its contract (a wrong key type, an impure key, a victim from outside the
running set, an admission past the budget) fails — where the Scheduler suite alone let an
admission policy with a wrong return type through."""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from deepinfer_kit.request import Request
from deepinfer_kit.sched.batching import ContinuousBatching, StaticBatching
from deepinfer_kit.sched.policies import fcfs_key, latest_arrival_victim, lowest_priority_victim, priority_key
from deepinfer_kit.testing import (
    ADMISSION_POLICY_SUITE, BATCHING_POLICY_SUITE, PREEMPTION_POLICY_SUITE, SCHEDULER_SUITE,
)
from deepinfer_kit.testing.suite import Check, Suite

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import own_components as own  # noqa: E402

ADMISSIONS: dict[str, Any] = {"fcfs": lambda: fcfs_key, "priority": lambda: priority_key,
                              "shortest_first": lambda: own.shortest_prompt_first}
VICTIMS: dict[str, Any] = {"latest_arrival": lambda: latest_arrival_victim,
                           "lowest_priority": lambda: lowest_priority_victim, "newest": own.NewestVictim}
BATCHINGS: dict[str, Any] = {"continuous": ContinuousBatching, "static": StaticBatching,
                             "short_prompts_only": lambda: own.ShortPromptsOnly(limit=10_000)}


@pytest.mark.parametrize("name", sorted(ADMISSIONS))
@pytest.mark.parametrize("check", ADMISSION_POLICY_SUITE.checks, ids=ADMISSION_POLICY_SUITE.ids)
def test_admission_policies(check: Check[Any], name: str) -> None:
    check(ADMISSIONS[name])


@pytest.mark.parametrize("name", sorted(VICTIMS))
@pytest.mark.parametrize("check", PREEMPTION_POLICY_SUITE.checks, ids=PREEMPTION_POLICY_SUITE.ids)
def test_preemption_policies(check: Check[Any], name: str) -> None:
    check(VICTIMS[name])


@pytest.mark.parametrize("name", sorted(BATCHINGS))
@pytest.mark.parametrize("check", BATCHING_POLICY_SUITE.checks, ids=BATCHING_POLICY_SUITE.ids)
def test_batching_policies(check: Check[Any], name: str) -> None:
    check(BATCHINGS[name])


def _fails(suite: Suite[Any], factory: Any) -> int:
    failed = 0
    for check in suite:
        try:
            check(factory)
        except Exception:  # noqa: BLE001 - any failure of a check counts
            failed += 1
    return failed


def _float_key(request: Request) -> float:  # a bare float, not a tuple
    return float(request.num_prompt_tokens)


def _noisy_key(request: Request) -> tuple[float, ...]:
    return (random.random(),)


def _stranger(running: Sequence[Request]) -> Request:
    return Request("stranger", [1, 2, 3])


def _reorders(running: Sequence[Request]) -> Request:
    running.sort(key=lambda r: r.request_id, reverse=True)  # type: ignore[attr-defined]
    return running[0]


class _GreedyAdmission(ContinuousBatching):
    """Admits past the round's budget (ignores it)."""

    def admit(self, state: Any, entry: Any, budget: int, preempted: bool) -> int:
        return super().admit(state, entry, budget * 4, preempted) - 3 * budget


class _SaysYes(ContinuousBatching):
    @property
    def preemptive(self) -> Any:
        return "yes"


def test_the_scheduler_suite_alone_misses_a_wrong_key_type_the_admission_suite_does_not() -> None:
    from deepinfer_kit.sched import ContinuousBatchScheduler

    assert _fails(SCHEDULER_SUITE, lambda cfg, cache: ContinuousBatchScheduler(
        cfg, cache, admission=_float_key)) == 0  # type: ignore[arg-type]
    assert _fails(ADMISSION_POLICY_SUITE, lambda: _float_key) >= 1


@pytest.mark.parametrize(("suite", "broken"), [
    (ADMISSION_POLICY_SUITE, lambda: _noisy_key),
    (PREEMPTION_POLICY_SUITE, lambda: _stranger),
    (PREEMPTION_POLICY_SUITE, lambda: _reorders),
    (BATCHING_POLICY_SUITE, _GreedyAdmission),
    (BATCHING_POLICY_SUITE, _SaysYes),
], ids=["impure_key", "stranger_victim", "reordering_victim", "past_the_budget", "not_a_bool"])
def test_a_broken_policy_fails_its_suite(suite: Suite[Any], broken: Any) -> None:
    assert _fails(suite, broken) >= 1
