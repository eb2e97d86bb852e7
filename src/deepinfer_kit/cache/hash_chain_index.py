"""HashChainPrefixIndex: full blocks keyed by a chained keyed hash, verified on every hit."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from deepinfer_kit.cache._index_base import PublishedBlocks
from deepinfer_kit.cache.hashing import BlockHasher
from deepinfer_kit.cache.protocols import EvictionPolicy

__all__ = ["HashChainPrefixIndex"]

_EMPTY = -1  # block of a placeholder entry (evicted while descendants stay cached)


class _Entry:
    """One chain position: its block, tokens and parent entry (``None`` for block 0).

    ``children`` counts entries whose parent this is; an evicted entry with children
    stays as a placeholder so they are reachable again once its content is republished.
    """

    __slots__ = ("block", "tokens", "parent", "key", "context", "children")

    def __init__(
        self, block: int, tokens: list[int], parent: _Entry | None, key: bytes,
        context: Hashable,
    ) -> None:
        self.block = block
        self.tokens = tokens
        self.parent = parent
        self.key = key
        self.context = context
        self.children = 0


class HashChainPrefixIndex(PublishedBlocks[_Entry]):
    """A flat map ``K_i -> entry`` over chained keys ``K_i = H(K_{i-1} || tokens_i)``
    with ``K_{-1} = H(context)`` (vLLM style).

    ``H`` is keyed BLAKE2b (see :class:`~deepinfer_kit.cache.hashing.BlockHasher`). Every
    hit is verified: the entry's tokens must equal the query's block, its parent must be
    the entry just matched (by identity, not by key) and block 0's context must equal
    the query's, so even forced hash collisions (tests use one-byte digests) can only
    cost a miss, never return KV of other tokens.

    Args:
        block_size: tokens per block ``P``.
        key: hash key; ``None`` draws a random per-process key.
        digest_size: bytes per block key (16 by default).
        policy: eviction order of unreferenced cached blocks; LRU when ``None``.

    Raises:
        ConfigError: a bad ``block_size``, ``key`` or ``digest_size``.
    """

    __slots__ = ("_hasher", "_by_key")

    def __init__(
        self,
        block_size: int,
        *,
        key: bytes | None = None,
        digest_size: int = 16,
        policy: EvictionPolicy | None = None,
    ) -> None:
        super().__init__(block_size, policy)
        self._hasher = BlockHasher(key, digest_size=digest_size)
        self._by_key: dict[bytes, _Entry] = {}

    def _keys(
        self, tokens: Sequence[int], num_blocks: int, context: Hashable, memo: list[bytes] | None
    ) -> list[bytes]:
        keys = memo if memo is not None else []
        if len(keys) < num_blocks:
            root = b"" if keys else self._hasher.root(context)
            self._hasher.extend_chain(keys, tokens, num_blocks, self._block_size, root)
        return keys

    def match(
        self,
        tokens: Sequence[int],
        *,
        context: Hashable = None,
        memo: list[bytes] | None = None,
        max_blocks: int | None = None,
        touch: bool = True,
    ) -> list[int]:
        """The blocks caching the longest full-block prefix of ``tokens`` (see
        :meth:`PrefixIndex.match`). O(matched blocks + newly hashed blocks)."""
        if type(tokens) is not list:
            tokens = list(tokens)
        P = self._block_size
        n = self._query_blocks(tokens, max_blocks)
        hits: list[int] = []
        if n and self._by_key:
            keys = self._keys(tokens, n, context, memo)
            get = self._by_key.get
            prev: _Entry | None = None
            for i in range(n):
                e = get(keys[i])
                if (
                    e is None
                    or e.parent is not prev
                    or e.block < 0
                    or e.tokens != tokens[i * P : i * P + P]
                    or (prev is None and e.context != context)
                ):
                    break
                hits.append(e.block)
                prev = e
        if touch:
            self._touch_hits(hits, n)
        return hits

    def insert(
        self,
        tokens: Sequence[int],
        blocks: Sequence[int],
        *,
        context: Hashable = None,
        memo: list[bytes] | None = None,
        start: int = 0,
    ) -> list[int]:
        """Publish ``blocks[start:]`` as the full blocks of ``tokens`` (see
        :meth:`PrefixIndex.insert`). O(len(blocks) - start) when ``blocks[start - 1]``
        is published, else O(len(blocks)).

        Raises:
            InvariantError: ``tokens`` is shorter than ``len(blocks) * P``.
        """
        P = self._block_size
        n, start = self._insert_span(tokens, blocks, start)
        if start >= n:
            return []
        if type(tokens) is not list:
            tokens = list(tokens)
        keys = self._keys(tokens, n, context, memo)
        by_key = self._by_key
        entries = self._entries
        prev = entries.get(blocks[start - 1]) if start else None
        if prev is not None and prev.key == keys[start - 1]:
            i = start
        else:
            prev, i = None, 0
        new: list[int] = []
        while i < n:
            k = keys[i]
            seg = tokens[i * P : i * P + P]
            e = by_key.get(k)
            if e is None:
                e = by_key[k] = _Entry(_EMPTY, seg, prev, k, context)
                if prev is not None:
                    prev.children += 1
            elif e.parent is not prev or e.tokens != seg or (prev is None and e.context != context):
                break  # a key collision: this chain cannot be placed beyond here
            b = blocks[i]
            if i >= start and e.block < 0 and b not in entries:
                e.block = b
                entries[b] = e
                new.append(b)
            prev = e
            i += 1
        if prev is not None and prev.block < 0 and not prev.children:
            self._drop(prev)
        self._stats.inserted_blocks += len(new)
        return new

    def _drop(self, e: _Entry | None) -> None:
        """Remove placeholder entries without children, upwards from ``e``."""
        by_key = self._by_key
        while e is not None and e.block < 0 and not e.children:
            del by_key[e.key]
            e = e.parent
            if e is not None:
                e.children -= 1

    def _forget_all(self, blocks: list[int]) -> None:
        pop = self._entries.pop
        for b in blocks:
            e = pop(b)
            e.block = _EMPTY
            if not e.children:
                self._drop(e)


if TYPE_CHECKING:
    from deepinfer_kit.cache.protocols import PrefixIndex

    _check: type[PrefixIndex] = HashChainPrefixIndex
