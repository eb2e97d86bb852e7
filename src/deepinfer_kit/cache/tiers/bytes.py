"""Where a tier's bytes are: the host slab (torch), or nowhere (the simulator counts
blocks only) — so the scheduler side of the tiers runs without torch."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, Protocol, TypeVar

__all__ = ["HostBytes", "BlockStore", "NoBytes", "KeysOnlyStore", "InlineExecutor"]

T = TypeVar("T")


class HostBytes(Protocol):
    """The host tier's slots as bytes, for the scheduler side (the device side copies
    into and out of the same memory)."""

    def read(self, slot: int) -> Any:
        """A copy of ``slot``'s bytes the caller may keep (for a disk write)."""
        ...

    def write(self, slot: int, payload: Any) -> None:
        """Overwrite ``slot`` with ``payload`` (a block read from disk)."""
        ...

    def new_block(self) -> Any:
        """An empty block buffer, for a disk read to fill."""
        ...


class BlockStore(Protocol):
    """The disk tier's files (or a stand-in), keyed by block identity; called from I/O
    threads."""

    def put(self, key: bytes, payload: Any) -> None:
        """Store ``payload`` as ``key``; raises ``OSError`` on failure."""
        ...

    def get_into(self, key: bytes, out: Any) -> bool:
        """Fill ``out`` with ``key``'s block; False when missing or damaged."""
        ...

    def delete(self, key: bytes) -> None:
        """Forget ``key``; a missing one is fine."""
        ...


class NoBytes:
    """A host tier without bytes (the simulator's): slots are counted, nothing copied."""

    def read(self, slot: int) -> None:
        return None

    def write(self, slot: int, payload: Any) -> None:
        return None

    def new_block(self) -> None:
        return None


class KeysOnlyStore:
    """A disk tier without files (the simulator's): the set of keys written."""

    def __init__(self) -> None:
        self._keys: set[bytes] = set()

    def put(self, key: bytes, payload: Any) -> None:
        self._keys.add(key)

    def get_into(self, key: bytes, out: Any) -> bool:
        return key in self._keys

    def delete(self, key: bytes) -> None:
        self._keys.discard(key)


class InlineExecutor(Executor):
    """Runs each submitted call at once, in the caller's thread (``io_threads=0``: the
    simulator, where time is virtual and reads are priced, not waited for)."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        fut: Future[T] = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - the future carries it, as a thread's would
            fut.set_exception(exc)
        return fut
