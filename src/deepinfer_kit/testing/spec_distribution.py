"""The distribution conformance suite of speculative decoding: a drafter, a verify planner
and a draft verifier together must sample what plain sampling samples.

Speculative decoding may change how fast tokens come, never which: for every sampling
setting the first output positions drawn with drafts must follow the distribution drawn
without them. Each check runs the three components round by round over a toy target model
(:class:`ToyLM`, a small vocabulary) for a few thousand seeded sequences, samples the same
positions plainly, and compares the two samples per position (chi-square homogeneity and
total-variation distance, :mod:`deepinfer_kit.testing.spec_stats`). Greedy settings must
match plain decoding token for token.

A planner that decides how many drafts to verify from values that read the drafted tokens
(a confidence equal to the probability of the token just drawn, say, or a round total
read from confidences computed after the drafts it decides on) fails these checks: the
verify length must be a stopping time of the draft sequence. The planner runs as the
engine runs it (:class:`~deepinfer_kit.spec.planning.RoundPlanner`: a budgeted planner
gets each sequence's previous round's confidences as its budget), over the whole sample
as one batch and, in one check, over batches of a single sequence (where a total read
from the sequence's own later confidences is not diluted by thousands of others).

Use it on your own planner (or drafter, or verifier)::

    def factory(world):
        return toy_model_drafter(world), MyPlanner(), RejectionVerifier(VectorizedSampler("ref"))

    SPECULATIVE_DISTRIBUTION_SUITE.run(factory)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.records import SamplingBatch
from deepinfer_kit.spec.drafters.draw import draw_drafts
from deepinfer_kit.spec.planning import RoundPlanner
from deepinfer_kit.spec.records import DraftProposal
from deepinfer_kit.spec.verify.rows import verify_padded
from deepinfer_kit.testing.spec_stats import SampleComparison, compare_samples
from deepinfer_kit.testing.suite import Suite, expect

if TYPE_CHECKING:
    from deepinfer_kit.spec.protocols import Drafter, DraftSequence, DraftVerifier, VerifyPlanner

__all__ = [
    "ToyLM", "ToyModelDrafter", "toy_model_drafter", "SpeculationFactory", "DistributionReport",
    "speculative_distribution", "check_speculative_distribution", "SPECULATIVE_DISTRIBUTION_SUITE",
]


class ToyLM:
    """A deterministic toy language model: the logits after a context are a fixed random
    function of its last two tokens (a ``[V, V, V]`` table).

    Args:
        vocab: ``V``.
        seed: the table's random seed.
        scale: the logits' standard deviation (larger: peakier distributions).
        table: a ``[V, V, V]`` table to use instead of a random one.
    """

    def __init__(self, vocab: int = 16, *, seed: int = 0, scale: float = 1.5,
                 table: torch.Tensor | None = None) -> None:
        if table is None:
            g = torch.Generator().manual_seed(seed)
            table = torch.randn(vocab, vocab, vocab, generator=g) * scale
        self.vocab = int(table.shape[-1])
        self.table = table.float()

    def logits(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """``[n, V]`` float32 logits of the token after each of ``n`` contexts (each at
        least two tokens long). Pure."""
        a = torch.tensor([c[-2] for c in contexts], dtype=torch.int64)
        b = torch.tensor([c[-1] for c in contexts], dtype=torch.int64)
        return self.table[a, b]

    def perturbed(self, noise: float, seed: int) -> ToyLM:
        """A draft model for this target: its table plus Gaussian noise of std ``noise``
        (close enough that drafts are often accepted, different enough that they are not
        always)."""
        g = torch.Generator().manual_seed(seed)
        return ToyLM(table=self.table + torch.randn(self.table.shape, generator=g) * noise)


@attrs.define(slots=True)
class _Sequence:
    """One sequence of the check (a :class:`DraftSequence`)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    seed: int | None
    eos_token_id: int | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


class ToyModelDrafter:
    """Drafts autoregressively from a :class:`ToyLM` the way the engine's model drafters
    do: each position through :func:`~deepinfer_kit.spec.drafters.draw.draw_drafts` (the request's
    own sampling parameters and seeded stream, the confidence it returns), stopping a
    request once the survival of its drafts falls below ``stop_below`` (the engine's
    draft-model drafter under a threshold planner).

    Args:
        model: the draft model.
        stop_below: the survival under which drafting stops (0: draft all ``γ``).
        generator: random source of unseeded sequences' drafts.
    """

    def __init__(self, model: ToyLM, *, stop_below: float = 0.0,
                 generator: torch.Generator | None = None) -> None:
        self.model = model
        self.stop_below = stop_below
        self.generator = generator

    def propose(self, requests: Sequence[DraftSequence], num_draft: int) -> DraftProposal:
        """See :meth:`Drafter.propose`: ``token_ids [R, γ]``, ``draft_probs [R, γ, V]``
        float64 (``None`` when every request is greedy), ``confidence [R, γ]``."""
        num_req, gamma, vocab = len(requests), num_draft, self.model.vocab
        ids = [[0] * gamma for _ in range(num_req)]
        conf = torch.zeros(num_req, gamma)
        greedy = all(r.params.is_greedy for r in requests)
        probs = None if greedy else torch.zeros(num_req, gamma, vocab, dtype=torch.float64)
        depth = [gamma] * num_req
        survival = [1.0] * num_req
        for j in range(gamma):
            rows = [r for r in range(num_req) if depth[r] > j]
            if not rows:
                break
            logits = self.model.logits([[*requests[r].all_token_ids, *ids[r][:j]] for r in rows])
            tokens, q, c = draw_drafts(logits, [requests[r] for r in rows], [ids[r] for r in rows],
                                       j, greedy=greedy, generator=self.generator)
            for k, (r, tok, cj) in enumerate(zip(rows, tokens, c.tolist())):
                survival[r] *= cj
                if survival[r] < self.stop_below:
                    depth[r] = j  # below the threshold planner's cut: not kept
                    continue
                ids[r][j] = tok
                conf[r, j] = cj
                if probs is not None and q is not None:
                    probs[r, j] = q[k]
        return DraftProposal(torch.tensor(ids, dtype=torch.int64).view(num_req, gamma), depth,
                             probs, conf)


