"""MoEConfig: the shape and routing rule of one MoE layer, and its reading from HF configs."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from deepinfer_kit._validators import int_at_least, one_of
from deepinfer_kit.errors import ConfigError

__all__ = ["MoEConfig", "RoutingKind", "ExpertActivationKind", "ExpertLayout",
           "SUPPORTED_HF_MODEL_TYPES", "check_expert_groups"]

RoutingKind = Literal["softmax", "deepseek_v3", "topk_softmax"]
ExpertActivationKind = Literal["swiglu", "clamped_swiglu"]
ExpertLayout = Literal["standard", "gpt_oss"]

SUPPORTED_HF_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "gpt_oss", "deepseek_v3")
"""``model_type`` values :meth:`MoEConfig.from_hf` understands."""


def _positive_finite(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{attribute.name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{attribute.name} must be finite and > 0, got {value!r}")


def check_expert_groups(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """Raise ``ConfigError`` unless ``top_k`` experts can be picked from ``topk_group`` of
    ``n_group`` equal groups of ``num_experts`` (group-limited routing; sizes are ints >= 1).

    Shared by :class:`MoEConfig` and :class:`~deepinfer_kit.moe.DeepSeekV3Router`.
    """
    if num_experts % n_group:
        raise ConfigError(f"n_group must divide num_experts ({num_experts}), got {n_group}")
    if topk_group > n_group:
        raise ConfigError(f"topk_group must be <= n_group ({n_group}), got {topk_group}")
    if n_group > 1:
        per_group = num_experts // n_group
        if per_group < 2:
            raise ConfigError(
                f"n_group must leave >= 2 experts per group (group score = top-2 sum), "
                f"got {n_group} groups of {per_group}"
            )
        if topk_group * per_group < top_k:
            raise ConfigError(
                f"topk_group must keep >= top_k ({top_k}) experts, got {topk_group} "
                f"groups of {per_group}"
            )


def _is_bool(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name} must be a bool, got {value!r}")


@attrs.frozen(slots=True)
class MoEConfig:
    """One MoE layer: routed experts, their router, and optional shared experts.

    Every field is validated when the object is built (``ConfigError`` names the field).

    Attributes:
        hidden_size: ``H``.
        num_experts: ``E``, routed (logical) experts.
        top_k: ``k``, experts per token; ``1 <= k <= E``.
        intermediate_size: SwiGLU intermediate size of each routed expert.
        routing: ``"softmax"`` (softmax over all experts, then top-k: Mixtral, Qwen-MoE),
            ``"deepseek_v3"`` (sigmoid scores, biased group-limited selection: GLM-4-MoE,
            DeepSeek-V3) or ``"topk_softmax"`` (top-k of the logits, then a softmax over
            those ``k``: gpt-oss).
        norm_topk_prob: renormalize the ``k`` selected weights to sum to 1 (no effect with
            ``"topk_softmax"``, whose ``k`` weights already sum to 1).
        n_group: expert groups for group-limited selection (``E`` divisible by it).
        topk_group: groups kept per token; ``1 <= topk_group <= n_group``.
        routed_scaling_factor: multiplies the routed weights (after renormalization).
        num_shared_experts: shared experts (0 = none); they are stored fused as one MLP.
        shared_intermediate_size: total intermediate size of the shared experts
            (``> 0`` exactly when ``num_shared_experts > 0``).
        shared_expert_gate: Qwen2-MoE style: the shared output is scaled by
            ``sigmoid(x @ w_gate)`` with ``w_gate`` of shape ``[1, H]``.
        hidden_act: the expert activation; only ``"silu"`` (SwiGLU) is supported.
        router_bias: the router's linear has a bias ``[E]`` (gpt-oss ``router.bias``);
            softmax routings only.
        expert_bias: each routed expert's gate/up and down projections have biases
            (``[2I]`` and ``[H]``: gpt-oss).
        expert_activation: ``"swiglu"`` (``silu(gate) * up``) or ``"clamped_swiglu"``
            (gpt-oss: ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
            ``(u + 1) * g * sigmoid(alpha * g)``).
        swiglu_alpha: ``alpha`` of ``"clamped_swiglu"`` (finite, > 0).
        swiglu_limit: ``limit`` of ``"clamped_swiglu"`` (finite, > 0).
        expert_layout: how the checkpoint names and stores the layer's tensors:
            ``"standard"`` (``gate.weight``, per-expert or ``[E, 2I, H]`` fused experts) or
            ``"gpt_oss"`` (``router.weight``/``router.bias``, ``experts.gate_up_proj``
            ``[E, H, 2I]`` with gate and up interleaved in its columns, its bias
            ``[E, 2I]``, ``experts.down_proj`` ``[E, I, H]`` and ``down_proj_bias``).
    """

    hidden_size: int = attrs.field(validator=int_at_least(1))
    num_experts: int = attrs.field(validator=int_at_least(1))
    top_k: int = attrs.field(validator=int_at_least(1))
    intermediate_size: int = attrs.field(validator=int_at_least(1))
    routing: RoutingKind = attrs.field(
        default="softmax", validator=one_of(("softmax", "deepseek_v3", "topk_softmax"))
    )
    norm_topk_prob: bool = attrs.field(default=True, validator=_is_bool)
    n_group: int = attrs.field(default=1, validator=int_at_least(1))
    topk_group: int = attrs.field(default=1, validator=int_at_least(1))
    routed_scaling_factor: float = attrs.field(default=1.0, validator=_positive_finite)
    num_shared_experts: int = attrs.field(default=0, validator=int_at_least(0))
    shared_intermediate_size: int = attrs.field(default=0, validator=int_at_least(0))
    shared_expert_gate: bool = attrs.field(default=False, validator=_is_bool)
    hidden_act: str = attrs.field(default="silu", validator=one_of(("silu",)))
    router_bias: bool = attrs.field(default=False, validator=_is_bool)
    expert_bias: bool = attrs.field(default=False, validator=_is_bool)
    expert_activation: ExpertActivationKind = attrs.field(
        default="swiglu", validator=one_of(("swiglu", "clamped_swiglu")))
    swiglu_alpha: float = attrs.field(default=1.702, validator=_positive_finite)
    swiglu_limit: float = attrs.field(default=7.0, validator=_positive_finite)
    expert_layout: ExpertLayout = attrs.field(default="standard", validator=one_of(("standard", "gpt_oss")))

    def __attrs_post_init__(self) -> None:
        if self.router_bias and self.routing == "deepseek_v3":
            raise ConfigError("router_bias needs a softmax routing, got routing 'deepseek_v3'")
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"top_k must be <= num_experts ({self.num_experts}), got {self.top_k}"
            )
        if self.n_group > 1 and self.routing != "deepseek_v3":
            raise ConfigError(f"n_group > 1 needs routing 'deepseek_v3', got {self.routing!r}")
        check_expert_groups(self.num_experts, self.top_k, self.n_group, self.topk_group)
        if (self.num_shared_experts > 0) != (self.shared_intermediate_size > 0):
            raise ConfigError(
                "shared_intermediate_size must be > 0 exactly when num_shared_experts > 0, got "
                f"{self.shared_intermediate_size} with num_shared_experts={self.num_shared_experts}"
            )
        if self.shared_expert_gate and self.num_shared_experts == 0:
            raise ConfigError("shared_expert_gate must be False when num_shared_experts == 0, got True")
        if self.expert_layout == "gpt_oss" and self.num_shared_experts:
            raise ConfigError(f"expert_layout 'gpt_oss' has no shared experts, got "
                              f"num_shared_experts={self.num_shared_experts}")

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> MoEConfig:
        """Read the MoE layer of a Hugging Face ``config.json`` dict.

        Supports ``model_type`` ``qwen3_moe``, ``qwen2_moe``, ``mixtral``, ``glm4_moe``,
        ``gpt_oss`` and ``deepseek_v3`` (read as ``glm4_moe``: transformers' DeepSeek-V3 router,
        experts and shared experts are GLM-4-MoE's).
        Which layers are MoE (``first_k_dense_replace``, ``decoder_sparse_step``,
        ``mlp_only_layers``) is the model's business, not this config's.

        Raises:
            ConfigError: unknown ``model_type``, a missing key, or a bad value.
        """
        model_type = config.get("model_type")
        reader = _READERS.get(str(model_type))
        if reader is None:
            raise ConfigError(
                f"model_type must be one of {list(SUPPORTED_HF_MODEL_TYPES)} for an MoE layer, "
                f"got {model_type!r}"
            )
        return cls(**reader(config))


def _get(config: Mapping[str, Any], *keys: str, default: Any = ...) -> Any:
    for key in keys:
        if key in config and config[key] is not None:
            return config[key]
    if default is ...:
        raise ConfigError(f"{' or '.join(keys)} missing from the {config.get('model_type')} config")
    return default


def _num_experts(config: Mapping[str, Any]) -> Any:
    # transformers 5.x writes num_local_experts even for Qwen3-MoE; released checkpoints
    # use num_experts (Qwen) or n_routed_experts (GLM / DeepSeek).
    return _get(config, "num_experts", "n_routed_experts", "num_local_experts")


def _common(config: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "hidden_size": _get(config, "hidden_size"),
        "num_experts": _num_experts(config),
        "top_k": _get(config, "num_experts_per_tok"),
        "hidden_act": _get(config, "hidden_act", default="silu"),
    }


def _qwen3_moe(config: Mapping[str, Any]) -> dict[str, Any]:
    return _common(config) | {
        "intermediate_size": _get(config, "moe_intermediate_size"),
        "routing": "softmax",
        "norm_topk_prob": _get(config, "norm_topk_prob", default=False),
    }


def _qwen2_moe(config: Mapping[str, Any]) -> dict[str, Any]:
    shared = _get(config, "shared_expert_intermediate_size", default=0)
    return _qwen3_moe(config) | {
        "num_shared_experts": 1 if shared else 0,
        "shared_intermediate_size": shared,
        "shared_expert_gate": bool(shared),
    }


def _mixtral(config: Mapping[str, Any]) -> dict[str, Any]:
    return _common(config) | {
        "intermediate_size": _get(config, "intermediate_size"),
        "routing": "softmax",
        "norm_topk_prob": True,
    }


def _glm4_moe(config: Mapping[str, Any]) -> dict[str, Any]:
    moe_inter = _get(config, "moe_intermediate_size")
    n_shared = _get(config, "n_shared_experts", default=0)
    return _common(config) | {
        "intermediate_size": moe_inter,
        "routing": "deepseek_v3",
        "norm_topk_prob": _get(config, "norm_topk_prob", default=True),
        "n_group": _get(config, "n_group", default=1),
        "topk_group": _get(config, "topk_group", default=1),
        "routed_scaling_factor": float(_get(config, "routed_scaling_factor", default=1.0)),
        "num_shared_experts": n_shared,
        "shared_intermediate_size": moe_inter * n_shared if isinstance(n_shared, int) else 0,
    }


def _gpt_oss(config: Mapping[str, Any]) -> dict[str, Any]:
    # transformers' GptOssExperts ignore hidden_act: the clamped SwiGLU is the family's.
    return _common(config) | {
        "intermediate_size": _get(config, "intermediate_size"),
        "routing": "topk_softmax",
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "router_bias": True,
        "expert_bias": True,
        "expert_activation": "clamped_swiglu",
        "swiglu_alpha": _get(config, "swiglu_alpha", default=1.702),
        "swiglu_limit": _get(config, "swiglu_limit", default=7.0),
        "expert_layout": "gpt_oss",
    }


_READERS = {
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "glm4_moe": _glm4_moe,
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _glm4_moe,
}
