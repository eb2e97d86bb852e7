"""Engine.reset_prefix_cache / LLM.reset_prefix_cache: refused while requests run, then the
next run of the same prompts hits nothing; and a Request built for the cache alone."""

from __future__ import annotations

from deepinfer_kit import LLM, SamplingParams
from deepinfer_kit.cache import CacheConfig
from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.request import Request

PROMPTS = [list(range(1, 70)), list(range(1, 50)) + [7] * 20]
GREEDY = SamplingParams(max_tokens=4, temperature=0)


def _cached(llm: LLM) -> list[int]:
    return [out.num_cached_tokens for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_reset_empties_the_cache_only_when_idle() -> None:
    llm = LLM("tiny", num_blocks=256, block_size=16)
    first = _cached(llm)
    assert first == [0, 0]  # one batch: nothing is published before its step commits
    assert _cached(llm) == [64, 64]  # replayed: every full block but the last is cached
    engine = llm.engine
    rid = engine.add_request(None, PROMPTS[0], GREEDY)
    assert not llm.reset_prefix_cache()  # a request is queued
    engine.step()
    assert not engine.reset_prefix_cache()  # ... and running
    outs = engine.run()
    assert [o.request_id for o in outs] == [rid] and outs[0].num_cached_tokens == 64
    free = engine.cache.num_free_blocks
    assert llm.reset_prefix_cache()
    assert engine.cache.num_free_blocks == free == 256
    engine.check_idle()
    assert _cached(llm) == first  # as on a fresh engine


def test_request_for_the_cache_alone_needs_no_sampling_params() -> None:
    cache = BlockKVCacheManager.create(CacheConfig(block_size=4, num_blocks=16))
    a = Request("a", list(range(10)))
    assert a.params == SamplingParams() and a.seed is None
    cache.allocate(a, a.num_tokens)
    cache.cache_full_blocks(a, a.num_tokens)
    assert cache.match_prefix(Request("b", list(range(8)) + [99, 98])) == 8
