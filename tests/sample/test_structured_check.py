"""The engine's compile check of ``structured_outputs``: a spec that fails refuses its
request naming ``structured_outputs``; one that compiles past the time limit is refused
within the limit (a hostile spec cannot hold the caller); each spec compiles once; no
tokenizer or no xgrammar is a clear error."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from deepinfer_kit.sample.structured import StructuredOutputError, StructuredOutputsParams
from deepinfer_kit.sample.structured.check import GrammarCheck


class _Backend:
    """Compiles by waiting on ``release`` (or failing for a regex of ``bad``)."""

    vocab_size = 8

    def __init__(self) -> None:
        self.release = threading.Event()
        self.compiled: list[StructuredOutputsParams] = []

    def compile(self, spec: StructuredOutputsParams) -> Any:
        if spec.regex == "bad":
            raise StructuredOutputError("regex could not be compiled: bad")
        if spec.regex == "slow":
            self.release.wait(30)
        self.compiled.append(spec)
        return spec

    def matcher(self, grammar: Any, *, max_rollback: int) -> Any:
        raise NotImplementedError


def test_a_failing_spec_names_structured_outputs() -> None:
    check = GrammarCheck(None, 8, [0], backend=_Backend())  # type: ignore[arg-type]
    with pytest.raises(StructuredOutputError, match="^structured_outputs: regex could not"):
        check.check(StructuredOutputsParams(regex="bad"))


def test_a_slow_spec_is_refused_within_the_limit_and_each_spec_compiles_once() -> None:
    backend = _Backend()
    check = GrammarCheck(None, 8, [0], timeout_s=0.2, backend=backend)  # type: ignore[arg-type]
    try:
        with pytest.raises(StructuredOutputError, match="did not compile within 0.2 s"):
            check.check(StructuredOutputsParams(regex="slow"))
        check.check(StructuredOutputsParams(regex="a+"))  # the other thread still compiles
        check.check(StructuredOutputsParams(regex="a+"))
        assert backend.compiled.count(StructuredOutputsParams(regex="a+")) == 1
    finally:
        backend.release.set()


def test_no_tokenizer_is_a_clear_error() -> None:
    pytest.importorskip("xgrammar")
    with pytest.raises(StructuredOutputError, match="needs the model's tokenizer"):
        GrammarCheck(None, 8, [0]).check(StructuredOutputsParams(regex="a"))
