"""Speculative sampling exactness on the real engine: does speculation change what is sampled?

For each drafter x planner, ``--samples`` seeded requests of one prompt on tiny-words
(temperature 0.8, top-p 0.9, top-k 20, EOS ignored) are sampled with speculation, and as
many with other seeds without it; the first ``--positions`` output tokens are compared
position by position: total-variation distance and a chi-square homogeneity test. The
noise floor is plain sampling against plain sampling with disjoint seeds, measured in the
same run. A configuration is exact when every position's p-value is above 0.01 and its TV
is near the floor. Greedy: every prompt's tokens must equal plain greedy decoding.

Drafters: ``ngram``; ``self`` (the target's first layer); ``draft_model`` (the target's
first layer saved as a checkpoint folder); ``dspark`` (the heads shipped for tiny-words).
Planners: ``fixed``; ``threshold`` (survival >= 0.1); ``step`` (each draft's confidence
>= 0.5); ``dspark`` (a decreasing SPS curve whose knee lies inside the rounds' sizes).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_spec_exactness.py [--samples 3000]
        [--positions 3] [--only self:threshold,dspark:dspark] [--greedy-prompts 100]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from deepinfer_kit.models.embedded import embedded_checkpoint
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.spec.records import SpsCurve
from deepinfer_kit.testing.spec_engine import compare_engine_samples, engine_samples

PLANNERS: dict[str, dict[str, Any]] = {
    "fixed": {"planner": "fixed"},
    "threshold": {"planner": "threshold", "threshold": 0.1},
    "step": {"planner": "threshold", "threshold": 0.5, "threshold_rule": "step"},
    "dspark": {"planner": "dspark",
               "sps": SpsCurve((1, 128, 512, 2048), (100.0, 100.0, 50.0, 12.0))},
}


def _first_layer_checkpoint(folder: Path) -> str:
    """tiny-words' embedding, first layer, final norm and head as a checkpoint folder."""
    from safetensors.torch import load_file, save_file

    src = embedded_checkpoint("tiny-words")
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = 1
    weights = {k: v for k, v in load_file(str(src / "model.safetensors")).items()
               if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, str(folder / "model.safetensors"))
    return str(folder)


def _drafters(tmp: Path) -> dict[str, dict[str, Any]]:
    return {
        "ngram": {"drafter": "ngram"},
        "self": {"drafter": "self", "draft_layers": 1},
        "draft_model": {"drafter": "draft_model", "draft_model": _first_layer_checkpoint(tmp / "draft")},
        "dspark": {"drafter": "dspark", "dspark_heads": "tiny-words"},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--positions", type=int, default=3)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--prompt", default="The cat ")
    ap.add_argument("--only", default="", help="comma-separated drafter:planner pairs")
    ap.add_argument("--greedy-prompts", type=int, default=0,
                    help="also check greedy speculation equals plain on this many prompts")
    args = ap.parse_args()
    n, pos = args.samples, args.positions
    prompt = list(args.prompt.encode())
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20)
    base: dict[str, Any] = {"model": "tiny-words", "max_num_seqs": 256, "max_num_batched_tokens": 4096}
    t0 = time.perf_counter()
    most = pos + args.num_draft  # every compared position can be reached by a verify round
    plain, _ = engine_samples(base, prompt, params, range(n), pos, most)
    floor, _ = engine_samples(base, prompt, params, range(2 * n, 3 * n), pos, most)
    print(f"tiny-words, {n} samples per configuration, temperature 0.8, top-p 0.9, top-k 20, "
          f"positions 1..{pos}, γ = {args.num_draft}")
    print(f"{'configuration':28s} " + " ".join(f"{'TV@' + str(p + 1):>8s} {'p@' + str(p + 1):>9s}"
                                              for p in range(pos)) + "   verified accepted")
    row = compare_engine_samples(floor, plain)
    print(f"{'plain vs plain (floor)':28s} " + " ".join(f"{c.tv:8.3f} {c.p_value:9.2e}" for c in row))
    wanted = {tuple(p.split(":")) for p in args.only.split(",") if p}
    worst = 1.0
    with tempfile.TemporaryDirectory() as tmp:
        for dname, dspec in _drafters(Path(tmp)).items():
            for pname, pspec in PLANNERS.items():
                if wanted and (dname, pname) not in wanted:
                    continue
                spec = {**dspec, **pspec, "num_draft": args.num_draft}
                fast, counts = engine_samples({**base, "speculative": spec}, prompt, params,
                                              range(n, 2 * n), pos, most)
                row = compare_engine_samples(fast, plain)
                worst = min(worst, *(c.p_value for c in row))
                print(f"{dname + ' x ' + pname:28s} "
                      + " ".join(f"{c.tv:8.3f} {c.p_value:9.2e}" for c in row)
                      + f"   {counts['verified']:8d} {counts['accepted']:8d}", flush=True)
                if args.greedy_prompts:
                    _greedy(base, spec, args.greedy_prompts)
    print(f"lowest p-value over the speculative rows: {worst:.2e} "
          f"({'PASS' if worst > 0.01 else 'FAIL'}: > 0.01); {time.perf_counter() - t0:.0f} s")


def _greedy(base: dict[str, Any], spec: dict[str, Any], num: int) -> None:
    from deepinfer_kit import SamplingParams as SP, build_engine

    prompts = [list(f"{i} the".encode()) for i in range(num)]
    outs = []
    for cfg in (base, {**base, "speculative": spec}):
        engine = build_engine(**cfg)
        for i, p in enumerate(prompts):
            engine.add_request(f"g{i}", p, SP(temperature=0.0, max_tokens=24, ignore_eos=True))
        outs.append({o.request_id: o.outputs[0].token_ids for o in engine.run()})
    same = sum(outs[0][k] == outs[1][k] for k in outs[0])
    print(f"{'':28s} greedy: {same}/{num} prompts equal plain")


if __name__ == "__main__":
    main()
