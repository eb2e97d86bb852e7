"""ClusterSimulator: several engine replicas on one virtual timeline — disaggregated
prefill / decode instances with KV transfers between them, or colocated replicas behind
the same router. Each instance is a whole :class:`Simulator` (the real scheduler and KV
cache manager, its own pool, clock and cost model), advanced one round (or one stretch
of plain-decode rounds) at a time by an event loop."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer_kit._validators import require_ints_at_least
from deepinfer_kit.components import Components, Factory
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sim.build import build_simulator
from deepinfer_kit.sim.collector import quiet_collector
from deepinfer_kit.sim.cost_analytic import ModelShape
from deepinfer_kit.sim.disagg_kv import transfer_kv
from deepinfer_kit.sim.disagg_records import ROLES, ClusterReport, TransferLink
from deepinfer_kit.sim.disagg_run import ClusterRun, InstanceSlot
from deepinfer_kit.sim.protocols import CostModel
from deepinfer_kit.sim.records import SimRequest
from deepinfer_kit.sim.simulator import Simulator

__all__ = ["ClusterSimulator", "build_disaggregated", "build_colocated"]


class ClusterSimulator:
    """Simulates one workload on a cluster of instances sharing one virtual timeline.

    Event-driven and deterministic (no wall-clock time, no threads): events are taken in
    time order — at one instant first the commits of rounds that end then, then request
    arrivals and KV deliveries, then planning — ties in the order they were made. An
    instance plans its next round when its previous one ends (the one whose round ends
    first goes first); the round (or a stretch of plain-decode rounds, bounded so that
    nothing could be delivered to it before it ends) runs at once on the instance's
    own clock, and what it finished is handled at its end time.

    Routing: a request goes to the prefill (or colocated) instance with the fewest
    outstanding tokens, ties to the lowest index; outstanding = prompt + ``max_tokens``
    (``output_len``, which the router is given as a client's cap) of the requests routed
    there and not finished there (a prefill instance counts prompts only). Disaggregated,
    a request runs its prompt at its prefill instance with ``max_tokens=1`` (the first
    token and TTFT stamped there, its blocks held until sent); its prompt KV,
    ``prompt_len * model.kv_bytes_per_token`` bytes, is sent to the decode instance with
    the fewest outstanding tokens at that moment, landing ``link.transfer_time(bytes)``
    later, when the prefill instance's blocks are freed; the decode instance queues the
    prompt plus the first token, admits it with the transferred tokens as a prefix hit
    into fresh blocks of its own pool (:class:`TransferKV`) and decodes the other
    ``output_len - 1`` tokens. The synthetic tokens continue the request's stream, so
    its output is the colocated one's. A request of one output token ends at its
    prefill instance.

    Args:
        instances: the replicas (built by :func:`build_disaggregated` /
            :func:`build_colocated`).
        roles: each one's role (:data:`ROLES`): prefill and decode instances, or all
            colocated.
        model: the shape priced (its KV bytes per token size a transfer).
        link: the KV link (disaggregated only).

    Attributes:
        mode: ``"disaggregated"`` or ``"colocated"``; model, link: as given.
        instances: an :class:`InstanceSlot` per instance, in order; front: the
            instances requests arrive at (prefill or colocated); decode: the decode
            instances.

    Raises:
        ConfigError: a role not in :data:`ROLES`, a mix of colocated and disaggregated
            roles, no prefill or no decode instance, a missing link, or a prefill or
            decode instance without a :class:`TransferKV`.
    """

    def __init__(self, instances: Sequence[Simulator], roles: Sequence[str], model: ModelShape,
                 link: TransferLink | None = None) -> None:
        if len(instances) != len(roles) or not instances:
            raise ConfigError(f"roles must name one role per instance, got {len(roles)} for {len(instances)}")
        bad = [r for r in roles if r not in ROLES]
        if bad:
            raise ConfigError(f"roles must be in {list(ROLES)}, got {bad[0]!r}")
        colocated = roles[0] == "colocated"
        if colocated and any(r != "colocated" for r in roles):
            raise ConfigError(f"roles mix colocated and disaggregated instances: {list(roles)}")
        if not colocated and not ("prefill" in roles and "decode" in roles):
            raise ConfigError(f"roles need a prefill and a decode instance, got {list(roles)}")
        if not colocated and link is None:
            raise ConfigError("link must be a TransferLink for disaggregated roles, got None")
        self.mode = "colocated" if colocated else "disaggregated"
        self.model = model
        self.link = link
        self.instances = [InstanceSlot(i, r, s) for i, (r, s) in enumerate(zip(roles, instances))]
        for inst in self.instances:
            if inst.role != "colocated" and inst.kv is None:
                raise ConfigError(f"instance {inst.index} ({inst.role}) needs a TransferKV cache manager "
                                  f"(components.cache_manager=Factory(transfer_kv))")
        self.front = [i for i in self.instances if i.role != "decode"]
        self.decode = [i for i in self.instances if i.role == "decode"]

    def run(self, requests: Sequence[SimRequest], *, keep_outputs: bool = False) -> ClusterReport:
        """Simulate ``requests`` (first turns only) to the end; returns the run's
        :class:`ClusterReport` (with every whole request's output when
        ``keep_outputs``). Mutates every instance (a cluster runs one workload). The
        cyclic garbage collector runs tuned while it does.

        Raises:
            ConfigError: duplicate request ids or a follow-up turn (``after`` set: not
                supported here).
            InvariantError: a scheduler stopped making progress, or the run ended with
                a request unfinished, queued or holding blocks.
        """
        with quiet_collector():
            return ClusterRun(self, requests, keep_outputs).run()


def _check_config(config: EngineConfig, model: ModelShape, name: str) -> None:
    """Refuse what the cluster does not simulate (names the field and value)."""
    for field in ("speculative", "eplb"):
        if getattr(config, field) is not None:
            raise ConfigError(f"{name}.{field} must be None in a cluster simulation, got {getattr(config, field)!r}")
    if model.sliding_window is not None:
        raise ConfigError(f"model.sliding_window must be None in a cluster simulation, got {model.sliding_window}")


def build_disaggregated(prefill_config: EngineConfig, decode_config: EngineConfig, cost: CostModel,
                        model: ModelShape, *, num_prefill: int, num_decode: int, link: TransferLink,
                        seed: int = 0) -> ClusterSimulator:
    """A disaggregated cluster: ``num_prefill`` instances of ``prefill_config``, then
    ``num_decode`` of ``decode_config``, each a :func:`build_simulator` of ``cost``
    (shared: a cost model is pure) and ``model`` over a :class:`TransferKV`, all with
    ``seed``; prompt KV crosses ``link``.

    Raises:
        ConfigError: ``num_prefill`` or ``num_decode`` < 1, ``link`` not a
            :class:`TransferLink`, a config with ``speculative`` or ``eplb`` set, a
            sliding-window model, or what :func:`build_simulator` raises.
    """
    require_ints_at_least(1, num_prefill=num_prefill, num_decode=num_decode)
    if not isinstance(link, TransferLink):
        raise ConfigError(f"link must be a TransferLink, got {link!r}")
    _check_config(prefill_config, model, "prefill_config")
    _check_config(decode_config, model, "decode_config")
    parts = Components(cache_manager=Factory(transfer_kv))
    sims = [build_simulator(prefill_config, cost, model, seed=seed, components=parts) for _ in range(num_prefill)]
    sims += [build_simulator(decode_config, cost, model, seed=seed, components=parts) for _ in range(num_decode)]
    return ClusterSimulator(sims, ["prefill"] * num_prefill + ["decode"] * num_decode, model, link)


def build_colocated(config: EngineConfig, cost: CostModel, model: ModelShape, *, num_replicas: int,
                    seed: int = 0) -> ClusterSimulator:
    """``num_replicas`` identical colocated replicas (data parallel) of ``config``, each
    a plain :func:`build_simulator` of ``cost`` and ``model`` with ``seed``, behind the
    same router as the disaggregated cluster's prefill instances.

    Raises:
        ConfigError: ``num_replicas`` < 1, a config with ``speculative`` or ``eplb`` set,
            a sliding-window model, or what :func:`build_simulator` raises.
    """
    require_ints_at_least(1, num_replicas=num_replicas)
    _check_config(config, model, "config")
    sims = [build_simulator(config, cost, model, seed=seed) for _ in range(num_replicas)]
    return ClusterSimulator(sims, ["colocated"] * num_replicas, model)
