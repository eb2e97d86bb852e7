"""HashChainPrefixIndex: full blocks keyed by a chained keyed hash, verified on every hit."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from deepinfer_kit.cache._index_base import PublishedBlocks
from deepinfer_kit.cache.hashing import BlockHasher
from deepinfer_kit.cache.protocols import EvictionPolicy
from deepinfer_kit.errors import InvariantError

__all__ = ["HashChainPrefixIndex"]

# entry = (block, tokens of the block, key of the previous block or None, context)
_Entry = tuple[int, list[int], "bytes | None", Hashable]


class HashChainPrefixIndex(PublishedBlocks[bytes]):
    """A flat map ``K_i -> block`` over chained keys ``K_i = H(K_{i-1} || tokens_i)``
    with ``K_{-1} = H(context)`` (vLLM style).

    ``H`` is keyed BLAKE2b (see :class:`~deepinfer_kit.cache.hashing.BlockHasher`). Every
    hit is verified: the stored tokens, the stored previous key and (for block 0) the
    context must equal the query's, so even a forced hash collision (tests use one-byte
    digests) can only cost a miss, never return KV of other tokens.

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
        n = len(tokens) // P
        if max_blocks is not None and max_blocks < n:
            n = max(max_blocks, 0)
        hits: list[int] = []
        if n and self._by_key:
            keys = self._keys(tokens, n, context, memo)
            get = self._by_key.get
            prev: bytes | None = None
            for i in range(n):
                k = keys[i]
                e = get(k)
                if e is None or e[2] != prev or e[1] != tokens[i * P : i * P + P]:
                    break
                if prev is None and e[3] != context:
                    break
                hits.append(e[0])
                prev = k
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
        :meth:`PrefixIndex.insert`). O(len(blocks) - start).

        Raises:
            InvariantError: ``tokens`` is shorter than ``len(blocks) * P``.
        """
        P = self._block_size
        n = len(blocks)
        if len(tokens) < n * P:
            raise InvariantError(f"insert: {n} blocks need {n * P} tokens, got {len(tokens)}")
        if start >= n:
            return []
        if type(tokens) is not list:
            tokens = list(tokens)
        keys = self._keys(tokens, n, context, memo)
        by_key = self._by_key
        entries = self._entries
        new: list[int] = []
        for i in range(max(start, 0), n):
            k = keys[i]
            b = blocks[i]
            if k in by_key or b in entries:
                continue
            by_key[k] = (b, tokens[i * P : i * P + P], keys[i - 1] if i else None, context)
            entries[b] = k
            new.append(b)
        self._stats.inserted_blocks += len(new)
        return new

    def _forget(self, block: int) -> None:
        del self._by_key[self._entries.pop(block)]


if TYPE_CHECKING:
    from deepinfer_kit.cache.protocols import PrefixIndex

    _check: type[PrefixIndex] = HashChainPrefixIndex
