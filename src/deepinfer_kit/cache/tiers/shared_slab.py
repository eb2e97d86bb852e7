"""The host tier of a worker process: its slab in shared memory, which the engine's process
maps too — the worker's device side copies blocks into and out of it, the scheduler side
reads and writes its blocks for the disk tier, with no copy between the two processes.

The worker creates the memory (an anonymous ``memfd`` on Linux, an unlinked temporary
file elsewhere), reserves it in full (so a host that cannot hold it fails at build, not
later at a touch), and hands the descriptor to the host over their socket; each side
maps it. The memory goes away when both have unmapped it (both processes exited)."""

from __future__ import annotations

import math
import mmap
import os
import tempfile

import attrs
import torch

from deepinfer_kit.cache.hybrid_kv import KVStorage
from deepinfer_kit.errors import CapacityError, ConfigError

__all__ = ["SlabShard", "shared_host_slab", "map_host_slab", "available_memory"]


@attrs.frozen(slots=True)
class SlabShard:
    """One rank's host slab as its worker reports it (``WorkerInfo.kv_slab``).

    Attributes:
        shape: ``[host_blocks, L, planes, P, heads, D]``: this rank's heads.
        dtype: the pool's dtype, as ``str(torch.dtype)`` (``"torch.bfloat16"``).
        kv_start: the first key/value head this rank holds.
        total_heads: the model's key/value heads (or latent rows).
    """

    shape: tuple[int, ...]
    dtype: str
    kv_start: int
    total_heads: int

    @property
    def torch_dtype(self) -> torch.dtype:
        """:attr:`dtype` as a ``torch.dtype``."""
        value = getattr(torch, self.dtype.removeprefix("torch."), None)
        if not isinstance(value, torch.dtype):
            raise ConfigError(f"SlabShard.dtype must name a torch dtype, got {self.dtype!r}")
        return value

    @property
    def nbytes(self) -> int:
        """Bytes of the slab."""
        return math.prod(self.shape) * torch.empty((), dtype=self.torch_dtype).element_size()


def shared_host_slab(kv_cache: KVStorage, num_blocks: int, kv_start: int,
                     total_heads: int) -> tuple[torch.Tensor, int, SlabShard]:
    """A zeroed host slab for ``num_blocks`` blocks of ``kv_cache`` (this rank's pool) in
    shared memory: ``(tensor, file descriptor, shard)``. Called once, in the worker
    process, at build; the descriptor goes to the host (:func:`map_host_slab`).

    Raises:
        CapacityError: the host cannot reserve the memory (names ``host_blocks`` and the bytes).
    """
    shard = SlabShard((num_blocks, *kv_cache.block_shape), str(kv_cache.dtype), kv_start, total_heads)
    nbytes = shard.nbytes
    free = available_memory()
    if free is not None and nbytes > free:  # reserving shared memory past this meets the OOM killer
        raise CapacityError(f"kv_tiers.host_blocks={num_blocks} needs {nbytes} bytes of shared host memory, "
                            f"more than the {free} bytes this host has available")
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("deepinfer-kv-host-slab", os.MFD_CLOEXEC)
    else:  # pragma: no cover - not Linux
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        else:  # pragma: no cover - not Linux
            os.ftruncate(fd, nbytes)
        return map_host_slab(fd, shard), fd, shard
    except (OSError, ValueError) as exc:
        os.close(fd)
        raise CapacityError(f"kv_tiers.host_blocks={num_blocks} needs {nbytes} bytes of shared host "
                            f"memory, which could not be reserved: {exc}") from exc


def available_memory() -> int | None:
    """Bytes of memory the host can still give (``MemAvailable`` of ``/proc/meminfo``), or
    None where that is not known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def map_host_slab(fd: int, shard: SlabShard) -> torch.Tensor:
    """The CPU tensor ``shard.shape`` over the shared memory ``fd`` holds (the worker's
    slab, seen from the host, or the worker's own). The tensor keeps the mapping alive;
    ``fd`` may be closed after.

    Raises:
        OSError, ValueError: ``fd`` cannot be mapped at ``shard.nbytes``.
    """
    view = mmap.mmap(fd, shard.nbytes)
    return torch.frombuffer(view, dtype=shard.torch_dtype).view(shard.shape)
