"""The server's Prometheus metrics (``GET /metrics``, through ``prometheus_client``):
request and token counters, latency histograms, and the engine's state read at scrape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from deepinfer_kit.cache.tiers.manager import tiered
from deepinfer_kit.outputs import RequestOutput
from deepinfer_kit.serve.async_llm import AsyncLLM, StepTimes

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector(Collector):
    """The engine's state as of the last :meth:`ServerMetrics.refresh` (read at scrape)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.state: dict[str, float] = {}
        self.tiers: dict[str, float] | None = None  # TierStats fields, with KV tiers
        self.steps = StepTimes()

    def collect(self) -> Iterator[Any]:
        """Yield the metric families (called by ``generate_latest``)."""
        s, labels = self.state, [self.model]
        for name, doc in (("num_requests_running", "Sequences in the running set."),
                          ("num_requests_waiting", "Sequences waiting for admission."),
                          ("kv_blocks_used", "KV-cache blocks held by requests."),
                          ("kv_blocks_total", "KV-cache blocks in the pool."),
                          ("kv_cache_usage_perc", "Fraction of KV blocks held (0-1)."),
                          ("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache "
                                                    "over prompt tokens, since start.")):
            g = GaugeMetricFamily(f"deepinfer_{name}", doc, labels=["model_name"])
            g.add_metric(labels, s.get(name, 0.0))
            yield g
        for name, doc in (("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
                          ("prefix_cache_hits", "Prompt tokens found in the prefix cache.")):
            c = CounterMetricFamily(f"deepinfer_{name}", doc, labels=["model_name"])
            c.add_metric(labels, s.get(name, 0.0))
            yield c
        yield from _tier_families(self.tiers, labels)
        steps = self.steps
        h = HistogramMetricFamily("deepinfer_engine_step_seconds", "Duration of one engine round.",
                                  labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, count in zip((*steps.buckets, float("inf")), steps.counts):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        h.add_metric(labels, buckets, steps.total_s)
        yield h


# (metric, help, {label value: TierStats field}) of the KV tiers' counters
_TIERS = (
    ("kv_tier_hits", "KV blocks a request took from a lower tier instead of computing them.",
     "medium", {"host": "host_hits", "disk": "disk_hits"}),
    ("kv_tier_saved", "KV blocks written to a tier.", "medium", {"host": "saved_host", "disk": "saved_disk"}),
    ("kv_tier_evicted", "KV blocks dropped from a tier for room.", "medium",
     {"host": "evicted_host", "disk": "evicted_disk"}),
    ("kv_tier_failures", "Tier reads found damaged or missing, reads late at their deadline, "
     "writes that failed (each recomputed when needed).", "kind",
     {"read": "failed_reads", "late_read": "late_reads", "write": "failed_writes"}),
)


def _tier_families(tiers: dict[str, float] | None, labels: list[str]) -> Iterator[Any]:
    """The KV tiers' counters (nothing without tiers)."""
    if tiers is None:
        return
    for name, doc, key, fields in _TIERS:
        c = CounterMetricFamily(f"deepinfer_{name}", doc, labels=["model_name", key])
        for value, field in fields.items():
            c.add_metric([*labels, value], tiers[field])
        yield c
    for name, doc, field in (("kv_tier_loaded_tokens", "Prompt tokens whose KV came from a lower tier.",
                              "loaded_tokens"),
                             ("kv_tier_refused", "KV blocks the admission policy kept out of the tiers.",
                              "refused")):
        c = CounterMetricFamily(f"deepinfer_{name}", doc, labels=["model_name"])
        c.add_metric(labels, tiers[field])
        yield c
    g = GaugeMetricFamily("deepinfer_kv_answers_held", "Answers of save_prompt requests waiting for "
                          "their prompt's blocks to reach the lowest tier.", labels=["model_name"])
    g.add_metric(labels, tiers["answers_held"])
    yield g


class ServerMetrics:
    """Counters and histograms fed by the endpoints, plus the engine's gauges.

    Names (all labelled ``model_name``): ``deepinfer_request_success_total{finished_reason}``,
    ``deepinfer_prompt_tokens_total``, ``deepinfer_generation_tokens_total``,
    ``deepinfer_time_to_first_token_seconds``, ``deepinfer_inter_token_latency_seconds``,
    ``deepinfer_e2e_request_latency_seconds``, ``deepinfer_engine_step_seconds``,
    ``deepinfer_num_requests_running`` / ``_waiting``, ``deepinfer_kv_blocks_used`` /
    ``_total``, ``deepinfer_kv_cache_usage_perc``, ``deepinfer_prefix_cache_queries_total`` /
    ``_hits_total``, ``deepinfer_prefix_cache_hit_rate``, ``deepinfer_http_requests_total{status}``;
    with KV tiers also ``deepinfer_kv_tier_hits_total{medium}``, ``_saved_total{medium}``,
    ``_evicted_total{medium}``, ``_failures_total{kind}``, ``_loaded_tokens_total``,
    ``_refused_total`` and ``deepinfer_kv_answers_held``.
    A registry of its own: several apps in one process do not collide.
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.finished = Counter("deepinfer_request_success", "Requests finished, by finish reason.",
                                [*m, "finished_reason"], registry=r)
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "Prompt tokens of finished requests.",
                                     m, registry=r)
        self.generation_tokens = Counter("deepinfer_generation_tokens",
                                         "Generated tokens of finished requests.", m, registry=r)
        self.http = Counter("deepinfer_http_requests", "HTTP requests answered, by status.",
                            [*m, "status"], registry=r)
        self.ttft = Histogram("deepinfer_time_to_first_token_seconds",
                              "Arrival to first generated token.", m, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("deepinfer_inter_token_latency_seconds",
                             "Mean time between output tokens of a request (one observation per "
                             "token after the first).", m, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("deepinfer_e2e_request_latency_seconds", "Arrival to finish.", m,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self._engine = _EngineCollector(model)
        r.register(self._engine)

    def observe_reason(self, reason: str | None) -> None:
        """Count one finished completion under its finish reason."""
        self.finished.labels(self.model, reason or "unknown").inc()

    def observe_finished(self, out: RequestOutput, lengths: list[int] | None = None) -> None:
        """Count one finished request: its tokens and latencies, and (``lengths`` not
        given) its completions' finish reasons.

        Args:
            out: its last output (cumulative, or a stream's last delta).
            lengths: the tokens of each completion, when ``out`` holds deltas only (the
                stream then counts each completion's reason as it finishes).
        """
        m = self.model
        if lengths is None:
            for c in out.outputs:
                self.observe_reason(c.finish_reason)
            lengths = [len(c.token_ids) for c in out.outputs]
        generated = sum(lengths)
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        self.generation_tokens.labels(m).inc(generated)
        t = out.metrics
        if t is None:
            return
        if t.first_token_time is not None:
            self.ttft.labels(m).observe(max(0.0, t.first_token_time - t.arrival_time))
        if t.finished_time is not None:
            self.e2e.labels(m).observe(max(0.0, t.finished_time - t.arrival_time))
            longest = max(lengths, default=0)
            if t.first_token_time is not None and longest > 1:
                gap = max(0.0, t.finished_time - t.first_token_time) / (longest - 1)
                for _ in range(min(longest - 1, 4096)):
                    self.itl.labels(m).observe(gap)

    def observe_http(self, status: int) -> None:
        """Count one answered HTTP request."""
        self.http.labels(self.model, str(status)).inc()

    async def render(self, llm: AsyncLLM) -> bytes:
        """The exposition text, after reading the engine's state on its thread."""
        self._engine.state, self._engine.tiers, self._engine.steps = await llm.call(lambda: _snapshot(llm))
        return bytes(generate_latest(self.registry))


def _snapshot(llm: AsyncLLM) -> tuple[dict[str, float], dict[str, float] | None, StepTimes]:
    """Engine gauges, the KV tiers' counters (None without tiers) and the step histogram;
    runs on the engine thread."""
    engine = llm.engine
    total = engine.cache.num_blocks
    used = total - engine.cache.num_free_blocks
    queries, hits = engine.num_prompt_tokens, engine.num_cached_prompt_tokens
    sched: Any = engine.scheduler
    state = {
        "num_requests_running": float(sched.num_running),
        "num_requests_waiting": float(sched.num_waiting),
        "kv_blocks_used": float(used), "kv_blocks_total": float(total),
        "kv_cache_usage_perc": used / total if total else 0.0,
        "prefix_cache_queries": float(queries), "prefix_cache_hits": float(hits),
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
    }
    stats = getattr(tiered(engine.cache), "tier_stats", None)
    tiers = None
    if stats is not None:
        tiers = {k: float(v) for k, v in attrs.asdict(stats).items()}
        tiers["answers_held"] = float(llm.num_answers_held)
    return state, tiers, llm.step_times.copy()
