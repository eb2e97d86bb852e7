"""``logprobs=-1`` / ``prompt_logprobs=-1`` (the whole vocabulary) with vLLM's cap rule:
allowed when ``max_logprobs`` is ``-1`` (no cap) or at least the vocabulary size; a row
asking for fewer alternatives in the same batch copies back only those."""

from __future__ import annotations

import math
import random

import pytest
import torch

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.engine.runner.step_outputs import asked_top
from deepinfer_kit.errors import ConfigError


def _vocab(engine: object) -> int:
    return int(engine._builder.vocab_size)  # type: ignore[attr-defined]


@pytest.mark.parametrize("cap", ["unlimited", "vocab"])
def test_whole_vocabulary_rows_hold_every_token_ranked(cap: str) -> None:
    probe = build_engine(model="tiny")
    v = _vocab(probe)
    engine = build_engine(model="tiny", max_logprobs=-1 if cap == "unlimited" else v)
    prompt = [5, 9, 17, 33, 2]
    whole = engine.add_request(None, prompt, SamplingParams(
        logprobs=-1, prompt_logprobs=-1, max_tokens=3, temperature=0.0, ignore_eos=True))
    top = engine.add_request(None, prompt, SamplingParams(
        logprobs=4, prompt_logprobs=4, max_tokens=3, temperature=0.0, ignore_eos=True))
    outs = {o.request_id: o for o in engine.run()}
    engine.check_idle()
    full, few = outs[whole], outs[top]
    maps = full.outputs[0].logprobs
    assert maps is not None and len(maps) == 3
    prompt_maps = full.prompt_logprobs
    assert prompt_maps is not None and prompt_maps[0] is None
    for entry in [*maps, *prompt_maps[1:]]:
        assert entry is not None and set(entry) == set(range(v))
        by_rank = sorted(entry.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in by_rank][:2] == [1, 2]
        assert [lp.logprob for lp in by_rank] == sorted((lp.logprob for lp in by_rank), reverse=True)
        assert math.fsum(math.exp(lp.logprob) for lp in entry.values()) == pytest.approx(1.0, abs=1e-4)
        assert all(lp.decoded_token is not None for lp in entry.values())
    # the top-4 request reads the same numbers, and only its top 4 (plus the chosen one)
    assert few.outputs[0].token_ids == full.outputs[0].token_ids
    small = few.outputs[0].logprobs
    assert small is not None
    for big, little in zip(maps, small):
        assert 4 <= len(little) <= 5
        for t, lp in little.items():
            assert lp.logprob == pytest.approx(big[t].logprob, abs=1e-5) and lp.rank == big[t].rank


def test_minus_one_is_refused_under_a_smaller_cap() -> None:
    engine = build_engine(model="tiny")  # max_logprobs 20, as vLLM
    v = _vocab(engine)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ConfigError, match=rf"{name} must be <= max_logprobs \(20\), got -1 "
                                              rf"\(the whole vocabulary, {v} tokens\)"):
            engine.add_request(None, [1, 2, 3], SamplingParams(**{name: -1}))
    small = build_engine(model="tiny", max_logprobs=v - 1)
    with pytest.raises(ConfigError, match="logprobs must be <= max_logprobs"):
        small.add_request(None, [1, 2, 3], SamplingParams(logprobs=-1))
    unlimited = build_engine(model="tiny", max_logprobs=-1)
    unlimited.add_request(None, [1, 2, 3], SamplingParams(logprobs=v, max_tokens=1))
    with pytest.raises(ConfigError, match=rf"logprobs must be <= max_logprobs \(-1: the vocabulary size, {v}\)"):
        unlimited.add_request(None, [1, 2, 3], SamplingParams(logprobs=v + 1))
    assert len(unlimited.run()) == 1
    unlimited.check_idle()
    engine.check_idle()


@pytest.mark.parametrize("seed", range(20))
def test_asked_top_keeps_each_rows_prefix(seed: int) -> None:
    rng = random.Random(seed)
    n, k = rng.randint(1, 6), rng.randint(1, 9)
    ids = torch.randint(0, 100, (n, k))
    lps = torch.randn(n, k)
    wants = [rng.choice([0, k, rng.randint(0, k)]) for _ in range(n)]
    flat_ids, flat_lp, starts = asked_top(ids, lps, wants)
    assert starts[0] == 0 and len(starts) == n + 1
    for r in range(n):
        got = flat_ids[starts[r]:starts[r + 1]].tolist()
        assert got == ids[r, :wants[r]].tolist()
        assert flat_lp[starts[r]:starts[r + 1]].tolist() == lps[r, :wants[r]].tolist()


@pytest.mark.cuda
def test_asked_top_never_makes_the_host_wait_on_cuda() -> None:
    ids = torch.randint(0, 100, (4, 7), device="cuda")
    lps = torch.randn(4, 7, device="cuda")
    wants = [0, 7, 3, 5]
    torch.cuda.set_sync_debug_mode("error")
    try:
        flat_ids, flat_lp, starts = asked_top(ids, lps, wants)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for r in range(4):
        assert flat_ids[starts[r]:starts[r + 1]].tolist() == ids[r, :wants[r]].tolist()
        assert flat_lp[starts[r]:starts[r + 1]].tolist() == lps[r, :wants[r]].tolist()
