"""RadixPrefixIndex: a tree of full blocks, one subtree per context (SGLang style)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

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

# A node is a list, not an object: one full block on a path from a context's root. Lists
# are built 4x faster than slotted instances, and an insert builds one per fresh block.
#   node[0]  block: the physical block, or _EMPTY (a placeholder, or a root)
#   node[1]  parent: the parent node; None for a root
#   node[2]  key: the block's token bytes (a root: its encoded context)
#   node[3]  children: key -> child node
#   node[4]  context: the context (roots only)
_Node = list[Any]


class RadixPrefixIndex(PublishedBlocks[list[Any]]):
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
        if node is not None and node[4] == context:
            keys = self._keys(tokens, n, memo)
            append = hits.append
            for k in keys if len(keys) == n else keys[:n]:
                node = node[3].get(k)
                if node is None or node[0] < 0:
                    break
                append(node[0])
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
        if node is not None and node[2] == keys[start - 1]:
            i = start
        else:
            node = self._root(context)
            i = 0
        new: list[int] = []
        for i in range(i, start):  # the published head (reached only without the shortcut)
            k = keys[i]
            children = node[3]
            child = children.get(k)
            if child is None:
                child = children[k] = [_EMPTY, node, k, {}]
            node = child
        for i in range(start, n):
            k = keys[i]
            children = node[3]
            child = children.get(k)
            b = blocks[i]
            if child is None:
                if b in entries:
                    child = children[k] = [_EMPTY, node, k, {}]
                else:  # the common case: a fresh block for a new path
                    child = children[k] = entries[b] = [b, node, k, {}]
                    new.append(b)
            elif child[0] < 0 and b not in entries:
                child[0] = b
                entries[b] = child
                new.append(b)
            node = child
        if node[0] < 0 and not node[3]:
            self._prune(node)
        self._stats.inserted_blocks += len(new)
        return new

    def _root(self, context: Hashable) -> _Node:
        enc = encode_context(context)
        root = self._roots.get(enc)
        if root is None or root[4] != context:
            root = self._roots[enc] = [_EMPTY, None, enc, {}, context]
        return root

    def _prune(self, node: _Node) -> None:
        """Remove empty placeholder nodes upwards from ``node``, and an empty root."""
        parent = node[1]
        while parent is not None and node[0] < 0 and not node[3]:
            del parent[3][node[2]]
            node, parent = parent, parent[1]
        if parent is None and not node[3] and self._roots.get(node[2]) is node:
            del self._roots[node[2]]

    def _forget_all(self, blocks: list[int]) -> None:
        pop = self._entries.pop
        for b in blocks:
            node = pop(b)
            if node[3]:
                node[0] = _EMPTY  # a placeholder: its cached descendants stay reachable
                continue
            # A leaf leaves the tree (a node holding a block always has a parent); nothing
            # refers to it afterwards, so its fields stay as they were.
            parent = node[1]
            del parent[3][node[2]]
            if parent[0] < 0 and not parent[3]:
                self._prune(parent)  # an emptied placeholder or root: rare


if TYPE_CHECKING:
    from deepinfer_kit.cache.protocols import PrefixIndex

    _check: type[PrefixIndex] = RadixPrefixIndex
