"""The engine with KV tiers: the same tokens as without (greedy and seeded) while prefixes
come back from the host and disk tiers; damaged files recomputed; opt-out; reset; events;
refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deepinfer_kit.cache.tiers.config import TierConfig
from deepinfer_kit.cache.tiers.host_worker import HostTransferWorker, host_slab
from deepinfer_kit.cache.tiers.slab_bytes import RankSlabs
from deepinfer_kit.cache.tiers.manager import TieredKVCacheManager, chain_keys
from deepinfer_kit.cache.tiers.offload import OffloadConnector
from deepinfer_kit.cache.tiers.records import TransferPlan
from deepinfer_kit.components import BuildContext, Components, Factory
from deepinfer_kit.disagg import push_kv_down
from deepinfer_kit.engine.build import build_engine
from deepinfer_kit.errors import CapacityError, ConfigError
from deepinfer_kit.sample.params import SamplingParams
from tier_workload import serve_one_at_a_time, tier_params, tier_prompts

_HEADS, _PROMPTS, _RNG = tier_prompts(7, 6, 18)
_params = tier_params


def _serve(prompts: list[list[int]], **kw: object) -> tuple[dict[str, list[int]], object]:
    return serve_one_at_a_time(prompts, **kw)


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return _serve(_PROMPTS)[0]


@pytest.mark.parametrize("tiers, engine", [
    ({"host_blocks": 64}, {}),
    ({"host_blocks": 12, "disk_blocks": 120}, {}),
    ({"host_blocks": 12, "disk_blocks": 120, "write_policy": "write_back"}, {}),
    ({"host_blocks": 12, "disk_blocks": 120, "host_eviction": "frequency", "admission": "seen_twice"}, {}),
    ({"host_blocks": 12, "disk_blocks": 120}, {"overlap": True}),
    ({"host_blocks": 12, "disk_blocks": 120, "write_policy": "write_back"},
     {"speculative": {"drafter": "ngram", "num_draft": 3}}),
], ids=["host", "disk_through", "disk_back", "frequency_seen_twice", "overlapped", "speculative"])
def test_tokens_equal_the_device_only_engine(reference: dict[str, list[int]], tiers: dict[str, object],
                                             engine: dict[str, object], tmp_path: Path) -> None:
    if "disk_blocks" in tiers:
        tiers = {**tiers, "disk_path": str(tmp_path)}
    got, stats = _serve(_PROMPTS, kv_tiers=tiers, **engine)
    if "speculative" in engine:
        # How many drafts a round verifies follows the round's budget, which the loaded
        # (uncomputed) prompt tokens change; a seeded request's draws follow that count, so
        # under speculation only greedy requests are compared (odd indices).
        got = {k: v for k, v in got.items() if int(k) % 2}
        reference = {k: v for k, v in _serve(_PROMPTS, **engine)[0].items() if int(k) % 2}
    assert got == reference
    assert stats.loaded_tokens > 0  # type: ignore[attr-defined]
    if "disk_blocks" in tiers:
        assert stats.disk_hits > 0 and stats.saved_disk > 0  # type: ignore[attr-defined]


def test_damaged_files_are_recomputed(reference: dict[str, list[int]], tmp_path: Path) -> None:
    tiers = {"host_blocks": 12, "disk_blocks": 120, "disk_path": str(tmp_path)}
    key = b"k" * 32
    engine = build_engine(num_blocks=24, block_size=8, max_num_seqs=2, max_model_len=192, kv_tiers={**tiers, "hash_key": key})
    for i, p in enumerate(_PROMPTS[:6]):
        engine.add_request(str(i), p, _params(i))
        engine.run()
    cache = engine.cache
    assert isinstance(cache, TieredKVCacheManager)
    push_kv_down(engine)
    files = sorted(tmp_path.glob("*.kvb"))
    assert files
    for n, f in enumerate(files):  # flip a payload byte, truncate, or empty each file
        data = bytearray(f.read_bytes())
        if n % 3 == 0:
            data[-5] ^= 0xFF
        elif n % 3 == 1:
            data = data[: len(data) // 2]
        else:
            data = bytearray()
        f.write_bytes(bytes(data))
    # The device and the host forget the first run; only the (damaged) files remain.
    host = cache.connector.host  # type: ignore[attr-defined]
    for s in range(host.capacity):
        if host.key(s) is not None:
            host.drop(s)
    cache._evict(cache._index, cache._index.num_evictable)  # type: ignore[union-attr]
    out: dict[str, list[int]] = {}
    for i, p in enumerate(_PROMPTS):
        engine.add_request(str(i), p, _params(i))
        out.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.run()})
    engine.flush()
    assert out == reference
    assert cache.tier_stats.failed_reads > 0
    engine.close()


def test_opt_out_writes_nothing_below_the_device(tmp_path: Path) -> None:
    engine = build_engine(num_blocks=24, block_size=8, max_num_seqs=2, max_model_len=192,
                          kv_tiers={"host_blocks": 40, "disk_blocks": 100, "disk_path": str(tmp_path)})
    for i, p in enumerate(_PROMPTS[:8]):
        engine.add_request(str(i), p, _params(i), kv={"write": False})
        engine.run()
    cache = engine.cache
    assert isinstance(cache, TieredKVCacheManager)
    push_kv_down(engine)
    assert cache.tier_stats.saved_host == 0 and not list(tmp_path.glob("*.kvb"))
    engine.check_idle()
    engine.close()


def test_reset_forgets_the_tiers_and_events_name_the_blocks(tmp_path: Path) -> None:
    key = b"r" * 32
    engine = build_engine(num_blocks=24, block_size=8, max_num_seqs=2, max_model_len=192,
                          kv_tiers={"host_blocks": 12, "disk_blocks": 100, "disk_path": str(tmp_path), "hash_key": key})
    for i, p in enumerate(_PROMPTS[:8]):
        engine.add_request(str(i), p, _params(i))
        engine.run()
    cache = engine.cache
    assert isinstance(cache, TieredKVCacheManager)
    push_kv_down(engine)
    events = cache.take_kv_events()
    stored = {m: set() for m in ("device", "host", "disk")}
    for ev in events:
        if ev.kind == "stored":
            stored[ev.medium].update(ev.keys)
    from deepinfer_kit.cache.hashing import BlockHasher
    first = chain_keys(BlockHasher(key), _PROMPTS[0], None, 8, len(_PROMPTS[0]) // 8)
    assert set(first) <= stored["device"] and stored["host"] and stored["disk"]
    assert engine.reset_prefix_cache()
    assert not list(tmp_path.glob("*.kvb"))
    loaded = cache.tier_stats.loaded_tokens
    engine.add_request("again", _PROMPTS[0], _params(1))
    engine.run()
    assert cache.tier_stats.loaded_tokens == loaded
    assert any(ev.kind == "cleared" for ev in cache.take_kv_events())
    engine.check_idle()
    engine.close()


@pytest.mark.parametrize("fields, message", [
    ({"enable_prefix_caching": False}, "enable_prefix_caching"),
])
def test_unsupported_builds_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_engine(kv_tiers={"host_blocks": 8}, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("tiers, message", [
    ({"host_blocks": -1}, "host_blocks"),
    ({"host_blocks": 4, "disk_blocks": 8}, "disk_path"),
    ({"disk_blocks": 8, "disk_path": "/tmp/x"}, "host_blocks"),
    ({"host_blocks": 4, "write_policy": "sometimes"}, "write_policy"),
    ({"host_blocks": 4, "hash_key": b"short"}, "hash_key"),
    ({"host_blocks": 4, "bogus": 1}, "bogus"),
    ({"host_blocks": 4, "prefetch": "eventually"}, "prefetch"),
    ({"host_blocks": 4, "disk_blocks": 8, "disk_path": "/proc/no-kv-here"}, "disk_path '/proc/no-kv-here' cannot"),
    ({"host_blocks": 4, "prefetch_timeout_s": float("nan")}, "prefetch_timeout_s"),
])
def test_bad_tier_configs_name_the_field(tiers: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_engine(kv_tiers=tiers)


def test_a_host_tier_too_big_for_memory_is_a_capacity_error() -> None:
    with pytest.raises(CapacityError, match="host_blocks=1000000000000"):
        build_engine(num_blocks=16, max_model_len=256, kv_tiers={"host_blocks": 10**12})


def test_bad_request_params_name_the_field() -> None:
    engine = build_engine(num_blocks=16, max_model_len=256, kv_tiers={"host_blocks": 8})
    with pytest.raises(ConfigError, match="kv has unknown keys"):
        engine.add_request("a", [1, 2, 3], kv={"wrte": False})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="save_prompt"):
        engine.add_request("a", [1, 2, 3], kv={"write": False, "save_prompt": True})
    with pytest.raises(ConfigError, match="write must be True or False, got 'no'"):
        engine.add_request("a", [1, 2, 3], kv={"write": "no"})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="kv must be a KVRequestParams"):
        engine.add_request("a", [1, 2, 3], kv=5)  # type: ignore[arg-type]
    assert not engine.has_unfinished_requests()
    engine.close()


class _CountingConnector(OffloadConnector):
    """The built-in tiers, counting the rounds that carried copies."""

    rounds = 0

    def build_transfers(self, step_id: int) -> TransferPlan:
        plan = super().build_transfers(step_id)
        if plan:
            self.rounds += 1
        return plan


def _make_connector(ctx: BuildContext) -> tuple[OffloadConnector, HostTransferWorker]:
    kv = ctx.base
    slab = host_slab(kv, 64)
    return _CountingConnector(TierConfig(host_blocks=64), RankSlabs([slab], [0], kv.num_kv_heads), None, kv.block_size), \
        HostTransferWorker(kv, slab)


def test_an_injected_connector_is_the_one_the_engine_drives(reference: dict[str, list[int]]) -> None:
    engine = build_engine(num_blocks=24, block_size=8, max_num_seqs=2, max_model_len=192,
                          components=Components(kv_connector=Factory(_make_connector)))
    out: dict[str, list[int]] = {}
    for i, p in enumerate(_PROMPTS):
        engine.add_request(str(i), p, _params(i))
        out.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.run()})
    cache = engine.cache
    assert isinstance(cache, TieredKVCacheManager) and isinstance(cache.connector, _CountingConnector)
    assert out == reference and cache.connector.rounds > 0 and cache.tier_stats.loaded_tokens > 0
    engine.check_idle()
    engine.close()
    with pytest.raises(ConfigError, match="kv_connector is built over the engine's KV pool: give a Factory"):
        Components(kv_connector=_make_connector)  # type: ignore[arg-type]


def test_a_drafter_with_its_own_kv_drafts_as_without_tiers() -> None:
    """Self-speculation's drafter keeps a KV pool of its own, without prefix sharing: it
    computes every new request's whole prompt itself, so prompts served from a tier give
    it the same context, the same drafts and the same acceptances."""
    counts = []
    for tiers in (None, {"host_blocks": 64}):
        engine = build_engine(num_blocks=24, block_size=8, max_num_seqs=2, max_model_len=192, kv_tiers=tiers,
                              speculative={"drafter": "self", "num_draft": 3, "draft_layers": 1})
        seen = [0, 0]

        def on(trace: Any, seen: list[int] = seen) -> None:
            seen[0] += trace.num_drafted
            seen[1] += trace.num_accepted

        engine.subscribe(on)
        out = {}
        for i, p in enumerate(_PROMPTS):
            engine.add_request(str(i), p, SamplingParams(max_tokens=8, temperature=0.0))
            out.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.run()})
        loaded = engine.cache.tier_stats.loaded_tokens if tiers else 0  # type: ignore[attr-defined]
        engine.check_idle()
        engine.close()
        counts.append((out, seen, loaded))
    (plain, drafts, _), (tiered_out, tiered_drafts, loaded) = counts
    assert loaded > 0 and drafts[0] > 0
    assert tiered_out == plain and tiered_drafts == drafts
