"""Brute-force references for the output text: a trained byte-level BPE tokenizer, and
the stop-string result computed by decoding every prefix of a token stream and searching
it whole."""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from deepinfer_kit.models.protocols import Tokenizer

CORPUS = [
    "The paged KV cache stores keys and values in blocks. ",
    "naïve café — déjà vu, smörgåsbord, Ærøskøbing. ",
    "東京の天気は晴れです。北京欢迎你！ 서울은 맑습니다. ",
    "emoji: 🎉🚀👩‍👩‍👧 ∑∞≠ ünïcödé. ",
    "stop here STOP, then ### end of text ###. ",
]
SPECIAL = "<|endoftext|>"


@lru_cache(maxsize=1)
def bpe_tokenizer_json(folder: str) -> Path:
    """A byte-level BPE ``tokenizer.json`` trained on :data:`CORPUS` with a small vocab
    (so most non-ASCII characters are split over several tokens) and one special token."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS * 20, trainer)
    path = Path(folder) / "tokenizer.json"
    backend.save(str(path))
    return path


def shown_text(tokenizer: Tokenizer, tokens: Sequence[int], k: int) -> str:
    """What an incremental detokenizer may show after ``k`` tokens: the decode of the
    longest prefix of at most ``k`` tokens whose text does not end in U+FFFD."""
    for j in range(k, 0, -1):
        text = tokenizer.decode(tokens[:j])
        if not text.endswith("\ufffd"):
            return text
    return ""


def stop_reference(
    tokenizer: Tokenizer, tokens: Sequence[int], stops: Sequence[str], min_tokens: int,
    include: bool,
) -> tuple[int, str | None, str]:
    """``(tokens kept, stop string or None, final text)`` for a stream of ``tokens`` that
    ends by length unless a stop string shows up: the first prefix (beyond
    ``min_tokens``) whose shown text holds a stop ending after the ``min_tokens`` text;
    the earliest such occurrence, ties to the first listed stop."""
    base = len(shown_text(tokenizer, tokens, min_tokens))
    for k in range(min_tokens + 1, len(tokens) + 1):
        text = shown_text(tokenizer, tokens, k)
        best: tuple[int, int] | None = None
        for order, stop in enumerate(stops):
            start = text.find(stop, max(0, base - len(stop) + 1))
            if start != -1 and (best is None or start < best[0]):
                best = (start, order)
        if best is not None:
            start, order = best
            stop = stops[order]
            return k, stop, text[: start + len(stop) if include else start]
    return len(tokens), None, tokenizer.decode(tokens)


@lru_cache(maxsize=1)
def byte_fallback_tokenizer_json(folder: str) -> Path:
    """A SentencePiece-style BPE ``tokenizer.json`` (``▁`` for spaces, byte fallback) trained
    on ASCII only, so every other character is spelled as ``<0xNN>`` byte tokens and the
    decoder strips the first leading space, as Llama's does."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, trainers

    backend = Backend(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    backend.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"])
    backend.train_from_iterator([CORPUS[0], CORPUS[4]] * 20, trainer)
    path = Path(folder) / "tokenizer.json"
    backend.save(str(path))
    data = json.loads(path.read_text())  # the byte tokens are plain vocabulary, not specials
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    path.write_text(json.dumps(data))
    return path
