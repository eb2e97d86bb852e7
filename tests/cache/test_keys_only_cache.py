"""PagedKVCache(keys_only=True), the pool of DeepSeek-V3's latent rows: one plane per layer,
half the bytes of a K/V pool of the same rows, writes and block copies against a shadow
tensor on the torch reference and the Triton ops (the interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.errors import ConfigError, InvariantError

L, NB, P, W = 3, 6, 4, 24


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=pytest.mark.triton)])
def test_writes_and_copies_follow_a_shadow_of_one_plane(impl: str) -> None:
    cache = PagedKVCache(L, NB, P, 1, W, impl=impl, keys_only=True)  # type: ignore[arg-type]
    assert cache.keys_only and cache._kv.shape == (L, 1, NB + 1, P, 1, W)
    assert cache._kv.numel() * 4 == (NB + 1) * PagedKVCache.bytes_per_block(L, P, 1, W, torch.float32,
                                                                             keys_only=True)
    assert PagedKVCache.bytes_per_block(L, P, 1, W, torch.float32, keys_only=True) == L * P * W * 4
    shadow = torch.zeros(L, NB + 1, P, 1, W)
    gen = torch.Generator().manual_seed(0)
    slots = torch.tensor([5, 0, 13, cache.pad_slot, cache.pad_slot])
    for layer in range(L):
        rows = torch.randn(5, 1, W, generator=gen)
        cache.write(layer, rows, rows, slots)
        shadow[layer].view(-1, 1, W)[slots[:3]] = rows[:3]
        assert torch.equal(cache.value_cache(layer), cache.key_cache(layer))
        keys, values = cache.slot_caches(layer)
        assert keys.data_ptr() == values.data_ptr() and keys.shape == (NB + 1, P, 1, W)
    cache.copy_blocks([(0, 4), (3, 2)])
    shadow[:, [4, 2]] = shadow[:, [0, 3]]
    cache.copy_scratch()
    for layer in range(L):
        assert torch.equal(cache.key_cache(layer), shadow[layer, :NB])


def test_the_default_pool_keeps_two_planes_and_checks_shapes() -> None:
    cache = PagedKVCache(L, NB, P, 2, 8)
    assert not cache.keys_only and cache._kv.shape == (L, 2, NB + 1, P, 2, 8)
    assert cache.value_cache(0).data_ptr() != cache.key_cache(0).data_ptr()
    assert PagedKVCache.bytes_per_block(L, P, 2, 8, torch.float32) == 2 * L * P * 2 * 8 * 4
    latent = PagedKVCache(L, NB, P, 1, W, keys_only=True)
    with pytest.raises(InvariantError, match="write expects key/value"):
        latent.write(0, torch.zeros(2, 1, W), torch.zeros(2, 1, 8), torch.tensor([0, 1]))
    with pytest.raises(ConfigError, match="keys_only"):
        PagedKVCache(L, NB, P, 1, W, keys_only=1)  # type: ignore[arg-type]
