"""XGrammarBackend passes GRAMMAR_BACKEND_SUITE; a backend that allows every token fails it."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import pytest
import torch

from deepinfer_kit.errors import ConfigError, InvariantError
from deepinfer_kit.sample.structured.params import StructuredOutputError, StructuredOutputsParams
from deepinfer_kit.testing import ConformanceError
from deepinfer_kit.testing.structured import GRAMMAR_BACKEND_SUITE, SUITE_EOS, GrammarBackendFactory
from deepinfer_kit.testing.suite import Check

xgrammar = pytest.importorskip("xgrammar")

from deepinfer_kit.sample.structured.xgrammar_backend import XGrammarBackend  # noqa: E402


def _xgrammar(vocab: Sequence[str], eos_id: int) -> XGrammarBackend:
    return XGrammarBackend.from_tokenizer(list(vocab), len(vocab), [eos_id])


@pytest.mark.parametrize("check", GRAMMAR_BACKEND_SUITE.checks, ids=GRAMMAR_BACKEND_SUITE.ids)
def test_xgrammar_backend(check: Check[GrammarBackendFactory]) -> None:
    check(_xgrammar)


class _Wrapped:
    """An XGrammarMatcher with one contract broken (chosen by ``flaw``)."""

    def __init__(self, inner: object, flaw: str) -> None:
        self.inner, self.flaw = inner, flaw

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill_bitmask(bitmask, row)  # type: ignore[attr-defined]
        if self.flaw == "allow_all":
            bitmask[row] = -1
        elif self.flaw == "eos_always":
            bitmask[row, SUITE_EOS // 32] |= 1 << (SUITE_EOS % 32)

    def fork(self) -> object:
        return self if self.flaw == "shared_fork" else _Wrapped(self.inner.fork(), self.flaw)  # type: ignore[attr-defined]

    def rollback(self, num_tokens: int) -> None:
        if self.flaw != "rollback_ignored":
            self.inner.rollback(num_tokens)  # type: ignore[attr-defined]


class _Broken:
    def __init__(self, vocab: Sequence[str], eos_id: int, flaw: str) -> None:
        self.inner, self.flaw = _xgrammar(vocab, eos_id), flaw
        self.vocab_size = self.inner.vocab_size

    def compile(self, spec: StructuredOutputsParams) -> object:
        if self.flaw == "lenient_compile":
            try:
                return self.inner.compile(spec)
            except StructuredOutputError:
                return self.inner.compile(StructuredOutputsParams(regex="a"))
        return self.inner.compile(spec)

    def matcher(self, grammar: object, *, max_rollback: int) -> object:
        return _Wrapped(self.inner.matcher(grammar, max_rollback=max_rollback), self.flaw)


@pytest.mark.parametrize("flaw, failing", [
    ("allow_all", {"regex_bitmask_is_exact", "choice_bitmask_is_exact"}),
    ("eos_always", {"regex_bitmask_is_exact", "choice_bitmask_is_exact"}),
    ("shared_fork", {"fork_is_independent"}),
    ("rollback_ignored", {"rollback_restores_the_bitmask", "fork_is_independent"}),
    ("lenient_compile", {"invalid_spec_raises_structured_output_error"}),
])
def test_broken_backend_fails_the_suite(flaw: str, failing: set[str]) -> None:
    def factory(vocab: Sequence[str], eos_id: int) -> object:
        return _Broken(vocab, eos_id, flaw)

    for check in GRAMMAR_BACKEND_SUITE.checks:
        if check.name in failing:
            with pytest.raises(ConformanceError):
                check(factory)  # type: ignore[arg-type]
    with pytest.raises(ConformanceError, match=sorted(failing)[0]):
        GRAMMAR_BACKEND_SUITE.run(factory)  # type: ignore[arg-type]


def test_from_tokenizer_byte_tokenizer() -> None:
    """The embedded models' ByteTokenizer: bytes are text, 257 (EOS) ends, specials never allowed."""
    from deepinfer_kit.models.tokenizer import ByteTokenizer
    from deepinfer_kit.sample.structured.bitmask import allocate_bitmask

    backend = XGrammarBackend.from_tokenizer(ByteTokenizer(), 264)
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(choice=["hi", "ho"])), max_rollback=0)
    mask = allocate_bitmask(1, 264)
    for text, allowed in (("", {ord("h")}), ("h", {ord("i"), ord("o")}), ("hi", {257})):
        for ch in text[len(text) - 1:] if text else "":
            assert matcher.accept_token(ord(ch))
        matcher.fill_bitmask(mask, 0)
        words = [int(w) & 0xFFFFFFFF for w in mask[0].tolist()]
        assert {t for t in range(264) if words[t // 32] >> (t % 32) & 1} == allowed


def test_compile_cache_hits_and_missing_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _xgrammar(["a", "b", "<eos>"], 2)
    first = backend.compile(StructuredOutputsParams(json={"type": "string", "minLength": 1}))
    assert backend.compile(StructuredOutputsParams(json='{"minLength": 1, "type": "string"}')) is first
    assert backend.cache.hits == 1
    with pytest.raises(StructuredOutputError, match="whitespace_pattern"):
        backend.compile(StructuredOutputsParams(json_object=True, whitespace_pattern=" *"))
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(ConfigError, match=r"pip install 'deepinfer_kit\[structured\]'"):
        XGrammarBackend.from_tokenizer(["a", "<eos>"], 2, [1])


def test_num_accepted_follows_rollback_and_reset() -> None:
    backend = _xgrammar(["a", "b", "<eos>"], 2)
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(regex="a*b")), max_rollback=3)
    assert matcher.accept_token(0) and matcher.accept_token(0) and matcher.accept_token(1)
    matcher.rollback(2)
    assert matcher.num_accepted == 1
    with pytest.raises(InvariantError, match=r"num_tokens must be in \[0, 1\]"):
        matcher.rollback(2)
    matcher.reset()
    assert matcher.num_accepted == 0


