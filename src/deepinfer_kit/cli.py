"""The ``deepinfer-kit`` command: ``generate`` and ``trace`` on a checkpoint or the tiny model;
``sim`` on the real scheduler and cache with a cost model; ``serve`` (an OpenAI-compatible
server) and ``pd-proxy`` (a router over prefill and decode servers)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from deepinfer_kit.cli_engine import add_engine_options, add_parallel_options, components_of, engine_config
from deepinfer_kit.errors import ConfigError, DeepInferError

if TYPE_CHECKING:
    from deepinfer_kit.engine.engine import Engine
    from deepinfer_kit.sample.params import SamplingParams

__all__ = ["main", "build_parser", "engine_config"]

DEFAULT_PROMPTS = (
    "The paged KV cache stores each request's keys and values in fixed-size blocks.",
    "The paged KV cache stores each request's keys and values so that prefixes are shared.",
    "Continuous batching admits new requests every round.",
    "A mixture-of-experts layer routes every token to a few experts.",
)


_HTML_BLOCKS = 48  # a pool the viewer can draw cell by cell


def _add_common(p: argparse.ArgumentParser) -> None:
    add_engine_options(p)
    add_parallel_options(p)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: built-in prompts")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per prompt (default 64)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--logprobs", type=int, default=None,
                   help="return this many top logprobs per token (prints the cumulative logprob)")
    p.add_argument("--stop", action="append", default=None,
                   help="a stop string (repeatable); the text is cut before it")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``deepinfer-kit`` command."""
    parser = argparse.ArgumentParser(prog="deepinfer-kit", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    gen = sub.add_parser("generate", help="generate completions and print a summary")
    _add_common(gen)
    trace = sub.add_parser("trace", help="print one request's path through the engine, step by step")
    _add_common(trace)
    trace.add_argument("--request", type=int, default=0, help="index of the prompt to follow")
    trace.add_argument(
        "--html", default=None, metavar="PATH",
        help="also write a self-contained step-through viewer of the run (one HTML file); "
        f"without --num-blocks the pool is then {_HTML_BLOCKS} blocks, and --logprobs defaults to 5",
    )
    trace.add_argument("--json", default=None, metavar="PATH",
                       help="also write the run's trace document (docs/trace_schema.md)")
    trace.add_argument("--heatmap", default=None,
                       help="with --eplb-interval: also write the first rebalance's heatmaps to this PNG "
                            "(needs matplotlib)")
    from deepinfer_kit.sim.command import add_sim_parser

    add_sim_parser(sub)
    from deepinfer_kit.serve.command import add_serve_options

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the 'serve' extra)")
    add_engine_options(serve)
    add_parallel_options(serve, tensor_parallel_size=False)  # serve has its own -tp
    add_serve_options(serve)
    proxy = sub.add_parser("pd-proxy", help="route each completion to a prefill server, then a decode server "
                                            "(`serve --kv-role`; needs the 'serve' extra)")
    proxy.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="URL",
                       help="prefill servers (round robin; repeat the flag or list several)")
    proxy.add_argument("--decode", nargs="+", action="extend", required=True, metavar="URL",
                       help="decode servers (round robin, or the one on the link a prefill answer names)")
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, default=8000)
    return parser


def _engine_and_params(args: argparse.Namespace) -> tuple[Engine, SamplingParams, list[str]]:
    """The engine, the sampling parameters and the prompts the arguments describe.

    Heavy imports happen here, so ``deepinfer-kit --help`` stays fast.
    """
    from deepinfer_kit.engine.build import build_engine
    from deepinfer_kit.sample.params import SamplingParams

    num_blocks, max_model_len = args.num_blocks, args.max_model_len
    if getattr(args, "html", None) and num_blocks is None:
        num_blocks = _HTML_BLOCKS
        max_model_len = max_model_len or num_blocks * args.block_size
    config = engine_config(args, num_blocks=num_blocks, max_model_len=max_model_len)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        n=args.n,
        logprobs=args.logprobs if args.logprobs is not None or not getattr(args, "html", None) else 5,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    prompts = list(args.prompt) if args.prompt else list(DEFAULT_PROMPTS)
    return build_engine(config, components=components_of(args)), params, prompts


def _generate(args: argparse.Namespace) -> int:
    engine, params, prompts = _engine_and_params(args)
    start = time.perf_counter()
    ids = [engine.add_request(None, p, params) for p in prompts]
    finished = {o.request_id: o for o in engine.run()}
    elapsed = time.perf_counter() - start
    tokens = 0
    for rid in ids:
        out = finished[rid]
        for c in out.outputs:
            tokens += len(c.token_ids)
            name = rid if c.index == 0 else f"{rid}#{c.index}"
            why = c.finish_reason if c.stop_reason is None else f"{c.finish_reason} {c.stop_reason!r}"
            logprob = "" if c.cumulative_logprob is None else f", logprob {c.cumulative_logprob:.3f}"
            print(f"[{name}] {out.prompt!r} -> {c.text!r} ({len(c.token_ids)} tokens, {why}{logprob})")
    prompt_tokens = engine.num_prompt_tokens
    hit = engine.num_cached_prompt_tokens / prompt_tokens if prompt_tokens else 0.0
    print(
        f"requests={len(ids)} output_tokens={tokens} time={elapsed:.2f}s "
        f"tokens/s={tokens / elapsed if elapsed > 0 else 0.0:.1f} prefix_hit_rate={hit:.1%}"
    )
    return 0


