"""MetricsRecorder and SimReport: what a simulated run measured — throughput, latency
percentiles (overall and per priority level), queueing, prefix hits, preemptions, KV
usage over time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.sched.records import SchedulePlan

if TYPE_CHECKING:
    from deepinfer_kit.sim.expert_records import ExpertReport

__all__ = ["percentile", "Percentiles", "PriorityLatency", "PRIORITY_KEYS", "SimReport",
           "MetricsRecorder"]


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) by linear interpolation between closest ranks
    (numpy's default): rank ``p / 100 * (n - 1)`` of the sorted values. ``nan`` for no
    values. Pure; O(n log n)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    rank = p / 100.0 * (len(xs) - 1)
    lo = int(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@attrs.frozen(slots=True)
class Percentiles:
    """p50 / p90 / p99 and the mean of one latency, in seconds."""

    p50: float
    p90: float
    p99: float
    mean: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        """The percentiles of ``values`` (``nan`` everywhere when empty)."""
        mean = sum(values) / len(values) if values else float("nan")
        return cls(percentile(values, 50), percentile(values, 90), percentile(values, 99), mean)


#: The per-priority keys of :meth:`SimReport.summary`, as ``prio{level}_{key}``.
PRIORITY_KEYS = ("requests", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                 "e2e_p99_ms", "queueing_p99_ms")


@attrs.frozen(slots=True)
class PriorityLatency:
    """The latencies of the requests of one priority level.

    Attributes:
        priority: the level (lower is served first by the ``priority`` policy).
        num_finished: its requests that finished, errors excluded.
        ttft, tpot, e2e, queueing: as in :class:`SimReport`, over those requests.
    """

    priority: int
    num_finished: int
    ttft: Percentiles
    tpot: Percentiles
    e2e: Percentiles
    queueing: Percentiles

    def summary(self) -> dict[str, float | int]:
        """The level's :data:`PRIORITY_KEYS` as one flat row (latencies in ms)."""
        return {
            "requests": self.num_finished,
            "ttft_p50_ms": self.ttft.p50 * 1e3,
            "ttft_p99_ms": self.ttft.p99 * 1e3,
            "tpot_p50_ms": self.tpot.p50 * 1e3,
            "tpot_p99_ms": self.tpot.p99 * 1e3,
            "e2e_p99_ms": self.e2e.p99 * 1e3,
            "queueing_p99_ms": self.queueing.p99 * 1e3,
        }


class _Latencies:
    """The latency samples of a set of finished requests (one list per metric)."""

    __slots__ = ("ttft", "tpot", "e2e", "queue", "count")

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.e2e: list[float] = []
        self.queue: list[float] = []
        self.count = 0

    def report(self, priority: int) -> PriorityLatency:
        """These samples' percentiles as the level ``priority``."""
        return PriorityLatency(priority, self.count, Percentiles.of(self.ttft),
                               Percentiles.of(self.tpot), Percentiles.of(self.e2e),
                               Percentiles.of(self.queue))


@attrs.frozen(slots=True)
class SimReport:
    """The result of one simulated run.

    Attributes:
        num_requests: requests that arrived; num_finished: those finished, of which
            num_errors ended with reason ``error`` (could never run) and num_stopped with
            EOS.
        duration_s: virtual seconds from the first arrival to the last finish.
        busy_s: virtual seconds spent executing rounds; num_steps: rounds executed.
        prompt_tokens, output_tokens: over finished requests.
        output_throughput: output tokens per virtual second; request_throughput: requests.
        ttft, tpot, e2e, queueing: time to first token, time per output token after the
            first, end-to-end latency, arrival to first scheduled.
        per_user_tokens_per_s: mean over requests of output tokens / end-to-end latency.
        prefix_hit_rate: prompt tokens served from the prefix cache / prompt tokens.
        preemptions: preemptions by recompute.
        kv_usage_mean, kv_usage_max: time-weighted mean and max fraction of the pool held.
        kv_usage_series: ``(time, usage)`` samples, at most ``max_series`` of them.
        wall_s: real seconds the simulation took.
        experts: expert balancedness when a simulated MoE router took part, else None.
        by_priority: the latencies of each priority level that finished requests, lowest
            level first.
    """

    num_requests: int
    num_finished: int
    num_errors: int
    num_stopped: int
    duration_s: float
    busy_s: float
    num_steps: int
    prompt_tokens: int
    output_tokens: int
    output_throughput: float
    request_throughput: float
    ttft: Percentiles
    tpot: Percentiles
    e2e: Percentiles
    queueing: Percentiles
    per_user_tokens_per_s: float
    prefix_hit_rate: float
    preemptions: int
    kv_usage_mean: float
    kv_usage_max: float
    kv_usage_series: tuple[tuple[float, float], ...]
    wall_s: float
    experts: ExpertReport | None = None
    by_priority: tuple[PriorityLatency, ...] = ()

    def summary(self) -> dict[str, float | int]:
        """The scalar metrics as one flat row (latencies in milliseconds), for tables
        and CSV; with more than one priority level, also :data:`PRIORITY_KEYS` of each
        as ``prio{level}_{key}``."""
        row: dict[str, float | int] = {
            "requests": self.num_finished,
            "errors": self.num_errors,
            "duration_s": self.duration_s,
            "out_tok_per_s": self.output_throughput,
            "req_per_s": self.request_throughput,
        }
        for name in ("ttft", "tpot", "e2e", "queueing"):
            p: Percentiles = getattr(self, name)
            row[f"{name}_p50_ms"] = p.p50 * 1e3
            row[f"{name}_p90_ms"] = p.p90 * 1e3
            row[f"{name}_p99_ms"] = p.p99 * 1e3
        row.update(
            user_tok_per_s=self.per_user_tokens_per_s,
            prefix_hit_rate=self.prefix_hit_rate,
            preemptions=self.preemptions,
            kv_usage_mean=self.kv_usage_mean,
            kv_usage_max=self.kv_usage_max,
            steps=self.num_steps,
            wall_s=self.wall_s,
        )
        if self.experts is not None:
            row.update(self.experts.summary())
        if len(self.by_priority) > 1:
            for level in self.by_priority:
                row.update({f"prio{level.priority}_{k}": v for k, v in level.summary().items()})
        return row


