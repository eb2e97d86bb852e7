"""Static batching's batch discipline; placeholders with a step in flight; the room the
plan leaves for speculative verify tokens."""

from __future__ import annotations

from typing import Any

from deepinfer_kit.sched import ContinuousBatchScheduler, StaticBatchScheduler, StepResult
from deepinfer_kit.sched.records import SchedulerConfig
from deepinfer_kit.testing.sched_driver import EOS, SchedulerDriver, make_request

P = 4


def test_static_batch_admits_only_when_drained(make_cache: Any) -> None:
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64)
    drv = SchedulerDriver(StaticBatchScheduler(config, make_cache(64, P)), config)
    lengths = {"a": 2, "b": 6, "c": 4, "d": 1, "e": 1}
    for rid, n in lengths.items():
        drv.sched.add(make_request(rid, 5, max_tokens=n, ignore_eos=True))
    drv.run()
    rounds = [{c.request_id for c in p.all_chunks()} for p in drv.plans]
    first = [i for i, ids in enumerate(rounds) if ids & {"a", "b", "c"}]
    second = [i for i, ids in enumerate(rounds) if ids & {"d", "e"}]
    assert rounds[0] == {"a", "b", "c"} and first == list(range(6))  # b's 6 tokens
    assert second == [6] and rounds[6] == {"d", "e"}


def test_static_batch_reserves_blocks_for_whole_lives(make_cache: Any) -> None:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    drv = SchedulerDriver(StaticBatchScheduler(config, make_cache(8, P)), config)
    for i in range(4):  # each needs 3 blocks over its life: only 2 fit at once
        drv.sched.add(make_request(f"r{i}", 6, max_tokens=6, ignore_eos=True))
    assert len(drv.schedule().all_chunks()) == 2
    drv.commit(drv.plans[-1])
    drv.run()
    assert all(not p.preempted_ids for p in drv.plans)


def _overlapped(make_cache: Any, num_blocks: int = 32) -> tuple[ContinuousBatchScheduler, Any]:
    cache = make_cache(num_blocks, P)
    return ContinuousBatchScheduler(SchedulerConfig(long_prefill_token_threshold=4), cache), cache


def test_placeholders_for_the_token_in_flight(make_cache: Any) -> None:
    sched, _ = _overlapped(make_cache)
    sched.add(make_request("dec", 3, max_tokens=10, ignore_eos=True))
    sched.add(make_request("pre", 10, max_tokens=10, ignore_eos=True))
    k = sched.schedule()
    k1 = sched.schedule()  # before k is committed
    by_id = {c.request_id: c for c in k1.all_chunks()}
    assert by_id["dec"].num_placeholders == 1 and by_id["dec"].start == 3 and by_id["dec"].sample
    assert (
        by_id["pre"].num_placeholders == 0 and by_id["pre"].start == 4 and not by_id["pre"].sample
    )
    sched.commit(k, StepResult([[7], []]))
    assert sched.running[0].all_token_ids[-1] == 7
    sched.commit(k1, StepResult([[8], []]))
    assert sched.running[0].output_token_ids == [7, 8]


def test_no_step_scheduled_past_the_last_token(make_cache: Any) -> None:
    sched, _ = _overlapped(make_cache)
    sched.add(make_request("one", 3, max_tokens=1, ignore_eos=True))
    k = sched.schedule()
    assert sched.schedule().is_empty  # the in-flight token is its last
    outs = sched.commit(k, StepResult([[5]]))
    assert [o.outputs[0].finish_reason for o in outs] == ["length"]


def test_finished_in_flight_is_freed_after_the_later_step(make_cache: Any) -> None:
    sched, cache = _overlapped(make_cache)
    sched.add(make_request("eos", 3, max_tokens=10))
    sched.commit(sched.schedule(), StepResult([[5]]))
    k, k1 = sched.schedule(), sched.schedule()
    outs = sched.commit(k, StepResult([[EOS]]))
    assert outs[0].outputs[0].token_ids == [5, EOS] and outs[0].outputs[0].finish_reason == "stop"
    assert cache.num_free_blocks < cache.num_blocks  # plan k1 still writes its KV
    assert sched.commit(k1, StepResult([[9]])) == []  # its token is discarded
    cache.check_integrity(())


