"""SimRunner: the ModelRunner's prepare / execute with no model — a cost model prices the
round, a synthetic source supplies the tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer_kit.sched.records import SchedulePlan
from deepinfer_kit.sim.protocols import CostModel, DecodeRoundCost
from deepinfer_kit.sim.records import SimStep, StepShape
from deepinfer_kit.sim.shape import plan_shape
from deepinfer_kit.sim.tokens import SyntheticTokens
from deepinfer_kit.cache.tiers.records import TransferOutput
from deepinfer_kit.step import StepResult

if TYPE_CHECKING:
    from deepinfer_kit.sim.experts import ExpertSim

__all__ = ["SimRunner"]


class SimRunner:
    """Lays a plan out as a :class:`SimStep` (its shape and price) and "executes" it.

    Same call order as :class:`~deepinfer_kit.engine.runner.model_runner.ModelRunner`:
    ``execute(prepare(plan))`` once per non-empty plan, in schedule order. Reads only the
    plan's snapshots, never a live request.

    Args:
        cost: prices each round.
        tokens: the tokens each sampled chunk draws (keyed by request id and output
            position, so a preempted request regenerates the same ones).
        experts: a simulated MoE router and placement policy; when given, each round's
            price is stretched by its expert imbalance (:meth:`ExpertSim.on_step`).
        block_size: tokens per block (a round's KV-tier copies are priced per token).
        layerwise_loads: the tiers' loads land layer by layer beside the forward.

    Attributes:
        num_steps: rounds executed; busy_time: their summed durations (seconds).
    """

    __slots__ = ("cost", "tokens", "experts", "num_steps", "busy_time", "_round_times", "_window", "_P",
                 "_layerwise")

    def __init__(self, cost: CostModel, tokens: SyntheticTokens,
                 experts: ExpertSim | None = None, *, block_size: int = 16,
                 layerwise_loads: bool = False) -> None:
        self.cost = cost
        self._P = block_size
        self._layerwise = layerwise_loads
        self.tokens = tokens
        self.experts = experts
        self.num_steps = 0
        self.busy_time = 0.0
        self._window: int | None = getattr(cost, "window", None)  # a cost model pricing sliding layers
        self._round_times = (cost.decode_round_times
                             if isinstance(cost, DecodeRoundCost) and self._window is None else None)

    def prepare(self, plan: SchedulePlan) -> SimStep:
        """The round's :class:`StepShape` and its duration from the cost model (stretched
        by the expert imbalance when ``experts`` is set, which routes the round's tokens
        and may rebalance: its only mutation). O(chunks)."""
        shape = plan_shape(plan, self._window)
        transfers = plan.kv_transfers
        if transfers is not None:
            shape.num_kv_transfer_tokens = (len(transfers.saves) + len(transfers.loads)) * self._P
            if self._layerwise:
                shape.num_kv_layerwise_load_tokens = len(transfers.loads) * self._P
        duration = self.cost.step_time(shape)
        if self.experts is not None:
            duration = self.experts.on_step(shape.num_tokens, duration)
        return SimStep(plan, shape, duration)

    def execute(self, step: SimStep) -> StepResult:
        """Per chunk: no token for a non-final prefill chunk, else ``num_samples`` tokens
        from the synthetic source (a verified chunk gets one token: every draft is
        rejected). Counts the step and its duration; mutates nothing else. O(chunks)."""
        out = self.tokens.plan_tokens(step.plan)
        self.num_steps += 1
        self.busy_time += step.duration
        transfers = step.plan.kv_transfers  # the KV tiers' copies: done when the round is
        report = TransferOutput(saved=[s for _, s in transfers.saves]) if transfers is not None else None
        return StepResult(token_ids=out, kv_transfers=report)

    def prices_plain_decodes(self) -> bool:
        """True when this runner's rounds are :class:`SimRunner`'s own (priced by their
        shape alone, tokens from :attr:`tokens`, no expert simulation), so a stretch of
        plain-decode rounds may be priced by :meth:`plain_decode_times` instead."""
        cls = type(self)
        return (
            self.experts is None and self._window is None and cls.prepare is SimRunner.prepare
            and cls.execute is SimRunner.execute
        )

    def plain_decode_times(self, num_seqs: int, context: int, start: float, until: float,
                           max_rounds: int) -> list[float]:
        """Durations of consecutive plain-decode rounds of ``num_seqs`` sequences, the
        first reading ``context`` KV positions (each later round ``num_seqs`` more), as
        :meth:`prepare` prices each one; the first round starts at ``start`` (virtual
        seconds). Stops at ``max_rounds`` or before a round that would start at or after
        ``until`` (the first is always priced); in one call when the cost model is a
        :class:`~deepinfer_kit.sim.protocols.DecodeRoundCost`. Pure; O(rounds)."""
        if self._round_times is not None:
            return self._round_times(num_seqs, context, start, until, max_rounds)
        step_time = self.cost.step_time
        times: list[float] = []
        now = start
        while len(times) < max_rounds and (not times or now < until):
            d = step_time(StepShape(0, num_seqs, context, num_seqs, context, num_seqs, 0))
            times.append(d)
            now += d
            context += num_seqs
        return times

    def count_rounds(self, durations: list[float]) -> None:
        """Count rounds run outside :meth:`execute` (a stretch of plain decodes), as
        :meth:`execute` counts each: mutates :attr:`num_steps` and :attr:`busy_time`."""
        busy = self.busy_time
        for d in durations:  # summed one by one, as execute() does
            busy += d
        self.busy_time = busy
        self.num_steps += len(durations)
