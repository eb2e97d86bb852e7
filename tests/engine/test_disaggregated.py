"""Prefill/decode disaggregation on one host: the decode engine's tokens are one engine's
(greedy and seeded), its prompts' blocks come from the prefill engine, and a failed
prefill side ends in recompute with nothing leaked."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from deepinfer_kit.cache.tiers.disk_store import DiskBlockStore
from deepinfer_kit.disagg import DisaggregatedEngine, build_disaggregated, push_kv_down
from deepinfer_kit.engine.build import build_engine
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sample.params import SamplingParams

_RNG = random.Random(3)
_PROMPTS = [[_RNG.randrange(250) for _ in range(_RNG.randrange(5, 70))] for _ in range(10)]
_PARAMS = [SamplingParams(max_tokens=7, temperature=0.0) if i % 2 else
           SamplingParams(max_tokens=7, temperature=1.0, seed=50 + i) for i in range(10)]
_CONFIG = EngineConfig(num_blocks=64, block_size=8, max_num_seqs=4, max_model_len=512)


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    engine = build_engine(_CONFIG)
    for i, p in enumerate(_PROMPTS):
        engine.add_request(str(i), p, _PARAMS[i])
    out = {o.request_id: list(o.outputs[0].token_ids) for o in engine.run()}
    engine.close()
    return out


def _run(d: DisaggregatedEngine) -> dict[str, list[int]]:
    for i, p in enumerate(_PROMPTS):
        d.add_request(str(i), p, _PARAMS[i])
    out = {o.request_id: list(o.outputs[0].token_ids) for o in d.run()}
    d.prefill.check_idle()
    d.decode.check_idle()
    return out


def test_decode_engine_gives_one_engines_tokens(reference: dict[str, list[int]], tmp_path: Path) -> None:
    d = build_disaggregated(_CONFIG, tmp_path)
    got = _run(d)
    assert got == reference
    full_blocks = sum((len(p) - 1) // 8 for p in _PROMPTS)
    assert d.decode.cache.tier_stats.disk_hits == full_blocks  # type: ignore[attr-defined]
    assert d.num_fallbacks == 0
    d.close()


def test_failed_transfers_are_recomputed(reference: dict[str, list[int]], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    d = build_disaggregated(_CONFIG, tmp_path, prefetch_timeout_s=30.0)
    calls = {"n": 0}
    real_put = DiskBlockStore.put

    def flaky_put(self: DiskBlockStore, key: bytes, payload: object) -> None:
        calls["n"] += 1
        if calls["n"] % 2:  # every other block never reaches the folder
            raise OSError("injected: the link went down")
        real_put(self, key, payload)  # type: ignore[arg-type]

    monkeypatch.setattr(DiskBlockStore, "put", flaky_put)
    got = _run(d)
    assert got == reference
    assert d.prefill.cache.tier_stats.failed_writes > 0  # type: ignore[attr-defined]
    # The decode side is told how many leading blocks are down: it waits for none of the
    # blocks that never came (with a 30 s deadline, a wait would show as a late read).
    stats = d.decode.cache.tier_stats  # type: ignore[attr-defined]
    assert stats.late_reads == 0 and stats.failed_reads == 0
    d.close()


def test_a_dead_prefill_engine_falls_back_to_decode(reference: dict[str, list[int]], tmp_path: Path) -> None:
    d = build_disaggregated(_CONFIG, tmp_path)
    d.prefill.close()  # dead: every later call raises EngineDeadError
    got = _run_without_prefill_check(d)
    assert got == reference
    assert d.num_fallbacks == len(_PROMPTS)
    d.decode.close()


def _run_without_prefill_check(d: DisaggregatedEngine) -> dict[str, list[int]]:
    for i, p in enumerate(_PROMPTS):
        d.add_request(str(i), p, _PARAMS[i])
    out = {o.request_id: list(o.outputs[0].token_ids) for o in d.run()}
    d.decode.check_idle()
    return out


def test_engines_without_tiers_are_refused() -> None:
    plain = build_engine(_CONFIG)
    with pytest.raises(ConfigError, match="prefill engine has no kv_tiers"):
        DisaggregatedEngine(plain, plain)
    plain.close()


@pytest.mark.parametrize("remote_blocks, waits", [(2, False), (None, True)], ids=["told", "untold"])
def test_the_decode_side_waits_only_for_the_blocks_the_prefill_side_wrote(
        tmp_path: Path, remote_blocks: int | None, waits: bool) -> None:
    key = b"r" * 32
    tiers = {"host_blocks": 16, "disk_blocks": 64, "disk_path": str(tmp_path), "hash_key": key,
             "prefetch_timeout_s": 0.3}
    prefill = build_engine(_CONFIG, kv_tiers=tiers)
    head = _PROMPTS[3][:16] if len(_PROMPTS[3]) >= 16 else list(range(1, 17))
    prefill.add_request("p", head + [9], SamplingParams(max_tokens=1), kv={"save_prompt": True})
    prefill.run()
    push_kv_down(prefill)
    prefill.close()
    assert len(list(tmp_path.glob("*.kvb"))) == 2  # the two full blocks it wrote
    decode = build_engine(_CONFIG, kv_tiers=tiers)
    prompt = head + [(5 * j) % 250 + 1 for j in range(3 * 8 + 2)]  # three more blocks nobody writes
    kv = {"load_remote": True} if remote_blocks is None else {"load_remote": True, "remote_blocks": remote_blocks}
    decode.add_request("d", prompt, SamplingParams(max_tokens=3, temperature=0.0), kv=kv)
    out = decode.run()[0].outputs[0]
    plain = build_engine(_CONFIG)
    plain.add_request("d", prompt, SamplingParams(max_tokens=3, temperature=0.0))
    assert out.token_ids == plain.run()[0].outputs[0].token_ids
    plain.close()
    stats = decode.cache.tier_stats  # type: ignore[attr-defined]
    assert stats.disk_hits == 2
    # Untold, the decode side waited for block 2 until its deadline (then recomputed it:
    # missing, or still being looked for); told that two blocks exist, it never looked.
    assert stats.failed_reads + stats.late_reads == (1 if waits else 0)
    decode.check_idle()
    decode.close()
