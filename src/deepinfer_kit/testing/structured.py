"""GRAMMAR_BACKEND_SUITE: the GrammarBackend / GrammarMatcher contract, checked against brute
force over a small vocabulary the suite supplies.

The factory is ``factory(vocab, eos_id) -> GrammarBackend``: ``vocab[i]`` is token ``i``'s raw
text (``vocab_size == len(vocab)``), and ``eos_id`` is the one stop token (its text is never
output). Expected bitmasks come from Python's ``re``: a prefix is viable when some completion
of at most ``_HORIZON`` characters over the regex's alphabet full-matches, exact for the
small regexes used here (their automata have fewer states than the horizon).
"""

from __future__ import annotations

import itertools
import json
import random
import re
import warnings
from collections.abc import Callable, Sequence
from functools import lru_cache

import torch

from deepinfer_kit.sample.structured.bitmask import allocate_bitmask
from deepinfer_kit.sample.structured.params import StructuredOutputError, StructuredOutputsParams
from deepinfer_kit.sample.structured.protocols import GrammarBackend, GrammarMatcher
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["GRAMMAR_BACKEND_SUITE", "GrammarBackendFactory", "SUITE_VOCAB", "SUITE_EOS"]

GrammarBackendFactory = Callable[[Sequence[str], int], GrammarBackend]

GRAMMAR_BACKEND_SUITE: Suite[GrammarBackendFactory] = Suite(
    "GrammarBackend", "factory(vocab: Sequence[str], eos_id: int) -> GrammarBackend")

_JSON_CHARS = list('{}[]":,-') + list("0123456789") + list("tfrueals")
#: The suite's vocabulary: letters, their pairs and a triple, JSON punctuation, the EOS text.
SUITE_VOCAB: tuple[str, ...] = tuple(dict.fromkeys(
    ["a", "b", "c", "ab", "ba", "ca", "cc", "abc", "aab"] + _JSON_CHARS
    + ['{"', '":', '"a', "true", "false", "12", "x", "<eos>"]))
SUITE_EOS = SUITE_VOCAB.index("<eos>")
_ALPHABET = "abc"
_HORIZON = 5
_REGEXES = ("(ab|c)+", "a{2,3}b?", "[ab]*c", "ab?c?")
_CHOICES = ("ab", "abc", "ba", "cab")
_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
           "required": ["a", "b"]}


def _backend(factory: GrammarBackendFactory) -> GrammarBackend:
    backend = factory(list(SUITE_VOCAB), SUITE_EOS)
    expect(backend.vocab_size == len(SUITE_VOCAB),
           f"vocab_size must be len(vocab) = {len(SUITE_VOCAB)}, got {backend.vocab_size}")
    return backend


