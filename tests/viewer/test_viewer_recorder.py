"""TraceRecorder on real tiny-engine runs: every recorded fact agrees with the engine."""

from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from viewer_run import EPLB, record_eplb_run, Run, completions, record_run, recorded_tokens  # noqa: E402

from deepinfer_kit.errors import ConfigError  # noqa: E402
from deepinfer_kit.viewer import TraceRecorder, filter_name, loads, validate  # noqa: E402


@pytest.fixture(scope="module")
def run() -> Run:
    return record_run()


def test_run_shows_every_mechanism(run: Run) -> None:
    steps = run.doc["steps"]
    assert any(s["preempted"] for s in steps), "no preemption"
    assert any(s["blocks"]["prefix_hits"] for s in steps), "no prefix hit"
    assert any(r["parent"] for r in run.doc["requests"].values()), "no fork"
    assert any(s["blocks"]["copies"] for s in steps), "no copy-on-write"
    assert any(s["blocks"]["num_evicted"] for s in steps), "no eviction"
    assert any(s["blocks"]["shared"] for s in steps), "no shared block"
    validate(run.doc)
    assert loads(run.recorder.to_json()) == run.doc


def test_block_tables_agree_with_the_cache_manager(run: Run) -> None:
    steps = run.doc["steps"]
    assert len(steps) == len(run.live)
    for step, live in zip(steps, run.live):
        blocks = step["blocks"]
        assert blocks["tables"] == live["tables"], step["step"]
        assert blocks["ref_counts"] == live["refs"], step["step"]
        assert blocks["num_free"] == live["num_free"]
        assert step["queues"]["waiting"] == live["waiting"]
        # A synchronous engine: each holder of a block is a running sequence's table.
        holders = Counter(b for table in blocks["tables"].values() for b in table)
        assert [holders.get(b, 0) for b in range(len(blocks["ref_counts"]))] == blocks["ref_counts"]
        assert blocks["shared"] == sorted(b for b, n in holders.items() if n > 1)
        assert blocks["num_free"] == blocks["ref_counts"].count(0)
        assert set(blocks["cached"]) >= {b for hit in blocks["prefix_hits"].values() for b in hit}
        assert not set(blocks["evicted"]) & set(blocks["cached"])
        assert len(blocks["evicted"]) <= blocks["num_evicted"]
        for src, dst in blocks["copies"]:
            assert src != dst and blocks["ref_counts"][dst] >= 1
        for rid, table in blocks["tables"].items():
            assert len(set(table)) == len(table), (rid, table)


def test_budget_queues_and_token_steps(run: Run) -> None:
    doc = run.doc
    finished: list[str] = []
    for step in doc["steps"]:
        assert sum(c["q"] for c in step["chunks"]) == step["batched_tokens"] <= step["budget"]
        assert not set(step["queues"]["waiting"]) & set(step["queues"]["running"])
        finished += step["finished"]
        assert step["queues"]["finished"] == finished
        for tok in step["tokens"]:
            assert tok["committed_in"] >= tok["sampled_in"] == step["step"]
    assert sorted(finished) == sorted(completions(run))
    assert recorded_tokens(doc) == completions(run)


def test_sampling_records_filters_and_candidates(run: Run) -> None:
    doc = run.doc
    for step in doc["steps"]:
        drawn = [t for c in step["chunks"] for t in c["sampled"]]
        assert [s["token"] for s in step["sampling"]] == drawn
        for s in step["sampling"]:
            req = doc["requests"][s["request"]]
            assert s["filter"] == req["filter"]
            k = req["logprobs"]
            if k is None:
                assert s["candidates"] == []
                continue
            ranks = [c["rank"] for c in s["candidates"]]
            assert ranks == sorted(ranks) and len(ranks) >= k
            chosen = [c for c in s["candidates"] if c["token"] == s["token"]]
            assert len(chosen) == 1
            if req["filter"] == "greedy":
                assert chosen[0]["rank"] == 1
            probs = [math.exp(c["logprob"]) for c in s["candidates"] if c["logprob"] is not None]
            assert sum(probs) <= 1.0 + 1e-5
    assert {r["filter"] for r in doc["requests"].values()} == {
        "greedy", "temperature+top-k", "temperature+top-p", "temperature+min-p"}


