"""Records of the moe package: a routing decision and token copies grouped by expert.

Shape symbols: ``T`` tokens, ``H`` hidden size, ``E`` logical experts, ``k`` experts per
token, ``S`` physical expert slots held by this rank (``E`` on a single device), ``M``
routed token copies held by this rank (``T * k`` on a single device).
The layer config, :class:`~deepinfer_kit.moe.config.MoEConfig`, lives in ``config.py``.
"""

from __future__ import annotations

import attrs
import torch

__all__ = ["Routing", "Dispatched"]


@attrs.define(slots=True, eq=False)
class Routing:
    """Which experts each token goes to, and with what combine weight.

    Attributes:
        expert_ids: ``[T, k]`` int64 logical expert ids in ``[0, E)``, distinct per row, on
            the device of the hidden states.
        weights: ``[T, k]`` float32 combine weights.
    """

    expert_ids: torch.Tensor  # [T, k] int64
    weights: torch.Tensor  # [T, k] float32

    def expert_counts(self, num_experts: int) -> torch.Tensor:
        """``[E]`` int64 token copies routed to each logical expert (what EPLB records).

        Same device as ``expert_ids``; sums to ``T * k``.
        """
        return torch.bincount(self.expert_ids.flatten(), minlength=num_experts)


@attrs.define(slots=True, eq=False)
class Dispatched:
    """Token copies grouped contiguously by the (local, physical) expert that computes them.

    Attributes:
        hidden: ``[M, H]`` token copies, local expert slot 0's first.
        expert_counts: ``[S]`` int64 on the host: copies per local expert slot (grouped
            compute splits on it without a device sync). Sums to ``M``.
        weights: ``[M]`` float32 combine weight of each copy (informative: ``combine``
            applies the weights itself, so expert outputs are passed in unweighted).
        order: ``[M]`` int64. Single device: position of each copy in the flattened
            ``[T * k]`` routing. Expert-parallel: position of each copy in this rank's
            receive buffer.
        num_tokens: ``T`` of the batch that was dispatched.
        routed_counts: ``[E]`` int64 on the host: copies of this rank's ``T`` tokens routed
            to each logical expert (``routing.expert_counts(E)``, sums to ``T * k``); the
            dispatcher counts them anyway to check the ids, and the layer reports them for
            EPLB without counting again.
        load_counts: ``[E]`` int64 on the host: copies routed to each logical expert by
            every rank of an expert-parallel group (all-gathered: the whole load the
            experts serve, what EPLB records there), or ``None`` on one device (then
            ``routed_counts`` is the whole load).
        state: dispatcher-private data needed by ``combine`` (e.g. all-to-all splits).
    """

    hidden: torch.Tensor  # [M, H]
    expert_counts: torch.Tensor  # [S] int64, CPU
    weights: torch.Tensor  # [M] float32
    order: torch.Tensor  # [M] int64
    num_tokens: int
    routed_counts: torch.Tensor  # [E] int64, CPU
    state: object | None = None
    load_counts: torch.Tensor | None = None  # [E] int64, CPU
