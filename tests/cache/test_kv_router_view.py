"""A router's view from KV events: the engine holding a prompt's prefix in any tier wins,
and forgets what the engine dropped."""

from __future__ import annotations

import random
from pathlib import Path

from deepinfer_kit.cache.tiers.router_view import PrefixRouterView
from deepinfer_kit.disagg import push_kv_down
from deepinfer_kit.engine.build import build_engine
from deepinfer_kit.sample.params import SamplingParams

_KEY = b"v" * 32


def test_the_view_routes_to_the_engine_holding_the_prefix_below_the_device(tmp_path: Path) -> None:
    rng = random.Random(5)
    heads = [[rng.randrange(250) for _ in range(48)] for _ in range(4)]
    engines = [build_engine(num_blocks=12, block_size=8, max_num_seqs=2, max_model_len=96,
                            kv_tiers={"host_blocks": 8, "disk_blocks": 64, "disk_path": str(tmp_path / str(i)),
                                      "hash_key": _KEY}) for i in range(2)]
    view = PrefixRouterView(_KEY, 8)
    for n, head in enumerate(heads):  # engine n % 2 serves head n, then pushes it down
        engine = engines[n % 2]
        engine.add_request(str(n), head + [1, 2, 3], SamplingParams(max_tokens=2))
        engine.run()
        push_kv_down(engine)
    for i, engine in enumerate(engines):
        view.apply(i, engine.cache.take_kv_events())  # type: ignore[attr-defined]
    for n, head in enumerate(heads):
        prompt = head + [9, 9, 9, 9]
        assert view.best(prompt) == (n % 2, 6)  # 48 tokens: 6 blocks, wherever they are now
    assert view.best([7] * 40) == (None, 0)
    engines[0].reset_prefix_cache()
    view.apply(0, engines[0].cache.take_kv_events())  # type: ignore[attr-defined]
    assert view.best(heads[0] + [9]) == (None, 0)
    assert view.best(heads[1] + [9]) == (1, 6)
    for engine in engines:
        engine.close()


def test_a_feed_that_lost_events_rebuilds_the_engines_view() -> None:
    from deepinfer_kit.cache.tiers.router_view import PrefixRouterView

    view = PrefixRouterView(b"k" * 32, 4)
    tokens = list(range(1, 10))
    keys = [k.hex() for k in _keys(view, tokens)]
    cursor = view.apply_feed("e", {"events": [{"seq": 1, "kind": "stored", "medium": "disk", "keys": keys}],
                                   "last": 1, "lost": False})
    assert cursor == 1 and view.matched_blocks("e", tokens) == 2
    # the reader fell behind: what it held may be gone; it keeps only what follows
    cursor = view.apply_feed("e", {"events": [{"seq": 9, "kind": "stored", "medium": "host", "keys": keys[:1]}],
                                   "last": 9, "lost": True})
    assert cursor == 9 and view.matched_blocks("e", tokens) == 1


def _keys(view: object, tokens: list[int]) -> list[bytes]:
    from deepinfer_kit.cache.tiers.manager import chain_keys

    return chain_keys(view._hasher, tokens, None, 4, (len(tokens) - 1) // 4)  # type: ignore[attr-defined]
