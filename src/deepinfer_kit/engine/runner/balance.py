"""ExpertBalancer: the engine's live EPLB — windows of routed counts, and rebalances between steps.

Shape symbols: ``L`` MoE layers, ``E`` logical experts, ``P`` physical slots per layer,
``G`` GPUs the slots are split over, ``W`` window steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
import torch

from deepinfer_kit.eplb.config import EplbConfig
from deepinfer_kit.eplb.named import make_policy
from deepinfer_kit.eplb.protocols import PlacementPolicy
from deepinfer_kit.eplb.evaluate import step_balancedness
from deepinfer_kit.eplb.movement import align_placement
from deepinfer_kit.eplb.placement_ops import gpu_loads, placement_from_phy2log
from deepinfer_kit.eplb.records import BalancerState, Placement, Rebalance, Topology
from deepinfer_kit.eplb.window import LoadWindow
from deepinfer_kit.errors import ConfigError, InvariantError
from deepinfer_kit.models.protocols import CausalLM
from deepinfer_kit.moe.ep_dispatcher import ExpertParallelDispatcher
from deepinfer_kit.moe.layer import MoELayer
from deepinfer_kit.moe.protocols import ReplicaSelector
from deepinfer_kit.moe.selectors import make_selector

__all__ = ["ExpertBalancer", "first_placement", "moe_layers"]


def first_placement(config: EplbConfig, layers: list[MoELayer]) -> Placement:
    """The placement every balancer starts from: DeepSeek's policy on a uniform load over
    ``config``'s topology (an expert-parallel model is sharded under it before its
    :class:`ExpertBalancer` is built). Raises ConfigError as :meth:`EplbConfig.topology`."""
    cfg = layers[0].config
    groups = cfg.n_group if cfg.routing == "deepseek_v3" else 1
    topology = config.topology(cfg.num_experts, groups)
    uniform = torch.ones(1, len(layers), cfg.num_experts, dtype=torch.int64)
    return make_policy(attrs.evolve(config, policy="deepseek"), 0).place(uniform, topology)


def moe_layers(model: CausalLM) -> list[MoELayer]:
    """The model's :class:`MoELayer` modules, in layer order (empty for a dense model)."""
    if not isinstance(model, torch.nn.Module):
        return []
    return [m for m in model.modules() if isinstance(m, MoELayer)]


