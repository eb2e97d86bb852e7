"""cache/: paged KV blocks, reference counts, prefix reuse, copy-on-write, eviction."""

from deepinfer_kit.cache.protocols import BlockAllocator, KVCacheManager, PrefixIndex
from deepinfer_kit.cache.records import CacheConfig, PrefixCacheStats

__all__ = ["BlockAllocator", "PrefixIndex", "KVCacheManager", "CacheConfig", "PrefixCacheStats"]
