"""ProcessGroupRunner: an expert-parallel model over one worker process per rank.

``EngineConfig(worker="process", expert_parallel=W)`` starts ``W`` workers
(:class:`ProcessRunner` each, rank ``r`` of a gloo group that rendezvous on a local
port before the model loads). Every rank holds the whole model but only ``E / W`` experts
of each MoE layer (:meth:`MoELayer.use_expert_parallel`); a forward's token copies go to
their expert's rank by all-to-all, so every rank must run every step, in order, on the
same plan. This runner is the host's side: it sends each plan to every rank (each
connection with its own plan encoder), collects every rank's reply, and returns rank
0's (all ranks sample the same tokens from the same logits; a disagreement is an
:class:`~deepinfer_kit.errors.InvariantError`).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import attrs

from deepinfer_kit.cache.tiers.records import merge_outputs
from deepinfer_kit.engine.remote.process_runner import ProcessRunner, RemoteSlots, WorkerInfo, WorkerPool, WorkerSpec
from deepinfer_kit.engine.remote.rank_groups import collect_replies
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.sched.records import SchedulePlan
from deepinfer_kit.step import StepResult

__all__ = ["GroupSlots", "ProcessGroupRunner"]


class GroupSlots:
    """Every rank's token slots, released together (a ``SlotLeases``)."""

    def __init__(self, ranks: Sequence[RemoteSlots]) -> None:
        self._ranks = list(ranks)

    def release_through(self, step_id: int) -> None:
        """See :meth:`RemoteSlots.release_through`, on every rank."""
        for slots in self._ranks:
            slots.release_through(step_id)


class ProcessGroupRunner(WorkerPool):
    """The host's side of ``W`` expert-parallel worker processes (a ``StepRunner``).

    Args:
        spec: what every rank builds (its ``config.expert_parallel`` is ``W``); the
            rank and the rendezvous address are filled in here.
        start_timeout: seconds to wait for each rank's runner.

    Raises:
        ConfigError: what building raised in a worker (every rank is stopped then).
        EngineDeadError: a worker exited or did not report in time.
    """

    def __init__(self, spec: WorkerSpec, *, start_timeout: float = 600.0) -> None:
        world = spec.config.expert_parallel * spec.config.tensor_parallel
        with socket.socket() as probe:  # a free port for the gloo rendezvous
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        address = f"tcp://127.0.0.1:{port}"
        self.ranks: list[ProcessRunner] = []
        try:
            for rank in range(world):  # all start before any is awaited: they rendezvous
                self.ranks.append(ProcessRunner(attrs.evolve(spec, rank=rank, rendezvous=address),
                                                start_timeout=start_timeout, wait=False))
            infos = [r.wait_ready() for r in self.ranks]
        except BaseException:
            self.close()
            raise
        self.info: WorkerInfo = infos[0]
        slots = [r.token_slots for r in self.ranks]
        self.token_slots: GroupSlots | None = (
            GroupSlots([s for s in slots if s is not None]) if slots[0] is not None else None
        )

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, rank 0 first."""
        return [r.pid for r in self.ranks]

    def prepare(self, plan: SchedulePlan, *, record_expert_counts: bool = False) -> list[object]:
        """Send ``plan`` to every rank (see :meth:`ProcessRunner.prepare`); returns at once.

        Raises:
            EngineDeadError: a worker is gone.
        """
        return [r.prepare(plan, record_expert_counts=record_expert_counts) for r in self.ranks]

    def check_idle(self) -> None:
        """:meth:`ProcessRunner.check_idle` on every rank, rank 0 first."""
        for rank in self.ranks:
            rank.check_idle()

    def execute(self, sent: list[object]) -> StepResult:
        """Collect every rank's reply to one step (:func:`collect_replies`: all ranks at
        once) and return rank 0's result.

        Raises:
            Exception: the step's exception when it failed alike on every rank.
            InvariantError: ranks that sampled different tokens.
            EngineDeadError: a worker is gone, a collective failed or timed out, or only
                some ranks failed the step; every rank is killed first.
        """
        results = collect_replies(self.ranks, sent)  # type: ignore[arg-type]
        if results[0].ranks is not None:  # every rank's stats ride on rank 0's result
            results[0].ranks = [s for r in results for s in (r.ranks or [])]
        first = results[0].token_ids
        for rank, result in enumerate(results[1:], 1):
            if result.token_ids != first:
                raise InvariantError(f"expert-parallel rank {rank} sampled other tokens than rank 0")
        return _merged(results)

    @property
    def released(self) -> int | None:
        """The newest committed step the ranks were told of (alike on every rank)."""
        return self.ranks[0].released

    @property
    def num_step_replies(self) -> int:
        """Steps rank 0 has answered."""
        return self.ranks[0].num_step_replies

    def request(self, message: tuple[Any, ...]) -> Any:
        """Send a control message to every rank, then collect every answer (a rebalance
        is a collective: no rank may be awaited before all have it); returns rank 0's.

        Raises:
            InvariantError: ranks whose answers differ in kind (one failed).
            EngineDeadError: a worker is gone.
        """
        for r in self.ranks:
            r.send_control(message)
        answers = [r.answer() for r in self.ranks]
        failed = [isinstance(a, BaseException) for a in answers]
        if any(failed) and not all(failed):
            raise InvariantError(f"expert-parallel ranks answered {message[0]!r} differently: {answers}")
        return answers[0]

    def close(self) -> None:
        """Stop every rank. Idempotent."""
        for r in self.ranks:
            r.close()


def _merged(results: list[StepResult]) -> StepResult:
    """Rank 0's result with what any rank found wrong: the KV tiers' reports merged
    (:func:`merge_outputs`: a save counts when every rank's shard is down, a failed load
    on any rank fails its chunks) and a chunk's error from the lowest rank reporting one
    (a rank whose load failed computed garbage every rank then shares)."""
    head = results[0]
    if head.kv_transfers is None and all(r.kv_transfers is None for r in results):
        return head
    head.kv_transfers = merge_outputs([r.kv_transfers for r in results])
    if any(r.errors for r in results):
        n = max(len(r.errors) for r in results)
        head.errors = [next((r.errors[i] for r in results if i < len(r.errors) and r.errors[i] is not None), None)
                       for i in range(n)]
    return head
