"""Engine throughput vs `transformers` generate on the same model and requests.

Builds a small random Qwen3-MoE checkpoint (hidden 512, 4 layers, 16 experts top-4,
vocab 32k by default), saves it as a real safetensors folder, then generates for the same
requests (prompts of 16-256 tokens, 16-128 new tokens each, greedy, EOS ignored) with:

* deepinfer_kit's Engine (continuous batching, paged KV cache, no padding), and
* `transformers` `generate` with left padding at batch 16 and 64 (each batch runs until its
  longest request is done; extra tokens of the shorter requests are wasted).

Output tokens/s counts only the tokens each request asked for. Prints the ratio to the best
transformers configuration, and how many requests' greedy tokens agree between the two.

    .venv/bin/python benchmarks/bench_engine.py            # the full comparison
    .venv/bin/python benchmarks/bench_engine.py --quick    # a smoke run
    .venv/bin/python benchmarks/bench_engine.py --batch-invariant   # + the batch-invariant
        # mode on the same requests, its cost as a same-run ratio (target >= 0.8x on CPU)
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch


def build_checkpoint(path: Path, args: argparse.Namespace) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(args.seed)
    config = Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=args.hidden // 8,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=args.vocab - 1,
        bos_token_id=None,
        pad_token_id=0,
    )
    model = Qwen3MoeForCausalLM(config).eval()
    model.save_pretrained(str(path), safe_serialization=True)


def make_requests(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    reqs = []
    for _ in range(args.num_requests):
        plen = rng.randint(args.min_prompt, args.max_prompt)
        prompt = [rng.randrange(1, args.vocab - 1) for _ in range(plen)]
        reqs.append((prompt, rng.randint(args.min_new, args.max_new)))
    return reqs


def run_engine(
    path: Path, reqs: list[tuple[list[int], int]], args: argparse.Namespace, overlap: bool = False,
    batch_invariant: bool = False,
) -> tuple[float, list[list[int]]]:
    from deepinfer_kit import LLM, SamplingParams

    llm = LLM(
        str(path),
        overlap=overlap,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_mb=1024,  # the pool's size on CPU and on CUDA alike (same pool every run)
        batch_invariant=batch_invariant,
    )
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    llm.generate([reqs[0][0]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.engine.check_idle()
    return elapsed, [o.outputs[0].token_ids for o in outs]


def run_transformers(
    path: Path, reqs: list[tuple[list[int], int]], batch: int, device: str
) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for lo in range(0, len(reqs), batch):
        group = reqs[lo : lo + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for i, (p, _) in enumerate(group):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        new = max(n for _, n in group)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        for i, (_, n) in enumerate(group):
            tokens.append(out[i, width : width + n].tolist())
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few small requests (smoke run)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--min-new", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--moe-intermediate", type=int, default=256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both sides run there)")
    parser.add_argument("--overlap", action="store_true",
                        help="also run the engine with overlap=True and print its gain")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="also run the engine with batch_invariant=True (alternating with the "
                             "default engine, --repeats times each) and print its cost")
    parser.add_argument("--repeats", type=int, default=3, help="--batch-invariant: runs of each engine")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.max_prompt, args.max_new, args.min_new = 8, 48, 12, 4
        args.vocab, args.hidden, args.layers, args.batch_sizes = 2048, 128, 2, [8]
    if args.threads:
        torch.set_num_threads(args.threads)

    reqs = make_requests(args)
    useful = sum(n for _, n in reqs)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        build_checkpoint(path, args)
        ours_s, ours_tokens = run_engine(path, reqs, args)
        rows = [("deepinfer_kit Engine", ours_s, ours_tokens)]
        if args.overlap:
            over_s, over_tokens = run_engine(path, reqs, args, overlap=True)
            overlapped = ("deepinfer_kit Engine, overlap=True", over_s, over_tokens)
        if args.batch_invariant:
            pairs = []
            for _ in range(args.repeats):  # alternate, so drift on a shared machine hits both
                base_s, _ = run_engine(path, reqs, args)
                inv_s, inv_tokens = run_engine(path, reqs, args, batch_invariant=True)
                pairs.append((base_s, inv_s))
        for bs in args.batch_sizes:
            hf_s, hf_tokens = run_transformers(path, reqs, bs, args.device)
            rows.append((f"transformers generate, batch {bs}", hf_s, hf_tokens))
    print(
        f"{len(reqs)} requests, {useful} output tokens asked for, device {args.device}, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"{'configuration':36s} {'seconds':>9s} {'out tok/s':>10s} {'greedy agree':>13s}")
    for name, secs, toks in rows:
        agree = sum(a == b for a, b in zip(toks, ours_tokens))
        print(f"{name:36s} {secs:9.2f} {useful / secs:10.1f} {agree:>6d}/{len(reqs):<6d}")
    best = min(secs for _, secs, _ in rows[1:])
    print(f"ratio vs best transformers configuration: {best / ours_s:.2f}x output tokens/s")
    if args.batch_invariant:
        ratios = sorted(b / i for b, i in pairs)
        inv_best = min(i for _, i in pairs)
        agree = sum(a == b for a, b in zip(inv_tokens, ours_tokens))
        print(f"{'deepinfer_kit Engine, batch_invariant':36s} {inv_best:9.2f} {useful / inv_best:10.1f} "
              f"{agree:>6d}/{len(reqs):<6d}")
        print(f"batch-invariant vs default engine, output tokens/s, {len(pairs)} alternating pairs: "
              f"median {ratios[len(ratios) // 2]:.2f}x (pairs: {', '.join(f'{r:.2f}' for r in ratios)})")
    if args.overlap:
        name, secs, toks = overlapped
        agree = sum(a == b for a, b in zip(toks, ours_tokens))
        print(f"{name:36s} {secs:9.2f} {useful / secs:10.1f} {agree:>6d}/{len(reqs):<6d}")
        print(f"overlap vs synchronous engine: {ours_s / secs:.2f}x output tokens/s")


if __name__ == "__main__":
    main()
