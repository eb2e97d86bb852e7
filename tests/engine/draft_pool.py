"""The model drafters' own KV pool, checked after a committed round (shared by their tests).

The runner drafts as each round executes and rolls a sequence's draft KV back to what the
round before accepted just before it drafts again, so after a commit a running sequence's
draft KV is its committed tokens up to at most ``num_draft`` rejected drafts of the round
just verified; a sequence that finished stays held until the next round (or the idle
check) releases it.
"""

from __future__ import annotations

from typing import Any

from deepinfer_kit.spec.drafters.draft_kv import DraftKVBook


def check_draft_pool(book: DraftKVBook, engine: Any) -> int:
    """Each running sequence's draft KV agrees with its tokens but for at most γ rejected
    drafts at its end, in exactly the blocks that hold it; the pool's free count matches
    what is held. Returns the tokens held by running sequences."""
    running = {r.request_id: r.all_token_ids for r in engine.scheduler.running}
    gamma = engine.num_draft
    held = 0
    total_blocks = 0
    for sid in list(running):
        tokens = book.tokens(sid)
        agree = 0
        for a, b in zip(running[sid], tokens):
            if a != b:
                break
            agree += 1
        assert len(tokens) - agree <= gamma, (sid, len(tokens), agree)
        blocks = book.block_table(sid)
        assert len(blocks) == -(-len(tokens) // book.block_size), sid
        held += len(tokens)
        total_blocks += len(blocks)
    assert book.num_held_blocks >= total_blocks
    assert book.allocator.num_free == book.allocator.num_blocks - book.num_held_blocks
    return held
