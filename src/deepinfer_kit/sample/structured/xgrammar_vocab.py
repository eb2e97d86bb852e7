"""xgrammar's TokenizerInfo built from what the kit holds: a ByteTokenizer, an HFTokenizer (or a
``tokenizers.Tokenizer``), a transformers tokenizer, or an explicit vocabulary list."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from deepinfer_kit.errors import ConfigError

__all__ = ["import_xgrammar", "tokenizer_info_from", "tokenizer_key"]

_MISSING = ("structured outputs need xgrammar, which is not installed: "
            "pip install 'deepinfer_kit[structured]'")


def import_xgrammar() -> ModuleType:
    """The ``xgrammar`` module, imported on first use.

    Raises:
        ConfigError: xgrammar is not installed (the message says ``pip install
            'deepinfer_kit[structured]'``).
    """
    try:
        import xgrammar
    except ImportError:
        raise ConfigError(_MISSING) from None
    return xgrammar


def _check_stops(stop_token_ids: Sequence[int], vocab_size: int) -> list[int]:
    stops = list(stop_token_ids)
    if not stops:
        raise ConfigError("stop_token_ids must name at least one token (the EOS id), got []")
    for t in stops:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ConfigError(f"stop_token_ids entries must be ints in [0, {vocab_size}), got {t!r}")
    return stops


def _from_tokenizers_backend(xgr: ModuleType, backend: Any, vocab_size: int, stops: list[int]) -> Any:
    """From a ``tokenizers.Tokenizer``: its vocabulary, special added tokens blanked (they are
    never text a grammar may match, as vLLM filters them), metadata detected by xgrammar."""
    encoded: list[str] = [""] * vocab_size
    for token, idx in backend.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size:
            encoded[idx] = token
    for idx, added in backend.get_added_tokens_decoder().items():
        if getattr(added, "special", False) and idx < vocab_size:
            encoded[idx] = ""
    # The same detection TokenizerInfo.from_huggingface runs on a fast tokenizer's backend.
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=stops, add_prefix_space=meta["add_prefix_space"])


def _from_transformers(xgr: ModuleType, tokenizer: Any, vocab_size: int, stops: list[int]) -> Any:
    """From a transformers tokenizer, special tokens blanked as vLLM's xgrammar backend does."""
    full = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
    specials = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    encoded: list[str] = [""] * vocab_size
    for token, idx in tokenizer.get_vocab().items():
        if idx < vocab_size and idx not in specials:
            encoded[idx] = token
    return xgr.TokenizerInfo.from_vocab_and_metadata(encoded, full.dump_metadata())


def tokenizer_info_from(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] | None) -> Any:
    """An ``xgrammar.TokenizerInfo`` of width ``vocab_size`` for ``tokenizer``.

    Args:
        tokenizer: an ``xgrammar.TokenizerInfo`` (returned as is), the kit's ``ByteTokenizer``
            (ids 0..255 are bytes, the rest special), the kit's ``HFTokenizer`` or a
            ``tokenizers.Tokenizer``, a transformers tokenizer (``get_vocab``), or a sequence
            of ``str``/``bytes`` where entry ``i`` is token ``i``'s raw text (``""`` for a
            special token).
        vocab_size: ``V``, the model's logits width (>= the tokenizer's ids).
        stop_token_ids: the ids that end generation; None takes ``tokenizer.eos_token_id``.

    Raises:
        ConfigError: xgrammar missing, an unknown tokenizer type, no stop token, a stop id
            outside ``[0, V)``, or a vocabulary list longer than ``V``.
    """
    xgr = import_xgrammar()
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ConfigError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    if isinstance(tokenizer, xgr.TokenizerInfo):
        return tokenizer
    if stop_token_ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        stop_token_ids = [] if eos is None else [int(eos)]
    stops = _check_stops(stop_token_ids, vocab_size)
    from deepinfer_kit.models.tokenizer import ByteTokenizer, HFTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        byte_vocab: list[bytes] = [bytes([i]) for i in range(min(256, vocab_size))]
        byte_vocab += [b""] * (vocab_size - len(byte_vocab))
        return xgr.TokenizerInfo(byte_vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)
    if isinstance(tokenizer, HFTokenizer):
        # The kit's wrapper has no public accessor for its tokenizers.Tokenizer.
        return _from_tokenizers_backend(xgr, tokenizer._backend, vocab_size, stops)
    if type(tokenizer).__module__.startswith("tokenizers"):
        return _from_tokenizers_backend(xgr, tokenizer, vocab_size, stops)
    if hasattr(tokenizer, "get_vocab"):
        return _from_transformers(xgr, tokenizer, vocab_size, stops)
    if isinstance(tokenizer, Sequence) and not isinstance(tokenizer, (str, bytes)):
        vocab = list(tokenizer)
        if len(vocab) > vocab_size:
            raise ConfigError(f"the vocabulary list holds {len(vocab)} tokens, more than vocab_size {vocab_size}")
        for i, tok in enumerate(vocab):
            if not isinstance(tok, (str, bytes)):
                raise ConfigError(f"vocabulary entry {i} must be str or bytes, got {tok!r}")
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)
    raise ConfigError(f"tokenizer must be a Tokenizer, a tokenizers/transformers tokenizer, an "
                      f"xgrammar TokenizerInfo or a vocabulary list, got {type(tokenizer).__name__}")


def tokenizer_key(info: Any) -> str:
    """A fingerprint of an ``xgrammar.TokenizerInfo`` (its decoded vocabulary, stop ids and
    metadata): the tokenizer half of a compile-cache key. O(V)."""
    digest = hashlib.sha256()
    digest.update(str(info.dump_metadata()).encode())
    digest.update(repr(sorted(info.stop_token_ids)).encode())
    for token in info.decoded_vocab:
        digest.update(len(token).to_bytes(4, "little"))
        digest.update(token)
    return digest.hexdigest()
