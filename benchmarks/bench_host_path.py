"""The host's share of an engine step on CPU with many running tiny requests.

Builds the synchronous CPU engine on the embedded tiny model, puts ``--requests`` short
prompts in flight (greedy by default, ``ignore_eos`` so every request keeps decoding),
lets them all reach decode, then times ``--repeats`` x ``--steps`` decode steps. Each
step is split with :class:`phase_timer.PhaseTimer` into the forward (the model call,
``ModelRunner._logits``) and the host (everything else in ``Engine.step``: schedule,
the runner's layout and input packing, the sampler, the copy back and per-chunk
results, the commit with its stop checks and detokenizing, the outputs). Prints per
step, as the median over the timed steps: host µs, forward µs, host share = host /
step (and the share with the sampler's call counted as device work instead: its row
planning is host work, its argmax or draw device work), and the host µs of each phase;
then the mean host µs and share over all the timed steps, whose last one finishes every
request (work done once per request at its end, such as the text of a request nothing
reads before, shows there and not in the median); then a digest of every request's
tokens and text (equal digests: identical decisions and outputs).

The clock is the main thread's CPU time (``time.thread_time``) with one torch thread, so
a busy machine slows the figures less than wall time would. Before/after comparisons
run this same script with ``PYTHONPATH`` pointing at another checkout's ``src``::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_host_path.py [--requests 256]
        [--steps 20] [--repeats 5] [--temperature 0.0] [--clock cpu|wall] [--static]
        [--prompt-len 8]

``--static`` decodes on the static padded buffers (``static_decode=True``: what CUDA
replays as graphs, run eagerly here), whose staging copies every row's block table each
step: with ``--prompt-len 500`` the tables are 32 blocks wide.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import torch

import deepinfer_kit
from phase_timer import PhaseTimer
from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.engine.groups import OutputGroups

#: The host's phases, in round order (``execute``: the runner's part of it outside the
#: forward and the sampler: the finite-row check, logit edits, copy back, per-chunk results).
PHASES = ("schedule", "prepare", "execute", "sampler", "commit", "collect")


def _instrument(timer: PhaseTimer, engine: Engine) -> None:
    """Wrap the phases of ``engine``'s classes (every engine of them, from now on)."""
    timer.wrap(Engine, "step", "step")
    timer.wrap(type(engine.scheduler), "schedule", "schedule")
    timer.wrap(type(engine.scheduler), "commit", "commit")
    runner = engine.runner
    timer.wrap(type(runner), "prepare", "prepare")
    timer.wrap(type(runner), "execute", "execute")
    timer.wrap(type(runner), "_logits", "forward")
    timer.wrap(type(getattr(runner, "sampler")), "__call__", "sampler")
    timer.wrap(OutputGroups, "collect", "collect")


def _per_step(timer: PhaseTimer) -> dict[str, float]:
    """One step's phases in µs: the host's phases exclusive of what they hold (execute
    without the forward and the sampler), ``host`` = step - forward."""
    t = {k: v * 1e6 for k, v in timer.total.items()}
    row = {k: t.get(k, 0.0) for k in ("step", "forward", *PHASES)}
    row["execute"] -= row["forward"] + row["sampler"]
    row["other"] = row["step"] - row["forward"] - sum(row[k] for k in PHASES)
    row["host"] = row["step"] - row["forward"]
    row["share"] = row["host"] / row["step"]
    row["share_ex_sampler"] = (row["host"] - row["sampler"]) / row["step"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5, help="decode steps before timing")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: seeded sampling")
    ap.add_argument("--clock", default="cpu", choices=("cpu", "wall"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--static", action="store_true",
                    help="decode on the static padded buffers (CUDA's default path; eager on CPU)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    timed_steps = args.steps * args.repeats
    max_tokens = 1 + args.warmup + timed_steps
    engine = build_engine(
        max_num_seqs=args.requests, max_num_batched_tokens=max(2048, args.requests * args.prompt_len),
        num_blocks=args.requests * ((args.prompt_len + max_tokens) // 16 + 2), max_model_len=2048,
        static_decode=args.static or None,
    )
    for i in range(args.requests):
        prompt = [(7 * i + 3 * j) % 250 + 1 for j in range(args.prompt_len)]
        seed = i if args.temperature > 0 else None
        engine.add_request(f"r{i}", prompt, SamplingParams(
            temperature=args.temperature, seed=seed, max_tokens=max_tokens, ignore_eos=True))
    timer = PhaseTimer(time.thread_time if args.clock == "cpu" else time.perf_counter)
    outputs = engine.step()  # every prompt fits one round: all decode from the next step on
    for _ in range(args.warmup):
        outputs += engine.step()
    _instrument(timer, engine)
    rows: list[dict[str, float]] = []
    for _ in range(timed_steps):
        timer.clear()
        outputs += engine.step()
        rows.append(_per_step(timer))
    timer.unwrap()
    outputs += engine.run()
    engine.check_idle()
    digest = hashlib.sha256(repr(sorted(
        (o.request_id, o.outputs[0].token_ids, o.outputs[0].text) for o in outputs)).encode())
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    per_repeat = [statistics.median(r["host"] for r in rows[k::args.repeats]) for k in range(args.repeats)]
    print(f"deepinfer_kit from {deepinfer_kit.__file__}")
    print(f"{args.requests} running tiny requests, {timed_steps} decode steps timed "
          f"({args.clock} clock, torch threads {torch.get_num_threads()}), median per step:")
    print(f"  step {med['step']:9.0f} us   forward {med['forward']:9.0f} us   "
          f"host {med['host']:9.0f} us   host share {med['share']:.3f}")
    print(f"  host share with the sampler counted as device work: {med['share_ex_sampler']:.3f}")
    mean_host, mean_step = (statistics.mean(r[k] for r in rows) for k in ("host", "step"))
    print(f"  mean over the timed steps (the last one finishes every request): host {mean_host:.0f} us, "
          f"share {mean_host / mean_step:.3f}")
    print(f"  host per request {med['host'] / args.requests:.2f} us; host median of each repeat: "
          + ", ".join(f"{h:.0f}" for h in per_repeat))
    print("  host phases (us): " + "  ".join(f"{k} {med[k]:.0f}" for k in (*PHASES, "other")))
    print(f"  tokens and text digest {digest.hexdigest()[:16]} ({sum(len(o.outputs[0].token_ids) for o in outputs)} tokens)")


if __name__ == "__main__":
    main()
