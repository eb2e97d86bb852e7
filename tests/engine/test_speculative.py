"""Speculative decoding in the engine: n-gram drafts verified as chunks of the plan.

Greedy speculative output equals plain greedy on every prompt (dense checkpoint and the
tiny MoE), through chunked prefill, prefix caching, preemption, stops and penalties;
seeded sampling with forks and logprobs too; rejected drafts leave the cache exactly as a
plain run does.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.engine.trace import StepTrace
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.request import Request
from deepinfer_kit.spec.records import SpecConfig, SpsCurve


def _prompts(seed: int, vocab: int, count: int) -> list[list[int]]:
    """Repetitive prompts (drafts get accepted) and random ones (drafts get rejected)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        if i % 3 == 2:
            out.append([rng.randrange(vocab) for _ in range(rng.randint(3, 30))])
        else:
            unit = [rng.randrange(vocab) for _ in range(rng.randint(2, 6))]
            out.append((unit * 12)[: rng.randint(8, 40)])
    return out


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
         traces: list[StepTrace] | None = None) -> dict[str, list[list[int]]]:
    if traces is not None:
        engine.subscribe(traces.append)
    ids = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    outs = {o.request_id: o for o in engine.run()}
    engine.check_idle()
    return {i: [c.token_ids for c in outs[i].outputs] for i in ids}


def _cached_tokens(engine: Engine, sequences: list[list[int]]) -> list[int]:
    """How much of each sequence the prefix cache holds (its published contents); one
    more token is appended, as a hit always leaves a token to compute."""
    return [engine.cache.match_prefix(Request(f"probe{i}", s + [0], SamplingParams()))
            for i, s in enumerate(sequences)]


SPECS = {
    "fixed": SpecConfig(num_draft=4),
    "threshold": SpecConfig(num_draft=5, planner="threshold", threshold=0.4),
    "dspark": SpecConfig(num_draft=4, planner="dspark",
                         sps=SpsCurve((1, 8, 32), (100.0, 90.0, 30.0))),
}


def _compare(model: str, spec: SpecConfig, params: list[SamplingParams], prompts: list[list[int]],
             same_cache: bool = True, **config: Any) -> tuple[list[StepTrace], Engine, Engine]:
    """Outputs equal a plain run's; with ``same_cache`` (a pool that never evicts) so do
    the prefix cache's contents and the free block count afterwards."""
    plain = build_engine(model=model, **config)
    fast = build_engine(model=model, speculative=spec, **config)
    traces: list[StepTrace] = []
    want = _run(plain, prompts, params)
    got = _run(fast, prompts, params, traces)
    assert got == want
    if not same_cache:
        return traces, plain, fast
    assert not any(t.blocks_evicted for t in traces)
    sequences = [p + out[0] for p, out in zip(prompts, want.values())]
    assert _cached_tokens(fast, sequences) == _cached_tokens(plain, sequences)
    assert fast.cache.num_free_blocks == plain.cache.num_free_blocks
    return traces, plain, fast


@pytest.mark.parametrize("planner", sorted(SPECS))
def test_greedy_speculative_equals_plain_on_the_moe_model(planner: str) -> None:
    prompts = _prompts(1, 256, 12)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
    traces, _, _ = _compare("tiny", SPECS[planner], params, prompts, num_blocks=96,
                            max_model_len=256, block_size=8)
    drafted = sum(t.num_drafted for t in traces)
    accepted = sum(t.num_accepted for t in traces)
    assert drafted > accepted > 0  # some drafts accepted, some rolled back


def test_greedy_speculative_equals_plain_on_a_dense_checkpoint(
    checkpoints: dict[str, tuple[Path, Any]]
) -> None:
    folder, _ = checkpoints["qwen3"]
    prompts = _prompts(2, 100, 12)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                             repetition_penalty=1.2 if i % 4 == 1 else 1.0)
              for i in range(len(prompts))]
    traces, _, _ = _compare(str(folder), SPECS["fixed"], params, prompts, num_blocks=256,
                            block_size=4, max_model_len=128)
    assert sum(t.num_accepted for t in traces) > 0


