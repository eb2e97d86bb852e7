"""Reading one MoE layer's tensors out of a Hugging Face checkpoint's name -> tensor map.

Accepted names under the layer prefix (``model.layers.N.mlp.`` or, for Mixtral files,
``model.layers.N.block_sparse_moe.``):

- router: ``gate.weight`` ``[E, H]``; DeepSeek-V3 routing adds
  ``gate.e_score_correction_bias`` ``[E]``;
- routed experts, per expert (what ``save_pretrained`` writes and released checkpoints
  hold): ``experts.{e}.gate_proj.weight`` / ``up_proj.weight`` ``[I, H]`` and
  ``down_proj.weight`` ``[H, I]``, or Mixtral's ``experts.{e}.w1`` (gate) / ``w3`` (up) /
  ``w2`` (down); or fused (a transformers 5.x ``state_dict()``):
  ``experts.gate_up_proj`` ``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]``;
- shared experts: ``shared_experts.{gate,up,down}_proj.weight`` (GLM-4-MoE, DeepSeek) or
  ``shared_expert.{gate,up,down}_proj.weight`` plus ``shared_expert_gate.weight`` ``[1, H]``
  (Qwen2-MoE);
- gpt-oss (``MoEConfig.expert_layout == "gpt_oss"``): ``router.weight`` ``[E, H]`` and
  ``router.bias`` ``[E]``; ``experts.gate_up_proj`` ``[E, H, 2I]`` (``x @ W``, gate and up
  interleaved in its columns: gate ``[..., 0::2]``, up ``[..., 1::2]``),
  ``experts.gate_up_proj_bias`` ``[E, 2I]`` (interleaved alike), ``experts.down_proj``
  ``[E, I, H]`` and ``experts.down_proj_bias`` ``[E, H]``; stored de-interleaved and
  transposed into the kit's layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch

from deepinfer_kit.errors import CheckpointError
from deepinfer_kit.moe.config import MoEConfig

__all__ = ["LayerTensors", "read_moe_layer"]

_PER_EXPERT_NAMES = {
    "gate_proj": ("gate_proj", "up_proj", "down_proj"),
    "w1": ("w1", "w3", "w2"),
}


@attrs.define(slots=True, eq=False)
class LayerTensors:
    """The tensors of one MoE layer, in the layout :class:`MoELayer` stores.

    Attributes:
        gate: ``[E, H]`` router weight.
        bias: ``[E]`` selection bias, or None (softmax routing).
        gate_up: ``[S, 2I, H]`` the local experts' gate and up weights.
        down: ``[S, H, I]``.
        shared_gate_up: ``[2 I_s, H]`` or None.
        shared_down: ``[H, I_s]`` or None.
        shared_gate: ``[1, H]`` or None.
        gate_bias: ``[E]`` router logit bias (gpt-oss) or None.
        gate_up_bias: ``[S, 2I]`` the local experts' gate then up biases, or None.
        down_bias: ``[S, H]`` or None.
    """

    gate: torch.Tensor | None = None  # [E, H]
    bias: torch.Tensor | None = None  # [E]
    gate_up: torch.Tensor | None = None  # [S, 2I, H]
    down: torch.Tensor | None = None  # [S, H, I]
    shared_gate_up: torch.Tensor | None = None  # [2 I_s, H]
    shared_down: torch.Tensor | None = None  # [H, I_s]
    shared_gate: torch.Tensor | None = None  # [1, H]
    gate_bias: torch.Tensor | None = None  # [E]
    gate_up_bias: torch.Tensor | None = None  # [S, 2I]
    down_bias: torch.Tensor | None = None  # [S, H]


class _Reader:
    """Takes tensors by name, checking presence and shape; remembers what it took."""

    def __init__(self, weights: Mapping[str, torch.Tensor], prefix: str) -> None:
        self.weights = weights
        self.prefix = prefix
        self.expected: set[str] = set()

    def has(self, name: str) -> bool:
        return self.prefix + name in self.weights

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        full = self.prefix + name
        tensor = self.weights.get(full)
        if tensor is None:
            raise CheckpointError(f"missing tensor {full} (expected shape {list(shape)})")
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"tensor {full} must have shape {list(shape)}, got {list(tensor.shape)}"
            )
        self.expected.add(full)
        return tensor

    def allow(self, name: str) -> None:
        """Mark ``name`` as belonging to this layer without reading it (other ranks' experts)."""
        self.expected.add(self.prefix + name)

    def check_unexpected(self) -> None:
        extra = sorted(k for k in self.weights if k.startswith(self.prefix) and k not in self.expected)
        if extra:
            shown = ", ".join(extra[:5]) + (f" (+{len(extra) - 5} more)" if len(extra) > 5 else "")
            raise CheckpointError(f"unexpected tensor(s) for this MoE layer: {shown}")


def _read_routed(
    reader: _Reader, cfg: MoEConfig, local_experts: Sequence[int], out: LayerTensors
) -> None:
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    if reader.has("experts.gate_up_proj") or reader.has("experts.down_proj"):
        idx = torch.tensor(list(local_experts), dtype=torch.int64)
        out.gate_up = reader.take("experts.gate_up_proj", (e, 2 * i, h)).index_select(0, idx)
        out.down = reader.take("experts.down_proj", (e, h, i)).index_select(0, idx)
        return
    scheme = "w1" if reader.has("experts.0.w1.weight") else "gate_proj"
    g_name, u_name, d_name = _PER_EXPERT_NAMES[scheme]
    local = set(local_experts)
    for expert in range(e):
        if expert not in local:
            for name in (g_name, u_name, d_name):
                reader.allow(f"experts.{expert}.{name}.weight")
    gate_up, down = [], []
    for expert in local_experts:
        base = f"experts.{expert}."
        gate = reader.take(base + g_name + ".weight", (i, h))
        up = reader.take(base + u_name + ".weight", (i, h))
        gate_up.append(torch.cat([gate, up], dim=0))
        down.append(reader.take(base + d_name + ".weight", (h, i)))
    out.gate_up = torch.stack(gate_up)
    out.down = torch.stack(down)


def _read_gpt_oss(
    reader: _Reader, cfg: MoEConfig, local_experts: Sequence[int], out: LayerTensors
) -> None:
    """gpt-oss's router and fused experts (see the module docstring), de-interleaved:
    column ``2j`` of ``gate_up_proj`` is gate unit ``j``, column ``2j + 1`` up unit ``j``."""
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    out.gate = reader.take("router.weight", (e, h))
    if cfg.router_bias:
        out.gate_bias = reader.take("router.bias", (e,))
    idx = torch.tensor(list(local_experts), dtype=torch.int64)
    gate_up = reader.take("experts.gate_up_proj", (e, h, 2 * i)).index_select(0, idx)
    out.gate_up = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=2).transpose(1, 2).contiguous()
    out.down = reader.take("experts.down_proj", (e, i, h)).index_select(0, idx).transpose(1, 2).contiguous()
    if cfg.expert_bias:
        bias = reader.take("experts.gate_up_proj_bias", (e, 2 * i)).index_select(0, idx)
        out.gate_up_bias = torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1)
        out.down_bias = reader.take("experts.down_proj_bias", (e, h)).index_select(0, idx)


