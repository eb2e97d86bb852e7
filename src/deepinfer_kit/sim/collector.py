"""quiet_collector: the cyclic garbage collector tuned for the simulator's round loop."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["quiet_collector"]


@contextmanager
def quiet_collector(gen0_threshold: int = 50_000) -> Iterator[None]:
    """Run the block with the objects alive at entry frozen out of the cyclic collector
    (:func:`gc.freeze`) and generation 0 collected every ``gen0_threshold`` allocations
    instead of every 700; both are restored on exit, also on an exception.

    The round loop allocates a few short-lived container objects per simulated token
    (chunks, one-token lists, plans) that reference counting frees; at the default
    threshold the collector still ran hundreds of passes per thousand requests, and its
    older generations walked the workload and every live request each time. Collection
    itself stays on: cycles made during the block are still found. Process-wide while
    the block runs (the collector has no per-thread setting).
    """
    old = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(gen0_threshold, old[1], old[2])
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()
