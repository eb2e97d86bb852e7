"""Runner hooks of ``bench_overlap.py`` (a module of their own so that a worker process can
import them: ``worker_setup`` objects pickle by reference)."""

from __future__ import annotations

import time
from typing import Any


class FixedDeviceTime:
    """Each step does the model's real work for its plan, then its device takes ``seconds``
    more (a sleep, the GIL released, like a device the host waits on). ``busy`` totals the
    time spent inside the runner's steps in the process that runs them.

    The runner's two phases are wrapped (``execute`` runs through them): ``launch`` does the
    real work and queues the step's device time behind the steps already queued; ``finish``
    sleeps until that time has passed. Run one after the other this is the work then a
    sleep of ``seconds``; a step launched before the one before it finished (a pipelining
    executor) has its device time queued behind that one's, as on a GPU. Only the
    outermost launch and finish count (a speculative round runs whole steps inside its
    launch)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.busy = 0.0
        self.steps = 0
        self._device_free = 0.0  # perf_counter when the device has run every queued step
        self._depth = 0

    def __call__(self, runner: Any) -> None:
        inner_launch, inner_finish = runner.launch, runner.finish
        ready: dict[int, float] = {}  # id(launched) -> when its device time is over

        def launch(step: Any) -> Any:
            start = time.perf_counter()
            self._depth += 1
            try:
                launched = inner_launch(step)
            finally:
                self._depth -= 1
            if not self._depth:
                now = time.perf_counter()
                self._device_free = max(now, self._device_free) + self.seconds
                ready[id(launched)] = self._device_free
                self.busy += now - start
            return launched

        def finish(launched: Any) -> Any:
            start = time.perf_counter()
            until = ready.pop(id(launched), None)
            if until is not None:
                time.sleep(max(0.0, until - time.perf_counter()))
            result = inner_finish(launched)
            if until is not None:
                self.busy += time.perf_counter() - start
                self.steps += 1
            return result

        runner.launch = launch
        runner.finish = finish
