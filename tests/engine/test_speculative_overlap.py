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

from deepinfer_kit import Components, ConfigError, Factory, SamplingParams, build_engine
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.engine.runner.drafting import RunnerDrafting
from deepinfer_kit.engine.runner.token_slots import NEVER_SAMPLED
from deepinfer_kit.spec.speculation import Speculation
from deepinfer_kit.engine.trace import StepTrace, token_timeline
from deepinfer_kit.request import Request
from deepinfer_kit.sched.records import SamplingRow, ScheduledChunk, SchedulePlan
from deepinfer_kit.spec.drafters.ngram import NgramDrafter
from deepinfer_kit.spec.planners import FixedPlanner
from deepinfer_kit.spec.records import SpsCurve
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
    engine = build_engine(overlap=overlap, **config, trace=traces.append)
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
    for overlap in (True, False):  # the worker drafts either way (synchronous: without token slots)
        got, engine = run_workload(reqs, overlap, worker="process", speculative=SPECS["threshold"], **SMALL_POOL)
        assert got == want and engine.executor.depth == int(overlap)
        engine.close()


def test_a_scheduler_without_draft_room_is_refused_for_runner_drafting() -> None:
    from deepinfer_kit.sched.continuous import ContinuousBatchScheduler

    class NoRoom:  # a scheduler of someone else's: everything but reserve_drafts
        def __init__(self, ctx: Any) -> None:
            self._inner = ContinuousBatchScheduler(ctx.scheduler_config, ctx.cache)

        def __getattr__(self, name: str) -> Any:
            if name == "reserve_drafts":
                raise AttributeError(name)
            return getattr(self._inner, name)

    with pytest.raises(ConfigError, match="needs a scheduler with reserve_drafts"):
        build_engine(overlap=True, speculative=SPECS["fixed"], components=Components(scheduler=Factory(NoRoom)),
                     **ROOMY)


def _row() -> SamplingRow:
    return SamplingRow(SamplingParams(temperature=0.0), None, [5, 6, 7, 5, 6], None, False)


def test_the_runner_moves_a_chunk_by_the_drafts_rejected_before_it() -> None:
    """Round k verified 3 drafts of "a" and accepted 1 (2 tokens out), so round k + 1's
    chunk (planned as if all 3 were accepted) starts 2 positions lower and feeds the last
    token out; "b" continues from a round that produced nothing; "c" prefills."""
    drafting = RunnerDrafting(Speculation(NgramDrafter(1, 3), FixedPlanner(3), 3))
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


def test_the_planner_sizes_the_round_with_every_token_it_does_not_draft_for() -> None:
    """The round's other tokens are the prefill chunks' and the decode chunks' that have no
    draft room (one each): a planner told only the prefill undercounts the round and fills
    a captured size that the round then overflows."""
    seen: list[int] = []

    class Spy(FixedPlanner):
        def plan(self, confidence: Any, max_lengths: Any, other_tokens: int = 0) -> list[int]:
            seen.append(other_tokens)
            return super().plan(confidence, max_lengths, other_tokens)

    drafting = RunnerDrafting(Speculation(NgramDrafter(1, 3), Spy(3), 3))
    row = _row()
    plan = SchedulePlan(0, [
        ScheduledChunk("a", 4, 1, [6], [0], sampling=row, draft_room=3, output_token_ids=(6,)),
        ScheduledChunk("b", 4, 1, [6], [1], sampling=row),  # a decode without room
        ScheduledChunk("c", 0, 5, [1, 2, 3, 4, 5], [2], sample=False),  # a prefill
    ])
    drafting.resolve(plan)
    assert seen == [6]


def test_a_late_step_holds_its_slots_from_prepare_on() -> None:
    """The layout of a LateStep runs on the executor's thread, while the host commits the
    round before and releases its slots: the host's prepare must lease them, or a release
    could free a slot the late layout is about to use (and race on the lease tables)."""
    engine = build_engine(overlap=True, speculative=SPECS["fixed"], **ROOMY)
    runner, slots = engine.runner, engine.runner.token_slots
    prepare = runner.prepare
    seen: list[int] = []

    def checked(plan: SchedulePlan, **kw: Any) -> Any:
        step = prepare(plan, **kw)
        for c in plan.chunks:
            if c.sample:
                assert slots._newest[c.request_id] == plan.step_id, c.request_id
                seen.append(plan.step_id)
        return step

    runner.prepare = checked
    for rid, prompt, params in workload(11, 6):
        engine.add_request(rid, prompt, params)
    engine.run()
    assert len(set(seen)) > 5
    engine.check_idle()


MODEL_DRAFTERS = {
    "self": {"drafter": "self", "draft_layers": 1, "num_draft": 3},
    "draft_model": {"drafter": "draft_model", "draft_model": "tiny", "num_draft": 3},
}


@pytest.mark.parametrize("drafter", sorted(MODEL_DRAFTERS))
def test_model_drafters_overlapped_equal_synchronous(drafter: str) -> None:
    """A draft model's KV follows the runner's late rounds: rolled back to what the round
    before accepted, released with the sequence's slot. The differential workload (seeded
    sampling draws its drafts from the draft model's distribution: strict rejection
    sampling) token for token, and the draft pool ends empty."""
    reqs = workload(13, 24)
    spec = MODEL_DRAFTERS[drafter]
    want, _ = run_workload(reqs, False, speculative=spec, **ROOMY)
    engine, traces = _traced(True, speculative=spec, **ROOMY)
    got, _ = run_workload(reqs, engine=engine)  # ends with check_idle: the draft pool too
    assert engine.executor.depth == 1 and engine.runner.drafting is not None
    assert got == want
    assert sum(t.num_drafted for t in traces) >= sum(t.num_accepted for t in traces) > 0  # "tiny": all
    engine.runner.drafting.speculation.check_idle()  # every released slot released its draft KV


