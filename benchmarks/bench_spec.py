"""Speculative decoding (a): plain decoding vs each drafter on the real engine, CPU.

The embedded tiny model (2 layers, MoE), batch 1, greedy. Drafters: n-gram prompt
lookup; self-speculation with the target's first layer (``drafter="self"``,
``draft_layers=1``: shared weights, its own KV); a separate 1-layer draft checkpoint (the
tiny model's first layer and head saved as a folder, loaded as ``drafter="draft_model"``);
and the identical draft model (the target's own weights: every draft accepted, the
acceptance ceiling at a full target's cost). Two workloads: repetitive text (the prompt
repeats a sentence) and random token ids. A third workload runs the trained tiny-words model
(4 layers) on corpus prompts: plain, n-gram, self-speculation with its first 2 layers, and
the DSpark drafter (the heads shipped for tiny-words, backbone = its first 2 layers) under
the fixed and threshold planners. Each configuration runs the same prompts in the
same process, alternating, best of ``--repeats``. Prints output tokens/s, the ratio to
plain, the mean acceptance length (tokens emitted per verify round, ``1 + accepted``), the
share of decode rounds that verified drafts and the tokens per decode round (all decode
rounds: the bound on the speed-up when a verify round costs a plain one); with ``--profile``, where each
configuration's time goes (drafting, the target step, the host). Outputs are checked
equal to plain.

    .venv/bin/python benchmarks/bench_spec.py [--quick] [--tokens 128] [--gamma 4] [--profile]
        [--cpu-time] [--only tiny|tiny-words] [--overlap]

``--overlap`` adds plain and n-gram rows (and DSpark rows on tiny-words) under overlap
(``overlap=True`` in-process, and ``worker="process"`` synchronous and overlapped), each
checked equal to plain too.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.engine.engine import Engine
from deepinfer_kit.engine.trace import StepTrace
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.tiny import tiny_hf_config, tiny_hf_weights


def _workloads(num: int) -> dict[str, list[list[int]]]:
    rng = random.Random(0)
    text = [list(f"Request {i}: the cat sat on the mat and the dog sat on the log. ".encode() * 3)
            for i in range(num)]
    rand = [[rng.randrange(256) for _ in range(48)] for _ in range(num)]
    return {"repetitive": text, "random": rand}


def _one_layer_draft(folder: Path, seed: int = 0) -> str:
    """Save the embedded model's first layer, final norm and head as a checkpoint folder:
    a draft model of the target's vocabulary at about half its cost."""
    config = tiny_hf_config()
    weights = tiny_hf_weights(ModelConfig.from_hf_config(config), seed=seed)
    config["num_hidden_layers"] = 1
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items() if not k.startswith("model.layers.1.")},
              str(folder / "model.safetensors"))
    return str(folder)


class _Clock:
    """Seconds spent in the drafter (:attr:`draft`) and in the runner's step outside it
    (:attr:`target`: forward, verify, layout), by benchmark-only wrappers.

    The runner's entry points are ``execute`` and, for a pipelined step, ``launch`` and
    ``finish``; a speculative round's launch drafts and runs ``execute`` inside itself.
    Only the outermost entry is timed (a depth count), and the drafting inside it is
    taken off, so nothing is counted twice."""

    def __init__(self, engine: Engine) -> None:
        self.draft = self.target = 0.0
        self._depth = 0
        drafting = getattr(engine.runner, "drafting", None)  # None: a worker process drafts
        if drafting is not None:
            drafter = drafting.speculation.drafter
            propose = drafter.propose

            def timed_propose(*a: Any) -> Any:
                t = _TIMER()
                try:
                    return propose(*a)
                finally:
                    self.draft += _TIMER() - t

            drafter.propose = timed_propose  # type: ignore[method-assign]
        for name in ("execute", "launch", "finish"):
            entry = getattr(engine.runner, name, None)
            if entry is not None:
                setattr(engine.runner, name, self._outermost(entry))

    def _outermost(self, entry: Any) -> Any:
        def timed(*a: Any) -> Any:
            self._depth += 1
            if self._depth > 1:
                try:
                    return entry(*a)
                finally:
                    self._depth -= 1
            t, drafted = _TIMER(), self.draft
            try:
                return entry(*a)
            finally:
                self._depth -= 1
                self.target += _TIMER() - t - (self.draft - drafted)

        return timed