def _allowed(matcher: GrammarMatcher, vocab_size: int) -> set[int]:
    bitmask = allocate_bitmask(2, vocab_size)
    bitmask[1] = 0
    matcher.fill_bitmask(bitmask, 1)
    expect(bool((bitmask[0] == -1).all()), "fill_bitmask wrote a row other than the one asked for")
    words = [int(w) & 0xFFFFFFFF for w in bitmask[1].tolist()]
    return {t for t in range(vocab_size) if words[t // 32] >> (t % 32) & 1}


def _viable_fn(pattern: str) -> Callable[[str], bool]:
    compiled = re.compile(pattern)
    tails = ["".join(p) for n in range(_HORIZON + 1) for p in itertools.product(_ALPHABET, repeat=n)]

    @lru_cache(maxsize=None)
    def viable(prefix: str) -> bool:
        return any(compiled.fullmatch(prefix + tail) for tail in tails)
    return viable


def _expected(pattern: str, viable: Callable[[str], bool], text: str) -> set[int]:
    out = {t for t, tok in enumerate(SUITE_VOCAB) if t != SUITE_EOS and viable(text + tok)}
    if re.fullmatch(pattern, text):
        out.add(SUITE_EOS)
    return out


def _walk_against_re(backend: GrammarBackend, spec: StructuredOutputsParams, pattern: str,
                     seed: int, walks: int) -> None:
    """Seeded random walks: at every step the mask equals brute force; EOS ends the walk."""
    viable = _viable_fn(pattern)
    grammar = backend.compile(spec)
    rng = random.Random(seed)
    for walk in range(walks):
        matcher = backend.matcher(grammar, max_rollback=0)
        text = ""
        for _ in range(12):
            want = _expected(pattern, viable, text)
            got = _allowed(matcher, backend.vocab_size)
            expect(got == want, f"{spec.kind} {pattern!r} walk {walk} after {text!r}: allowed "
                   f"{sorted(SUITE_VOCAB[t] for t in got)}, expected {sorted(SUITE_VOCAB[t] for t in want)}")
            expect(matcher.can_terminate() == (SUITE_EOS in want),
                   f"{pattern!r} after {text!r}: can_terminate() is {matcher.can_terminate()}")
            token = rng.choice(sorted(want))
            expect(matcher.accept_token(token), f"{pattern!r} after {text!r}: allowed token "
                   f"{SUITE_VOCAB[token]!r} was not accepted")
            if token == SUITE_EOS:
                expect(matcher.is_terminated(), f"{pattern!r}: not terminated after EOS")
                break
            expect(not matcher.is_terminated(), f"{pattern!r} terminated before EOS")
            text += SUITE_VOCAB[token]


@GRAMMAR_BACKEND_SUITE.check
def check_regex_bitmask_is_exact(factory: GrammarBackendFactory) -> None:
    """Each step's bitmask of a regex grammar is exactly the viable tokens, EOS where it may end."""
    backend = _backend(factory)
    for i, pattern in enumerate(_REGEXES):
        _walk_against_re(backend, StructuredOutputsParams(regex=pattern), pattern, seed=i, walks=6)


@GRAMMAR_BACKEND_SUITE.check
def check_choice_bitmask_is_exact(factory: GrammarBackendFactory) -> None:
    """A choice grammar allows exactly the continuations of the choices, EOS after a whole one."""
    pattern = "|".join(re.escape(c) for c in _CHOICES)
    _walk_against_re(_backend(factory), StructuredOutputsParams(choice=list(_CHOICES)), pattern,
                     seed=7, walks=8)


def _validate(doc: object) -> None:
    try:
        import jsonschema  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        warnings.warn("jsonschema is not installed: JSON walks are checked by the suite's own "
                      "test of the schema only (pip install jsonschema)", stacklevel=2)
    else:
        jsonschema.validate(doc, _SCHEMA)
    expect(isinstance(doc, dict) and set(doc) == {"a", "b"} and type(doc["a"]) is int
           and type(doc["b"]) is bool, f"output {doc!r} does not match the schema")


@GRAMMAR_BACKEND_SUITE.check
def check_json_schema_walks_validate(factory: GrammarBackendFactory) -> None:
    """Random walks through a JSON-schema grammar, ending at the first EOS, parse and validate."""
    backend = _backend(factory)
    grammar = backend.compile(StructuredOutputsParams(json=_SCHEMA, disable_any_whitespace=True))
    rng = random.Random(3)
    finished = 0
    for walk in range(12):
        matcher = backend.matcher(grammar, max_rollback=0)
        text = ""
        for _ in range(60):
            allowed = _allowed(matcher, backend.vocab_size)
            expect(bool(allowed), f"json walk {walk} after {text!r}: no token allowed")
            token = SUITE_EOS if SUITE_EOS in allowed else rng.choice(sorted(allowed))
            expect(matcher.accept_token(token), f"json walk {walk}: allowed token {token} refused")
            if token == SUITE_EOS:
                break
            text += SUITE_VOCAB[token]
        if not matcher.is_terminated():
            continue
        finished += 1
        try:
            doc = json.loads(text)
        except ValueError:
            expect(False, f"json walk {walk} ended at EOS with invalid JSON {text!r}")
        _validate(doc)
    expect(finished >= 6, f"only {finished} of 12 JSON walks reached EOS within 60 tokens")


@GRAMMAR_BACKEND_SUITE.check
def check_disallowed_token_is_refused_and_changes_nothing(factory: GrammarBackendFactory) -> None:
    """accept_token of a masked-out (or out-of-range) token returns False; the mask stays."""
    backend = _backend(factory)
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(regex="ab?c?")), max_rollback=0)
    before = _allowed(matcher, backend.vocab_size)
    forbidden = set(range(backend.vocab_size)) - _expected("ab?c?", _viable_fn("ab?c?"), "")
    for token in sorted(forbidden) + [backend.vocab_size, -1]:
        expect(not matcher.accept_token(token), f"disallowed token {token} was accepted")
    expect(_allowed(matcher, backend.vocab_size) == before, "a refused token changed the mask")
    expect(not matcher.can_terminate(), "can_terminate() before the regex 'ab?c?' matched")