def _read_shared(reader: _Reader, cfg: MoEConfig, out: LayerTensors) -> None:
    if cfg.num_shared_experts == 0:
        return
    h, i = cfg.hidden_size, cfg.shared_intermediate_size
    base = "shared_expert." if cfg.shared_expert_gate else "shared_experts."
    gate = reader.take(base + "gate_proj.weight", (i, h))
    up = reader.take(base + "up_proj.weight", (i, h))
    out.shared_gate_up = torch.cat([gate, up], dim=0)
    out.shared_down = reader.take(base + "down_proj.weight", (h, i))
    if cfg.shared_expert_gate:
        out.shared_gate = reader.take("shared_expert_gate.weight", (1, h))


def read_moe_layer(
    weights: Mapping[str, torch.Tensor],
    prefix: str,
    cfg: MoEConfig,
    local_experts: Sequence[int],
) -> LayerTensors:
    """Collect one MoE layer's tensors from a whole checkpoint.

    Args:
        weights: every tensor of the checkpoint (name -> tensor, any device/dtype).
        prefix: the layer's MLP module prefix, e.g. ``"model.layers.3.mlp."`` (a missing
            trailing dot is added).
        cfg: the layer config (decides which tensors must be present and their shapes).
        local_experts: logical ids of the experts this rank holds, in slot order.

    Returns:
        :class:`LayerTensors` (views or copies of the checkpoint tensors; not yet cast).

    Raises:
        CheckpointError: a tensor is missing, has the wrong shape, or a tensor under
            ``prefix`` belongs to nothing this layer has; the message names the tensor.
    """
    if prefix and not prefix.endswith("."):
        prefix += "."
    reader = _Reader(weights, prefix)
    out = LayerTensors()
    if cfg.expert_layout == "gpt_oss":
        _read_gpt_oss(reader, cfg, local_experts, out)
        reader.check_unexpected()
        return out
    out.gate = reader.take("gate.weight", (cfg.num_experts, cfg.hidden_size))
    if cfg.routing == "deepseek_v3":
        out.bias = reader.take("gate.e_score_correction_bias", (cfg.num_experts,))
    _read_routed(reader, cfg, local_experts, out)
    _read_shared(reader, cfg, out)
    reader.check_unexpected()
    return out
