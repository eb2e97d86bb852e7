"""Ranks of a multi-rank model, seen from the engine: joining the groups (a spawned worker,
or a launcher-started process), each worker's per-round stats, and the host collecting one
step's replies from every worker rank, failing the whole group fast when one rank dies or a
collective breaks."""

from __future__ import annotations

from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

import attrs
import torch

from deepinfer_kit.comm.world import ParallelGroups, WorldSpec, join_world, world_from_env
from deepinfer_kit.engine.runner.build import DeviceParts
from deepinfer_kit.errors import ConfigError, EngineDeadError
from deepinfer_kit.step import RankStats, StepResult

if TYPE_CHECKING:
    from deepinfer_kit.engine.config import EngineConfig
    from deepinfer_kit.engine.remote.process_runner import ProcessRunner, SentStep, WorkerSpec

__all__ = ["worker_groups", "launched_groups", "collect_replies", "stop_ranks", "RankMeter"]


def worker_groups(spec: WorkerSpec, device: torch.device) -> ParallelGroups | None:
    """Join the world of a spawned worker rank (``spec.rank`` of ``tensor_parallel *
    expert_parallel``, rendezvous at ``spec.rendezvous``), then wrap its tensor-parallel
    communicator with ``spec.wrap_comm`` when given (fault injection). ``None`` for a
    single-rank model. Collective: every rank calls it before its model loads.

    Raises:
        CollectiveError, RuntimeError: the rendezvous failed or timed out.
    """
    config = spec.config
    world = config.tensor_parallel * config.expert_parallel
    if world == 1:
        return None
    if spec.rendezvous is None:
        raise ConfigError(f"a worker of {world} ranks needs a rendezvous address, got None")
    groups = join_world(WorldSpec(spec.rank, world, spec.rendezvous), tensor_parallel=config.tensor_parallel,
                        expert_parallel=config.expert_parallel, timeout=config.collective_timeout,
                        device=device)
    if spec.wrap_comm is not None:
        groups = attrs.evolve(groups, tp=spec.wrap_comm(groups.tp))
    return groups


def launched_groups(config: EngineConfig, device: torch.device) -> ParallelGroups:
    """Join the world of a launcher-started rank (``worker="launched"``) from the standard
    environment. Collective: every rank calls it before its model loads.

    Raises:
        ConfigError: the launcher environment is missing, or its ``WORLD_SIZE`` is not
            ``tensor_parallel * expert_parallel``.
    """
    spec = world_from_env()
    if spec is None:
        raise ConfigError(
            "worker='launched' needs the launcher environment (MASTER_ADDR, MASTER_PORT, "
            "WORLD_SIZE, RANK, as torchrun sets them); none of it is set")
    return join_world(spec, tensor_parallel=config.tensor_parallel,
                      expert_parallel=config.expert_parallel, timeout=config.collective_timeout,
                      device=device)


def collect_replies(ranks: Sequence[ProcessRunner], sent: Sequence[SentStep]) -> list[StepResult]:
    """Every rank's result of one step, waiting on all ranks at once.

    A rank whose process exits, or whose step failed in a collective (a peer died, raised
    or stalled past ``collective_timeout``), ends the group at once: every rank is killed
    and :class:`EngineDeadError` raised. A step that failed alike on every rank (outside
    any collective) raises the lowest rank's exception and the group goes on.

    Raises:
        EngineDeadError: as above, or some ranks failed the step while others did not.
        Exception: the step's exception, raised on every rank.
    """
    pending = dict(enumerate(ranks))
    results: dict[int, StepResult] = {}
    failures: dict[int, Exception] = {}
    while pending:
        ready = wait([r.connection for r in pending.values()])
        for i, runner in list(pending.items()):
            if runner.connection not in ready:
                continue
            del pending[i]
            try:
                results[i] = runner.execute(sent[i])
            except EngineDeadError as exc:
                stop_ranks(ranks)
                raise EngineDeadError(f"rank {i} of {len(ranks)} failed: {exc}") from exc
            except Exception as exc:  # noqa: BLE001 - judged once every rank has answered
                failures[i] = exc
    if failures and len(failures) < len(ranks):
        stop_ranks(ranks)
        first = min(failures)
        raise EngineDeadError(
            f"ranks {sorted(failures)} of {len(ranks)} failed a step the others ran: "
            f"{failures[first]!r}") from failures[first]
    if failures:
        raise failures[0]
    return [results[i] for i in range(len(ranks))]


def stop_ranks(ranks: Sequence[ProcessRunner]) -> None:
    """Kill every rank's process (a broken group cannot finish a step) and reap it.
    Idempotent."""
    for runner in ranks:
        runner.kill()


class RankMeter:
    """Stamps a worker rank's step results with its :class:`RankStats` (per-rank traces).

    Args:
        groups: the rank's groups (its collectives are read from ``groups.timed``).
        parts: what the rank built (its shard's parameters and KV pool are measured once).
    """

    def __init__(self, groups: ParallelGroups, parts: DeviceParts) -> None:
        self.rank = groups.rank
        self.timed = groups.timed
        model = parts.loaded.model
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        kv = parts.runner.kv_cache
        self.kv_bytes = kv.nbytes()

    def stamp(self, result: StepResult, run_s: float) -> StepResult:
        """Set ``result.ranks`` to this rank's stats of the round that took ``run_s`` (the
        collectives since the last stamp); returns ``result``."""
        calls, seconds, sent = 0, 0.0, 0
        if self.timed is not None:
            stats = self.timed.take()
            calls, seconds, sent = stats.calls, stats.seconds, stats.bytes
        result.ranks = [RankStats(self.rank, run_s, seconds, calls, sent, self.weight_bytes, self.kv_bytes)]
        return result
