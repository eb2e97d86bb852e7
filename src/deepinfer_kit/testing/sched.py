"""Conformance suite for Scheduler: every check drives a scheduler built by your factory
over a fresh KV cache manager, through the Protocol alone (see
:class:`~deepinfer_kit.testing.sched_driver.SchedulerDriver`)."""

from __future__ import annotations

import random
from collections.abc import Callable

from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.cache.records import CacheConfig
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sched.protocols import Scheduler, SchedulerFactory
from deepinfer_kit.sched.records import SchedulePlan, SchedulerConfig
from deepinfer_kit.step import StepResult
from deepinfer_kit.testing.sched_driver import EOS, SchedulerDriver, make_request, random_tokens
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["SCHEDULER_SUITE", "build_scheduler"]

SCHEDULER_SUITE: Suite[SchedulerFactory] = Suite(
    "Scheduler", "factory(config, cache) -> Scheduler"
)


def build_scheduler(
    factory: SchedulerFactory, config: SchedulerConfig, num_blocks: int, block_size: int
) -> Scheduler:
    """``factory`` applied to ``config`` and a fresh prefix-caching KV cache manager of
    ``num_blocks`` blocks of ``block_size`` tokens."""
    cache = BlockKVCacheManager.create(CacheConfig(block_size=block_size, num_blocks=num_blocks))
    return factory(config, cache)


def _setup(
    factory: SchedulerFactory, num_blocks: int = 64, block_size: int = 4, **cfg: object
) -> SchedulerDriver:
    config = SchedulerConfig(**cfg)  # type: ignore[arg-type]
    sched = build_scheduler(factory, config, num_blocks, block_size)
    return SchedulerDriver(sched, config, block_size=block_size)


def _expect_pool_is_whole(drv: SchedulerDriver, num_blocks: int, block_size: int) -> None:
    """Leak check through the Protocol: a request needing every block (or as many as
    ``max_model_len`` allows) still runs."""
    prompt = min(num_blocks * block_size, drv.config.max_model_len - 1) - 3
    drv.sched.add(make_request("whole-pool", prompt, max_tokens=4, ignore_eos=True))
    drv.run()
    expect(
        drv.reason("whole-pool") == "length",
        f"whole-pool request: {drv.reason('whole-pool')} (blocks leaked?)",
    )
    expect(len(drv.completions[("whole-pool", 0)].token_ids) == 4, "whole-pool request lost tokens")


@SCHEDULER_SUITE.check
def check_empty_scheduler_is_idle(factory: SchedulerFactory) -> None:
    sched = build_scheduler(factory, SchedulerConfig(), 16, 4)
    expect(not sched.has_unfinished(), "a fresh scheduler must have nothing unfinished")
    expect(sched.num_unfinished == 0, f"num_unfinished: expected 0, got {sched.num_unfinished}")
    plan = sched.schedule()
    expect(plan.is_empty, "an empty scheduler must plan an empty round")
    expect(sched.commit(plan, StepResult(token_ids=[])) == [], "committing nothing reports nothing")


@SCHEDULER_SUITE.check
def check_every_request_gets_its_tokens(factory: SchedulerFactory) -> None:
    drv = _setup(factory, 64, 4, max_num_seqs=5, max_num_batched_tokens=40, max_model_len=512)
    want = {}
    for i in range(12):
        want[f"r{i}"] = 1 + (i * 5) % 9
        drv.sched.add(
            make_request(f"r{i}", 1 + (i * 13) % 37, max_tokens=want[f"r{i}"], ignore_eos=True)
        )
    expect(
        drv.sched.num_unfinished == 12, f"num_unfinished after 12 adds: {drv.sched.num_unfinished}"
    )
    drv.run()
    for rid, n in want.items():
        comp = drv.completions[(rid, 0)]
        expect(comp.finish_reason == "length" and len(comp.token_ids) == n, f"{rid}: {comp}")
    _expect_pool_is_whole(drv, 64, 4)


@SCHEDULER_SUITE.check
def check_chunked_prefill_fills_budget(factory: SchedulerFactory) -> None:
    drv = _setup(factory, 256, 16, max_num_batched_tokens=1024, max_model_len=4096)
    for i in range(3):
        drv.sched.add(make_request(f"p{i}", 800, max_tokens=4, ignore_eos=True))
    for _ in range(2):
        plan = drv.schedule()
        expect(
            plan.num_batched_tokens == 1024,
            f"round {plan.step_id} used {plan.num_batched_tokens} of 1024",
        )
        drv.commit(plan)
    drv.run()


