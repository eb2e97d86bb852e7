"""Torch reference ops of the KV pool: write new tokens' K/V by slot, copy whole blocks.

They are the spec and the test oracle of the Triton kernels in ``triton_ops.py`` (same
signatures). Shape symbols: ``T`` new tokens, ``L`` layers, ``NB`` blocks in the pool,
``P`` block size, ``Hkv`` KV heads, ``D`` head dim, ``C`` block copies.
"""

from __future__ import annotations

import torch

__all__ = ["write_kv", "copy_blocks"]


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store token ``i``'s K/V at slot ``slot_mapping[i]`` (``block * P + offset``).

    Args:
        key_cache, value_cache: ``[NB, P, Hkv, D]`` contiguous; mutated in place.
        key, value: ``[T, Hkv, D]`` on the cache's device (cast to the cache dtype).
        slot_mapping: ``[T]`` int64 slots in ``[0, NB * P)``, distinct.
    """
    slots = slot_mapping.long()
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, value.to(value_cache.dtype))


def copy_blocks(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy block ``src[c]`` to block ``dst[c]`` in every layer, for K and V.

    Args:
        kv: ``[L, 2, NB, P, Hkv, D]`` the whole pool; mutated in place.
        src, dst: ``[C]`` int64 block ids on ``kv``'s device; ``dst`` entries are distinct
            and disjoint from ``src`` (so the copies are order independent).
    """
    kv[:, :, dst] = kv[:, :, src]
