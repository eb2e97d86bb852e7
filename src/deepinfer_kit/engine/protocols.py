"""Contracts of the engine package: the runner the Engine drives (and its optional
two-phase steps), the token-slot leases it releases as rounds commit, and the live expert
balancer it asks between rounds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable


from deepinfer_kit.sched.records import SchedulePlan
from deepinfer_kit.step import StepResult

if TYPE_CHECKING:
    from deepinfer_kit.eplb.records import Rebalance
    from deepinfer_kit.eplb.config import EplbConfig
    from deepinfer_kit.eplb.records import Placement, Topology

__all__ = ["Balancer", "SlotLeases", "StepRunner", "TwoPhaseRunner"]


class SlotLeases(Protocol):
    """The host's view of the token slots an overlapped runner keeps (see
    :class:`~deepinfer_kit.engine.runner.token_slots.TokenSlots`); their idle check is the
    runner's (:meth:`StepRunner.check_idle`)."""

    def release_through(self, step_id: int) -> object:
        """Step ``step_id`` was committed (its device work is done): free the slots whose
        newest reader is that step or older. Called by the engine after each commit, in
        step order."""
        ...


class StepRunner(Protocol):
    """Lays plans out for the device and executes them: the execution boundary.

    The Engine calls :meth:`prepare` once per non-empty plan, in step order, then hands
    ``execute(prepared)`` to its executor; executes run in the same order. Implementations:
    :class:`~deepinfer_kit.engine.runner.model_runner.ModelRunner` (in the engine's process) and
    :class:`~deepinfer_kit.engine.remote.process_runner.ProcessRunner` (a worker process).
    """

    @property
    def block_size(self) -> int:
        """Tokens per block of the runner's KV pool (must equal the cache manager's)."""
        ...

    @property
    def num_blocks(self) -> int:
        """Blocks in the runner's KV pool (must equal the cache manager's)."""
        ...

    @property
    def token_slots(self) -> SlotLeases | None:
        """The slots that carry each sequence's newest token into the next step (needed
        under an overlapped executor), or ``None``."""
        ...

    def prepare(self, plan: SchedulePlan, *, record_expert_counts: bool = False) -> Any:
        """Lay ``plan`` out (reading only its snapshots); returns what :meth:`execute`
        takes. May start the device work already. ``record_expert_counts`` (the engine
        passes ``True`` while it traces): the step returns the round's MoE routing counts
        in ``StepResult.expert_counts``.

        Raises:
            InvariantError: the plan breaks the runner's contract (see the implementation).
            EngineDeadError: the runner can never run a step again.
        """
        ...

    def execute(self, prepared: Any) -> StepResult:
        """Run (or finish) one prepared step; returns its tokens per chunk, aligned with
        the plan's chunks. Mutates the KV cache. Blocks until the tokens are on the host.

        Raises:
            EngineDeadError: the runner can never run a step again.
            Exception: the step failed (the engine fails its requests and goes on).
        """
        ...

    def check_idle(self) -> None:
        """Raise :class:`~deepinfer_kit.errors.InvariantError` unless the runner holds no
        per-sequence state (token slots, a drafter's sequences and blocks). Called by the
        engine's idle check, with nothing in flight and no request live."""
        ...

    def close(self) -> None:
        """Release what the runner holds beyond memory (a worker process). Idempotent."""
        ...


@runtime_checkable  # checked once, when the Engine is built
class TwoPhaseRunner(Protocol):
    """A :class:`StepRunner` that can split ``execute`` in two, so that an overlapped
    executor may queue step ``k + 1``'s device work before it waits for step ``k``'s
    tokens (:class:`~deepinfer_kit.overlap.records.TwoPhaseRun`).
    ``execute(p)`` must equal ``finish(launch(p))``. Implementation:
    :class:`~deepinfer_kit.engine.runner.model_runner.ModelRunner`."""

    def execute(self, prepared: Any) -> StepResult:
        """The whole step in one go (see :meth:`StepRunner.execute`)."""
        ...

    def pipelines(self, prepared: Any) -> bool:
        """Whether ``prepared`` may be launched while the step before it is launched and
        not finished (``False``: it reads that step's host results). Host only."""
        ...

    def launch(self, prepared: Any) -> Any:
        """Queue the step's device work, up to the copy of its tokens to the host; return
        without waiting for them. Launches happen in step order.

        Raises:
            Exception: the step failed (only this step; the one before still finishes).
        """
        ...

    def finish(self, launched: Any) -> StepResult:
        """Wait for ``launched``'s tokens and return its result (as ``execute`` does).
        Finishes happen in launch order, each launched step once.

        Raises:
            Exception: the step failed.
        """
        ...


class Balancer(Protocol):
    """Live EPLB as the Engine drives it: told of each committed round (:meth:`commit`),
    asked :meth:`due` before each step, and told to :meth:`rebalance` with nothing in
    flight. Implementations:
    :class:`~deepinfer_kit.engine.runner.balance.ExpertBalancer` (beside the model) and
    :class:`~deepinfer_kit.engine.remote.balancer.RemoteBalancer` (the model in a worker
    process)."""

    config: EplbConfig
    """The window, interval, policy and topology asked for."""

    topology: Topology
    """Slots, GPUs and nodes the placements span."""

    num_experts: int
    """Logical experts per MoE layer."""

    placement: Placement
    """The placement the model runs under now."""

    history: list[Rebalance]
    """One record per rebalance so far, oldest first."""

    @property
    def num_steps(self) -> int:
        """The rebalance clock: rounds with work committed so far (counted on the host by
        :meth:`commit`, so the same in-process, in a worker and on every rank)."""
        ...

    def commit(self) -> None:
        """Called by the engine once per committed round that had work, in commit order:
        advances :attr:`num_steps`."""
        ...

    def due(self) -> bool:
        """True once ``config.interval`` rounds committed since the last plan."""
        ...

    def rebalance(self, *, in_flight: int = 0) -> Rebalance:
        """Plan from the window and move the expert weights (between steps only);
        appends to :attr:`history` and returns the record, stamped :attr:`num_steps`.

        Raises:
            InvariantError: ``in_flight > 0`` (a forward could read half-moved weights).
        """
        ...