def toy_model_drafter(world: ToyLM, *, noise: float = 0.8, stop_below: float = 0.0,
                      seed: int = 1) -> ToyModelDrafter:
    """A :class:`ToyModelDrafter` over a perturbed copy of ``world`` (its draft model)."""
    return ToyModelDrafter(world.perturbed(noise, seed), stop_below=stop_below,
                           generator=torch.Generator().manual_seed(seed))


SpeculationFactory = Callable[[ToyLM], "tuple[Drafter, VerifyPlanner, DraftVerifier]"]
"""``factory(world)`` -> ``(drafter, planner, verifier)`` speculating on the toy target ``world``."""


@attrs.frozen(slots=True)
class DistributionReport:
    """What one check measured.

    Attributes:
        comparisons: per output position, speculative vs plain (:class:`SampleComparison`).
        num_drafted, num_verified, num_accepted: drafts proposed, sent to verification
            and accepted over the whole run.
    """

    comparisons: tuple[SampleComparison, ...]
    num_drafted: int
    num_verified: int
    num_accepted: int


def _plain(world: ToyLM, params: SamplingParams, prompt: list[int], seeds: list[int | None],
           positions: int, generator: torch.Generator) -> list[list[int]]:
    from deepinfer_kit.sample.vectorized import VectorizedSampler

    sampler = VectorizedSampler(impl="ref")
    outs: list[list[int]] = [[] for _ in seeds]
    for pos in range(positions):
        batch = SamplingBatch([params] * len(seeds), list(seeds), [pos] * len(seeds),
                              [prompt] * len(seeds), [list(o) for o in outs],
                              [None] * len(seeds), generator)
        tokens = sampler(world.logits([prompt + o for o in outs]), batch).token_ids.tolist()
        for o, t in zip(outs, tokens):
            o.append(int(t))
    return outs


def _speculative(world: ToyLM, factory: SpeculationFactory, params: SamplingParams,
                 prompt: list[int], seeds: list[int | None], positions: int, num_draft: int,
                 generator: torch.Generator, batch_size: int | None) -> tuple[list[list[int]], tuple[int, int, int]]:
    drafter, planner, verifier = factory(world)
    rounds = RoundPlanner(planner)
    seqs = [_Sequence(f"s{i}", list(prompt), [], params, s) for i, s in enumerate(seeds)]
    size = batch_size or len(seqs)
    counts = [0, 0, 0]
    for lo in range(0, len(seqs), size):
        _speculate_batch(world, drafter, rounds, verifier, seqs[lo: lo + size], positions, num_draft,
                         generator, counts)
    return [s.output_token_ids[:positions] for s in seqs], (counts[0], counts[1], counts[2])


def _speculate_batch(world: ToyLM, drafter: Drafter, rounds: RoundPlanner, verifier: DraftVerifier,
                     live: list[_Sequence], positions: int, num_draft: int,
                     generator: torch.Generator, counts: list[int]) -> None:
    """Speculate ``live`` round by round until each has ``positions`` outputs; adds the
    drafts proposed, verified and accepted to ``counts``."""
    while live:
        proposal = drafter.propose(live, num_draft)
        conf = (proposal.confidence.tolist() if proposal.confidence is not None
                else [[1.0] * num_draft for _ in live])
        lengths = rounds.plan([s.request_id for s in live], [len(s.output_token_ids) for s in live], conf,
                             proposal.num_drafted)
        ids = proposal.token_ids.tolist()
        contexts = [[*s.all_token_ids, *row[:j]] for s, row in zip(live, ids)
                    for j in range(num_draft + 1)]
        logits = world.logits(contexts).view(len(live), num_draft + 1, world.vocab)
        batch = SamplingBatch([s.params for s in live], [s.seed for s in live],
                              [len(s.output_token_ids) for s in live],
                              [s.prompt_token_ids for s in live],
                              [list(s.output_token_ids) for s in live], [None] * len(live),
                              generator)
        result = verify_padded(verifier, proposal, lengths, logits, batch)
        counts[0] += sum(proposal.num_drafted)
        counts[1] += sum(lengths)
        counts[2] += sum(result.num_accepted)
        for s, toks in zip(live, result.token_ids):
            s.output_token_ids.extend(toks)
        live = [s for s in live if len(s.output_token_ids) < positions]


