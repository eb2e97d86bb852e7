"""XGrammarBackend: the GrammarBackend on xgrammar (the ``structured`` extra), with an LRU of
compiled grammars keyed by spec and tokenizer."""

from __future__ import annotations

import json as json_mod
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sample.structured.compile_cache import CompileCache
from deepinfer_kit.sample.structured.params import StructuredOutputError, StructuredOutputsParams
from deepinfer_kit.sample.structured.schema_scan import loosened_keywords
from deepinfer_kit.sample.structured.xgrammar_matcher import TokenGuard, XGrammarMatcher, json_guard
from deepinfer_kit.sample.structured.xgrammar_vocab import (
    import_xgrammar, tokenizer_info_from, tokenizer_key,
)

__all__ = ["XGrammarBackend", "XGrammarCompiled", "choice_as_ebnf"]

log = logging.getLogger("deepinfer_kit.structured")

_EBNF_ESCAPES = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}


def choice_as_ebnf(choices: Sequence[str]) -> str:
    """``root ::= "a" | "b" ...`` matching exactly one of ``choices`` (vLLM's
    ``choice_as_grammar``: quotes, backslashes and control characters escaped)."""
    def escape(s: str) -> str:
        return "".join(_EBNF_ESCAPES.get(ch) or (f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F
                                                 else ch) for ch in s)
    return "root ::= " + " | ".join(f'"{escape(c)}"' for c in choices)


def _is_lark(grammar: str) -> bool:
    """vLLM's test: a grammar with no ``::=`` rule outside comments is Lark, else EBNF."""
    import re

    for line in grammar.split("\n"):
        line = re.sub(r"(#|//).*$", "", line).strip()
        if "::=" in line:
            return False
    return True


@attrs.frozen(slots=True, eq=False)
class XGrammarCompiled:
    """A spec compiled by one :class:`XGrammarBackend` (a ``CompiledGrammar``)."""

    spec: StructuredOutputsParams
    handle: Any  # xgrammar.CompiledGrammar: immutable, shared by every matcher made of it
    tokenizer_key: str  # the backend's tokenizer fingerprint; a matcher checks it
    loosened: tuple[str, ...] = ()  # schema keywords xgrammar may enforce loosely (schema_scan)


