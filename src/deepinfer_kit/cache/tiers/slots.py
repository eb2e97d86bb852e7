"""TierSlots: one tier's record of which block key each slot holds, and which slots may
be given to another key."""

from __future__ import annotations

from deepinfer_kit.cache.frequency_policy import FrequencyEvictionPolicy
from deepinfer_kit.cache.lru_policy import LRUEvictionPolicy
from deepinfer_kit.cache.protocols import EvictionPolicy
from deepinfer_kit.errors import InvariantError

__all__ = ["TierSlots", "eviction_policy"]


def eviction_policy(name: str) -> EvictionPolicy:
    """``"lru"`` or ``"frequency"`` as a fresh policy (names checked by TierConfig)."""
    return FrequencyEvictionPolicy() if name == "frequency" else LRUEvictionPolicy()


class TierSlots:
    """``capacity`` slots of a tier, each free or holding one block key.

    A held slot is *pending* (its bytes are still being written: readable by a later
    device load, not by a host read), *ready*, and may be *pinned* (a match or a load
    reads it; never given away). Ready, unpinned slots are the eviction policy's
    candidates. Every mutator keeps ``free + held == capacity``. Not thread-safe: the
    scheduler side owns it.

    Args:
        capacity: slots (>= 1).
        policy: the order of eviction among candidates.
    """

    __slots__ = ("_key_of", "_slot_of", "_free", "_pins", "_ready", "_policy", "capacity")

    def __init__(self, capacity: int, policy: EvictionPolicy) -> None:
        self.capacity = capacity
        self._key_of: list[bytes | None] = [None] * capacity
        self._slot_of: dict[bytes, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._pins = [0] * capacity
        self._ready = [False] * capacity
        self._policy = policy

    def __len__(self) -> int:
        """Slots holding a key."""
        return len(self._slot_of)

    def slot(self, key: bytes) -> int | None:
        """The slot holding ``key`` (pending or ready), else None. O(1)."""
        return self._slot_of.get(key)

    def key(self, slot: int) -> bytes | None:
        """The key ``slot`` holds, or None when it is free."""
        return self._key_of[slot]

    def is_ready(self, slot: int) -> bool:
        """True when the slot's bytes are written."""
        return self._ready[slot]

    def holds(self, key: bytes) -> bool:
        """True when a slot holds ``key`` with its bytes written. O(1)."""
        slot = self._slot_of.get(key)
        return slot is not None and self._ready[slot]

    def touch(self, slot: int) -> None:
        """A use of ``slot``'s block (recency and frequency)."""
        self._policy.touch([slot])

    def pin(self, slot: int) -> None:
        """Keep ``slot`` from eviction until a matching :meth:`unpin`."""
        if self._pins[slot] == 0:
            self._policy.discard([slot])
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        """Undo one :meth:`pin`.

        Raises:
            InvariantError: the slot is not pinned.
        """
        if self._pins[slot] <= 0:
            raise InvariantError(f"tier slot {slot} unpinned more often than pinned")
        self._pins[slot] -= 1
        if self._pins[slot]:
            return
        if self._key_of[slot] is None:
            self._free.append(slot)  # dropped while pinned: free now
        elif self._ready[slot]:
            self._policy.push([slot])

    @property
    def num_pinned(self) -> int:
        """Slots pinned now. O(capacity)."""
        return sum(1 for p in self._pins if p)

    def take(self, key: bytes) -> tuple[int, bytes | None] | None:
        """A pending slot for ``key`` (not held yet): a free one, else the policy's victim.

        Returns ``(slot, evicted_key)`` (``evicted_key`` None when the slot was free; the
        caller reads the victim's bytes before anything overwrites them), or None when
        every slot is pinned or pending.

        Raises:
            InvariantError: ``key`` is held already.
        """
        if key in self._slot_of:
            raise InvariantError(f"tier key {key.hex()} taken twice")
        evicted: bytes | None = None
        if self._free:
            slot = self._free.pop()
        else:
            victims = self._policy.pop(1)
            if not victims:
                return None
            slot = victims[0]
            evicted = self._key_of[slot]
            assert evicted is not None
            del self._slot_of[evicted]
        self._key_of[slot] = key
        self._slot_of[key] = slot
        self._ready[slot] = False
        return slot, evicted

    def mark_ready(self, slot: int) -> None:
        """The slot's bytes are written: it becomes readable and (unpinned) evictable."""
        if self._key_of[slot] is None or self._ready[slot]:
            return
        self._ready[slot] = True
        if self._pins[slot] == 0:
            self._policy.push([slot])

    def drop(self, slot: int) -> bytes | None:
        """Free ``slot`` now (its write failed, or its bytes are bad); returns the key it
        held. A pinned slot keeps its pins' count until they are undone."""
        key = self._key_of[slot]
        if key is None:
            return None
        self._policy.discard([slot])
        del self._slot_of[key]
        self._key_of[slot] = None
        self._ready[slot] = False
        if self._pins[slot] == 0:
            self._free.append(slot)
        return key

    def check(self) -> None:
        """``free + held == capacity`` and the maps agree; for tests.

        Raises:
            InvariantError: naming what disagrees.
        """
        held = [s for s, k in enumerate(self._key_of) if k is not None]
        dead = sum(1 for s, k in enumerate(self._key_of) if k is None and self._pins[s])
        if len(held) + len(self._free) + dead != self.capacity or len(held) != len(self._slot_of):
            raise InvariantError(f"tier slots: {len(held)} held + {len(self._free)} free != {self.capacity}")
        for s in held:
            key = self._key_of[s]
            assert key is not None
            if self._slot_of.get(key) != s:
                raise InvariantError(f"tier slot {s} and its key disagree")