def _trace(args: argparse.Namespace) -> int:
    from deepinfer_kit.engine.trace import StepTrace, describe_rank, token_timeline

    engine, params, prompts = _engine_and_params(args)
    if not 0 <= args.request < len(prompts):
        print(f"error: --request must be in [0, {len(prompts)}), got {args.request}", file=sys.stderr)
        return 2
    from deepinfer_kit.viewer import TraceRecorder, write_html

    traces: list[StepTrace] = []
    engine.subscribe(traces.append)
    # The recorder reads the whole pool every step: only when a document is asked for.
    recorder = TraceRecorder.attach(engine, model=args.model) if args.html or args.json else None
    ids = [engine.add_request(None, p, params) for p in prompts]
    finished = {o.request_id: o for o in engine.run()}
    target = ids[args.request]
    print(f"following {target}: {prompts[args.request]!r}")
    for t in traces:
        mine = [c for c in t.chunks if c.request_id == target or c.request_id.startswith(target + "#")]
        done = [f for f in t.finished if f == target or f.startswith(target + "#")]
        if not mine and not done and target not in t.preempted:
            continue
        print(
            f"step {t.step_id}: batch {len(t.chunks)} requests, {t.num_batched_tokens}/{t.token_budget} "
            f"tokens, free blocks {t.free_blocks_before}->{t.free_blocks_after}, "
            f"execute {t.execute_s * 1e3:.1f} ms"
            + (f"; its tokens committed in step {t.committed_in}" if t.committed_in != t.step_id else "")
        )
        for c in mine:
            print(
                f"  {c.kind:7s} positions [{c.start}, {c.start + c.num_tokens}) cached={c.num_cached_tokens} "
                f"blocks={c.num_blocks} sampled={list(c.sampled)}"
                + (f" drafted={c.num_drafted} accepted={c.num_accepted}" if c.num_drafted else "")
            )
        for stats in t.ranks:
            print(f"  {describe_rank(stats)}")
        if t.slot_counts is not None and engine.balancer is not None:
            gpus = engine.balancer.topology.num_gpus
            per = [[sum(row[g * len(row) // gpus:(g + 1) * len(row) // gpus]) for g in range(gpus)]
                   for row in t.slot_counts]
            print(f"  expert copies per GPU, per MoE layer: {per}")
        if target in t.preempted:
            print("  preempted (blocks released; will recompute)")
        for f in done:
            print(f"  finished: {f}")
    print("its tokens (output index: id, the step that sampled it, the step that committed it):")
    for index, tok, sampled, committed in token_timeline(traces, target, finished[target].outputs[0].token_ids):
        late = f"committed in step {committed}" if committed is not None else "discarded (never committed)"
        print(f"  {index}: {tok} sampled in step {sampled}, {late}")
    if recorder is not None and args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            out.write(recorder.to_json(indent=1))
        print(f"wrote the trace of {len(traces)} steps to {args.json}")
    if recorder is not None and args.html:
        write_html(recorder, args.html)
        print(f"wrote a step-through viewer of {len(traces)} steps to {args.html}")
    _print_rebalance(engine, args.heatmap)
    return 0


def _print_rebalance(engine: Engine, png: str | None) -> None:
    """The expert load per GPU before and after the engine's first rebalance (text, and a
    PNG at ``png`` when given and matplotlib is installed)."""
    from deepinfer_kit.eplb.heatmap import save_heatmaps, text_heatmap

    balancer = engine.balancer
    if balancer is None:
        return
    if not balancer.history:
        print(f"no rebalance ran ({balancer.num_steps} steps < interval {balancer.config.interval})")
        return
    r = balancer.history[0]
    scale = float(max(r.before.max(), r.after.max()))
    print(f"expert load per GPU over the {balancer.config.window}-step window, rebalance after step "
          f"{r.after_step} ({len(balancer.history)} rebalances; {r.moved_slots} slots moved, "
          f"{r.moved_bytes} bytes, planned in {r.plan_s * 1e3:.1f} ms, applied in {r.apply_s * 1e3:.1f} ms)")
    print(text_heatmap(r.before, "before (old placement):", scale=scale))
    print(text_heatmap(r.after, "after (new placement):", scale=scale))
    if png is not None:
        try:
            save_heatmaps(r.before, r.after, png, f"expert load per GPU, rebalance after step {r.after_step}")
            print(f"heatmap written to {png}")
        except DeepInferError as exc:
            print(f"heatmap not written: {exc}")


def _pd_proxy(args: argparse.Namespace) -> int:
    """Run the prefill/decode proxy under uvicorn until interrupted."""
    try:
        import uvicorn

        from deepinfer_kit.serve.pd_proxy import build_proxy_app
    except ImportError as exc:
        raise ConfigError(f"deepinfer-kit pd-proxy needs FastAPI, uvicorn and httpx: "
                          f"pip install 'deepinfer_kit[serve]' ({exc})") from None
    uvicorn.run(build_proxy_app(args.prefill, args.decode), host=args.host, port=args.port, log_level="info")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``deepinfer-kit`` command; returns the exit status.

    Options with no subcommand (``deepinfer-kit --model X``), or nothing at all, mean
    ``generate``.

    A library error (any :class:`DeepInferError`: bad option, unreadable checkpoint, pool
    too large) prints ``error: <message>`` to stderr, with no traceback, and returns 2.
    """
    parser = build_parser()
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (args_list[0].startswith("-") and args_list[0] not in ("-h", "--help")):
        args_list = ["generate", *args_list]  # options alone mean `generate`
    args = parser.parse_args(args_list)
    try:
        if args.command == "trace":
            return _trace(args)
        if args.command == "sim":
            from deepinfer_kit.sim.command import run_sim_command

            return run_sim_command(args)
        if args.command == "serve":
            from deepinfer_kit.serve.command import run_serve_command

            return run_serve_command(args)
        if args.command == "pd-proxy":
            return _pd_proxy(args)
        return _generate(args)
    except DeepInferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
