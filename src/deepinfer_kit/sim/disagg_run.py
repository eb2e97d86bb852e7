"""The event loop of one :meth:`ClusterSimulator.run` (``sim/disagg.py``): the instances'
state in the loop, the events, routing, transfers, and the run's report."""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import attrs

from deepinfer_kit.errors import ConfigError, InvariantError
from deepinfer_kit.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer_kit.request import Request
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sched.records import SchedulePlan
from deepinfer_kit.sim.disagg_kv import TransferKV
from deepinfer_kit.sim.disagg_records import ClusterReport, InstanceReport, RequestPath
from deepinfer_kit.sim.metrics import MetricsRecorder, SimReport
from deepinfer_kit.sim.records import SimRequest
from deepinfer_kit.sim.shape import plan_shape
from deepinfer_kit.sim.simulator import Simulator

if TYPE_CHECKING:
    from deepinfer_kit.sim.cost_analytic import ModelShape
    from deepinfer_kit.sim.disagg_records import TransferLink

__all__ = ["Cluster", "InstanceSlot", "ClusterRun"]

_NEVER = float("inf")
_COMMIT, _DELIVER, _PLAN = 0, 1, 2  # at one instant: commits, then deliveries, then plans


class _SlotMetrics(MetricsRecorder):
    """An instance's recorder; also counts the prompt tokens its rounds computed."""

    def __init__(self) -> None:
        super().__init__()
        self.prefill_tokens = 0

    def on_step(self, plan: SchedulePlan, start: float, duration: float, usage: float) -> None:
        """See :meth:`MetricsRecorder.on_step`; adds the round's prefill tokens."""
        if plan.chunks:
            self.prefill_tokens += plan_shape(plan).num_prefill_tokens
        super().on_step(plan, start, duration, usage)


class InstanceSlot:
    """One replica in the cluster's loop: its simulator, role, recorder, router load and
    event state. Built by :class:`ClusterSimulator`; mutated only by :class:`ClusterRun`.

    Args:
        index: its place in the cluster; role: one of ``ROLES``; sim: its simulator.
    """

    __slots__ = ("index", "role", "sim", "kv", "metrics", "inbox", "outstanding", "scheduled", "next_time",
                 "deliveries", "parked", "waits")

    def __init__(self, index: int, role: str, sim: Simulator) -> None:
        self.index = index
        self.role = role
        self.sim = sim
        self.kv = sim.cache if isinstance(sim.cache, TransferKV) else None
        self.metrics = _SlotMetrics()
        self.inbox: list[Request] = []  # delivered, added to the scheduler at its next round
        self.outstanding = 0  # router load: tokens of requests routed here and not done here
        self.scheduled = False  # a round's commit or a planning event is pending
        self.next_time = 0.0  # ... at this time
        self.deliveries: list[float] = []  # heap: landing times of transfers on their way here
        self.parked = False  # waits for its blocks held by outgoing transfers
        self.waits = 0  # times it parked


class Cluster(Protocol):
    """What a run reads of its cluster (:class:`~deepinfer_kit.sim.disagg.ClusterSimulator`
    has it): the instances, those requests arrive at (``front``) and the decode ones, the
    KV link and the model shape that sizes a transfer."""

    mode: str
    model: ModelShape
    link: TransferLink | None
    instances: list[InstanceSlot]
    front: list[InstanceSlot]
    decode: list[InstanceSlot]


