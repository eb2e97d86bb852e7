"""Both schedulers, over both prefix indexes, pass the Scheduler conformance suite."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from deepinfer_kit.testing.sched import SCHEDULER_SUITE


@pytest.mark.parametrize("index", ["hash", "radix"])
@pytest.mark.parametrize("check", list(SCHEDULER_SUITE), ids=SCHEDULER_SUITE.ids)
def test_scheduler_conformance(
    check: Any, kind: str, index: str, suite_factory: Callable[[str, str], Any]
) -> None:
    check(suite_factory(kind, index))
