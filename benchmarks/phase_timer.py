"""PhaseTimer: wraps named methods of engine classes in timers, so a benchmark can split a
round into phases (no cProfile, whose per-call cost would swamp the host work measured).

Each wrapped call adds its elapsed time to its label; nested phases each count in full
(``engine.step`` holds ``runner.execute``, which holds the forward). The clock is a
``perf_counter``-like callable returning seconds (``time.thread_time`` for the CPU time of
the calling thread).

    timer = PhaseTimer()
    timer.wrap(Engine, "step", "step")
    ...
    timer.clear(); engine.step(); print(timer.total["step"])
    timer.unwrap()  # the classes as they were
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

__all__ = ["PhaseTimer"]


class PhaseTimer:
    """Time per label, summed over the wrapped calls since the last :meth:`clear`.

    Args:
        clock: seconds, monotonic (default ``time.perf_counter``).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.total: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, label: str) -> None:
        """Replace ``owner.name`` (a class or module attribute) by a timed call of it."""
        inner: Callable[..., Any] = getattr(owner, name)
        self._undo.append((owner, name, owner.__dict__.get(name, inner)))
        clock, total, calls = self.clock, self.total, self.calls

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                total[label] += clock() - t
                calls[label] += 1

        setattr(owner, name, timed)

    def unwrap(self) -> None:
        """Put back every attribute :meth:`wrap` replaced, newest first."""
        while self._undo:
            owner, name, original = self._undo.pop()
            setattr(owner, name, original)

    def clear(self) -> None:
        """Forget the times and counts so far."""
        self.total.clear()
        self.calls.clear()

    def report(self, heading: str) -> None:
        """Print each label's calls, total and per-call time, dearest first."""
        print(heading)
        for label in sorted(self.total, key=lambda k: -self.total[k]):
            n = self.calls[label]
            print(f"  {label:26s} n={n:4d}  {self.total[label] * 1e3:8.1f} ms"
                  f"  {self.total[label] / n * 1e6:8.0f} us/call")
