"""Speculative decoding with overlap: round k + 1 is planned while round k verifies its
drafts, the runner resolves where round k + 1 starts and drafts for it (RunnerDrafting).

The overlapped speculative engine gives the synchronous speculative engine's outputs token
for token (the same drafts from the same context, the same verify lengths, the same seeded
draws), greedy gives plain greedy, stops inside accepted runs and rollbacks leave the cache
as a plain run does, and aborts, preemption, forks, prefix hits, chunked prefill and
faults lose nothing, in one process and with the model in a worker process.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import attrs
import pytest

from deepinfer_kit import ConfigError, SamplingParams, build_engine
from deepinfer_kit.engine.runner_drafts import NEVER_SAMPLED, RunnerDrafting
from deepinfer_kit.engine.trace import StepTrace
from deepinfer_kit.request import Request
from deepinfer_kit.sched.records import SamplingRow, ScheduledChunk, SchedulePlan
from deepinfer_kit.spec.ngram import NgramDrafter
from deepinfer_kit.spec.planners import FixedPlanner
from deepinfer_kit.spec.records import SpecConfig, SpsCurve
from deepinfer_kit.step import StepResult
from differential import run_workload, workload
from faults import RunnerFaults, fail_commits, run_to_end

SMALL_POOL = {"num_blocks": 20, "block_size": 8, "max_model_len": 96, "max_num_seqs": 8,
              "max_num_batched_tokens": 64, "long_prefill_token_threshold": 24}
ROOMY = {"num_blocks": 200, "block_size": 8, "max_model_len": 96, "max_num_seqs": 16,
         "max_num_batched_tokens": 96}
SPECS = {
    "fixed": {"drafter": "ngram", "num_draft": 3},
    "threshold": {"drafter": "ngram", "num_draft": 4, "planner": "threshold", "threshold": 0.4},
}


def _traced(overlap: bool, **config: Any) -> tuple[Any, list[StepTrace]]:
    traces: list[StepTrace] = []
    engine = build_engine(overlap=overlap, **config)
    engine.trace = traces.append
    return engine, traces


@pytest.mark.parametrize("config", [ROOMY, SMALL_POOL], ids=["roomy", "preempting"])
@pytest.mark.parametrize("planner", sorted(SPECS))
def test_overlapped_speculation_equals_synchronous(planner: str, config: dict[str, Any]) -> None:
    """The differential workload (greedy, seeded sampling with penalties and min_tokens,
    forks, logprobs, stop ids, prefix hits, chunked prefill) token for token."""
    reqs = workload(7, 30)
    want, _ = run_workload(reqs, False, speculative=SPECS[planner], **config)
    engine, traces = _traced(True, speculative=SPECS[planner], **config)
    got, _ = run_workload(reqs, engine=engine)
    assert engine.executor.depth == 1
    assert got == want
    drafted = sum(t.num_drafted for t in traces)
    assert drafted > sum(t.num_accepted for t in traces) > 0
    if config is SMALL_POOL:
        assert any(t.preempted for t in traces)


def test_greedy_overlapped_speculation_equals_plain(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    """Every prompt, on the tiny MoE (the three planners, DSpark with a curve) and on a
    dense checkpoint."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    dspark = {"drafter": "ngram", "num_draft": 4, "planner": "dspark",
              "sps": SpsCurve((1, 8, 32), (100.0, 90.0, 30.0))}
    for model, vocab in (("tiny", 250), (str(checkpoints["qwen3"][0]), 100)):
        rng = random.Random(3)
        prompts = []
        for i in range(12):
            unit = [rng.randrange(1, vocab) for _ in range(rng.randint(2, 6))]
            prompts.append((unit * 12)[: rng.randint(8, 40)] if i % 3 else [rng.randrange(1, vocab) for _ in range(20)])
        reqs = [(f"g{i}", p, greedy) for i, p in enumerate(prompts)]
        config = dict(model=model, num_blocks=256, block_size=4, max_model_len=128)
        plain, _ = run_workload(reqs, False, **config)
        for spec in (SPECS["fixed"], SPECS["threshold"], dspark):
            engine, traces = _traced(True, speculative=spec, **config)
            got, _ = run_workload(reqs, engine=engine)
            assert got == plain, (model, spec)
            assert sum(t.num_accepted for t in traces) > 0


