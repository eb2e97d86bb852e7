"""sample/structured/: structured outputs (JSON schema, regex, choice, grammar) as components.

``StructuredOutputsParams`` is pure Python and imported eagerly (a request record holds it);
the Protocols, bitmask ops and the xgrammar backend are resolved on first use (PEP 562), so
importing this package needs neither torch nor xgrammar. xgrammar ships in the
``structured`` extra: ``pip install 'deepinfer_kit[structured]'``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepinfer_kit._lazy import lazy_attribute

from deepinfer_kit.sample.structured.params import StructuredOutputError, StructuredOutputsParams

if TYPE_CHECKING:
    from deepinfer_kit.sample.structured.bitmask import allocate_bitmask, apply_bitmask
    from deepinfer_kit.sample.structured.compile_cache import CompileCache
    from deepinfer_kit.sample.structured.protocols import CompiledGrammar, GrammarBackend, GrammarMatcher
    from deepinfer_kit.sample.structured.xgrammar_backend import XGrammarBackend

_LAZY = {
    "GrammarBackend": "deepinfer_kit.sample.structured.protocols",
    "GrammarMatcher": "deepinfer_kit.sample.structured.protocols",
    "CompiledGrammar": "deepinfer_kit.sample.structured.protocols",
    "allocate_bitmask": "deepinfer_kit.sample.structured.bitmask",
    "apply_bitmask": "deepinfer_kit.sample.structured.bitmask",
    "CompileCache": "deepinfer_kit.sample.structured.compile_cache",
    "XGrammarBackend": "deepinfer_kit.sample.structured.xgrammar_backend",
}

__all__ = [
    "StructuredOutputsParams",
    "StructuredOutputError",
    "GrammarBackend",
    "GrammarMatcher",
    "CompiledGrammar",
    "allocate_bitmask",
    "apply_bitmask",
    "CompileCache",
    "XGrammarBackend",
]


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, name)
