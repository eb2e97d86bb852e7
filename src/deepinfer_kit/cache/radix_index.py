"""RadixPrefixIndex: a tree of full blocks, one subtree per context (SGLang style)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from deepinfer_kit.cache._index_base import PublishedBlocks
from deepinfer_kit.cache.hashing import BlockHasher, encode_context
from deepinfer_kit.cache.protocols import EvictionPolicy
from deepinfer_kit.errors import InvariantError

__all__ = ["RadixPrefixIndex"]

_EMPTY = -1  # block of a placeholder node (its block was evicted, descendants remain)


class _Node:
    """One full block on a path from a context's root. ``tokens`` is ``None`` at a root."""

    __slots__ = ("block", "tokens", "parent", "key", "children", "context")

    def __init__(
        self, block: int, tokens: list[int] | None, parent: _Node | None, key: bytes,
        context: Hashable,
    ) -> None:
        self.block = block
        self.tokens = tokens
        self.parent = parent
        self.key = key
        self.children: dict[bytes, _Node] = {}
        self.context = context


class RadixPrefixIndex(PublishedBlocks[_Node]):
    """A radix tree whose edges are full blocks (radix ``P`` tokens, so every block can be
    evicted on its own), with one root per ``context``.

    A node's children are keyed by a keyed BLAKE2b digest of the child block's tokens
    (unpredictable by clients, hashed once per request via the memo) and every step of a
    walk compares the stored tokens, so the tree is exact: the path is the whole prefix.
    An evicted block whose descendants are still cached leaves a placeholder node; the
    path becomes reachable again when an equal block is published.

    Args:
        block_size: tokens per block ``P``.
        key: hash key; ``None`` draws a random per-process key.
        digest_size: bytes per child key (16 by default).
        policy: eviction order of unreferenced cached blocks; LRU when ``None``.

    Raises:
        ConfigError: a bad ``block_size``, ``key`` or ``digest_size``.
    """

    __slots__ = ("_hasher", "_roots")

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
        self._roots: dict[bytes, _Node] = {}

    def _keys(self, tokens: list[int], num_blocks: int, memo: list[bytes] | None) -> list[bytes]:
        keys = memo if memo is not None else []
        if len(keys) < num_blocks:
            self._hasher.extend_blocks(keys, tokens, num_blocks, self._block_size)
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
        node = self._roots.get(encode_context(context)) if n else None
        if node is not None and node.context == context:
            keys = self._keys(tokens, n, memo)
            for i in range(n):
                node = node.children.get(keys[i])
                if node is None or node.block < 0 or node.tokens != tokens[i * P : i * P + P]:
                    break
                hits.append(node.block)
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
        n = len(blocks)
        if len(tokens) < n * P:
            raise InvariantError(f"insert: {n} blocks need {n * P} tokens, got {len(tokens)}")
        start = max(start, 0)
        if start >= n:
            return []
        if type(tokens) is not list:
            tokens = list(tokens)
        keys = self._keys(tokens, n, memo)
        entries = self._entries
        node = entries.get(blocks[start - 1]) if start else None
        if node is not None and node.key == keys[start - 1]:
            i = start
        else:
            node = self._root(context)
            i = 0
        new: list[int] = []
        while i < n:
            k = keys[i]
            seg = tokens[i * P : i * P + P]
            child = node.children.get(k)
            if child is None:
                child = _Node(_EMPTY, seg, node, k, None)
                node.children[k] = child
            elif child.tokens != seg:
                break  # a key collision: this chain cannot be placed beyond here
            b = blocks[i]
            if i >= start and child.block < 0 and b not in entries:
                child.block = b
                entries[b] = child
                new.append(b)
            node = child
            i += 1
        if node.block < 0 and not node.children:
            self._prune(node)
        self._stats.inserted_blocks += len(new)
        return new

    def _root(self, context: Hashable) -> _Node:
        enc = encode_context(context)
        root = self._roots.get(enc)
        if root is None or root.context != context:
            root = _Node(_EMPTY, None, None, enc, context)
            self._roots[enc] = root
        return root

    def _prune(self, node: _Node) -> None:
        """Remove empty placeholder nodes upwards from ``node``, and an empty root."""
        parent = node.parent
        while parent is not None and node.block < 0 and not node.children:
            del parent.children[node.key]
            node, parent = parent, parent.parent
        if parent is None and not node.children and self._roots.get(node.key) is node:
            del self._roots[node.key]

    def _forget(self, block: int) -> None:
        node = self._entries.pop(block)
        node.block = _EMPTY
        if not node.children:
            self._prune(node)


if TYPE_CHECKING:
    from deepinfer_kit.cache.protocols import PrefixIndex

    _check: type[PrefixIndex] = RadixPrefixIndex