class MetricsRecorder:
    """Collects per-step and per-request observations during a run.

    Args:
        max_series: the most KV-usage samples kept in the report (evenly thinned).
    """

    def __init__(self, max_series: int = 200) -> None:
        self.max_series = max_series
        self.num_arrived = 0
        self.num_steps = 0
        self.busy_s = 0.0
        self.preemptions = 0
        self.first_arrival = float("inf")
        self.last_finish = 0.0
        self._usage_t: list[float] = []
        self._usage: list[float] = []
        self._usage_area = 0.0
        self._usage_max = 0.0
        self._all = _Latencies()
        self._by_priority: dict[int, _Latencies] = {}
        self._user_rate: list[float] = []
        self._prompt = self._cached = self._output = 0
        self._errors = self._stopped = self._finished = 0

    def on_arrival(self, when: float) -> None:
        """A request arrived at ``when`` (virtual seconds)."""
        self.num_arrived += 1
        if when < self.first_arrival:
            self.first_arrival = when

    def on_step(self, plan: SchedulePlan, start: float, duration: float, usage: float) -> None:
        """A round ran from ``start`` for ``duration`` s, with ``usage`` of the pool held
        after its scheduling. O(1)."""
        if plan.preempted_ids:
            self.preemptions += len(plan.preempted_ids)
        self.on_rounds(start, [duration], [usage])

    def on_rounds(self, start: float, durations: list[float], usages: list[float]) -> None:
        """Rounds that preempted nothing ran back to back from ``start``, round ``r`` for
        ``durations[r]`` s with ``usages[r]`` of the pool held (a stretch, or the one
        round of :meth:`on_step`). O(rounds)."""
        usage_t, usage_log = self._usage_t, self._usage
        busy, area, peak = self.busy_s, self._usage_area, self._usage_max
        for d, u in zip(durations, usages):  # summed round by round, in order
            busy += d
            usage_t.append(start)
            usage_log.append(u)
            area += u * d
            if u > peak:
                peak = u
            start += d
        self.num_steps += len(durations)
        self.busy_s, self._usage_area, self._usage_max = busy, area, peak

    def on_finish(self, out: RequestOutput, priority: int = 0) -> None:
        """A request of level ``priority`` finished; reads its metrics (virtual times)
        and token counts."""
        self._finished += 1
        comp = out.outputs[0]
        n_out = len(comp.token_ids)
        if comp.finish_reason == "error":
            self._errors += 1
            return
        if comp.finish_reason == "stop":
            self._stopped += 1
        self._prompt += len(out.prompt_token_ids)
        self._cached += out.num_cached_tokens
        self._output += n_out
        m = out.metrics
        if m is None or m.finished_time is None:
            return
        if m.finished_time > self.last_finish:
            self.last_finish = m.finished_time
        e2e = m.finished_time - m.arrival_time
        if e2e > 0:
            self._user_rate.append(n_out / e2e)
        level = self._by_priority.get(priority)
        if level is None:
            level = self._by_priority[priority] = _Latencies()
        for lat in (self._all, level):
            lat.count += 1
            lat.e2e.append(e2e)
            if m.first_scheduled_time is not None:
                lat.queue.append(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                lat.ttft.append(m.first_token_time - m.arrival_time)
                if n_out > 1:
                    lat.tpot.append((m.finished_time - m.first_token_time) / (n_out - 1))

    def report(self, wall_s: float, experts: ExpertReport | None = None) -> SimReport:
        """The :class:`SimReport` of what was recorded (``wall_s``: real seconds;
        ``experts``: the expert metrics, if any)."""
        start = self.first_arrival if self.first_arrival != float("inf") else 0.0
        duration = max(self.last_finish - start, 0.0)
        done = self._finished - self._errors
        step = max(1, len(self._usage) // self.max_series) if self.max_series else 0
        series = tuple(zip(self._usage_t[::step], self._usage[::step])) if step else ()
        return SimReport(
            num_requests=self.num_arrived,
            num_finished=self._finished,
            num_errors=self._errors,
            num_stopped=self._stopped,
            duration_s=duration,
            busy_s=self.busy_s,
            num_steps=self.num_steps,
            prompt_tokens=self._prompt,
            output_tokens=self._output,
            output_throughput=self._output / duration if duration > 0 else 0.0,
            request_throughput=done / duration if duration > 0 else 0.0,
            ttft=Percentiles.of(self._all.ttft),
            tpot=Percentiles.of(self._all.tpot),
            e2e=Percentiles.of(self._all.e2e),
            queueing=Percentiles.of(self._all.queue),
            per_user_tokens_per_s=(sum(self._user_rate) / len(self._user_rate)
                                   if self._user_rate else 0.0),
            prefix_hit_rate=self._cached / self._prompt if self._prompt else 0.0,
            preemptions=self.preemptions,
            kv_usage_mean=self._usage_area / self.busy_s if self.busy_s > 0 else 0.0,
            kv_usage_max=self._usage_max,
            kv_usage_series=series,
            wall_s=wall_s,
            experts=experts,
            by_priority=tuple(self._by_priority[p].report(p) for p in sorted(self._by_priority)),
        )
