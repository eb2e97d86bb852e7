"""The model drafters' own KV pool, checked after a committed round (shared by their tests)."""

from __future__ import annotations

from typing import Any

from deepinfer_kit.spec.drafters.draft_kv import DraftKVBook


def check_draft_pool(book: DraftKVBook, engine: Any) -> int:
    """Each running sequence's draft KV is a prefix of its tokens, in exactly the blocks
    that hold it; nothing else is held. Returns the tokens held."""
    running = {r.request_id: r.all_token_ids for r in engine.scheduler.running}
    held = 0
    total_blocks = 0
    for sid in list(running):
        tokens = book.tokens(sid)
        assert running[sid][: len(tokens)] == tokens
        blocks = book.block_table(sid)
        assert len(blocks) == -(-len(tokens) // book.block_size), sid
        held += len(tokens)
        total_blocks += len(blocks)
    assert len(book) <= len(running)
    assert book.num_held_blocks == total_blocks
    assert book.allocator.num_free == book.allocator.num_blocks - total_blocks
    return held
