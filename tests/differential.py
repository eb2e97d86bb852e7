"""Random serving workloads and a runner that records every completion, for differential
tests: one engine configuration against another, token for token."""

from __future__ import annotations

import random
from typing import Any

from deepinfer_kit import Engine, RequestOutput, SamplingParams, build_engine

Outcome = dict[str, list[tuple[tuple[int, ...], str | None, Any]]]


def workload(seed: int, num: int, vocab: int = 250) -> list[tuple[str, list[int], SamplingParams]]:
    """``num`` seeded requests mixing greedy, penalties with ``min_tokens``, forks,
    logprobs, frequent stop tokens and shared prefixes; prompt ids in ``[1, vocab)``
    (``vocab`` >= 140, the stop ids' range)."""
    rng = random.Random(seed)
    reqs = []
    for i in range(num):
        kind = rng.random()
        common: dict[str, Any] = {"max_tokens": rng.randint(1, 14), "seed": 1000 + i}
        if kind < 0.3:
            params = SamplingParams(temperature=0.0, **common)
        elif kind < 0.5:  # penalties and min_tokens read the in-flight token
            params = SamplingParams(temperature=0.9, presence_penalty=0.8, frequency_penalty=0.5,
                                    repetition_penalty=1.3, min_tokens=min(2, common["max_tokens"]),
                                    **common)
        elif kind < 0.6:
            params = SamplingParams(temperature=1.0, n=2, top_k=40, **common)
        elif kind < 0.8:
            params = SamplingParams(temperature=0.8, top_p=0.9, logprobs=2, **common)
        else:  # stop tokens frequent enough to stop mid-run
            params = SamplingParams(temperature=1.0, stop_token_ids=list(range(40, 140)), **common)
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 50))]
        if i % 3 == 0:
            prompt = [11] * 20 + prompt[:6]  # prefix hits
        reqs.append((f"r{i}", prompt, params))
    return reqs


def run_workload(reqs: list[tuple[str, list[int], SamplingParams]], overlap: bool = False, *,
         aborts: dict[int, list[str]] | None = None, engine: Engine | None = None,
         **config: Any) -> tuple[Outcome, Engine]:
    """Serve ``reqs`` to the end (aborting ``aborts[step]`` before each step) on
    ``engine`` or a new one built from ``config``; every completion, keyed by request."""
    engine = engine if engine is not None else build_engine(overlap=overlap, **config)
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    outs: list[RequestOutput] = []
    step = 0
    while engine.has_unfinished_requests():
        for rid in (aborts or {}).get(step, []):
            engine.abort(rid)
        outs.extend(engine.step())
        step += 1
        assert step < 5000
    outs.extend(engine.flush())
    engine.check_idle()
    got: Outcome = {}
    for out in outs:
        assert out.request_id not in got, f"{out.request_id} reported twice"
        got[out.request_id] = [
            (tuple(c.token_ids), c.finish_reason,
             [sorted(lp) for lp in c.logprobs] if c.logprobs is not None else None)
            for c in out.outputs
        ]
    return got, engine


