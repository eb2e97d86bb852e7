"""``prompt_logprobs`` against transformers' log-softmax over the full prompt, with and
without chunked prefill, with the prefix cache on (no hits are taken), through
preemption and overlap; ``max_logprobs`` caps it; ``decoded_token`` is filled."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.errors import ConfigError

from hf_models import hf_logits


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(160) for _ in range(16)]
    return [shared + [rng.randrange(160) for _ in range(rng.randint(1, 20))] for _ in range(3)] + [
        [rng.randrange(160) for _ in range(n)] for n in (1, 2, 33)
    ]


CONFIGS = {
    "default": {},
    "chunked-prefill": {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 5},
    "tiny-chunks": {"max_num_batched_tokens": 8, "long_prefill_token_threshold": 1, "block_size": 4},
    "preemption": {"num_blocks": 12, "block_size": 4, "max_model_len": 40,
                   "max_num_batched_tokens": 8, "long_prefill_token_threshold": 4},
    "overlap": {"overlap": True, "max_num_batched_tokens": 16, "long_prefill_token_threshold": 7},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prompt_logprobs_equal_transformers(checkpoints: dict[str, tuple[Path, Any]], name: str) -> None:
    folder, model = checkpoints["qwen3"]
    prompts = _prompts(2)
    traces: list[Any] = []
    engine = build_engine(model=str(folder), **CONFIGS[name], trace=traces.append)
    # the shared prefix is cached first: the requests below must not take it
    engine.add_request(None, prompts[0], SamplingParams(max_tokens=1))
    engine.run()
    top = [3, 0, 5, 1, 2, 4]
    ids = [engine.add_request(None, p, SamplingParams(prompt_logprobs=k, max_tokens=8, ignore_eos=True,
                                                      temperature=0.0))
           for p, k in zip(prompts, top)]
    outs = {o.request_id: o for o in engine.run()}
    engine.check_idle()
    if name == "preemption":
        assert sum(len(t.preempted) for t in traces) > 0
    for rid, prompt, k in zip(ids, prompts, top):
        out = outs[rid]
        assert out.num_cached_tokens == 0
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        want = torch.log_softmax(hf_logits(model, prompt), dim=-1)
        for p in range(1, len(prompt)):
            entry = got[p]
            assert entry is not None
            row = want[p - 1]
            target = prompt[p]
            assert entry[target].logprob == pytest.approx(float(row[target]), abs=2e-4)
            assert entry[target].rank == int((row > row[target]).sum()) + 1
            best = row.topk(k).indices.tolist()
            assert set(entry) == {*best, target}
            for rank, t in enumerate(best, 1):
                assert entry[t].rank == rank
                assert entry[t].logprob == pytest.approx(float(row[t]), abs=2e-4)


def test_max_logprobs_caps_prompt_logprobs() -> None:
    engine = build_engine(model="tiny", max_logprobs=3)
    with pytest.raises(ConfigError, match=r"prompt_logprobs must be <= max_logprobs \(3\), got 4"):
        engine.add_request(None, [1, 2, 3], SamplingParams(prompt_logprobs=4))
    with pytest.raises(ConfigError, match=r"prompt_logprobs must be <= max_logprobs \(3\), got -1"):
        engine.add_request(None, [1, 2, 3], SamplingParams(prompt_logprobs=-1))
    rid = engine.add_request(None, [1, 2, 3], SamplingParams(prompt_logprobs=3, max_tokens=1))
    (out,) = engine.run()
    assert out.request_id == rid and out.prompt_logprobs is not None
    assert all(len(m) in (3, 4) for m in out.prompt_logprobs[1:])
    engine.check_idle()


def test_decoded_tokens_are_filled_and_plain_requests_get_none() -> None:
    engine = build_engine(model="tiny")
    tok = engine._builder.tokenizer
    assert tok is not None
    a = engine.add_request(None, "hello world", SamplingParams(prompt_logprobs=2, max_tokens=2))
    b = engine.add_request(None, "hello world", SamplingParams(max_tokens=2))
    outs = {o.request_id: o for o in engine.run()}
    maps = outs[a].prompt_logprobs
    assert maps is not None and outs[b].prompt_logprobs is None
    for m in maps[1:]:
        assert m is not None
        for t, lp in m.items():
            assert lp.decoded_token == tok.decode([t], skip_special_tokens=False)
    engine.check_idle()


def test_a_delta_stream_reports_prompt_logprobs_once_and_forks_share_them() -> None:
    from deepinfer_kit.sample.params import RequestOutputKind

    engine = build_engine(model="tiny")
    delta = SamplingParams(prompt_logprobs=1, max_tokens=3, output_kind=RequestOutputKind.DELTA)
    fork = SamplingParams(prompt_logprobs=1, max_tokens=3, n=3, temperature=1.0, seed=1)
    engine.add_request("d", [1, 2, 3, 4], delta)
    engine.add_request("f", [1, 2, 3, 4], fork)
    seen: list[int | None] = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "d":
                seen.append(None if out.prompt_logprobs is None else len(out.prompt_logprobs))
            else:
                final = out
    for out in engine.flush():
        final = out if out.request_id == "f" else final
    assert seen[0] == 4 and len(seen) > 1 and all(s is None for s in seen[1:])
    assert final is not None and len(final.outputs) == 3
    assert final.prompt_logprobs is not None and len(final.prompt_logprobs) == 4
    engine.check_idle()
