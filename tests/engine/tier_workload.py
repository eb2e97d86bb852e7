"""The KV tier tests' workload (imported by the tier test modules): prompts over a few
shared 64-token heads, greedy and seeded parameters, served one request at a time so each
finds the earlier prefixes wherever the tiers put them; and the failed-load scenario."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from deepinfer_kit.cache.tiers.manager import TieredKVCacheManager
from deepinfer_kit.engine.build import build_engine
from deepinfer_kit.sample.params import SamplingParams

POOL = {"num_blocks": 24, "block_size": 8, "max_num_seqs": 2, "max_model_len": 192}


def tier_prompts(seed: int, num_heads: int, count: int) -> tuple[list[list[int]], list[list[int]], random.Random]:
    """``(heads, prompts, rng)``: ``num_heads`` 64-token heads, ``count`` prompts cycling
    over them with a 3 to 19 token tail each, and the generator for anything else drawn."""
    rng = random.Random(seed)
    heads = [[rng.randrange(250) for _ in range(64)] for _ in range(num_heads)]
    prompts = [heads[i % num_heads] + [rng.randrange(250) for _ in range(rng.randrange(3, 20))]
               for i in range(count)]
    return heads, prompts, rng


def tier_params(i: int) -> SamplingParams:
    """Prompt ``i``'s parameters: greedy for odd ``i``, seeded nucleus sampling for even."""
    if i % 2:
        return SamplingParams(max_tokens=5, temperature=0.0)
    return SamplingParams(max_tokens=5, temperature=0.9, top_p=0.9, seed=100 + i)


def serve_one_at_a_time(prompts: list[list[int]], **engine: Any) -> tuple[dict[str, list[int]], Any]:
    """Tokens per request id (``str(i)``) and the tier counters (None without tiers) of a
    fresh engine of :data:`POOL` and ``engine`` serving ``prompts`` one at a time; the idle
    check holds after."""
    e = build_engine(**{**POOL, **engine})
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, tier_params(i))
        out.update({o.request_id: list(o.outputs[0].token_ids) for o in e.run()})
    e.flush()
    e.check_idle()
    stats = getattr(e.cache, "tier_stats", None)
    e.close()
    return out, stats


def a_failed_load_errors_its_request(engine: Any, head: list[int], others: list[list[int]],
                                     before_read: Callable[[], None] | None = None) -> None:
    """``head``'s blocks go to the host tier (``others`` push them out of the device pool);
    ``before_read`` runs; then a request reading them must end with the load error while a
    fresh one beside it finishes."""
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    engine.add_request("first", head + [1, 2], greedy)
    for i, p in enumerate(others):
        engine.add_request(f"other{i}", p, greedy)
    engine.run()
    if before_read is not None:
        before_read()
    engine.add_request("reads_the_tier", head + [3, 4], greedy)
    engine.add_request("fresh", [5] * 30, greedy)
    outs = {o.request_id: o.outputs[0] for o in engine.run()}
    cache = engine.cache
    assert isinstance(cache, TieredKVCacheManager) and cache.tier_stats.host_hits > 0
    assert outs["reads_the_tier"].finish_reason == "error"
    assert "KV load failed" in str(outs["reads_the_tier"].stop_reason)
    assert outs["fresh"].finish_reason == "length"
