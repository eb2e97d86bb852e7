"""copies_per_id: routed copies counted per id on the device, without a host read."""

from __future__ import annotations

import torch

__all__ = ["copies_per_id"]


def copies_per_id(ids: torch.Tensor, size: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``[size]`` int64: how many entries of ``ids`` (any shape, int64 in ``[0, size)``)
    hold each id, each counted ``weights`` times (int64, the shape of ``ids`` flattened;
    ``None``: once). On the device of ``ids`` with a size known on the host, so nothing
    is read back (``bincount`` reads its size back) and the op can be captured in a CUDA
    graph. Mutates nothing."""
    flat = ids.reshape(-1)
    out = torch.zeros(size, dtype=torch.int64, device=flat.device)
    return out.index_add_(0, flat, torch.ones_like(flat) if weights is None else weights)
