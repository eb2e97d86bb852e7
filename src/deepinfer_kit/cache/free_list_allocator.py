"""FreeListBlockAllocator: a LIFO free list plus a flat list of reference counts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from deepinfer_kit._validators import require_ints_at_least
from deepinfer_kit.errors import InvariantError, OutOfBlocksError

__all__ = ["FreeListBlockAllocator"]

_FREE = -1  # internal count of a block on the free list
_OUT = -2  # what the mutators read for a negative block id (out of range, like a free one)


class FreeListBlockAllocator:
    """Blocks ``0 .. num_blocks - 1`` with reference counts; O(1) per block, no objects.

    State is one list of ints (``-1`` marks a free block) and one free stack; a call
    allocates nothing but the list it returns. The most recently freed block is reused
    first. Not thread-safe (the scheduler owns it).

    Args:
        num_blocks: blocks in the pool (>= 1).
        block_size: tokens per block ``P`` (>= 1).

    Raises:
        ConfigError: either argument is not an int >= 1.
    """

    __slots__ = ("_block_size", "_num_blocks", "_free", "_ref")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        require_ints_at_least(1, num_blocks=num_blocks, block_size=block_size)
        self._num_blocks = num_blocks
        self._block_size = block_size
        # Popped from the end: a fresh pool hands out 0, 1, 2, ...
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._ref: list[int] = [_FREE] * num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block (``P``)."""
        return self._block_size

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Blocks on the free list. O(1)."""
        return len(self._free)

    def _bad(self, block: int, what: str) -> InvariantError:
        if not isinstance(block, int) or not 0 <= block < self._num_blocks:
            return InvariantError(f"block {block!r} is out of range [0, {self._num_blocks})")
        return InvariantError(f"block {block} {what} (ref count {self._ref[block]})")

    def _in_range(self, block: int) -> bool:
        return 0 <= block < self._num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks with count 1. O(n).

        Raises:
            OutOfBlocksError: fewer than ``n`` free; nothing changes.
            InvariantError: ``n < 0``.
        """
        free = self._free
        if n > len(free):
            raise OutOfBlocksError(f"cannot allocate {n} blocks: {len(free)} free")
        if n <= 0:
            if n == 0:
                return []
            raise InvariantError(f"allocate: n must be >= 0, got {n}")
        blocks = free[-n:]
        del free[-n:]
        blocks.reverse()  # stack order: the most recently freed block first
        ref = self._ref
        for b in blocks:
            ref[b] = 1
        return blocks

    def retain(self, blocks: Sequence[int]) -> None:
        """Add a reference to each held block.

        Raises:
            InvariantError: a block is free or out of range; no count changes.
        """
        ref = self._ref
        i = 0
        try:
            for i, b in enumerate(blocks):
                c = ref[b] if b >= 0 else _OUT  # ref[b] raises IndexError past the end
                if c < 0:
                    raise IndexError
                ref[b] = c + 1
        except (IndexError, TypeError):
            for u in blocks[:i]:
                ref[u] -= 1
            raise self._bad(blocks[i], "is free and cannot be retained") from None

    def release(self, blocks: Sequence[int]) -> list[int]:
        """Drop a reference from each block; returns those whose count reached 0.

        Raises:
            InvariantError: a block is free, already at count 0 or out of range; no count
                changes.
        """
        ref = self._ref
        zero: list[int] = []
        i = 0
        try:
            for i, b in enumerate(blocks):
                c = (ref[b] if b >= 0 else _OUT) - 1
                if c <= 0:
                    if c < 0:
                        raise IndexError
                    zero.append(b)
                ref[b] = c
        except (IndexError, TypeError):
            for u in blocks[:i]:
                ref[u] += 1
            raise self._bad(blocks[i], "is not referenced and cannot be released") from None
        return zero

    def free(self, blocks: Sequence[int]) -> None:
        """Return unreferenced held blocks to the free list.

        Raises:
            InvariantError: a block is referenced, free, given twice or out of range;
                nothing changes.
        """
        ref = self._ref
        i = 0
        try:
            for i, b in enumerate(blocks):
                if b < 0 or ref[b]:
                    raise IndexError
                ref[b] = _FREE
        except (IndexError, TypeError):
            for u in blocks[:i]:
                ref[u] = 0
            raise self._bad(blocks[i], "is referenced or already free and cannot be freed") from None
        self._free.extend(blocks)

    def make_writable(self, block: int) -> tuple[int, int | None]:
        """Copy-on-write: ``(block, None)`` for a sole holder, else ``(new, block)``.

        Raises:
            OutOfBlocksError: the block is shared and none is free; nothing changes.
            InvariantError: the block is free, unreferenced or out of range.
        """
        if not self._in_range(block) or self._ref[block] < 1:
            raise self._bad(block, "is not referenced and cannot be written")
        if self._ref[block] == 1:
            return block, None
        (new,) = self.allocate(1)
        self._ref[block] -= 1
        return new, block

    def ref_count(self, block: int) -> int:
        """The block's reference count (0 when free or cached-unreferenced).

        Raises:
            InvariantError: out of range.
        """
        if not self._in_range(block):
            raise self._bad(block, "")
        c = self._ref[block]
        return c if c > 0 else 0

    def is_free(self, block: int) -> bool:
        """True when the block is on the free list (for integrity checks)."""
        if not self._in_range(block):
            raise self._bad(block, "")
        return self._ref[block] == _FREE


if TYPE_CHECKING:
    from deepinfer_kit.cache.protocols import BlockAllocator

    _check: type[BlockAllocator] = FreeListBlockAllocator
