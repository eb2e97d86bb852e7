"""Speculative decoding with each drafter on the embedded tiny model.

Prompt lookup (n-gram), self-speculation (the target's first layer and its LM head, sharing
its weights) and a draft model (here the embedded model itself: the same weights, so every
draft is accepted); then the DSpark drafter (the heads shipped for the trained tiny-words
model, above its first 2 layers) against plain decoding of tiny-words; then DSpark with the
model in a worker process that overlaps rounds (the worker drafts each round as it runs
it, see docs/speculative.md). Greedy output is the same with and without speculation; each
run ends with the engine idle, the model drafters' own KV pools included.

    PYTHONPATH=src .venv/bin/python examples/speculative_drafters.py
"""

from __future__ import annotations

import torch

from deepinfer_kit import SamplingParams, build_engine

DRAFTERS: dict[str, dict[str, object] | None] = {
    "plain": None,
    "ngram": {"drafter": "ngram", "num_draft": 4},
    "self k=1": {"drafter": "self", "draft_layers": 1, "num_draft": 3},
    "draft model": {"drafter": "draft_model", "draft_model": "tiny", "num_draft": 3},
}
DSPARK = {"drafter": "dspark", "dspark_heads": "tiny-words", "num_draft": 4}
WORDS_DRAFTERS: dict[str, dict[str, object] | None] = {"plain": None, "dspark": DSPARK}
OVERLAPPED = {"overlap": True, "worker": "process"}  # engine options of the last row


def main() -> None:
    torch.set_num_threads(1)
    compare("tiny", DRAFTERS, "the cat sat on the mat. the cat sat on the mat. the cat")
    compare("tiny-words", WORDS_DRAFTERS, "The engine schedules")
    compare("tiny-words", {"plain": None, "dspark, worker overlapped": DSPARK}, "The engine schedules",
            OVERLAPPED)


def compare(model: str, drafters: dict[str, dict[str, object] | None], prompt: str,
            options: dict[str, object] | None = None) -> None:
    """Run each drafter on ``model`` (the speculative ones with engine ``options``); exit
    non-zero if one changes plain greedy output."""
    print(f"model {model}:")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = None
    for name, spec in drafters.items():
        extra = options if spec is not None and options else {}
        engine = build_engine(model=model, speculative=spec, num_blocks=64, max_model_len=256, **extra)
        engine.add_request("r", prompt, params)
        out = engine.run()[0]
        engine.check_idle()  # target blocks and the drafter's own blocks all free
        engine.close()
        tokens = out.outputs[0].token_ids
        reference = tokens if reference is None else reference
        if tokens != reference:
            raise SystemExit(f"{name}: greedy output differs from plain decoding")
        m = out.metrics
        drafted, accepted = (m.num_draft_tokens, m.num_accepted_tokens) if m else (0, 0)
        print(f"{name:26s} drafted {drafted:3d}  accepted {accepted:3d}  same tokens as plain")


if __name__ == "__main__":
    main()
