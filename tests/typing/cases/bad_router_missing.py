"""A Router missing the ``top_k`` member: mypy --strict must reject it."""

from __future__ import annotations

import torch

from deepinfer_kit.moe import Router, Routing


class HalfRouter:
    @property
    def num_experts(self) -> int:
        return 4

    def __call__(self, hidden: torch.Tensor) -> Routing:
        ids = torch.zeros(hidden.shape[0], 1, dtype=torch.int64)
        return Routing(expert_ids=ids, weights=torch.ones(hidden.shape[0], 1))


_check: type[Router] = HalfRouter  # error: missing member top_k
