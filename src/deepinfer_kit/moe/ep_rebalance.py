"""exchange_slots: move expert weights rank to rank for a new EPLB slot map, over all-to-all.

Rank ``r`` of ``W`` holds global slots ``[r*S, (r+1)*S)``. Every rank knows the old and the
new ``phy2log`` (``P`` ints each), so every rank computes the same transfer plan without
any exchange of metadata; one ``all_to_all_single`` per weight tensor then moves the rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from deepinfer_kit.errors import ConfigError

__all__ = ["plan_transfers", "exchange_slots"]


def plan_transfers(old: Sequence[int], new: Sequence[int], world: int) -> list[tuple[int, int]]:
    """``(source slot, destination slot)`` of every global slot whose expert changes.

    The source holds the destination's new expert under ``old``: a slot on the
    destination's own rank when there is one (a local copy), else the holders are taken
    in turn by the destination's index, spreading the sends over the ranks that hold a
    hot expert. Deterministic: every rank gets the same plan. Pure host code.

    Raises:
        ConfigError: maps of different lengths, a length not divisible by ``world``, or
            maps that do not hold the same set of experts.
    """
    if len(old) != len(new) or len(old) % world:
        raise ConfigError(f"old and new phy2log must have one length divisible by {world}, got {len(old)} and {len(new)}")
    if set(map(int, new)) != set(map(int, old)):
        raise ConfigError(
            f"new phy2log must hold the same experts as the old one, got {sorted(set(map(int, new)))}"
        )
    per = len(old) // world
    holders: dict[int, list[int]] = {}
    for s, e in enumerate(old):
        holders.setdefault(int(e), []).append(s)
    plan = []
    for dst, e in enumerate(new):
        if int(old[dst]) == int(e):
            continue
        have = holders[int(e)]
        local = [s for s in have if s // per == dst // per]
        plan.append((local[0] if local else have[dst % len(have)], dst))
    return plan


@torch.no_grad()
def exchange_slots(
    weights: Sequence[torch.Tensor],
    old: Sequence[int],
    new: Sequence[int],
    rank: int,
    world: int,
    group: dist.ProcessGroup | None = None,
) -> int:
    """Give this rank's slots the weights ``new`` assigns them, copying from whichever rank
    holds each expert under ``old``.

    Collective: every rank of ``group`` calls it with the same maps. Each tensor of
    ``weights`` is ``[S, ...]``, this rank's slots, on the device the group's backend
    uses (CPU for gloo, CUDA for NCCL). Rows are gathered into the send buffer before any
    is written, so swaps and chains between slots are safe. Mutates ``weights`` in place.

    Returns:
        Global slots whose weights changed (the same number on every rank).

    Raises:
        ConfigError: as :func:`plan_transfers`.
    """
    plan = plan_transfers(old, new, world)
    per = len(old) // world
    sends = [[src % per for src, dst in plan if src // per == rank and dst // per == r] for r in range(world)]
    recvs = [[dst % per for src, dst in plan if dst // per == rank and src // per == r] for r in range(world)]
    send_rows = [i for rows in sends for i in rows]
    recv_rows = [i for rows in recvs for i in rows]
    for w in weights:
        device = w.device
        out = w.new_empty((len(recv_rows), *w.shape[1:]))
        send = w.index_select(0, torch.tensor(send_rows, dtype=torch.int64, device=device))
        dist.all_to_all_single(
            out, send, output_split_sizes=[len(r) for r in recvs],
            input_split_sizes=[len(s) for s in sends], group=group,
        )  # fmt: skip
        w.index_copy_(0, torch.tensor(recv_rows, dtype=torch.int64, device=device), out)
    return len(plan)
