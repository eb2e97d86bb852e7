"""VirtualClock: simulated time, advanced by the simulator, read by the scheduler."""

from __future__ import annotations

from deepinfer_kit.errors import InvariantError

__all__ = ["VirtualClock"]


class VirtualClock:
    """Seconds of simulated time; call it like ``time.monotonic``.

    The simulator advances it by each step's cost-model duration and jumps it to the next
    arrival when the engine is idle; the scheduler reads it to stamp request metrics.

    Args:
        start: the initial time.
    """

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        """The current simulated time. O(1); mutates nothing."""
        return self.now

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds``.

        Raises:
            InvariantError: ``seconds`` is negative (time never runs back).
        """
        if seconds < 0:
            raise InvariantError(f"a clock advances by >= 0 seconds, got {seconds}")
        self.now += seconds

    def advance_each(self, seconds: list[float]) -> None:
        """:meth:`advance` by each of ``seconds`` in turn (the same float sums).

        Raises:
            InvariantError: one of ``seconds`` is negative (nothing moved then).
        """
        if seconds and min(seconds) < 0:
            raise InvariantError(f"a clock advances by >= 0 seconds, got {min(seconds)}")
        now = self.now
        for d in seconds:
            now += d
        self.now = now

    def advance_to(self, when: float) -> None:
        """Jump to ``when`` if it is later than now (an earlier time is a no-op)."""
        if when > self.now:
            self.now = when
