"""Fault and load: hundreds of mixed requests through a small pool, with aborts and forks."""

from __future__ import annotations

import random

from deepinfer_kit import Engine, RequestOutput, SamplingParams, build_engine


def test_mixed_load_with_aborts_and_forks_loses_nothing() -> None:
    rng = random.Random(0)
    engine = build_engine(num_blocks=48, block_size=8, max_model_len=160, max_num_seqs=32,
                                max_num_batched_tokens=256)
    expected: dict[str, tuple[int, int]] = {}
    to_abort: set[str] = set()
    for i in range(220):
        n = 2 if i % 9 == 0 else 1
        max_tokens = rng.randint(1, 24)
        prompt = [rng.randrange(1, 250) for _ in range(rng.randint(1, 60))]
        if i % 5 == 0:  # shared prefixes
            prompt = [7] * 24 + prompt[:10]
        params = SamplingParams(n=n, temperature=0.9 if n > 1 else 0.0, max_tokens=max_tokens,
                                ignore_eos=True, seed=i if n > 1 else None)
        rid = engine.add_request(f"r{i}", prompt, params)
        expected[rid] = (n, max_tokens)
        if rng.random() < 0.1:
            to_abort.add(rid)
    outs: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        steps += 1
        if steps == 3 or steps % 7 == 0:  # abort in every state: waiting, mid-prefill, decoding
            for rid in list(to_abort)[:5]:
                engine.abort(rid)
                to_abort.discard(rid)
        assert steps < 5000, "the engine must not hang"
    assert set(outs) == set(expected)
    for rid, (n, max_tokens) in expected.items():
        completions = outs[rid].outputs
        assert len(completions) == n
        for c in completions:
            if c.finish_reason == "abort":
                assert len(c.token_ids) <= max_tokens
            else:
                assert c.finish_reason == "length", (rid, c.finish_reason)
                assert len(c.token_ids) == max_tokens
    assert any(c.finish_reason == "abort" for o in outs.values() for c in o.outputs)
    engine.check_idle()


def test_same_seeds_same_results_across_runs() -> None:
    def once() -> list[list[int]]:
        engine = build_engine(num_blocks=64, block_size=8, max_model_len=256)
        params = [SamplingParams(temperature=1.0, top_k=20, max_tokens=8, seed=s, ignore_eos=True) for s in range(6)]
        ids = [engine.add_request(None, f"prompt {s}", p) for s, p in enumerate(params)]
        outs = {o.request_id: o for o in engine.run()}
        return [outs[i].outputs[0].token_ids for i in ids]

    assert once() == once()


def test_prompt_filling_the_pool_and_one_token_more() -> None:
    engine = build_engine(num_blocks=4, block_size=8, max_model_len=32)
    fits = engine.add_request("fits", list(range(1, 31)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    too_long = engine.add_request("too-long", list(range(1, 32)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    outs = {o.request_id: o for o in engine.run()}
    assert len(outs[fits].outputs[0].token_ids) == 2
    assert outs[too_long].outputs[0].finish_reason in ("length", "error")
    engine.check_idle()
