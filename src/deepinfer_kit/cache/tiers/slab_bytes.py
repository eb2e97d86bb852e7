"""RankSlabs: the host tier's bytes as the scheduler side reads and writes them — one slab
per rank, each holding that rank's key/value heads, seen as whole blocks of every head."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer_kit.errors import ConfigError

__all__ = ["RankSlabs", "HEAD_AXIS"]

HEAD_AXIS = 3  # of a block ``[L, planes, P, Hkv, D]``: the key/value heads


class RankSlabs:
    """A :class:`~deepinfer_kit.cache.tiers.bytes.HostBytes` over the host slabs of the
    ranks of one model: slab ``i`` is ``[host_blocks, L, planes, P, heads_i, D]`` holding
    the key/value heads ``starts[i] .. starts[i] + heads_i`` of ``total_heads`` (tensor
    parallelism splits them; expert-parallel ranks, and a single rank, hold all of them).

    A block read here (for a disk write) is the whole block, every head in order, the
    same bytes whatever the ranks' split: so a disk file one engine wrote is read by
    another that splits the heads differently (another tensor-parallel size), each rank
    taking its heads. A write (a disk read) gives every rank its heads.

    The slabs are CPU tensors the device side copies into and out of: in this process
    (``worker="inline"``) or, mapped from shared memory, in the worker processes
    (:mod:`~deepinfer_kit.cache.tiers.shared_slab`). Called on the scheduler's thread.

    With ``partial`` the slabs may hold a run of heads short of the model's (one rank of
    ``worker="launched"``, which sees only its own slab): blocks are then those heads only
    (:attr:`heads` says which), and the disk files must say so too.

    Args:
        slabs: one per rank, equal but for the head axis, of one dtype.
        starts: each slab's first head.
        total_heads: the model's key/value heads.
        partial: allow heads ``lo .. hi`` short of ``0 .. total_heads``.

    Raises:
        ConfigError: slabs of different shapes or dtypes, or head ranges that do not
            tile ``0 .. total_heads`` (two distinct ranges overlapping, or a gap; with
            ``partial``, a run of heads inside it).
    """

    def __init__(self, slabs: Sequence[torch.Tensor], starts: Sequence[int], total_heads: int, *,
                 partial: bool = False) -> None:
        if not slabs or len(slabs) != len(starts):
            raise ConfigError(f"RankSlabs needs one start per slab, got {len(slabs)} slabs and {len(starts)} starts")
        first = slabs[0]
        for i, s in enumerate(slabs):
            same = s.dim() == 6 and s.dtype == first.dtype and \
                s.shape[:4] == first.shape[:4] and s.shape[5] == first.shape[5]
            if not same:
                raise ConfigError(f"rank {i}'s host slab {tuple(s.shape)} {s.dtype} does not match rank 0's "
                                  f"{tuple(first.shape)} {first.dtype} but for the head axis")
        ranges = sorted({(int(b), int(b) + int(s.shape[HEAD_AXIS + 1])) for b, s in zip(starts, slabs)})
        low = edge = ranges[0][0] if partial else 0
        for lo, hi in ranges:
            if lo != edge:
                raise ConfigError(f"the ranks' key/value heads {ranges} do not tile 0..{total_heads}")
            edge = hi
        if edge > total_heads or (edge != total_heads and not partial):
            raise ConfigError(f"the ranks' key/value heads {ranges} do not tile 0..{total_heads}")
        self.slabs = list(slabs)
        self._spans = [(int(b) - low, int(b) - low + int(s.shape[HEAD_AXIS + 1])) for b, s in zip(starts, slabs)]
        self._readers = [self._spans.index((lo - low, hi - low)) for lo, hi in ranges]  # the first rank of each
        self.heads = (low, edge, total_heads)  # the heads a block here holds, of the model's
        self.block_shape = (*first.shape[1:HEAD_AXIS + 1], edge - low, first.shape[-1])

    @property
    def dtype(self) -> torch.dtype:
        """The slabs' dtype."""
        return self.slabs[0].dtype

    def read(self, slot: int) -> torch.Tensor:
        """A new CPU tensor ``block_shape``: ``slot``'s bytes, every head."""
        if len(self._readers) == 1:
            return self.slabs[self._readers[0]][slot].clone()
        return torch.cat([self.slabs[i][slot] for i in self._readers], dim=HEAD_AXIS)

    def write(self, slot: int, payload: torch.Tensor) -> None:
        """Give every rank's slab ``slot`` its heads of ``payload`` (``block_shape``)."""
        for slab, (lo, hi) in zip(self.slabs, self._spans):
            slab[slot].copy_(payload.narrow(HEAD_AXIS, lo, hi - lo))

    def new_block(self) -> torch.Tensor:
        """An empty CPU block of ``block_shape`` (for a disk read to fill)."""
        return torch.empty(self.block_shape, dtype=self.dtype)
