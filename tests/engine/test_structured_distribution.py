"""A constrained request's tokens follow the masked softmax: at each position, the
model's distribution renormalised over the tokens the grammar allows. Checked on
tiny-words at the first output position and at one after two forced tokens: 1,500 seeded
engine draws against 1,500 draws from the masked softmax of the unconstrained model's
whole-vocabulary logprobs (a separate request), by a chi-square homogeneity test
(``testing.spec_stats``); and the engine never draws a token outside the mask."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("xgrammar")

from deepinfer_kit import LLM, SamplingParams  # noqa: E402
from deepinfer_kit.testing.spec_stats import chi_square_homogeneity  # noqa: E402

DRAWS = 1500
PROMPT = "The cache"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-words", max_logprobs=-1, max_num_seqs=256)


def _raw_logprobs(llm: LLM, prefix: str) -> dict[int, float]:
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1)
    (out,) = llm.generate([PROMPT + prefix], params, use_tqdm=False)
    return {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}


def _masked_sample(raw: dict[int, float], allowed: set[int], seed: int) -> list[int]:
    ids = sorted(allowed)
    weights = torch.tensor([math.exp(raw[t]) for t in ids], dtype=torch.float64)
    draws = torch.multinomial(weights / weights.sum(), DRAWS, replacement=True,
                              generator=torch.Generator().manual_seed(seed))
    return [ids[i] for i in draws.tolist()]


@pytest.mark.parametrize(("regex", "forced", "allowed_text"), [
    (r"[aeiou][a-z]", "", "aeiou"),  # the first position: five vowels allowed
    (r"ab[c-h]", "ab", "cdefgh"),    # the third position, after two forced tokens
], ids=["first-position", "after-two-forced"])
def test_draws_follow_the_masked_softmax(llm: LLM, regex: str, forced: str, allowed_text: str) -> None:
    position = len(forced)
    params = [SamplingParams(max_tokens=position + 1, temperature=1.0, seed=i,
                             structured_outputs={"regex": regex}) for i in range(DRAWS)]
    outs = llm.generate([PROMPT] * DRAWS, params, use_tqdm=False)
    drawn = [o.outputs[0].token_ids[position] for o in outs]
    assert all(o.outputs[0].text.startswith(forced) for o in outs)
    allowed = {ord(c) for c in allowed_text}  # tiny-words is byte-level: a token per byte
    assert set(drawn) <= allowed
    reference = _masked_sample(_raw_logprobs(llm, forced), allowed, seed=len(regex))
    _, _, p_value = chi_square_homogeneity(drawn, reference)
    assert p_value > 1e-4, (p_value, sorted(set(drawn)))
