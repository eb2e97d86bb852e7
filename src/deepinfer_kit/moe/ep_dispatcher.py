"""ExpertParallelDispatcher: token copies to the rank holding their expert, over all-to-all.

The ``P`` physical expert slots of a layer are split evenly over the ``W`` ranks of a
process group (rank ``r`` holds slots ``[r*S, (r+1)*S)``, ``S = P / W``); ``phy2log`` says
which logical expert each slot holds, so an expert may have several replicas (EPLB's
placement). Which replica serves each copy is the
:attr:`~ExpertParallelDispatcher.selector`'s choice (:mod:`deepinfer_kit.moe.selectors`;
default the static rule, replica ``(flat position + rank) % replicas``), from the per-expert
counts of every rank, all-gathered once per dispatch: each rank then knows the whole load
(what EPLB's window records) and every count-based selector plans the same whole batch on
every rank.

One dispatch = an all-gather of per-expert counts, an all-to-all of per-slot counts, then of the copies and their weights
(``all_to_all_single`` with variable split sizes); combine returns the outputs the same way
and takes the weighted sum on the token's own rank. Works on gloo (CPU tensors) and NCCL
(CUDA tensors): every exchanged tensor lives on the device of the hidden states.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch
import torch.distributed as dist

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.moe.counts import copies_per_id
from deepinfer_kit.moe.local_dispatcher import check_routing, count_experts, unpermute_and_sum
from deepinfer_kit.moe.protocols import Dispatcher, ReplicaSelector
from deepinfer_kit.moe.records import Dispatched, Routing
from deepinfer_kit.moe.replica_layout import ReplicaLayout
from deepinfer_kit.moe.selectors import StaticSelector

if TYPE_CHECKING:
    from deepinfer_kit.eplb.records import Placement

__all__ = ["ExpertParallelDispatcher"]


@attrs.define(slots=True, eq=False)
class _EPState:
    """What combine needs to send results home (private to this module)."""

    send_order: torch.Tensor  # [T*k] int64: flat routing position of each sent row
    send_splits: list[int]  # [W] rows sent to each rank
    recv_splits: list[int]  # [W] rows received from each rank
    weights: torch.Tensor  # [T, k] float32 routing weights of this rank's tokens


class ExpertParallelDispatcher:
    """Dispatch over a ``torch.distributed`` group, with a logical -> physical replica map.

    Args:
        num_experts: ``E`` logical experts.
        phy2log: ``P`` ints, the logical expert in each physical slot (every expert at
            least once; ``P`` divisible by the group size). ``list(range(E))`` is the plain
            layout without replicas.
        group: the process group (default: the world group). Must be initialized.

    Raises:
        ConfigError: ``P`` not divisible by the world size, an id outside ``[0, E)``, or an
            expert without a slot.
    """

    def __init__(
        self,
        num_experts: int,
        phy2log: Sequence[int],
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group
        self._world = dist.get_world_size(group)
        self._rank = dist.get_rank(group)
        self._num_experts = num_experts
        self._slots_per_rank = 0
        self.selector: ReplicaSelector = StaticSelector()
        """Chooses the replica of each copy (set it between dispatches, on every rank alike)."""
        self.assign(phy2log)

    def assign(self, phy2log: Sequence[int]) -> None:
        """Route by the slot map ``phy2log`` from now on (the weights of this rank's slots
        must already be in place: see :func:`deepinfer_kit.moe.ep_rebalance.exchange_slots`).
        Call between dispatches, on every rank with the same map; the slots per rank
        cannot change.

        Raises:
            ConfigError: as the constructor, or a map of another length.
        """
        slots = [int(e) for e in phy2log]
        num_experts = self._num_experts
        if len(slots) % self._world or (self._slots_per_rank and len(slots) != self.num_slots):
            raise ConfigError(
                f"phy2log length must be divisible by the world size {self._world} and keep the "
                f"slots per rank, got {len(slots)}"
            )
        if any(not 0 <= e < num_experts for e in slots):
            raise ConfigError(f"phy2log entries must be in [0, {num_experts}), got {slots}")
        missing = sorted(set(range(num_experts)) - set(slots))
        if missing:
            raise ConfigError(f"phy2log must give every expert a slot, got none for {missing}")
        self._slots_per_rank = len(slots) // self._world
        first = self._rank * self._slots_per_rank
        self._phy2log = tuple(slots)
        self._local = tuple(slots[first : first + self._slots_per_rank])
        self._layout = ReplicaLayout(slots, num_experts, self._world)

    @property
    def phy2log(self) -> tuple[int, ...]:
        """The logical expert of every physical slot of the group (``P`` ints)."""
        return self._phy2log

    @property
    def num_slots(self) -> int:
        """``P``, physical slots over all ranks."""
        return self._slots_per_rank * self._world

    @property
    def rank(self) -> int:
        """This process's rank in the group (it holds slots ``[rank*S, (rank+1)*S)``)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self._world

    @classmethod
    def from_placement(
        cls, placement: Placement, layer: int, group: dist.ProcessGroup | None = None
    ) -> ExpertParallelDispatcher:
        """The dispatcher of MoE layer ``layer`` under an EPLB :class:`Placement`."""
        phy2log = placement.phy2log[layer].tolist()
        return cls(int(placement.logcnt.shape[1]), phy2log, group)

    @property
    def local_experts(self) -> tuple[int, ...]:
        """Logical expert of each of this rank's ``S`` physical slots."""
        return self._local

    def physical_slots(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """``[N]`` physical slot chosen by :attr:`selector` for each copy of the flat ids
        ``expert_ids`` (``[N]``). Collective (the counts are all-gathered): every rank calls it."""
        return self._select(expert_ids, copies_per_id(expert_ids, self._num_experts))[0]

    def _select(self, flat_ids: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``([N] slots, [E] copies of every rank per expert)`` from this rank's ``[E]`` counts."""
        gathered = [torch.empty_like(counts) for _ in range(self._world)]
        dist.all_gather(gathered, counts, group=self.group)
        every = torch.stack(gathered)
        layout = self._layout
        if layout.device != flat_ids.device:
            layout = self._layout = ReplicaLayout(self._phy2log, self._num_experts, self._world, flat_ids.device)
        return self.selector.select(flat_ids, every, self._rank, layout).slots, every.sum(0)

    def dispatch(self, hidden: torch.Tensor, routing: Routing) -> Dispatched:
        """Send each copy of ``hidden`` (``[T, H]``) to the rank of its chosen replica.

        Collective: every rank of the group must call it (``T`` may be 0). Returns the
        copies this rank received, grouped by local slot; ``order`` is each row's position
        in the receive buffer. Two host syncs (the count exchange).

        Raises:
            ConfigError: shapes disagree or an id is outside ``[0, E)``.
        """
        check_routing(hidden, routing)
        top_k = routing.expert_ids.shape[1]
        flat_ids = routing.expert_ids.reshape(-1)
        routed_counts = count_experts(flat_ids, self._num_experts)
        phys, load_counts = self._select(flat_ids, routed_counts.to(flat_ids.device))
        send_order = torch.argsort(phys, stable=True)
        world, per_rank = self._world, self._slots_per_rank
        send_slot_counts = torch.bincount(phys, minlength=world * per_rank)
        recv_slot_counts = torch.empty_like(send_slot_counts)
        dist.all_to_all_single(recv_slot_counts, send_slot_counts, group=self.group)
        send_splits = send_slot_counts.view(world, per_rank).sum(1).tolist()
        recv_matrix = recv_slot_counts.view(world, per_rank).cpu()
        recv_splits = recv_matrix.sum(1).tolist()
        received = self._exchange(hidden.index_select(0, send_order // top_k), send_splits, recv_splits)
        flat_weights = routing.weights.reshape(-1).index_select(0, send_order)
        recv_weights = self._exchange(flat_weights, send_splits, recv_splits)
        slot_of_row = torch.repeat_interleave(
            torch.arange(per_rank).repeat(world), recv_matrix.flatten()
        ).to(hidden.device)
        regroup = torch.argsort(slot_of_row, stable=True)
        return Dispatched(
            hidden=received.index_select(0, regroup),
            expert_counts=recv_matrix.sum(0),
            weights=recv_weights.index_select(0, regroup),
            order=regroup,
            num_tokens=hidden.shape[0],
            routed_counts=routed_counts,
            load_counts=load_counts.cpu(),
            state=_EPState(send_order, send_splits, recv_splits, routing.weights),
        )

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """Return each output to its token's rank and take the weighted sum there.

        Collective: every rank of the group must call it.

        Args:
            expert_out: ``[M, H]`` unweighted outputs aligned with ``dispatched.hidden``.
            dispatched: what :meth:`dispatch` returned on this rank.

        Returns:
            ``[T, H]`` in the dtype of ``expert_out``.
        """
        state = dispatched.state
        if not isinstance(state, _EPState):
            raise ConfigError("dispatched was not produced by ExpertParallelDispatcher.dispatch")
        in_recv_order = torch.empty_like(expert_out).index_copy_(0, dispatched.order, expert_out)
        returned = self._exchange(in_recv_order, state.recv_splits, state.send_splits)
        return unpermute_and_sum(returned, state.send_order, state.weights)

    def _exchange(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = rows.new_empty((sum(recv), *rows.shape[1:]))
        dist.all_to_all_single(
            out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=self.group
        )
        return out


if TYPE_CHECKING:
    _check: type[Dispatcher] = ExpertParallelDispatcher