@SCHEDULER_SUITE.check
def check_decodes_not_starved_by_long_prefill(factory: SchedulerFactory) -> None:
    drv = _setup(factory, 256, 4, max_num_batched_tokens=64, long_prefill_token_threshold=16)
    drv.sched.add(make_request("short", 4, max_tokens=30, ignore_eos=True))
    drv.step()
    drv.sched.add(make_request("long", 600, max_tokens=2, ignore_eos=True))
    while ("short", 0) not in drv.completions:
        plan = drv.schedule()
        expect(
            any(c.request_id == "short" for c in plan.all_chunks()),
            f"decode starved in round {plan.step_id}",
        )
        drv.commit(plan)
    drv.run()


@SCHEDULER_SUITE.check
def check_stop_rules_are_per_request(factory: SchedulerFactory) -> None:
    scripts = {
        "eos": [5, 6, EOS, 7, 8],
        "stop": [5, 42, 6, 7, 8],
        "length": [5, 6, 7, 8, 9],
        "ignore": [EOS, 5, EOS, 6, 7],
        "min": [EOS, 5, 42, EOS, 6],
    }
    drv = _setup(factory, 64, 4, max_num_seqs=8)
    drv.tokens = lambda c: [scripts[c.request_id][c.output_position]]
    drv.sched.add(make_request("eos", 3, max_tokens=5))
    drv.sched.add(make_request("stop", 6, max_tokens=5, stop_token_ids=[42]))
    drv.sched.add(make_request("length", 9, max_tokens=4))
    drv.sched.add(make_request("ignore", 4, max_tokens=5, ignore_eos=True))
    drv.sched.add(make_request("min", 5, max_tokens=5, min_tokens=3, stop_token_ids=[42]))
    drv.run()
    got = {k[0]: (v.finish_reason, v.stop_reason, v.token_ids) for k, v in drv.completions.items()}
    expect(got["eos"] == ("stop", None, [5, 6, EOS]), f"EOS: {got['eos']}")
    expect(got["stop"] == ("stop", 42, [5, 42]), f"stop id: {got['stop']}")
    expect(got["length"] == ("length", None, [5, 6, 7, 8]), f"max_tokens: {got['length']}")
    expect(got["ignore"] == ("length", None, [EOS, 5, EOS, 6, 7]), f"ignore_eos: {got['ignore']}")
    expect(got["min"] == ("stop", None, [EOS, 5, 42, EOS]), f"min_tokens: {got['min']}")


@SCHEDULER_SUITE.check
def check_never_fitting_request_is_finished(factory: SchedulerFactory) -> None:
    drv = _setup(factory, 8, 4, max_model_len=64)
    drv.sched.add(make_request("too-long", 64, max_tokens=1))
    drv.sched.add(make_request("ok", 5, max_tokens=3, ignore_eos=True))
    drv.sched.add(make_request("too-big", 30, max_tokens=4))  # 33 KV positions > 32 slots
    drv.sched.add(make_request("exact", 29, max_tokens=4, ignore_eos=True))  # exactly 32
    drv.step()
    for rid in ("too-long", "too-big"):
        expect((rid, 0) in drv.completions, f"{rid} not reported by the first commit")
        expect(drv.reason(rid) in ("error", "length"), f"{rid}: reason {drv.reason(rid)}")
    drv.run()
    expect(drv.reason("ok") == "length" and drv.reason("exact") == "length", "the queue must go on")
    expect(
        len(drv.completions[("exact", 0)].token_ids) == 4, "the pool-filling request lost tokens"
    )


@SCHEDULER_SUITE.check
def check_abort_in_every_state(factory: SchedulerFactory) -> None:
    drv = _setup(
        factory, 64, 4, max_num_seqs=2, max_num_batched_tokens=16, long_prefill_token_threshold=8
    )
    sched = drv.sched
    expect(not sched.abort("nobody"), "abort of an unknown id must return False")
    sched.add(make_request("decoding", 3, max_tokens=50, ignore_eos=True))
    sched.add(make_request("prefilling", 60, max_tokens=5, ignore_eos=True))
    sched.add(make_request("waiting", 4, max_tokens=5, ignore_eos=True))
    drv.step()
    drv.step()
    expect(
        sched.abort("prefilling") and sched.abort("waiting"), "abort of live ids must return True"
    )
    outs = drv.step()
    expect(
        {o.request_id for o in outs} >= {"prefilling", "waiting"},
        "aborts not reported by the next commit",
    )
    plan = drv.schedule()
    expect(sched.abort("decoding"), "abort of a scheduled request")
    drv.commit(plan)
    for rid in ("decoding", "prefilling", "waiting"):
        expect(drv.reason(rid) == "abort", f"{rid}: {drv.reason(rid)}")
    expect(not sched.abort("decoding"), "a second abort must return False")
    drv.run()
    for rid in ("decoding", "waiting"):  # ids are reusable
        del drv.completions[(rid, 0)]
        sched.add(make_request(rid, 5, max_tokens=2, ignore_eos=True))
    drv.run()
    expect(drv.reason("decoding") == drv.reason("waiting") == "length", "reused ids must run")
    _expect_pool_is_whole(drv, 64, 4)