def test_stops_inside_accepted_runs_leave_the_cache_as_a_plain_run() -> None:
    """The tiny model's 2-cycle (171, 224) with either token as the stop, cut at several
    lengths: drafts are accepted, the stop ends the request while its next round is in
    flight, and the prefix cache ends up holding exactly what a plain run's holds."""
    base = [61, 200, 46, 189, 59, 18, 11, 99, 94, 63, 245, 107]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    loop, _ = run_workload([("b", base, greedy)], False, num_blocks=256, max_model_len=256)
    out = list(loop["b"][0][0])
    accepted_runs = 0
    for cut in range(30, 34):
        for stop in (171, 224):
            prompt = base + out[:cut]
            params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=(stop,))
            config = dict(num_blocks=512, block_size=2, max_model_len=256)
            want, plain = run_workload([("s", prompt, params)], False, **config)
            engine, traces = _traced(True, speculative={"num_draft": 8}, **config)
            got, _ = run_workload([("s", prompt, params)], engine=engine)
            assert got == want
            accepted_runs += sum(c.num_accepted > 1 for t in traces for c in t.chunks)
            seq = prompt + list(want["s"][0][0]) + [0]  # one probe per cache: it memoises keys
            hits = [e.cache.match_prefix(Request("probe", seq, SamplingParams())) for e in (engine, plain)]
            assert hits[0] == hits[1] > 0
            assert engine.cache.num_free_blocks == plain.cache.num_free_blocks
    assert accepted_runs