class ExpertBalancer:
    """Counts routed tokens per layer and expert on the device, and rebalances on schedule.

    Construction turns every MoE layer to ``P = E + num_redundant`` physical slots under
    the placement the policy makes of a uniform load (:meth:`MoELayer.use_replicas`). The
    runner calls :meth:`record` after every forward; the engine calls :meth:`commit` for
    every round with work it commits, :meth:`due` before each step and, when true, commits
    the rounds in flight and calls :meth:`rebalance`.

    When a rebalance happens is a pure function of the committed rounds: the clock
    (:attr:`num_steps`) advances at commit, on the host, never from a count of forwards
    that a worker thread or process may or may not have finished yet. In-process, in a
    worker process and on every expert-parallel rank the same rounds commit in the same
    order, so the rebalance points and the windows they plan from are the same whatever
    the machine's load.

    Args:
        config: the window, interval, policy and topology.
        layers: the model's MoE layers (all with the same ``E``), weights loaded.
        device: where the window lives (the model's device).
        capturable: the layers' replica tables are fixed-shape and a rebalance rewrites
            them in place (:attr:`ReplicaLayout.fixed`), so forwards captured as CUDA
            graphs (the static decode path) stay valid; the selectors then run over
            padded tables, a little dearer on a CPU, where nothing is captured.
        policy: the placement policy (``Components.placement_policy``); default the one
            ``config.policy`` names.
        selectors: the replica selector of each MoE layer, by its index among them
            (``Components.replica_selector``); default the one ``config.dispatch`` names.

    Raises:
        ConfigError: no MoE layers, expert-parallel layers not sharded under
            :func:`first_placement`, layers of different
            ``E``, or a topology the slots do not divide over (the message names the field).
    """

    def __init__(self, config: EplbConfig, layers: list[MoELayer], device: torch.device, *,
                 capturable: bool = False, policy: PlacementPolicy | None = None,
                 selectors: Callable[[int], ReplicaSelector] | None = None) -> None:
        if not layers:
            raise ConfigError("eplb needs a model with MoE layers; this model has none")
        experts = {layer.config.num_experts for layer in layers}
        if len(experts) != 1:
            raise ConfigError(f"eplb needs one expert count over the MoE layers, got {sorted(experts)}")
        self.config = config
        self.layers = layers
        self.num_experts = experts.pop()
        groups = layers[0].config.n_group if layers[0].config.routing == "deepseek_v3" else 1
        self.topology: Topology = config.topology(self.num_experts, groups)
        # every [S, ...] tensor a slot carries (gpt-oss's expert biases too)
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in layers[0].experts.slot_tensors())
        self.policy: PlacementPolicy = policy if policy is not None else make_policy(config, self.expert_bytes)
        self.window = LoadWindow(len(layers), self.num_experts, config.window, device=device)
        first = first_placement(config, layers)
        for i, (layer, row) in enumerate(zip(layers, first.phy2log.tolist())):
            dispatcher = layer.dispatcher
            selector: ReplicaSelector = selectors(i) if selectors is not None else make_selector(config.dispatch)
            if isinstance(dispatcher, ExpertParallelDispatcher):  # sharded under this plan
                if list(dispatcher.phy2log) != row:
                    raise ConfigError("an expert-parallel layer must be sharded under first_placement")
                dispatcher.selector = selector  # balances over the ranks
            else:
                layer.use_replicas(row)
                assert layer.replicas is not None
                layer.replicas.use_selector(selector, self.topology.num_gpus, fixed=capturable)
        self.placement: Placement = first
        self.num_steps = 0
        self._last_plan = 0
        self.history: list[Rebalance] = []

    def record(self, model: CausalLM) -> None:
        """After a forward: push its ``[L, E]`` routed counts into the window (device copy,
        no host sync). Mutates the window, not the clock (see :meth:`commit`)."""
        counts = model.expert_counts()
        if counts is None:
            return
        self.window.record(counts.to(self.window.device))

    def commit(self) -> None:
        """The engine committed a round that had work: advance the rebalance clock
        (:attr:`num_steps`) by one. Called on the host, in commit order."""
        self.num_steps += 1

    def slot_counts(self) -> torch.Tensor | None:
        """``[L, P]`` int64 copies each physical slot served in the last forward, a new
        tensor on the layers' device (no host read: a trace reads it once the step's
        tokens are back), or None before any forward."""
        counts = [layer.last_slot_counts for layer in self.layers]
        if any(c is None for c in counts):
            return None
        return torch.stack([c for c in counts if c is not None])

    def state(self) -> BalancerState:
        """A snapshot for a host in another process (placements are not copied: do not
        mutate them)."""
        return BalancerState(self.topology, self.num_experts, self.placement)

    def due(self) -> bool:
        """True once ``interval`` rounds committed since the last plan (a function of the
        committed rounds alone)."""
        return self.num_steps - self._last_plan >= self.config.interval

    def rebalance(self, *, in_flight: int = 0, after_step: int | None = None) -> Rebalance:
        """Plan from the window's per-step counts with the policy, relabel the plan to keep
        replicas in their slots (:func:`align_placement`: GPU loads unchanged), keep the
        current placement of each layer it balances the window's steps no worse than the
        plan, and apply the rest: copy the weights of moved slots, then swap each layer's
        routing table. Call only between steps; ``in_flight`` is the caller's count of
        steps launched and not yet waited for. ``after_step`` stamps the record and
        restarts the clock there (the host's clock when the balancer lives in a worker;
        default :attr:`num_steps`). One host read of the window (its recorded steps,
        oldest first; a window with none plans from one step of zeros). Appends to
        :attr:`history` and returns the record.

        Raises:
            InvariantError: ``in_flight > 0`` (a forward could read half-moved weights).
            ConfigError: as :meth:`PlacementPolicy.place` (not after construction checks).
        """
        if in_flight:
            raise InvariantError(f"rebalance with {in_flight} steps in flight; commit them first")
        step = self.num_steps if after_step is None else after_step
        t0 = time.perf_counter()
        steps = self.window.steps().cpu()
        if steps.shape[0] == 0:
            steps = torch.zeros(1, len(self.layers), self.num_experts, dtype=torch.int64)
        load = steps.sum(dim=0)
        gpus, nodes = self.topology.num_gpus, self.topology.num_nodes
        planned = self.policy.place(steps, self.topology).phy2log
        # Same GPU loads, fewer copies: GPUs of a node and slots of a GPU relabelled to
        # keep the replicas that stay where they are.
        aligned = align_placement(planned, self.placement.phy2log, gpus, nodes)
        # A layer whose current placement already balances the window's steps at least
        # as well (mean over the steps of each step's balancedness) keeps it (greedy
        # packing can lose to it): never pay copies for a worse plan.
        old_bal = step_balancedness(self.placement, steps, gpus).mean(dim=0)
        new_bal = step_balancedness(placement_from_phy2log(aligned, self.num_experts), steps, gpus).mean(dim=0)
        keep = (old_bal >= new_bal)[:, None]
        new = placement_from_phy2log(torch.where(keep, self.placement.phy2log, aligned), self.num_experts)
        t1 = time.perf_counter()
        moved = sum(layer.apply_placement(row) for layer, row in zip(self.layers, new.phy2log.tolist()))
        t2 = time.perf_counter()
        before, after = gpu_loads(self.placement, load, gpus), gpu_loads(new, load, gpus)
        record = Rebalance(
            after_step=step, window=load, before=before, after=after,
            balancedness_before=float(old_bal.mean()),
            balancedness_after=float(torch.maximum(old_bal, new_bal).mean()),
            phy2log=new.phy2log.clone(), moved_slots=moved, moved_bytes=moved * self.expert_bytes,
            plan_s=t1 - t0, apply_s=t2 - t1,
        )  # fmt: skip
        self.placement = new
        self.num_steps = self._last_plan = step
        self.history.append(record)
        return record