class ClusterRun:
    """The state of one :meth:`ClusterSimulator.run` (see there for the rules).

    Args:
        cluster: the cluster (its instances are mutated by :meth:`run`).
        requests: the workload.
        keep_outputs: keep each whole request's output for the report.

    Raises:
        ConfigError: duplicate request ids or a follow-up turn.
    """

    def __init__(self, cluster: Cluster, requests: Sequence[SimRequest], keep_outputs: bool = False) -> None:
        ids: set[str] = set()
        for r in requests:
            if r.request_id in ids:
                raise ConfigError(f"request ids must be unique, got {r.request_id!r} twice")
            if r.after is not None:
                raise ConfigError(f"the cluster simulator runs first turns only, got {r.request_id!r} "
                                  f"after {r.after!r}")
            ids.add(r.request_id)
        self.cluster = cluster
        self.arrivals = sorted(requests, key=lambda r: r.arrival_time)
        self.next_arrival = 0
        self.heap: list[tuple[float, int, int, int, object]] = []
        self.seq = 0
        self.metrics = MetricsRecorder()
        self.paths: dict[str, RequestPath] = {}
        self.sims: dict[str, SimRequest] = {}
        self.firsts: dict[str, RequestOutput] = {}  # prefill outputs awaiting their decode
        self.params: dict[int, SamplingParams] = {}
        self.load: dict[str, int] = {}  # router load a request adds to the instance it is at
        self.num_transfers = self.transfer_bytes = 0
        self.outputs: list[RequestOutput] | None = [] if keep_outputs else None

    def push(self, when: float, kind: int, index: int, data: object) -> None:
        """Queue an event (``index``: its instance, -1 for an arrival). O(log events)."""
        heapq.heappush(self.heap, (when, kind, self.seq, index, data))
        self.seq += 1

    def run(self) -> ClusterReport:
        """Take every event in order to the end; returns the report (see
        :meth:`ClusterSimulator.run`, which raises what this raises)."""
        wall = time.perf_counter()
        for r in self.arrivals:
            self.push(r.arrival_time, _DELIVER, -1, r)
        insts = self.cluster.instances
        while self.heap:
            when, kind, _, index, data = heapq.heappop(self.heap)
            if kind == _PLAN:
                self.plan(insts[index], when)
            elif kind == _COMMIT:
                assert isinstance(data, list)
                self.commit(insts[index], when, data)
            elif index < 0:
                assert isinstance(data, SimRequest)
                self.next_arrival += 1
                self.arrive(data, when)
            else:
                assert isinstance(data, RequestOutput)
                self.land(insts[index], when, data)
        return self.report(time.perf_counter() - wall)

    # ------------------------------------------------------------------ events

    def wake(self, inst: InstanceSlot, when: float) -> None:
        """Plan ``inst`` at ``when`` unless a round or a planning event is pending."""
        if not inst.scheduled:
            inst.scheduled, inst.next_time = True, when
            self.push(when, _PLAN, inst.index, None)

    def plan(self, inst: InstanceSlot, when: float) -> None:
        """``inst`` is free at ``when``: add what was delivered, run its next round (or
        stretch) now, and handle what it finished at the round's end."""
        sim = inst.sim
        sim.clock.advance_to(when)
        for req in inst.inbox:
            sim.scheduler.add(req)
        inst.inbox.clear()
        if not sim.scheduler.has_unfinished():
            inst.scheduled = False
            return
        held = inst.kv is not None and inst.kv.num_held > 0
        outputs = sim.advance(inst.metrics, self.until(inst), may_wait=held)
        if held and not outputs and sim.clock.now == when:
            inst.scheduled, inst.parked = False, True  # its pool is held by KV on the way out
            inst.waits += 1
            return
        inst.next_time = sim.clock.now
        self.push(sim.clock.now, _COMMIT, inst.index, outputs)

    def until(self, inst: InstanceSlot) -> float:
        """The earliest time something may be delivered to ``inst``: a stretch of its
        plain-decode rounds stops before a round that would start then. For a decode
        instance: a transfer on its way, or one a prefill instance may start — no
        earlier than its pending event (a busy one), the next arrival (an idle one) or
        the next landing, which frees blocks (one waiting for them) — plus the link's
        latency."""
        arrival = self.arrivals[self.next_arrival].arrival_time if self.next_arrival < len(self.arrivals) else _NEVER
        if inst.role != "decode":
            return arrival
        assert self.cluster.link is not None
        first = _NEVER
        for p in self.cluster.front:
            t = p.next_time if p.scheduled else arrival
            if p.parked:
                t = min([t] + [d.deliveries[0] for d in self.cluster.decode if d.deliveries])
            if t < first:
                first = t
        bound = first + self.cluster.link.latency_s  # a prefill ending then lands no earlier
        return min(bound, inst.deliveries[0]) if inst.deliveries else bound

    def admit(self, inst: InstanceSlot, sim_req: SimRequest, prompt: list[int], max_tokens: int, when: float,
              first: int) -> None:
        """Queue a request of ``prompt`` at ``inst`` arriving ``when``; its synthetic
        tokens are its stream from position ``first``."""
        params = self.params.get(max_tokens)
        if params is None:
            params = self.params[max_tokens] = SamplingParams(max_tokens=max_tokens)
        sim = inst.sim
        rid = sim_req.request_id
        sim.runner.tokens.register(rid, sim_req.output_len, sim_req.stop_by_eos, first)
        inst.metrics.on_arrival(when)
        inst.inbox.append(Request(rid, prompt, params, arrival_time=when, eos_token_id=sim.eos_token_id,
                                  priority=sim_req.priority))
        self.wake(inst, when)

    def arrive(self, sim_req: SimRequest, when: float) -> None:
        """A request arrives: route it to the front instance with the least outstanding
        tokens."""
        inst = min(self.cluster.front, key=lambda i: (i.outstanding, i.index))
        rid = sim_req.request_id
        self.sims[rid] = sim_req
        self.paths[rid] = RequestPath(rid, when, sim_req.prompt_len, sim_req.output_len, inst.index)
        self.metrics.on_arrival(when)
        prompt = inst.sim.prompts.build(sim_req)
        colocated = inst.role == "colocated"
        self.load[rid] = len(prompt) + (sim_req.output_len if colocated else 0)
        inst.outstanding += self.load[rid]
        if colocated:
            self.admit(inst, sim_req, prompt, sim_req.output_len, when, 0)
            return
        if sim_req.output_len > 1:
            assert inst.kv is not None
            inst.kv.hold(rid)
        self.admit(inst, sim_req, prompt, 1, when, 0)

    def land(self, inst: InstanceSlot, when: float, first: RequestOutput) -> None:
        """A prompt's KV lands at decode instance ``inst``: the prefill instance frees
        its blocks, and the request (prompt plus first token) queues here."""
        heapq.heappop(inst.deliveries)
        rid = first.request_id
        sim_req = self.sims[rid]
        prefill = self.cluster.instances[self.paths[rid].first_instance]
        assert prefill.kv is not None and inst.kv is not None
        prefill.kv.release(rid)
        if prefill.parked:
            prefill.parked = False
            self.wake(prefill, when)
        inst.kv.expect(rid, len(first.prompt_token_ids))
        prompt = first.prompt_token_ids + first.outputs[0].token_ids
        self.admit(inst, sim_req, prompt, sim_req.output_len - 1, when, 1)

    def commit(self, inst: InstanceSlot, when: float, outputs: list[RequestOutput]) -> None:
        """``inst``'s round ended at ``when``: handle what it finished, then plan it."""
        inst.scheduled = False
        for out in outputs:
            rid = out.request_id
            sim_req = self.sims[rid]
            inst.metrics.on_finish(out, sim_req.priority)
            inst.sim.runner.tokens.forget(rid)
            inst.outstanding -= self.load.pop(rid)
            if inst.role == "colocated":
                self.finish(out, out)
            elif inst.role == "prefill":
                self.prefilled(inst, when, out, sim_req)
            else:
                self.finish(self.firsts.pop(rid), out)
        self.wake(inst, when)

    def prefilled(self, inst: InstanceSlot, when: float, out: RequestOutput, sim_req: SimRequest) -> None:
        """A prefill finished at ``when``: the request ends here (an error, or one
        token), or its KV leaves for the decode instance with the least outstanding
        tokens."""
        comp = out.outputs[0]
        rid = out.request_id
        path = self.paths[rid]
        m = out.metrics
        path.first_token = m.first_token_time if m is not None else None
        if comp.finish_reason == "error" or sim_req.output_len <= 1 or comp.finish_reason == "stop":
            assert inst.kv is not None
            inst.kv.release(rid)
            self.finish(out, out)
            return
        dec = min(self.cluster.decode, key=lambda i: (i.outstanding, i.index))
        self.load[rid] = len(out.prompt_token_ids) + sim_req.output_len - 1
        dec.outstanding += self.load[rid]
        assert self.cluster.link is not None
        size = len(out.prompt_token_ids) * self.cluster.model.kv_bytes_per_token
        landing = when + self.cluster.link.transfer_time(size)
        path.decode_instance, path.transfer_start, path.transfer_end = dec.index, when, landing
        self.num_transfers += 1
        self.transfer_bytes += size
        self.firsts[rid] = out
        heapq.heappush(dec.deliveries, landing)
        self.push(landing, _DELIVER, dec.index, out)

    def finish(self, first: RequestOutput, last: RequestOutput) -> None:
        """A request is done: ``first`` is its first instance's output, ``last`` its
        last one's (the same output colocated); record the whole request."""
        rid = first.request_id
        path = self.paths[rid]
        fm, lm = first.metrics, last.metrics
        assert fm is not None and lm is not None
        tokens = list(last.outputs[0].token_ids)
        if last is not first:
            tokens = first.outputs[0].token_ids + tokens
            path.second_token = lm.first_token_time
        comp = last.outputs[0]
        path.first_token = fm.first_token_time
        path.finished, path.output_tokens, path.finish_reason = lm.finished_time, len(tokens), comp.finish_reason
        whole = RequestOutput(
            rid, None, first.prompt_token_ids,
            [CompletionOutput(0, "", tokens, finish_reason=comp.finish_reason, stop_reason=comp.stop_reason)],
            True, first.num_cached_tokens,
            RequestMetrics(fm.arrival_time, fm.first_scheduled_time, fm.first_token_time, lm.finished_time),
        )
        self.metrics.on_finish(whole, self.sims[rid].priority)
        if self.outputs is not None:
            self.outputs.append(whole)

    # ------------------------------------------------------------------ report

    def report(self, wall: float) -> ClusterReport:
        """Check every instance idle and every request done; the run's report.

        Raises:
            InvariantError: a request unfinished, queued, or holding blocks.
        """
        instances = []
        for inst in self.cluster.instances:
            kv = inst.kv
            if inst.inbox or inst.sim.scheduler.has_unfinished() or (kv is not None and kv.num_held):
                raise InvariantError(f"instance {inst.index} ({inst.role}) is not idle at the end of the run")
            instances.append(InstanceReport(inst.index, inst.role, inst.metrics.report(wall),
                                            inst.metrics.prefill_tokens, kv.transferred_tokens if kv else 0,
                                            inst.waits))
        unfinished = [p.request_id for p in self.paths.values() if p.finished is None and p.finish_reason is None]
        if unfinished or self.firsts:
            raise InvariantError(f"requests unfinished at the end of the run: {(unfinished or list(self.firsts))[:5]}")
        return ClusterReport(self.cluster.mode, _merge(self.metrics.report(wall), [i.report for i in instances]),
                             tuple(instances), tuple(self.paths[r.request_id] for r in self.arrivals),
                             self.num_transfers, self.transfer_bytes, tuple(self.outputs or ()))


def _merge(whole: SimReport, parts: list[SimReport]) -> SimReport:
    """``whole`` (the requests' latencies) with the instances' rounds, busy time,
    preemptions and KV usage."""
    busy = sum(p.busy_s for p in parts)
    return attrs.evolve(
        whole, busy_s=busy, num_steps=sum(p.num_steps for p in parts),
        preemptions=sum(p.preemptions for p in parts),
        kv_usage_mean=sum(p.kv_usage_mean * p.busy_s for p in parts) / busy if busy > 0 else 0.0,
        kv_usage_max=max(p.kv_usage_max for p in parts), kv_usage_series=(),
    )