def test_abort_with_two_plans_in_flight(make_cache: Any) -> None:
    sched, cache = _overlapped(make_cache)
    sched.add(make_request("a", 3, max_tokens=10, ignore_eos=True))
    k, k1 = sched.schedule(), sched.schedule()
    assert sched.abort("a")
    assert [o.outputs[0].finish_reason for o in sched.commit(k, StepResult([[4]]))] == ["abort"]
    assert cache.num_free_blocks < cache.num_blocks
    assert sched.commit(k1, StepResult([[5]])) == []
    cache.check_integrity(())
    assert not sched.has_unfinished()


def test_draft_room_counts_in_the_budget_and_rolls_back(make_cache: Any) -> None:
    cache = make_cache(32, P)
    config = SchedulerConfig(max_num_batched_tokens=8)
    sched = ContinuousBatchScheduler(config, cache)
    sched.reserve_drafts(9)
    sched.add(make_request("s", 7, max_tokens=20, ignore_eos=True))
    sched.commit(sched.schedule(), StepResult([[11]]))  # 8 tokens, 7 computed
    plan = sched.schedule()
    (chunk,) = plan.as_records().chunks
    assert chunk.draft_room == 7 and chunk.num_tokens == 8  # the room cut to the budget
    assert plan.num_batched_tokens == 8
    req = sched.get(chunk.request_id)
    assert req is not None
    assert len(req.block_table) == 4  # positions 7..14 may be written
    drafts = (1, 2, 3, 4, 5, 6, 7)  # the runner drafted into the room; two accepted, then 42
    sched.commit(plan, StepResult([[1, 2, 42]], num_drafted=[7], num_accepted=[2], drafts=[drafts]))
    assert req.output_token_ids == [11, 1, 2, 42]
    assert req.num_computed_tokens == 10 and len(req.block_table) == 3
    cache.check_integrity([req])
    (chunk,) = sched.schedule().as_records().chunks
    assert chunk.start == 10 and chunk.num_tokens == 8


def test_a_shift_under_overlapped_speculation_truncates_to_the_computed_tokens(make_cache: Any) -> None:
    """Round k + 1 is planned before round k commits, as if round k's drafts were all
    accepted; when k accepts fewer, its commit moves the sequence down by the rejected
    drafts and releases the blocks past it: after every commit the table covers exactly
    the computed tokens (the in-flight chunk's, moved), over random acceptance patterns."""
    import random

    rng = random.Random(5)
    for trial in range(12):
        cache = make_cache(96, P)
        sched = ContinuousBatchScheduler(SchedulerConfig(max_num_batched_tokens=64), cache)
        gamma = rng.randint(1, 5)
        sched.reserve_drafts(gamma)
        sched.add(make_request("s", rng.randint(3, 9), max_tokens=60, ignore_eos=True))
        sched.commit(sched.schedule(), StepResult([[11]]))
        req = sched.get("s")
        assert req is not None
        inflight = sched.schedule()
        shifted = 0
        for _ in range(8):
            nxt = sched.schedule()  # planned before `inflight` commits
            (chunk,) = inflight.as_records().chunks
            drafts = tuple(rng.randrange(3, 200) for _ in range(chunk.draft_room))
            accepted = rng.randint(0, len(drafts))
            emitted = [*drafts[:accepted], rng.randrange(3, 200)]
            sched.commit(inflight, StepResult([emitted], num_drafted=[len(drafts)], num_accepted=[accepted],
                                              drafts=[drafts]))
            shifted += len(drafts) > accepted
            assert len(req.block_table) == -(-req.num_computed_tokens // P), (trial, req.num_computed_tokens)
            cache.check_integrity([req])
            (moved,) = nxt.as_records().chunks
            inflight = nxt
            inflight_shift = moved.shift(len(emitted))
            assert req.num_computed_tokens == moved.end - inflight_shift  # the chunk in flight, moved down
        assert shifted
