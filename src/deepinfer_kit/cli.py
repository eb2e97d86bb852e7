"""The ``deepinfer-kit`` command: ``generate`` and ``trace`` on a checkpoint or the tiny model;
``sim`` on the real scheduler and cache with a cost model."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from deepinfer_kit._dtypes import DTYPE_NAMES
from deepinfer_kit.errors import DeepInferError

if TYPE_CHECKING:
    from deepinfer_kit.engine.engine import Engine
    from deepinfer_kit.sample.params import SamplingParams

__all__ = ["main", "build_parser"]

DEFAULT_PROMPTS = (
    "The paged KV cache stores each request's keys and values in fixed-size blocks.",
    "The paged KV cache stores each request's keys and values so that prefixes are shared.",
    "Continuous batching admits new requests every round.",
    "A mixture-of-experts layer routes every token to a few experts.",
)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="checkpoint folder, or 'tiny' (embedded, default)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: built-in prompts")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step k+1 while step k runs (tokens committed one step late); "
                        "default: on unless --num-draft")
    p.add_argument("--num-draft", type=int, default=0,
                   help="speculative decoding: n-gram drafts verified per round (0: off)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="on a GPU, run decode rounds eagerly instead of replaying captured graphs")
    p.add_argument(
        "--threads", type=int, default=None,
        help="torch intra-op threads (default: 1 for the tiny model, torch's default otherwise)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``deepinfer-kit`` command."""
    parser = argparse.ArgumentParser(prog="deepinfer-kit", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    gen = sub.add_parser("generate", help="generate completions and print a summary")
    _add_common(gen)
    trace = sub.add_parser("trace", help="print one request's path through the engine, step by step")
    _add_common(trace)
    trace.add_argument("--request", type=int, default=0, help="index of the prompt to follow")
    from deepinfer_kit.sim.command import add_sim_parser

    add_sim_parser(sub)
    return parser


def _engine_and_params(args: argparse.Namespace) -> tuple[Engine, SamplingParams, list[str]]:
    """The engine, the sampling parameters and the prompts the arguments describe.

    Heavy imports happen here, so ``deepinfer-kit --help`` stays fast.
    """
    import torch

    from deepinfer_kit.engine.build import build_engine
    from deepinfer_kit.engine.config import EngineConfig
    from deepinfer_kit.sample.params import SamplingParams

    threads = args.threads if args.threads is not None else (1 if args.model == "tiny" else 0)
    if threads > 0:
        torch.set_num_threads(threads)
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        overlap=args.overlap,
        cuda_graphs=not args.no_cuda_graphs,
        speculative=({"drafter": "ngram", "num_draft": args.num_draft} if args.num_draft else None),
    )
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    prompts = list(args.prompt) if args.prompt else list(DEFAULT_PROMPTS)
    return build_engine(config), params, prompts


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
            print(f"[{rid}] {out.prompt!r} -> {c.text!r} ({len(c.token_ids)} tokens, {c.finish_reason})")
    prompt_tokens = engine.num_prompt_tokens
    hit = engine.num_cached_prompt_tokens / prompt_tokens if prompt_tokens else 0.0
    print(
        f"requests={len(ids)} output_tokens={tokens} time={elapsed:.2f}s "
        f"tokens/s={tokens / elapsed if elapsed > 0 else 0.0:.1f} prefix_hit_rate={hit:.1%}"
    )
    return 0


def _trace(args: argparse.Namespace) -> int:
    from deepinfer_kit.engine.trace import StepTrace, token_timeline

    engine, params, prompts = _engine_and_params(args)
    if not 0 <= args.request < len(prompts):
        print(f"error: --request must be in [0, {len(prompts)}), got {args.request}", file=sys.stderr)
        return 2
    traces: list[StepTrace] = []
    engine.trace = traces.append
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
        if target in t.preempted:
            print("  preempted (blocks released; will recompute)")
        for f in done:
            print(f"  finished: {f}")
    print("its tokens (output index: id, the step that sampled it, the step that committed it):")
    for index, tok, sampled, committed in token_timeline(traces, target, finished[target].outputs[0].token_ids):
        late = f"committed in step {committed}" if committed is not None else "discarded (never committed)"
        print(f"  {index}: {tok} sampled in step {sampled}, {late}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``deepinfer-kit`` command; returns the exit status.

    A library error (any :class:`DeepInferError`: bad option, unreadable checkpoint, pool
    too large) prints ``error: <message>`` to stderr, with no traceback, and returns 2.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["generate", *(argv or [])])
    try:
        if args.command == "trace":
            return _trace(args)
        if args.command == "sim":
            from deepinfer_kit.sim.command import run_sim_command

            return run_sim_command(args)
        return _generate(args)
    except DeepInferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
