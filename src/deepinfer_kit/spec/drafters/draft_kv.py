"""DraftKVBook: which tokens a drafter's own KV holds per sequence, in blocks of its own pool.

A drafter that runs a model (a draft checkpoint, or the target's first layers) keeps the
KV of each sequence it drafts for between rounds, so a round only computes the tokens it
has not seen (catch-up) plus its drafts. The book is the host side of that cache: per
sequence the token ids whose KV is written and the block table that holds them, over an
injected :class:`~deepinfer_kit.cache.protocols.BlockAllocator` of the drafter's own pool
(same block size as the target's). Pure Python, no tensors.

KV is a function of the token prefix only, so the book rolls back by content: a sequence
keeps the longest common prefix of what it holds and the sequence's current tokens (the
accepted drafts and the emitted token), and the blocks beyond that prefix go back to the
pool.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from deepinfer_kit.cache.protocols import BlockAllocator
from deepinfer_kit.errors import InvariantError

__all__ = ["DraftKVBook", "common_prefix"]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences. O(result)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@attrs.define(slots=True, eq=False)
class _Held:
    tokens: list[int]  # tokens whose KV is written, positions 0..len-1
    blocks: list[int]  # the block table; covers at least len(tokens) tokens


class DraftKVBook:
    """Per-sequence KV bookkeeping of a drafter's own paged pool.

    Args:
        allocator: the drafter's own block allocator (never the target's); every block
            the book takes has reference count 1 and goes back through ``release`` +
            ``free``.
    """

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self.block_size = allocator.block_size
        self._held: dict[str, _Held] = {}

    def __len__(self) -> int:
        """Sequences with draft KV."""
        return len(self._held)

    @property
    def num_held_blocks(self) -> int:
        """Blocks held over all sequences. O(sequences)."""
        return sum(len(h.blocks) for h in self._held.values())

    def tokens(self, seq_id: str) -> list[int]:
        """The tokens whose KV is held for ``seq_id`` (empty when none); a copy."""
        held = self._held.get(seq_id)
        return list(held.tokens) if held is not None else []

    def block_table(self, seq_id: str) -> list[int]:
        """``seq_id``'s block table (empty when none); a copy."""
        held = self._held.get(seq_id)
        return list(held.blocks) if held is not None else []

    def reusable(self, seq_id: str, tokens: Sequence[int]) -> int:
        """Roll ``seq_id`` back to its longest common prefix with ``tokens`` and return
        that length: how many of ``tokens`` need no recomputation.

        Called before each drafting of the sequence. Frees the blocks past the prefix.
        O(prefix + freed blocks).
        """
        held = self._held.get(seq_id)
        if held is None:
            return 0
        keep = common_prefix(held.tokens, tokens)
        self._truncate(held, keep)
        return keep

    def reserve(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow ``seq_id``'s block table to cover ``num_tokens`` tokens; returns it (a copy).

        Called before a forward writes positions up to ``num_tokens - 1``. A new sequence
        starts with no tokens.

        Raises:
            OutOfBlocksError: the pool has too few free blocks; nothing changes.
        """
        held = self._held.get(seq_id)
        need = -(-num_tokens // self.block_size) - (len(held.blocks) if held else 0)
        if need > 0:
            fresh = self.allocator.allocate(need)  # raises having allocated nothing
            if held is None:
                held = self._held[seq_id] = _Held([], [])
            held.blocks.extend(fresh)
        return list(held.blocks) if held is not None else []

    def written(self, seq_id: str, tokens: Sequence[int]) -> None:
        """Record that the KV of ``tokens`` (positions ``0..len - 1``) is written for
        ``seq_id``; blocks beyond them go back to the pool.

        Raises:
            InvariantError: ``seq_id`` has no blocks reserved, or too few for ``tokens``.
        """
        held = self._held.get(seq_id)
        if held is None or len(held.blocks) * self.block_size < len(tokens):
            have = len(held.blocks) if held else 0
            raise InvariantError(
                f"draft KV of {seq_id!r}: {len(tokens)} tokens written into {have} blocks of "
                f"{self.block_size}; reserve() first"
            )
        held.tokens = list(tokens)
        self._truncate(held, len(tokens))

    def sync(self, live: Mapping[str, Sequence[int]]) -> int:
        """Keep only the sequences of ``live`` (id -> current tokens), each rolled back to
        its common prefix with those tokens; release the others entirely.

        Called by the engine after every committed round (rejected drafts, finished,
        aborted and preempted sequences) and before drafting. Returns the blocks freed.
        O(held sequences + prefixes).
        """
        before = self.allocator.num_free
        for seq_id in [s for s in self._held if s not in live]:
            self.release(seq_id)
        for seq_id, held in self._held.items():
            self._truncate(held, common_prefix(held.tokens, live[seq_id]))
        return self.allocator.num_free - before

    def release(self, seq_id: str) -> None:
        """Give every block of ``seq_id`` back to the pool (no-op when it holds none)."""
        held = self._held.pop(seq_id, None)
        if held is not None and held.blocks:
            self.allocator.free(self.allocator.release(held.blocks))

    def check_idle(self) -> None:
        """Raise :class:`InvariantError` unless no sequence is held and every block of the
        pool is free."""
        free, total = self.allocator.num_free, self.allocator.num_blocks
        if self._held or free != total:
            raise InvariantError(
                f"draft KV not idle: sequences {sorted(self._held)} hold "
                f"{self.num_held_blocks} blocks; {total - free} of {total} blocks not free"
            )

    def _truncate(self, held: _Held, keep: int) -> None:
        """Keep ``keep`` tokens and the blocks that hold them; free the rest."""
        del held.tokens[keep:]
        need = -(-keep // self.block_size)
        extra = held.blocks[need:]
        if extra:
            del held.blocks[need:]
            self.allocator.free(self.allocator.release(extra))