@SCHEDULER_SUITE.check
def check_live_id_is_rejected(factory: SchedulerFactory) -> None:
    drv = _setup(factory)
    drv.sched.add(make_request("a", 3, max_tokens=2))
    try:
        drv.sched.add(make_request("a", 3, max_tokens=2))
    except ConfigError:
        pass
    else:
        expect(False, "adding a live request_id again must raise ConfigError")
    drv.run()


@SCHEDULER_SUITE.check
def check_forks_report_n_completions(factory: SchedulerFactory) -> None:
    drv = _setup(factory, 64, 4)
    drv.sched.add(make_request("fork", 6, n=3, max_tokens=5, ignore_eos=True))
    drv.sched.add(make_request("solo", 2, max_tokens=3, ignore_eos=True))
    drv.run()
    comps = [drv.completions.get(("fork", i)) for i in range(3)]
    expect(
        all(c is not None and len(c.token_ids) == 5 for c in comps), f"fork completions: {comps}"
    )
    seqs = {tuple(c.token_ids) for c in comps if c is not None}
    expect(len(seqs) == 3, "completions of a fork must each get their own tokens")
    _expect_pool_is_whole(drv, 64, 4)


@SCHEDULER_SUITE.check
def check_tiny_pool_finishes_everything(factory: SchedulerFactory) -> None:
    drv = _setup(factory, 10, 4, max_num_seqs=6, max_num_batched_tokens=24)
    for i in range(14):
        drv.sched.add(
            make_request(
                f"t{i}", 2 + i % 9, max_tokens=3 + i % 7, n=1 + (i % 5 == 0), ignore_eos=True
            )
        )
    drv.run()
    for i in range(14):
        for j in range(1 + (i % 5 == 0)):
            comp = drv.completions[(f"t{i}", j)]
            expect(len(comp.token_ids) == 3 + i % 7, f"t{i}#{j}: {len(comp.token_ids)} tokens")
    _expect_pool_is_whole(drv, 10, 4)


@SCHEDULER_SUITE.check
def check_prefix_hit_leaves_a_token_to_compute(factory: SchedulerFactory) -> None:
    drv = _setup(factory, 64, 4)
    drv.sched.add(make_request("first", 12, prompt_seed="same", max_tokens=2))
    drv.run()
    drv.sched.add(make_request("again", 12, prompt_seed="same", max_tokens=2))
    plan = drv.schedule()
    (chunk,) = plan.all_chunks()
    expect(
        chunk.start <= 11 and chunk.start + chunk.num_tokens == 12,
        f"prefix hit chunk {chunk.start}+{chunk.num_tokens}",
    )
    drv.commit(plan)
    drv.run()


@SCHEDULER_SUITE.check
def check_random_operation_sequences(factory: SchedulerFactory) -> None:
    for seed in range(6):
        rng = random.Random(seed)
        drv = _setup(
            factory,
            12,
            4,
            max_num_seqs=4,
            max_num_batched_tokens=20,
            max_model_len=64,
            long_prefill_token_threshold=rng.choice([0, 6]),
        )
        drv.tokens = random_tokens(seed, eos_rate=0.15)
        live: list[str] = []
        for k in range(120):
            op = rng.random()
            if op < 0.3:
                rid = f"s{seed}-{k}"
                drv.sched.add(
                    make_request(
                        rid,
                        rng.randint(1, 20),
                        max_tokens=rng.randint(1, 12),
                        n=rng.choice([1, 1, 1, 2]),
                        min_tokens=rng.choice([0, 1]),
                    )
                )
                live.append(rid)
            elif op < 0.4 and live:
                drv.sched.abort(live.pop(rng.randrange(len(live))))
            else:
                drv.step()
        drv.run()
        expect(not drv.sched.has_unfinished(), f"seed {seed}: unfinished at the end")
        _expect_pool_is_whole(drv, 12, 4)


