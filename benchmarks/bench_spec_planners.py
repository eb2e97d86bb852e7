"""The verify-length planner study (issue 16, part b), on the simulator.

The real scheduler and KV cache manager, the engine's drafting phase (``Speculation``)
and the real planners (``spec/planners.py``), with no model: a saturating cost model
(Qwen3-1.7B's weights and FLOPs on an H200, KV traffic left out: ``SaturatingCost``), a
synthetic drafter whose confidences are calibrated (``sim/acceptance.py``), and a closed
loop — ``C`` requests always in flight (``max_num_seqs = C``, the next request admitted
when one finishes). For each concurrency ``C`` it runs plain decoding, fixed γ in
{1, 2, 4, 8}, a static survival threshold, DSpark (γ = 8 drafted, the planner picks
ℓ_r from the SPS curve profiled from the same cost model) and its asynchronous variant
(each request's previous round's confidences, as an overlapped engine would plan), and prints steady-state output
tokens/s (virtual time, from the start until the last request is admitted: every slot
busy, prefills included), mean per-request
tokens/s (each request's tokens over its time from first scheduled to last token), their
ratios against plain decoding in the same run, the mean acceptance length (tokens per
verify round) and the mean verified drafts per request and round — then checks the
issue's targets and prints PASS / FAIL.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_spec_planners.py            # the study
    PYTHONPATH=src .venv/bin/python benchmarks/bench_spec_planners.py --quick    # a smoke run
    PYTHONPATH=src .venv/bin/python benchmarks/bench_spec_planners.py --staircase
        # rounds padded to captured sizes, beside DeepInfer's rule (benchmarks/spec_staircase.py;
        # its sdist from --deepinfer PATH, $DEEPINFER_SRC or /tmp/deepinfer/deepinfer-0.1.0)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import attrs

from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.sched.records import SchedulePlan
from deepinfer_kit.sim import H200, QWEN3_1_7B, SimRequest, Simulator, build_simulator
from deepinfer_kit.sim.acceptance import AcceptanceModel
from deepinfer_kit.sim.cost_saturating import SaturatingCost, profile_sps
from deepinfer_kit.sim.spec_build import build_spec_simulator
from deepinfer_kit.sim.protocols import CostModel
from deepinfer_kit.sim.spec_runner import check_idle
from deepinfer_kit.spec.planners import DSparkPlanner, FixedPlanner, ThresholdPlanner
from deepinfer_kit.spec.protocols import VerifyPlanner
from deepinfer_kit.spec.records import SpsCurve
from deepinfer_kit.step import StepResult

FIXED = (1, 2, 4, 8)
GAMMA_MAX = 8
PROMPT_LEN = 64
ASYNC = "dspark async (last round's c)"  # plans from each request's previous confidences


@attrs.define
class Tally:
    """What the observer collects from one run."""

    C: int
    rounds: list[tuple[float, float, int]] = attrs.field(factory=list)  # start, end, tokens
    verified_chunks: int = 0
    drafted: int = 0
    accepted: int = 0
    first: dict[str, float] = attrs.field(factory=dict)
    last: dict[str, float] = attrs.field(factory=dict)
    tokens: dict[str, int] = attrs.field(factory=dict)

    def __call__(self, plan: SchedulePlan, result: StepResult, start: float, end: float) -> None:
        emitted = 0
        for chunk, toks in zip(plan.all_chunks(), result.token_ids):
            rid = chunk.request_id
            self.first.setdefault(rid, start)
            if toks:
                self.last[rid] = end
                self.tokens[rid] = self.tokens.get(rid, 0) + len(toks)
                emitted += len(toks)
        for d, a in zip(result.num_drafted, result.num_accepted):
            if d:
                self.verified_chunks += 1
                self.drafted += d
                self.accepted += a
        self.rounds.append((start, end, emitted))

    def row(self) -> dict[str, float]:
        per_req = [n / (self.last[r] - self.first[r]) for r, n in self.tokens.items()
                   if self.last[r] > self.first[r]]
        vc = max(1, self.verified_chunks)
        # Closed-loop steady state: every slot is busy until the last request is admitted;
        # the rounds after it drain the pool at falling concurrency and are left out.
        last_admit = max(self.first.values())
        busy = [(e, n) for s, e, n in self.rounds if s < last_admit]
        busy_time = busy[-1][0] if busy else 0.0
        return {
            "tok_s": sum(n for _, n in busy) / busy_time if busy_time else 0.0,
            "req_tok_s": sum(per_req) / len(per_req) if per_req else 0.0,
            "accept_len": 1.0 + self.accepted / vc if self.verified_chunks else 1.0,
            "verified": self.drafted / vc if self.verified_chunks else 0.0,
        }


def workload(C: int, waves: int, output_len: int) -> list[SimRequest]:
    """``C * waves`` requests arriving at once; ``max_num_seqs = C`` keeps C in flight."""
    return [SimRequest(f"c{C}-{i}", 0.0, PROMPT_LEN, output_len) for i in range(C * waves)]


def engine_config(C: int, output_len: int) -> EngineConfig:
    blocks_per_seq = (PROMPT_LEN + output_len + GAMMA_MAX + 15) // 16 + 1
    return EngineConfig(
        max_num_seqs=C, max_num_batched_tokens=max(2048, C * (1 + GAMMA_MAX) + PROMPT_LEN),
        num_blocks=C * blocks_per_seq + 64, block_size=16,
        max_model_len=PROMPT_LEN + output_len + GAMMA_MAX + 16,
        enable_prefix_caching=False,
    )


def methods(sps: SpsCurve, threshold: float) -> list[tuple[str, VerifyPlanner | None, int]]:
    out: list[tuple[str, VerifyPlanner | None, int]] = [("plain", None, 0)]
    out += [(f"fixed γ={g}", FixedPlanner(g), g) for g in FIXED]
    out.append((f"threshold {threshold:g}", ThresholdPlanner(threshold), GAMMA_MAX))
    out.append(("dspark", DSparkPlanner(sps), GAMMA_MAX))
    out.append((ASYNC, DSparkPlanner(sps), GAMMA_MAX))
    return out


def run_one(C: int, planner: VerifyPlanner | None, gamma: int, acceptance: AcceptanceModel,
            cost: CostModel, waves: int, output_len: int, *,
            lagged: bool = False) -> dict[str, float]:
    config = engine_config(C, output_len)
    sim: Simulator
    if planner is None:
        sim = build_simulator(config, cost, QWEN3_1_7B, seed=0)
    else:
        sim, _ = build_spec_simulator(config, cost, QWEN3_1_7B, acceptance=acceptance,
                                      planner=planner, num_draft=gamma, seed=0, lagged=lagged)
    tally = Tally(C)
    sim.run(workload(C, waves, output_len), observer=tally)
    check_idle(sim)
    return tally.row()


def check(label: str, ok: bool, detail: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'}  {label}: {detail}")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="C up to 16, short outputs")
    ap.add_argument("--max-concurrency", type=int, default=256)
    ap.add_argument("--waves", type=int, default=3, help="requests per slot")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--miscalibrated", type=float, default=0.3,
                    help="confidence power of an extra overconfident DSpark row (0: off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--staircase", action="store_true",
                    help="rounds padded to captured sizes, beside DeepInfer's rule")
    ap.add_argument("--cases", type=int, default=1000, help="--staircase: random staircases of part 1")
    ap.add_argument("--deepinfer", default=None, help="the unpacked deepinfer 0.1.0 sdist")
    args = ap.parse_args(argv)
    max_c, waves, out_len = args.max_concurrency, args.waves, args.output_len
    if args.quick:
        max_c, waves, out_len = min(max_c, 16), 2, 32
    if args.staircase:
        return staircase(args, max_c, waves, out_len)
    cost = SaturatingCost.from_shape(QWEN3_1_7B, H200)
    # up to every token a round can hold, prefill included: the curve is flat past its end
    sps = profile_sps(cost, 2 * engine_config(max_c, out_len).max_num_batched_tokens)
    acceptance = AcceptanceModel(seed=args.seed)
    table = methods(sps, args.threshold)
    if args.miscalibrated > 0:
        table.append((f"dspark overconfident (c^{args.miscalibrated:g})", DSparkPlanner(sps),
                      GAMMA_MAX))
    print(f"cost: Qwen3-1.7B on H200, weights {cost.memory_s * 1e3:.3f} ms, "
          f"{(cost.token_s + cost.row_s) * 1e6:.2f} us/token, overhead "
          f"{cost.overhead_s * 1e3:.1f} ms, knee at B = {cost.knee_tokens:.0f} tokens; "
          f"prompt {PROMPT_LEN}, output {out_len}, {waves} requests per slot")
    levels = []
    c = 1
    while c <= max_c:
        levels.append(c)
        c *= 2
    results: dict[tuple[int, str], dict[str, float]] = {}
    t0 = time.perf_counter()
    for C in levels:
        print(f"\nC = {C}")
        for name, planner, gamma in table:
            acc = acceptance
            if name.startswith("dspark overconfident"):
                acc = AcceptanceModel(seed=args.seed, confidence_power=args.miscalibrated)
            row = run_one(C, planner, gamma, acc, cost, waves, out_len, lagged=name == ASYNC)
            results[(C, name)] = row
            base = results[(C, "plain")]
            print(f"  {name:<30} {row['tok_s']:>10,.0f} tok/s x{row['tok_s'] / base['tok_s']:.2f}"
                  f"  per-request {row['req_tok_s']:>7,.0f} tok/s x"
                  f"{row['req_tok_s'] / base['req_tok_s']:.2f}"
                  f"  accept len {row['accept_len']:.2f}  verified/req {row['verified']:.2f}")
    print(f"\n({time.perf_counter() - t0:.1f} s wall)")
    ok = True
    past = [C for C in levels if C >= cost.knee_tokens]
    for g in FIXED:
        below = [C for C in levels if results[(C, f"fixed γ={g}")]["tok_s"] < results[(C, "plain")]["tok_s"]]
        ok &= check(f"fixed γ={g} below plain past saturation",
                    bool(past) and all(C in below for C in past),
                    f"below plain at C = {below or 'none'}; past the knee: {past or 'no level'}")
    worst = min(levels, key=lambda C: results[(C, "dspark")]["tok_s"] / results[(C, "plain")]["tok_s"])
    r = results[(worst, "dspark")]["tok_s"] / results[(worst, "plain")]["tok_s"]
    ok &= check("DSpark never below plain", r >= 1.0, f"lowest ratio x{r:.3f} at C = {worst}")
    short = []
    for C in levels:
        best = max(results[(C, f"fixed γ={g}")]["tok_s"] for g in FIXED)
        if results[(C, "dspark")]["tok_s"] < best:
            short.append(f"C={C}: x{results[(C, 'dspark')]['tok_s'] / best:.3f}")
    ok &= check("DSpark >= best fixed γ at each C", not short,
                "at every level" if not short else ", ".join(short))
    return 0 if ok else 1


def staircase(args: argparse.Namespace, max_c: int, waves: int, out_len: int) -> int:
    """``--staircase``: the rule on random staircases, then serving on a padded cost
    (``spec_staircase``), DeepInfer's rule beside the kit's when its sdist is found."""
    import deepinfer_peer
    import spec_staircase as st

    root = deepinfer_peer.find_sdist(args.deepinfer)
    schedule = deepinfer_peer.load_planner(root) if root is not None else None
    if schedule is None:
        print(deepinfer_peer.missing(args.deepinfer) if root is None else
              "DeepInfer rows skipped: no C++ compiler to build its planner rule")
    st.rule_rows(min(args.cases, 100) if args.quick else args.cases, args.seed, schedule)
    cost, sps = st.padded_cost()
    print(f"\nserving, rounds padded to {list(st.CAPTURED)} tokens: step ms "
          + ", ".join(f"{b}: {1e3 / v:.2f}" for b, v in zip(sps.batch_tokens, sps.steps_per_second)))
    table: list[tuple[str, VerifyPlanner | None, int]] = [
        ("plain", None, 0), ("fixed γ=4", FixedPlanner(4), 4),
        ("dspark early stop (before)", st.EarlyStop(sps), GAMMA_MAX),  # type: ignore[list-item]
        ("dspark whole walk", DSparkPlanner(sps), GAMMA_MAX),
    ]
    if schedule is not None:
        table.append(("DeepInfer MTPVarlen::schedule", st.DeepInferPlanner(schedule, sps), GAMMA_MAX))  # type: ignore[arg-type]
    acceptance = AcceptanceModel(seed=args.seed)
    ok, C = True, 4
    while C <= max_c:
        print(f"C = {C}")
        base = 0.0
        rows: dict[str, float] = {}
        for name, planner, gamma in table:
            row = run_one(C, planner, gamma, acceptance, cost, waves, out_len)
            base = base or row["tok_s"]
            rows[name] = row["tok_s"]
            print(f"  {name:<32} {row['tok_s']:>10,.0f} tok/s x{row['tok_s'] / base:.2f}"
                  f"  accept len {row['accept_len']:.2f}  verified/req {row['verified']:.2f}")
        peer = rows.get("DeepInfer MTPVarlen::schedule")
        if peer is not None:
            ok &= rows["dspark whole walk"] >= 0.99 * peer
        C *= 4
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
