"""Real-world JSON schemas (the 26 that ``check-jsonschema`` vendors: CI configs, dependabot,
compose, renovate, ...) through the xgrammar backend: each compiles or is refused with a
``StructuredOutputError``, and token walks guided by its mask (random tokens among the
allowed ones, leaning towards closing) end in JSON that ``jsonschema`` validates — for the
schemas xgrammar 0.2.9 enforces exactly. Without the backend's JSON token guard
(``xgrammar_matcher.json_guard``) strings with ``minLength`` / ``maxLength`` took raw control
characters, and github-issue-config failed here. The others are pinned below with what goes wrong
(docs/structured_outputs.md, "The xgrammar backend on real-world schemas"), so a change in
the backend shows here."""

from __future__ import annotations

import importlib.resources
import json
import random
from typing import Any

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("check_jsonschema")

from deepinfer_kit.models.tokenizer import ByteTokenizer  # noqa: E402
from deepinfer_kit.sample.structured import StructuredOutputError, StructuredOutputsParams  # noqa: E402
from deepinfer_kit.sample.structured.bitmask import allocate_bitmask  # noqa: E402
from deepinfer_kit.sample.structured.xgrammar_backend import XGrammarBackend  # noqa: E402

VENDOR = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
NAMES = sorted(p.name.removesuffix(".json") for p in VENDOR.iterdir() if p.name.endswith(".json"))
VOCAB, EOS = 259, 257
CLOSING = [ord(c) for c in '}]"0,:']
WALKS = 6

REFUSED = {  # xgrammar cannot compile them
    "github-actions": "EBNF lexer error (a pattern it cannot translate)",
    "github-workflows": "EBNF lexer error (a pattern it cannot translate)",
    "gitlab-ci": "minItems greater than the items a tuple allows",
}
APPROXIMATED = {  # compiled, but walks can end in JSON the schema rejects
    "citation-file-format": "a string with `format: uri` takes any `scheme:` (its pattern wants http/ftp)",
    "github-issue-forms": "the top-level type is lost (allOf / if-then approximated)",
    "snapcraft": "a top-level oneOf (one branch per base) not enforced",
    "dependabot": "allOf of several schemas (xgrammar: 'still ongoing'): the top-level type is lost",
    "drone-ci": "allOf / oneOf approximated: the top-level type and required properties are lost",
    "taskfile": "allOf / oneOf approximated: the top-level type and required properties are lost",
    "travis": "allOf of several schemas: the top-level type is lost",
    "woodpecker-ci": "oneOf with overlapping branches taken as anyOf",
    "buildkite": "oneOf with overlapping branches taken as anyOf ({} matches several notify kinds)",
    "circle-ci": "its own patterns use \\p{Cc}, which Python's re (so jsonschema) cannot compile",
}
QUICK = ["bamboo-spec", "bitbucket-pipelines", "cloudbuild", "codecov", "github-discussion",
         "meltano", "readthedocs"]


@pytest.fixture(scope="module")
def backend() -> XGrammarBackend:
    return XGrammarBackend.from_tokenizer(ByteTokenizer(), VOCAB, [EOS])


def _schema(name: str) -> dict[str, Any]:
    return json.loads(VENDOR.joinpath(name + ".json").read_text())


def _walk(backend: XGrammarBackend, grammar: Any, rng: random.Random, limit: int = 3000) -> str | None:
    """Tokens drawn among the allowed ones (closing tokens preferred, EOS taken when
    allowed, mostly) until EOS; the text, or None when the walk runs past ``limit``."""
    matcher = backend.matcher(grammar, max_rollback=0)
    bitmask = allocate_bitmask(1, VOCAB)
    out = bytearray()
    for _ in range(limit):
        matcher.fill_bitmask(bitmask, 0)
        words = bitmask[0].tolist()
        allowed = [t for t in range(VOCAB) if (words[t // 32] >> (t % 32)) & 1]
        assert allowed, "a mask with no token allowed before the grammar ended"
        if EOS in allowed and (len(allowed) == 1 or rng.random() < 0.9):
            assert matcher.accept_token(EOS) and matcher.is_terminated()
            return out.decode("utf-8", "replace")
        preferred = [t for t in CLOSING if t in allowed]
        token = preferred[0] if preferred and rng.random() < 0.8 else rng.choice([t for t in allowed if t != EOS])
        assert matcher.accept_token(token)
        out.append(token)
    return None


def _valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
        return False
    return True


def _check(name: str, backend: XGrammarBackend) -> None:
    schema = _schema(name)
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    if name in REFUSED:
        with pytest.raises(StructuredOutputError, match="could not be compiled"):
            backend.compile(spec)
        return
    grammar = backend.compile(spec)
    if name in APPROXIMATED and name != "circle-ci":  # circle-ci: its own patterns are the issue
        assert grammar.loosened, f"{name}: the backend does not say the schema may be loosened"
    rng = random.Random(name)
    texts = [t for t in (_walk(backend, grammar, rng) for _ in range(WALKS)) if t is not None]
    assert texts, f"{name}: no walk ended"
    valid = [_valid(t, schema) for t in texts]
    if name in APPROXIMATED:
        assert not all(valid), f"{name} is now enforced exactly: move it out of APPROXIMATED"
    else:
        assert all(valid), (name, [t[:120] for t, ok in zip(texts, valid) if not ok])


def test_the_corpus_is_the_expected_one() -> None:
    assert len(NAMES) >= 20 and set(REFUSED) | set(APPROXIMATED) | set(QUICK) <= set(NAMES)


@pytest.mark.parametrize("name", QUICK)
def test_schemas_enforced_exactly(name: str, backend: XGrammarBackend) -> None:
    _check(name, backend)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in NAMES if n not in QUICK])
def test_every_vendored_schema(name: str, backend: XGrammarBackend) -> None:
    _check(name, backend)