class XGrammarBackend:
    """Compiles :class:`StructuredOutputsParams` with xgrammar for one tokenizer.

    Args:
        tokenizer_info: an ``xgrammar.TokenizerInfo`` of width ``vocab_size`` (see
            :meth:`from_tokenizer` for everything else).
        vocab_size: ``V``, the bitmask width (the model's logits width).
        cache: the compile cache (shareable between backends: keys hold the tokenizer's
            fingerprint); a fresh 256-entry one when None.
        max_threads: xgrammar's compile threads per compile call.

    ``compile`` is thread-safe (xgrammar's GrammarCompiler compiles concurrently and guards
    its own cache; :class:`CompileCache` takes a lock), so a background pool may call it.

    Raises:
        ConfigError: xgrammar missing (``pip install 'deepinfer_kit[structured]'``), or
            ``tokenizer_info.vocab_size`` is not ``vocab_size``.
    """

    def __init__(self, tokenizer_info: Any, vocab_size: int, *,
                 cache: CompileCache[XGrammarCompiled] | None = None, max_threads: int = 8) -> None:
        xgr = import_xgrammar()
        if not isinstance(tokenizer_info, xgr.TokenizerInfo):
            raise ConfigError(f"tokenizer_info must be an xgrammar.TokenizerInfo, got "
                              f"{type(tokenizer_info).__name__} (use XGrammarBackend.from_tokenizer)")
        if tokenizer_info.vocab_size != vocab_size:
            raise ConfigError(f"vocab_size must equal tokenizer_info.vocab_size "
                              f"{tokenizer_info.vocab_size}, got {vocab_size!r}")
        self._xgr = xgr
        self._info = tokenizer_info
        self._vocab_size = vocab_size
        self._stop_ids = tuple(int(t) for t in tokenizer_info.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_threads)
        self._cache: CompileCache[XGrammarCompiled] = cache if cache is not None else CompileCache(256)
        self.tokenizer_key = tokenizer_key(tokenizer_info)
        self._guards: dict[bool, TokenGuard] = {}  # JSON grammars' token guards (json_guard), by compactness

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] | None = None,
                       *, cache: CompileCache[XGrammarCompiled] | None = None,
                       max_threads: int = 8) -> XGrammarBackend:
        """A backend for the kit's ``ByteTokenizer`` (the embedded models') or ``HFTokenizer``,
        a ``tokenizers.Tokenizer``, a transformers tokenizer, an ``xgrammar.TokenizerInfo``,
        or a vocabulary list (entry ``i`` is token ``i``'s raw text; ``""`` special).

        ``stop_token_ids``: the ids allowed where the grammar may end (None: the tokenizer's
        EOS). Special added tokens of HF tokenizers are never allowed by a grammar.

        Raises:
            ConfigError: as :func:`tokenizer_info_from` (naming the field) and ``__init__``.
        """
        info = tokenizer_info_from(tokenizer, vocab_size, stop_token_ids)
        return cls(info, vocab_size, cache=cache, max_threads=max_threads)

    @property
    def vocab_size(self) -> int:
        """``V``: the bitmask width in tokens."""
        return self._vocab_size

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids allowed (only) where a grammar may end."""
        return self._stop_ids

    @property
    def cache(self) -> CompileCache[XGrammarCompiled]:
        """The compile cache (read its ``hits``/``misses``)."""
        return self._cache

    def compile(self, spec: StructuredOutputsParams) -> XGrammarCompiled:
        """See ``GrammarBackend.compile``: a cached grammar, else xgrammar's compile (whose
        failures become :class:`StructuredOutputError` naming the spec field).

        ``disable_additional_properties`` needs nothing here: xgrammar's strict mode (always on)
        already allows only the properties a schema names. ``whitespace_pattern`` is refused.
        """
        if not isinstance(spec, StructuredOutputsParams):
            raise ConfigError(f"spec must be a StructuredOutputsParams, got {type(spec).__name__}")
        key = (spec.key(), self.tokenizer_key)
        found = self._cache.get(key)
        if found is not None:
            return found
        if spec.whitespace_pattern is not None:
            raise StructuredOutputError(
                f"whitespace_pattern is not supported by the xgrammar backend, got "
                f"{spec.whitespace_pattern!r} (use disable_any_whitespace)")
        kind = spec.kind
        try:
            handle = self._compile(spec)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with C++ context
            message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise StructuredOutputError(f"{kind} could not be compiled: {message}") from exc
        loose: tuple[str, ...] = ()
        if spec.json is not None:
            loose = loosened_keywords(json_mod.loads(spec.json) if isinstance(spec.json, str) else spec.json)
            if loose:
                log.warning("structured_outputs json: the schema uses %s, which xgrammar may enforce "
                            "loosely (outputs can then fail the schema)", ", ".join(loose))
        compiled = XGrammarCompiled(spec, handle, self.tokenizer_key, loose)
        self._cache.put(key, compiled)
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        c = self._compiler
        whitespace = {"any_whitespace": not spec.disable_any_whitespace,
                      "separators": (",", ":") if spec.disable_any_whitespace else None}
        if spec.json is not None:
            schema = spec.json if isinstance(spec.json, str) else json_mod.dumps(spec.json)
            return c.compile_json_schema(schema, strict_mode=True, **whitespace)
        if spec.json_object is not None:
            return c.compile_json_schema('{"type": "object"}', strict_mode=True, **whitespace)
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            return c.compile_grammar(choice_as_ebnf(spec.choice))
        if spec.grammar is not None:
            return c.compile_lark(spec.grammar) if _is_lark(spec.grammar) else c.compile_grammar(spec.grammar)
        assert spec.structural_tag is not None
        tag = json_mod.loads(spec.structural_tag)
        if "structures" in tag:  # the legacy form vLLM still accepts
            items = [self._xgr.StructuralTagItem(begin=s["begin"], schema=json_mod.dumps(s["schema"]),
                                                 end=s["end"]) for s in tag["structures"]]
            return c.compile_structural_tag(items, tag["triggers"])
        return c.compile_structural_tag(spec.structural_tag)

    def matcher(self, grammar: Any, *, max_rollback: int) -> XGrammarMatcher:
        """See ``GrammarBackend.matcher``. O(1) beyond xgrammar's matcher construction."""
        if isinstance(max_rollback, bool) or not isinstance(max_rollback, int) or max_rollback < 0:
            raise ConfigError(f"max_rollback must be an int >= 0, got {max_rollback!r}")
        if not isinstance(grammar, XGrammarCompiled) or grammar.tokenizer_key != self.tokenizer_key:
            raise ConfigError(f"grammar must come from this backend's compile, got {type(grammar).__name__}")
        guard = None
        if grammar.spec.kind in ("json", "json_object"):
            compact = grammar.spec.disable_any_whitespace
            guard = self._guards.get(compact)
            if guard is None:
                guard = self._guards[compact] = json_guard(self._info.decoded_vocab, self._vocab_size,
                                                           compact=compact)
        return XGrammarMatcher(self._xgr.GrammarMatcher(grammar.handle), vocab_size=self._vocab_size,
                               stop_ids=self._stop_ids, max_rollback=max_rollback, guard=guard)


if TYPE_CHECKING:
    from deepinfer_kit.sample.structured.protocols import CompiledGrammar, GrammarBackend

    _check_backend: type[GrammarBackend] = XGrammarBackend
    _check_compiled: type[CompiledGrammar] = XGrammarCompiled
