"""A prefix index used alone, on plain token lists: no engine, no torch tensors, no GPU.

Publishes the blocks of a few "prompts" (block ids stand for wherever your engine keeps
KV), looks up longest cached prefixes, shows that a cache salt separates equal tokens,
then lets LRU eviction reclaim unreferenced blocks. Each result is checked; a wrong one
exits non-zero naming it.

    .venv/bin/python examples/prefix_cache_alone.py [--index hash|radix]
"""

from __future__ import annotations

import argparse

from deepinfer_kit.cache import FreeListBlockAllocator, HashChainPrefixIndex, RadixPrefixIndex

P = 4  # tokens per block


def check(what: str, got: object, expected: object) -> None:
    """Exit non-zero naming ``what`` unless ``got == expected``."""
    if got != expected:
        raise SystemExit(f"{what}: expected {expected!r}, got {got!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", choices=["hash", "radix"], default="hash")
    args = parser.parse_args()
    index = (HashChainPrefixIndex if args.index == "hash" else RadixPrefixIndex)(P)
    pool = FreeListBlockAllocator(num_blocks=8, block_size=P)

    system = [101, 102, 103, 104, 105, 106, 107, 108]  # two full blocks shared by both
    chat_a = system + [1, 2, 3, 4, 5, 6]  # 3 full blocks + 2 tokens
    chat_b = system + [9, 9, 9, 9]

    # Request A computes its KV, then (after that step committed) publishes its full blocks.
    blocks_a = pool.allocate(len(chat_a) // P)
    published = index.insert(chat_a, blocks_a)
    print("A publishes", published)
    check("A publishes its 3 full blocks", published, blocks_a)

    # Request B reuses the shared system prompt: it takes the matched blocks by reference.
    hit = index.match(chat_b)
    pool.retain(hit)
    index.mark_used(hit)
    print(f"B matches {len(hit) * P} of {len(chat_b)} tokens in blocks {hit}")
    check("B reuses A's two system-prompt blocks", hit, blocks_a[:2])
    salted = index.match(chat_b, context="tenant-2")
    print("same tokens under cache salt 'tenant-2':", salted)
    check("a different cache salt misses", salted, [])

    # Both finish: blocks that reach count 0 and are cached become evictable (tail first);
    # mark_unused hands back the uncached ones, which go straight to the free list.
    for blocks in (hit, blocks_a):
        pool.free(index.mark_unused(pool.release(blocks[::-1])))
    print(f"free {pool.num_free}, evictable {index.num_evictable}")
    check("free blocks (8 minus A's 3)", pool.num_free, 5)
    check("evictable blocks (A's 3, cached, unreferenced)", index.num_evictable, 3)

    # Memory pressure: evict the least recently used blocks (A's own tail goes first).
    evicted = index.evict(2)
    pool.free(evicted)
    left = index.match(chat_a)
    print("evicted", evicted, "-> A now matches", left)
    check("eviction order (A's tail first)", evicted, [blocks_a[2], blocks_a[1]])
    check("A's match after eviction", left, blocks_a[:1])
    stats = index.stats
    print(stats)
    check("queries", stats.queries, 3)
    check("hit blocks (2 for B + 0 salted + 1 for A)", stats.hit_blocks, 3)
    check("evicted blocks", stats.evicted_blocks, 2)


if __name__ == "__main__":
    main()
