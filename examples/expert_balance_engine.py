"""Live expert rebalancing in the engine: replicas of hot experts, rebalanced every few steps.

    .venv/bin/python examples/expert_balance_engine.py

Runs the embedded MoE model twice on the same prompts, once plain and once with EPLB on
(12 physical slots for 8 experts over 4 virtual GPUs, a plan every 4 steps from a
window of 8), checks the greedy tokens are identical, and prints what each rebalance did
and the load per GPU before and after the first one.
"""

from __future__ import annotations

from deepinfer_kit import Engine, SamplingParams, build_engine
from deepinfer_kit.eplb import EplbConfig, text_heatmap

PROMPTS = [
    "A mixture-of-experts layer routes every token to a few experts.",
    "Hot experts get replicas; cold ones share a GPU.",
    "The routing table changes between steps, never inside one.",
]


def generate(eplb: EplbConfig | None) -> tuple[list[list[int]], Engine]:
    engine = build_engine(max_model_len=256, num_blocks=64, eplb=eplb)
    params = SamplingParams(max_tokens=16)
    ids = [engine.add_request(None, p, params) for p in PROMPTS]
    finished = {o.request_id: o for o in engine.run()}
    engine.check_idle()  # every block back in the pool, no request held
    return [finished[i].outputs[0].token_ids for i in ids], engine


def main() -> None:
    plain, _ = generate(None)
    config = EplbConfig(window=8, interval=4, policy="movement", num_redundant=4, num_gpus=4)
    balanced, engine = generate(config)
    if balanced != plain:
        raise SystemExit("rebalancing changed the greedy tokens")
    balancer = engine.balancer
    assert balancer is not None
    print(f"greedy tokens identical with and without EPLB ({len(balancer.history)} rebalances)")
    for r in balancer.history:
        print(
            f"after step {r.after_step}: mean/max GPU load {r.balancedness_before:.3f} -> "
            f"{r.balancedness_after:.3f}, {r.moved_slots} slots copied ({r.moved_bytes} bytes)"
        )
    first = balancer.history[0]
    scale = float(max(first.before.max(), first.after.max()))
    print(text_heatmap(first.before, "before the first rebalance:", scale=scale))
    print(text_heatmap(first.after, "after it:", scale=scale))


if __name__ == "__main__":
    main()
