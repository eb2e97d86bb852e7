"""Device-side block schedule of routed token copies: expert-sorted, padded to row tiles.

The fused-MoE kernels' ``moe_align_block_size``, in torch ops that never read the device
from the host. From ``expert_ids [T, k]`` it lays the ``N = T * k`` copies out in
expert order, padding each expert's rows up to a multiple of ``B`` (``block_m``) so that
every ``B``-row tile belongs to one expert. The schedule's *sizes* depend only on
``(N, E, B)``, never on the counts, so a kernel grid built from them is fixed when a CUDA
graph is captured and the same graph serves any routing.

Shape symbols: ``T`` tokens, ``k`` top-k, ``E`` experts, ``N = T * k`` copies,
``B`` rows per tile, ``R`` padded rows (a multiple of ``B``), ``G = R / B`` tiles.
"""

from __future__ import annotations

import attrs
import torch

from deepinfer_kit.errors import ConfigError

__all__ = ["BlockSchedule", "align_block_size", "schedule_size"]


@attrs.frozen(eq=False)
class BlockSchedule:
    """Which routed copy each padded row holds, and which expert each row tile runs.

    Padded row ``r`` lies in tile ``r // B``. Expert ``e``'s copies occupy rows
    ``[start_e, start_e + counts[e])`` where ``start_e`` is a multiple of ``B``, in flat
    routing order (stable: token order within an expert); the rest of its last tile, and
    every tile after the last used one, is padding.

    Attributes:
        row_source: ``[R]`` int64: flat routing position ``t * k + j`` of the copy in
            padded row ``r``, or ``N`` (points at nothing) for a padding row.
        tile_expert: ``[G]`` int32: expert of tile ``g``, or ``-1`` for an unused tile.
        expert_counts: ``[E]`` int64: copies routed to each expert (sums to ``N``).
        block_m: ``B``.
        num_copies: ``N``, the sentinel value of ``row_source``.
    """

    row_source: torch.Tensor  # [R] int64, on the device of expert_ids
    tile_expert: torch.Tensor  # [G] int32, on the device of expert_ids
    expert_counts: torch.Tensor  # [E] int64, on the device of expert_ids
    block_m: int
    num_copies: int


def schedule_size(num_copies: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """``(R, G)``: padded rows and tiles of a schedule, from sizes alone.

    At most ``m = min(E, N)`` experts have copies, and expert ``e`` needs
    ``ceil(c_e / B) = floor((c_e + B - 1) / B)`` tiles; a sum of floors is at most the
    floor of the sum, so ``G = floor((N + m * (B - 1)) / B)`` tiles always suffice (and
    are needed when every used expert ends one copy past a tile boundary). Counting ``m``
    rather than ``E`` keeps decode steps (``N`` much smaller than ``E``) to a few tiles.

    Args:
        num_copies: ``N >= 0``.
        num_experts: ``E >= 1``.
        block_m: ``B >= 1``.

    Returns:
        ``(R, G)`` with ``R = G * B``.

    Raises:
        ConfigError: a negative ``N`` or a non-positive ``E`` or ``B``.
    """
    if num_copies < 0:
        raise ConfigError(f"num_copies must be >= 0, got {num_copies}")
    if num_experts < 1:
        raise ConfigError(f"num_experts must be >= 1, got {num_experts}")
    if block_m < 1:
        raise ConfigError(f"block_m must be >= 1, got {block_m}")
    tiles = (num_copies + min(num_experts, num_copies) * (block_m - 1)) // block_m
    return tiles * block_m, tiles


def align_block_size(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockSchedule:
    """The padded, expert-sorted block schedule of ``expert_ids``, without a host sync.

    Called once per MoE forward, before the grouped GEMMs. Only device torch ops whose
    output sizes follow from ``(N, E, B)``: a scatter-add count (not ``bincount``, which
    reads the maximum id on the host), a stable ``argsort``, ``cumsum``, ``scatter_`` and
    ``searchsorted``. Safe inside CUDA-graph capture. Mutates nothing.

    Args:
        expert_ids: ``[T, k]`` integer expert ids in ``[0, E)``, any device (``T`` may
            be 0). Not range-checked (that would read the device): an id outside
            ``[0, E)`` raises ``RuntimeError`` on the CPU and trips a device assert on CUDA.
        num_experts: ``E``.
        block_m: ``B``, rows per tile.

    Returns:
        :class:`BlockSchedule` on the device of ``expert_ids``, with ``R`` and ``G`` from
        :func:`schedule_size`.

    Raises:
        ConfigError: ``expert_ids`` is not 2-D integer, or a size is out of range.
    """
    if expert_ids.dim() != 2 or expert_ids.dtype.is_floating_point or expert_ids.dtype == torch.bool:
        raise ConfigError(
            f"expert_ids must be a [T, k] integer tensor, got {expert_ids.dtype} {tuple(expert_ids.shape)}"
        )
    device = expert_ids.device
    flat = expert_ids.reshape(-1).long()
    num_copies = flat.numel()
    padded_rows, tiles = schedule_size(num_copies, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_m - 1)).div_(block_m, rounding_mode="floor").mul_(block_m)
    padded_end = padded.cumsum(0)
    # Row of each sorted copy = its expert's padded start + its rank within the expert.
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat.index_select(0, order)
    copies_before = counts.cumsum(0).sub_(counts)
    dest = (padded_end - padded).index_select(0, sorted_ids)
    dest.add_(torch.arange(num_copies, device=device)).sub_(copies_before.index_select(0, sorted_ids))
    row_source = torch.full((padded_rows,), num_copies, dtype=torch.int64, device=device)
    row_source.scatter_(0, dest, order)
    # Tile g runs the first expert whose padded range ends after row g * B; past the last
    # range searchsorted returns E, the unused marker.
    tile_start = torch.arange(0, padded_rows, block_m, dtype=torch.int64, device=device)
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True)
    tile_expert = tile_expert.masked_fill_(tile_expert == num_experts, -1).to(torch.int32)
    return BlockSchedule(
        row_source=row_source,
        tile_expert=tile_expert,
        expert_counts=counts,
        block_m=block_m,
        num_copies=num_copies,
    )
