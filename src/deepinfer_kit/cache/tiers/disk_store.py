"""DiskBlockStore: the disk tier's bytes — one checksummed file per block, written
atomically, read through a memory map."""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from pathlib import Path

import torch

from deepinfer_kit.errors import ConfigError

__all__ = ["DiskBlockStore", "layout_fingerprint"]

_MAGIC = b"DIKVB01\0"
# magic, fingerprint (16 bytes), key length, payload length, BLAKE2b-16 of the payload
_HEADER = struct.Struct("<8s16sIQ16s")
_SUFFIX = ".kvb"


def layout_fingerprint(*parts: object) -> bytes:
    """16 bytes naming a block's layout and meaning (model, dtype, shape): a file written
    under another fingerprint is never read as this one's. Pure."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


class DiskBlockStore:
    """Blocks as files ``<root>/<key hex>.kvb``: a header (magic, layout fingerprint, key,
    payload length, BLAKE2b-16 of the payload), the key, then the payload bytes.

    :meth:`put` writes a temporary file and renames it into place, so a reader (this
    engine or another sharing the folder) sees a whole file or none; a process killed
    mid-write leaves only a temporary file, which is never read. :meth:`get_into`
    memory-maps the file and checks everything before copying: a missing, truncated,
    corrupted or foreign file reads as a miss (and a damaged one is deleted), never as
    wrong K/V. Thread-safe for distinct keys (the tier's I/O threads call it); the caller
    orders a read after the write of the same key.

    Args:
        root: the folder (created when missing).
        fingerprint: :func:`layout_fingerprint` of the blocks stored here.
        fsync: flush each file to the device before its rename (durable across power loss;
            not needed for a cache that recomputes what it loses).

    Raises:
        ConfigError: ``root`` cannot be created, or ``fingerprint`` is not 16 bytes.
    """

    __slots__ = ("_root", "_fingerprint", "_fsync")

    def __init__(self, root: str | os.PathLike[str], fingerprint: bytes, *, fsync: bool = False) -> None:
        if not isinstance(fingerprint, bytes) or len(fingerprint) != 16:
            raise ConfigError(f"fingerprint must be 16 bytes, got {fingerprint!r}")
        self._root = Path(root)
        try:
            self._root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"disk_path {str(root)!r} cannot be created: {exc}") from exc
        self._fingerprint = fingerprint
        self._fsync = fsync

    @property
    def fingerprint(self) -> bytes:
        """The layout fingerprint of the blocks stored here."""
        return self._fingerprint

    @property
    def root(self) -> Path:
        """The folder."""
        return self._root

    def path(self, key: bytes) -> Path:
        """The file of ``key``. Pure."""
        return self._root / (key.hex() + _SUFFIX)

    def contains(self, key: bytes) -> bool:
        """True when a file for ``key`` exists (it may still fail :meth:`get_into`'s checks).
        One ``stat``."""
        return self.path(key).is_file()

    def put(self, key: bytes, payload: torch.Tensor) -> None:
        """Write ``payload`` (a contiguous CPU tensor) as ``key``'s block, replacing any file.

        Called from an I/O thread. Mutates the folder only.

        Raises:
            OSError: the write failed (disk full, permissions); no partial file remains
                under the block's name.
        """
        data = memoryview(payload.contiguous().view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
        digest = hashlib.blake2b(data, digest_size=16).digest()
        final = self.path(key)
        tmp = final.with_name(f"{final.name}.{os.getpid()}.{id(payload)}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, self._fingerprint, len(key), len(data), digest))
                f.write(key)
                f.write(data)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def get_into(self, key: bytes, out: torch.Tensor) -> bool:
        """Read ``key``'s block into ``out`` (a contiguous CPU tensor of the stored size).

        Returns False, with ``out`` unspecified, when the file is missing, unreadable,
        truncated, longer than its header says, of another layout or key, or its payload
        fails the checksum; a damaged file is deleted so it is not read again. Never
        raises for a bad file. Called from an I/O thread.
        """
        path = self.path(key)
        target = memoryview(out.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                verdict = self._check_and_copy(mm, key, target)
        except FileNotFoundError:
            return False
        except (OSError, ValueError):  # unreadable, or empty (mmap refuses 0 bytes)
            verdict = "damaged"
        if verdict == "damaged":
            path.unlink(missing_ok=True)
        return verdict == "ok"

    def _check_and_copy(self, mm: mmap.mmap, key: bytes, target: memoryview) -> str:
        """``"ok"`` (copied into ``target``), ``"foreign"`` (another layout's whole file:
        left alone) or ``"damaged"`` (truncated, padded, wrong key or checksum)."""
        if len(mm) < _HEADER.size:
            return "damaged"
        magic, fp, klen, plen, digest = _HEADER.unpack_from(mm, 0)
        if magic != _MAGIC:
            return "damaged"
        if fp != self._fingerprint or plen != len(target):
            return "foreign"
        if klen != len(key) or len(mm) != _HEADER.size + klen + plen or mm[_HEADER.size:_HEADER.size + klen] != key:
            return "damaged"
        body = memoryview(mm)[_HEADER.size + klen:]
        try:
            if hashlib.blake2b(body, digest_size=16).digest() != digest:
                return "damaged"
            target[:] = body
        finally:
            body.release()
        return "ok"

    def delete(self, key: bytes) -> None:
        """Remove ``key``'s file; a missing one is fine."""
        self.path(key).unlink(missing_ok=True)

