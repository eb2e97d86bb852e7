"""MoEConfig: validation names the field and value; from_hf reads each architecture."""

from __future__ import annotations

from typing import Any

import pytest

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.moe import MoEConfig

BASE: dict[str, Any] = dict(hidden_size=16, num_experts=8, top_k=2, intermediate_size=4)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"top_k": 0}, "top_k must be an int >= 1, got 0"),
        ({"top_k": 9}, "top_k must be <= num_experts (8), got 9"),
        ({"hidden_size": 2.0}, "hidden_size must be an int >= 1, got 2.0"),
        ({"routing": "sparsemax"}, "routing must be one of"),
        ({"routing": "deepseek_v3", "n_group": 3}, "n_group must divide num_experts (8), got 3"),
        ({"routing": "deepseek_v3", "n_group": 8}, "n_group must leave >= 2 experts per group"),
        ({"routing": "deepseek_v3", "n_group": 2, "topk_group": 3}, "topk_group must be <= n_group (2), got 3"),
        ({"n_group": 2}, "n_group > 1 needs routing 'deepseek_v3', got 'softmax'"),
        ({"routing": "deepseek_v3", "n_group": 4, "topk_group": 1, "top_k": 3}, "topk_group must keep >= top_k (3)"),
        ({"routed_scaling_factor": 0.0}, "routed_scaling_factor must be finite and > 0, got 0.0"),
        ({"num_shared_experts": 1}, "shared_intermediate_size must be > 0 exactly when"),
        ({"shared_expert_gate": True}, "shared_expert_gate must be False when num_shared_experts == 0"),
        ({"hidden_act": "gelu"}, "hidden_act must be one of ['silu'], got 'gelu'"),
        ({"norm_topk_prob": 1}, "norm_topk_prob must be a bool, got 1"),
    ],
)
def test_bad_fields_are_rejected_with_field_and_value(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        MoEConfig(**(BASE | changes))
    assert message in str(info.value)


def test_from_hf_qwen3_moe_both_expert_count_keys() -> None:
    hf = {"model_type": "qwen3_moe", "hidden_size": 64, "num_experts": 128, "num_experts_per_tok": 8,
          "moe_intermediate_size": 32, "norm_topk_prob": True, "intermediate_size": 999}
    cfg = MoEConfig.from_hf(hf)
    assert (cfg.num_experts, cfg.top_k, cfg.intermediate_size, cfg.routing) == (128, 8, 32, "softmax")
    assert cfg.norm_topk_prob and cfg.num_shared_experts == 0
    written_by_transformers_5 = dict(hf, num_local_experts=128)
    del written_by_transformers_5["num_experts"]
    assert MoEConfig.from_hf(written_by_transformers_5) == cfg


def test_from_hf_mixtral_glm_qwen2() -> None:
    mix = MoEConfig.from_hf({"model_type": "mixtral", "hidden_size": 64, "num_local_experts": 8,
                             "num_experts_per_tok": 2, "intermediate_size": 112})
    assert (mix.intermediate_size, mix.norm_topk_prob, mix.routing) == (112, True, "softmax")
    glm = MoEConfig.from_hf({"model_type": "glm4_moe", "hidden_size": 64, "n_routed_experts": 16,
                             "num_experts_per_tok": 4, "moe_intermediate_size": 8, "n_group": 4,
                             "topk_group": 2, "n_shared_experts": 2, "routed_scaling_factor": 2.5,
                             "norm_topk_prob": True})
    assert (glm.routing, glm.n_group, glm.topk_group, glm.routed_scaling_factor) == ("deepseek_v3", 4, 2, 2.5)
    assert (glm.num_shared_experts, glm.shared_intermediate_size, glm.shared_expert_gate) == (2, 16, False)
    qwen2 = MoEConfig.from_hf({"model_type": "qwen2_moe", "hidden_size": 64, "num_experts": 8,
                               "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                               "shared_expert_intermediate_size": 40, "norm_topk_prob": False})
    assert (qwen2.shared_intermediate_size, qwen2.shared_expert_gate, qwen2.norm_topk_prob) == (40, True, False)


def test_from_hf_rejects_unknown_architecture_and_missing_keys() -> None:
    with pytest.raises(ConfigError, match="model_type must be one of .* got 'llama'"):
        MoEConfig.from_hf({"model_type": "llama"})
    with pytest.raises(ConfigError, match="moe_intermediate_size missing from the qwen3_moe config"):
        MoEConfig.from_hf({"model_type": "qwen3_moe", "hidden_size": 8, "num_experts": 4, "num_experts_per_tok": 2})
