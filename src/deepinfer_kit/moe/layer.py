"""MoELayer: router -> dispatcher -> grouped experts -> combine (+ shared experts)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from deepinfer_kit._kernels import Impl
from deepinfer_kit.errors import CheckpointError, ConfigError
from deepinfer_kit.moe.config import MoEConfig
from deepinfer_kit.moe.counts import copies_per_id
from deepinfer_kit.moe.expert_variants import ExpertActivation
from deepinfer_kit.moe.experts import GroupedExperts, SharedExpert
from deepinfer_kit.moe.hf_weights import read_moe_layer
from deepinfer_kit.moe.ep_dispatcher import ExpertParallelDispatcher
from deepinfer_kit.moe.ep_rebalance import exchange_slots, plan_transfers
from deepinfer_kit.moe.local_dispatcher import LocalDispatcher
from deepinfer_kit.moe.protocols import Dispatcher, Router
from deepinfer_kit.moe.records import Routing
from deepinfer_kit.moe.replicas import ReplicaTable, move_slots
from deepinfer_kit.moe.routers import DeepSeekV3Router, SoftmaxTopKRouter

__all__ = ["MoELayer", "make_router"]


def make_router(
    config: MoEConfig, *, device: torch.device | str | None = None
) -> SoftmaxTopKRouter | DeepSeekV3Router:
    """The router ``config.routing`` names, with zero weights (load or set them after)."""
    if config.routing in ("softmax", "topk_softmax"):
        return SoftmaxTopKRouter(
            config.hidden_size,
            config.num_experts,
            config.top_k,
            renormalize=config.norm_topk_prob,
            bias=config.router_bias,
            softmax_after_topk=config.routing == "topk_softmax",
            device=device,
        )
    return DeepSeekV3Router(
        config.hidden_size,
        config.num_experts,
        config.top_k,
        n_group=config.n_group,
        topk_group=config.topk_group,
        renormalize=config.norm_topk_prob,
        routed_scaling_factor=config.routed_scaling_factor,
        device=device,
    )


class MoELayer(nn.Module):
    """One MoE MLP block: ``y = sum_{e in S(x)} w_e E_e(x) + shared(x)``.

    Composes a router built from ``config`` (float32 gate), a :class:`Dispatcher`
    (a :class:`LocalDispatcher` unless one is injected; an expert-parallel one makes this
    rank hold only ``dispatcher.local_experts``), :class:`GroupedExperts` and, when
    ``config.num_shared_experts > 0``, a :class:`SharedExpert`. Weights start at zero:
    call :meth:`load_hf_weights` or set them.

    Args:
        config: the layer shape and routing rule (and gpt-oss's options: the router's
            bias, the experts' biases and clamped SwiGLU, which the experts and
            :meth:`load_hf_weights` then hold and read).
        impl: grouped-GEMM implementation, ``"auto" | "ref" | "triton"`` (resolved once).
        dtype: expert weight dtype (the router stays float32).
        device: where weights live.
        dispatcher: inject a dispatcher (e.g. expert-parallel); default local.
        gate: the router module that holds the gate's weights (what
            :meth:`load_hf_weights` fills); default one built from ``config``.
        router: the :class:`Router` the forward calls, in place of ``gate`` (e.g. one
            that wraps it: it sees the loaded weights); default ``gate`` itself.

    Raises:
        ConfigError: bad ``impl``; a dispatcher whose local experts are out of range.
        DeviceUnavailableError: ``impl="triton"`` without CUDA or the interpreter.

    Two execution plans, chosen once here and tested equal. With a
    :class:`LocalDispatcher` every expert is local and :meth:`GroupedExperts.routed` does
    route-to-combine in one call: the reference experts gather, compute and scatter-add
    per expert in one cache-resident pass (one host read of the counts, free on the CPU);
    the Triton experts run a device-side block schedule and never synchronise the host, so
    the forward can be captured in a CUDA graph. Otherwise
    ``dispatch -> grouped experts -> combine`` through the dispatcher (an expert-parallel
    exchange needs its split sizes on the host).

    Attributes:
        last_expert_counts: after each forward, ``[E]`` int64: token copies routed to
            each logical expert (what EPLB records; with an expert-parallel dispatcher,
            every rank's copies together); on the host, except with a
            :class:`LocalDispatcher` and ``impl="triton"``, where it stays on the device
            (read it after the forward, outside any captured graph); None before the
            first forward. One tensor from the first forward on, overwritten in place by
            each (a captured forward's replay included): copy it to keep it.
        replicas: with physical slots (:meth:`use_replicas`), the logical -> physical
            table; ``None`` while each expert has exactly its own slot.
        last_slot_counts: with ``replicas``, ``[P]`` int64 copies each physical slot
            served in the last forward (where ``last_expert_counts`` lives); else None.
    """

    router: Router

    def __init__(
        self,
        config: MoEConfig,
        *,
        impl: Impl = "auto",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        dispatcher: Dispatcher | None = None,
        gate: SoftmaxTopKRouter | DeepSeekV3Router | None = None,
        router: Router | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.dispatcher: Dispatcher = (
            dispatcher if dispatcher is not None else LocalDispatcher(config.num_experts)
        )
        local = self.dispatcher.local_experts
        if any(not 0 <= e < config.num_experts for e in local):
            raise ConfigError(
                f"dispatcher.local_experts must be in [0, {config.num_experts}), got {list(local)}"
            )
        self.gate = gate if gate is not None else make_router(config, device=device)
        # not registered as a submodule: an injected router wrapping the gate would list its
        # weights twice
        object.__setattr__(self, "router", router if router is not None else self.gate)
        self.experts = GroupedExperts(
            len(local),
            config.hidden_size,
            config.intermediate_size,
            impl=impl,
            dtype=dtype,
            device=device,
            bias=config.expert_bias,
            activation=ExpertActivation.of(config),
        )
        self.shared_experts: SharedExpert | None = (
            SharedExpert(
                config.hidden_size,
                config.shared_intermediate_size,
                gated=config.shared_expert_gate,
                dtype=dtype,
                device=device,
            )
            if config.num_shared_experts > 0
            else None
        )
        self.last_expert_counts: torch.Tensor | None = None
        self.last_slot_counts: torch.Tensor | None = None
        self.replicas: ReplicaTable | None = None
        self._all_local = isinstance(self.dispatcher, LocalDispatcher)

    def forward(self, hidden: torch.Tensor, real_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the layer to ``hidden`` (``[..., H]``: any leading shape, each of its
        ``T`` rows a token; ``[T, H]`` in the engine).

        ``real_rows``: ``[T]`` bool on the device of ``hidden``, False for a padded row
        (a static decode round's): such a row is routed and computed like any other (a
        replica selector balances the compute it costs) but left out of
        :attr:`last_expert_counts` and :attr:`last_slot_counts`, which EPLB's load
        window and traces read; counted on the device, without a host read. ``None``:
        every row counts. Not for an expert-parallel dispatcher (its padded rows would
        cross ranks).

        Sets :attr:`last_expert_counts`. With an expert-parallel dispatcher this is a
        collective call (every rank calls it, ``T`` may differ or be 0). With a
        :class:`LocalDispatcher` and ``impl="triton"`` it reads nothing back from the
        device, and its launch sizes depend only on ``T``.

        Returns:
            The shape of ``hidden`` (``[..., H]``), in its dtype.

        Raises:
            ConfigError: ``hidden`` has no dimension or its last is not ``config.hidden_size``;
                ``real_rows`` is not ``[T]`` bool, or is given to an expert-parallel layer.
        """
        size = self.config.hidden_size
        if hidden.dim() == 0 or hidden.shape[-1] != size:
            raise ConfigError(f"hidden must be [..., {size}], got {list(hidden.shape)}")
        if hidden.dim() != 2:
            return self.forward(hidden.reshape(-1, size), real_rows).reshape(hidden.shape)
        real = self._real_copies(real_rows, hidden.shape[0])
        routing = self.router(hidden)
        table = self.replicas
        if table is not None:
            slots = Routing(table.physical(routing.expert_ids), routing.weights)
            out, served = self.experts.routed(hidden, slots)
            served = served if real is None else copies_per_id(slots.expert_ids, table.num_slots, real)
            self.last_slot_counts = _kept(self.last_slot_counts, served)
            self.last_expert_counts = _kept(self.last_expert_counts, table.logical_counts(served))
        elif self._all_local:
            out, counts = self.experts.routed(hidden, routing)
            counts = counts if real is None else copies_per_id(routing.expert_ids, self.config.num_experts, real)
            self.last_expert_counts = _kept(self.last_expert_counts, counts)
        else:
            out = self._routed(hidden, routing)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out.to(hidden.dtype)

    def _real_copies(self, real_rows: torch.Tensor | None, tokens: int) -> torch.Tensor | None:
        """``[T * k]`` int64, 1 for each routed copy of a real row and 0 for a padded
        one (flat routing order); ``None`` when every row is real. Shape checks only."""
        if real_rows is None:
            return None
        if real_rows.shape != (tokens,) or real_rows.dtype != torch.bool:
            raise ConfigError(f"real_rows must be [{tokens}] bool, got {list(real_rows.shape)} {real_rows.dtype}")
        if not (self._all_local or self.replicas is not None):
            raise ConfigError("real_rows (padded rows) cannot go through an expert-parallel dispatcher")
        k = self.config.top_k
        return real_rows.to(torch.int64)[:, None].expand(tokens, k).reshape(-1)

    def _routed(self, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        dispatched = self.dispatcher.dispatch(hidden, routing)
        whole = dispatched.load_counts  # every rank's copies under expert parallelism
        self.last_expert_counts = _kept(self.last_expert_counts, whole if whole is not None else dispatched.routed_counts)
        # expert_counts is on the host by the Dispatcher contract: no device read here.
        expert_out = self.experts(dispatched.hidden, dispatched.expert_counts.tolist())
        return self.dispatcher.combine(expert_out, dispatched)

    @torch.no_grad()
    def load_hf_weights(self, weights: Mapping[str, torch.Tensor], prefix: str) -> None:
        """Copy this layer's tensors out of a whole Hugging Face checkpoint.

        Reads the names listed in :mod:`deepinfer_kit.moe.hf_weights` under ``prefix``
        (e.g. ``"model.layers.3.mlp."``; Mixtral files use ``"...block_sparse_moe."``),
        per-expert or fused expert layouts alike, and only the experts this rank holds.
        Mutates the layer's parameters in place (cast to their dtype and device).

        Raises:
            CheckpointError: a missing, mis-shaped or unexpected tensor under ``prefix``
                (the message names it).
        """
        held = self.replicas.slot_experts if self.replicas is not None else self.dispatcher.local_experts
        tensors = read_moe_layer(weights, prefix, self.config, held)
        if tensors.gate is None or tensors.gate_up is None or tensors.down is None:
            raise CheckpointError(f"no router or expert tensors under {prefix!r}")
        self.gate.weight.copy_(tensors.gate)
        if tensors.bias is not None:
            self.gate.get_buffer("e_score_correction_bias").copy_(tensors.bias)
        self.experts.gate_up.copy_(tensors.gate_up)
        self.experts.down.copy_(tensors.down)
        for held_param, read in ((self.gate.bias, tensors.gate_bias),
                                 (self.experts.gate_up_bias, tensors.gate_up_bias),
                                 (self.experts.down_bias, tensors.down_bias)):
            if held_param is not None and read is not None:  # both follow the config's flags
                held_param.copy_(read)
        shared = self.shared_experts
        if shared is not None and tensors.shared_gate_up is not None:
            shared.gate_up.copy_(tensors.shared_gate_up)
            if tensors.shared_down is not None:
                shared.down.copy_(tensors.shared_down)
            if shared.gate is not None and tensors.shared_gate is not None:
                shared.gate.copy_(tensors.shared_gate)

    @torch.no_grad()
    def use_replicas(self, phy2log: Sequence[int]) -> None:
        """Hold the experts in ``P = len(phy2log)`` physical slots, slot ``s`` a copy of
        logical expert ``phy2log[s]``, and route every copy to one of its expert's replicas
        (:class:`ReplicaTable`). Called once, after the weights are loaded and before any
        graph capture. Replaces the expert parameters (``[P, ...]`` now); outputs are
        unchanged.

        Raises:
            ConfigError: an expert-parallel dispatcher (its own ``phy2log`` places the
                slots), replicas already in use, or a ``phy2log`` missing an expert.
        """
        if not self._all_local or self.replicas is not None:
            raise ConfigError("use_replicas needs a layer with a LocalDispatcher and no replicas yet")
        table = ReplicaTable(phy2log, self.config.num_experts, device=self.experts.gate_up.device)
        self._keep_slots(table.slot_experts)
        self.replicas = table

    @torch.no_grad()
    def use_expert_parallel(self, dispatcher: ExpertParallelDispatcher) -> None:
        """Serve as this rank's shard of an expert-parallel layer: keep only the weights
        of ``dispatcher.local_experts`` and route every copy through ``dispatcher`` (a
        collective call per forward from now on). Called once, after the weights are
        loaded, on every rank with the same slot map. Outputs are unchanged.

        Raises:
            ConfigError: the layer is not local with one slot per expert (replicas in
                use, or already sharded), or the dispatcher has another expert count.
        """
        if not self._all_local or self.replicas is not None:
            raise ConfigError("use_expert_parallel needs a local layer without replicas")
        # The dispatcher checked its map against its own expert count; it must be ours.
        if set(dispatcher.phy2log) != set(range(self.config.num_experts)):
            raise ConfigError(
                f"dispatcher slots {list(dispatcher.phy2log)} do not place the layer's "
                f"{self.config.num_experts} experts"
            )
        self._keep_slots(dispatcher.local_experts)
        self.dispatcher = dispatcher
        self._all_local = False

    def _keep_slots(self, slot_experts: Sequence[int]) -> None:
        """Replace the expert weights by one row per slot, slot ``s`` a copy of expert
        ``slot_experts[s]`` (from the full local weights; the biases too, when held)."""
        index = torch.tensor(list(slot_experts), device=self.experts.gate_up.device)
        names = ("gate_up", "down") + (("gate_up_bias", "down_bias") if self.experts.gate_up_bias is not None else ())
        for name in names:
            old = getattr(self.experts, name)
            setattr(self.experts, name, nn.Parameter(old.index_select(0, index), requires_grad=False))

    def apply_placement(self, phy2log: Sequence[int]) -> int:
        """Move to the slot map ``phy2log``: copy each slot whose expert changes from a
        slot holding that expert now, then swap the routing table. Call between forwards
        only. Returns the slots whose weights were copied.

        With an :class:`ExpertParallelDispatcher` ``phy2log`` covers every rank's slots;
        the weights move rank to rank (:func:`exchange_slots`, a collective call: every
        rank calls it with the same map) and the dispatcher routes by the new map.

        Raises:
            ConfigError: no replicas in use (see :meth:`use_replicas`) on a local layer,
                or a bad map (checked before anything is copied).
        """
        dispatcher = self.dispatcher
        if isinstance(dispatcher, ExpertParallelDispatcher):
            old = dispatcher.phy2log
            plan_transfers(old, phy2log, dispatcher.world_size)  # checks before any collective
            moved = exchange_slots(self.experts.slot_tensors(), old, phy2log,
                                   dispatcher.rank, dispatcher.world_size, dispatcher.group)
            dispatcher.assign(phy2log)
            return moved
        table = self.replicas
        if table is None:
            raise ConfigError("apply_placement needs physical slots: call use_replicas first")
        moved = move_slots(self.experts.slot_tensors(), table.sources(phy2log))
        table.assign(phy2log)
        return moved

    def extra_repr(self) -> str:
        """One line of the config for ``print(layer)``."""
        c = self.config
        return (
            f"E={c.num_experts}, k={c.top_k}, H={c.hidden_size}, I={c.intermediate_size}, "
            f"routing={c.routing}, shared={c.shared_intermediate_size}, impl={self.experts.impl}"
        )


def _kept(buffer: torch.Tensor | None, counts: torch.Tensor) -> torch.Tensor:
    """``counts`` copied into ``buffer``, the tensor the previous forward left (so a CUDA
    graph, whose capture wrote it, writes it again at every replay, and a reader after
    the replay finds this forward's counts); a new copy at the first forward or when the
    shape, dtype or device differs."""
    if (buffer is None or buffer.shape != counts.shape or buffer.dtype != counts.dtype
            or buffer.device != counts.device):
        return counts.clone()
    return buffer.copy_(counts)
