"""Runner hooks of ``bench_overlap.py`` (a module of their own so that a worker process can
import them: ``worker_setup`` objects pickle by reference)."""

from __future__ import annotations

import time
from typing import Any


class FixedDeviceTime:
    """Each execute does the model's real work for its plan, then sleeps ``seconds`` (the
    GIL released, like a device the host waits on). ``busy`` totals the time spent inside
    execute in the process that runs it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.busy = 0.0
        self.steps = 0

    def __call__(self, runner: Any) -> None:
        inner = runner.execute

        def execute(step: Any) -> Any:
            start = time.perf_counter()
            result = inner(step)
            time.sleep(self.seconds)
            self.busy += time.perf_counter() - start
            self.steps += 1
            return result

        runner.execute = execute
