"""Routed experts with projection biases and/or gpt-oss's clamped SwiGLU: the torch reference.

The plain bias-free SwiGLU experts of every other family run ``ref_ops`` unchanged; a layer
whose :class:`~deepinfer_kit.moe.config.MoEConfig` asks for ``expert_bias`` or
``expert_activation="clamped_swiglu"`` runs these instead (the Triton kernels take the same
options, ``triton_ops``). The weights keep the kit's layout: ``gate_up`` ``[S, 2I, H]``
(the ``I`` gate rows, then the ``I`` up rows), ``down`` ``[S, H, I]``, biases
``gate_up_bias`` ``[S, 2I]`` (same split) and ``down_bias`` ``[S, H]``.

Per expert ``e`` and row ``x``: ``h = x W_gu[e]^T + b_gu[e]``, ``a = act(h)``,
``y = a W_d[e]^T + b_d[e]``; a routed copy adds ``w * y`` to its token (the bias is
scaled by the combine weight too, as in transformers' ``GptOssExperts``).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from deepinfer_kit.models.invariant import PLAIN, Numerics
from deepinfer_kit.moe.config import ExpertActivationKind, MoEConfig
from deepinfer_kit.moe.local_dispatcher import sort_by_expert, unpermute_and_sum
from deepinfer_kit.moe.records import Routing

__all__ = ["ExpertActivation", "grouped_experts", "routed_experts"]


@attrs.frozen(slots=True)
class ExpertActivation:
    """The activation between an expert's two projections.

    Attributes:
        kind: ``"swiglu"``: ``silu(gate) * up``; ``"clamped_swiglu"`` (gpt-oss):
            ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
            ``(u + 1) * (g * sigmoid(alpha * g))``.
        alpha: the sigmoid gain of ``"clamped_swiglu"``.
        limit: the clamp of ``"clamped_swiglu"``.
    """

    kind: ExpertActivationKind = "swiglu"
    alpha: float = 1.702
    limit: float = 7.0

    @classmethod
    def of(cls, config: MoEConfig) -> ExpertActivation:
        """The activation ``config`` names (its ``swiglu_alpha`` and ``swiglu_limit``)."""
        return cls(config.expert_activation, config.swiglu_alpha, config.swiglu_limit)

    @property
    def clamped(self) -> bool:
        """True for gpt-oss's clamped SwiGLU."""
        return self.kind == "clamped_swiglu"

    def __call__(self, h: torch.Tensor, numerics: Numerics = PLAIN) -> torch.Tensor:
        """``h`` ``[N, 2I]`` (gate columns, then up columns) -> a new ``[N, I]`` tensor in
        its dtype, on its device; the sigmoid or silu through ``numerics``."""
        inter = h.shape[1] // 2
        gate, up = h[:, :inter], h[:, inter:]
        if not self.clamped:
            return numerics.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * numerics.sigmoid(gate * self.alpha)
        return (up + 1) * glu


def _expert(x: torch.Tensor, expert: int, gate_up: torch.Tensor, down: torch.Tensor,
            act: ExpertActivation, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
            numerics: Numerics) -> torch.Tensor:
    """Expert ``expert`` on the rows ``x`` ``[N, H]`` -> ``[N, H]`` (unweighted)."""
    h = numerics.linear(x, gate_up[expert], None)
    if gate_up_bias is not None:
        h = h + gate_up_bias[expert]
    out = numerics.linear(act(h, numerics), down[expert], None)
    return out if down_bias is None else out + down_bias[expert]


def grouped_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts: Sequence[int],
    act: ExpertActivation,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    numerics: Numerics = PLAIN,
) -> torch.Tensor:
    """Experts over expert-contiguous rows (``ref_ops.grouped_swiglu`` with biases and
    ``act``). Mutates nothing.

    Args:
        x: ``[M, H]`` rows grouped by expert (expert 0's ``counts[0]`` rows first).
        gate_up: ``[S, 2I, H]``; down: ``[S, H, I]``.
        counts: ``S`` host ints summing to ``M``.
        act: the activation.
        gate_up_bias: ``[S, 2I]`` or ``None``; down_bias: ``[S, H]`` or ``None``.
        numerics: the matmul and activations (the batch-invariant ones keep a row's
            output independent of how many rows share its expert).

    Returns:
        ``[M, H]`` unweighted expert outputs in the dtype of ``x``, aligned with ``x``.
    """
    out = torch.empty(x.shape[0], down.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        out[start:end] = _expert(x[start:end], expert, gate_up, down, act, gate_up_bias, down_bias, numerics)
        start = end
    return out


def routed_experts(
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: ExpertActivation,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    numerics: Numerics = PLAIN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token through its ``k`` experts, weighted and summed; all experts local
    (``ref_ops.routed_swiglu`` with biases and ``act``).

    Experts run in increasing id order, each gathering its tokens, scaling its output
    rows (bias included) by their combine weights and adding them into the result, the
    order transformers' ``GptOssExperts`` uses. With batch-invariant ``numerics`` the
    copies are computed grouped and summed in routing order instead (as
    ``ref_ops.routed_swiglu`` does). One host read of the counts. Mutates nothing.

    Args:
        hidden: ``[T, H]`` (cast to the weight dtype).
        expert_ids: ``[T, k]`` int64 in ``[0, S)``; weights: ``[T, k]``.
        gate_up, down, act, gate_up_bias, down_bias, numerics: as :func:`grouped_experts`.

    Returns:
        ``(y [T, H] in the weight dtype, counts [S] int64 on the host)``.

    Raises:
        ConfigError: an id outside ``[0, S)``.
    """
    order, counts = sort_by_expert(Routing(expert_ids=expert_ids, weights=weights), gate_up.shape[0])
    top_k = expert_ids.shape[1]
    x = hidden.to(gate_up.dtype)
    tokens = order // top_k
    if numerics.invariant:
        rows = grouped_experts(x.index_select(0, tokens), gate_up, down, counts.tolist(), act,
                               gate_up_bias=gate_up_bias, down_bias=down_bias, numerics=numerics)
        return unpermute_and_sum(rows, order, weights), counts
    flat_weights = weights.reshape(-1).index_select(0, order).to(x.dtype).unsqueeze(1)
    out = torch.zeros(x.shape[0], down.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        end = start + count
        rows = tokens[start:end]
        y = _expert(x.index_select(0, rows), expert, gate_up, down, act, gate_up_bias, down_bias, numerics)
        out.index_add_(0, rows, y * flat_weights[start:end])
        start = end
    return out, counts
