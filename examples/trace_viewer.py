"""Record a real engine run and write the step-through viewer: one self-contained HTML file.

    .venv/bin/python examples/trace_viewer.py --out run.html

Open run.html in any browser (it works offline, from file://): step with the buttons or the
arrow keys, play, or scrub. A small pool makes prefix hits, preemption and copy-on-write
show up; ``n=2`` forks a request; ``logprobs`` asks the sampler for the candidates the
sampling panel draws.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from deepinfer_kit import SamplingParams, build_engine
from deepinfer_kit.viewer import TraceRecorder, read_html, write_html


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="the HTML file (default: a temporary folder)")
    parser.add_argument("--num-draft", type=int, default=0, help="n-gram drafts per round (0: no speculation)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = build_engine(model="tiny", num_blocks=16, block_size=4, max_model_len=64,
                          max_num_batched_tokens=16, max_num_seqs=6,
                          speculative={"drafter": "ngram", "num_draft": args.num_draft} if args.num_draft else None)
    # Any callback already in engine.trace (Engine(trace=...)) keeps receiving every StepTrace.
    recorder = TraceRecorder.attach(engine, model="tiny")
    system = "Paged KV: "
    engine.add_request("a", system + "blocks", SamplingParams(temperature=0, max_tokens=12, logprobs=3))
    engine.add_request("b", system + "forks", SamplingParams(temperature=0.8, top_k=8, seed=1, n=2,
                                                             max_tokens=12, logprobs=3))
    engine.add_request("c", "Budget!", SamplingParams(top_p=0.9, seed=2, max_tokens=14))
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        if step == 6:  # a late arrival: its prefix blocks are cached by now
            engine.add_request("d", system + "reuse", SamplingParams(temperature=0, max_tokens=10, logprobs=2))
    engine.flush()
    engine.check_idle()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp()) / "run.html"
    write_html(recorder, out)
    doc = read_html(out)
    assert doc == recorder.document()
    steps = doc["steps"]
    hits = sum(len(b) for s in steps for b in s["blocks"]["prefix_hits"].values())
    preempted = sum(len(s["preempted"]) for s in steps)
    print(f"{len(steps)} steps, {len(doc['requests'])} sequences, {hits} prefix-hit blocks, "
          f"{preempted} preemptions -> {out}")


if __name__ == "__main__":
    main()