@pytest.mark.parametrize("drafter", sorted(MODEL_DRAFTERS))
def test_model_drafters_overlapped_under_preemption(drafter: str) -> None:
    """A pool that preempts and a draft pool that runs short: which sequences get drafts
    then depends on what each engine keeps (the runner keeps a sequence's draft KV while it
    holds a token slot, the host while it runs), so sampled tokens may differ — drawn from
    the same target distribution — but greedy ones may not; nothing is lost."""
    reqs = workload(17, 20)
    spec = MODEL_DRAFTERS[drafter]
    want, _ = run_workload(reqs, False, speculative=spec, **SMALL_POOL)
    engine, traces = _traced(True, speculative=spec, **SMALL_POOL)
    got, _ = run_workload(reqs, engine=engine)
    greedy = {rid for rid, _, params in reqs if params.temperature == 0.0}
    assert greedy and all(got[rid] == want[rid] for rid in greedy)
    assert all(reason != "error" for comps in got.values() for _, reason, _ in comps)
    assert any(t.preempted for t in traces) and sum(t.num_accepted for t in traces) > 0


def test_dspark_overlapped_equals_plain_greedy() -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    data = (Path(__file__).resolve().parents[2] / "scripts" / "embedded_corpus.txt").read_bytes()
    reqs = [(f"d{i}", list(data[97 * i: 97 * i + 40]), greedy) for i in range(6)]
    config = dict(model="tiny-words", num_blocks=128, block_size=8, max_model_len=128)
    plain, _ = run_workload(reqs, False, **config)
    spec = {"drafter": "dspark", "dspark_heads": "tiny-words", "num_draft": 4}
    engine, traces = _traced(True, speculative=spec, **config)
    got, _ = run_workload(reqs, engine=engine)
    assert got == plain
    assert sum(t.num_accepted for t in traces) > len(reqs)


def test_a_model_drafter_in_the_worker_equals_the_in_process_engine() -> None:
    reqs = workload(17, 20)
    spec = MODEL_DRAFTERS["self"]
    want, _ = run_workload(reqs, False, speculative=spec, **ROOMY)
    for overlap in (True, False):  # the worker drafts either way
        got, engine = run_workload(reqs, overlap, worker="process", speculative=spec, **ROOMY)
        assert got == want and engine.executor.depth == int(overlap)
        engine.close()


def test_aborts_with_a_model_drafter_release_its_kv() -> None:
    engine = build_engine(overlap=True, speculative=MODEL_DRAFTERS["draft_model"], **SMALL_POOL)
    rng = random.Random(5)
    reqs = workload(19, 16)
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    live = [rid for rid, _, _ in reqs]
    while engine.has_unfinished_requests():
        engine.step()
        if live and rng.random() < 0.4:
            engine.abort(live.pop(rng.randrange(len(live))))
    engine.flush()
    engine.check_idle()


def test_the_idle_check_sees_draft_kv_the_runner_kept() -> None:
    engine = build_engine(overlap=True, speculative=MODEL_DRAFTERS["self"], **ROOMY)
    engine.runner.drafting.release = lambda seq_ids: None  # forgets to drop released sequences
    engine.add_request("a", list(range(3, 30)), SamplingParams(temperature=0.0, max_tokens=8))
    engine.run()
    with pytest.raises(InvariantError, match="runner drafting still holds sequences"):
        engine.check_idle()


@pytest.mark.parametrize("worker", ["inline", "process"])
def test_traces_show_the_drafts_the_runner_verified(worker: str) -> None:
    """The runner's own drafts come back in StepResult.drafts: each traced verify chunk
    names the drafts it verified, and its accepted tokens are their prefix."""
    engine, traces = _traced(True, worker=worker, speculative=SPECS["fixed"], **ROOMY)
    reqs = workload(23, 12)
    got, _ = run_workload(reqs, engine=engine)
    verified = [c for t in traces for c in t.chunks if c.num_drafted]
    assert verified
    for c in verified:
        assert len(c.drafted) == c.num_drafted
        assert c.sampled[: c.num_accepted] == c.drafted[: c.num_accepted]
    # Chunks are traced where they ran (after the runner's shift), not where they were
    # planned: a decode feeds the token before its output position, plus its drafts, and
    # every output index of a completion is committed exactly once.
    prompts = {rid: len(prompt) for rid, prompt, _ in reqs}
    for t in traces:
        for c in t.chunks:
            base = c.request_id.split("#")[0]
            if c.kind == "decode" and c.request_id in prompts:
                assert c.start == prompts[base] + c.output_position - 1, (t.step_id, c)
                assert c.num_tokens == 1 + c.num_drafted
    for rid, comps in got.items():
        if any(p.n > 1 for r, _, p in reqs if r == rid):
            continue
        tokens = comps[0][0]
        line = token_timeline(traces, rid, tokens)
        committed = [(i, tok) for i, tok, _, step in line if step is not None]
        assert committed == list(enumerate(tokens)), rid
    engine.close()
