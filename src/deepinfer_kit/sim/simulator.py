"""Simulator: the engine's synchronous round loop on a virtual clock — the real scheduler
and KV cache manager, a SimRunner in place of the model."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from deepinfer_kit.cache.protocols import KVCacheManager
from deepinfer_kit.errors import ConfigError, InvariantError
from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.request import Request
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sched.protocols import DecodeStretches, Scheduler
from deepinfer_kit.sched.records import PlainDecodeRun, SchedulePlan
from deepinfer_kit.sim.clock import VirtualClock
from deepinfer_kit.sim.collector import quiet_collector
from deepinfer_kit.sim.metrics import MetricsRecorder, SimReport
from deepinfer_kit.sim.prompts import PromptBuilder
from deepinfer_kit.sim.records import SimRequest
from deepinfer_kit.sim.runner import SimRunner
from deepinfer_kit.step import StepResult

__all__ = ["Simulator", "StepObserver"]

_NEVER = float("inf")
_MAX_STRETCH = 4096  # rounds one stretch of plain decodes covers at most

StepObserver = Callable[[SchedulePlan, StepResult, float, float], None]
"""``observer(plan, result, start, end)`` after each round's commit (virtual seconds)."""


class Simulator:
    """Runs a workload through injected components, round by round, like
    :meth:`Engine.step` with a synchronous executor: ``schedule`` -> ``prepare`` ->
    ``execute`` -> advance the clock by the round's duration -> ``commit``.

    Before each round every request whose arrival time has come is added (a follow-up
    turn arrives ``think_time`` after the previous turn finished, its prompt extended by
    that turn's prompt and output); an idle engine jumps the clock to the next arrival.

    Args:
        scheduler: the real scheduler (built with ``clock`` as its clock, so request
            metrics are in virtual seconds).
        cache: its KV cache manager (read for KV usage).
        runner: the cost-model runner.
        clock: the virtual clock the scheduler reads.
        prompts: materializes prompt tokens on arrival.
        eos_token_id: stamped on every request (the synthetic EOS).
        stretches: apply each stretch of plain-decode rounds (every running sequence
            decoding, nothing waiting; through the round in which a token may end one,
            until its blocks run short or a request arrives) in one scheduler call
            (:class:`~deepinfer_kit.sched.protocols.DecodeStretches`) when the scheduler
            offers it, the runner is a plain :class:`SimRunner` and no observer is
            given: the requests, cache, clock and metrics end as round by round, without
            a plan per round. ``False``: always round by round.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        cache: KVCacheManager,
        runner: SimRunner,
        clock: VirtualClock,
        prompts: PromptBuilder,
        eos_token_id: int | None,
        *,
        stretches: bool = True,
    ) -> None:
        self.scheduler = scheduler
        self.cache = cache
        self.runner = runner
        self.clock = clock
        self.prompts = prompts
        self.eos_token_id = eos_token_id
        self.stretches = stretches
        self._params: dict[int, SamplingParams] = {}
        self._priority: dict[str, int] = {}  # live request id -> its priority level

    def run(
        self,
        requests: Sequence[SimRequest],
        *,
        progress: bool = False,
        observer: StepObserver | None = None,
    ) -> SimReport:
        """Simulate ``requests`` to the end; returns the run's :class:`SimReport`.

        Mutates the scheduler, the cache, the runner's counters and the clock (a
        simulator runs one workload). ``progress`` shows a tqdm bar of finished requests.
        The cyclic garbage collector runs tuned while it does
        (:func:`~deepinfer_kit.sim.collector.quiet_collector`).

        Raises:
            ConfigError: duplicate request ids, or a follow-up whose previous turn is
                not in ``requests``.
            InvariantError: the scheduler stopped making progress.
        """
        with quiet_collector():
            return self._run(requests, progress, observer)

    def _run(
        self, requests: Sequence[SimRequest], progress: bool, observer: StepObserver | None
    ) -> SimReport:
        """The body of :meth:`run`."""
        roots, followers = _split(requests)
        metrics = MetricsRecorder()
        bar = _progress_bar(len(requests)) if progress else None
        pending: list[tuple[float, int, SimRequest, list[int] | None]] = []
        seq = 0
        next_root = 0
        sched, cache, runner, clock = self.scheduler, self.cache, self.runner, self.clock
        total_blocks = cache.num_blocks
        stretches = (
            sched if self.stretches and observer is None and isinstance(sched, DecodeStretches)
            and runner.prices_plain_decodes() else None
        )
        wall = time.perf_counter()
        while True:
            now = clock.now
            while True:  # arrivals due, in arrival order (FCFS and victims read it)
                root_t = roots[next_root].arrival_time if next_root < len(roots) else _NEVER
                follow_t = pending[0][0] if pending else _NEVER
                if root_t <= follow_t and root_t <= now:
                    self._add(roots[next_root], root_t, None, metrics)
                    next_root += 1
                elif follow_t < root_t and follow_t <= now:
                    when, _, req, history = heapq.heappop(pending)
                    self._add(req, when, history, metrics)
                else:
                    break
            if not sched.has_unfinished():
                if root_t == _NEVER and follow_t == _NEVER:
                    break
                clock.advance_to(min(root_t, follow_t))
                continue
            outputs = None
            if stretches is not None:
                outputs = self._stretch(stretches, min(root_t, follow_t), metrics, total_blocks)
            if outputs is None:
                outputs = self._round(metrics, total_blocks, observer)
            for out in outputs:
                rid = out.request_id
                metrics.on_finish(out, self._priority.pop(rid, 0))
                runner.tokens.forget(rid)
                for nxt in followers.pop(rid, ()):
                    history = out.prompt_token_ids + out.outputs[0].token_ids
                    heapq.heappush(pending, (clock.now + nxt.think_time, seq, nxt, history))
                    seq += 1
            if bar is not None and outputs:
                bar.update(len(outputs))
        if bar is not None:
            bar.close()
        experts = runner.experts.report() if runner.experts is not None else None
        return metrics.report(time.perf_counter() - wall, experts)

    def advance(self, metrics: MetricsRecorder, until: float = _NEVER, *,
                may_wait: bool = False) -> list[RequestOutput]:
        """Run what :meth:`run` runs next for the requests added so far (through
        ``scheduler.add``): the stretch of plain-decode rounds that starts now, up to the
        round that would start at or after ``until`` (when stretches apply, as in
        :meth:`run`), else one round; returns what it finished. For a driver that puts
        several simulators on one timeline (``sim/disagg.py``): it adds the requests,
        calls this only while ``scheduler.has_unfinished()``, and forgets finished ids
        from ``runner.tokens``. Mutates the scheduler, cache, runner counters, clock and
        ``metrics`` as :meth:`run` does. With ``may_wait`` (blocks held for something
        outside the scheduler will come back), a round that schedules and finishes
        nothing is recorded (zero seconds) and returns ``[]``: the driver waits.

        Raises:
            InvariantError: without ``may_wait``, the scheduler is stuck (nothing
                scheduled, nothing finished).
        """
        sched, total = self.scheduler, self.cache.num_blocks
        if self.stretches and isinstance(sched, DecodeStretches) and self.runner.prices_plain_decodes():
            outputs = self._stretch(sched, until, metrics, total)
            if outputs is not None:
                return outputs
        return self._round(metrics, total, None, may_wait)

    def _round(self, metrics: MetricsRecorder, total_blocks: int,
               observer: StepObserver | None, may_wait: bool = False) -> list[RequestOutput]:
        """One round: schedule, price and run it, advance the clock, commit; returns what
        the commit finished.

        Raises:
            InvariantError: nothing was scheduled and nothing finished (a stuck scheduler).
        """
        sched, runner, clock = self.scheduler, self.runner, self.clock
        now = clock.now
        plan = sched.schedule()
        if not plan.is_empty:
            step = runner.prepare(plan)
            result = runner.execute(step)
            duration = step.duration
        else:
            result, duration = StepResult(token_ids=[]), 0.0
        metrics.on_step(plan, now, duration, 1.0 - self.cache.num_free_blocks / total_blocks)
        clock.advance(duration)
        outputs = sched.commit(plan, result)
        if observer is not None:
            observer(plan, result, now, clock.now)
        if plan.is_empty and not outputs and not may_wait:
            raise InvariantError(
                f"step {plan.step_id}: nothing scheduled and nothing finished with "
                f"requests unfinished; the scheduler is stuck"
            )
        return outputs

    def _stretch(self, sched: DecodeStretches, until: float, metrics: MetricsRecorder,
                 total_blocks: int) -> list[RequestOutput] | None:
        """Run the stretch of plain-decode rounds that starts now, if there is one of at
        least two rounds, up to the round that would start at or after ``until`` (the
        next arrival); returns what its last round finished, or ``None`` when no round
        ran. The clock, runner counters and metrics advance as round by round."""
        start = self.clock.now
        source = _StretchSource(self.runner, self.clock, until)
        result = sched.advance_plain_decodes(source)
        frees = result.frees
        if not frees:
            return None
        times = source.times[:len(frees)]
        metrics.on_rounds(start, times, [1.0 - f / total_blocks for f in frees])
        self.runner.count_rounds(times)
        return result.outputs

    def _add(self, sim: SimRequest, when: float, history: list[int] | None,
             metrics: MetricsRecorder) -> None:
        """Materialize ``sim`` as a scheduler request arriving at ``when`` and queue it."""
        params = self._params.get(sim.output_len)
        if params is None:
            params = self._params[sim.output_len] = SamplingParams(max_tokens=sim.output_len)
        request = Request(
            sim.request_id,
            self.prompts.build(sim, history or ()),
            params,
            arrival_time=when,
            eos_token_id=self.eos_token_id,
            priority=sim.priority,
        )
        self.runner.tokens.register(sim.request_id, sim.output_len, sim.stop_by_eos)
        self._priority[sim.request_id] = sim.priority
        metrics.on_arrival(when)
        self.scheduler.add(request)


class _StretchSource:
    """The simulator's :class:`~deepinfer_kit.sched.protocols.StretchSource`: a stretch
    runs until the round that would start at or after ``until`` (each round priced as
    :meth:`SimRunner.prepare` prices it), and samples the synthetic model's tokens. A
    stretch shorter than two rounds is left to the round-by-round path, which costs no
    more for one round."""

    __slots__ = ("runner", "clock", "until", "times")

    def __init__(self, runner: SimRunner, clock: VirtualClock, until: float) -> None:
        self.runner = runner
        self.clock = clock
        self.until = until
        self.times: list[float] = []

    def rounds(self, run: PlainDecodeRun) -> int:
        """Prices the run's rounds into :attr:`times`; returns how many (0 if fewer than
        two)."""
        n = len(run.request_ids)
        self.times = self.runner.plain_decode_times(
            n, sum(run.starts) + n, self.clock.now, self.until, min(run.max_rounds + 1, _MAX_STRETCH)
        )
        return len(self.times) if len(self.times) >= 2 else 0

    def tokens(self, request_id: str, first: int, count: int) -> list[int]:
        """The synthetic model's tokens (:meth:`SyntheticTokens.tokens`)."""
        return self.runner.tokens.tokens(request_id, first, count)

    def applied(self, rounds: int) -> None:
        """The clock moves to the end of the ``rounds`` rounds applied (their durations
        summed in order, as round by round)."""
        self.clock.advance_each(self.times[:rounds])


if TYPE_CHECKING:
    from deepinfer_kit.sched.protocols import StretchSource

    _source: type[StretchSource] = _StretchSource


def _split(requests: Sequence[SimRequest]) -> tuple[list[SimRequest], dict[str, list[SimRequest]]]:
    """First turns sorted by arrival (stable), and follow-ups by the id they follow."""
    ids: set[str] = set()
    roots: list[SimRequest] = []
    followers: dict[str, list[SimRequest]] = {}
    for r in requests:
        if r.request_id in ids:
            raise ConfigError(f"request ids must be unique, got {r.request_id!r} twice")
        ids.add(r.request_id)
        if r.after is None:
            roots.append(r)
        else:
            followers.setdefault(r.after, []).append(r)
    missing = sorted(set(followers) - ids)
    if missing:
        raise ConfigError(f"follow-up turns name unknown previous turns: {missing[:5]}")
    roots.sort(key=lambda r: r.arrival_time)
    return roots, followers


class _Bar:
    """The part of tqdm the simulator uses."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, unit="req", desc="simulating", mininterval=0.5)

    def update(self, n: int) -> None:
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()


def _progress_bar(total: int) -> _Bar:
    return _Bar(total)
