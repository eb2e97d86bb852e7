"""StructuredOutputsParams: vLLM 0.33's fields, its mutual exclusion, validation and key()."""

from __future__ import annotations

import attrs
import pytest

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sample.structured import StructuredOutputError, StructuredOutputsParams as S
from deepinfer_kit.sample.structured.params import CONSTRAINT_FIELDS

_ONE_OF_EACH = {"json": {"type": "object"}, "regex": "a+", "choice": ["x", "y"], "grammar": 'root ::= "a"',
                "json_object": True, "structural_tag": '{"type": "structural_tag", "format": {}}'}


def test_field_names_are_vllms() -> None:
    assert [f.name for f in attrs.fields(S) if f.init] == [
        "json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
        "disable_additional_properties", "whitespace_pattern", "structural_tag"]


@pytest.mark.parametrize("field", CONSTRAINT_FIELDS)
def test_each_constraint_alone_is_accepted(field: str) -> None:
    spec = S(**{field: _ONE_OF_EACH[field]})
    assert spec.kind == field


def test_mutual_exclusion_names_the_fields() -> None:
    with pytest.raises(StructuredOutputError, match="got none"):
        S()
    with pytest.raises(StructuredOutputError, match="got regex, choice"):
        S(regex="a", choice=["b"])
    with pytest.raises(ConfigError, match="json, regex, choice, grammar, json_object, structural_tag"):
        S(json="{}", grammar="root ::= \"a\"", json_object=True)
    with pytest.raises(StructuredOutputError, match="got none"):
        S(disable_any_whitespace=True)


@pytest.mark.parametrize("kwargs, field", [
    ({"choice": []}, "choice"), ({"choice": ["a", 1]}, r"choice\[1\]"), ({"choice": "ab"}, "choice"),
    ({"json": "{not json"}, "json"), ({"json": ""}, "json"), ({"json": "[1, 2]"}, "json"),
    ({"json": 5}, "json"), ({"regex": 3}, "regex"), ({"regex": "a\x00"}, "regex"),
    ({"grammar": "  "}, "grammar"), ({"json_object": False}, "json_object"),
    ({"json_object": 1}, "json_object"), ({"structural_tag": "[]"}, "structural_tag"),
    ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace"),
    ({"regex": "a", "whitespace_pattern": 2}, "whitespace_pattern"),
])
def test_bad_values_name_their_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(StructuredOutputError, match=field):
        S(**kwargs)  # type: ignore[arg-type]


def test_deep_nesting_is_refused() -> None:
    deep: dict[str, object] = {"type": "object"}
    for _ in range(70):
        deep = {"properties": {"x": deep}}
    with pytest.raises(StructuredOutputError, match="nested too deeply"):
        S(json=deep)
    with pytest.raises(StructuredOutputError, match="nested too deeply"):
        S(json="[" * 100_000 + "]" * 100_000)


def test_key_is_canonical_and_hashable() -> None:
    a = S(json={"b": 1, "a": {"y": 2, "x": 3}})
    b = S(json='{"a": {"x": 3, "y": 2}, "b": 1}')
    assert a.key() == b.key() and a == b and hash(a) == hash(b)
    assert a.key() == ("json", '{"a":{"x":3,"y":2},"b":1}', False, False, None)
    assert S(json={"a": 1}, disable_any_whitespace=True).key() != S(json={"a": 1}).key()
    assert S(regex="a").key() != S(grammar="a").key()
    assert S(choice=["a", "b"]).key() != S(choice=["b", "a"]).key()
    assert S(choice=("a", "b")) == S(choice=["a", "b"])
    assert S(json_object=True).key() == ("json_object", "", False, False, None)
    assert len({S(regex="a"), S(regex="a"), S(regex="b")}) == 2


def test_frozen() -> None:
    spec = S(regex="a")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        spec.regex = "b"  # type: ignore[misc]
    assert S(choice=["a"]).choice == ("a",)
