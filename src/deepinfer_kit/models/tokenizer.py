"""Tokenizers: a built-in byte-level one, and a wrapper of ``tokenizers`` for tokenizer.json.

:func:`load_tokenizer` reads the checkpoint's ``tokenizer.json`` with ``tokenizers`` (a
declared dependency); a folder without one gets no tokenizer of its own, and
:func:`missing_tokenizer_reason` says so, for an engine refusing text prompts. The
byte-level tokenizer is the embedded model's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepinfer_kit.errors import CheckpointError, ConfigError
from deepinfer_kit.models.chat_template import special_token_strings
from deepinfer_kit.models.protocols import Tokenizer

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "load_tokenizer", "missing_tokenizer_reason"]


_BYTE_SPECIALS = ("<bos>", "<eos>", "<pad>")


class ByteTokenizer:
    """UTF-8 bytes as ids ``0..255`` plus three specials: ``<bos>`` 256, ``<eos>`` 257,
    ``<pad>`` 258 (``vocab_size`` 259).

    ``encode`` adds no special token; ``decode`` skips special ids (or writes their names)
    and replaces invalid UTF-8 with U+FFFD. Stateless and O(len) both ways.
    """

    __slots__ = ()

    BOS = 256
    EOS = 257
    PAD = 258

    @property
    def vocab_size(self) -> int:
        """259."""
        return 259

    @property
    def eos_token_id(self) -> int:
        """257."""
        return self.EOS

    @property
    def bos_token_id(self) -> int:
        """256."""
        return self.BOS

    @property
    def pad_token_id(self) -> int:
        """258."""
        return self.PAD

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of the byte ids in ``ids``; special ids are skipped, or written as
        ``<bos>`` / ``<eos>`` / ``<pad>`` when ``skip_special_tokens`` is False.

        Raises:
            ConfigError: an id outside ``[0, 259)``.
        """
        if type(ids) in (list, tuple):  # not any buffer: bytes() would copy its raw memory
            try:  # plain bytes, the common case: one C call checks and converts them
                return bytes(ids).decode("utf-8", "replace")
            except ValueError:
                pass  # a special id (or a bad one): the checks below
        for token in ids:
            if not 0 <= token < 259:
                raise ConfigError(f"token id must be in [0, 259), got {token}")
        if skip_special_tokens or all(t < 256 for t in ids):
            return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")
        parts: list[str] = []
        run: list[int] = []
        for t in ids:
            if t < 256:
                run.append(t)
                continue
            parts.append(bytes(run).decode("utf-8", errors="replace"))
            parts.append(_BYTE_SPECIALS[t - 256])
            run = []
        parts.append(bytes(run).decode("utf-8", errors="replace"))
        return "".join(parts)


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` read from ``tokenizer.json``.

    Args:
        path: the ``tokenizer.json`` file.
        eos_token_id: overrides the EOS id (the model config's first EOS id).
        bos_token_id: overrides the BOS id.

    Raises:
        CheckpointError: the file cannot be parsed.
    """

    def __init__(self, path: str | os.PathLike[str], *, eos_token_id: int | None = None,
                 bos_token_id: int | None = None) -> None:
        from tokenizers import Tokenizer as _Backend

        try:
            self._backend: Any = _Backend.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own exception type
            raise CheckpointError(f"cannot read tokenizer {str(path)!r}: {exc}") from None
        specials = special_token_strings(Path(path).parent)
        self._eos = eos_token_id if eos_token_id is not None else self._id_of(specials.get("eos_token"))
        self._bos = bos_token_id if bos_token_id is not None else self._id_of(specials.get("bos_token"))

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        found = self._backend.token_to_id(token)
        return int(found) if found is not None else None

    @property
    def vocab_size(self) -> int:
        """Ids including added tokens."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_id(self) -> int | None:
        """From the model config, else ``tokenizer_config.json``'s ``eos_token``."""
        return self._eos

    @property
    def bos_token_id(self) -> int | None:
        """From the model config, else ``tokenizer_config.json``'s ``bos_token``."""
        return self._bos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text``, with the specials the tokenizer's post-processor adds unless
        ``add_special_tokens`` is False (a rendered chat template holds its own)."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens skipped unless ``skip_special_tokens`` is False."""
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))


def missing_tokenizer_reason(folder: str | os.PathLike[str] | None) -> str:
    """Why a checkpoint folder yields no tokenizer of its own, for an error message that
    goes on to say "pass token ids".

    Says the folder has no ``tokenizer.json``, or (``folder=None``) that the model was not
    read from a folder.
    """
    if folder is None:
        return "the model was not read from a checkpoint folder"
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return f"checkpoint folder {str(folder)!r} has no tokenizer.json"
    return f"{str(path)!r} was not loaded"


def load_tokenizer(folder: str | os.PathLike[str], *, eos_token_id: int | None = None,
                   bos_token_id: int | None = None, required: bool = False) -> Tokenizer:
    """The tokenizer of a checkpoint (or tokenizer) folder.

    ``tokenizer.json`` through :class:`HFTokenizer` when the file exists; otherwise a
    :class:`ByteTokenizer` (which the engine keeps only when the model's vocabulary is bytes).

    Args:
        required: raise instead of falling back (a folder given as ``tokenizer=``).

    Raises:
        CheckpointError: ``tokenizer.json`` exists but cannot be parsed, or is missing
            while ``required``.
    """
    path = Path(folder) / "tokenizer.json"
    if path.is_file():
        return HFTokenizer(path, eos_token_id=eos_token_id, bos_token_id=bos_token_id)
    if required:
        raise CheckpointError(f"tokenizer folder {str(folder)!r} has no tokenizer.json")
    return ByteTokenizer()


if TYPE_CHECKING:
    _byte: type[Tokenizer] = ByteTokenizer
    _hf: type[Tokenizer] = HFTokenizer
