"""NgramDrafter: prompt lookup over the request's own tokens, with per-position confidence."""

from __future__ import annotations

import random

import pytest

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.request import Request
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.spec.drafters.ngram import NgramDrafter, lookup


def _brute(tokens: list[int], gamma: int, min_n: int, max_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        hits = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
        if hits:
            return tokens[hits[-1] + n : hits[-1] + n + gamma]
    return []


@pytest.mark.parametrize("seed", range(200))
def test_lookup_matches_a_brute_force_search(seed: int) -> None:
    rng = random.Random(seed)
    tokens = [rng.randrange(rng.choice([2, 4, 16])) for _ in range(rng.randint(1, 40))]
    gamma = rng.randint(1, 5)
    drafts, conf = lookup(tokens, gamma, 1, 3)
    assert drafts == _brute(tokens, gamma, 1, 3)
    assert len(conf) == len(drafts) and all(0 < c < 1 for c in conf)


def test_repetitive_text_gives_confident_drafts() -> None:
    tokens = [1, 2, 3, 4, 5] * 6 + [1, 2]
    drafts, conf = lookup(tokens, 4, 1, 3)
    assert drafts == [3, 4, 5, 1]
    assert min(conf) > 0.8
    # A continuation that disagreed before is less confident.
    drafts, conf = lookup([7, 8, 1, 7, 8, 2, 7, 8], 1, 2, 2)
    assert drafts == [2] and conf[0] == pytest.approx(2 / 4)


def test_propose_pads_rows_and_counts_drafts() -> None:
    reqs = [Request("a", [1, 2, 1, 2, 1], SamplingParams()), Request("b", [5, 6, 7], SamplingParams())]
    prop = NgramDrafter(1, 2).propose(reqs, 3)
    assert prop.num_drafted == [2, 0]  # the continuation runs into the end of the tokens
    assert prop.token_ids.tolist() == [[2, 1, 0], [0, 0, 0]]
    assert prop.draft_probs is None and prop.confidence is not None
    assert prop.confidence.shape == (2, 3) and float(prop.confidence[1].sum()) == 0.0
    assert NgramDrafter().propose([], 2).token_ids.shape == (0, 2)
    with pytest.raises(ConfigError, match="max_n"):
        NgramDrafter(3, 2)
