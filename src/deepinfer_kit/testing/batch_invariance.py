"""The batch-invariance suite: an engine in ``batch_invariant=True`` mode must give every
sequence the same logits — compared through its tokens and their top log-probabilities,
bitwise — whatever runs beside it and however the engine is configured.

Each check builds engines with ``factory(**overrides)`` (an :class:`~deepinfer_kit.engine.llm.LLM`;
the factory sets the model, ``batch_invariant=True`` and whatever component it swaps in),
runs a fixed set of prompts (greedy and seeded sampled requests, alternating) and compares
each request's :class:`Trace` with the one it gets **alone** in the factory's default
engine. The matrix:

- batch size and company: every prompt alone, then all together and in random subsets of
  other sizes and orders (``batch_size_and_position``);
- chunked prefill with small token budgets and a prefill-chunk cap, and prefix-cache hits
  versus misses (the same prompts again, prompts sharing a long prefix, the cache off);
- speculative decoding with a prompt-lookup and a self-drafting model drafter (a position
  computed in a verify row versus a decode row; sampled drafts matched against the
  sampler's own draw);
- overlap on, a worker process, the padded static decode path (on CUDA: replayed graphs);
- the static scheduler and the hash prefix index;
- parallel sampling (``n = 2``, seeded: each child keyed by its own seed).

Expert parallelism with EPLB is :func:`check_expert_parallel_with_eplb` (slower: worker
processes), run by the project's slow tests. Tensor parallelism is refused by the mode
(``ConfigError``, :func:`check_tensor_parallel_is_refused`).

Use it on a component of your own::

    def factory(**overrides):
        return LLM("tiny-words", batch_invariant=True, components=Components(scheduler=mine), **overrides)

    BATCH_INVARIANCE_SUITE.run(factory)

and to compare two engines (the kit's scheduler against yours): :func:`expect_same_traces`.
The default engine (``batch_invariant=False``) fails ``batch_size_and_position``: its logits
move by ~1e-6 with the batch (tests/engine/test_batch_invariance.py).
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.testing.suite import Suite, expect

if TYPE_CHECKING:
    from deepinfer_kit.engine.llm import LLM

__all__ = [
    "Trace", "InvariantEngineFactory", "invariance_prompts", "invariance_params", "run_traces",
    "alone_traces", "expect_same_traces", "BATCH_INVARIANCE_SUITE", "check_expert_parallel_with_eplb",
    "check_tensor_parallel_is_refused",
]

InvariantEngineFactory = Callable[..., "LLM"]
"""``factory(**engine_overrides) -> LLM`` in batch-invariant mode."""

_WORDS = ("the old house stood at the edge of a quiet river where light fell on stone and water "
          "while the city road ran long into the night and small boats waited by the bridge").split()

NUM_PROMPTS = 32
MAX_TOKENS = 8
TOP_LOGPROBS = 3


@attrs.frozen(slots=True)
class Trace:
    """What a request produced: per completion, its tokens and, per token, the top
    log-probabilities as ``(token, logprob)`` pairs (floats compared bitwise)."""

    completions: tuple[tuple[tuple[int, ...], tuple[tuple[tuple[int, float], ...], ...]], ...]


def invariance_prompts(count: int = NUM_PROMPTS, *, seed: int = 0) -> list[str]:
    """``count`` prompts of 2 to 60 words (short ones decode beside long prefills), two of
    them sharing a long prefix with an earlier one. Deterministic for ``seed``."""
    rng = random.Random(seed)
    out = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 60))) for _ in range(count)]
    for i in range(2, count, max(3, count // 2)):
        out[i] = out[i - 1] + " " + " ".join(rng.choice(_WORDS) for _ in range(5))
    return out


def invariance_params(count: int = NUM_PROMPTS, *, max_tokens: int = MAX_TOKENS, n: int = 1) -> list[SamplingParams]:
    """Alternating greedy and seeded sampled requests (temperature 0.8, top-p 0.95), each
    asking for its tokens' top log-probabilities; with ``n > 1`` all sampled (a greedy
    request has one completion)."""
    return [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=TOP_LOGPROBS) if i % 2 == 0 and n == 1
        else SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=max_tokens,
                            logprobs=TOP_LOGPROBS, n=n)
        for i in range(count)
    ]


def run_traces(llm: LLM, prompts: Sequence[str], params: Sequence[SamplingParams]) -> list[Trace]:
    """Generate ``prompts`` together in ``llm`` and return each one's :class:`Trace`. The
    prompts go in as token ids, their ASCII bytes (what the embedded models' byte tokenizer
    makes of them; a checkpoint without a tokenizer takes them as they are)."""
    from deepinfer_kit.engine.llm import TokensPrompt

    ids = [TokensPrompt(prompt_token_ids=list(p.encode("ascii"))) for p in prompts]
    outputs = llm.generate(ids, list(params), use_tqdm=False)
    traces = []
    for out in outputs:
        comps = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            tops = tuple(tuple(sorted((t, lp.logprob) for t, lp in pos.items())) for pos in (c.logprobs or ()))
            comps.append((tuple(c.token_ids), tops))
        traces.append(Trace(tuple(comps)))
    return traces


def alone_traces(factory: InvariantEngineFactory, prompts: Sequence[str],
                 params: Sequence[SamplingParams]) -> list[Trace]:
    """Each prompt generated alone (a batch of one) in ``factory()``'s engine: the
    reference every other configuration must reproduce."""
    llm = factory()
    return [run_traces(llm, [p], [s])[0] for p, s in zip(prompts, params)]


def expect_same_traces(expected: Sequence[Trace], got: Sequence[Trace], what: str) -> None:
    """Raise :class:`~deepinfer_kit.testing.suite.ConformanceError` naming ``what`` and the
    first request whose trace differs (its first differing token or log-probability)."""
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        if a == b:
            continue
        detail = "a different number of completions"
        for (ta, la), (tb, lb) in zip(a.completions, b.completions):
            if ta != tb:
                k = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
                detail = f"tokens differ from position {k}: {ta} vs {tb}"
                break
            for k, (x, y) in enumerate(zip(la, lb)):
                if x != y:
                    worst = max((abs(p[1] - q[1]) for p, q in zip(x, y)), default=float("nan"))
                    detail = f"log-probabilities differ at position {k} (by up to {worst:.3g}): {x} vs {y}"
                    break
            else:
                continue
            break
        expect(False, f"{what}: request {i} is not batch-invariant: {detail}")


_Case = tuple[list[str], list[SamplingParams], list[Trace]]
_CACHE: weakref.WeakKeyDictionary[InvariantEngineFactory, _Case] = weakref.WeakKeyDictionary()


def _reference(factory: InvariantEngineFactory) -> _Case:
    """The prompts, their params and their alone traces (computed once per factory)."""
    case = _CACHE.get(factory)
    if case is None:
        prompts, params = invariance_prompts(), invariance_params()
        case = _CACHE[factory] = (prompts, params, alone_traces(factory, prompts, params))
    return case


def _together(factory: InvariantEngineFactory, what: str, **overrides: Any) -> None:
    prompts, params, expected = _reference(factory)
    llm = factory(**overrides)
    try:
        expect_same_traces(expected, run_traces(llm, prompts, params), what)
    finally:
        _close(llm)


def _close(llm: LLM) -> None:
    close = getattr(llm, "close", None)
    if callable(close):
        close()


BATCH_INVARIANCE_SUITE: Suite[InvariantEngineFactory] = Suite(
    "BatchInvariance", "factory(**engine_overrides) -> LLM with batch_invariant=True")


@BATCH_INVARIANCE_SUITE.check
def check_batch_size_and_position(factory: InvariantEngineFactory) -> None:
    prompts, params, expected = _reference(factory)
    llm = factory()
    expect_same_traces(expected, run_traces(llm, prompts, params), f"all {len(prompts)} together")
    rng = random.Random(1)
    for size in (2, 3, 8, 17):
        picked = rng.sample(range(len(prompts)), min(size, len(prompts)))
        got = run_traces(llm, [prompts[i] for i in picked], [params[i] for i in picked])
        expect_same_traces([expected[i] for i in picked], got, f"a batch of {size} in order {picked}")


@BATCH_INVARIANCE_SUITE.check
def check_chunked_prefill(factory: InvariantEngineFactory) -> None:
    _together(factory, "max_num_batched_tokens=64", max_num_batched_tokens=64, max_num_seqs=32)
    _together(factory, "long_prefill_token_threshold=7", long_prefill_token_threshold=7)


@BATCH_INVARIANCE_SUITE.check
def check_prefix_cache_hit_and_miss(factory: InvariantEngineFactory) -> None:
    prompts, params, expected = _reference(factory)
    llm = factory(enable_prefix_caching=True)
    run_traces(llm, prompts[::2], params[::2])  # fill the cache
    expect_same_traces(expected, run_traces(llm, prompts, params), "prompts whose prefixes are cached")
    _together(factory, "the prefix cache off", enable_prefix_caching=False)


@BATCH_INVARIANCE_SUITE.check
def check_speculative_decoding(factory: InvariantEngineFactory) -> None:
    _together(factory, "prompt-lookup speculation (γ=3)", speculative={"drafter": "ngram", "num_draft": 3})
    _together(factory, "self-speculation (1 layer, γ=2)",
              speculative={"drafter": "self", "draft_layers": 1, "num_draft": 2})


@BATCH_INVARIANCE_SUITE.check
def check_overlap_and_worker_process(factory: InvariantEngineFactory) -> None:
    _together(factory, "overlap=True", overlap=True)
    _together(factory, "worker='process'", worker="process")


@BATCH_INVARIANCE_SUITE.check
def check_static_decode_path(factory: InvariantEngineFactory) -> None:
    _together(factory, "static_decode=True (padded rows; graphs on CUDA)", static_decode=True)


@BATCH_INVARIANCE_SUITE.check
def check_scheduler_and_prefix_index(factory: InvariantEngineFactory) -> None:
    _together(factory, "scheduler='static'", scheduler="static")
    _together(factory, "prefix_index='hash'", prefix_index="hash")


@BATCH_INVARIANCE_SUITE.check
def check_parallel_sampling(factory: InvariantEngineFactory) -> None:
    prompts = invariance_prompts(8, seed=3)
    params = invariance_params(8, n=2)
    expected = alone_traces(factory, prompts, params)
    llm = factory()
    expect_same_traces(expected, run_traces(llm, prompts, params), "n=2 requests together")


def check_expert_parallel_with_eplb(factory: InvariantEngineFactory) -> None:
    """An MoE model on two expert-parallel ranks with live rebalancing (every 2 steps, one
    redundant slot per layer, balanced dispatch) equals it on one rank: a copy's expert
    output does not depend on the replica or rank that computed it. Slower (two worker
    processes); not in :data:`BATCH_INVARIANCE_SUITE`."""
    _together(factory, "expert_parallel=2 with EPLB", worker="process", expert_parallel=2,
              eplb={"interval": 2, "window": 2, "num_redundant": 2, "num_gpus": 2, "dispatch": "balanced"})


def check_tensor_parallel_is_refused(factory: InvariantEngineFactory) -> None:
    """``tensor_parallel > 1`` raises ConfigError naming ``batch_invariant``."""
    try:
        llm = factory(tensor_parallel=2, worker="process")
    except ConfigError as err:
        expect("batch_invariant" in str(err), f"the refusal does not name batch_invariant: {err}")
        return
    _close(llm)
    expect(False, "tensor_parallel=2 was accepted in batch-invariant mode")
