"""RemoteBalancer: live EPLB when the model runs in a worker process.

The :class:`~deepinfer_kit.engine.balance.ExpertBalancer` stays beside the model, in the
worker (its load window is fed after every forward there, and a rebalance copies expert
weights there). The host keeps this handle, which the Engine drives like the local one:

- :meth:`due` estimates the worker's forward count from the step replies received since
  the last exchange (no message per step);
- :meth:`rebalance` sends one ``("rebalance", released)`` request, which the worker runs
  after every step sent before it (the engine commits them all first); the worker checks
  its own ``due()`` (a step that failed before its forward is not counted there), plans
  and moves the weights, and answers the :class:`Rebalance` record with its state, which
  resets the estimate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer_kit.engine.balance import BalancerState, Rebalance
from deepinfer_kit.eplb.config import EplbConfig
from deepinfer_kit.eplb.placement_ops import placement_from_phy2log
from deepinfer_kit.errors import InvariantError

if TYPE_CHECKING:
    from deepinfer_kit.engine.process_group import ProcessGroupRunner
    from deepinfer_kit.engine.process_runner import ProcessRunner

__all__ = ["RemoteBalancer"]


class RemoteBalancer:
    """The host's side of the worker's :class:`ExpertBalancer` (a
    :class:`~deepinfer_kit.engine.protocols.Balancer`).

    Args:
        runner: the worker's runner handle (its request channel and reply count), or the
            expert-parallel ranks' (the request goes to every rank, each moves its slots).
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
        self._sync(state)

    @property
    def num_steps(self) -> int:
        """The worker's forward count, estimated from the step replies since the last
        exchange (exact unless a step failed before its forward)."""
        return self._steps + self._runner.num_step_replies - self._replies

    def due(self) -> bool:
        """See :meth:`ExpertBalancer.due` (on the estimate; the worker decides)."""
        return self.num_steps - self._last_plan >= self.config.interval

    def rebalance(self, *, in_flight: int = 0) -> Rebalance | None:
        """See :meth:`ExpertBalancer.rebalance`: one round trip to the worker. Returns
        ``None`` (and corrects the estimate) when the worker's own count is not due yet.

        Raises:
            InvariantError: ``in_flight > 0``.
            EngineDeadError: the worker is gone.
            Exception: what planning or moving the weights raised in the worker.
        """
        if in_flight:
            raise InvariantError(f"rebalance with {in_flight} steps in flight; commit them first")
        answer = self._runner.request(("rebalance", self._runner.released))
        if isinstance(answer, BaseException):
            raise answer
        record: Rebalance | None = answer[0]
        state: BalancerState = answer[1]
        self._sync(state)
        if record is not None:
            self.history.append(record)
            self.placement = placement_from_phy2log(record.phy2log, self.num_experts)
        return record

    def _sync(self, state: BalancerState) -> None:
        self._steps, self._last_plan = state.num_steps, state.last_plan
        self._replies = self._runner.num_step_replies
