"""Incremental detokenisation and stop strings against a full decode of the whole output:
a trained byte-level BPE tokenizer (decoded by transformers too) and the byte tokenizer,
with multi-byte UTF-8 characters split over tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_kit import SamplingParams
from deepinfer_kit.engine.detokenizer import IncrementalDetokenizer, find_stop
from deepinfer_kit.engine.streams import SequenceStream
from deepinfer_kit.models.tokenizer import ByteTokenizer, HFTokenizer
from deepinfer_kit.request import Request
from deepinfer_kit.sched.stops import append_token

from text_reference import (
    CORPUS, SPECIAL, bpe_tokenizer_json, byte_fallback_tokenizer_json, stop_reference,
)

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return HFTokenizer(bpe_tokenizer_json(str(tmp_path_factory.mktemp("bpe"))))


@pytest.fixture(scope="module")
def hf_fast(bpe: HFTokenizer) -> Any:
    """transformers' fast tokenizer over the same tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe._backend, clean_up_tokenization_spaces=False
    )


def _run(detok: IncrementalDetokenizer, tokens: list[int]) -> list[str]:
    shown = []
    for t in tokens:
        detok.push(t)
        shown.append(detok.text)
    detok.flush()
    return shown


def test_the_fixture_splits_multibyte_characters_over_tokens(bpe: HFTokenizer) -> None:
    ids = bpe.encode(CORPUS[2])
    assert any(bpe.decode([t]).endswith("\ufffd") for t in ids)  # so the tests below bite
    assert bpe.decode(ids) == CORPUS[2]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_bpe_incremental_text_equals_transformers_decode(
    data: st.DataObject, bpe: HFTokenizer, hf_fast: Any
) -> None:
    skip = data.draw(st.booleans())
    special = bpe._backend.token_to_id(SPECIAL)
    if data.draw(st.booleans()):  # real text, or any ids at all (invalid UTF-8 included)
        text = data.draw(st.sampled_from(CORPUS))
        tokens = bpe.encode(text[data.draw(st.integers(0, 10)):])
        tokens[data.draw(st.integers(0, len(tokens))):0] = [special]
    else:
        tokens = data.draw(st.lists(st.integers(0, bpe.vocab_size - 1), min_size=1, max_size=30))
    prompt = bpe.encode("A prompt: ")
    detok = IncrementalDetokenizer(bpe, prompt, skip_special_tokens=skip)
    shown = _run(detok, tokens)
    full = hf_fast.decode(tokens, skip_special_tokens=skip)
    assert detok.text == full == bpe.decode(tokens, skip_special_tokens=skip)
    for text in shown:  # never a character that a later token changes
        assert full.startswith(text)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_byte_fallback_text_continues_the_prompt(data: st.DataObject, tmp_path_factory: Any) -> None:
    tok = HFTokenizer(byte_fallback_tokenizer_json(str(tmp_path_factory.getbasetemp())))
    prompt = tok.encode("The prompt")
    line = data.draw(st.sampled_from(CORPUS))
    out = tok.encode(line[data.draw(st.integers(0, len(line) - 1)):])[1:]  # no Prepend marker
    if not out:
        return
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    shown = _run(detok, out)
    full = tok.decode(prompt + out)
    continuation = full[len(tok.decode(prompt)):]
    assert detok.text == continuation  # the leading space the decoder strips at the start stays
    assert all(continuation.startswith(t) and "\ufffd" not in t for t in shown)


def test_byte_fallback_fixture_spells_characters_in_bytes(tmp_path: Path) -> None:
    tok = HFTokenizer(byte_fallback_tokenizer_json(str(tmp_path)))
    ids = tok.encode("café 東")
    pieces = [tok._backend.id_to_token(t) for t in ids]
    assert "<0xC3>" in pieces and "<0xE6>" in pieces and tok.decode(ids) == "café 東"


def test_byte_tokenizer_holds_back_split_characters() -> None:
    tok = ByteTokenizer()
    text = "aé€🎉ü東"
    tokens = tok.encode(text)
    shown = _run(IncrementalDetokenizer(tok, tok.encode("hi ")), tokens)
    assert all("\ufffd" not in s and text.startswith(s) for s in shown)
    assert shown[-1] == text
    assert shown[2] == "aé" and shown[3] == "aé" and shown[4] == "aé"  # € is 3 bytes


def test_byte_tokenizer_special_tokens_are_skipped_or_named() -> None:
    tok = ByteTokenizer()
    tokens = [*tok.encode("é"), tok.EOS, *tok.encode("x")]
    assert _run(IncrementalDetokenizer(tok, [1]), tokens)[-1] == "éx"
    named = IncrementalDetokenizer(tok, [1], skip_special_tokens=False)
    _run(named, tokens)
    assert named.text == "é<eos>x"


