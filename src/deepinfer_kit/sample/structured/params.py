"""StructuredOutputsParams: which grammar constrains a request's output (vLLM 0.33's record)."""

from __future__ import annotations

import json as json_mod
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from deepinfer_kit.errors import ConfigError

__all__ = ["StructuredOutputError", "StructuredOutputsParams", "StructuredKind", "CONSTRAINT_FIELDS"]

StructuredKind = Literal["json", "regex", "choice", "grammar", "json_object", "structural_tag"]

#: The constraint fields, exactly one of which a spec sets (vLLM's mutual-exclusion set).
CONSTRAINT_FIELDS: tuple[StructuredKind, ...] = (
    "json", "regex", "choice", "grammar", "json_object", "structural_tag",
)

#: vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING and STRUCTURAL_TAG_WRAPPER_NESTING.
MAX_JSON_NESTING = 64
_STRUCTURAL_TAG_EXTRA_NESTING = 16


class StructuredOutputError(ConfigError):
    """A structured-output spec that is invalid or cannot be compiled (a bad regex, grammar
    or JSON schema, an unsupported option). The message names the spec field at fault."""


def _exceeds_nesting(doc: Any, limit: int) -> bool:
    """Whether ``doc`` nests objects and arrays more than ``limit`` levels (iterative)."""
    level: list[Any] = [doc]
    for _ in range(limit):
        level = [
            child
            for node in level
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return False
    return True


def _load_json(field: str, value: str | dict[str, Any], limit: int) -> Any:
    """``value`` parsed (a dict is taken as is); raises naming ``field``."""
    if isinstance(value, str):
        if not value.strip():
            raise StructuredOutputError(f"{field} must not be an empty string")
        try:
            doc = json_mod.loads(value)
        except RecursionError:
            raise StructuredOutputError(f"{field} is nested too deeply") from None
        except ValueError as exc:
            raise StructuredOutputError(f"{field} is not valid JSON ({exc}): {value[:80]!r}") from None
    else:
        doc = value
    if isinstance(doc, (dict, list)) and _exceeds_nesting(doc, limit):
        raise StructuredOutputError(
            f"{field} is nested too deeply: objects and arrays may nest at most {limit} levels")
    return doc


def _check_json(inst: StructuredOutputsParams, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, (str, dict)):
        raise StructuredOutputError(f"json must be a str or a dict (a JSON schema), got {type(value).__name__}")
    doc = _load_json("json", value, MAX_JSON_NESTING)
    if not isinstance(doc, (dict, bool)):
        raise StructuredOutputError(f"json must be a JSON schema (an object or a boolean), got {doc!r}"[:200])


def _check_optional_str(inst: StructuredOutputsParams, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise StructuredOutputError(f"{attribute.name} must be a str, got {type(value).__name__} {value!r}")
    if isinstance(value, str) and "\x00" in value:
        raise StructuredOutputError(f"{attribute.name} must not contain a NUL character ('\\x00')")


def _check_grammar(inst: StructuredOutputsParams, attribute: attrs.Attribute[Any], value: Any) -> None:
    _check_optional_str(inst, attribute, value)
    if isinstance(value, str) and not value.strip():
        raise StructuredOutputError("grammar must not be empty")


def _to_choice(value: Any) -> Any:
    """A list (or any non-string sequence) of choices as a tuple; anything else unchanged."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return tuple(value)
    return value


def _check_choice(inst: StructuredOutputsParams, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, tuple):
        raise StructuredOutputError(f"choice must be a list of str, got {type(value).__name__} {value!r}")
    if not value:
        raise StructuredOutputError("choice must hold at least one string, got []")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise StructuredOutputError(f"choice[{i}] must be a str, got {type(item).__name__} {item!r}")
        if "\x00" in item:
            raise StructuredOutputError(f"choice[{i}] must not contain a NUL character ('\\x00')")


def _check_json_object(inst: StructuredOutputsParams, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and value is not True:
        raise StructuredOutputError(
            f"json_object must be True if set (omit structured outputs to disable them), got {value!r}")


def _check_structural_tag(inst: StructuredOutputsParams, attribute: attrs.Attribute[Any], value: Any) -> None:
    _check_optional_str(inst, attribute, value)
    if value is not None:
        doc = _load_json("structural_tag", value, MAX_JSON_NESTING + _STRUCTURAL_TAG_EXTRA_NESTING)
        if not isinstance(doc, dict):
            raise StructuredOutputError(f"structural_tag must be a JSON object, got {value[:80]!r}")


def _check_bool(inst: StructuredOutputsParams, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise StructuredOutputError(f"{attribute.name} must be a bool, got {type(value).__name__} {value!r}")


@attrs.frozen(slots=True, eq=False)
class StructuredOutputsParams:
    """What a request's output must match: exactly one of ``json`` (a JSON schema, as a str or
    a dict), ``regex``, ``choice`` (one of these strings), ``grammar`` (EBNF/GBNF as xgrammar
    reads it), ``json_object`` (any JSON object; only ``True``) or ``structural_tag`` (xgrammar's
    structural tag, a JSON string), as vLLM 0.33's ``StructuredOutputsParams`` spells them.

    Options: ``disable_any_whitespace`` (JSON without free whitespace between tokens),
    ``disable_additional_properties`` (objects take only the properties their schema names),
    ``whitespace_pattern`` (a regex for JSON whitespace; not every backend supports it).

    Validated at construction; equal specs (a dict schema and its JSON text included) have
    the same :meth:`key` and compare and hash equal.

    Raises:
        StructuredOutputError: none or several constraint fields set (naming them), or a field
            of the wrong type or value (naming it): an empty ``choice``, a ``json`` that is not
            JSON, ``json_object=False``, a NUL character in a regex or grammar.
    """

    json: str | dict[str, Any] | None = attrs.field(default=None, validator=_check_json)
    regex: str | None = attrs.field(default=None, validator=_check_optional_str)
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_to_choice, validator=_check_choice)
    grammar: str | None = attrs.field(default=None, validator=_check_grammar)
    json_object: bool | None = attrs.field(default=None, validator=_check_json_object)
    disable_any_whitespace: bool = attrs.field(default=False, validator=_check_bool)
    disable_additional_properties: bool = attrs.field(default=False, validator=_check_bool)
    whitespace_pattern: str | None = attrs.field(default=None, validator=_check_optional_str)
    structural_tag: str | None = attrs.field(default=None, validator=_check_structural_tag)
    _key: tuple[str, str, bool, bool, str | None] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        set_fields = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(set_fields) != 1:
            got = ", ".join(set_fields) if set_fields else "none"
            raise StructuredOutputError(
                "structured outputs take exactly one of " + ", ".join(CONSTRAINT_FIELDS)
                + f"; got {got}")
        object.__setattr__(self, "_key", self._canonical())  # once: the engine compares specs every step

    @property
    def kind(self) -> StructuredKind:
        """The constraint field that is set."""
        for name in CONSTRAINT_FIELDS:
            if getattr(self, name) is not None:
                return name
        raise AssertionError("unreachable: validated at construction")

    def key(self) -> tuple[str, str, bool, bool, str | None]:
        """:meth:`_canonical`, computed once at construction."""
        return self._key

    def _canonical(self) -> tuple[str, str, bool, bool, str | None]:
        """A canonical, hashable key for a compile cache: ``(kind, payload,
        disable_any_whitespace, disable_additional_properties, whitespace_pattern)``.

        The payload of ``json`` and ``structural_tag`` is their JSON re-serialized with sorted
        keys (a dict schema and the same schema as text share a key); ``choice`` is its JSON
        list; ``json_object`` is ``""``. O(size of the spec).
        """
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            doc = json_mod.loads(value) if isinstance(value, str) else value
            payload = json_mod.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        elif kind == "structural_tag":
            payload = json_mod.dumps(json_mod.loads(value), sort_keys=True, separators=(",", ":"),
                                     ensure_ascii=False)
        elif kind == "choice":
            payload = json_mod.dumps(list(value), ensure_ascii=False)
        elif kind == "json_object":
            payload = ""
        else:
            payload = value
        return (kind, payload, self.disable_any_whitespace, self.disable_additional_properties,
                self.whitespace_pattern)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StructuredOutputsParams):
            return NotImplemented
        return self is other or self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)