def test_blocks_cover_exactly_the_computed_tokens_after_every_step() -> None:
    """After each step (plan round k + 1, commit round k) a running sequence holds the
    blocks of its computed tokens and no more: the room its drafts were planned with and
    the over-reach of a chunk planned as if every draft were accepted are released."""
    engine = build_engine(overlap=True, speculative={"num_draft": 7}, num_blocks=128,
                          block_size=2, max_model_len=128)
    rng = random.Random(8)
    for i in range(6):
        unit = [rng.randrange(1, 250) for _ in range(3)]
        engine.add_request(f"r{i}", (unit * 10)[: 10 + i], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    sched: Any = engine.scheduler
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for req in sched.running:
            assert len(req.block_table) == -(-req.num_computed_tokens // 2), req.request_id
            checked += 1
    engine.flush()
    engine.check_idle()
    assert checked


@pytest.mark.parametrize("seed", [0, 1])
def test_aborts_at_every_step_leave_nothing_behind(seed: int) -> None:
    reqs = workload(seed, 24)
    spec = SPECS["fixed"]
    want, _ = run_workload(reqs, False, speculative=spec, **SMALL_POOL)
    rng = random.Random(seed)
    aborts: dict[int, list[str]] = {}
    for rid, _, _ in reqs:
        if rng.random() < 0.4:
            aborts.setdefault(rng.randrange(0, 30), []).append(rid)
    got, _ = run_workload(reqs, True, aborts=aborts, speculative=spec, **SMALL_POOL)
    for rid, comps in got.items():
        for (toks, reason, _), (want_toks, want_reason, _) in zip(comps, want[rid]):
            if reason == "abort":
                assert want_toks[: len(toks)] == toks
            else:
                assert (toks, reason) == (want_toks, want_reason), rid


@pytest.mark.parametrize("worker", ["inline", "process"])
def test_faults_lose_nothing(worker: str) -> None:
    """Forwards and samplers that raise and NaN rows in the runner, commits that raise on
    the host: every request ends with a reason and the engine ends idle."""
    faults = RunnerFaults(4, p_forward=0.06, p_sampler=0.05, p_nan=0.08)
    engine = build_engine(overlap=True, worker=worker, speculative=SPECS["fixed"], worker_setup=faults,
                          **SMALL_POOL)
    fail_commits(engine, 4, 0.05)
    _, reasons = run_to_end(engine, workload(9, 36))
    assert "error" in reasons
    engine.check_idle()
    engine.close()


def test_the_worker_process_drafts_and_equals_the_synchronous_engine() -> None:
    reqs = workload(5, 30)
    want, _ = run_workload(reqs, False, speculative=SPECS["threshold"], **SMALL_POOL)
    for overlap in (True, False):  # overlapped: the worker drafts; else the host does
        got, engine = run_workload(reqs, overlap, worker="process", speculative=SPECS["threshold"], **SMALL_POOL)
        assert got == want and engine.executor.depth == int(overlap)
        engine.close()


def test_what_cannot_be_combined_yet() -> None:
    with pytest.raises(ConfigError, match="drafter 'draft_model' cannot be combined with overlap=True"):
        build_engine(overlap=True, speculative={"drafter": "draft_model", "draft_model": "tiny", "num_draft": 2})
    with pytest.raises(ConfigError, match="drafter 'self' cannot be combined with worker='process'"):
        build_engine(worker="process", overlap=False, speculative={"drafter": "self", "draft_layers": 1})
    with pytest.raises(ConfigError, match="sps='profile' needs the model in the engine's process"):
        build_engine(worker="process", overlap=False, num_blocks=16, max_model_len=64,
                     speculative={"planner": "dspark", "sps": "profile"})


def _row() -> SamplingRow:
    return SamplingRow(SamplingParams(temperature=0.0), None, [5, 6, 7, 5, 6], None, False)


def test_the_runner_moves_a_chunk_by_the_drafts_rejected_before_it() -> None:
    """Round k verified 3 drafts of "a" and accepted 1 (2 tokens out), so round k + 1's
    chunk (planned as if all 3 were accepted) starts 2 positions lower and feeds the last
    token out; "b" continues from a round that produced nothing; "c" prefills."""
    drafting = RunnerDrafting(NgramDrafter(1, 3), FixedPlanner(3), 3)
    row = _row()
    first = SchedulePlan(0, [ScheduledChunk("a", 4, 4, [6], [0, 1], sampling=row, spec_token_ids=(7, 5, 6)),
                             ScheduledChunk("b", 4, 1, [6], [2], sampling=row)])
    drafting.record(first, StepResult(token_ids=[[7, 9], []]))
    nxt = SchedulePlan(1, [
        ScheduledChunk("a", 8, 4, [], [0, 1], sampling=row, num_placeholders=1, pending_drafts=3,
                       draft_room=3, output_position=4, output_token_ids=(6,)),
        ScheduledChunk("b", 5, 1, [], [2], sampling=row, num_placeholders=1),
        ScheduledChunk("c", 0, 3, [1, 2, 3], [3], sample=False),
    ])
    resolved, kept, errors = drafting.resolve(nxt)
    assert kept == [0, 2] and errors == [None, NEVER_SAMPLED, None]
    a = resolved.chunks[0]
    assert (a.start, a.token_ids, a.output_position, a.num_placeholders) == (6, [9], 2, 0)
    assert a.output_token_ids == (6, 7, 9)
    # context [5, 6, 7, 5, 6] + [6, 7, 9]: no earlier 9, "9" has no n-gram match -> no drafts
    assert a.spec_token_ids == () and a.num_tokens == 1
    merged = RunnerDrafting.merge(StepResult(token_ids=[[4], []]), kept, errors)
    assert merged.token_ids == [[4], [], []] and merged.errors == [None, NEVER_SAMPLED, None]
    assert attrs.evolve(resolved.chunks[1]) is not resolved.chunks[1]  # records copied, not shared