@GRAMMAR_BACKEND_SUITE.check
def check_rollback_restores_the_bitmask(factory: GrammarBackendFactory) -> None:
    """rollback(k) returns to the mask k tokens back (through EOS too); beyond bounds it raises."""
    backend = _backend(factory)
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(regex="(ab|c)+")), max_rollback=4)
    masks = [_allowed(matcher, backend.vocab_size)]
    for token in ("ab", "c", "ab"):
        expect(matcher.accept_token(SUITE_VOCAB.index(token)), f"token {token!r} refused")
        masks.append(_allowed(matcher, backend.vocab_size))
    expect(matcher.accept_token(SUITE_EOS) and matcher.is_terminated(), "EOS refused after 'abcab'")
    matcher.rollback(1)
    expect(not matcher.is_terminated() and _allowed(matcher, backend.vocab_size) == masks[3],
           "rollback(1) after EOS did not restore the live matcher")
    matcher.rollback(2)
    expect(_allowed(matcher, backend.vocab_size) == masks[1], "rollback(2) did not restore the mask")
    for bad in (2, -1):  # one token left to undo; a negative count
        try:
            matcher.rollback(bad)
        except Exception:  # noqa: BLE001 - the Protocol names InvariantError; any error is a refusal
            pass
        else:
            expect(False, f"rollback({bad}) with 1 token accepted did not raise")
    expect(_allowed(matcher, backend.vocab_size) == masks[1], "a refused rollback changed the state")
    matcher.reset()
    expect(_allowed(matcher, backend.vocab_size) == masks[0], "reset() did not return to the start")
    short = backend.matcher(backend.compile(StructuredOutputsParams(regex="(ab|c)+")), max_rollback=1)
    expect(short.max_rollback == 1, f"max_rollback is {short.max_rollback}, built with 1")
    for token in ("ab", "c"):
        short.accept_token(SUITE_VOCAB.index(token))
    try:
        short.rollback(2)
    except Exception:  # noqa: BLE001
        pass
    else:
        expect(False, "rollback(2) on a matcher built with max_rollback=1 did not raise")


@GRAMMAR_BACKEND_SUITE.check
def check_fork_is_independent(factory: GrammarBackendFactory) -> None:
    """A fork starts at the parent's state; advancing one leaves the other as it was."""
    backend = _backend(factory)
    parent = backend.matcher(backend.compile(StructuredOutputsParams(choice=list(_CHOICES))), max_rollback=2)
    expect(parent.accept_token(SUITE_VOCAB.index("ab")), "'ab' refused by the choice grammar")
    at_fork = _allowed(parent, backend.vocab_size)
    child = parent.fork()
    expect(_allowed(child, backend.vocab_size) == at_fork, "a fork's mask differs from its parent's")
    expect(child.accept_token(SUITE_VOCAB.index("c")), "the fork refused 'c' after 'ab'")
    expect(_allowed(parent, backend.vocab_size) == at_fork, "advancing the fork changed the parent")
    expect(parent.accept_token(SUITE_EOS) and not child.is_terminated(), "EOS on the parent ended the fork")
    child.rollback(1)  # the fork keeps the parent's history
    expect(_allowed(child, backend.vocab_size) == at_fork, "the fork's rollback did not restore its mask")


@GRAMMAR_BACKEND_SUITE.check
def check_invalid_spec_raises_structured_output_error(factory: GrammarBackendFactory) -> None:
    """An invalid regex, grammar or schema raises StructuredOutputError naming the field."""
    backend = _backend(factory)
    for spec in (StructuredOutputsParams(regex="a("), StructuredOutputsParams(grammar="root ::= ("),
                 StructuredOutputsParams(json={"type": "no-such-type"})):
        try:
            backend.compile(spec)
        except StructuredOutputError as exc:
            expect(spec.kind in str(exc), f"the error for a bad {spec.kind} does not name it: {exc}")
        else:
            expect(False, f"compiling an invalid {spec.kind} {getattr(spec, spec.kind)!r} did not raise")


@GRAMMAR_BACKEND_SUITE.check
def check_compile_is_reusable(factory: GrammarBackendFactory) -> None:
    """One compiled grammar serves many matchers; equal specs give equal results."""
    backend = _backend(factory)
    first = backend.compile(StructuredOutputsParams(json=json.dumps(_SCHEMA)))
    second = backend.compile(StructuredOutputsParams(json=_SCHEMA))
    a, b = backend.matcher(first, max_rollback=0), backend.matcher(second, max_rollback=0)
    expect(a.accept_token(SUITE_VOCAB.index("{")), "'{' refused at the start of a JSON object")
    expect(_allowed(b, backend.vocab_size) == _allowed(backend.matcher(first, max_rollback=0), backend.vocab_size),
           "two matchers of equal specs start with different masks")
    expect(_allowed(a, backend.vocab_size) != _allowed(b, backend.vocab_size), "matchers share state")
    mask = torch.zeros(1, (backend.vocab_size + 31) // 32, dtype=torch.int32)
    b.fill_bitmask(mask, 0)
