"""LayerTruncatedLM: a model's first ``k`` decoder layers and its LM head, as a CausalLM.

Self-speculation drafts with it: the view shares every parameter with the full model (no
copy; the embeddings, the first ``k`` layers, the final norm and the LM head are the same
tensors), and writes its KV into a cache of its own that holds only those ``k`` layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.causal_lm import TransformerCausalLM
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.protocols import PagedKVStore
from deepinfer_kit.models.records import ForwardBatch

if TYPE_CHECKING:
    from deepinfer_kit.models.protocols import CausalLM

__all__ = ["LayerTruncatedLM"]


class LayerTruncatedLM:
    """The first ``num_layers`` layers of ``model`` followed by its final norm and LM head.

    Args:
        model: the full model; its parameters are shared, never copied (a weight update
            of the model is seen by the view).
        num_layers: ``k``, in ``[1, model.config.num_layers]``.

    Attributes:
        config: the model's config with ``num_layers = k`` (and its per-layer lists cut),
            so a :class:`~deepinfer_kit.cache.kv_cache.PagedKVCache` sized from it holds
            exactly the view's layers.
        dtype: the model's parameter dtype.

    Raises:
        ConfigError: ``num_layers`` not an int in that range (names the field and value).
    """

    def __init__(self, model: TransformerCausalLM, num_layers: int) -> None:
        full = model.config.num_layers
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= full:
            raise ConfigError(
                f"speculative.draft_layers must be an int in [1, {full}] (the target's layers), "
                f"got {num_layers!r}"
            )
        self.model = model
        self.num_layers = num_layers
        self.dtype = model.dtype
        base = model.config
        self.config: ModelConfig = attrs.evolve(
            base,
            num_layers=num_layers,
            sliding_windows=base.sliding_windows[:num_layers],
            sparse_layers=tuple(i for i in base.sparse_layers if i < num_layers),
        )

    def __call__(self, batch: ForwardBatch, kv_cache: PagedKVStore) -> torch.Tensor:
        """Same as :meth:`forward`."""
        return self.forward(batch, kv_cache)

    def forward(self, batch: ForwardBatch, kv_cache: PagedKVStore) -> torch.Tensor:
        """The first ``k`` layers over ``batch``, then the final norm and the LM head.

        Writes layers ``0 .. k - 1`` of ``kv_cache``; reads nothing of the full model's
        cache. Returns ``[N, V]`` float32 logits of the rows ``batch.logits_indices``.
        """
        return self.model.forward_layers(batch, kv_cache, self.num_layers)

    def hidden(self, batch: ForwardBatch, kv_cache: PagedKVStore) -> torch.Tensor:
        """The first ``k`` layers over ``batch``, then the final norm: ``[N, H]`` hidden
        states (model dtype) of the rows ``batch.logits_indices`` (the DSpark drafter's
        backbone). Writes layers ``0 .. k - 1`` of ``kv_cache`` like :meth:`forward`."""
        return self.model.hidden_layers(batch, kv_cache, self.num_layers)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The shared LM head: ``[N, H]`` -> ``[N, V]`` float32 logits."""
        return self.model.project(hidden)

    def expert_counts(self) -> torch.Tensor | None:
        """Always ``None``: the view's routing is not recorded (the shared MoE layers'
        counts belong to the full model's last forward)."""
        return None


if TYPE_CHECKING:
    _check: type[CausalLM] = LayerTruncatedLM
