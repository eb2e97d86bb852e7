"""Generate with the LLM API on the embedded "tiny-words" model (or a checkpoint folder).

    .venv/bin/python examples/generate.py [CHECKPOINT_DIR]
"""

from __future__ import annotations

import sys

import torch

from deepinfer_kit import LLM, SamplingParams


def main() -> None:
    torch.set_num_threads(1)  # the embedded model's ops are too small to share out
    llm = LLM(sys.argv[1] if len(sys.argv) > 1 else "tiny-words", num_blocks=512)
    prompts = ["Paged attention reads", "Continuous batching means", "Experts are"]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    sampled = SamplingParams(n=3, temperature=0.8, top_p=0.95, max_tokens=16, seed=0, logprobs=2)
    for out in llm.generate(prompts, greedy):
        c = out.outputs[0]
        print(f"{out.prompt!r} -> {c.text!r} ({c.finish_reason})")
    (forked,) = llm.generate(prompts[0], sampled)
    for c in forked.outputs:
        print(f"completion {c.index}: {c.text!r} cumulative logprob {c.cumulative_logprob:.2f}")
    llm.engine.check_idle()


if __name__ == "__main__":
    main()
