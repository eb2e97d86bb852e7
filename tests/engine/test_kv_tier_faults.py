"""Faults of the tiers inside the engine: a load that fails ends exactly the requests that
read its blocks with an error; a slow disk is waited for (``prefetch="wait"``) or its blocks
recomputed (``"best_effort"``); the engine keeps serving and leaks nothing."""

from __future__ import annotations

import random
import time

import pytest
import torch

from deepinfer_kit.cache.tiers.disk_store import DiskBlockStore
from deepinfer_kit.cache.tiers.manager import TieredKVCacheManager
from deepinfer_kit.disagg import push_kv_down
from deepinfer_kit.engine.build import build_engine
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.testing.kv_connector import FlakyWorker
from tier_workload import a_failed_load_errors_its_request

_RNG = random.Random(9)
_HEAD = [_RNG.randrange(250) for _ in range(64)]
_OTHERS = [[_RNG.randrange(250) for _ in range(70)] for _ in range(3)]


def test_a_failed_load_errors_its_requests_and_the_engine_serves_on() -> None:
    engine = build_engine(num_blocks=24, block_size=8, max_num_seqs=2, max_model_len=192,
                          kv_tiers={"host_blocks": 64})
    runner = engine.runner.runner if hasattr(engine.runner, "runner") else engine.runner  # type: ignore[attr-defined]

    def flaky() -> None:
        runner.kv_transfer = FlakyWorker(runner.kv_transfer, fail_loads=True)

    a_failed_load_errors_its_request(engine, _HEAD, _OTHERS, before_read=flaky)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    runner.kv_transfer = runner.kv_transfer.inner  # the link heals: the same prompt is served right
    engine.add_request("again", _HEAD + [3, 4], greedy)
    again = engine.run()[0].outputs[0]
    plain = build_engine(num_blocks=24, block_size=8, max_num_seqs=2, max_model_len=192)
    plain.add_request("ref", _HEAD + [3, 4], greedy)
    assert again.finish_reason == "length" and again.token_ids == plain.run()[0].outputs[0].token_ids
    plain.close()
    engine.flush()
    engine.check_idle()
    engine.close()


def _disk_only_engine(tmp_path: object, prefetch: str):  # type: ignore[no-untyped-def]
    """An engine whose first prompt's blocks are on disk only (device and host forgot them)."""
    engine = build_engine(num_blocks=24, block_size=8, max_num_seqs=2, max_model_len=192,
                          kv_tiers={"host_blocks": 16, "disk_blocks": 64, "disk_path": str(tmp_path),
                                    "prefetch": prefetch, "prefetch_timeout_s": 5.0})
    engine.add_request("warm", _HEAD + [1, 2], SamplingParams(max_tokens=2, temperature=0.0))
    engine.run()
    cache = engine.cache
    assert isinstance(cache, TieredKVCacheManager)
    push_kv_down(engine)
    host = cache.connector.host  # type: ignore[attr-defined]
    for s in range(host.capacity):
        if host.key(s) is not None:
            host.drop(s)
    cache._evict(cache._index, cache._index.num_evictable)  # type: ignore[union-attr]
    return engine, cache


@pytest.mark.parametrize("prefetch", ["wait", "best_effort"])
def test_a_slow_disk_is_waited_for_or_recomputed(tmp_path: object, prefetch: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    engine, cache = _disk_only_engine(tmp_path, prefetch)
    real = DiskBlockStore.get_into

    def slow(self: DiskBlockStore, key: bytes, out: torch.Tensor) -> bool:
        time.sleep(0.3)  # far longer than planning a round: a best-effort admission never sees it land
        return real(self, key, out)

    monkeypatch.setattr(DiskBlockStore, "get_into", slow)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    engine.add_request("again", _HEAD + [3, 4], greedy)
    got = engine.run()[0].outputs[0].token_ids
    plain = build_engine(num_blocks=24, block_size=8, max_num_seqs=2, max_model_len=192)
    plain.add_request("ref", _HEAD + [3, 4], greedy)
    assert got == plain.run()[0].outputs[0].token_ids
    stats = cache.tier_stats
    if prefetch == "wait":
        assert stats.disk_hits == len(_HEAD) // 8 and stats.late_reads == 0
    else:
        assert stats.disk_hits == 0 and stats.late_reads > 0
    engine.check_idle()
    engine.close()
    plain.close()


class _RaisesOnFirstSave:
    """A device side whose first round with saves raises before copying anything (the
    round fails); every later call goes through."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.raised = False

    def start_save_kv(self, plan: object) -> None:
        if plan.saves and not self.raised:  # type: ignore[attr-defined]
            self.raised = True
            raise RuntimeError("injected: the save copy failed to launch")
        self.inner.start_save_kv(plan)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_saves_of_a_failed_round_free_their_host_slots() -> None:
    engine = build_engine(num_blocks=24, block_size=8, max_num_seqs=2, max_model_len=192,
                          kv_tiers={"host_blocks": 64})
    runner = engine.runner.runner if hasattr(engine.runner, "runner") else engine.runner  # type: ignore[attr-defined]
    runner.kv_transfer = _RaisesOnFirstSave(runner.kv_transfer)
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    engine.add_request("publishes", _HEAD + [1, 2], greedy)
    engine.run()  # its blocks' saves are queued for the next round
    engine.add_request("fails", _OTHERS[0], greedy)  # its round carries them, and raises
    outs = {o.request_id: o.outputs[0] for o in engine.run()}
    assert runner.kv_transfer.raised and outs["fails"].finish_reason in ("error", "length")  # retried or failed
    engine.add_request("after", _OTHERS[1], greedy)
    assert engine.run()[0].outputs[0].finish_reason == "length"  # the engine serves on
    push_kv_down(engine)
    host = engine.cache.connector.host  # type: ignore[attr-defined]
    saving = [s for s in range(host.capacity) if host.key(s) is not None and not host.is_ready(s)]
    assert saving == []  # the failed round's saves never ran: their slots are free again
    engine.check_idle()
    engine.close()