def test_chunked_prefill_prefix_caching_preemption_and_stops() -> None:
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(20)]
    prompts = [shared + p for p in _prompts(3, 256, 10)]
    params = []
    for i in range(len(prompts)):
        stop = (7, 9) if i % 2 else ()
        params.append(SamplingParams(temperature=0.0, max_tokens=rng.randint(5, 30),
                                     stop_token_ids=stop, ignore_eos=True))
    traces, _, _ = _compare("tiny", SpecConfig(num_draft=6), params, prompts, False, num_blocks=20,
                               block_size=4, max_model_len=80, max_num_batched_tokens=24)
    assert any(t.preempted for t in traces), "the small pool must force preemption"
    assert any(t.prefix_hit_tokens for t in traces)
    assert sum(t.num_accepted for t in traces) > 0


def _looping_prompt() -> tuple[list[int], int]:
    """A prompt ending in the tiny model's own greedy loop (it repeats one token), so the
    n-gram drafts of its continuation are accepted; returns it and the looping token."""
    prompt = [5, 6, 7, 8] * 8
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    out = _run(build_engine(num_blocks=256, max_model_len=256), [prompt], [greedy])["r0"][0]
    assert out[-1] == out[-2] == out[-3]
    return prompt + out, out[-1]


def test_stops_inside_an_accepted_run_drop_what_follows() -> None:
    """Prompts ending in the tiny model's 2-cycle (171, 224), cut at several lengths so
    the stop position has either parity against 2-token blocks, with either cycle token
    as the stop: the cycle's drafts are accepted, the first stop token ends the request
    and the accepted drafts after it are dropped; the published blocks end where a plain
    run's do."""
    base = [61, 200, 46, 189, 59, 18, 11, 99, 94, 63, 245, 107]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    out = _run(build_engine(num_blocks=256, max_model_len=256), [base], [greedy])["r0"][0]
    assert out[-6:] == [224, 171] * 3, out  # the embedded model's loop (fixed seed)
    traces = []
    for cut in range(30, 34):  # one engine pair each: no request publishes another's blocks
        for stop in (171, 224):
            params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                    stop_token_ids=(stop,))
            traces += _compare("tiny", SpecConfig(num_draft=8), [params], [base + out[:cut]],
                               num_blocks=512, block_size=2, max_model_len=256)[0]
    assert any(c.num_accepted > 1 and c.sampled[0] in (171, 224) for t in traces for c in t.chunks)


def test_seeded_sampling_forks_penalties_and_logprobs_match_plain() -> None:
    loop_prompt, _ = _looping_prompt()
    prompts = _prompts(4, 256, 4) + [loop_prompt] * 4
    params = [SamplingParams(temperature=0.3, seed=i, max_tokens=16, n=2 if i % 2 else 1,
                             frequency_penalty=0.3 if i % 3 else 0.0, logprobs=2, ignore_eos=True)
              for i in range(len(prompts))]
    config: dict[str, Any] = dict(num_blocks=256, max_model_len=256, block_size=4)
    traces: list[StepTrace] = []
    plain, fast = build_engine(**config), build_engine(speculative={"num_draft": 3}, trace=traces.append, **config)
    outs: list[dict[str, Any]] = []
    for engine in (plain, fast):
        ids = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        done = {o.request_id: o for o in engine.run()}
        engine.check_idle()
        outs.append({i: done[i] for i in ids})
    assert sum(t.num_accepted for t in traces) > 0
    for rid, want in outs[0].items():
        got = outs[1][rid]
        for a, b in zip(want.outputs, got.outputs):
            assert a.token_ids == b.token_ids
            assert a.logprobs is not None and b.logprobs is not None
            assert len(b.logprobs) == len(b.token_ids)
            for la, lb in zip(a.logprobs, b.logprobs):
                assert la.keys() == lb.keys()
                assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)


