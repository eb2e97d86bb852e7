"""Fault and load: hundreds of mixed requests through a small pool, with aborts and forks."""

from __future__ import annotations

import random

import attrs
import pytest

from deepinfer_kit import BuildContext, CompletionOutput, Components, ConfigError, Engine, Factory, RequestOutput, SamplingParams, build_engine
from deepinfer_kit.cache.protocols import KVCacheManager
from deepinfer_kit.sched import ContinuousBatchScheduler, Scheduler, SchedulerConfig


@pytest.mark.parametrize("how", [{}, {"overlap": True}, {"overlap": True, "worker": "process"}],
                         ids=["sync", "overlap", "overlap-worker-process"])
def test_mixed_load_with_aborts_and_forks_loses_nothing(how: dict[str, object]) -> None:
    rng = random.Random(0)
    engine = build_engine(num_blocks=48, block_size=8, max_model_len=160, max_num_seqs=32,
                          max_num_batched_tokens=256, **how)  # type: ignore[arg-type]
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
    outs |= {out.request_id: out for out in engine.flush()}
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
    engine.close()


def test_same_seeds_same_results_across_runs() -> None:
    """A seeded sampled request gives the same tokens in any run, at any batch position and
    next to a twin with the same seed; different seeds give different tokens. Unseeded
    requests draw from the engine's generator, which is also seeded, so only sampling with
    explicit seeds in a different order (and twins within a batch) shows an ignored seed."""
    prompt = "one prompt for every seed"
    seeds = [0, 1, 2, 3, 4, 5]

    def once(order: list[int]) -> dict[int, list[list[int]]]:
        engine = build_engine(num_blocks=64, block_size=8, max_model_len=256)
        ids = {
            engine.add_request(None, prompt, SamplingParams(
                temperature=1.0, top_k=20, max_tokens=8, seed=s, ignore_eos=True)): s
            for s in order
        }
        got: dict[int, list[list[int]]] = {}
        for out in engine.run():
            got.setdefault(ids[out.request_id], []).append(out.outputs[0].token_ids)
        engine.check_idle()
        return got

    first = once(seeds + [0])  # seed 0 twice in one batch
    assert first[0][0] == first[0][1], "two requests with the same seed must agree"
    assert len({tuple(first[s][0]) for s in seeds}) == len(seeds), "different seeds must differ"
    second = once(seeds[::-1])
    assert {s: second[s][0] for s in seeds} == {s: first[s][0] for s in seeds}


def test_prompt_filling_the_pool_and_one_token_more() -> None:
    """The rule of docs/continuous_batching.md ("Requests that can never run"): a request
    whose KV, ``min(prompt + max_tokens, max_model_len) - 1`` positions, needs more blocks
    than the pool can never run (the scheduler finishes it with ``error``; the engine
    refuses it at ``add_request`` with a ConfigError naming ``num_blocks``); one whose
    prompt fits but whose ``prompt + max_tokens`` passes ``max_model_len`` runs and
    finishes with ``length`` at ``max_model_len`` tokens. Pool: 4 blocks of 8 = 32 slots."""
    greedy = {"temperature": 0.0, "ignore_eos": True}

    def run(engine: Engine) -> dict[str, CompletionOutput]:
        outs: dict[str, CompletionOutput] = {}
        for _ in range(100):  # a request that can never fit must not hang the engine
            outs |= {o.request_id: o.outputs[0] for o in engine.step()}
            if not engine.has_unfinished_requests():
                outs |= {o.request_id: o.outputs[0] for o in engine.flush()}
                engine.check_idle()
                return outs
        raise AssertionError(f"still unfinished after 100 steps; finished so far: {sorted(outs)}")

    def finish(engine: Engine, prompts: dict[str, tuple[int, int]]) -> dict[str, tuple[str | None, int]]:
        for rid, (prompt_len, max_tokens) in prompts.items():
            params = SamplingParams(max_tokens=max_tokens, **greedy)
            engine.add_request(rid, list(range(1, prompt_len + 1)), params)
        return {rid: (c.finish_reason, len(c.token_ids)) for rid, c in run(engine).items()}

    # max_model_len = the pool: build_engine never builds a pool smaller than max_model_len,
    # so here max_model_len is the binding limit.
    capped = build_engine(num_blocks=4, block_size=8, max_model_len=32)
    assert finish(capped, {"fits": (30, 2), "one-more": (31, 2)}) == {
        "fits": ("length", 2),  # 31 KV positions: 4 blocks
        "one-more": ("length", 1),  # stops at max_model_len = 32 tokens
    }

    # The scheduler allows 64 tokens, so the 4-block pool is the binding limit.
    def roomy(ctx: BuildContext) -> Scheduler:
        assert ctx.scheduler_config is not None and ctx.cache is not None
        return ContinuousBatchScheduler(attrs.evolve(ctx.scheduler_config, max_model_len=64), ctx.cache)

    pooled = build_engine(num_blocks=4, block_size=8, max_model_len=32, components=Components(scheduler=Factory(roomy)))
    # 31 + 3 - 1 = 33 KV positions: 5 blocks > 4
    with pytest.raises(ConfigError, match="num_blocks=4"):
        pooled.add_request("over", list(range(1, 32)), SamplingParams(max_tokens=3, **greedy))
    # 30 + 3 - 1 = 32 KV positions: exactly the 4 blocks
    assert finish(pooled, {"exact": (30, 3)}) == {"exact": ("length", 3)}