def test_expert_counts_route_every_token_k_times(run: Run) -> None:
    ks = set()
    for step in run.doc["steps"]:
        experts = step["experts"]
        assert experts is not None and len(experts) >= 1
        for layer in experts:
            assert sum(layer) % step["batched_tokens"] == 0
            ks.add(sum(layer) // step["batched_tokens"])
    assert len(ks) == 1 and ks.pop() >= 1


def test_overlap_commits_one_step_late() -> None:
    run = record_run(overlap=True, min_steps=20)
    late = [t for s in run.doc["steps"] for t in s["tokens"]]
    assert late and all(t["committed_in"] >= t["sampled_in"] for t in late)
    assert any(t["committed_in"] == t["sampled_in"] + 1 for t in late)
    draws = [d for s in run.doc["steps"] for d in s["sampling"]]
    assert sum(not d["committed"] for d in draws) == len(draws) - len(late)
    assert recorded_tokens(run.doc) == completions(run)


def test_speculation_records_drafts() -> None:
    run = record_run(speculative={"drafter": "ngram", "num_draft": 3}, min_steps=10)
    assert run.doc["meta"]["speculative"]
    verified = [c for s in run.doc["steps"] for c in s["chunks"] if c["verified"]]
    assert verified
    for c in verified:
        assert len(c["drafted"]) == c["verified"] and 0 <= c["accepted"] <= c["verified"]
        assert len(c["sampled"]) == c["accepted"] + 1
        assert c["sampled"][: c["accepted"]] == c["drafted"][: c["accepted"]]
    assert recorded_tokens(run.doc) == completions(run)


def test_filter_name() -> None:
    from deepinfer_kit.sample.params import SamplingParams

    assert filter_name(SamplingParams(temperature=0.0)) == "greedy"
    assert filter_name(SamplingParams(top_k=1)) == "greedy"
    assert filter_name(SamplingParams(top_k=5, top_p=0.5, min_p=0.1)) == "temperature+top-k+top-p+min-p"


def test_recorder_needs_readable_queues(run: Run) -> None:
    class Opaque:
        pass

    engine = run.engine
    saved = engine.scheduler
    engine.scheduler = Opaque()  # type: ignore[assignment]
    try:
        with pytest.raises(ConfigError, match="engine.scheduler"):
            TraceRecorder(engine)
    finally:
        engine.scheduler = saved


def test_eplb_placement_loads_and_rebalances_follow_the_balancer() -> None:
    """Each step's slot counts are the trace's, the GPU loads sum them, the placement
    changes exactly at the steps that record a rebalance (to the balancer's new map), and
    ``changed`` lists the slots whose expert differs from the step before."""
    run = record_eplb_run()
    doc, balancer = run.doc, run.engine.balancer
    assert balancer is not None and doc["meta"]["eplb"]["num_slots"] == 12
    history = iter(balancer.history)
    for i, (step, trace) in enumerate(zip(doc["steps"], run.recorder.traces)):
        x = step["eplb"]
        assert x["slots"] == [list(r) for r in trace.slot_counts or ()]
        assert x["gpu_loads"] == [[sum(r[g:g + 3]) for g in range(0, 12, 3)] for r in x["slots"]]
        assert [sum(r) for r in x["slots"]] == [2 * step["batched_tokens"]] * 2  # top-2 routing
        prev = doc["steps"][i - 1]["eplb"]["phy2log"] if i else x["phy2log"]
        r = x["rebalance"]
        if r is None:
            assert x["phy2log"] == prev
            continue
        record = next(history)
        assert x["phy2log"] == record.phy2log.tolist() and r["moved_slots"] == record.moved_slots
        assert r["changed"] == [[k for k in range(12) if a[k] != b[k]] for a, b in zip(prev, x["phy2log"])]
        assert sum(map(len, r["changed"])) == r["moved_slots"] > 0
        assert r["balancedness_after"] >= r["balancedness_before"]
    assert next(history, None) is None


def test_eplb_gpu_loads_before_and_after_selection() -> None:
    """With the balanced selector, each step's load before selection is the even split of
    the trace's routed counts over the placement's replicas (computed here from scratch),
    it holds the same copies as the dispatched load, and the balancer's busiest GPU is
    never busier than the even split's beyond one copy per slot it holds (rounding)."""
    run = record_eplb_run({**EPLB, "dispatch": "balanced"})
    doc = run.doc
    assert doc["meta"]["eplb"]["dispatch"] == "balanced"
    moved = 0
    for step, trace in zip(doc["steps"], run.recorder.traces):
        x = step["eplb"]
        assert trace.expert_counts is not None
        for layer, (phy2log, counts) in enumerate(zip(x["phy2log"], trace.expert_counts)):
            slots_of = {e: [s for s, v in enumerate(phy2log) if v == e] for e in range(len(counts))}
            even = [0] * 12
            for e, slots in slots_of.items():
                for r, s in enumerate(slots):
                    even[s] = counts[e] // len(slots) + (r < counts[e] % len(slots))
            before = [sum(even[g:g + 3]) for g in range(0, 12, 3)]
            assert x["gpu_loads_before"][layer] == before
            after = x["gpu_loads"][layer]
            assert sum(after) == sum(before) == 2 * step["batched_tokens"]
            assert max(after) <= max(before) + 3
            moved += after != before
    assert moved > 0  # the selector changed some step's split
