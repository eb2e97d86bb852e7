"""Keyed block hashing for the prefix indexes: context encoding and chained block keys.

Keys are keyed BLAKE2b digests. The key is random per process unless given, so a client
who controls prompts cannot predict a key, let alone craft two prompts with equal keys
(Python's ``hash`` is not used anywhere: ``hash(None)`` and ``hash(int)`` are the same
in every process, which made collisions craftable in other engines).
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
from array import array
from collections.abc import Hashable, Sequence

from deepinfer_kit.errors import ConfigError

__all__ = ["BlockHasher", "encode_context", "new_key", "extend_block_bytes", "hash_key_is_secret"]


def _framed(tag: bytes, payload: bytes) -> bytes:
    return tag + str(len(payload)).encode() + b":" + payload


def encode_context(context: Hashable) -> bytes:
    """A byte encoding of a prefix-cache ``context`` that is the same in every process.

    ``None``, bools, ints, floats, strings, bytes and (nested) tuples / frozensets of them
    get an unambiguous, length-framed encoding; any other object is encoded by its type
    name and ``repr``. Indexes also compare contexts with ``==`` on a hit, so an
    ambiguous encoding can only cost a miss, never a wrong hit.
    """
    if context is None:
        return b"N"
    if isinstance(context, bool):
        return b"T" if context else b"F"
    if isinstance(context, int):
        return _framed(b"i", str(context).encode())
    if isinstance(context, float):
        return _framed(b"f", context.hex().encode())
    if isinstance(context, str):
        return _framed(b"s", context.encode("utf-8", "surrogatepass"))
    if isinstance(context, (bytes, bytearray)):
        return _framed(b"b", bytes(context))
    if isinstance(context, tuple):
        return _framed(b"t", b"".join(encode_context(c) for c in context))
    if isinstance(context, frozenset):
        return _framed(b"z", b"".join(sorted(encode_context(c) for c in context)))
    name = f"{type(context).__module__}.{type(context).__qualname__}"
    return _framed(b"o", name.encode() + b"|" + repr(context).encode())


def _block_array(tokens: Sequence[int], first: int, end: int, block_size: int) -> array[int]:
    """Tokens of blocks ``[first, end)`` as native uint32s (``4 * P`` bytes per block).

    Raises:
        OverflowError: a token id outside ``[0, 2**32)``.
    """
    seg = tokens[first * block_size : end * block_size]
    if type(seg) is list:
        out = array("I")
        out.fromlist(seg)  # twice as fast as array("I", seg) on a list of ints
        return out
    return array("I", seg)


def _block_bytes(tokens: Sequence[int], first: int, end: int, block_size: int) -> memoryview:
    """:func:`_block_array` as a byte view: slicing it copies nothing, so each block's key
    is built with one copy."""
    return memoryview(_block_array(tokens, first, end, block_size)).cast("B")


def hash_key_is_secret() -> bool:
    """True when Python's ``str`` / ``bytes`` hash is keyed by a random per-process secret
    (``PYTHONHASHSEED`` unset, empty or ``random``), so a client cannot craft dict-key
    collisions; False when a fixed seed makes the hash predictable."""
    return sys.flags.hash_randomization == 1 and os.environ.get("PYTHONHASHSEED", "") in (
        "",
        "random",
    )


def new_key(key: bytes | None, name: str = "key") -> bytes:
    """``key`` checked (bytes, at most 64 long), or 32 fresh random bytes when ``None``.

    Raises:
        ConfigError: ``key`` is not bytes or longer than 64 bytes.
    """
    if key is None:
        return os.urandom(32)
    if not isinstance(key, bytes) or len(key) > 64:
        raise ConfigError(f"{name} must be bytes of length <= 64, got {key!r}")
    return key


_CHUNK = 64  # blocks split by one struct call
_splitters: dict[tuple[int, int], struct.Struct] = {}


def _splitter(num_blocks: int, stride: int) -> struct.Struct:
    """A ``struct`` format that cuts ``num_blocks * stride`` bytes into ``num_blocks``
    bytes objects in one C call (cached; at most ``_CHUNK`` blocks per format)."""
    fmt = _splitters.get((num_blocks, stride))
    if fmt is None:
        fmt = _splitters[(num_blocks, stride)] = struct.Struct(f"{stride}s" * num_blocks)
    return fmt


def extend_block_bytes(
    keys: list[bytes], tokens: Sequence[int], num_blocks: int, block_size: int, salt: bytes
) -> None:
    """Append ``salt || tokens of block i`` (uint32 native byte order) to ``keys`` until
    it holds ``num_blocks`` keys: exact block identities whose Python hash (SipHash, keyed
    per process) is also keyed by ``salt`` when it is not empty. O(new blocks).

    Raises:
        OverflowError: a token id outside ``[0, 2**32)``.
    """
    have = len(keys)
    if have >= num_blocks:
        return
    if have + 1 == num_blocks:  # one block: a decode filled it (2.5x cheaper than the split)
        key = _block_array(tokens, have, num_blocks, block_size).tobytes()
        keys.append(salt + key if salt else key)
        return
    stride = 4 * block_size
    if salt:
        view = _block_bytes(tokens, have, num_blocks, block_size)
        keys.extend([salt + view[off : off + stride] for off in range(0, len(view), stride)])
        return
    # Unsalted: the blocks are cut from the uint32 buffer by struct, in C (no Python loop
    # per block; 5x faster than slicing bytes in a comprehension).
    data = _block_array(tokens, have, num_blocks, block_size)
    todo = num_blocks - have
    off = 0
    while todo > 0:
        k = _CHUNK if todo > _CHUNK else todo
        keys.extend(_splitter(k, stride).unpack_from(data, off))
        off += k * stride
        todo -= k


class BlockHasher:
    """Keyed BLAKE2b over token blocks.

    Args:
        key: the hash key (at most 64 bytes). ``None`` draws 32 random bytes, so keys
            differ between processes; pass a fixed key only to share keys across
            processes you trust.
        digest_size: bytes per key, 1..64. 16 (128 bits) by default; tests use 1 to force
            collisions and prove that the indexes verify tokens on a hit.

    Raises:
        ConfigError: a key longer than 64 bytes or a digest size outside 1..64.
    """

    __slots__ = ("_base", "digest_size")

    def __init__(self, key: bytes | None = None, *, digest_size: int = 16) -> None:
        key = new_key(key)
        if isinstance(digest_size, bool) or not isinstance(digest_size, int) or not (
            1 <= digest_size <= 64
        ):
            raise ConfigError(f"digest_size must be an int in [1, 64], got {digest_size!r}")
        self.digest_size = digest_size
        self._base = hashlib.blake2b(key=key, digest_size=digest_size)

    def root(self, context: Hashable) -> bytes:
        """The key standing before block 0 of a sequence under ``context``."""
        h = self._base.copy()
        h.update(b"root|")
        h.update(encode_context(context))
        return h.digest()

    def extend_chain(
        self, keys: list[bytes], tokens: Sequence[int], num_blocks: int, block_size: int,
        root: bytes,
    ) -> None:
        """Append chained keys ``K_i = H(K_{i-1} || tokens of block i)`` to ``keys``
        until it holds ``num_blocks`` keys (``K_{-1}`` is ``root``). O(new blocks).

        Raises:
            OverflowError: a token id outside ``[0, 2**32)``.
        """
        have = len(keys)
        if have >= num_blocks:
            return
        if have + 1 == num_blocks:  # one block (a decode filled it): no view, no slice
            h = self._base.copy()
            h.update(keys[-1] if have else root)
            h.update(_block_array(tokens, have, num_blocks, block_size))
            keys.append(h.digest())
            return
        data = _block_bytes(tokens, have, num_blocks, block_size)
        stride = 4 * block_size
        prev = keys[-1] if have else root
        copy = self._base.copy
        append = keys.append
        for off in range(0, len(data), stride):
            h = copy()
            h.update(prev + data[off : off + stride])
            prev = h.digest()
            append(prev)