def test_find_stop_takes_the_earliest_occurrence_in_the_new_text() -> None:
    assert find_stop("xxabcd", 4, ["cd", "bc"]) == ("bc", 3)
    assert find_stop("ab ab", 3, ["ab"]) == ("ab", 3)  # the first one was found before
    assert find_stop("abab", 4, ["ab"]) is None


# ---- stop strings through the scheduler's append path ---------------------------------

_PIECES = ["a", "b", "é", "€", "ab", " "]


def _drive(tokenizer: Any, tokens: list[int], params: SamplingParams) -> tuple[Request, str]:
    prompt = tokenizer.encode("go: ")
    req = Request("r", prompt, params)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    stream = SequenceStream(req, detok, {})
    req.observer = stream
    for t in tokens:
        if append_token(req, t, None, 10_000):
            break
    return req, stream.text()


def _check(tokenizer: Any, tokens: list[int], stops: list[str], min_tokens: int, include: bool) -> None:
    params = SamplingParams(
        max_tokens=len(tokens), min_tokens=min(min_tokens, len(tokens)), stop=stops,
        include_stop_str_in_output=include, ignore_eos=True,
    )
    req, text = _drive(tokenizer, tokens, params)
    kept, stop, want = stop_reference(tokenizer, tokens, stops, params.min_tokens, include)
    assert req.output_token_ids == tokens[:kept]
    assert (req.finish_reason.value if req.finish_reason else None) == ("stop" if stop else "length")
    assert req.stop_reason == stop
    assert text == want


@settings(max_examples=200, deadline=None)
@given(
    text=st.lists(st.sampled_from(_PIECES), min_size=1, max_size=14).map("".join),
    stops=st.lists(st.lists(st.sampled_from(_PIECES), min_size=1, max_size=3).map("".join),
                   min_size=1, max_size=3),
    min_tokens=st.integers(0, 4),
    include=st.booleans(),
)
def test_stop_strings_match_brute_force_on_bytes(
    text: str, stops: list[str], min_tokens: int, include: bool
) -> None:
    tok = ByteTokenizer()
    _check(tok, tok.encode(text), stops, min_tokens, include)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_stop_strings_match_brute_force_on_bpe(data: st.DataObject, bpe: HFTokenizer) -> None:
    line = data.draw(st.sampled_from(CORPUS))
    tokens = bpe.encode(line)
    start = data.draw(st.integers(0, len(line) - 1))
    stop = line[start:start + data.draw(st.integers(1, 6))]
    stops = [stop, *data.draw(st.lists(st.sampled_from(["é", "。", "##", "zz"]), max_size=2))]
    _check(bpe, tokens, stops, data.draw(st.integers(0, 3)), data.draw(st.booleans()))


def test_a_stop_token_text_is_left_out_unless_asked() -> None:
    tok = ByteTokenizer()
    tokens = tok.encode("ab;c")
    for include, want in ((False, "ab"), (True, "ab;")):
        params = SamplingParams(stop_token_ids=[ord(";")], include_stop_str_in_output=include)
        req, text = _drive(tok, tokens, params)
        assert (req.stop_reason, text) == (ord(";"), want)


def test_logprobs_get_their_decoded_token() -> None:
    from deepinfer_kit.outputs import Logprob

    tok = ByteTokenizer()
    req = Request("r", [1], SamplingParams(logprobs=1))
    req.observer = SequenceStream(req, IncrementalDetokenizer(tok, [1]), {})
    for t in (ord("h"), tok.EOS):
        append_token(req, t, {t: Logprob(-0.5, 1), 0xC3: Logprob(-2.0, 2)}, 100)
    assert req.logprobs is not None
    assert [{k: v.decoded_token for k, v in d.items()} for d in req.logprobs] == [
        {ord("h"): "h", 0xC3: "\ufffd"}, {tok.EOS: "<eos>", 0xC3: "\ufffd"}
    ]




def test_a_character_cut_by_the_length_limit_is_flushed_as_a_full_decode_would() -> None:
    tok = ByteTokenizer()
    tokens = tok.encode("a€")[:-1]
    req, text = _drive(tok, tokens, SamplingParams(max_tokens=len(tokens)))
    assert req.finish_reason is not None and req.finish_reason.value == "length"
    assert text == tok.decode(tokens) == "a\ufffd"


def test_decode_one_fills_a_shared_cache_that_copies_keep() -> None:
    tok = ByteTokenizer()
    pieces: dict[int, str] = {}
    detok = IncrementalDetokenizer(tok, [1], pieces=pieces)
    assert detok.decode_one(tok.EOS) == "<eos>" and pieces == {tok.EOS: "<eos>"}
    pieces[65] = "cached"  # a second call reads the cache, not the tokenizer
    assert detok.copy().decode_one(65) == "cached"
    assert IncrementalDetokenizer(tok, [1], pieces=pieces).decode_one(65) == "cached"
