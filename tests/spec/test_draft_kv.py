"""DraftKVBook: a drafter's own KV bookkeeping — rollback by content, release, all-or-nothing
reservation, the idle check."""

from __future__ import annotations

import random

import pytest

from deepinfer_kit.cache.free_list_allocator import FreeListBlockAllocator
from deepinfer_kit.errors import InvariantError, OutOfBlocksError
from deepinfer_kit.spec.drafters.draft_kv import DraftKVBook, common_prefix


def _book(blocks: int = 16, size: int = 4) -> DraftKVBook:
    return DraftKVBook(FreeListBlockAllocator(blocks, size))


def test_rollback_keeps_the_common_prefix_and_frees_the_blocks_past_it() -> None:
    book = _book()
    seq = list(range(10))
    book.reserve("a", 10 + 3)
    book.written("a", seq + [50, 51, 52])  # 13 tokens: 4 blocks
    assert len(book.block_table("a")) == 4 and book.allocator.num_free == 12
    accepted = seq + [50, 99]  # draft 51 rejected, 99 emitted
    assert book.reusable("a", accepted) == 11
    assert book.tokens("a") == seq + [50]
    assert len(book.block_table("a")) == 3 and book.allocator.num_free == 13


def test_sync_releases_sequences_no_longer_running_and_rolls_back_the_others() -> None:
    book = _book()
    for sid, n in (("a", 9), ("b", 5), ("c", 4)):
        book.reserve(sid, n)
        book.written(sid, list(range(n)))
    freed = book.sync({"a": list(range(6)) + [7, 7], "c": list(range(4))})
    assert book.tokens("a") == list(range(6)) and len(book.block_table("a")) == 2
    assert book.tokens("b") == [] and book.block_table("b") == []
    assert freed == 1 + 2  # a's third block, b's two
    book.sync({})
    book.check_idle()


def test_reserve_is_all_or_nothing_and_written_needs_room() -> None:
    book = _book(blocks=3, size=2)
    book.reserve("a", 4)
    before = (book.allocator.num_free, book.block_table("a"))
    with pytest.raises(OutOfBlocksError):
        book.reserve("a", 8)
    assert (book.allocator.num_free, book.block_table("a")) == before
    with pytest.raises(OutOfBlocksError):
        book.reserve("b", 3)
    assert len(book) == 1
    with pytest.raises(InvariantError, match="reserve"):
        book.written("a", list(range(5)))


def test_idle_check_names_what_is_held() -> None:
    book = _book()
    book.reserve("x", 1)
    with pytest.raises(InvariantError, match=r"\['x'\] hold 1 blocks"):
        book.check_idle()
    book.release("x")
    book.release("x")  # no-op
    book.check_idle()


def test_random_rounds_never_leak() -> None:
    """Random draft rounds (reserve, write, accept a random prefix, finish some): the pool
    always holds exactly ceil(tokens / P) blocks per sequence and ends idle."""
    rng = random.Random(0)
    book = _book(blocks=64, size=3)
    live: dict[str, list[int]] = {}
    for step in range(300):
        if len(live) < 4 and rng.random() < 0.3:
            live[f"s{step}"] = [rng.randrange(9) for _ in range(rng.randint(1, 8))]
        for sid, toks in live.items():
            start = book.reusable(sid, toks)
            assert start == common_prefix(book.tokens(sid), toks)
            drafts = [rng.randrange(9) for _ in range(rng.randint(1, 4))]
            book.reserve(sid, len(toks) + len(drafts) - 1)
            book.written(sid, toks + drafts[:-1])
            toks += drafts[: rng.randint(0, len(drafts))] + [rng.randrange(9)]
        for sid in [s for s in live if rng.random() < 0.1 or len(live[s]) > 24]:
            del live[sid]
        book.sync(live)
        for sid in live:
            assert len(book.block_table(sid)) == -(-len(book.tokens(sid)) // 3)
        assert book.allocator.num_free + book.num_held_blocks == 64
    book.sync({})
    book.check_idle()