_TIMER = time.perf_counter  # time.process_time with --cpu-time


Spec = dict[str, Any] | None
Row = Spec | tuple[Spec, dict[str, Any]]  # a speculative config, or one with engine options


def _run(row: Row, prompts: list[list[int]],
         tokens: int, model: str = "tiny") -> tuple[float, list[Any], list[StepTrace], _Clock]:
    spec, opts = row if isinstance(row, tuple) else (row, {})
    traces: list[StepTrace] = []
    engine = build_engine(model=model, speculative=spec, num_blocks=256, max_model_len=1024, **opts, trace=traces.append)
    clock = _Clock(engine)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs: list[Any] = []
    t0 = _TIMER()
    for i, p in enumerate(prompts):  # batch 1: one request at a time
        engine.add_request(f"r{i}", p, params)
        outs += [o.outputs[0].token_ids for o in engine.run()]
    dt = _TIMER() - t0
    engine.check_idle()
    engine.close()
    return dt, outs, traces, clock


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="print where each configuration's time goes")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time each run by this process's CPU time (one thread), not wall time: "
                         "steadier on a shared machine; tok/s are then per CPU-second")
    ap.add_argument("--only", choices=("tiny", "tiny-words"), help="run one model's workloads")
    ap.add_argument("--overlap", action="store_true",
                    help="add n-gram (and plain) rows under overlap: in-process (a worker thread) "
                         "and with the model in a worker process")
    args = ap.parse_args()
    global _TIMER
    _TIMER = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(1)
    num, tokens, repeats = (2, 32, 1) if args.quick else (6, args.tokens, args.repeats)
    g = args.gamma
    draft_dir = _one_layer_draft(Path(tempfile.mkdtemp(prefix="bench_spec_")) / "draft")
    configs: dict[str, Row] = {
        "plain": None,
        f"ngram γ={g} fixed": {"num_draft": g},
        f"ngram γ={g} threshold 0.5": {"num_draft": g, "planner": "threshold", "threshold": 0.5},
        f"self k=1 γ={g}": {"drafter": "self", "draft_layers": 1, "num_draft": g},
        f"self k=1 γ={g} threshold 0.5": {"drafter": "self", "draft_layers": 1, "num_draft": g,
                                          "planner": "threshold", "threshold": 0.5},
        f"draft 1-layer ckpt γ={g}": {"drafter": "draft_model", "draft_model": draft_dir,
                                      "num_draft": g},
        f"draft identical γ={g}": {"drafter": "draft_model", "draft_model": "tiny", "num_draft": g},
    }
    if args.overlap:
        configs = {**configs, **_overlap_rows(g)}
    if args.only != "tiny-words":
        for name, prompts in _workloads(num).items():
            _compare(name, prompts, configs, "tiny", tokens, repeats, args.profile)
    if args.only == "tiny":
        return
    words: dict[str, Row] = {
        "plain": None,
        f"ngram γ={g} fixed": {"num_draft": g},
        f"self k=2 γ={g}": {"drafter": "self", "draft_layers": 2, "num_draft": g},
        "dspark k=2 γ=4 fixed": {"drafter": "dspark", "dspark_heads": "tiny-words", "num_draft": 4},
        "dspark k=2 γ=4 threshold 0.5": {"drafter": "dspark", "dspark_heads": "tiny-words",
                                         "num_draft": 4, "planner": "threshold", "threshold": 0.5},
        "dspark k=2 γ=4 planner dspark": {"drafter": "dspark", "dspark_heads": "tiny-words",
                                          "num_draft": 4, "planner": "dspark"},
    }
    if args.overlap:
        words = {**words, **_overlap_rows(g, ("dspark γ=4", words["dspark k=2 γ=4 fixed"]))}  # type: ignore[arg-type]
    _compare("tiny-words (corpus prompts)", _corpus_prompts(num), words, "tiny-words", tokens,
             repeats, args.profile)


