"""Route, dispatch, compute and combine one batch through an MoE layer, with no engine.

    .venv/bin/python examples/moe_layer_alone.py

Builds a small DeepSeek-V3-routed layer (groups, correction bias, shared expert) with
random weights, then does by hand what ``MoELayer.forward`` does, step by step, and checks
that both agree.
"""

from __future__ import annotations

import torch

from deepinfer_kit.moe import LocalDispatcher, MoEConfig, MoELayer


def main() -> None:
    config = MoEConfig(
        hidden_size=32,
        num_experts=8,
        top_k=2,
        intermediate_size=16,
        routing="deepseek_v3",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        num_shared_experts=1,
        shared_intermediate_size=16,
    )
    layer = MoELayer(config, impl="ref")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
        layer.gate.get_buffer("e_score_correction_bias").copy_(torch.randn(8, generator=gen) * 0.1)

    hidden = torch.randn(6, 32, generator=gen)  # [T, H]: six tokens

    # 1. gating: k experts per token and their combine weights
    routing = layer.gate(hidden)
    print("experts per token:\n", routing.expert_ids.tolist())
    print("weights (sum = routed_scaling_factor):\n", routing.weights.sum(dim=1).tolist())

    # 2. dispatch: token copies grouped by expert, with per-expert counts
    dispatcher = LocalDispatcher(config.num_experts)
    dispatched = dispatcher.dispatch(hidden, routing)
    print("copies per expert:", dispatched.expert_counts.tolist())

    # 3. grouped expert compute over the expert-contiguous copies
    expert_out = layer.experts(dispatched.hidden, dispatched.expert_counts.tolist())

    # 4. combine: y = sum_e w_e E_e(x), then add the shared expert
    routed = dispatcher.combine(expert_out, dispatched)
    assert layer.shared_experts is not None
    by_hand = routed + layer.shared_experts(hidden)

    with torch.no_grad():
        by_layer = layer(hidden)
    print("max |by hand - layer|:", float((by_hand - by_layer).abs().max()))
    print("tokens per expert this step (for EPLB):", layer.last_expert_counts)
    torch.testing.assert_close(by_hand, by_layer, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    main()
