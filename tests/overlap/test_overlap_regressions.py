"""Asynchronous-scheduling bugs of real engines (TESTING.md §3, items 9-13, and the
issue's list), each pinned by a targeted scenario under the overlapped engine."""

from __future__ import annotations

from typing import Any

from deepinfer_kit import Engine, RequestOutput, SamplingParams, build_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _drive(engine: Engine, before_step: dict[int, list[tuple[str, str, list[int], SamplingParams]]],
           ) -> dict[str, list[RequestOutput]]:
    """Step to the end; ``before_step[k]`` lists ``("add"|"abort", id, prompt, params)``."""
    outs: dict[str, list[RequestOutput]] = {}
    step = 0
    while engine.has_unfinished_requests() or step <= max(before_step, default=0):
        for op, rid, prompt, params in before_step.get(step, []):
            if op == "add":
                engine.add_request(rid, prompt, params)
            else:
                engine.abort(rid)
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        step += 1
        assert step < 500
    for out in engine.flush():
        outs.setdefault(out.request_id, []).append(out)
    engine.check_idle()
    return outs


def _tokens(outs: dict[str, list[RequestOutput]]) -> dict[str, list[tuple[tuple[int, ...], Any]]]:
    return {rid: [(tuple(c.token_ids), c.finish_reason) for c in o[-1].outputs]
            for rid, o in outs.items()}


def _both(config: dict[str, Any], script: dict[int, list[Any]]) -> tuple[Any, Any]:
    sync = _tokens(_drive(build_engine(overlap=False, **config), script))
    over = _tokens(_drive(build_engine(overlap=True, **config), script))
    return sync, over


def test_stop_in_flight_and_abort_free_the_blocks_once() -> None:
    """(9) A request stopping in step k has a token in flight in k + 1; aborting it in
    between must not free its blocks a second time."""
    stop_all = SamplingParams(temperature=1.0, seed=3, max_tokens=10, stop_token_ids=list(range(259)))
    script = {0: [("add", "s", [1, 2, 3], stop_all), ("add", "o", [4, 5], GREEDY)],
              2: [("abort", "s", [], GREEDY)]}
    sync, over = _both({"num_blocks": 16, "block_size": 4, "max_model_len": 64}, script)
    assert over == sync and over["s"][0][1] == "stop"


def test_resume_after_preemption_continues_from_the_right_tokens() -> None:
    """(10) A preempted request resumes with the tokens it had committed (no stale or
    duplicated ids): a pool of 12 blocks for four 20-token requests forces preemption."""
    config = {"num_blocks": 12, "block_size": 4, "max_model_len": 40, "max_num_seqs": 4,
              "enable_prefix_caching": False}
    script = {0: [("add", f"r{i}", [10 + i] * 9, GREEDY) for i in range(4)]}
    traces: list[Any] = []
    engine = build_engine(overlap=True, **config, trace=traces.append)
    over = _tokens(_drive(engine, script))
    sync = _tokens(_drive(build_engine(overlap=False, **config), script))
    assert any(t.preempted for t in traces), "the pool did not force a preemption"
    assert over == sync


def test_a_finished_requests_blocks_wait_for_its_in_flight_step() -> None:
    """(11) ``a`` stops (a stop token) at the commit of step k while step k + 1, already launched,
    still writes its (discarded) token's KV: its blocks go back to the pool only when
    k + 1 commits, never while a step reading them is in flight. ``b``, admitted into a
    pool with only ``a``'s blocks to spare, then gets the synchronous engine's tokens."""
    short = SamplingParams(temperature=1.0, seed=1, max_tokens=8, stop_token_ids=list(range(259)))
    config = {"num_blocks": 6, "block_size": 4, "max_model_len": 24, "enable_prefix_caching": False}
    engine = build_engine(overlap=True, **config)
    engine.add_request("a", list(range(1, 12)), short)
    free: list[tuple[int, bool]] = []
    while engine.has_unfinished_requests():
        done = any(o.finished for o in engine.step())
        free.append((engine.cache.num_free_blocks, done))
    engine.flush()
    engine.check_idle()
    finish = next(i for i, (_, done) in enumerate(free) if done)
    assert free[finish][0] < engine.cache.num_free_blocks, (
        f"a's blocks were free while its last step was in flight: {free}")
    script = {0: [("add", "a", list(range(1, 12)), short)],
              1: [("add", "b", list(range(30, 41)), GREEDY)]}
    sync, over = _both(config, script)
    assert over == sync and len(over["b"][0][0]) == 12


def test_penalties_see_the_in_flight_token() -> None:
    """Penalties and ``min_tokens`` read a row's output history: under overlap the
    newest token is still in flight when the round is planned, and the runner must add
    it before sampling — every row's history is exactly as long as its output position
    (the sampler is spied on), and the outputs equal the synchronous engine's."""
    params = SamplingParams(temperature=0.7, seed=5, presence_penalty=1.5, repetition_penalty=1.5,
                            min_tokens=6, max_tokens=16, ignore_eos=True)
    script = {0: [("add", f"p{i}", [7 + i, 8, 9], params) for i in range(3)]}
    engine = build_engine(overlap=True, num_blocks=32, block_size=4, max_model_len=64)
    sampler = engine.runner.sampler
    seen: list[tuple[int, int]] = []

    def spy(logits: Any, batch: Any) -> Any:
        seen.extend((len(h), p) for h, p in zip(batch.output_token_ids, batch.positions))
        return sampler(logits, batch)

    engine.runner.sampler = spy
    over = _tokens(_drive(engine, script))
    sync = _tokens(_drive(build_engine(overlap=False, num_blocks=32, block_size=4, max_model_len=64),
                          script))
    assert len(seen) == 3 * 16 and all(length == pos for length, pos in seen), seen
    assert over == sync


def test_a_reused_request_id_never_reads_the_aborted_requests_token() -> None:
    """(13) No ring of pending tokens to wrap: in-flight tokens are keyed by the
    scheduler's sequence id, which differs when a user id is reused after an abort while
    the aborted request's last token is still in flight."""
    script = {0: [("add", "x", [1, 2, 3], GREEDY), ("add", "y", [9, 9], GREEDY)],
              3: [("abort", "x", [], GREEDY), ("add", "x", [50, 60, 70, 80], GREEDY)]}
    sync, over = _both({"num_blocks": 32, "block_size": 4, "max_model_len": 64}, script)
    assert over == sync
    fresh = _tokens(_drive(build_engine(overlap=True, num_blocks=32, block_size=4, max_model_len=64),
                           {0: [("add", "x", [50, 60, 70, 80], GREEDY)]}))
    assert over["x"] == fresh["x"]
