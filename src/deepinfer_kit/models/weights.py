"""Checkpoint tensors: safetensors shards read lazily, every read recorded, clear errors.

Only ``*.safetensors`` files are ever opened. A folder holding only pickle checkpoints
(``*.bin``, ``*.pt``, ``*.pth``) is refused without reading them, so loading a checkpoint
can never run code.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from deepinfer_kit.errors import CheckpointError

__all__ = ["SafetensorsWeights", "TrackedWeights", "take", "take_slice", "safetensors_files"]

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_INDEX = "model.safetensors.index.json"


def safetensors_files(folder: str | os.PathLike[str]) -> dict[str, Path]:
    """Map every tensor name of the checkpoint in ``folder`` to the shard holding it.

    Uses ``model.safetensors.index.json`` when present, else every ``*.safetensors`` file.

    Raises:
        CheckpointError: no safetensors file (naming any pickle files seen, which are never
            read), a shard named by the index is missing, the index is malformed, a shard
            cannot be read (truncated, corrupt header; named), or one tensor name appears in
            two shards.
    """
    root = Path(folder)
    index_file = root / _INDEX
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{str(index_file)!r} is not a valid index: {exc}") from None
        located: dict[str, Path] = {}
        for name, shard in weight_map.items():
            path = root / str(shard)
            if not path.is_file():
                raise CheckpointError(
                    f"shard {shard!r} named by {_INDEX} for tensor {name!r} is missing"
                )
            located[name] = path
        return located
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES) if root.is_dir() else []
        detail = (
            f"; found only pickle files {pickles}, which are never loaded (convert them to "
            "safetensors)" if pickles else ""
        )
        raise CheckpointError(f"checkpoint folder {str(root)!r} has no *.safetensors file{detail}")
    located = {}
    for shard in shards:
        with _open_shard(shard) as f:
            for name in f.keys():
                if name in located:
                    raise CheckpointError(
                        f"tensor {name!r} appears in both {located[name].name!r} and {shard.name!r}"
                    )
                located[name] = shard
    return located


def _open_shard(path: Path) -> Any:
    """``safe_open`` of one shard; its own error types become a CheckpointError naming the file."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises SafetensorError, OSError, ...
        raise CheckpointError(
            f"cannot read safetensors file {str(path)!r} (truncated or corrupt?): {exc}"
        ) from None


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """The tensors of a checkpoint folder as a read-only mapping, loaded on access.

    Each access reads the tensor from its shard on the CPU in its stored dtype (callers copy
    it into their parameters, converting dtype and device). Use as a context manager or
    call :meth:`close` to release the open shards.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self._located = safetensors_files(folder)
        self._handles: dict[Path, Any] = {}

    def _handle(self, path: Path) -> Any:
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = _open_shard(path)
        return handle

    def __getitem__(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as stored.

        Raises:
            KeyError: no such tensor.
            CheckpointError: its shard or its bytes cannot be read (names tensor and file).
        """
        path = self._located[name]
        try:
            tensor: torch.Tensor = self._handle(path).get_tensor(name)
        except CheckpointError as exc:
            raise CheckpointError(f"cannot read tensor {name!r}: {exc}") from None
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor {name!r} from {str(path)!r}: {exc}") from None
        return tensor

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor ``name``, read from the shard header (no data read).

        Raises:
            KeyError: no such tensor.
            CheckpointError: its shard cannot be read.
        """
        return tuple(self._slice(name).get_shape())

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` (``dim`` 0) or columns (``dim`` 1) of tensor ``name``,
        read from its shard without reading the rest of the tensor.

        Raises:
            KeyError: no such tensor.
            CheckpointError: its shard or those bytes cannot be read.
        """
        part = self._slice(name)
        try:
            tensor: torch.Tensor = part[start:stop] if dim == 0 else part[:, start:stop]
        except Exception as exc:
            raise CheckpointError(f"cannot read a slice of tensor {name!r}: {exc}") from None
        return tensor

    def _slice(self, name: str) -> Any:
        path = self._located[name]
        try:
            return self._handle(path).get_slice(name)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor {name!r} from {str(path)!r}: {exc}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._located)

    def __len__(self) -> int:
        return len(self._located)

    def __contains__(self, name: object) -> bool:
        return name in self._located

    def close(self) -> None:
        """Drop the open shard handles."""
        self._handles.clear()

    def __enter__(self) -> SafetensorsWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TrackedWeights(Mapping[str, torch.Tensor]):
    """A mapping of checkpoint tensors that records which names were read.

    After loading, :meth:`unread` lists the checkpoint tensors no module asked for, which the
    loader reports as unexpected.
    """

    def __init__(self, source: Mapping[str, torch.Tensor]) -> None:
        self._source = source
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._source[name]
        self.read.add(name)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._source)

    def __len__(self) -> int:
        return len(self._source)

    def __contains__(self, name: object) -> bool:
        return name in self._source

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The shape of ``name`` (from the shard header when the source can; else read)."""
        if isinstance(self._source, (SafetensorsWeights, TrackedWeights)):
            return self._source.shape_of(name)
        return tuple(self._source[name].shape)

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of ``name``, recorded as
        read; only that slice is read from a safetensors source."""
        self.read.add(name)
        if isinstance(self._source, (SafetensorsWeights, TrackedWeights)):
            return self._source.read_slice(name, dim, start, stop)
        return self._source[name].narrow(dim, start, stop - start)

    def unread(self) -> list[str]:
        """Names never read, sorted."""
        return sorted(set(self._source) - self.read)


def take(weights: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``weights[name]`` after checking it exists and has ``shape``.

    Raises:
        CheckpointError: naming the tensor when it is missing or mis-shaped.
    """
    if name not in weights:
        raise CheckpointError(f"checkpoint tensor {name!r} is missing (expected shape {shape})")
    tensor = weights[name]
    if tuple(tensor.shape) != shape:
        raise CheckpointError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}"
        )
    return tensor


def take_slice(weights: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...], dim: int,
               start: int, stop: int) -> torch.Tensor:
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of ``weights[name]`` after
    checking the whole tensor exists and has ``shape``; from safetensors (through
    :class:`SafetensorsWeights` or :class:`TrackedWeights`) only the slice is read.

    Raises:
        CheckpointError: naming the tensor when it is missing or mis-shaped.
    """
    if name not in weights:
        raise CheckpointError(f"checkpoint tensor {name!r} is missing (expected shape {shape})")
    if isinstance(weights, (SafetensorsWeights, TrackedWeights)):
        stored = weights.shape_of(name)
        if stored != shape:
            raise CheckpointError(f"checkpoint tensor {name!r} has shape {stored}, expected {shape}")
        return weights.read_slice(name, dim, start, stop)
    return take(weights, name, shape).narrow(dim, start, stop - start)
