"""The fairness rule: one request (a parent and its n - 1 fork children) never holds every
running seat while another request waits; the seats it yields cost recompute, not output."""

from __future__ import annotations

from typing import Any

import pytest

from deepinfer_kit import EngineConfig, SamplingParams, build_engine
from deepinfer_kit.request import Request
from deepinfer_kit.sched.policies import fair_share_victim

SEATS = 8


def _engine(**kw: Any) -> Any:
    return build_engine(EngineConfig(model="tiny", num_blocks=512, block_size=8, max_model_len=256,
                                     max_num_seqs=SEATS, **kw))


def _big() -> SamplingParams:
    return SamplingParams(n=SEATS, max_tokens=120, ignore_eos=True, temperature=1.0, seed=7)


def _small() -> SamplingParams:
    return SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)


def _run_until(engine: Any, want: str) -> tuple[int, dict[str, Any]]:
    finished: dict[str, Any] = {}
    for step in range(1, 10_000):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if want in finished:
            return step, finished
    raise AssertionError("never finished")


def test_a_small_request_is_served_while_n_equals_max_num_seqs_runs() -> None:
    engine = _engine()
    engine.add_request("big", "a long story " * 3, _big())
    while engine.scheduler.num_running < SEATS:  # the fork took every seat
        engine.step()
    engine.add_request("small", "hi", _small())
    steps, finished = _run_until(engine, "small")
    assert "big" not in finished  # still running: the small one did not wait for it
    assert steps <= 12, steps  # a prefill and four decodes, with slack; without the rule ~120
    for _ in range(5_000):  # bounded: a lost sequence fails the test instead of hanging it
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            finished[out.request_id] = out
    assert not engine.has_unfinished_requests()
    engine.flush()
    big = finished["big"]
    assert [len(c.token_ids) for c in big.outputs] == [120] * SEATS
    engine.check_idle()
    # The seat it yielded cost recompute only: seeded completions equal a run alone.
    alone = _engine()
    alone.add_request("big", "a long story " * 3, _big())
    (solo,) = [o for o in alone.run() if o.request_id == "big"]
    assert [c.token_ids for c in big.outputs] == [c.token_ids for c in solo.outputs]


def _req(rid: str, n: int = 1, parent: str | None = None, out: int = 1) -> Request:
    r = Request(request_id=rid, prompt_token_ids=[1, 2, 3], params=SamplingParams(n=n, temperature=1.0),
                parent_id=parent)
    r.output_token_ids.extend([5] * out)
    return r


@pytest.mark.parametrize("seats", [2, 4, 8, 9])
def test_the_rule_picks_the_hog_down_to_half_and_never_in_vain(seats: int) -> None:
    family = [_req("A", n=seats, out=1)] + [_req(f"A#{j}", n=seats, parent="A") for j in range(1, seats)]
    head = _req("B", out=0)
    assert fair_share_victim(family, head, 1, 0, seats) is family[-1]  # the member admitted last
    assert fair_share_victim(family, family[3 % seats], 1, 0, seats) is None  # its own family
    half = family[: seats // 2]
    assert fair_share_victim(half, head, 1, seats - len(half), seats) is None  # at its share
    big_head = _req("C", n=seats, out=0)
    assert fair_share_victim(family, big_head, seats, 0, seats) is None  # cannot free enough
    unforked = [_req("D", n=seats, out=0)]  # holds n seats, its children not born yet
    assert fair_share_victim(unforked, head, 1, 0, seats) is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_yielded_seats_never_change_seeded_outputs_nor_lose_a_request(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import random

    from deepinfer_kit.sched import batching

    yielded: list[str] = []
    real = batching.yield_seat

    def counting(state: Any, entry: Any, victim: Request) -> int:
        yielded.append(victim.request_id)
        return real(state, entry, victim)

    monkeypatch.setattr(batching, "yield_seat", counting)

    rng = random.Random(seed)
    reqs = [(f"r{i}", "p" * rng.randint(1, 20), SamplingParams(
        n=rng.choice([1, 1, 2, 3, 4]), max_tokens=rng.randint(2, 14), ignore_eos=True, temperature=1.0,
        seed=rng.randrange(1000))) for i in range(12)]

    def run(max_num_seqs: int) -> dict[str, list[list[int]]]:
        traces: list[Any] = []
        engine = build_engine(EngineConfig(model="tiny", num_blocks=256, block_size=8, max_model_len=64,
                                           max_num_seqs=max_num_seqs), trace=traces.append)
        got: dict[str, list[list[int]]] = {}
        pending = list(reqs)
        arrivals = random.Random(seed)
        for _ in range(5_000):
            if pending and arrivals.random() < 0.5:  # arrivals interleaved with rounds
                engine.add_request(*pending.pop(0))
            if not pending and not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = [c.token_ids for c in out.outputs]
        engine.flush()
        engine.check_idle()
        for t in traces:  # a sequence that yielded its seat runs no chunk in that round
            assert not {c.request_id for c in t.chunks} & set(t.preempted), t.step_id
        return got

    tight = run(4)
    assert yielded, "the seed never exercised the rule"
    roomy = run(64)
    assert set(tight) == {r[0] for r in reqs}
    for rid, params in ((r[0], r[2]) for r in reqs):
        assert [len(t) for t in tight[rid]] == [params.max_tokens] * params.n
        assert tight[rid] == roomy[rid], rid