def test_json_strings_never_take_raw_control_characters() -> None:
    """xgrammar 0.2.9 lets a string with minLength / maxLength take raw control
    characters (invalid JSON); the backend's guard bans them (and, for compact JSON, tab,
    newline and carriage return), in the mask and in accept_token."""
    pytest.importorskip("xgrammar")
    from deepinfer_kit.models.tokenizer import ByteTokenizer
    from deepinfer_kit.sample.structured import StructuredOutputsParams
    from deepinfer_kit.sample.structured.bitmask import allocate_bitmask
    from deepinfer_kit.sample.structured.xgrammar_backend import XGrammarBackend

    backend = XGrammarBackend.from_tokenizer(ByteTokenizer(), 259, [257])
    for compact in (False, True):
        for schema in ({"type": "string", "minLength": 1}, {"type": "string", "maxLength": 5}):
            spec = StructuredOutputsParams(json=schema, disable_any_whitespace=compact)
            matcher = backend.matcher(backend.compile(spec), max_rollback=4)
            assert matcher.accept_token(ord('"'))
            bitmask = allocate_bitmask(1, 259)
            matcher.fill_bitmask(bitmask, 0)
            words = bitmask[0].tolist()
            allowed = {t for t in range(259) if (words[t // 32] >> (t % 32)) & 1}
            # free whitespace is JSON's between tokens, so only compact JSON bans it everywhere
            never = set(range(0x20)) - (set() if compact else {0x09, 0x0A, 0x0D})
            assert not allowed & never, (schema, compact, sorted(allowed & never))
            assert ord("a") in allowed
            assert not matcher.accept_token(0x01)
    regex = backend.matcher(backend.compile(StructuredOutputsParams(regex="a\nb")), max_rollback=4)
    assert regex.accept_token(ord("a")) and regex.accept_token(0x0A)  # not a JSON grammar: no guard


def test_a_schema_xgrammar_may_loosen_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    from deepinfer_kit.models.tokenizer import ByteTokenizer
    from deepinfer_kit.sample.structured.schema_scan import loosened_keywords

    assert loosened_keywords({"type": "object", "properties": {"a": {"oneOf": [{"type": "integer"},
                                                                          {"type": "number"}]}}}) == ("oneOf",)
    assert loosened_keywords({"allOf": [{"type": "object"}]}) == ()  # one schema: merged exactly
    assert loosened_keywords({"allOf": [{}, {}], "if": {}, "then": {}, "format": "uri"}) == ("allOf", "if", "format")
    assert loosened_keywords({"properties": {"format": {"type": "string"}, "if": {}}}) == ()  # properties named so
    deep: dict = {}
    node = deep
    for _ in range(5000):  # iterative: no recursion limit
        node["items"] = {}
        node = node["items"]
    assert loosened_keywords(deep) == ()
    backend = XGrammarBackend.from_tokenizer(ByteTokenizer(), 259, [257])
    with caplog.at_level("WARNING", logger="deepinfer_kit.structured"):
        grammar = backend.compile(StructuredOutputsParams(json={"oneOf": [{"type": "integer"}, {"type": "number"}]}))
    assert grammar.loosened == ("oneOf",) and "oneOf" in caplog.text
    assert backend.compile(StructuredOutputsParams(json={"type": "integer"})).loosened == ()
