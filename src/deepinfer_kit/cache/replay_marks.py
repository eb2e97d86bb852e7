"""ReplayMarks: which sliding-window blocks a bounded replay writes, and when they may be read
by others — never for those before its first exact position, and for the rest only once the
round that wrote them committed (a round that fails leaves them unwritten)."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer_kit.cache.window_map import WindowBlockMap, WindowHold

__all__ = ["ReplayMarks"]


class ReplayMarks:
    """The replays of one :class:`~deepinfer_kit.cache.hybrid_manager.HybridKVCacheManager`
    whose rounds have not committed yet.

    A replay maps fresh blocks in the sliding groups for the blocks before a prefix hit's
    end. They are all marked inexact when it is allocated (never matched, freed rather than
    kept idle when released): those before the first exact position for good, the others
    until the request publishes past the hit's end (:meth:`settle`, the scheduler's commit
    of the replay's round). A replay whose round failed is freed with its blocks still
    marked, so no later hit reads K/V that was never written.
    """

    def __init__(self) -> None:
        self._pending: dict[str, tuple[int, list[list[int]]]] = {}  # request -> (hit end, per group: blocks)

    def start(self, request_id: str, maps: Sequence[WindowBlockMap], windows: Sequence[WindowHold], exact: int,
              end: int, block_size: int) -> None:
        """A replay ending at token ``end`` was allocated over ``windows`` (the request's
        holds, one per sliding group of ``maps``): mark every held block before ``end``
        inexact, and remember those from ``exact`` on for :meth:`settle`."""
        pending: list[list[int]] = []
        for m, w in zip(maps, windows):
            later = []
            for j, b in enumerate(w.held, w.lo):
                if j * block_size < end:
                    m.mark_inexact(b)
                    if j * block_size >= exact:
                        later.append(b)
            pending.append(later)
        self._pending[request_id] = (end, pending)

    def settle(self, request_id: str, num_tokens: int, maps: Sequence[WindowBlockMap],
               windows: Sequence[WindowHold]) -> None:
        """``request_id`` published its first ``num_tokens`` tokens (its round committed):
        once past its replay's end, the exact blocks it still holds become matchable."""
        entry = self._pending.get(request_id)
        if entry is None or num_tokens < entry[0]:
            return
        del self._pending[request_id]
        for m, w, later in zip(maps, windows, entry[1]):
            held = set(w.held)
            for b in later:
                if b in held:  # released meanwhile: freed, maybe mapped again by another
                    m.mark_exact(b)

    def forget(self, request_id: str) -> None:
        """The request was freed (its blocks released with their marks)."""
        self._pending.pop(request_id, None)
