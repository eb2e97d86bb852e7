"""RemoteBalancer: live EPLB when the model runs in a worker process.

The :class:`~deepinfer_kit.engine.runner.balance.ExpertBalancer` stays beside the model, in the
worker (its load window is fed after every forward there, and a rebalance copies expert
weights there). The host keeps this handle, which the Engine drives like the local one:

- the rebalance clock lives here, on the host: :meth:`commit` counts the rounds the
  engine commits (no message per step), so :meth:`due` is a function of committed rounds
  alone, never of how many step replies happen to have arrived;
- :meth:`rebalance` sends one ``("rebalance", released, after_step)`` request, which the
  worker (every expert-parallel rank) runs after every step sent before it (the engine
  commits them all first): it plans from its window, moves the weights and answers the
  :class:`Rebalance` record stamped with the host's clock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer_kit.eplb.records import BalancerState, Rebalance
from deepinfer_kit.eplb.config import EplbConfig
from deepinfer_kit.eplb.placement_ops import placement_from_phy2log
from deepinfer_kit.errors import InvariantError

if TYPE_CHECKING:
    from deepinfer_kit.engine.remote.process_group import ProcessGroupRunner
    from deepinfer_kit.engine.remote.process_runner import ProcessRunner

__all__ = ["RemoteBalancer"]


class RemoteBalancer:
    """The host's side of the worker's :class:`ExpertBalancer` (a
    :class:`~deepinfer_kit.engine.protocols.Balancer`).

    Args:
        runner: the worker's runner handle (its request channel), or the expert-parallel
            ranks' (the request goes to every rank, each moves its slots).
        config: the engine's ``eplb`` config.
        state: the worker balancer's state when the worker was built.
    """

    def __init__(self, runner: ProcessRunner | ProcessGroupRunner, config: EplbConfig,
                 state: BalancerState) -> None:
        self._runner = runner
        self.config = config
        self.topology = state.topology
        self.num_experts = state.num_experts
        self.placement = state.placement
        self.history: list[Rebalance] = []
        self.num_steps = 0
        self._last_plan = 0

    def commit(self) -> None:
        """See :meth:`ExpertBalancer.commit` (the clock is the host's; nothing is sent)."""
        self.num_steps += 1

    def due(self) -> bool:
        """See :meth:`ExpertBalancer.due`."""
        return self.num_steps - self._last_plan >= self.config.interval

    def rebalance(self, *, in_flight: int = 0) -> Rebalance:
        """See :meth:`ExpertBalancer.rebalance`: one round trip to the worker (every rank),
        which plans from its window whatever its own count, stamped ``num_steps``.

        Raises:
            InvariantError: ``in_flight > 0``.
            EngineDeadError: the worker is gone.
            Exception: what planning or moving the weights raised in the worker.
        """
        if in_flight:
            raise InvariantError(f"rebalance with {in_flight} steps in flight; commit them first")
        answer = self._runner.request(("rebalance", self._runner.released, self.num_steps))
        if isinstance(answer, BaseException):
            raise answer
        record: Rebalance = answer[0]
        self._last_plan = self.num_steps
        self.history.append(record)
        self.placement = placement_from_phy2log(record.phy2log, self.num_experts)
        return record
