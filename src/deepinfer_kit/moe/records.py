"""Records of the moe package: a routing decision and tokens grouped by expert.

Shape symbols: ``T`` tokens, ``H`` hidden size, ``E`` experts, ``k`` experts per token,
``M`` routed token copies held by this rank (``T * k`` on a single device).
"""

from __future__ import annotations

import attrs
import torch

__all__ = ["Routing", "Dispatched"]


@attrs.define(slots=True, eq=False)
class Routing:
    """Which experts each token goes to, and with what combine weight.

    Attributes:
        expert_ids: ``[T, k]`` int64 logical expert ids in ``[0, E)``, on the device of
            the hidden states.
        weights: ``[T, k]`` float32 combine weights.
    """

    expert_ids: torch.Tensor
    weights: torch.Tensor

    def expert_counts(self, num_experts: int) -> torch.Tensor:
        """``[E]`` int64 tokens routed to each expert (what EPLB records)."""
        return torch.bincount(self.expert_ids.flatten(), minlength=num_experts)


@attrs.define(slots=True, eq=False)
class Dispatched:
    """Token copies grouped contiguously by (local) expert.

    Attributes:
        hidden: ``[M, H]`` token copies, expert 0's first.
        expert_counts: ``[E_local]`` int64 copies per local expert (on the host, so grouped
            compute can split without a device sync).
        weights: ``[M]`` float32 combine weight of each copy.
        order: ``[M]`` int64, position of each copy in the flattened ``[T * k]`` routing
            (what ``combine`` uses to return results to their tokens).
        num_tokens: ``T`` of the batch that was dispatched.
        state: dispatcher-private data needed by ``combine`` (e.g. all-to-all splits).
    """

    hidden: torch.Tensor
    expert_counts: torch.Tensor
    weights: torch.Tensor
    order: torch.Tensor
    num_tokens: int
    state: object | None = None
