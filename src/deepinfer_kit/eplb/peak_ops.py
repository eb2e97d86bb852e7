"""Per-step replication and packing: the building blocks of the peak policy, batched over rows.

Shape symbols: ``X`` independent rows (layers, or layers x nodes), ``n`` items (logical
experts) per row, ``S`` steps, ``N`` physical replicas per row, ``m`` packs (GPUs or
nodes) per row, each taking ``N / m`` replicas. Loads are ``[X, n, S]``: one row of steps
per item, so gathering items moves contiguous rows.

The packing loops over replicas (two at a time) and does tensor ops over rows, packs and
steps, as DeepInfer's EPLB policy does; every tie goes to the lower index, so a plan is a
pure function of its input. CPU tensors in, new tensors out; inputs are not mutated.
"""

from __future__ import annotations

import math

import torch

from deepinfer_kit.eplb.packing import replicate, spread_replicas

__all__ = ["replicate_by_peak", "pack_steps", "peak_sum"]

DTYPE = torch.float32


def replicate_by_peak(load: torch.Tensor, num_phy: int) -> torch.Tensor:
    """Give ``num_phy - n`` extra replicas one at a time, each to the item whose largest
    per-step load per replica is the largest of its row (ties: the lower index), which
    lowers the window's highest per-step load per replica as far as one replica can.

    Args:
        load: ``[X, n, S]`` load per item and step (>= 0).
        num_phy: ``N >= n`` replicas per row.

    Returns:
        ``[X, n]`` int64 replicas of each item (``>= 1``, summing to ``N`` per row).
    """
    return replicate(load.amax(dim=2), num_phy)[2]


