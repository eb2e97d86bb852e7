"""ContinuousBatchScheduler: prefix-aware admission, preemption, policies, never-fits,
abort, forks, and the regressions of TESTING.md section 3 (items 1, 3, 6, 7, 8)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from sched_shadow import SpyCache

from deepinfer_kit.errors import InvariantError
from deepinfer_kit.request import Request
from deepinfer_kit.sched import ContinuousBatchScheduler, StepResult
from deepinfer_kit.sched.records import SchedulerConfig
from deepinfer_kit.testing.sched_driver import SchedulerDriver, make_request

P = 4
MUTATORS = {"allocate", "free", "fork", "truncate", "cache_full_blocks"}


def build(
    make_cache: Any, num_blocks: int = 32, spy: bool = False, **cfg: Any
) -> tuple[SchedulerDriver, Any]:
    config = SchedulerConfig(**cfg)
    cache = make_cache(num_blocks, P)
    if spy:
        cache = SpyCache(cache)
    return SchedulerDriver(ContinuousBatchScheduler(config, cache), config), cache


def test_blocks_are_published_only_after_commit(make_cache: Any) -> None:
    # Regression 1: B, admitted in the round that computes A's prompt, must not hit A's
    # blocks (their KV is not written yet); C, admitted after that commit, must.
    drv, cache = build(make_cache, spy=True)
    drv.sched.add(make_request("A", 12, prompt_seed="p", max_tokens=3))
    drv.sched.add(make_request("B", 12, prompt_seed="p", max_tokens=3))
    plan = drv.schedule()
    assert [c.start for c in plan.all_chunks()] == [0, 0]
    assert not any(e[0] == "cache_full_blocks" for e in cache.log)
    drv.commit(plan)
    drv.sched.add(make_request("C", 12, prompt_seed="p", max_tokens=3))
    plan = drv.schedule()
    assert plan.all_chunks()[-1].request_id == "C" and plan.all_chunks()[-1].start == 8
    assert plan.num_cached_tokens == 8
    drv.commit(plan)
    drv.run()


def _check_fresh_matches(log: list[tuple[str, Request, tuple[Any, ...], Any]]) -> int:
    """Every allocate that takes cached tokens uses the count of a match_prefix of the
    same request with no cache mutation since. Returns how many such allocations."""
    checked = 0
    last_match: dict[int, int] = {}
    for name, req, args, result in log:
        if name == "match_prefix":
            last_match[id(req)] = result
        elif name in MUTATORS:
            if name == "allocate" and args[2] == 0 and args[1] > 0:
                assert last_match.get(id(req)) == args[1], f"{req.request_id}: stale cached count"
                checked += 1
            last_match.clear()
    return checked


def test_cached_counts_are_never_stale(make_cache: Any) -> None:
    # Regressions 3 and 6: a tiny pool, shared prefixes, preemption and eviction; every
    # admission (first or resume) uses a count matched after the last cache change.
    drv, cache = build(make_cache, 10, spy=True, max_num_seqs=4, max_num_batched_tokens=16)
    for i in range(16):
        drv.sched.add(
            make_request(
                f"r{i}", 5 + i % 7, prompt_seed=f"s{i % 3}", max_tokens=4 + i % 5, ignore_eos=True
            )
        )
    drv.run()
    assert sum(len(p.preempted_ids) for p in drv.plans) > 0
    assert _check_fresh_matches(cache.log) > 0


def _resume_stats(seed: int, make_cache: Any) -> tuple[int, int]:
    drv, cache = build(make_cache, 10, spy=True, max_num_seqs=4, max_num_batched_tokens=24)
    rng = random.Random(seed)
    for i in range(20):
        drv.sched.add(
            make_request(
                f"r{i}",
                rng.randint(1, 12),
                prompt_seed=f"s{i % 2}",
                max_tokens=rng.randint(3, 12),
                ignore_eos=True,
            )
        )
    resumes = boundaries = 0
    while drv.sched.has_unfinished():
        preempted = {id(r) for r in drv.sched.waiting if r.num_preemptions}
        plan = drv.schedule()
        for c in plan.all_chunks():
            req = drv.sched.get(c.request_id)
            assert req is not None
            if id(req) in preempted:
                resumes += 1
                boundaries += req.num_tokens % P == 0
                match = [e[3] for e in cache.log if e[0] == "match_prefix" and e[1] is req][-1]
                assert c.start == match and c.start < req.num_tokens
                assert c.start + c.num_tokens == req.num_tokens or not c.sample
            assert len(req.block_table) == -(-(c.start + c.num_tokens) // P)
            assert c.block_table == req.block_table  # the plan holds a true snapshot
        drv.commit(plan)
    return resumes, boundaries


def test_resume_recomputes_every_token(make_cache: Any) -> None:
    # Regressions 6 and 7: a resumed request's first chunk starts at its fresh prefix
    # match and re-prefills prompt *and* outputs; its table covers exactly the computed
    # positions, also when it resumes with a whole number of blocks.
    stats = [_resume_stats(seed, make_cache) for seed in range(4)]
    assert sum(r for r, _ in stats) > 0 and sum(b for _, b in stats) > 0, stats


def test_preemption_releases_the_shared_prefix_too(make_cache: Any) -> None:
    # Regression 8: after preemption the victim holds no reference to the blocks it
    # shares with another request; counts equal the tables holding them.
    drv, cache = build(make_cache, 7, max_num_seqs=3, max_num_batched_tokens=64)
    drv.sched.add(
        make_request("a", 8, prompt_seed="x", max_tokens=12, ignore_eos=True, arrival=0.0)
    )
    drv.step()
    drv.sched.add(
        make_request("b", 8, prompt_seed="x", max_tokens=12, ignore_eos=True, arrival=1.0)
    )
    preempted = False
    while drv.sched.has_unfinished():
        plan = drv.schedule()
        preempted |= bool(plan.preempted_ids)
        cache.check_integrity(drv.sched.running)
        drv.commit(plan)
    assert preempted
    cache.check_integrity(())


def test_fcfs_preempts_the_latest_arrival(make_cache: Any) -> None:
    drv, _ = build(make_cache, 6, max_num_seqs=3, max_num_batched_tokens=64)
    for i, t in enumerate([0.0, 2.0, 1.0]):
        drv.sched.add(make_request(f"r{i}", 3, max_tokens=12, ignore_eos=True, arrival=t))
    victims: list[str] = []
    while drv.sched.has_unfinished():
        victims += drv.schedule().preempted_ids
        drv.commit(drv.plans[-1])
    assert victims and victims[0] == "r1"


def test_priority_admission_and_victims(make_cache: Any) -> None:
    drv, _ = build(make_cache, 6, max_num_seqs=2, max_num_batched_tokens=64, policy="priority")
    drv.sched.add(make_request("low", 3, max_tokens=12, ignore_eos=True, priority=5, arrival=0.0))
    drv.sched.add(make_request("high", 3, max_tokens=12, ignore_eos=True, priority=0, arrival=1.0))
    drv.sched.add(make_request("mid", 3, max_tokens=12, ignore_eos=True, priority=2, arrival=2.0))
    plan = drv.schedule()
    assert [c.request_id for c in plan.all_chunks()] == ["high", "mid"]
    drv.commit(plan)
    preempted = []
    while drv.sched.has_unfinished():
        preempted += drv.schedule().preempted_ids
        drv.commit(drv.plans[-1])
    assert preempted and preempted[0] == "mid"


def test_policy_hooks_are_called(make_cache: Any) -> None:
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64)
    seen: list[str] = []

    def longest_first(req: Request) -> tuple[float, ...]:
        return (-req.num_prompt_tokens,)

    def first_running(running: Any) -> Request:
        seen.append(running[0].request_id)
        return running[0]

    sched = ContinuousBatchScheduler(
        config, make_cache(6, P), admission=longest_first, victim=first_running
    )
    drv = SchedulerDriver(sched, config)
    for i, n in enumerate([2, 9, 5]):
        sched.add(make_request(f"r{i}", n, max_tokens=10, ignore_eos=True))
    assert [c.request_id for c in drv.schedule().all_chunks()] == ["r1", "r2"]
    drv.commit(drv.plans[-1])
    drv.run()
    assert seen and seen[0] == "r1"


def test_never_fits_messages_name_the_limit(make_cache: Any) -> None:
    drv, _ = build(
        make_cache,
        4,
        max_model_len=20,
        max_num_seqs=2,
        enable_chunked_prefill=False,
        max_num_batched_tokens=8,
    )
    cases = {
        "model-len": (make_request("model-len", 20), "max_model_len=20"),
        "pool": (make_request("pool", 8, max_tokens=10), "num_blocks=4"),
        "seqs": (make_request("seqs", 2, n=3), "max_num_seqs=2"),
        "budget": (make_request("budget", 9), "max_num_batched_tokens=8"),
    }
    for req, _ in cases.values():
        drv.sched.add(req)
    assert drv.sched.num_unfinished == 4
    outs = drv.step()
    assert len(outs) == 4 + 2  # the n=3 request reports all three completions
    for rid, (req, needle) in cases.items():
        assert req.error is not None and needle in req.error, req.error
        assert drv.reason(rid) == "error"
    assert not drv.sched.has_unfinished()


def test_abort_of_a_fork_family(make_cache: Any) -> None:
    drv, cache = build(make_cache)
    drv.sched.add(make_request("f", 6, n=3, max_tokens=20, ignore_eos=True))
    drv.step()
    drv.step()
    assert drv.sched.num_unfinished == 3
    assert drv.sched.abort("f")
    outs = drv.step()
    assert sorted((o.request_id, o.outputs[0].index, o.outputs[0].finish_reason) for o in outs) == [
        ("f", 0, "abort"),
        ("f", 1, "abort"),
        ("f", 2, "abort"),
    ]
    assert not drv.sched.has_unfinished()
    cache.check_integrity(())


def test_abort_before_fork_reports_every_completion(make_cache: Any) -> None:
    drv, _ = build(make_cache)
    drv.sched.add(make_request("f", 6, n=2, max_tokens=4))
    assert drv.sched.abort("f")
    assert sorted(o.outputs[0].index for o in drv.step()) == [0, 1]


def test_abort_in_flight_frees_after_the_commit(make_cache: Any) -> None:
    drv, cache = build(make_cache, 16)
    drv.sched.add(make_request("a", 9, max_tokens=20, ignore_eos=True))
    drv.step()
    held = cache.num_blocks - cache.num_free_blocks
    plan = drv.schedule()
    assert drv.sched.abort("a")
    assert cache.num_blocks - cache.num_free_blocks == held  # the plan still reads them
    drv.sched.add(make_request("a", 3, max_tokens=2, ignore_eos=True))  # id reusable at once
    outs = drv.commit(plan)
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [("a", "abort")]
    del drv.completions[("a", 0)]
    drv.run()
    assert drv.reason("a") == "length"
    cache.check_integrity(())


def test_commit_order_and_alignment_are_enforced(make_cache: Any) -> None:
    drv, _ = build(make_cache)
    drv.sched.add(make_request("a", 3, max_tokens=5))
    first, second = drv.sched.schedule(), drv.sched.schedule()
    with pytest.raises(InvariantError, match="schedule order"):
        drv.sched.commit(second, StepResult([[1]] * len(second.all_chunks())))
    with pytest.raises(InvariantError, match="token lists"):
        drv.sched.commit(first, StepResult([]))


def test_first_admission_hit_is_what_users_see(make_cache: Any) -> None:
    drv, _ = build(make_cache, 64)
    drv.sched.add(make_request("warm", 13, prompt_seed="s", max_tokens=1))
    drv.run()
    drv.sched.add(make_request("hit", 13, prompt_seed="s", max_tokens=2))
    outs = [o for _ in range(10) for o in drv.step() if o.request_id == "hit"]
    assert outs[0].num_cached_tokens == 12


def test_without_chunking_a_prompt_waits_for_room(make_cache: Any) -> None:
    drv, _ = build(make_cache, 64, enable_chunked_prefill=False, max_num_batched_tokens=16)
    drv.sched.add(make_request("a", 10, max_tokens=3, ignore_eos=True))
    drv.sched.add(make_request("b", 10, max_tokens=3, ignore_eos=True))
    plan = drv.step() and drv.plans[-1] or drv.plans[-1]
    assert [(c.request_id, c.num_tokens) for c in plan.all_chunks()] == [("a", 10)]
    drv.run()
    assert all(c.num_tokens in (1, 10) for p in drv.plans for c in p.all_chunks())


def test_abort_of_a_preempted_request(make_cache: Any) -> None:
    drv, cache = build(make_cache, 6, max_num_seqs=3, max_num_batched_tokens=64)
    for i in range(3):
        drv.sched.add(make_request(f"r{i}", 5, max_tokens=12, ignore_eos=True, arrival=float(i)))
    while not any(r.num_preemptions for r in drv.sched.waiting):
        drv.step()
    (victim,) = [r for r in drv.sched.waiting if r.num_preemptions]
    assert victim.block_table == [] and drv.sched.abort(victim.request_id)
    assert victim not in drv.sched.waiting
    outs = drv.step()
    assert (victim.request_id, "abort") in [
        (o.request_id, o.outputs[0].finish_reason) for o in outs
    ]
    drv.run()
    cache.check_integrity(())


def test_logprobs_follow_their_completion(make_cache: Any) -> None:
    from deepinfer_kit.outputs import Logprob

    drv, _ = build(make_cache)
    drv.sched.add(make_request("lp", 3, n=2, max_tokens=2, ignore_eos=True, logprobs=1))

    def lp(tok: int) -> dict[int, Logprob]:
        return {tok: Logprob(-tok / 10, 1)}

    plan = drv.schedule()
    drv.commit(plan, StepResult([[3, 5]], logprobs=[[lp(3), lp(5)]]))
    plan = drv.schedule()
    toks = [[4 + i] for i in range(len(plan.all_chunks()))]
    drv.commit(plan, StepResult(toks, logprobs=[[lp(t[0])] for t in toks]))
    comps = {i: drv.completions[("lp", i)] for i in range(2)}
    for comp in comps.values():
        assert comp.logprobs is not None and len(comp.logprobs) == 2
        assert comp.cumulative_logprob == pytest.approx(-sum(comp.token_ids) / 10)
    assert {comps[0].token_ids[0], comps[1].token_ids[0]} == {3, 5}
