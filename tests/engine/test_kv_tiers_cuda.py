"""The KV tiers' CUDA paths (run by scripts/device_check_correctness.sh, which collects every
``cuda`` test): the pinned host slab, saves gathered on the device and copied to the host
without blocking (an event settles them), loads staged in pinned memory and scattered on
the runner's stream before the forward, or layer by layer on a stream of their own that the
forward waits on per layer (``layerwise_loads``) — under the overlapped executor CUDA engines use by
default, and in a worker process over a shared-memory slab. Tokens equal the device-only
engine's; a round trip through the host slab is byte for byte."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.cache.tiers.host_worker import HostTransferWorker, host_slab
from deepinfer_kit.cache.tiers.records import TransferPlan
from tier_workload import serve_one_at_a_time, tier_prompts

pytestmark = pytest.mark.cuda

_, _PROMPTS, _ = tier_prompts(5, 4, 12)


def _serve(**kw: Any) -> tuple[dict[str, list[int]], Any]:
    return serve_one_at_a_time(_PROMPTS, device="cuda", **kw)


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole-round"])
@pytest.mark.parametrize("engine", [{}, {"overlap": False}, {"worker": "process"}],
                         ids=["overlapped", "synchronous", "worker-process"])
def test_tokens_equal_the_device_only_engine_on_cuda(engine: dict[str, Any], layerwise: bool, tmp_path: Path) -> None:
    reference, _ = _serve(**engine)
    got, stats = _serve(kv_tiers={"host_blocks": 12, "disk_blocks": 120, "disk_path": str(tmp_path),
                                  "layerwise_loads": layerwise}, **engine)
    assert got == reference
    assert stats.loaded_tokens > 0 and stats.host_hits + stats.disk_hits > 0


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole-round"])
def test_a_round_trip_through_the_pinned_slab_is_exact(layerwise: bool) -> None:
    kv = PagedKVCache(3, 8, 4, 2, 16, dtype=torch.bfloat16, device="cuda")
    for layer in range(3):
        kv.write_blocks(layer, torch.arange(8, device="cuda"),
                        torch.randn((8, *kv.block_shape[1:]), dtype=torch.bfloat16, device="cuda"))
    before = [kv.read_blocks(layer, torch.tensor([1, 2], device="cuda")).clone() for layer in range(3)]
    slab = host_slab(kv, 4)
    assert slab.is_pinned()
    worker = HostTransferWorker(kv, slab, layerwise=layerwise)
    # One round saves blocks 1 and 2 into slots 0 and 3 and loads slot 3 into block 5 (a
    # load reading a slot the same round saves: settled first); the next loads slot 0.
    worker.start_save_kv(TransferPlan(saves=[(1, 0), (2, 3)]))
    worker.start_load_kv(TransferPlan(loads=[(3, 5)]))
    worker.wait_for_load()
    assert sorted(worker.get_finished().saved) == [0, 3]  # type: ignore[union-attr]
    worker.start_load_kv(TransferPlan(loads=[(0, 6)]))
    for layer in range(3):  # the forward's stream waits per layer (layerwise) or not at all
        worker.wait_for_layer_load(layer)
        assert torch.equal(kv.read_blocks(layer, torch.tensor([6], device="cuda")), before[layer][:1])
    worker.wait_for_load()
    worker.get_finished()
    torch.cuda.synchronize()
    for layer in range(3):
        got = kv.read_blocks(layer, torch.tensor([6, 5], device="cuda"))
        assert torch.equal(got, before[layer])


def test_hybrid_tiers_on_cuda(tmp_path: Path) -> None:
    """The tiers under the hybrid cache on the device (every layer waits on the load
    stream's events; a sliding layer's rows go to its group's blocks; the Triton kernels
    read the group tables): a prefix pushed out of the pool and loaded back with its
    windows, layer by layer and whole, gives the tokens of the same engine without tiers."""
    import random
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from hf_models import five_to_one

    from deepinfer_kit import SamplingParams, build_engine
    from deepinfer_kit.cache.tiers.manager import tiered

    five_to_one(tmp_path, 3, 5)
    rng = random.Random(12)
    prefix = [rng.randrange(160) for _ in range(40)]
    prompts = [prefix + [1, 2, 3]] + [[rng.randrange(160) for _ in range(60)] for _ in range(3)] + [prefix + [4, 5]]
    runs = []
    for tiers in (None, {"host_blocks": 64}, {"host_blocks": 64, "layerwise_loads": False}):
        engine = build_engine(model=str(tmp_path), device="cuda", block_size=4, max_num_seqs=2, num_blocks=24,
                              max_num_batched_tokens=64, max_model_len=96, kv_tiers=tiers)
        out = []
        for p in prompts:
            engine.add_request(None, p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
            out += [list(o.outputs[0].token_ids) for o in engine.run()]
        cache = tiered(engine.cache)
        loaded = cache.tier_stats.loaded_tokens if cache is not None else 0
        replays = engine.cache.window_stats.replays  # type: ignore[attr-defined]
        engine.check_idle()
        engine.close()
        runs.append((out, loaded, replays))
    plain = runs[0][0]
    for out, loaded, replays in runs[1:]:
        assert out == plain and loaded == 40 and replays == 0
