"""build_drafter: the drafter a SpecConfig names, wired to the target model and its pool size.

``"ngram"`` needs nothing; ``"draft_model"`` loads a second checkpoint (or the embedded
tiny model) and ``"self"`` takes a layer-truncated view of the target; ``"dspark"`` loads
DSpark heads and reads a layer-truncated view as its backbone. Each model drafter gets a KV
pool and a block allocator of its own, the target's block size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer_kit.cache.free_list_allocator import FreeListBlockAllocator
from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.engine.runner.assemble import build_tiny_model, load_model
from deepinfer_kit.spec.drafters.draft_model import DraftModelDrafter
from deepinfer_kit.spec.drafters.dspark import DSparkDrafter
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.models.embedded import TINY, embedded_checkpoint, embedded_dspark_heads, is_embedded
from deepinfer_kit.models.tiny import tiny_hf_config
from deepinfer_kit.models.truncated import LayerTruncatedLM
from deepinfer_kit.spec.drafters.draft_kv import DraftKVBook
from deepinfer_kit.spec.drafters.dspark_heads import DSparkHeads, check_num_draft, heads_positions, load_heads
from deepinfer_kit.spec.drafters.ngram import NgramDrafter

if TYPE_CHECKING:
    from deepinfer_kit._kernels import Impl
    from deepinfer_kit.models.loader import LoadedModel
    from deepinfer_kit.models.protocols import CausalLM
    from deepinfer_kit.spec.protocols import Drafter
    from deepinfer_kit.spec.records import SpecConfig

__all__ = ["build_drafter", "draft_pool_blocks", "check_speculative"]


def _model_config(model: str) -> ModelConfig:
    """The config of a model name (``"tiny"``, an embedded name or a folder), read from its
    ``config.json`` only — no weights."""
    if model == TINY:
        return ModelConfig.from_hf_config(tiny_hf_config())
    return ModelConfig.from_pretrained(embedded_checkpoint(model) if is_embedded(model) else model)


def check_speculative(spec: SpecConfig | None, model: str, max_model_len: int | None) -> None:
    """Check ``spec`` against the target ``model``'s config file, the draft model's and the
    DSpark heads' file, before any weights are loaded (``build_engine`` calls it first, on
    the host, so a bad config never starts a worker).

    Raises:
        ConfigError: ``draft_layers`` beyond the target's layers, a draft model of another
            vocabulary, ``num_draft`` beyond the DSpark heads' positions, or ``num_draft``
            not below the model's length limit (each names the field and value).
        CheckpointError: a config or heads file that cannot be read.
    """
    if spec is None:
        return
    target = _model_config(model)
    limit = min(max_model_len or target.max_position_embeddings, target.max_position_embeddings)
    if spec.num_draft >= limit:
        raise ConfigError(f"speculative.num_draft must be below the model's length limit "
                          f"({limit}), got {spec.num_draft}")
    if spec.drafter == "self" and spec.draft_layers is not None and spec.draft_layers > target.num_layers:
        raise ConfigError(f"speculative.draft_layers must be an int in [1, {target.num_layers}] (the "
                          f"target's layers), got {spec.draft_layers}")
    if spec.drafter == "draft_model" and spec.draft_model:
        draft = _model_config(spec.draft_model)
        if draft.vocab_size != target.vocab_size:
            raise ConfigError(
                f"speculative.draft_model {spec.draft_model!r} has vocab_size "
                f"{draft.vocab_size}, the target has {target.vocab_size}; a draft model must "
                f"share the target's tokenizer")
    if spec.drafter == "dspark" and spec.dspark_heads:
        name = spec.dspark_heads
        positions = heads_positions(embedded_dspark_heads(name) if is_embedded(name) else name)
        if spec.num_draft > positions:
            raise ConfigError(f"speculative.num_draft must be <= {positions} (the DSpark heads' "
                              f"positions), got {spec.num_draft}")


def draft_pool_blocks(num_blocks: int, block_size: int, max_num_seqs: int, num_draft: int) -> int:
    """Blocks of a model drafter's own pool: the target's, plus room for every running
    sequence's ``γ`` draft positions (the draft writes ahead of the target). Sequences that
    share prefix blocks in the target's pool do not share them here; when the draft pool
    runs out, the sequences that do not fit get no drafts that round."""
    return num_blocks + max_num_seqs * -(-num_draft // block_size)


def build_drafter(
    spec: SpecConfig,
    target: LoadedModel,
    *,
    seed: int,
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    attention_impl: Impl,
    moe_impl: Impl,
    kv_heads: int | None = None,
) -> Drafter:
    """The drafter of ``spec`` for ``target``.

    Args:
        seed: the engine's seed (the embedded draft model's weights, the draft's
            generator of unseeded requests).
        block_size, num_blocks, max_num_seqs: the target pool's geometry and the round's
            sequence limit (sizing the draft pool, :func:`draft_pool_blocks`).
        max_model_len: the engine's limit; drafts never write past it.
        kv_heads: the KV heads the target's layers hold on this rank (a tensor-parallel
            shard holds fewer); the drafters that run the target's own first layers
            (``"self"``, ``"dspark"``) size their KV pool with it. ``None``: the model's.

    Raises:
        ConfigError: a draft model whose vocabulary differs from the target's, or
            ``draft_layers`` beyond the target's layers, ``num_draft`` beyond the DSpark
            heads' positions (each names the field and value).
        CheckpointError: a draft checkpoint or DSpark heads file that cannot be loaded
            (a heads tensor of the wrong shape for the target names the tensor).
    """
    if spec.drafter == "ngram":
        return NgramDrafter(spec.ngram_min, spec.ngram_max)
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    blocks = draft_pool_blocks(num_blocks, block_size, max_num_seqs, spec.num_draft)
    if spec.drafter == "dspark":
        heads = _load_heads(spec, target)
        backbone = LayerTruncatedLM(target.model, heads.backbone_layers)
        bc = backbone.config
        kv = PagedKVCache(bc.num_layers, blocks, block_size, kv_heads or bc.num_kv_heads, bc.head_dim,
                          dtype=dtype, device=device, impl=attention_impl)
        return DSparkDrafter(backbone, heads.to(device), kv,
                             DraftKVBook(FreeListBlockAllocator(blocks, block_size)),
                             generator=generator, max_model_len=max_model_len)
    model: CausalLM
    if spec.drafter == "self":
        assert spec.draft_layers is not None  # SpecConfig checked it
        model = LayerTruncatedLM(target.model, spec.draft_layers)
    else:
        model = _load_draft(spec.draft_model or "", target, seed=seed, dtype=dtype, device=device,
                            attention_impl=attention_impl, moe_impl=moe_impl)
    mc = model.config
    own_heads = kv_heads if spec.drafter == "self" and kv_heads else mc.num_kv_heads
    kv = PagedKVCache(mc.num_layers, blocks, block_size, own_heads, mc.head_dim,
                      dtype=dtype, device=device, impl=attention_impl)
    book = DraftKVBook(FreeListBlockAllocator(blocks, block_size))
    stop = spec.threshold if spec.planner == "threshold" else 0.0  # it verifies no further
    return DraftModelDrafter(model, kv, book, generator=generator, max_model_len=max_model_len,
                             stop_below=stop, stop_rule=spec.threshold_rule)


def _load_draft(path: str, target: LoadedModel, *, seed: int, dtype: torch.dtype,
                device: torch.device, attention_impl: Impl, moe_impl: Impl) -> CausalLM:
    """Load the draft checkpoint and check it shares the target's vocabulary."""
    if path == "tiny":
        loaded = build_tiny_model(seed=seed, dtype=dtype, device=device,
                                  attention_impl=attention_impl, moe_impl=moe_impl)
    else:
        loaded = load_model(path, dtype=dtype, device=device, attention_impl=attention_impl,
                            moe_impl=moe_impl)
    draft_vocab, vocab = loaded.config.vocab_size, target.config.vocab_size
    if draft_vocab != vocab:
        raise ConfigError(
            f"speculative.draft_model {path!r} has vocab_size {draft_vocab}, the target has "
            f"{vocab}; a draft model must share the target's tokenizer"
        )
    return loaded.model


def _load_heads(spec: SpecConfig, target: LoadedModel) -> DSparkHeads:
    """Resolve ``spec.dspark_heads`` (an embedded name or a path), load and validate it
    against ``target``, and check ``num_draft`` fits its positions."""
    name = spec.dspark_heads or ""
    path = embedded_dspark_heads(name) if is_embedded(name) else name
    tc = target.config
    heads = load_heads(path, vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
                       num_layers=tc.num_layers)
    check_num_draft(heads, spec.num_draft)
    return heads
