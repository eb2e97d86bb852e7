"""Conformance suite for a Drafter alone: the proposal's shapes and ranges, empty calls, and
that a sequence's drafts depend on that sequence only (not on the others drafted with it).
Whether speculation with the drafter stays exact is the engine-level
:data:`~deepinfer_kit.testing.spec_distribution.SPECULATIVE_DISTRIBUTION_SUITE`."""

from __future__ import annotations

import random
from collections.abc import Callable

from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.spec.protocols import Drafter, DraftSequence
from deepinfer_kit.spec.records import DraftProposal, DraftView
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["DrafterFactory", "DRAFTER_SUITE", "draft_views"]

DrafterFactory = Callable[[], Drafter]
"""``factory()`` -> a fresh drafter (holding no sequence state)."""

DRAFTER_SUITE: Suite[DrafterFactory] = Suite("Drafter", "factory() -> Drafter")

VOCAB = 250
"""Token ids of the suite's sequences lie in ``[3, VOCAB)`` (any model with a vocabulary of
at least this size can draft for them)."""


def draft_views(seed: int, n: int, *, greedy: bool = True) -> list[DraftView]:
    """``n`` sequences as a drafter sees them: prompts of 6-40 tokens with repeats (so
    prompt-lookup drafters find matches), 0-10 output tokens, greedy or seeded sampling."""
    rng = random.Random(seed)
    views = []
    for i in range(n):
        motif = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 5))]
        prompt = (motif * 8)[: rng.randint(6, 40)]
        out = [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 10))]
        params = SamplingParams(temperature=0.0) if greedy else SamplingParams(temperature=0.8, seed=i)
        views.append(DraftView(f"s{seed}-{i}", prompt, out, [*prompt, *out], params,
                               None if greedy else i, None))
    return views


def _check_proposal(p: DraftProposal, n: int, gamma: int) -> None:
    expect(tuple(p.token_ids.shape) == (n, gamma), f"token_ids must be [{n}, {gamma}], got {tuple(p.token_ids.shape)}")
    expect(str(p.token_ids.dtype) == "torch.int64", f"token_ids must be int64, got {p.token_ids.dtype}")
    expect(len(p.num_drafted) == n and all(isinstance(k, int) and 0 <= k <= gamma for k in p.num_drafted),
           f"num_drafted must hold {n} ints in [0, {gamma}], got {p.num_drafted}")
    ids = p.token_ids.tolist()
    expect(all(t >= 0 for row, k in zip(ids, p.num_drafted) for t in row[:k]), "drafted ids must be >= 0")
    if p.confidence is not None:
        c = p.confidence
        expect(tuple(c.shape) == (n, gamma), f"confidence must be [{n}, {gamma}], got {tuple(c.shape)}")
        expect(bool(((c >= 0) & (c <= 1)).all()), "confidence must lie in [0, 1]")
    if p.draft_probs is not None:
        q = p.draft_probs
        expect(q.dim() == 3 and tuple(q.shape[:2]) == (n, gamma), f"draft_probs must be [{n}, {gamma}, V]")
        for r, k in enumerate(p.num_drafted):
            for j in range(k):
                row = q[r, j].double()
                expect(abs(float(row.sum()) - 1.0) < 1e-3 and bool((row >= 0).all()),
                       f"draft_probs[{r}, {j}] must be a distribution")
                expect(float(row[ids[r][j]]) > 0, f"draft {ids[r][j]} at [{r}, {j}] has probability 0")


@DRAFTER_SUITE.check
def check_the_proposal_has_its_shapes_and_ranges(factory: DrafterFactory) -> None:
    for gamma in (1, 4):
        for greedy in (True, False):
            views = draft_views(gamma, 5, greedy=greedy)
            _check_proposal(factory().propose(views, gamma), len(views), gamma)


@DRAFTER_SUITE.check
def check_no_sequence_drafts_nothing(factory: DrafterFactory) -> None:
    p = factory().propose([], 3)
    expect(tuple(p.token_ids.shape) == (0, 3) and p.num_drafted == [],
           f"no sequence must give a [0, 3] proposal, got {tuple(p.token_ids.shape)}, {p.num_drafted}")


@DRAFTER_SUITE.check
def check_a_sequences_drafts_depend_on_it_alone(factory: DrafterFactory) -> None:
    """Greedy sequences, drafted alone and among others (any position), by fresh drafters:
    the same drafts (what keeps speculation batch-invariant)."""
    views = draft_views(7, 6)
    together = factory().propose(views, 3)
    for i in (0, 3, 5):
        alone = factory().propose([views[i]], 3)
        k = together.num_drafted[i]
        expect(alone.num_drafted[0] == k, f"sequence {i}: {alone.num_drafted[0]} drafts alone, {k} in a batch")
        expect(alone.token_ids[0, :k].tolist() == together.token_ids[i, :k].tolist(),
               f"sequence {i}: drafts differ alone and in a batch")
    reordered = factory().propose(views[::-1], 3)
    n = len(views)
    for i, k in enumerate(together.num_drafted):
        j = n - 1 - i
        expect(reordered.num_drafted[j] == k and reordered.token_ids[j, :k].tolist() == together.token_ids[i, :k].tolist(),
               f"sequence {i}: its drafts changed when the batch was reversed")


@DRAFTER_SUITE.check
def check_the_sequences_are_not_changed(factory: DrafterFactory) -> None:
    views: list[DraftSequence] = list(draft_views(9, 4))
    before = [(list(v.all_token_ids), list(v.output_token_ids)) for v in views]
    factory().propose(views, 2)
    expect([(list(v.all_token_ids), list(v.output_token_ids)) for v in views] == before,
           "propose must not change the sequences it reads")