def pack_steps(
    load: torch.Tensor, count: torch.Tensor, num_packs: int, *, spread_replicated: bool = False
) -> torch.Tensor:
    """Pack every row's replicas onto its packs, lowering the sum over steps of the
    step's largest pack load (each item's load split evenly over its replicas).

    Replicas go largest summed load first (an item's replicas one after another), two at
    a time: the first to the pack that raises the sum of the step peaks least, the second
    likewise among the other packs (the same pack only when no other has room for it),
    both scored against the peaks before the pair (ties: the lower pack). Two replicas of
    one item share a pack only when no other arrangement exists
    (:func:`~deepinfer_kit.eplb.packing.spread_replicas` repairs a greedy choice that
    made them).

    With ``spread_replicated`` every pack also gets an equal share (``floor`` or ``ceil``)
    of the replicas of replicated items and the rest of single-replica ones: under
    balanced dispatch a replicated item's load moves between its replicas' packs in every
    step, and a pack holding none cannot shed or take load.

    Capacities cost no operation in the loop: each kind of replica (single, replicated)
    has a column of its own beside the steps, where a pack starts at ``-H`` times its room
    for that kind and gains ``H`` per replica of it, against a peak of 0 there: a replica
    joining a full pack passes that peak by ``H``, more than any choice among the others
    can differ by (``H``, a power of two, exceeds twice every row's total: doubling the
    load doubles every score exactly, so a window of two alike steps plans as one step of
    their sum). The loop runs in float32, as DeepInfer's does (the plans measured alike
    to float64's on the benchmark's windows, 10% faster).

    Args:
        load: ``[X, n, S]`` load per item and step (>= 0, finite).
        count: ``[X, n]`` int64 replicas per item, ``N`` per row, ``N`` divisible by
            ``num_packs``.
        num_packs: ``m``.
        spread_replicated: as above.

    Returns:
        ``[X, N]`` int64 item of each slot; pack ``p`` holds slots ``[p*N/m, (p+1)*N/m)``.
    """
    rows, n, num_steps = load.shape
    slots = int(count[0].sum())
    cap, width = slots // num_packs, num_steps + 2
    w = load.double()
    total = w.sum(dim=2) / count  # [X, n] summed load per replica
    order = torch.argsort(total, dim=1, descending=True, stable=True)
    ends = count.gather(1, order).cumsum(dim=1)
    which = torch.searchsorted(ends, torch.arange(slots).expand(rows, slots).contiguous(), right=True)
    jobs = order.gather(1, which)  # [X, N] item of each job, an item's replicas adjacent
    job_count = count.gather(1, jobs)
    kind = (job_count > 1).long() if spread_replicated else torch.zeros_like(jobs)
    big = 2.0 ** math.ceil(math.log2(2.0 * float(total.sum(dim=1).max()) + 1.0))  # H, a power of 2
    # [N', X, S + 2]: each job's load per step (its item's over the replicas), then H in
    # its kind's capacity column; N' = N rounded up to pairs (a zero job pads).
    vec = torch.zeros(slots + slots % 2, rows, width, dtype=DTYPE)
    picked = w.view(rows * n, num_steps).index_select(0, (jobs + torch.arange(rows)[:, None] * n).t().reshape(-1))
    vec[:slots, :, :num_steps] = picked.view(slots, rows, num_steps).div_(job_count.t()[:, :, None])
    vec[:slots, :, num_steps] = big * (1 - kind).t()
    vec[:slots, :, num_steps + 1] = big * kind.t()
    room = torch.zeros(rows, num_packs, 2, dtype=DTYPE)  # replicas each kind may take
    room[:, :, 0] = cap
    if spread_replicated:
        share = kind.sum(dim=1, keepdim=True)
        take = (share // num_packs + (torch.arange(num_packs) < share % num_packs).long()).to(DTYPE)
        room[:, :, 1] = take
        room[:, :, 0] -= take
    loads = torch.zeros(rows, num_packs, width, dtype=DTYPE)
    loads[:, :, num_steps:] = -room * big  # the capacity columns' peak is 0: a full pack reaches it
    peaks = torch.zeros(rows, width, dtype=DTYPE)
    pack = _greedy_pairs(vec, loads, peaks, num_steps, big)[:, :slots]
    pack, rank = spread_replicas(pack, _arrival(pack, num_packs), total.gather(1, jobs), jobs, num_packs)
    return torch.empty_like(jobs).scatter_(1, pack * cap + rank, jobs)


def _greedy_pairs(vec: torch.Tensor, loads: torch.Tensor, peaks: torch.Tensor, num_steps: int,
                  big: float) -> torch.Tensor:
    """The loop of :func:`pack_steps`: ``vec`` ``[N', X, S + 2]`` jobs, ``loads``
    ``[X, m, S + 2]`` and ``peaks`` ``[X, S + 2]`` (both mutated). Returns ``[X, N']``
    int64, each job's pack. Ten tensor ops per pair of jobs."""
    rows, num_packs, width = loads.shape
    loads_flat = loads.view(rows * num_packs, width)
    shared = peaks.view(1, rows, 1, width)  # views: the loop's in-place updates show through
    steps_now = peaks[:, :num_steps]  # the capacity columns' peaks stay 0
    loads_steps = loads[:, :, :num_steps]
    loads4 = loads.unsqueeze(0)
    full = torch.empty(2, rows, num_packs, width, dtype=loads.dtype)  # loads + each job
    clipped = torch.empty_like(full)  # max(loads + each job, peaks)
    cost = torch.empty(2, rows, num_packs, dtype=loads.dtype)
    first_cost, second_cost = cost.unbind(0)
    second_flat = second_cost.view(-1)
    half = torch.full((rows,), big / 2, dtype=loads.dtype)
    base = torch.arange(rows) * num_packs
    picks: list[torch.Tensor] = []
    one = vec.unbind(0)  # views made once: each costs as much as an op in the loop
    pairs = zip(vec.view(-1, 2, rows, 1, width).unbind(0), one[0::2], one[1::2])
    for pair, job_a, job_b in pairs:  # two jobs at a time, largest first
        torch.add(loads4, pair, out=full)
        torch.maximum(full, shared, out=clipped)
        torch.sum(clipped, dim=3, out=cost)
        first = first_cost.argmin(dim=1)
        at = first.add_(base)
        second_flat.index_add_(0, at, half)  # another pack for the second job, unless none has room
        second = second_cost.argmin(dim=1).add_(base)
        picks += (at, second)
        loads_flat.index_add_(0, at, job_a)
        loads_flat.index_add_(0, second, job_b)
        torch.amax(loads_steps, dim=1, out=steps_now)
    return torch.stack(picks, dim=1) - base[:, None]


def _arrival(pack: torch.Tensor, num_packs: int) -> torch.Tensor:
    """``[X, N]`` int64 position of each job in its pack, in job order (``pack``: ``[X, N]``)."""
    onehot = torch.zeros(*pack.shape, num_packs, dtype=torch.int64).scatter_(2, pack[:, :, None], 1)
    return (onehot.cumsum(dim=1) - onehot).gather(2, pack[:, :, None]).squeeze(2)


def peak_sum(load: torch.Tensor, phy2log: torch.Tensor, count: torch.Tensor, num_packs: int) -> torch.Tensor:
    """``[X]`` float64 sum over steps of the largest pack load (each item's load split evenly
    over its replicas): the objective :func:`pack_steps` lowers.

    Args:
        load: ``[X, n, S]``; phy2log: ``[X, N]`` int64; count: ``[X, n]`` int64.
    """
    per = load.double() / count[:, :, None]
    slot = per.gather(1, phy2log[:, :, None].expand(-1, -1, load.shape[2]))  # [X, N, S]
    return slot.view(load.shape[0], num_packs, -1, load.shape[2]).sum(dim=2).amax(dim=1).sum(dim=1)
