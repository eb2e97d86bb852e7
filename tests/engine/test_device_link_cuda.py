"""The device link's CUDA paths (run by scripts/device_check_correctness.sh): send slots
filled by gathers on the runner's stream and settled by an event, landing slots filled by
a copy synchronised on its stream, loads scattered on the runner's stream before the
forward — under the overlapped executor CUDA engines use by default, on one GPU and (with
two) from one GPU to another by a peer copy. Tokens equal one engine's on the same GPU."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from deepinfer_kit.components import Components
from deepinfer_kit.disagg import build_device_disaggregated
from deepinfer_kit.disagg.device_link import link_connector, link_loopback
from deepinfer_kit.engine.build import build_engine
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.sample.params import SamplingParams

pytestmark = pytest.mark.cuda

_RNG = random.Random(23)
_HEADS = [[_RNG.randrange(250) for _ in range(40)] for _ in range(3)]
_PROMPTS = [_HEADS[i % 3] + [_RNG.randrange(250) for _ in range(_RNG.randrange(1, 30))] for i in range(8)]
_CFG = EngineConfig(num_blocks=48, block_size=8, max_num_seqs=3, max_model_len=256, device="cuda")


def _params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=5, temperature=0.0) if i % 2 else SamplingParams(max_tokens=5, temperature=1.0,
                                                                                      seed=i)


def _reference(**kw: Any) -> dict[str, list[int]]:
    engine = build_engine(_CFG, **kw)
    for i, p in enumerate(_PROMPTS):
        engine.add_request(str(i), p, _params(i))
    out = {o.request_id: list(o.outputs[0].token_ids) for o in engine.run()}
    engine.close()
    return out


def _pair(**sides: Any) -> None:
    pair = build_device_disaggregated(_CFG, send_slots=32, landing_slots=128, **sides)
    for i, p in enumerate(_PROMPTS):
        pair.add_request(str(i), p, _params(i))
    outputs = pair.run()
    assert {o.request_id: list(o.outputs[0].token_ids) for o in outputs} == _reference()
    full = sum((len(p) - 1) // 8 for p in _PROMPTS)
    assert link_connector(pair.prefill).stats.saved_host == full
    assert link_connector(pair.decode).stats.late_reads == 0
    assert sum(o.num_cached_tokens for o in outputs) == 8 * full
    pair.prefill.check_idle()
    pair.decode.check_idle()
    pair.close()


def test_a_device_linked_pair_on_one_gpu_gives_one_engines_tokens() -> None:
    _pair()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_device_linked_pair_across_two_gpus_gives_one_engines_tokens() -> None:
    _pair(prefill={"device": "cuda:0"}, decode={"device": "cuda:1"})


def test_a_loopback_link_on_cuda_loads_what_it_sent() -> None:
    small = EngineConfig(num_blocks=16, block_size=8, max_num_seqs=1, max_model_len=128, device="cuda")
    outs: dict[str, list[int]] = {}  # the engine without the link first
    for kw in ({}, {"components": Components(kv_connector=link_loopback(b"l" * 32, landing_slots=64))}):
        engine = build_engine(small, **kw)
        got = {}
        for i, p in enumerate(_PROMPTS):
            engine.add_request(str(i), p[:100], _params(i))
            got.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.run()})
        if kw:
            assert got == outs and link_connector(engine).stats.host_hits > 0
            engine.check_idle()
        outs = got
        engine.close()
