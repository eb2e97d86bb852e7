"""Index-specific behaviour beyond the conformance suite: pluggable eviction policy,
placeholders for evicted ancestors, context encoding, constructor validation."""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence

import pytest

from deepinfer_kit.cache import HashChainPrefixIndex, LRUEvictionPolicy, RadixPrefixIndex
from deepinfer_kit.cache.hashing import encode_context
from deepinfer_kit.errors import ConfigError

P = 4
INDEXES = [HashChainPrefixIndex, RadixPrefixIndex]


class MRUPolicy:
    """Most recently used first: proves the index follows an injected policy."""

    def __init__(self) -> None:
        self.inner = LRUEvictionPolicy()
        self.order: list[int] = []

    def __len__(self) -> int:
        return len(self.order)

    def push(self, blocks: Sequence[int]) -> None:
        self.order += blocks

    def discard(self, blocks: Sequence[int]) -> None:
        self.order = [b for b in self.order if b not in blocks]

    def touch(self, blocks: Sequence[int]) -> None:
        hit = [b for b in blocks if b in self.order]
        self.discard(hit)
        self.order += hit

    def pop(self, n: int) -> list[int]:
        out = self.order[::-1][:n]
        self.discard(out)
        return out


@pytest.mark.parametrize("cls", INDEXES)
def test_injected_policy_decides_the_eviction_order(cls: type) -> None:
    index = cls(P, policy=MRUPolicy())
    index.insert(list(range(8)), [0, 1])
    index.insert(list(range(50, 58)), [5, 6])
    index.mark_unused([1, 0])
    index.mark_unused([6, 5])
    assert index.evict(4) == [5, 6, 0, 1]


@pytest.mark.parametrize("cls", INDEXES)
def test_evicted_ancestor_leaves_a_placeholder_that_republishing_fills(cls: type) -> None:
    index = cls(P)
    t = list(range(3 * P))
    index.insert(t, [0, 1, 2])
    index.mark_unused([0])  # only the head is unreferenced (a duplicate's original)
    assert index.evict(1) == [0]
    assert index.match(t) == []  # the chain is cut at block 0 ...
    assert index.contains(1) and index.contains(2)  # ... but its descendants stay cached
    assert index.insert(t[:P], [7]) == [7]  # an equal block is published again
    assert index.match(t) == [7, 1, 2]


@pytest.mark.parametrize("cls", INDEXES)
def test_negative_insert_start_publishes_from_block_0(cls: type) -> None:
    index = cls(P)
    t = list(range(3 * P))
    assert index.insert(t, [4, 5, 6], start=-1) == [4, 5, 6]
    assert index.match(t) == [4, 5, 6]


@pytest.mark.parametrize("cls", INDEXES)
def test_evicting_everything_leaves_no_structure_behind(cls: type) -> None:
    index = cls(P)
    for i in range(5):
        blocks = [3 * i, 3 * i + 1, 3 * i + 2]
        index.insert([i % 2] * P + list(range(i, i + 2 * P)), blocks, context=i % 3)
        index.mark_unused(blocks[::-1])
    index.mark_unused([])
    assert len(index.evict(100)) == index.stats.inserted_blocks
    inner = index._by_key if cls is HashChainPrefixIndex else index._roots
    assert not inner


@pytest.mark.parametrize("cls", INDEXES)
def test_constructor_rejects_bad_arguments(cls: type) -> None:
    with pytest.raises(ConfigError, match="block_size"):
        cls(0)
    if cls is HashChainPrefixIndex:
        with pytest.raises(ConfigError, match="digest_size"):
            cls(P, digest_size=0)
    with pytest.raises(ConfigError, match="key"):
        cls(P, key=b"x" * 65)


def test_context_encoding_separates_values_that_print_alike() -> None:
    values = [None, "None", 0, False, 0.0, "", b"", (), ("a",), ("a", "b"), ("ab",), "a",
              b"a", frozenset({"a"}), (("a",),), 1, True, "1"]
    encoded = [encode_context(v) for v in values]
    assert len(set(encoded)) == len(values)
    assert encode_context(frozenset({"x", "y"})) == encode_context(frozenset({"y", "x"}))


@pytest.mark.parametrize(
    ("seed", "key", "salted"),
    [(None, None, False), ("random", None, False), ("0", None, True), ("123", None, True),
     (None, b"k" * 8, True)],
)
def test_radix_keys_carry_a_salt_only_when_the_dict_hash_is_predictable_or_a_key_is_given(
    monkeypatch: pytest.MonkeyPatch, seed: str | None, key: bytes | None, salted: bool
) -> None:
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    index = RadixPrefixIndex(P, key=key)
    t = list(range(3 * P))
    memo: list[bytes] = []
    index.insert(t, [0, 1, 2], memo=memo)
    raw = [array("I", t[i : i + P]).tobytes() for i in range(0, 3 * P, P)]
    if salted:
        salt = memo[0][: len(memo[0]) - 4 * P]
        assert len(salt) == (len(key) if key else 32)
        assert memo == [salt + r for r in raw]
    else:
        assert memo == raw
    assert index.match(t) == [0, 1, 2]


@pytest.mark.parametrize("salt", [b"", b"0123456789abcdef"], ids=["unsalted", "salted"])
@pytest.mark.parametrize("kind", [list, tuple])
def test_block_keys_one_at_a_time_equal_keys_made_together(salt: bytes, kind: type) -> None:
    """The one-block path (a decode filling its block) gives the keys the split gives."""
    from deepinfer_kit.cache.hashing import extend_block_bytes

    rng = random.Random(4)
    tokens = kind(rng.randrange(0, 2**32) for _ in range(16 * 70 + 5))
    together: list[bytes] = []
    extend_block_bytes(together, tokens, 70, 16, salt)
    one_by_one: list[bytes] = []
    for n in range(1, 71):
        extend_block_bytes(one_by_one, tokens, n, 16, salt)
    assert one_by_one == together and len(together) == 70
    mixed: list[bytes] = []
    for n in (1, 3, 4, 69, 70):
        extend_block_bytes(mixed, tokens, n, 16, salt)
    assert mixed == together
    with pytest.raises(OverflowError):
        extend_block_bytes([], kind([2**32] * 16), 1, 16, salt)


@pytest.mark.parametrize("kind", [list, tuple])
def test_chained_keys_one_at_a_time_equal_keys_made_together(kind: type) -> None:
    """The hash chain's one-block path gives the keys a multi-block extension gives."""
    from deepinfer_kit.cache.hashing import BlockHasher

    rng = random.Random(5)
    tokens = kind(rng.randrange(0, 2**32) for _ in range(16 * 40 + 3))
    hasher = BlockHasher(b"k" * 16)
    root = hasher.root("ctx")
    together: list[bytes] = []
    hasher.extend_chain(together, tokens, 40, 16, root)
    one_by_one: list[bytes] = []
    for n in range(1, 41):
        hasher.extend_chain(one_by_one, tokens, n, 16, root)
    assert one_by_one == together and len(set(together)) == 40
    with pytest.raises(OverflowError):
        hasher.extend_chain([], kind([2**32] * 16), 1, 16, root)