def test_rejected_drafts_give_their_blocks_back_every_round() -> None:
    """After every commit a running sequence holds exactly the blocks of its computed
    tokens: the blocks allocated for rejected drafts were released at once."""
    engine = build_engine(speculative={"num_draft": 7}, num_blocks=128, block_size=2,
                          max_model_len=128)
    for i, p in enumerate(_prompts(8, 256, 6)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    sched: Any = engine.scheduler
    rolled_back = 0
    while engine.has_unfinished_requests():
        engine.step()
        for req in sched.running:
            assert len(req.block_table) == -(-req.num_computed_tokens // 2), req.request_id
            rolled_back += 1
    engine.flush()
    engine.check_idle()
    assert rolled_back


def test_a_repetitive_prompt_accepts_several_tokens_per_round() -> None:
    prompt = list(b"the cat sat on the mat. " * 6)
    traces: list[StepTrace] = []
    engine = build_engine(speculative={"num_draft": 4}, num_blocks=64, max_model_len=256)
    _run(engine, [prompt], [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)], traces)
    rounds = [c for t in traces for c in t.chunks if c.num_drafted]
    assert rounds
    mean = sum(len(c.sampled) for c in rounds) / len(rounds)
    assert mean > 1.0


def test_speculation_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown keys"):
        build_engine(speculative={"gamma": 2})
    with pytest.raises(ConfigError, match="drafter"):
        build_engine(speculative={"drafter": "eagle"})


def test_static_decode_rounds_and_verify_rounds_mix() -> None:
    """Rounds without drafts may take the static (padded) decode path; verify rounds run
    eagerly; the output is still plain greedy's."""
    prompts = _prompts(6, 256, 8)
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * len(prompts)
    traces, _, _ = _compare("tiny", SpecConfig(num_draft=3, planner="threshold", threshold=0.6),
                            params, prompts, num_blocks=128, max_model_len=128, static_decode=True)
    assert any(t.num_drafted for t in traces) and any(
        not t.num_drafted and all(c.kind == "decode" for c in t.chunks) for t in traces)


def test_request_metrics_count_drafts_and_accepted_tokens() -> None:
    """A request's metrics add up its verify rounds as the step traces record them; a
    plain run counts nothing."""
    prompt = list(b"the cat sat on the mat. " * 6)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    traces: list[StepTrace] = []
    engine = build_engine(speculative={"num_draft": 4}, num_blocks=64, max_model_len=256, trace=traces.append)
    engine.add_request("r", prompt, params)
    out = {o.request_id: o for o in engine.run()}["r"]
    drafted = sum(c.num_drafted for t in traces for c in t.chunks)
    accepted = sum(c.num_accepted for t in traces for c in t.chunks)
    assert out.metrics is not None and drafted > 0
    assert (out.metrics.num_draft_tokens, out.metrics.num_accepted_tokens) == (drafted, accepted)
    assert 0 < accepted <= drafted
    plain = build_engine(num_blocks=64, max_model_len=256)
    plain.add_request("r", prompt, params)
    metrics = plain.run()[0].metrics
    assert metrics is not None and metrics.num_draft_tokens == metrics.num_accepted_tokens == 0


@pytest.mark.parametrize("drafter", [{"drafter": "self", "draft_layers": 1}, {"drafter": "ngram"}])
def test_a_request_about_to_fork_gets_no_drafts(drafter: dict[str, object]) -> None:
    """Chunked prefill can leave an ``n > 1`` request's last prompt token alone in its own
    chunk: the sequence then looks like a decode to the drafter, but that chunk forks, and
    a forking chunk cannot verify drafts (it failed the round, and every request in it)."""
    engine = build_engine(speculative={**drafter, "num_draft": 3}, num_blocks=64, block_size=8,
                          max_model_len=128, long_prefill_token_threshold=8)
    prompt = [5, 6, 7, 8] * 4 + [5]  # 17 tokens: chunks of 8, 8 and the last one
    engine.add_request("fork", prompt, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6))
    engine.add_request("other", prompt, SamplingParams(temperature=0.0, max_tokens=6))
    outs = engine.run()
    assert [c.finish_reason for o in outs for c in o.outputs] == ["length"] * 3
    engine.check_idle()
