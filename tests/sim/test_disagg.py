"""The cluster simulator (sim/disagg.py): disaggregated prefill / decode instances and
colocated replicas on one virtual timeline. Every request finishes with its length and
the very tokens a colocated run gives; TTFT is stamped at the prefill instance; a
decode instance computes no prompt token (unless its own pool preempts); the transfer
time is applied; runs are deterministic and stretches change nothing; every pool is idle
at the end; goodput counts as computed by hand; bad values raise ConfigError naming them.
One colocated replica is exactly the single-engine Simulator."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer_kit.sim import H200, QWEN3_1_7B, AnalyticCost, LengthDist, WorkloadConfig, build_simulator, generate
from deepinfer_kit.sim.cost_tp import LLAMA3_70B, TensorParallel, TensorParallelCost
from deepinfer_kit.sim.disagg import ClusterSimulator, build_colocated, build_disaggregated
from deepinfer_kit.sim.disagg_records import ClusterReport, TransferLink
from deepinfer_kit.sim.metrics import percentile
from deepinfer_kit.sim.goodput import RequestLatency, goodput, latency_of
from deepinfer_kit.sim.records import SimRequest
from deepinfer_kit.testing.sim_cost import COST_MODEL_SUITE

MODEL = QWEN3_1_7B
COST = AnalyticCost(MODEL, H200)
LINK = TransferLink(50e9, 1e-3)
ROOMY = EngineConfig(num_blocks=4000, max_model_len=2048)


def _workload(n: int = 90, rate: float = 60.0, seed: int = 5, output_mean: float = 40) -> list[SimRequest]:
    reqs = generate(WorkloadConfig(
        num_requests=n, rate=rate, seed=seed, shared_fraction=0.3, shared_prefix_len=64, eos_fraction=0.5,
        prompt_len=LengthDist("lognormal", 300, 0.6, 4, 1200),
        output_len=LengthDist("lognormal", output_mean, 0.8, 1, 5 * output_mean)))
    reqs += [SimRequest("one-eos", 0.31, 50, 1, stop_by_eos=True), SimRequest("one-len", 0.32, 70, 1)]
    return reqs


def _disagg(pre: EngineConfig = ROOMY, dec: EngineConfig = ROOMY, link: TransferLink = LINK,
            num_prefill: int = 2, num_decode: int = 2) -> ClusterSimulator:
    return build_disaggregated(pre, dec, COST, MODEL, num_prefill=num_prefill, num_decode=num_decode, link=link)


def _snapshot(report: ClusterReport) -> str:
    """Everything a run reports but its wall time (as text: NaN, a prefill instance's
    TPOT, equals itself there; every float is written exactly)."""
    def strip(r: Any) -> Any:
        return attrs.evolve(r, wall_s=0.0)
    return repr((strip(report.report), tuple(attrs.evolve(i, report=strip(i.report)) for i in report.instances),
                 report.requests, report.num_transfers, report.transfer_bytes, report.outputs))


def _check_idle(cluster: ClusterSimulator) -> None:
    for inst in cluster.instances:
        inst.sim.cache.check_integrity(())
        if inst.kv is not None:
            assert inst.kv.num_held == 0
            inst.kv.inner.check_integrity(())  # the real manager's own idle check
        assert not inst.sim.scheduler.has_unfinished() and not inst.inbox


def test_every_request_finishes_with_its_length_and_the_colocated_tokens() -> None:
    reqs = _workload()
    cluster = _disagg()
    out = cluster.run(reqs, keep_outputs=True)
    colo = build_colocated(ROOMY, COST, MODEL, num_replicas=4).run(reqs, keep_outputs=True)
    assert out.report.num_finished == out.report.num_requests == len(reqs) and out.report.num_errors == 0
    by_id = {r.request_id: r for r in reqs}
    for p in out.requests:
        assert p.output_tokens == by_id[p.request_id].output_len
        assert p.finish_reason == ("stop" if by_id[p.request_id].stop_by_eos else "length")
    tokens = {o.request_id: o.outputs[0].token_ids for o in out.outputs}
    assert tokens == {o.request_id: o.outputs[0].token_ids for o in colo.outputs}
    assert all(len(tokens[r.request_id]) == r.output_len for r in reqs)
    assert out.num_transfers == sum(r.output_len > 1 for r in reqs)
    assert out.transfer_bytes == sum(r.prompt_len for r in reqs if r.output_len > 1) * MODEL.kv_bytes_per_token
    _check_idle(cluster)


def test_ttft_is_stamped_at_the_prefill_instance_and_tpot_runs_to_the_decode_end() -> None:
    out = _disagg().run(_workload())
    roles = [i.role for i in out.instances]
    for p in out.requests:
        assert roles[p.first_instance] == "prefill" and p.first_token is not None and p.finished is not None
        if p.output_len == 1:
            assert p.decode_instance is None and p.transfer_start is None and p.finished == p.first_token
            continue
        assert p.decode_instance is not None and roles[p.decode_instance] == "decode"
        assert p.transfer_start == p.first_token < p.transfer_end <= p.second_token <= p.finished
    ttfts = sorted(p.first_token - p.arrival for p in out.requests)
    assert (out.report.ttft.p50, out.report.ttft.p90) == (percentile(ttfts, 50), percentile(ttfts, 90))
    assert out.report.e2e.p50 > out.report.ttft.p50
    # the prefill instances' own reports see the same first tokens: their requests end there
    firsts = [i.report.ttft.mean * i.report.num_finished for i in out.instances if i.role == "prefill"]
    assert sum(firsts) == pytest.approx(sum(ttfts))


def test_the_router_picks_the_least_outstanding_tokens_ties_to_the_lowest_index() -> None:
    reqs = [SimRequest("a", 0.0, 100, 5), SimRequest("b", 0.0, 50, 5), SimRequest("c", 0.0, 10, 5),
            SimRequest("d", 0.0, 30, 5)]
    out = _disagg().run(reqs)
    # prompts only: 0|0 -> P0 (tie), 100|0 -> P1, 100|50 -> P1, 100|60 -> P1
    assert [p.first_instance for p in out.requests] == [0, 1, 1, 1]
    colo = build_colocated(ROOMY, COST, MODEL, num_replicas=2).run(
        [SimRequest("a", 0.0, 100, 5), SimRequest("b", 0.0, 50, 60), SimRequest("c", 0.0, 10, 5)])
    assert [p.first_instance for p in colo.requests] == [0, 1, 0]  # prompt + max_tokens: 105 vs 110
    # decode instances (2, 3), chosen as each prefill ends (in arrival order here; all still decoding):
    # 0|0 -> 2 (tie), 599|0 -> 3, 599|1049 -> 2, 1608|1049 -> 3
    staggered = [SimRequest("a", 0.0, 100, 500), SimRequest("b", 0.01, 50, 1000), SimRequest("c", 0.02, 10, 1000),
                 SimRequest("d", 0.03, 30, 20)]
    assert [p.decode_instance for p in _disagg().run(staggered).requests] == [2, 3, 2, 3]


def test_decode_instances_compute_no_prompt_token() -> None:
    reqs = _workload()
    out = _disagg().run(reqs)
    pre = [i for i in out.instances if i.role == "prefill"]
    dec = [i for i in out.instances if i.role == "decode"]
    assert all(i.prefill_tokens == 0 and i.report.num_finished > 0 for i in dec)
    moved = sum(r.prompt_len for r in reqs if r.output_len > 1)
    assert sum(i.transferred_tokens for i in dec) == moved
    assert all(i.transferred_tokens == 0 for i in pre)
    colo = build_colocated(ROOMY, COST, MODEL, num_replicas=4).run(reqs)
    for front in (pre, colo.instances):  # every prompt token not hit in a prefix cache, once
        hits = sum(round(i.report.prefix_hit_rate * i.report.prompt_tokens) for i in front)
        assert sum(i.prefill_tokens for i in front) == sum(r.prompt_len for r in reqs) - hits > 0


def test_a_tight_decode_pool_preempts_recomputes_and_still_finishes() -> None:
    tight = EngineConfig(num_blocks=100, max_model_len=1600)
    cluster = _disagg(dec=tight)
    out = cluster.run(_workload(rate=400.0), keep_outputs=True)
    dec = [i for i in out.instances if i.role == "decode"]
    assert sum(i.report.preemptions for i in dec) > 0  # the decode pools' pressure is real
    assert sum(i.prefill_tokens for i in dec) > 0  # a preempted request lost its transferred KV
    moved = sum(p.prompt_len for p in out.requests if p.output_len > 1)
    assert sum(i.transferred_tokens for i in dec) == moved  # ... and none came back on readmission
    assert all(p.output_tokens == p.output_len for p in out.requests)
    _check_idle(cluster)


def test_a_prefill_pool_held_by_outgoing_transfers_waits_for_them() -> None:
    slow = TransferLink(2e8, 0.05)  # about 0.7 s per prompt
    small = EngineConfig(num_blocks=130, max_model_len=2048)  # room for about 6 prompts
    reqs = _workload(40, rate=200.0, output_mean=300)  # decodes outlast the transfers: stretches meet them
    cluster = _disagg(pre=small, link=slow, num_prefill=1)
    out = cluster.run(reqs, keep_outputs=True)
    assert out.report.num_finished == 42 and all(p.output_tokens == p.output_len for p in out.requests)
    assert out.instances[0].waits > 0  # it did wait for its blocks to be sent
    _check_idle(cluster)
    plain = _disagg(pre=small, link=slow, num_prefill=1)
    for inst in plain.instances:
        inst.sim.stretches = False
    assert _snapshot(plain.run(reqs, keep_outputs=True)) == _snapshot(out)  # the decode stretches wait too


def test_a_slower_link_delays_the_first_decode_token_by_the_transfer_time() -> None:
    reqs = [SimRequest(f"r{i}", 10.0 * i, 400 + 100 * i, 30) for i in range(3)]  # one at a time
    fast = _disagg(link=TransferLink(100e9, 1e-4)).run(reqs)
    slow = _disagg(link=TransferLink(1e9, 0.02)).run(reqs)
    per_token = MODEL.kv_bytes_per_token
    for f, s, r in zip(fast.requests, slow.requests, reqs):
        assert f.first_token == s.first_token  # TTFT does not depend on the link
        assert s.transfer_end - s.transfer_start == pytest.approx(r.prompt_len * per_token / 1e9 + 0.02)
        delay = (s.transfer_end - s.transfer_start) - (f.transfer_end - f.transfer_start)
        assert s.second_token - f.second_token == pytest.approx(delay)
        assert delay > 0.05
    assert slow.report.tpot.p50 > fast.report.tpot.p50 and slow.report.ttft == fast.report.ttft


def test_runs_are_deterministic_and_stretches_change_nothing() -> None:
    reqs = _workload(120, rate=80.0)
    tight = EngineConfig(num_blocks=400, max_model_len=2048)
    first = _snapshot(_disagg(dec=tight).run(reqs, keep_outputs=True))
    assert first == _snapshot(_disagg(dec=tight).run(reqs, keep_outputs=True))
    plain = _disagg(dec=tight)
    for inst in plain.instances:
        inst.sim.stretches = False
    assert _snapshot(plain.run(reqs, keep_outputs=True)) == first
    colo = _snapshot(build_colocated(tight, COST, MODEL, num_replicas=3).run(reqs))
    assert colo == _snapshot(build_colocated(tight, COST, MODEL, num_replicas=3).run(reqs))


def test_one_colocated_replica_is_the_simulator() -> None:
    config = EngineConfig(num_blocks=300, max_model_len=2048)
    reqs = _workload()
    ends = build_colocated(config, COST, MODEL, num_replicas=1).run(reqs).requests
    # more requests, arriving exactly as rounds end: taken before the next round, as the Simulator does
    reqs += [SimRequest(f"edge{i}", ends[i].first_token, 90, 12) for i in (3, 20, 40)]
    alone = build_simulator(config, COST, MODEL).run(reqs)
    cluster = build_colocated(config, COST, MODEL, num_replicas=1)
    replica = cluster.run(reqs).instances[0].report
    assert repr(attrs.evolve(replica, wall_s=0.0)) == repr(attrs.evolve(alone, wall_s=0.0))
    _check_idle(cluster)


def test_goodput_counts_as_by_hand() -> None:
    lats = [RequestLatency(0.5, 0.02), RequestLatency(1.5, 0.01), RequestLatency(0.5, 0.05),
            RequestLatency(0.2, None), RequestLatency(None, None), RequestLatency(1.0, 0.03)]
    g = goodput(lats, ttft_slo_s=1.0, tpot_slo_s=0.03, duration_s=2.0, num_requests=8)
    assert (g.num_good, g.num_requests, g.fraction, g.rate_per_s) == (3, 8, 3 / 8, 1.5)
    out = RequestOutput("a", None, [1, 2], [CompletionOutput(0, "", [5, 6, 7, 8, 9], finish_reason="length")],
                        True, metrics=RequestMetrics(1.0, 1.1, 1.25, 1.65))
    assert latency_of(out) == RequestLatency(pytest.approx(0.25), pytest.approx(0.1))
    report = _disagg().run(_workload())
    ttft, tpot = report.report.ttft.p50, report.report.tpot.p50
    by_hand = sum(1 for p in report.requests if p.first_token - p.arrival <= ttft
                  and (p.output_tokens < 2 or (p.finished - p.first_token) / (p.output_tokens - 1) <= tpot))
    g = report.goodput(ttft, tpot)
    assert g.num_good == by_hand and 0 < by_hand < len(report.requests)
    assert g.rate_per_s == pytest.approx(by_hand / report.report.duration_s)
    span = report.requests[-1].arrival - report.requests[0].arrival
    assert report.arrival_span_s == span
    assert report.goodput(ttft, tpot, span).rate_per_s == pytest.approx(by_hand / span)


def test_bad_values_raise_config_error_naming_them() -> None:
    cases = [
        (lambda: TransferLink(0.0), "bandwidth_bytes_per_s must be > 0, got 0.0"),
        (lambda: TransferLink(1e9, -1.0), "latency_s must be >= 0, got -1.0"),
        (lambda: _disagg(num_prefill=0), "num_prefill must be an int >= 1, got 0"),
        (lambda: _disagg(num_decode=-2), "num_decode must be an int >= 1, got -2"),
        (lambda: build_colocated(ROOMY, COST, MODEL, num_replicas=0), "num_replicas must be an int >= 1, got 0"),
        (lambda: _disagg(link=None), "link must be a TransferLink, got None"),
        (lambda: TensorParallel(size=0), "size must be an int >= 1, got 0"),
        (lambda: TensorParallel(bus_bandwidth=-1.0), "bus_bandwidth must be > 0, got -1.0"),
        (lambda: goodput([], 0, 0.1, 1.0), "ttft_slo_s must be > 0, got 0"),
        (lambda: goodput([], 1.0, -0.1, 1.0), "tpot_slo_s must be > 0, got -0.1"),
        (lambda: goodput([RequestLatency(1, 1)], 1.0, 1.0, 1.0, 0), "num_requests must be >= 1"),
        (lambda: ClusterSimulator([build_simulator(ROOMY, COST, MODEL)], ["mixed"], MODEL),
         "roles must be in .*, got 'mixed'"),
        (lambda: ClusterSimulator([build_simulator(ROOMY, COST, MODEL)], ["prefill"], MODEL, LINK),
         "need a prefill and a decode instance"),
        (lambda: _disagg().run([SimRequest("a", 0.0, 8, 4), SimRequest("a", 1.0, 8, 4)]), "got 'a' twice"),
        (lambda: _disagg().run([SimRequest("a", 0.0, 8, 4), SimRequest("b", 0.0, 8, 4, after="a")]),
         "first turns only"),
        (lambda: build_disaggregated(attrs.evolve(ROOMY, speculative={"num_draft": 2}), ROOMY, COST,
                                     MODEL, num_prefill=1, num_decode=1, link=LINK), "prefill_config.speculative"),
    ]
    for make, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            make()


def test_tensor_parallel_cost_divides_the_roofline_and_adds_all_reduces() -> None:
    one = TensorParallelCost(LLAMA3_70B, H200, TensorParallel(1))
    flat = AnalyticCost(LLAMA3_70B, H200)
    four = TensorParallelCost(LLAMA3_70B, H200, TensorParallel(4, 400e9, 1e-5))
    wide = AnalyticCost(LLAMA3_70B, attrs.evolve(H200, memory_bandwidth=4 * 4.3e12, peak_flops=4 * 790e12))
    from deepinfer_kit.sim.records import StepShape

    for shape in (StepShape(0, 64, 64 * 3000, 64, 64 * 3000, 64), StepShape(2048, 0, 2048, 1, 2048 * 2049 // 2, 1)):
        assert one.step_time(shape) == flat.step_time(shape)
        tokens = shape.num_prefill_tokens + shape.num_decode_rows
        comm = 160 * (1e-5 + 1.5 * tokens * 8192 * 2 / 400e9)
        assert four.step_time(shape) == pytest.approx(wide.step_time(shape) + comm)
        assert four.step_time(shape) < flat.step_time(shape)


@pytest.mark.parametrize("check", list(COST_MODEL_SUITE), ids=COST_MODEL_SUITE.ids)
def test_tensor_parallel_cost_conformance(check: Any) -> None:
    """The TP cost passes the CostModel suite (its stretch pricing is step_time's floats)."""
    check(lambda: TensorParallelCost(LLAMA3_70B, H200, TensorParallel(4)))
