"""``deepinfer-kit sim``: simulate a workload (flags or a file), optionally sweeping one
EngineConfig field; print a table, write CSV / JSON / PNG."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_sim_parser", "run_sim_command"]


def add_sim_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the ``sim`` subcommand and its flags on ``sub``. Mutates ``sub``."""
    from deepinfer_kit.cli_engine import add_component_option

    p = sub.add_parser("sim", help="simulate a workload on the real scheduler and cache")
    w = p.add_argument_group("workload (ignored with --workload FILE.jsonl)")
    w.add_argument("--workload", help="a JSONL trace, or a JSON object of WorkloadConfig fields")
    w.add_argument("--num-requests", type=int, default=2000)
    w.add_argument("--arrival", choices=("poisson", "bursty", "batch"), default="poisson")
    w.add_argument("--rate", type=float, default=20.0, help="first turns per second")
    w.add_argument("--burst-size", type=float, default=8.0)
    w.add_argument("--prompt-len", default="lognormal:500:0.6:8:8000",
                   help="KIND:MEAN[:SPREAD[:MIN[:MAX]]] or a number")
    w.add_argument("--output-len", default="lognormal:200:0.6:1:4000")
    w.add_argument("--shared-fraction", type=float, default=0.3)
    w.add_argument("--shared-prefix-len", type=int, default=256)
    w.add_argument("--multi-turn-fraction", type=float, default=0.0)
    w.add_argument("--turns", type=int, default=3)
    w.add_argument("--think-time", type=float, default=5.0)
    w.add_argument("--eos-fraction", type=float, default=0.5)
    w.add_argument("--priority-levels", type=int, default=1)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--save-trace", help="write the generated workload as JSONL")
    e = p.add_argument_group("engine (any EngineConfig field with --set)")
    e.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    add_component_option(e)
    e.add_argument("--kv-cache-memory-mb", type=int, default=40 * 1024)
    e.add_argument("--max-model-len", type=int, default=16384)
    e.add_argument("--sweep", metavar="FIELD=V1,V2,...", help="sweep one EngineConfig field")
    c = p.add_argument_group("cost model")
    c.add_argument("--cost", default="analytic",
                   help="'analytic' (Qwen3-1.7B on an H200), 'profiled' (fit the tiny model "
                        "on this CPU now), or a JSON file of ProfiledCost coefficients")
    c.add_argument("--step-overhead-ms", type=float, default=None,
                   help="per-round overhead of the analytic GPU (default 0.3)")
    c.add_argument("--sliding-window", type=int, default=None,
                   help="analytic model: the window of its sliding layers (with --sliding-layers)")
    c.add_argument("--sliding-layers", type=int, default=0,
                   help="analytic model: how many of its 28 layers slide (Gemma 3 slides 5 in 6)")
    x = p.add_argument_group("experts (a simulated MoE router and placement policy; on with "
                             "--eplb-policy or an eplb.* sweep)")
    x.add_argument("--eplb-policy", default=None,
                   help="deepseek, global, refine, forecast, movement or peak")
    x.add_argument("--eplb-interval", type=int, default=32, help="steps between rebalances")
    x.add_argument("--eplb-window", type=int, default=32, help="steps of counts a plan reads")
    x.add_argument("--eplb-gpus", type=int, default=8)
    x.add_argument("--eplb-nodes", type=int, default=1)
    x.add_argument("--eplb-redundant", type=int, default=8, help="redundant slots per layer")
    x.add_argument("--num-experts", type=int, default=64)
    x.add_argument("--top-k", type=int, default=8)
    x.add_argument("--moe-layers", type=int, default=None, help="default: the model's layers")
    x.add_argument("--zipf-exponent", type=float, default=1.0)
    x.add_argument("--drift-correlation", type=float, default=0.98)
    x.add_argument("--drift-every", type=int, default=32, help="routed steps between drifts")
    x.add_argument("--moe-fraction", type=float, default=0.5,
                   help="share of a balanced step's time in the routed experts")
    o = p.add_argument_group("output")
    o.add_argument("--csv")
    o.add_argument("--json")
    o.add_argument("--plot", help="PNG of the sweep (needs matplotlib)")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: on for 5,000 requests or more)")


