"""Records of the cluster simulator (``sim/disagg.py``): the KV transfer link, one
request's path through the instances, and the run's report."""

from __future__ import annotations

import attrs

from deepinfer_kit._validators import positive
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.sim.goodput import Goodput, RequestLatency, goodput
from deepinfer_kit.sim.metrics import SimReport

__all__ = ["TransferLink", "RequestPath", "InstanceReport", "ClusterReport", "ROLES"]

#: Instance roles: ``prefill`` and ``decode`` (disaggregated), ``colocated`` (both).
ROLES = ("prefill", "decode", "colocated")


def _non_negative(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"{attribute.name} must be >= 0, got {value!r}")


@attrs.frozen(slots=True)
class TransferLink:
    """The link a prompt's KV crosses from its prefill instance to its decode instance.

    A transfer of ``B`` bytes takes ``B / bandwidth_bytes_per_s + latency_s``. Each
    transfer has the whole bandwidth: concurrent transfers do not share a link (no
    contention is modelled).

    Attributes:
        bandwidth_bytes_per_s: bytes per second of one transfer (for a tensor-parallel
            instance, what its GPUs' NICs carry together: each sends its KV shard).
        latency_s: fixed seconds per transfer (setup, first byte, completion notice).

    Raises:
        ConfigError: a bandwidth that is not > 0 or a negative latency (names the field).
    """

    bandwidth_bytes_per_s: float = attrs.field(validator=positive)
    latency_s: float = attrs.field(default=0.0, validator=_non_negative)

    def transfer_time(self, num_bytes: int) -> float:
        """Seconds to move ``num_bytes``. Pure."""
        return num_bytes / self.bandwidth_bytes_per_s + self.latency_s


@attrs.define(slots=True)
class RequestPath:
    """One request's way through the cluster (virtual seconds), filled as it goes.

    Attributes:
        request_id, arrival, prompt_len, output_len: the workload's request.
        first_instance: the instance that prefilled it (the replica, colocated).
        decode_instance: the instance that decoded the rest; ``None`` colocated, or when
            it ended at its first token.
        first_token: when its first token was sampled (at ``first_instance``: TTFT is
            stamped there); ``None`` for an error.
        transfer_start, transfer_end: its KV transfer (``None`` without one).
        second_token: the decode instance's first token (``None`` without one).
        finished: when its last token was sampled (``None`` until then).
        output_tokens: tokens it produced in all; finish_reason: its completion's.
    """

    request_id: str
    arrival: float
    prompt_len: int
    output_len: int
    first_instance: int
    decode_instance: int | None = None
    first_token: float | None = None
    transfer_start: float | None = None
    transfer_end: float | None = None
    second_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None

    def latency(self) -> RequestLatency:
        """Its TTFT and TPOT (``None`` where there is none, as
        :func:`~deepinfer_kit.sim.goodput.latency_of`). Pure."""
        if self.first_token is None or self.finish_reason == "error":
            return RequestLatency(None, None)
        ttft = self.first_token - self.arrival
        if self.finished is None or self.output_tokens < 2:
            return RequestLatency(ttft, None)
        return RequestLatency(ttft, (self.finished - self.first_token) / (self.output_tokens - 1))


@attrs.frozen(slots=True)
class InstanceReport:
    """One instance's own view of a run.

    Attributes:
        index: its place in the cluster; role: one of :data:`ROLES`.
        report: its :class:`SimReport` (rounds, KV usage, preemptions, and the latencies
            of what it ran: a prefill instance's requests end at their first token; a
            decode instance's arrive when their KV lands, their prompt being the
            transferred prompt plus the first token, and their prefix hits are the
            transferred tokens).
        prefill_tokens: prompt (or recomputed) tokens it computed, as the cost model
            priced them (``StepShape.num_prefill_tokens``; a one-token chunk that
            samples is priced as a decode row, as a decode instance's first chunk is).
        transferred_tokens: prompt tokens whose KV it received (decode instances).
        waits: times it had requests to run and no room for them, its blocks held by
            prompts being sent (prefill instances; each such round is in ``report`` as a
            round of zero seconds).
    """

    index: int
    role: str
    report: SimReport
    prefill_tokens: int
    transferred_tokens: int
    waits: int = 0


@attrs.frozen(slots=True)
class ClusterReport:
    """The result of one cluster run.

    Attributes:
        mode: ``"disaggregated"`` or ``"colocated"``.
        report: the whole requests' :class:`SimReport`: TTFT from arrival to the first
            token at the prefill instance, TPOT from that token to the last one at the
            decode instance (the transfer and the decode instance's queueing included),
            throughput over the run; its rounds, busy seconds and preemptions are the
            instances' sums, its KV usage their busy-time-weighted mean and their max
            (no series).
        instances: each instance's :class:`InstanceReport`, in cluster order.
        requests: each request's :class:`RequestPath`, in arrival order.
        num_transfers, transfer_bytes: KV transfers made and the bytes they moved.
        outputs: with ``keep_outputs``, each whole request's output (prompt, every
            token, the request's times), in finish order; else empty.
    """

    mode: str
    report: SimReport
    instances: tuple[InstanceReport, ...]
    requests: tuple[RequestPath, ...]
    num_transfers: int
    transfer_bytes: int
    outputs: tuple[RequestOutput, ...] = ()

    def goodput(self, ttft_slo_s: float, tpot_slo_s: float, duration_s: float | None = None) -> Goodput:
        """:func:`~deepinfer_kit.sim.goodput.goodput` of this run's requests; its rate
        over ``duration_s``, by default the run's (``report.duration_s``, first arrival
        to last finish: the drain after the last arrival included). Requests that never
        finished count as misses. Pure.

        Raises:
            ConfigError: as :func:`~deepinfer_kit.sim.goodput.goodput`.
        """
        return goodput([p.latency() for p in self.requests], ttft_slo_s, tpot_slo_s,
                       self.report.duration_s if duration_s is None else duration_s, self.report.num_requests)

    @property
    def arrival_span_s(self) -> float:
        """Seconds from the first arrival to the last (0.0 for fewer than two). Pure."""
        return self.requests[-1].arrival - self.requests[0].arrival if len(self.requests) > 1 else 0.0
