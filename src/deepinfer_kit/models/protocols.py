"""Contracts of the models package: CausalLM, the KV store a model writes, Tokenizer, and the
sparse (MoE) MLP a model is given for its sparse layers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from deepinfer_kit.models.records import ForwardBatch

if TYPE_CHECKING:
    from deepinfer_kit.models.config import ModelConfig

__all__ = ["PagedKVStore", "CausalLM", "Tokenizer", "SparseMLP", "SparseMLPFactory"]


class PagedKVStore(Protocol):
    """What a model needs from the paged KV cache (``cache.kv_cache.PagedKVCache`` has it).

    Layer ``l``'s keys and values are ``[NB, P, Hkv, D]`` tensors on the model's device.
    """

    def key_cache(self, layer: int, /) -> torch.Tensor:
        """Layer ``layer``'s key blocks ``[NB, P, Hkv, D]`` (a view; not copied)."""
        ...

    def value_cache(self, layer: int, /) -> torch.Tensor:
        """Layer ``layer``'s value blocks ``[NB, P, Hkv, D]`` (a view; not copied)."""
        ...

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor, /) -> None:
        """Store ``key``/``value`` ``[T, Hkv, D]`` of layer ``layer`` at slots ``[T]``
        (mutates the cache)."""
        ...

    def slot_caches(self, layer: int, /) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s ``(keys, values)``, each ``[S / P, P, Hkv, D]`` contiguous and
        addressed by every slot :meth:`write` accepts (the pad slot's scratch block
        included): what a kernel that writes K/V itself (the fused RoPE + KV write) stores
        into, in place. Views; not copied."""
        ...


class CausalLM(Protocol):
    """A decoder-only language model over a flattened, paged batch.

    Every family (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral, GLM-4-MoE) implements it through
    ``models.causal_lm.TransformerCausalLM``.
    """

    @property
    def config(self) -> ModelConfig:
        """The validated checkpoint configuration."""
        ...

    def __call__(self, batch: ForwardBatch, kv_cache: PagedKVStore) -> torch.Tensor:
        """Same as :meth:`forward` (``nn.Module.__call__``)."""
        ...

    def forward(self, batch: ForwardBatch, kv_cache: PagedKVStore) -> torch.Tensor:
        """Run one step over ``batch``.

        Writes the KV of every new token into ``kv_cache`` (layer ``i`` of the model uses
        cache layer ``i``) and reads each request's cached context through its block table.
        Runs under ``torch.inference_mode``.

        Returns:
            ``[N, V]`` float32 logits for the rows ``batch.logits_indices``.
        """
        ...

    def expert_counts(self) -> torch.Tensor | None:
        """``[L_moe, E]`` int64 tokens routed to each expert of each sparse layer during the
        last :meth:`forward`; ``None`` for dense models (or before any forward)."""
        ...


class Tokenizer(Protocol):
    """Text <-> token ids."""

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (including special tokens)."""
        ...

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence id, if the tokenizer has one."""
        ...

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence id, if the tokenizer has one."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (with the special tokens the tokenizer adds by design)."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are left out unless ``skip_special_tokens`` is
        False. Bytes that are not valid UTF-8 (e.g. a character whose bytes are split
        over tokens and ``ids`` ends inside it) become U+FFFD. Never raises on valid ids."""
        ...


class SparseMLP(Protocol):
    """A mixture-of-experts MLP for one sparse decoder layer (``moe.MoELayer`` satisfies it).

    The model calls it once per forward on the post-attention-norm hidden states of that
    layer; it must also be an ``nn.Module`` so its parameters belong to the model.
    """

    @property
    def last_expert_counts(self) -> torch.Tensor | None:
        """``[E]`` int64 tokens routed to each expert in the last call; ``None`` before any
        call. ``MoELayer`` leaves it where it was computed — on the device on its Triton
        path, so the forward never waits for the host — and it is read only after the
        forward, by ``CausalLM.expert_counts`` (traces). The same tensor from the first
        call on, rewritten in place by each call (a CUDA graph's replay then leaves its
        counts where a reader finds them); copy it to keep it."""
        ...

    def __call__(self, hidden: torch.Tensor, real_rows: torch.Tensor | None = None, /) -> torch.Tensor:
        """``[T, H]`` -> ``[T, H]`` in the dtype and on the device of ``hidden``.

        ``real_rows``: ``[T]`` bool on that device (:attr:`ForwardBatch.real_rows`): the
        rows marked False are padding, computed like any row but left out of
        :attr:`last_expert_counts` (without reading the mask on the host, so a captured
        forward can take it); ``None``: every row counts. Updates
        :attr:`last_expert_counts`. O(T * k * expert FLOPs).
        """
        ...

    def load_hf_weights(self, weights: Mapping[str, torch.Tensor], prefix: str, /) -> None:
        """Fill the router and experts from Hugging Face tensor names under ``prefix``
        (``model.layers.<i>.mlp.``), copying into the existing parameters.

        Raises:
            CheckpointError: naming a missing or mis-shaped tensor.
        """
        ...


class SparseMLPFactory(Protocol):
    """Builds the :class:`SparseMLP` of each sparse layer when a model is constructed.

    Injected into ``TransformerCausalLM`` (and the loader) so the models package never
    constructs an MoE implementation itself; ``engine.assemble.moe_layer_factory`` is the
    default, built from ``deepinfer_kit.moe``.
    """

    def __call__(self, config: ModelConfig, layer: int, /, *, dtype: torch.dtype,
                 device: str | torch.device) -> SparseMLP:
        """The sparse MLP of ``layer`` (a layer listed in ``config.sparse_layers``), with
        uninitialized parameters of ``dtype`` on ``device``; the loader fills them.

        Raises:
            ValueError: ``config`` has no MoE section.
        """
        ...
