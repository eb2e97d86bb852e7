"""to_device: a host list as a device tensor without making the host wait for the device —
one pinned, non-blocking copy on CUDA; a plain tensor anywhere else (the reference path)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["to_device", "host_to_device"]


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """``values`` as a ``[len(values)]`` tensor of ``dtype`` on ``device``.

    On CUDA the list is laid out in pinned host memory and copied with ``non_blocking``:
    the copy is queued on the current stream behind the kernels already there, and the host
    returns at once (``torch.tensor(values, device="cuda")`` copies from pageable memory
    and synchronises the stream, so after a graph replay it waits for the whole forward).
    The pinned block is not reused before its copy ran (torch's host allocator records
    the copy's stream). Elsewhere: ``torch.tensor(values, dtype=dtype, device=device)``.
    Mutates nothing.
    """
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without making the host wait for the device: on CUDA
    a pinned copy of it (``pin_memory``, host work only) copied with ``non_blocking``,
    like :func:`to_device`; anywhere else ``tensor.to(device)`` (the same tensor when it
    is there already). ``tensor`` must be on the CPU for the CUDA path. Mutates nothing.
    """
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
