"""The kit's KV cache manager and sampler behind vLLM v1's interfaces.

:class:`KitKVCacheManager` needs no vLLM (it reads vLLM requests by duck typing);
:class:`KitSampler` imports vLLM's sampler records when first used. Tested with vLLM
0.33 (``TESTED_VLLM``); see docs/other_engines.md for what is not covered.
"""

from __future__ import annotations

from typing import Any

from deepinfer_kit.adapters.vllm.kv_cache import KitKVCacheBlocks, KitKVCacheManager
from deepinfer_kit.adapters.vllm.versions import TESTED_VLLM

__all__ = ["KitKVCacheManager", "KitKVCacheBlocks", "KitSampler", "TESTED_VLLM"]


def __getattr__(name: str) -> Any:
    if name == "KitSampler":
        from deepinfer_kit.adapters.vllm.sampler import KitSampler

        return KitSampler
    raise AttributeError(name)
