"""RadixPrefixIndex: a tree of full blocks, one subtree per context (SGLang style)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from deepinfer_kit.cache._index_base import PublishedBlocks
from deepinfer_kit.cache.hashing import (
    encode_context,
    extend_block_bytes,
    hash_key_is_secret,
    new_key,
)
from deepinfer_kit.cache.protocols import EvictionPolicy

__all__ = ["RadixPrefixIndex"]

_EMPTY = -1  # block of a placeholder node (its block was evicted, descendants remain)


class _Node:
    """One full block on a path from a context's root (a root has ``parent is None``)."""

    __slots__ = ("block", "parent", "key", "children", "context")

    def __init__(self, block: int, parent: _Node | None, key: bytes, context: Hashable) -> None:
        self.block = block
        self.parent = parent
        self.key = key
        self.children: dict[bytes, _Node] = {}
        self.context = context


class RadixPrefixIndex(PublishedBlocks[_Node]):
    """A radix tree whose edges are full blocks (radix ``P`` tokens, so every block can be
    evicted on its own), with one root per ``context``.

    A node's children are keyed by the exact bytes of the child block's tokens, so
    lookups compare tokens exactly (no hash can collide into a wrong hit). The dict's hash
    is keyed by Python's per-process secret; when that secret is not random
    (``PYTHONHASHSEED`` fixed, see :func:`~deepinfer_kit.cache.hashing.hash_key_is_secret`)
    or ``key`` is given, every key also starts with a salt a client cannot learn, so
    nobody can craft prompts whose blocks collide in one node's dict. A path from the root is the whole prefix. An
    evicted block whose descendants are still cached leaves a placeholder node; the path
    becomes reachable again when an equal block is published.

    Args:
        block_size: tokens per block ``P``.
        key: the salt; ``None`` draws 32 random bytes when Python's hash key is not
            secret, else uses none (one copy less per block key).
        policy: eviction order of unreferenced cached blocks; LRU when ``None``.

    Raises:
        ConfigError: a bad ``block_size`` or ``key``.
    """

    __slots__ = ("_salt", "_roots")

    def __init__(
        self, block_size: int, *, key: bytes | None = None, policy: EvictionPolicy | None = None
    ) -> None:
        super().__init__(block_size, policy)
        self._salt = new_key(key) if key is not None or not hash_key_is_secret() else b""
        self._roots: dict[bytes, _Node] = {}

    def _keys(self, tokens: Sequence[int], num_blocks: int, memo: list[bytes] | None) -> list[bytes]:
        keys = memo if memo is not None else []
        if len(keys) < num_blocks:
            extend_block_bytes(keys, tokens, num_blocks, self._block_size, self._salt)
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
        :meth:`PrefixIndex.match`). O(matched blocks + new block keys)."""
        n = self._query_blocks(tokens, max_blocks)
        hits: list[int] = []
        node = self._roots.get(encode_context(context)) if n else None
        if node is not None and node.context == context:
            keys = self._keys(tokens, n, memo)
            append = hits.append
            for k in keys if len(keys) == n else keys[:n]:
                node = node.children.get(k)
                if node is None or node.block < 0:
                    break
                append(node.block)
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
        n, start = self._insert_span(tokens, blocks, start)
        if start >= n:
            return []
        keys = self._keys(tokens, n, memo)
        entries = self._entries
        node = entries.get(blocks[start - 1]) if start else None
        if node is not None and node.key == keys[start - 1]:
            i = start
        else:
            node = self._root(context)
            i = 0
        new: list[int] = []
        for i in range(i, start):  # the published head (reached only without the shortcut)
            k = keys[i]
            children = node.children
            child = children.get(k)
            if child is None:
                child = children[k] = _Node(_EMPTY, node, k, None)
            node = child
        for i in range(start, n):
            k = keys[i]
            children = node.children
            child = children.get(k)
            b = blocks[i]
            if child is None:
                if b in entries:
                    child = children[k] = _Node(_EMPTY, node, k, None)
                else:  # the common case: a fresh block for a new path
                    child = children[k] = entries[b] = _Node(b, node, k, None)
                    new.append(b)
            elif child.block < 0 and b not in entries:
                child.block = b
                entries[b] = child
                new.append(b)
            node = child
        if node.block < 0 and not node.children:
            self._prune(node)
        self._stats.inserted_blocks += len(new)
        return new

    def _root(self, context: Hashable) -> _Node:
        enc = encode_context(context)
        root = self._roots.get(enc)
        if root is None or root.context != context:
            root = self._roots[enc] = _Node(_EMPTY, None, enc, context)
        return root

    def _prune(self, node: _Node) -> None:
        """Remove empty placeholder nodes upwards from ``node``, and an empty root."""
        parent = node.parent
        while parent is not None and node.block < 0 and not node.children:
            del parent.children[node.key]
            node, parent = parent, parent.parent
        if parent is None and not node.children and self._roots.get(node.key) is node:
            del self._roots[node.key]

    def _forget_all(self, blocks: list[int]) -> None:
        pop = self._entries.pop
        roots = self._roots
        for b in blocks:
            node = pop(b)
            node.block = _EMPTY
            if node.children:
                continue  # a placeholder: its cached descendants stay reachable
            # _prune inlined (evictions are the hottest per-block path)
            parent = node.parent
            while parent is not None and node.block < 0 and not node.children:
                del parent.children[node.key]
                node, parent = parent, parent.parent
            if parent is None and not node.children and roots.get(node.key) is node:
                del roots[node.key]


if TYPE_CHECKING:
    from deepinfer_kit.cache.protocols import PrefixIndex

    _check: type[PrefixIndex] = RadixPrefixIndex