def speculative_distribution(factory: SpeculationFactory, params: SamplingParams, *,
                             vocab: int = 16, num_samples: int = 3000, positions: int = 3,
                             num_draft: int = 2, seed: int = 0,
                             prompt: Sequence[int] = (1, 2, 3),
                             batch_size: int | None = None) -> DistributionReport:
    """Sample the first ``positions`` output tokens of ``num_samples`` sequences with the
    components ``factory`` builds and without them, and compare.

    With ``positions > num_draft`` the bonus token of a round whose drafts were all accepted
    lands inside the compared positions. Speculative and plain sequences use disjoint seeds
    (independent samples); every other
    sequence is unseeded (drawing from a seeded generator), so both kinds of random stream
    are covered. Greedy ``params``: the plain sequences use the same seeds and must match
    token for token (the comparisons are then exact). ``batch_size``: speculate the
    sequences in batches of that many, one batch after another (``None``: all at once).
    Deterministic for given arguments.
    """
    world = ToyLM(vocab, seed=seed)
    half = [(seed + i) if i % 2 else None for i in range(num_samples)]
    other = [(seed + num_samples + i) if i % 2 else None for i in range(num_samples)]
    spec_seeds = half if params.is_greedy else other
    fast, counts = _speculative(world, factory, params, list(prompt), spec_seeds, positions,
                                num_draft, torch.Generator().manual_seed(seed + 7), batch_size)
    plain = _plain(world, params, list(prompt), half, positions,
                   torch.Generator().manual_seed(seed + 11))
    if params.is_greedy:
        wrong = [i for i, (a, b) in enumerate(zip(fast, plain)) if a != b]
        expect(not wrong, f"greedy speculative decoding differs from plain decoding in "
                          f"{len(wrong)} of {num_samples} sequences (first: {wrong[:3]})")
    comparisons = tuple(compare_samples(p, [o[p] for o in fast], [o[p] for o in plain])
                        for p in range(positions))
    return DistributionReport(comparisons, *counts)


def check_speculative_distribution(factory: SpeculationFactory, params: SamplingParams, *,
                                   alpha: float = 1e-3, **kwargs: object) -> DistributionReport:
    """:func:`speculative_distribution`, raising :class:`ConformanceError` when a position's
    chi-square p-value is below ``alpha`` (the sample tells the two distributions apart)."""
    report = speculative_distribution(factory, params, **kwargs)  # type: ignore[arg-type]
    for c in report.comparisons:
        expect(c.p_value >= alpha,
               f"output position {c.position} under {params!r}: speculative and plain samples "
               f"differ (chi-square {c.statistic:.1f} on {c.dof} dof, p = {c.p_value:.2e}, "
               f"TV {c.tv:.3f})")
    return report


SPECULATIVE_DISTRIBUTION_SUITE: Suite[SpeculationFactory] = Suite(
    "SpeculativeDistribution", "factory(world: ToyLM) -> (Drafter, VerifyPlanner, DraftVerifier)")


@SPECULATIVE_DISTRIBUTION_SUITE.check
def check_sampled_with_top_k_and_top_p(factory: SpeculationFactory) -> None:
    check_speculative_distribution(factory, SamplingParams(temperature=0.8, top_k=8, top_p=0.9))


@SPECULATIVE_DISTRIBUTION_SUITE.check
def check_sampled_with_min_p_and_penalties(factory: SpeculationFactory) -> None:
    params = SamplingParams(temperature=1.0, min_p=0.05, presence_penalty=0.5,
                            frequency_penalty=0.3, repetition_penalty=1.2)
    check_speculative_distribution(factory, params, seed=1, prompt=(4, 4, 5))


@SPECULATIVE_DISTRIBUTION_SUITE.check
def check_sampled_with_logit_bias(factory: SpeculationFactory) -> None:
    params = SamplingParams(temperature=1.2, logit_bias={3: 2.0, 5: -1.5, 9: 1.0})
    check_speculative_distribution(factory, params, seed=2, prompt=(7, 3, 9))


@SPECULATIVE_DISTRIBUTION_SUITE.check
def check_sampled_one_sequence_per_round(factory: SpeculationFactory) -> None:
    check_speculative_distribution(factory, SamplingParams(temperature=1.0), seed=6,
                                   num_draft=2, positions=2, batch_size=1)


@SPECULATIVE_DISTRIBUTION_SUITE.check
def check_greedy_equals_plain(factory: SpeculationFactory) -> None:
    check_speculative_distribution(factory, SamplingParams(temperature=0.0), num_samples=200,
                                   positions=6, seed=3)
    check_speculative_distribution(factory, SamplingParams(temperature=0.0, repetition_penalty=1.3),
                                   num_samples=200, positions=6, seed=4)
