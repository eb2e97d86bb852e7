"""What structured outputs cost per decode step: 64 requests on tiny-words (CPU), every one
under a grammar (mixed: regexes, choices, JSON schemas), against the same requests without
one, in alternating runs of the same process; and the grammar stage's own share of a step
(matchers moved to each row's history, bitmasks filled, copied and applied), against
xgrammar's own mask filling and application driven directly on the same matchers.

Every request runs ``--tokens`` decode steps (``ignore_eos``: a grammar that has ended
allows only EOS, so the batch stays full and both runs do the same steps).

    .venv/bin/python benchmarks/bench_structured.py            # 64 requests x 48 tokens, 3 pairs
    .venv/bin/python benchmarks/bench_structured.py --quick    # a smoke run

Target (issue 46): mask building plus application <= 10% of a tiny-words step on CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from deepinfer_kit import LLM, SamplingParams

SPECS: list[dict[str, Any]] = [
    {"regex": r"[a-z]{2,8} (cache|block|token)s? [0-9]{1,3}"},
    {"choice": ["paged attention", "prefix cache", "overlap", "expert placement"]},
    {"json": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["name", "n", "ok"]}, "disable_any_whitespace": True},
    {"json": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 6}},
]


def params(num: int, tokens: int, constrained: bool) -> list[SamplingParams]:
    """``num`` seeded sampled requests of ``tokens`` tokens each, cycling through SPECS."""
    return [SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0, seed=i,
                           structured_outputs=SPECS[i % len(SPECS)] if constrained else None)
            for i in range(num)]


def timed_run(llm: LLM, num: int, tokens: int, constrained: bool) -> tuple[float, float, int]:
    """``(seconds, seconds inside the grammar stage, steps)`` of one run."""
    runner: Any = llm.engine.runner
    stage = getattr(runner, "grammar", None)
    inside = [0.0, 0]
    if stage is not None:
        apply = stage.apply

        def timed(*args: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return apply(*args, **kw)
            finally:
                inside[0] += time.perf_counter() - t
                inside[1] += 1

        stage.apply = timed
    start = time.perf_counter()
    llm.generate(["The engine"] * num, params(num, tokens, constrained), use_tqdm=False)
    elapsed = time.perf_counter() - start
    if stage is not None:
        stage.apply = apply
    return elapsed, inside[0], int(inside[1])


def xgrammar_direct(llm: LLM, num: int, tokens: int) -> float:
    """Seconds per step of xgrammar's own fill + apply for ``num`` matchers over ``tokens``
    steps (each matcher fed the tokens its own mask allows, the first allowed)."""
    import xgrammar as xgr

    from deepinfer_kit.sample.structured import StructuredOutputsParams

    stage = llm.engine.runner.grammar  # type: ignore[attr-defined]
    backend = stage.backend
    matchers = [xgr.GrammarMatcher(backend.compile(StructuredOutputsParams(**SPECS[i % len(SPECS)])).handle)
                for i in range(num)]
    vocab = backend.vocab_size
    bitmask = xgr.allocate_token_bitmask(num, vocab)
    logits = torch.randn(num, vocab)
    start = time.perf_counter()
    for _ in range(tokens):
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        best = logits.argmax(dim=-1).tolist()
        for m, t in zip(matchers, best):
            if not m.is_terminated():
                m.accept_token(t)
    return (time.perf_counter() - start) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.num, args.tokens, args.pairs = 8, 8, 1
    llm = LLM("tiny-words", max_num_seqs=args.num)
    timed_run(llm, args.num, 4, True)  # compiles the specs, warms both paths
    timed_run(llm, args.num, 4, False)
    ratios, shares, plain_steps = [], [], []
    for _ in range(args.pairs):
        plain, _, _ = timed_run(llm, args.num, args.tokens, False)
        constrained, inside, steps = timed_run(llm, args.num, args.tokens, True)
        ratios.append(constrained / plain)
        shares.append(inside / constrained)
        plain_steps.append(plain / steps)
    direct = xgrammar_direct(llm, args.num, args.tokens)
    step = statistics.median(plain_steps)
    print(f"tiny-words, {args.num} requests x {args.tokens} tokens, mixed grammars, CPU, "
          f"torch threads {torch.get_num_threads()}, {args.pairs} alternating pairs")
    print(f"unconstrained step: {step * 1e3:.2f} ms (median)")
    print(f"constrained / unconstrained run time: median {statistics.median(ratios):.3f}x "
          f"(pairs: {', '.join(f'{r:.3f}' for r in ratios)})")
    print(f"grammar stage share of a constrained run: median {statistics.median(shares) * 100:.1f}% "
          f"(target <= 10%)")
    print(f"xgrammar driven directly (fill {args.num} masks + apply + accept): {direct * 1e3:.2f} ms a step "
          f"= {direct / step * 100:.1f}% of an unconstrained step")


if __name__ == "__main__":
    main()