def run_sim_command(args: argparse.Namespace) -> int:
    """Run the ``sim`` subcommand; returns the exit status.

    Raises:
        ConfigError: a bad flag value, workload file, cost file or sweep (the caller
            prints it).
    """
    import attrs

    from deepinfer_kit.cli_engine import components_of
    from deepinfer_kit.engine.config import EngineConfig
    from deepinfer_kit.errors import ConfigError
    from deepinfer_kit.sim.cost_analytic import H200, QWEN3_1_7B, TINY, AnalyticCost
    from deepinfer_kit.sim.cost_profiled import ProfiledCost
    from deepinfer_kit.sim.expert_records import ExpertRouting
    from deepinfer_kit.sim.lengths import LengthDist
    from deepinfer_kit.sim.protocols import CostModel
    from deepinfer_kit.sim.sweep import (
        format_priority_table, format_table, parse_sweep, parse_value, plot_sweep, run_sweep,
        with_field, write_csv, write_json,
    )
    from deepinfer_kit.sim.trace_io import read_trace, write_trace
    from deepinfer_kit.sim.workload import WorkloadConfig, generate

    if args.workload and args.workload.endswith(".jsonl"):
        requests = read_trace(args.workload)
    else:
        fields: dict[str, object] = dict(
            num_requests=args.num_requests, arrival=args.arrival, rate=args.rate,
            burst_size=args.burst_size, prompt_len=LengthDist.parse(args.prompt_len),
            output_len=LengthDist.parse(args.output_len), shared_fraction=args.shared_fraction,
            shared_prefix_len=args.shared_prefix_len,
            multi_turn_fraction=args.multi_turn_fraction, turns=args.turns,
            think_time=args.think_time, eos_fraction=args.eos_fraction,
            priority_levels=args.priority_levels, seed=args.seed,
        )
        if args.workload:
            try:
                with open(args.workload, encoding="utf-8") as f:
                    fields.update(json.load(f))
            except (OSError, ValueError) as exc:
                raise ConfigError(f"--workload {args.workload!r}: {exc}") from exc
        requests = generate(WorkloadConfig.from_dict(fields))
    if args.save_trace:
        write_trace(requests, args.save_trace)
    cost: CostModel
    model = QWEN3_1_7B
    if args.cost == "analytic":
        gpu = H200
        if args.step_overhead_ms is not None:
            gpu = attrs.evolve(gpu, step_overhead_s=args.step_overhead_ms / 1e3)
        model = attrs.evolve(model, sliding_window=args.sliding_window, sliding_layers=args.sliding_layers)
        cost = AnalyticCost(model, gpu)
    elif args.cost == "profiled":
        from deepinfer_kit.sim.profile import profile_cost

        cost, model = profile_cost(), TINY
        print(f"profiled cost: {cost}", file=sys.stderr)
    else:
        try:
            with open(args.cost, encoding="utf-8") as f:
                cost = ProfiledCost.from_dict(json.load(f))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--cost must be analytic, profiled or a JSON file: {exc}") from exc
    config = EngineConfig(kv_cache_memory_mb=args.kv_cache_memory_mb,
                          max_model_len=min(args.max_model_len, model.max_position_embeddings))
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set must read FIELD=VALUE, got {item!r}")
        config = with_field(config, name.strip(), parse_value(value))
    field, values = parse_sweep(args.sweep) if args.sweep else (None, [])
    routing = None
    if args.eplb_policy is not None or (field or "").startswith("eplb."):
        config = with_field(config, "eplb", {
            "policy": args.eplb_policy or "deepseek", "interval": args.eplb_interval,
            "window": args.eplb_window, "num_gpus": args.eplb_gpus,
            "num_nodes": args.eplb_nodes, "num_redundant": args.eplb_redundant})
        routing = ExpertRouting(
            num_layers=args.moe_layers or model.num_layers, num_experts=args.num_experts,
            top_k=args.top_k, exponent=args.zipf_exponent, correlation=args.drift_correlation,
            drift_every=args.drift_every, moe_fraction=args.moe_fraction, seed=args.seed)
    progress = args.progress if args.progress is not None else len(requests) >= 5000
    parts = components_of(args)  # --component cost_model=... replaces --cost
    rows = run_sweep(config, field, values, requests, None if parts and parts.cost_model else cost, model,
                     seed=args.seed, progress=progress, routing=routing, components=parts)
    print(format_table(field, rows))
    by_priority = format_priority_table(field, rows)
    if by_priority:
        print("\nper priority level (ms):\n" + by_priority)
    if args.csv:
        write_csv(args.csv, field, rows)
    if args.json:
        write_json(args.json, field, rows)
    if args.plot:
        plot_sweep(args.plot, field, rows)
    return 0
