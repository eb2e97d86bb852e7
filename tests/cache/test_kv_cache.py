"""PagedKVCache: slot-mapped writes, block copies, addressing, sizing, bad input."""

from __future__ import annotations

import random
import re

import os

import pytest
import torch

from deepinfer_kit.cache.kv_cache import PagedKVCache
from deepinfer_kit.errors import CapacityError, ConfigError, DeviceUnavailableError, InvariantError
from deepinfer_kit.models.attention import slots_for

IMPLS = ["ref", pytest.param("triton", marks=pytest.mark.triton)]


def _cache(impl: str = "ref", **kw: object) -> PagedKVCache:
    args: dict[str, object] = {
        "num_layers": 3, "num_blocks": 10, "block_size": 4, "num_kv_heads": 3, "head_dim": 8
    }
    args.update(kw)
    return PagedKVCache(**args, impl=impl)  # type: ignore[arg-type]


def _flat(cache: PagedKVCache, layer: int, which: int) -> torch.Tensor:
    t = cache.key_cache(layer) if which == 0 else cache.value_cache(layer)
    return t.reshape(-1, cache.num_kv_heads, cache.head_dim)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", range(4))
def test_random_ops_match_a_shadow_pool(impl: str, seed: int) -> None:
    """Seeded sequences of writes and block copies against a plain tensor shadow."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cache = _cache(impl, block_size=rng.choice([4, 16]))
    nl, nb, p = cache.num_layers, cache.num_blocks, cache.block_size
    shadow = torch.zeros(nl, 2, nb * p, cache.num_kv_heads, cache.head_dim)
    for _ in range(12):
        if rng.random() < 0.7:
            layer = rng.randrange(nl)
            slots = rng.sample(range(nb * p), rng.randint(1, 3 * p))
            k = torch.randn(len(slots), cache.num_kv_heads, cache.head_dim, generator=gen)
            v = torch.randn(len(slots), cache.num_kv_heads, cache.head_dim, generator=gen)
            cache.write(layer, k, v, torch.tensor(slots))
            for i, s in enumerate(slots):
                shadow[layer, 0, s], shadow[layer, 1, s] = k[i], v[i]
        else:
            blocks = rng.sample(range(nb), 2 * rng.randint(1, nb // 2))
            pairs = list(zip(blocks[::2], blocks[1::2]))
            cache.copy_blocks(pairs)
            view = shadow.view(nl, 2, nb, p, cache.num_kv_heads, cache.head_dim)
            snapshot = view.clone()
            for src, dst in pairs:
                view[:, :, dst] = snapshot[:, :, src]
        for layer in range(nl):
            assert torch.equal(_flat(cache, layer, 0), shadow[layer, 0])
            assert torch.equal(_flat(cache, layer, 1), shadow[layer, 1])


def test_addressing_rule_reads_back_each_position() -> None:
    cache = _cache(num_blocks=12, block_size=4)
    table = [7, 2, 11, 0, 5]
    n = 18
    k = torch.randn(n, 3, 8)
    cache.write(1, k, -k, torch.tensor(slots_for(table, 0, n, 4)))
    kc, vc = cache.key_cache(1), cache.value_cache(1)
    for t in range(n):
        assert torch.equal(kc[table[t // 4], t % 4], k[t])
        assert torch.equal(vc[table[t // 4], t % 4], -k[t])
    assert slots_for(table, 5, 7, 4) == [2 * 4 + 1, 2 * 4 + 2]


def test_write_touches_only_its_layer_and_slots() -> None:
    cache = _cache()
    slots = torch.tensor([3, 17, 38])
    k = torch.ones(3, 3, 8)
    cache.write(2, k, 2 * k, slots)
    for layer in range(3):
        for which in (0, 1):
            flat = _flat(cache, layer, which)
            written = flat[slots]
            rest = torch.ones(flat.shape[0], dtype=torch.bool)
            rest[slots] = False
            assert torch.count_nonzero(flat[rest]) == 0
            expected = (which + 1) * k if layer == 2 else torch.zeros_like(k)
            assert torch.equal(written, expected)


def test_slot_caches_address_every_slot_the_pad_slot_included() -> None:
    cache = PagedKVCache(2, 3, 4, 2, 8)
    keys, values = cache.slot_caches(1)
    assert keys.shape == values.shape == (4, 4, 2, 8) and keys.is_contiguous()
    ones = torch.ones(2, 2, 8)
    cache.write(1, ones, 2 * ones, torch.tensor([cache.pad_slot, 5]))
    for slot in (cache.pad_slot, 5):
        assert torch.equal(keys.view(-1, 2, 8)[slot], ones[0])
        assert torch.equal(values.view(-1, 2, 8)[slot], 2 * ones[0])
    keys.view(-1, 2, 8)[7] = 3.0  # a view: what a kernel stores there, attention reads
    assert torch.equal(cache.key_cache(1).view(-1, 2, 8)[7], torch.full((2, 8), 3.0))
    assert not cache.slot_caches(0)[0].any()


def test_write_casts_to_cache_dtype() -> None:
    cache = _cache(dtype=torch.bfloat16)
    k = torch.randn(2, 3, 8)
    cache.write(0, k, k, torch.tensor([0, 5]))
    assert cache.key_cache(0).dtype == torch.bfloat16
    assert torch.equal(_flat(cache, 0, 0)[5], k[1].bfloat16())


def test_copy_blocks_copies_every_layer_and_leaves_others() -> None:
    cache = _cache()
    for layer in range(3):
        cache.key_cache(layer).copy_(torch.randn(cache.key_cache(layer).shape))
        cache.value_cache(layer).copy_(torch.randn(cache.value_cache(layer).shape))
    before = [(cache.key_cache(i).clone(), cache.value_cache(i).clone()) for i in range(3)]
    cache.copy_blocks([(1, 6), (4, 0)])
    for layer, (k, v) in enumerate(before):
        for got, old in ((cache.key_cache(layer), k), (cache.value_cache(layer), v)):
            assert torch.equal(got[6], old[1]) and torch.equal(got[0], old[4])
            for b in set(range(10)) - {0, 6}:
                assert torch.equal(got[b], old[b])


@pytest.mark.parametrize("pairs", [[(1, 10)], [(-1, 2)], [(1, 2), (3, 2)], [(1, 2), (2, 3)]])
def test_bad_copy_pairs_are_rejected(pairs: list[tuple[int, int]]) -> None:
    cache = _cache()
    with pytest.raises(InvariantError):
        cache.copy_blocks(pairs)


def test_write_shape_mismatch_is_rejected() -> None:
    cache = _cache()
    with pytest.raises(InvariantError, match="key"):
        cache.write(0, torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), torch.tensor([0, 1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bytes_per_block_matches_the_allocation(dtype: torch.dtype) -> None:
    cache = _cache(dtype=dtype)
    whole = sum(
        cache.key_cache(i).nbytes + cache.value_cache(i).nbytes for i in range(cache.num_layers)
    )
    assert PagedKVCache.bytes_per_block(3, 4, 3, 8, dtype) * cache.num_blocks == whole


def test_properties() -> None:
    cache = _cache(dtype=torch.float16)
    assert (cache.num_layers, cache.num_blocks, cache.block_size) == (3, 10, 4)
    assert (cache.num_kv_heads, cache.head_dim, cache.dtype) == (3, 8, torch.float16)
    assert cache.device == torch.device("cpu") and cache.impl == "ref"
    assert cache.key_cache(0).shape == (10, 4, 3, 8) and cache.key_cache(0).is_contiguous()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_blocks": -2}, "num_blocks"),
        ({"block_size": True}, "block_size"),
        ({"head_dim": 2.0}, "head_dim"),
        ({"dtype": torch.int32}, "dtype"),
        ({"impl": "fast"}, "impl"),
    ],
)
def test_bad_config_names_the_field(kwargs: dict[str, object], field: str) -> None:
    impl = kwargs.pop("impl", "ref")
    with pytest.raises(ConfigError, match=field):
        _cache(str(impl), **kwargs)


def test_unavailable_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(DeviceUnavailableError):
        _cache(device="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(DeviceUnavailableError):
        _cache("triton")
    assert _cache("auto").impl == "ref"


@pytest.mark.parametrize("impl", IMPLS)
def test_write_accepts_strided_views(impl: str) -> None:
    """K/V sliced out of a fused projection (non-contiguous rows) are written correctly."""
    cache = _cache(impl)
    fused = torch.randn(5, 9, 8)  # [T, 3 * Hkv, D], e.g. a fused K/V projection
    key, value = fused[:, 0:3], fused[:, 6:9]
    slots = torch.tensor([39, 0, 12, 7, 25])
    cache.write(1, key, value, slots)
    assert torch.equal(_flat(cache, 1, 0)[slots], key)
    assert torch.equal(_flat(cache, 1, 1)[slots], value)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_ops_match_reference_on_cuda(dtype: torch.dtype) -> None:
    caches = [
        _cache(impl, num_blocks=64, block_size=16, head_dim=64, dtype=dtype, device="cuda")
        for impl in ("ref", "triton")
    ]
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(64 * 16, generator=gen)[:300].cuda()
    for layer in range(3):
        k = torch.randn(300, 3, 64, generator=gen).cuda()
        for cache in caches:
            cache.write(layer, k, k * 2, slots)
    for cache in caches:
        cache.copy_blocks([(1, 50), (7, 3), (60, 8)])
    for layer in range(3):
        assert torch.equal(caches[0].key_cache(layer), caches[1].key_cache(layer))
        assert torch.equal(caches[0].value_cache(layer), caches[1].value_cache(layer))


# 10**12 blocks of 16 tokens x 8 floats, K and V: about 930 TiB, more than any 64-bit
# address space maps, so the allocation fails at once (even with memory overcommit on).
_HUGE = {"num_layers": 1, "num_blocks": 10**12, "block_size": 16, "num_kv_heads": 1, "head_dim": 8}
_HUGE_BYTES = 2 * 10**12 * 16 * 8 * 4


def test_unallocatable_pool_is_a_capacity_error_naming_bytes_and_setting() -> None:
    with pytest.raises(CapacityError) as err:
        PagedKVCache(**_HUGE)
    message = str(err.value)
    assert f"{_HUGE_BYTES} bytes" in message and "num_blocks=1000000000000" in message, message


def test_engine_with_a_huge_kv_memory_budget_names_the_setting() -> None:
    from deepinfer_kit import build_engine

    with pytest.raises(CapacityError) as err:
        build_engine(kv_cache_memory_mb=10**9)
    message = str(err.value)
    assert "kv_cache_memory_mb" in message and re.search(r"\d{15,} bytes", message), message


@pytest.mark.parametrize("impl", IMPLS)
def test_writes_to_the_pad_slot_touch_no_addressable_block(impl: str) -> None:
    """Padded rows of a static-shape step write to ``pad_slot`` (repeated): every block
    attention can read keeps its contents, the real rows of the same write land."""
    cache = _cache(impl)
    gen = torch.Generator().manual_seed(0)
    shape = (cache.num_kv_heads, cache.head_dim)
    keys0, values0 = _flat(cache, 1, 0).clone(), _flat(cache, 1, 1).clone()
    assert cache.pad_slot == cache.num_blocks * cache.block_size
    slots = torch.tensor([cache.pad_slot, 5, cache.pad_slot, cache.pad_slot])
    k, v = torch.randn(4, *shape, generator=gen), torch.randn(4, *shape, generator=gen)
    cache.write(1, k, v, slots)
    keys, values = _flat(cache, 1, 0), _flat(cache, 1, 1)
    assert keys.shape[0] == cache.num_blocks * cache.block_size
    torch.testing.assert_close(keys[5], k[1])
    torch.testing.assert_close(values[5], v[1])
    others = torch.arange(keys.shape[0]) != 5
    torch.testing.assert_close(keys[others], keys0[others])
    torch.testing.assert_close(values[others], values0[others])


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_pool_is_zero_and_takes_memory_only_where_written(dtype: torch.dtype) -> None:
    before = _resident_mib()
    cache = PagedKVCache(4, 8191, 16, 8, 64, dtype=dtype)  # 2 GiB (fp32) of K and V
    assert _resident_mib() - before < 64  # nothing touched yet
    assert cache.num_blocks == 8191 and cache.key_cache(3).dtype == dtype
    k = torch.ones(2, 8, 64, dtype=dtype)
    cache.write(3, k, k * 2, torch.tensor([16 * 8000, 16 * 8000 + 1]))
    assert torch.equal(cache.key_cache(3)[8000, :2], k) and torch.equal(cache.value_cache(3)[8000, :2], k * 2)
    assert not bool(cache.key_cache(3)[7999].any()) and not bool(cache.value_cache(0)[8000].any())
    assert _resident_mib() - before < 128