def _accept_every_draft(seed: int) -> Callable[[SchedulePlan], StepResult]:
    """A fake step that accepts every draft: the host's (``spec_token_ids``) and all of a
    chunk's draft room (the runner "drafts" it full), plus one bonus token — the fastest
    way to each request's length limit."""
    rng = random.Random(seed)

    def step(plan: SchedulePlan) -> StepResult:
        tokens: list[list[int]] = []
        drafted: list[int] = []
        for c in plan.all_chunks():
            n = c.num_samples + len(c.spec_token_ids) + c.draft_room if c.sample else 0
            fresh = [rng.randrange(1, 100) for _ in range(n - len(c.spec_token_ids))]
            tokens.append([*c.spec_token_ids, *fresh])
            drafted.append(c.draft_room if c.sample else 0)
        return StepResult(tokens, num_drafted=drafted if any(drafted) else [])

    return step


@SCHEDULER_SUITE.check
def check_no_chunk_reaches_past_the_length_limit(factory: SchedulerFactory) -> None:
    """Without drafts and with draft room (``reserve_drafts``), where the scheduler offers
    it, every draft accepted: no chunk, room included, is fed past ``length_limit - 1``
    (the driver checks every plan), near ``max_tokens`` and near ``max_model_len`` alike,
    and every request gets exactly its tokens."""
    for mode in ("plain", "room"):
        drv = _setup(factory, 64, 4, max_num_seqs=6, max_num_batched_tokens=48, max_model_len=40)
        sched = drv.sched
        reserve = getattr(sched, "reserve_drafts", None)
        if mode == "room" and callable(reserve):
            reserve(5)
        drv.model = _accept_every_draft(7)
        want: dict[str, int] = {}
        for i in range(12):  # prompts of 3-35 tokens; max_tokens 1-9, or past max_model_len
            prompt, max_tokens = 3 + (i * 11) % 33, (1 + i % 9 if i % 4 else None)
            want[f"L{i}"] = 40 - prompt if max_tokens is None else min(max_tokens, 40 - prompt)
            sched.add(make_request(f"L{i}", prompt, max_tokens=max_tokens, ignore_eos=True))
        for _ in range(200):
            if not sched.has_unfinished():
                break
            drv.step()
        drv.run()
        for rid, n in want.items():
            comp = drv.completions[(rid, 0)]
            expect(
                comp.finish_reason == "length" and len(comp.token_ids) == n,
                f"{mode} drafts: {rid} ended {comp.finish_reason} with {len(comp.token_ids)} of {n} tokens",
            )


@SCHEDULER_SUITE.check
def check_results_follow_the_batch_order(factory: SchedulerFactory) -> None:
    """A step's ``token_ids[i]`` belongs to chunk ``i`` of the batch
    (``plan.all_chunks()``: decode rows first, then records) and reaches that chunk's
    sequence: with rounds that mix decode rows, records that read their history
    (penalties), prefills and forks, each token is a function of its sequence and output
    position, and every completion must be exactly its own tokens."""
    def token(sid: str, position: int) -> int:
        return 1 + (sum(map(ord, sid)) * 7 + position * 13) % 97

    drv = _setup(factory, 96, 4, max_num_seqs=8, max_num_batched_tokens=24, max_model_len=64)
    drv.tokens = lambda c: [token(c.request_id if j == 0 else f"{c.request_id}#{j}", c.output_position)
                            for j in range(c.num_samples)]
    wants: dict[tuple[str, int], int] = {}
    for i in range(14):
        n = 2 if i % 5 == 4 else 1
        penalty = 0.5 if i % 3 == 0 else 0.0  # reads its history: a record, not a decode row
        drv.sched.add(make_request(f"b{i}", 3 + (i * 5) % 17, max_tokens=4 + i % 6, n=n, ignore_eos=True,
                                   arrival=float(i), presence_penalty=penalty))
        for j in range(n):
            wants[(f"b{i}", j)] = 4 + i % 6
        drv.step()
    drv.run()
    for (rid, index), count in wants.items():
        got = drv.completions.get((rid, index))
        expect(got is not None, f"{rid}[{index}] never reported")
        assert got is not None
        sid = rid if index == 0 else f"{rid}#{index}"
        expect(list(got.token_ids) == [token(sid, p) for p in range(count)],
               f"{rid}[{index}]: tokens {list(got.token_ids)} are not its own")
