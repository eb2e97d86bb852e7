"""The body fields that constrain an answer to a grammar: vLLM's ``structured_outputs``
object and OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``), as one
:class:`~deepinfer_kit.sample.structured.StructuredOutputsParams` or ``None``. Pure Python."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sample.structured.params import StructuredOutputsParams
from deepinfer_kit.serve.options import short

__all__ = ["structured_from_body"]


def structured_from_body(body: Mapping[str, Any]) -> StructuredOutputsParams | None:
    """The request's grammar, if it asks for one.

    ``structured_outputs``: an object of :class:`StructuredOutputsParams` fields (``json``,
    ``regex``, ``choice``, ``grammar``, ``json_object``, ``structural_tag`` and the
    options). ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``
    (any JSON object) or ``{"type": "json_schema", "json_schema": {"name": ..., "schema":
    {...}}}``. Both at once are refused.

    Raises:
        ConfigError: a malformed field; the message starts with the field's name (the
            server turns it into a 400 naming it).
    """
    from_format = _response_format(body.get("response_format"))
    raw = body.get("structured_outputs")
    if raw is None:
        return from_format
    if from_format is not None:
        raise ConfigError("structured_outputs and a response_format other than text cannot both be given")
    if not isinstance(raw, Mapping):
        raise ConfigError(f"structured_outputs must be an object, got {short(raw)}")
    try:
        return StructuredOutputsParams(**dict(raw))
    except TypeError as exc:
        raise ConfigError(f"structured_outputs: {exc}") from None


def _response_format(raw: object) -> StructuredOutputsParams | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"response_format must be an object, got {short(raw)}")
    kind = raw.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = raw.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise ConfigError(f"response_format.json_schema.schema must be an object, got {short(spec)}")
        return StructuredOutputsParams(json=dict(schema))
    raise ConfigError(f"response_format.type must be text, json_object or json_schema, got {short(kind)}")
