"""Which parts of a JSON schema the xgrammar backend may enforce loosely.

xgrammar 0.2.9 compiles some schema keywords to a wider language than the schema's (its
own warnings say so for the first two; the project's corpus test found the others):

- ``oneOf`` whose branches are not provably disjoint is taken as ``anyOf``;
- ``allOf`` of several schemas is only partly merged (a top-level ``type`` can be lost);
- ``if`` / ``then`` / ``else`` conditions are not applied;
- ``format`` (``uri`` among them) accepts strings the format's own rule rejects.

:func:`loosened_keywords` lists those a schema uses, so a caller can warn; the grammar is
still what xgrammar compiles (as vLLM accepts it). Pure Python.
"""

from __future__ import annotations

from typing import Any

__all__ = ["loosened_keywords"]

_LOOSE = ("oneOf", "allOf", "if", "format")
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def loosened_keywords(schema: Any) -> tuple[str, ...]:
    """The keywords of :data:`_LOOSE` that ``schema`` (a decoded JSON schema) uses anywhere
    (``allOf`` only with two or more schemas), in that order. O(size of the schema);
    iterative, so a deeply nested schema cannot exhaust the stack."""
    found: set[str] = set()
    stack: list[tuple[Any, bool]] = [(schema, False)]  # (node, its keys are names, not keywords)
    while stack:
        node, names = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if not names:
                    if key == "allOf":
                        if isinstance(value, list) and len(value) > 1:
                            found.add(key)
                    elif key in ("oneOf", "if") or (key == "format" and isinstance(value, str)):
                        found.add(key)
                stack.append((value, not names and key in _NAME_MAPS))
        elif isinstance(node, list):
            stack.extend((item, False) for item in node)
    return tuple(k for k in _LOOSE if k in found)