def _overlap_rows(g: int, model: tuple[str, dict[str, Any]] | None = None) -> dict[str, Row]:
    """Plain and n-gram speculation (and ``model``, a named model drafter) overlapped (the
    runner drafts, docs/speculative.md), in-process and with the model in a worker
    process; plus the worker process synchronous."""
    ngram = {"num_draft": g}
    extra: dict[str, Row] = {}
    if model is not None:
        name, spec = model
        extra = {
            f"{name}, overlap thread": (spec, {"overlap": True}),
            f"{name}, worker process sync": (spec, {"worker": "process", "overlap": False}),
            f"{name}, worker process overlap": (spec, {"worker": "process", "overlap": True}),
        }
    return {
        "plain, overlap thread": (None, {"overlap": True}),
        "plain, worker process sync": (None, {"worker": "process", "overlap": False}),
        "plain, worker process overlap": (None, {"worker": "process", "overlap": True}),
        f"ngram γ={g}, overlap thread": (ngram, {"overlap": True}),
        f"ngram γ={g}, worker process sync": (ngram, {"worker": "process", "overlap": False}),
        f"ngram γ={g}, worker process overlap": (ngram, {"worker": "process", "overlap": True}),
        **extra,
    }


def _corpus_prompts(num: int) -> list[list[int]]:
    """Windows of the words model's frozen training corpus (seeds unlike the DSpark training's)."""
    data = (Path(__file__).resolve().parents[1] / "scripts" / "embedded_corpus.txt").read_bytes()
    rng = random.Random(977)
    starts = [rng.randrange(len(data) - 48) for _ in range(num)]
    return [list(data[s:s + 48]) for s in starts]


def _compare(name: str, prompts: list[list[int]], configs: dict[str, Row],
             model: str, tokens: int, repeats: int, profile: bool) -> None:
    """Run every configuration on ``prompts`` (alternating, best of ``repeats``), check each
    output equals plain's, print tokens/s, the ratio to plain and the acceptance length."""
    num = len(prompts)
    best = {c: float("inf") for c in configs}
    stats: dict[str, tuple[float, float, float]] = {}
    split: dict[str, tuple[float, float]] = {}
    reference: list[Any] | None = None
    for _ in range(repeats):
        for cname, spec in configs.items():
            dt, outs, traces, clock = _run(spec, prompts, tokens, model)
            reference = outs if reference is None else reference
            if outs != reference:
                raise SystemExit(f"{cname} on {name}: output differs from plain")
            if dt < best[cname]:
                best[cname] = dt
                split[cname] = (clock.draft / dt, clock.target / dt)
            verify = [c for t in traces for c in t.chunks if c.num_drafted]
            decode = [c for t in traces for c in t.chunks if c.kind == "decode"]
            accept = sum(len(c.sampled) for c in verify) / len(verify) if verify else 1.0
            per_round = sum(len(c.sampled) for c in decode) / max(1, len(decode))
            stats[cname] = (accept, len(verify) / max(1, len(decode)), per_round)
    total = num * tokens
    print(f"workload {name}: {num} prompts x {tokens} tokens, batch 1, model {model}")
    for cname in configs:
        tps = total / best[cname]
        accept, share, per_round = stats[cname]
        print(f"  {cname:30s} {tps:8.1f} tok/s  x{best['plain'] / best[cname]:.2f} vs plain  "
              f"mean acceptance length {accept:.2f}  verify rounds {share:.0%} of decodes  "
              f"tokens per decode round {per_round:.2f}")
        if profile:
            draft, target = split[cname]
            print(f"  {'':30s} time: drafting {draft:.0%}, target step (forward + verify) "
                  f"{target:.0%}, host (schedule, commit, bookkeeping) {1 - draft - target:.0%}")


if __name__ == "__main__":
    main()
