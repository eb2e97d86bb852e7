"""Conformance suite for Sampler: greedy equivalences, ties at the top-k cut, -inf logits,
tokens inside the filtered set, seeds and batch invariance, penalties, ``min_tokens``,
logprobs, and a small distribution check against the float64 spec.

Every check builds fresh samplers from ``factory()`` and uses CPU tensors.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import attrs
import torch

from deepinfer_kit.errors import InvariantError
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.protocols import Sampler
from deepinfer_kit.sample.records import SamplingBatch
from deepinfer_kit.sample.reference import filtered_distribution
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["SamplerFactory", "SAMPLER_SUITE", "make_batch", "random_params", "total_variation"]

SamplerFactory = Callable[[], Sampler]
"""``factory()`` -> a sampler (CPU tensors are used by the checks)."""

SAMPLER_SUITE: Suite[SamplerFactory] = Suite("Sampler", "factory() -> Sampler")

_NEG_INF = float("-inf")


make_batch = SamplingBatch.build
"""A batch of the given rows (:meth:`SamplingBatch.build`, under the name the suites use)."""


def random_params(rnd: random.Random, vocab: int, seed: int | None) -> SamplingParams:
    """A random mix of temperature / top-k / top-p / min-p (sometimes greedy)."""
    return SamplingParams(
        temperature=rnd.choice([0.0, 0.3, 0.7, 1.0, 1.0, 1.6]),
        top_k=rnd.choice([0, 0, -1, 1, 2, 7, vocab // 3, vocab - 1, vocab, vocab + 5]),
        top_p=rnd.choice([1.0, 1.0, 0.95, 0.8, 0.5, 0.1]),
        min_p=rnd.choice([0.0, 0.0, 0.02, 0.2, 0.9]),
        seed=seed,
    )


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    """``0.5 * sum |p - q|`` of two distributions over the same support."""
    return 0.5 * float((p.double() - q.double()).abs().sum())


def _draw(factory: SamplerFactory, logits: torch.Tensor, batch: SamplingBatch) -> list[int]:
    tokens = factory()(logits, batch).token_ids
    expect(tokens.shape == (logits.shape[0],), f"token_ids shape: got {tuple(tokens.shape)}")
    expect(tokens.dtype == torch.int64, f"token_ids dtype: got {tokens.dtype}")
    values: list[int] = tokens.tolist()
    expect(all(0 <= t < logits.shape[1] for t in values), f"token outside [0, V): {values}")
    return values


@SAMPLER_SUITE.check
def check_greedy_is_argmax(factory: SamplerFactory) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    result = factory()(logits, make_batch([SamplingParams(temperature=0.0)] * 6))
    expect(result.token_ids.shape == (6,), f"token_ids shape: got {tuple(result.token_ids.shape)}")
    expect(result.token_ids.dtype == torch.int64, f"token_ids dtype: got {result.token_ids.dtype}")
    expect(
        torch.equal(result.token_ids, logits.argmax(dim=-1)),
        "greedy rows must return the argmax",
    )
    expect(result.logprobs is None, "logprobs must be None when no row asked for them")


@SAMPLER_SUITE.check
def check_greedy_equivalences_with_ties_and_neg_inf(factory: SamplerFactory) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 40, generator=gen)
    logits[:, ::3] = _NEG_INF
    logits[1, 10:14] = 9.0  # a tie at the top: the lowest id wins
    logits[2] = _NEG_INF
    logits[2, 33] = -1e30
    logits[3] = _NEG_INF  # nothing finite: the argmax is 0
    variants = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=1),
        SamplingParams(top_k=1, temperature=1.7, top_p=0.3, seed=5),
        SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.5),
    ]
    expected = logits.argmax(dim=-1).tolist()
    for params in variants:
        got = _draw(factory, logits, make_batch([params] * 8))
        expect(got == expected, f"{params}: expected the argmax {expected}, got {got}")


@SAMPLER_SUITE.check
def check_ties_at_topk_cut_keep_exactly_k(factory: SamplerFactory) -> None:
    draws = 600
    cases = [([5.0, 4.0, 4.0, 4.0, 4.0, 4.0, 0.0, 0.0], 3), ([1.0] * 10, 2), ([2.0, 2.0, 2.0], 2)]
    for row, k in cases:
        logits = torch.tensor([row] * draws)
        params = [SamplingParams(top_k=k, temperature=5.0, seed=s) for s in range(draws)]
        seen = set(_draw(factory, logits, make_batch(params)))
        expect(len(seen) == k, f"top_k={k} over {row}: {len(seen)} distinct tokens {sorted(seen)}")
        expect(max(row) == min(row) or 0 in seen, f"top_k={k} over {row} never drew the max")


@SAMPLER_SUITE.check
def check_topk_alone_equals_topk_with_top_p_one(factory: SamplerFactory) -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(32, 100, generator=gen)
    alone = _draw(factory, logits, make_batch([SamplingParams(top_k=9, seed=s) for s in range(32)]))
    with_p = [SamplingParams(top_k=9, top_p=1.0, seed=s) for s in range(32)]
    expect(alone == _draw(factory, logits, make_batch(with_p)), "top_p=1 changed top-k draws")


@SAMPLER_SUITE.check
def check_tokens_inside_filtered_set(factory: SamplerFactory) -> None:
    rnd = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    vocab = 97
    logits = torch.randn(300, vocab, generator=gen) * rnd.choice([1.0, 3.0])
    logits[logits < -2.0] = _NEG_INF
    params = [random_params(rnd, vocab, s if s % 4 else None) for s in range(300)]
    got = _draw(factory, logits, make_batch(params, generator=torch.Generator().manual_seed(4)))
    for i, (token, p) in enumerate(zip(got, params)):
        allowed = filtered_distribution(logits[i], p) > 0
        expect(bool(allowed[token]), f"row {i} {p}: token {token} is outside the filtered set")


@SAMPLER_SUITE.check
def check_neg_inf_never_drawn_never_nan(factory: SamplerFactory) -> None:
    rnd = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 30, generator=gen)
    logits[torch.rand(64, 30, generator=gen) < 0.8] = _NEG_INF
    logits[:, 7] = torch.where(logits[:, 7].isinf(), torch.zeros(64), logits[:, 7])
    params = [random_params(rnd, 30, s) for s in range(64)]
    params = [attrs.evolve(p, logprobs=2) for p in params]
    result = factory()(logits, make_batch(params))
    tokens = result.token_ids.tolist()
    expect(all(bool(torch.isfinite(logits[i, t])) for i, t in enumerate(tokens)), "drew a -inf logit")
    expect(result.logprobs is not None and not bool(result.logprobs.isnan().any()), "NaN logprob")


@SAMPLER_SUITE.check
def check_seeds_reproducible_and_distinct(factory: SamplerFactory) -> None:
    logits = torch.zeros(64, 1000)
    params = [SamplingParams(seed=s) for s in range(64)]
    first = _draw(factory, logits, make_batch(params))
    expect(first == _draw(factory, logits, make_batch(params)), "same seeds gave different tokens")
    expect(len(set(first)) >= 48, f"64 seeds on a flat row gave only {len(set(first))} tokens")
    one_seed = make_batch([SamplingParams(seed=7)] * 64, positions=list(range(64)))
    by_position = _draw(factory, logits, one_seed)
    expect(len(set(by_position)) >= 48, "positions 0..63 of one seed repeated tokens")


@SAMPLER_SUITE.check
def check_seeded_rows_are_batch_invariant(factory: SamplerFactory) -> None:
    rnd = random.Random(6)
    gen = torch.Generator().manual_seed(6)
    vocab = 257
    targets = [
        SamplingParams(seed=11),
        SamplingParams(seed=12, top_k=20, temperature=0.8),
        SamplingParams(seed=13, top_p=0.7),
        SamplingParams(seed=14, top_k=50, top_p=0.9, min_p=0.05),
        SamplingParams(seed=15, min_p=0.1, repetition_penalty=1.3, frequency_penalty=0.4),
    ]
    for target in targets:
        row = torch.randn(1, vocab, generator=gen) * 2
        history = ([1, 2, 3], [4, 4, 5])
        alone = make_batch([target], positions=[9], prompts=[history[0]], outputs=[history[1]])
        expected = _draw(factory, row, alone)[0]
        for slot in (0, 31, 63):
            others = [random_params(rnd, vocab, rnd.choice([None, rnd.randrange(99)])) for _ in range(64)]
            others[slot] = target
            logits = torch.randn(64, vocab, generator=gen) * 3
            logits[slot] = row[0]
            positions = [rnd.randrange(50) for _ in range(64)]
            positions[slot] = 9
            prompts: list[list[int]] = [[] for _ in range(64)]
            outputs: list[list[int]] = [[] for _ in range(64)]
            prompts[slot], outputs[slot] = history[0], history[1]
            batch = make_batch(others, positions=positions, prompts=prompts, outputs=outputs)
            got = _draw(factory, logits, batch)[slot]
            expect(got == expected, f"{target} at slot {slot} of 64 drew {got}, alone {expected}")


@SAMPLER_SUITE.check
def check_unseeded_rows_follow_the_generator(factory: SamplerFactory) -> None:
    logits = torch.zeros(32, 500)
    params = [SamplingParams()] * 32

    def run(seed: int) -> list[int]:
        return _draw(factory, logits, make_batch(params, generator=torch.Generator().manual_seed(seed)))

    expect(run(1) == run(1), "the same generator state gave different tokens")
    expect(run(1) != run(2), "different generator states gave the same 32 tokens")


@SAMPLER_SUITE.check
def check_penalty_semantics(factory: SamplerFactory) -> None:
    base = [3.0, 2.9, 2.0, 1.0]
    neg = [-1.0, -1.2, -3.0, -4.0]
    cases = [  # (logits, params, prompt, output, expected greedy token)
        (base, {"repetition_penalty": 1.5}, [0], [], 1),  # prompt tokens count
        (base, {"repetition_penalty": 1.5}, [], [0], 1),
        (neg, {"repetition_penalty": 1.5}, [0], [], 1),  # negative logits are multiplied
        (base, {"frequency_penalty": 0.06}, [], [0, 0], 1),  # per occurrence
        (base, {"frequency_penalty": 0.04}, [], [0, 0], 0),
        (base, {"presence_penalty": 0.11}, [], [0, 0, 0], 1),  # once, whatever the count
        (base, {"presence_penalty": 0.04}, [], [0, 0, 0], 0),
        (base, {"frequency_penalty": 2.0, "presence_penalty": 2.0}, [0, 0, 0], [], 0),
    ]
    for logits, kwargs, prompt, output, want in cases:
        params = SamplingParams(temperature=0.0, **kwargs)  # type: ignore[arg-type]
        batch = make_batch([params], prompts=[prompt], outputs=[output])
        got = _draw(factory, torch.tensor([logits]), batch)[0]
        expect(got == want, f"{kwargs} prompt={prompt} output={output} over {logits}: got {got}")


@SAMPLER_SUITE.check
def check_min_tokens_masks_eos_and_stops(factory: SamplerFactory) -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0]] * 4)
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1]),
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True),
        SamplingParams(min_tokens=2, stop_token_ids=[1, 2], seed=3),
    ]
    outputs = [[3, 3], [3, 3, 3], [3], [3]]
    got = _draw(factory, logits, make_batch(params, outputs=outputs, eos=[0, 0, 0, 0]))
    expect(got[:3] == [2, 0, 0], f"min_tokens masking: expected [2, 0, 0], got {got[:3]}")
    expect(got[3] == 3, f"EOS 0 and stops 1, 2 masked: only token 3 is left, got {got[3]}")


@SAMPLER_SUITE.check
def check_logprobs_from_raw_logits(factory: SamplerFactory) -> None:
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(5, 60, generator=gen)
    params = [
        SamplingParams(logprobs=3, seed=1, repetition_penalty=2.0, temperature=0.5),
        SamplingParams(logprobs=0, seed=2, top_k=4),
        SamplingParams(temperature=0.0),
        SamplingParams(logprobs=5, top_p=0.5, seed=3),
        SamplingParams(logprobs=1, presence_penalty=1.0, temperature=0.0),
    ]
    batch = make_batch(params, outputs=[[0, 1], [], [], [], [int(logits[4].argmax())]])
    result = factory()(logits, batch)
    lp = torch.log_softmax(logits.double(), dim=-1)
    tokens = result.token_ids
    expect(result.logprobs is not None and result.ranks is not None, "logprobs were asked for")
    assert result.logprobs is not None and result.ranks is not None
    assert result.top_token_ids is not None and result.top_logprobs is not None
    chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    expect(torch.allclose(result.logprobs.double(), chosen, atol=1e-4), "chosen logprob is not raw")
    ranks = (logits > logits.gather(1, tokens.unsqueeze(1))).sum(dim=-1) + 1
    expect(torch.equal(result.ranks.cpu(), ranks), f"ranks {result.ranks.tolist()} != {ranks.tolist()}")
    expect(tuple(result.top_token_ids.shape) == (5, 5), "top_token_ids must be [N, max_logprobs]")
    top = torch.topk(lp, 5, dim=-1)
    expect(torch.equal(result.top_token_ids.cpu(), top.indices), "top token ids are not the top 5")
    expect(torch.allclose(result.top_logprobs.double(), top.values, atol=1e-4), "top logprobs differ")


@SAMPLER_SUITE.check
def check_inputs_untouched_and_shapes_checked(factory: SamplerFactory) -> None:
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 20, generator=gen).to(torch.bfloat16)
    kept = logits.clone()
    params = [SamplingParams(repetition_penalty=1.5, seed=1), SamplingParams(min_tokens=2, seed=2), SamplingParams()]
    sampler = factory()
    sampler(logits, make_batch(params, prompts=[[1, 2], [], []], outputs=[[3], [], []], eos=[None, 4, None]))
    expect(torch.equal(logits, kept), "the sampler mutated its input logits")
    try:
        sampler(torch.zeros(2, 20), make_batch(params))
    except InvariantError:
        pass
    else:
        raise AssertionError("3 rows of params for 2 rows of logits must raise InvariantError")


@SAMPLER_SUITE.check
def check_distribution_matches_spec(factory: SamplerFactory) -> None:
    gen = torch.Generator().manual_seed(10)
    row = torch.randn(12, generator=gen) * 1.5
    draws = 3000
    for params in (
        SamplingParams(temperature=0.8, top_k=7, top_p=0.85, min_p=0.05),
        SamplingParams(temperature=1.3, min_p=0.02),
    ):
        batch = make_batch([params] * draws, seeds=list(range(draws)))
        got = torch.bincount(torch.tensor(_draw(factory, row.repeat(draws, 1), batch)), minlength=12)
        tv = total_variation(got / draws, filtered_distribution(row, params))
        expect(tv <= 0.06, f"{params}: total variation {tv:.4f} to the spec over {draws} draws")
