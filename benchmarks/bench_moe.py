"""One MoE layer forward on CPU: MoELayer vs transformers' own block, same weights, same run.

For each architecture (Qwen3-MoE, Mixtral, GLM-4-MoE) and token count it times:

- ``hf eager``: the transformers block with ``experts_implementation="eager"``;
- ``hf grouped_mm``: the same block with ``experts_implementation="grouped_mm"``;
- ``ours``: :class:`deepinfer_kit.moe.MoELayer` loaded from the block's ``state_dict``;
- ``dense``: plain matmuls of exactly the layer's GEMM shapes (router, routed experts as
  one ``[T*k, H]`` operand, shared experts) on contiguous operands: the same FLOPs with no
  routing, gathering or per-expert weights, i.e. this machine's GEMM limit for the work.

Rounds are interleaved and the minimum of each is reported (other processes on a shared
machine only ever add time). Printed ratios: ``speedup`` = best HF time / ours, and
``of dense`` = dense time / ours (the fraction of GEMM throughput the layer reaches).

    .venv/bin/python benchmarks/bench_moe.py            # hidden 1024, 64 experts, top-8
    .venv/bin/python benchmarks/bench_moe.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from deepinfer_kit.moe import MoEConfig, MoELayer

ARCHS = ("qwen3_moe", "mixtral", "glm4_moe")


def hf_block(arch: str, args: argparse.Namespace) -> tuple[Any, Any]:
    """A transformers MoE block of ``arch`` with random weights, and its config."""
    from transformers import AutoConfig

    common = dict(hidden_size=args.hidden, num_experts_per_tok=args.top_k,
                  num_attention_heads=8, num_key_value_heads=8)
    if arch == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        cfg = AutoConfig.for_model(arch, num_experts=args.experts, moe_intermediate_size=args.inter,
                                   norm_topk_prob=True, **common)
    elif arch == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        cfg = AutoConfig.for_model(arch, num_local_experts=args.experts, intermediate_size=args.inter, **common)
    else:
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE as Block

        cfg = AutoConfig.for_model(arch, n_routed_experts=args.experts, moe_intermediate_size=args.inter,
                                   n_group=args.groups, topk_group=args.groups // 2, n_shared_experts=1,
                                   routed_scaling_factor=2.5, norm_topk_prob=True, **common)
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    block = Block(cfg).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, args.hidden**-0.5)
        for name, buf in block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.05)
    return block, cfg


def dense_gemms(cfg: MoEConfig, tokens: int) -> Callable[[], object]:
    """The layer's GEMMs as contiguous dense matmuls (same FLOPs)."""
    h, i, rows = cfg.hidden_size, cfg.intermediate_size, tokens * cfg.top_k
    x, routed_x, routed_a = torch.randn(tokens, h), torch.randn(rows, h), torch.randn(rows, i)
    w_gate, w_up, w_down = torch.randn(h, cfg.num_experts), torch.randn(h, 2 * i), torch.randn(i, h)
    s = cfg.shared_intermediate_size
    shared = (torch.randn(h, 2 * s), torch.randn(tokens, s), torch.randn(s, h)) if s else None

    def run() -> object:
        out = [x @ w_gate, routed_x @ w_up, routed_a @ w_down]
        if shared is not None:
            out += [x @ shared[0], shared[1] @ shared[2]]
        return out

    return run


def time_min(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Interleaved rounds; the minimum wall time of each function (seconds)."""
    best = {name: float("inf") for name in fns}
    with torch.no_grad():
        for fn in fns.values():
            fn()  # warm-up
        for _ in range(rounds):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def bench(arch: str, tokens: int, args: argparse.Namespace) -> dict[str, float]:
    block, hf_cfg = hf_block(arch, args)
    config = MoEConfig.from_hf(hf_cfg.to_dict())
    layer = MoELayer(config, impl="ref")
    layer.load_hf_weights(block.state_dict(), "")
    x = torch.randn(tokens, args.hidden, generator=torch.Generator().manual_seed(1))

    def hf(impl: str) -> Callable[[], object]:
        def run() -> object:
            hf_cfg._experts_implementation = impl
            return block(x.unsqueeze(0))

        return run

    with torch.no_grad():
        diff = float((layer(x) - hf("eager")().squeeze(0)).abs().max())
    times = time_min(
        {"hf eager": hf("eager"), "hf grouped_mm": hf("grouped_mm"), "ours": lambda: layer(x),
         "dense": dense_gemms(config, tokens)},
        args.rounds,
    )
    return times | {"max |diff|": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--inter", type=int, default=256, help="per-expert intermediate size")
    parser.add_argument("--groups", type=int, default=8, help="GLM-4-MoE n_group (topk_group = half)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, two rounds: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.hidden, args.experts, args.top_k, args.inter, args.rounds = [64], 128, 16, 4, 32, 2
        args.groups = 4
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads={torch.get_num_threads()} H={args.hidden} E={args.experts} k={args.top_k} "
          f"I={args.inter} (times: min of {args.rounds} interleaved rounds, ms)")
    head = f"{'arch':<10} {'T':>5} {'hf eager':>9} {'hf gmm':>9} {'ours':>9} {'dense':>9} " \
           f"{'speedup':>8} {'of dense':>8} {'max|diff|':>10}"
    print(head)
    print("-" * len(head))
    for arch in args.archs:
        for tokens in args.tokens:
            r = bench(arch, tokens, args)
            best_hf = min(r["hf eager"], r["hf grouped_mm"])
            print(f"{arch:<10} {tokens:>5} {r['hf eager'] * 1e3:>9.1f} {r['hf grouped_mm'] * 1e3:>9.1f} "
                  f"{r['ours'] * 1e3:>9.1f} {r['dense'] * 1e3:>9.1f} {best_hf / r['ours']:>7.2f}x "
                  f"{r['dense'] / r['ours']:>7.0%} {r['max |diff|']:>10.1e}")


if __name__ == "__main__":
    main()
