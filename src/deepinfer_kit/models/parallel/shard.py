"""Which part of each tensor a tensor-parallel rank holds: head, column and vocabulary ranges.

Rank ``t`` of ``T`` holds query heads ``[t*Hq/T, (t+1)*Hq/T)``; key/value heads
``[t*Hkv/T, (t+1)*Hkv/T)`` when ``Hkv >= T``, else the one KV head its query heads read
(head ``t // (T / Hkv)``, replicated on ``T / Hkv`` ranks); MLP columns
``[t*I/T, (t+1)*I/T)``; vocabulary rows ``[t*Vl, (t+1)*Vl)`` with ``Vl = ceil(V / T)``
(the last rank's tail padded with zero rows, trimmed after the gather).
"""

from __future__ import annotations

import attrs

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models.config import ModelConfig

__all__ = ["AttentionShard", "VocabShard", "attention_shard", "split_even", "vocab_shard"]


def split_even(total: int, world: int, rank: int, field: str) -> tuple[int, int]:
    """``(start, size)`` of rank ``rank``'s equal part of ``total`` items.

    Raises:
        ConfigError: ``total`` is not divisible by ``world`` (names ``field``).
    """
    if total % world:
        raise ConfigError(f"tensor_parallel={world} must divide {field}, got {field}={total}")
    size = total // world
    return rank * size, size


@attrs.frozen(slots=True)
class AttentionShard:
    """One rank's heads of one attention layer.

    Attributes:
        q_start, num_heads: first query head and how many this rank holds.
        kv_start, num_kv_heads: first key/value head and how many this rank holds.
        kv_replicas: ranks holding each KV head (``T / Hkv`` when ``Hkv < T``, else 1).
    """

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int
    kv_replicas: int


def attention_shard(config: ModelConfig, world: int, rank: int) -> AttentionShard:
    """The heads rank ``rank`` of ``world`` holds.

    Raises:
        ConfigError: ``world`` does not divide the query heads, or neither divides the
            other for the key/value heads.
    """
    q_start, hq = split_even(config.num_heads, world, rank, "num_attention_heads")
    hkv = config.num_kv_heads
    if hkv >= world:
        kv_start, kv = split_even(hkv, world, rank, "num_key_value_heads")
        return AttentionShard(q_start, hq, kv_start, kv, 1)
    if world % hkv:
        raise ConfigError(
            f"with fewer key/value heads than ranks, num_key_value_heads must divide "
            f"tensor_parallel={world}, got num_key_value_heads={hkv}")
    replicas = world // hkv
    return AttentionShard(q_start, hq, rank // replicas, 1, replicas)


@attrs.frozen(slots=True)
class VocabShard:
    """One rank's rows of the embedding and LM head.

    Attributes:
        start: first vocabulary id this rank holds.
        size: rows held (``ceil(V / T)``, equal on every rank so the logits gather).
        real: rows backed by the checkpoint (``size`` except on the last ranks).
        vocab_size: ``V``, the full vocabulary.
    """

    start: int
    size: int
    real: int
    vocab_size: int


def vocab_shard(vocab_size: int, world: int, rank: int) -> VocabShard:
    """Rank ``rank``'s vocabulary rows (see the module docstring)."""
    size = -(-vocab_size // world)
    start = rank * size
    real = max(0, min(vocab_size, start + size) - start)
    return VocabShard(start, size, real, vocab_size)
