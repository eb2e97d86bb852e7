"""Routers: softmax top-k (Mixtral, Qwen-MoE) and DeepSeek-V3 biased group-limited top-k.

Both are ``nn.Module``s holding the gate weight ``[E, H]`` (float32, whatever the model
dtype: routing decisions are sensitive to rounding) and are pure functions of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.invariant import PLAIN, Numerics
from deepinfer_kit.moe.config import check_expert_groups
from deepinfer_kit.moe.protocols import Router
from deepinfer_kit.moe.records import Routing
from deepinfer_kit.moe.ref_ops import deepseek_v3_topk, softmax_topk, topk_softmax

__all__ = ["SoftmaxTopKRouter", "DeepSeekV3Router"]


def _require_positive_ints(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")


def _check_sizes(hidden_size: int, num_experts: int, top_k: int) -> None:
    _require_positive_ints(hidden_size=hidden_size, num_experts=num_experts, top_k=top_k)
    if top_k > num_experts:
        raise ConfigError(f"top_k must be <= num_experts ({num_experts}), got {top_k}")


class _GateRouter(nn.Module):
    """Shared part of both routers: the ``[E, H]`` gate and the Router properties."""

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, *, device: torch.device | str | None
    ) -> None:
        super().__init__()
        _check_sizes(hidden_size, num_experts, top_k)
        self._num_experts = num_experts
        self._top_k = top_k
        self.weight = nn.Parameter(
            torch.zeros(num_experts, hidden_size, dtype=torch.float32, device=device),
            requires_grad=False,
        )
        self.numerics: Numerics = PLAIN  # the model sets the batch-invariant one
        self.bias: nn.Parameter | None = None  # [E] float32 logit bias (gpt-oss), when the router has one

    @property
    def num_experts(self) -> int:
        """``E``, logical experts."""
        return self._num_experts

    @property
    def top_k(self) -> int:
        """``k``, experts per token."""
        return self._top_k

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` float32 router logits of ``hidden`` (``[T, H]``), plus :attr:`bias`
        when the router has one."""
        return self.numerics.linear(hidden.float(), self.weight, self.bias)

    def __call__(self, hidden: torch.Tensor) -> Routing:
        """Route ``hidden`` (``[T, H]``); see ``forward``."""
        return cast(Routing, super().__call__(hidden))


class SoftmaxTopKRouter(_GateRouter):
    """Softmax over all ``E`` logits, keep the top ``k``; optionally renormalize them.

    Args:
        hidden_size: ``H``.
        num_experts: ``E``.
        top_k: ``k``.
        renormalize: divide the ``k`` weights by their sum (Mixtral: True; Qwen3-MoE:
            ``norm_topk_prob``); no effect with ``softmax_after_topk``.
        bias: the logits carry a learned bias :attr:`bias` (``[E]`` float32, zeros until
            loaded; gpt-oss ``router.bias``).
        softmax_after_topk: keep the top ``k`` logits, then a softmax over those ``k``
            (gpt-oss's order, :func:`~deepinfer_kit.moe.ref_ops.topk_softmax`) instead of
            a softmax over all ``E`` first.
        device: where the gate weight lives.

    Raises:
        ConfigError: a size is not a positive int, or ``top_k > num_experts``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        renormalize: bool = True,
        bias: bool = False,
        softmax_after_topk: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(hidden_size, num_experts, top_k, device=device)
        self.renormalize = renormalize
        self.softmax_after_topk = softmax_after_topk
        if bias:
            self.bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32, device=device),
                                     requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> Routing:
        """Route ``hidden`` (``[T, H]``, any float dtype) to ``k`` experts each.

        Returns:
            ids ``[T, k]`` int64 and float32 weights, on the device of ``hidden``. Pure.
        """
        if self.softmax_after_topk:
            ids, weights = topk_softmax(self.logits(hidden), self._top_k)
        else:
            ids, weights = softmax_topk(self.logits(hidden), self._top_k, renormalize=self.renormalize)
        return Routing(expert_ids=ids, weights=weights)


class DeepSeekV3Router(_GateRouter):
    """Sigmoid scores; selection on scores + correction bias within the best groups.

    Combine weights come from the unbiased scores of the selected experts, renormalized
    (when asked) and multiplied by ``routed_scaling_factor``. The bias is a buffer
    ``e_score_correction_bias`` (``[E]`` float32), as in DeepSeek-V3 / GLM-4-MoE
    checkpoints.

    Args:
        hidden_size: ``H``.
        num_experts: ``E`` (divisible by ``n_group``).
        top_k: ``k``.
        n_group: expert groups; 1 disables group-limited selection.
        topk_group: groups a token may pick experts from.
        renormalize: ``norm_topk_prob``.
        routed_scaling_factor: multiplies the final weights.
        device: where the gate weight and bias live.

    Raises:
        ConfigError: bad sizes, ``E % n_group != 0``, groups of fewer than 2 experts,
            ``topk_group > n_group``, or fewer than ``k`` experts in the kept groups.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        n_group: int = 1,
        topk_group: int = 1,
        renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(hidden_size, num_experts, top_k, device=device)
        _require_positive_ints(n_group=n_group, topk_group=topk_group)
        check_expert_groups(num_experts, top_k, n_group, topk_group)
        self.n_group = n_group
        self.topk_group = topk_group
        self.renormalize = renormalize
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32, device=device)
        )

    def forward(self, hidden: torch.Tensor) -> Routing:
        """Route ``hidden`` (``[T, H]``, any float dtype) to ``k`` experts each.

        Returns:
            ids ``[T, k]`` int64 and float32 weights, on the device of ``hidden``. Pure.
        """
        bias = self.get_buffer("e_score_correction_bias")
        ids, weights = deepseek_v3_topk(
            self.logits(hidden),
            bias,
            self._top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            renormalize=self.renormalize,
            scaling=self.routed_scaling_factor,
            sigmoid=self.numerics.sigmoid,
        )
        return Routing(expert_ids=ids, weights=weights)


if TYPE_CHECKING:
    _check_softmax: type[Router] = SoftmaxTopKRouter
    _check_deepseek: type[Router] = DeepSeekV3Router
