"""cache/: paged KV blocks, reference counts, prefix reuse, copy-on-write, eviction."""

from deepinfer_kit.cache.free_list_allocator import FreeListBlockAllocator
from deepinfer_kit.cache.frequency_policy import FrequencyEvictionPolicy
from deepinfer_kit.cache.hash_chain_index import HashChainPrefixIndex
from deepinfer_kit.cache.lru_policy import LRUEvictionPolicy
from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.cache.protocols import (
    BlockAllocator,
    EvictionPolicy,
    KVCacheManager,
    PrefixIndex,
)
from deepinfer_kit.cache.radix_index import RadixPrefixIndex
from deepinfer_kit.cache.records import CacheConfig, PrefixCacheStats

__all__ = [
    "BlockAllocator",
    "PrefixIndex",
    "KVCacheManager",
    "CacheConfig",
    "PrefixCacheStats",
    "EvictionPolicy",
    "FreeListBlockAllocator",
    "HashChainPrefixIndex",
    "RadixPrefixIndex",
    "LRUEvictionPolicy",
    "FrequencyEvictionPolicy",
    "BlockKVCacheManager",
]
