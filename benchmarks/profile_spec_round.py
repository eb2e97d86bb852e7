"""Where a batch-1 speculative round's time goes on CPU: each engine phase wrapped in a
timer (no cProfile, whose per-call cost would swamp the host work measured), plain and
speculative runs alternating, the second pass of each printed (the first warms up).

Per phase: calls, total and per-call time. ``runner._logits`` is the model forward;
``engine.step`` minus it is the host's share. Outputs are checked equal to plain.

    PYTHONPATH=src .venv/bin/python benchmarks/profile_spec_round.py [--model tiny|tiny-words]
        [--drafter ngram|dspark] [--workload repetitive|random|corpus] [--tokens 96]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from bench_spec import _corpus_prompts, _workloads
from phase_timer import PhaseTimer
from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.engine import engine as engine_module
from deepinfer_kit.engine.runner import model_runner as runner_module
from deepinfer_kit.spec import speculation as speculation_module
from deepinfer_kit.spec.verify.rejection import RejectionVerifier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=("tiny", "tiny-words"))
    ap.add_argument("--drafter", default="ngram", choices=("ngram", "dspark"))
    ap.add_argument("--workload", default="repetitive", choices=("repetitive", "random", "corpus"))
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    prompts = (_corpus_prompts(args.prompts) if args.workload == "corpus"
               else _workloads(args.prompts)[args.workload])
    spec: dict[str, Any] = {"num_draft": 4}
    if args.drafter == "dspark":
        spec.update(drafter="dspark", dspark_heads="tiny-words")
    timer = PhaseTimer()
    _wrap = timer.wrap
    _wrap(engine_module.Engine, "step", "engine.step")
    _wrap(engine_module.Engine, "_commit_oldest", "engine commit")
    _wrap(runner_module.ModelRunner, "prepare", "runner.prepare")
    _wrap(runner_module.ModelRunner, "execute", "runner.execute")
    _wrap(runner_module.ModelRunner, "_logits", "runner._logits (forward)")
    _wrap(runner_module, "verify_round", "verify_round")
    _wrap(RejectionVerifier, "verify", "verifier.verify")
    _wrap(speculation_module.Speculation, "choose", "drafting phase (choose)")
    reference: list[Any] | None = None
    for rep in range(2):
        for name, config in (("plain", None), (args.drafter, spec)):
            timer.clear()
            engine = build_engine(model=args.model, speculative=config, num_blocks=256,
                                  max_model_len=1024)
            params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
            outs: list[Any] = []
            for i, p in enumerate(prompts):
                engine.add_request(f"r{i}", p, params)
                outs += [o.outputs[0].token_ids for o in engine.run()]
            reference = outs if reference is None else reference
            if outs != reference:
                raise SystemExit(f"{name}: output differs from plain")
            if rep:
                timer.report(f"{name} ({args.model}, {args.workload}, {len(prompts)} x {args.tokens} tokens)")


if __name__ == "__main__":
    main()
