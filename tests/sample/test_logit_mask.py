"""The logit stage of ``logit_bias`` / ``allowed_token_ids`` / bad words against a per-row
torch reference, the bad-word rule under random vocabularies (hypothesis), batch
invariance, and the SamplingParams validation of the three fields."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_kit.errors import ConfigError, InvariantError
from deepinfer_kit.sample.logit_mask import apply_logit_mask, build_logit_mask
from deepinfer_kit.sample.params import SamplingParams

from logit_oracle import reference_row


def masked(logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]]) -> torch.Tensor:
    x = logits.clone()
    mask = build_logit_mask(params, histories, x.shape[1])
    if mask is not None:
        apply_logit_mask(x, mask)
    return x


ROWS = [
    SamplingParams(),
    SamplingParams(logit_bias={3: 100.0, 7: -2.5, 0: 0.125}),
    SamplingParams(allowed_token_ids=[1, 4, 9]),
    SamplingParams(bad_words_token_ids=[[5], [2, 6], [1, 2, 8], [9, 9]]),
    SamplingParams(logit_bias={4: 3.0, 9: -100.0}, allowed_token_ids=[4, 9, 11],
                   bad_words_token_ids=[[2, 4]]),
]
HISTORIES = [[1, 2], [], [3], [1, 2], [7, 2]]


def test_each_row_equals_the_per_row_reference() -> None:
    logits = torch.randn(len(ROWS), 12, generator=torch.Generator().manual_seed(0))
    got = masked(logits, ROWS, HISTORIES)
    want = torch.stack([reference_row(logits[i], p, h) for i, (p, h) in enumerate(zip(ROWS, HISTORIES))])
    assert torch.equal(got, want)
    assert got[3, 6] == float("-inf") and got[3, 8] == float("-inf") and got[3, 9] != float("-inf")
    assert torch.isinf(got[2]).sum() == 12 - 3


def test_rows_without_fields_build_nothing() -> None:
    assert build_logit_mask([SamplingParams()] * 3, [[], [1], [2]], 10) is None


def test_a_row_does_not_depend_on_the_other_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(len(ROWS), 12, generator=gen)
    full = masked(logits, ROWS, HISTORIES)
    for i in range(len(ROWS)):
        order = [i] + [j for j in range(len(ROWS)) if j != i]
        alone = masked(logits[[i]], [ROWS[i]], [HISTORIES[i]])
        shuffled = masked(logits[order], [ROWS[j] for j in order], [HISTORIES[j] for j in order])
        assert torch.equal(alone[0], full[i]) and torch.equal(shuffled[0], full[i])


def test_ids_outside_the_vocabulary_are_caller_bugs() -> None:
    with pytest.raises(InvariantError, match="allowed_token_ids"):
        build_logit_mask([SamplingParams(allowed_token_ids=[12])], [[]], 12)


words = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(2, 6), bad=words, seed=st.integers(0, 2**31), greedy=st.booleans())
def test_a_bad_word_is_never_completed(vocab: int, bad: list[list[int]], seed: int, greedy: bool) -> None:
    """Drawing 24 tokens from random logits through the stage never writes a bad word."""
    bad = [[t % vocab for t in w] for w in bad]
    params = SamplingParams(bad_words_token_ids=bad)
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(24):
        x = masked(torch.randn(1, vocab, generator=gen), [params], [out])
        assert torch.equal(x[0], reference_row(x[0], params, out))  # idempotent on its result
        if torch.isinf(x).all():
            break  # every token is banned here: nothing may be drawn
        if greedy:
            token = int(x[0].argmax())
        else:
            token = int(torch.multinomial(torch.softmax(x[0], 0), 1, generator=gen))
        out.append(token)
    for w in bad:
        n = len(w)
        assert all(out[i : i + n] != w for i in range(len(out) - n + 1)), (w, out)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"logit_bias": {3: 100.5}}, r"logit_bias\[3\] must be in \[-100, 100\], got 100.5"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids >= 0, got -1"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias keys"),
        ({"logit_bias": {2: float("nan")}}, r"logit_bias\[2\] must be finite"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"allowed_token_ids": [1, -3]}, "allowed_token_ids must hold token ids >= 0, got -3"),
        ({"allowed_token_ids": "ab"}, "allowed_token_ids must be a list of ints"),
        ({"bad_words": "word"}, "bad_words must be a list of str"),
        ({"bad_words": ["ok", "  "]}, "bad_words must hold non-blank strings, got '  '"),
        ({"bad_words_token_ids": [[1], []]}, "bad_words_token_ids must hold non-empty lists"),
        ({"bad_words_token_ids": [3]}, "bad_words_token_ids must be a list of token id lists"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_the_fields_keep_params_hashable_and_comparable() -> None:
    a = SamplingParams(logit_bias={1: 2.0}, allowed_token_ids=[1, 2], bad_words=["x"])
    b = SamplingParams(logit_bias={1: 2.0}, allowed_token_ids=(1, 2), bad_words=("x",))
    assert a == b and hash(a) == hash(b) and a.has_logit_mask
    assert not SamplingParams(bad_words=["x"]).has_logit_mask  # tokenized at add_request
