"""KitKVCacheManager: the kit's BlockKVCacheManager behind the subset of vLLM v1's
``KVCacheManager`` interface that vLLM's scheduler calls for a decoder-only model."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Literal

import attrs

from deepinfer_kit.adapters._peers import check_peer_version
from deepinfer_kit.adapters.vllm.versions import TESTED_VLLM
from deepinfer_kit.cache.manager import BlockKVCacheManager
from deepinfer_kit.cache.prefix_state import state_of
from deepinfer_kit.cache.records import CacheConfig, PrefixCacheStats
from deepinfer_kit.errors import ConfigError, InvariantError
from deepinfer_kit.request import Request

__all__ = ["KitKVCacheManager", "KitKVCacheBlocks", "KitBlockCopy"]

Publish = Literal["at_allocation", "after_step"]


@attrs.frozen(slots=True)
class KitKVCacheBlocks:
    """Block ids of one request, in vLLM's ``KVCacheBlocks`` shape for one KV-cache group:
    ``get_block_ids()`` returns ``([ids...],)``. Ids are vLLM-style (``0`` is never
    handed out, as vLLM reserves it for its null block)."""

    block_ids: tuple[int, ...] = ()

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int]]:
        """The ids as vLLM's ``KVCacheBlocks.get_block_ids`` returns them (one group)."""
        return (list(self.block_ids),)

    def __add__(self, other: KitKVCacheBlocks) -> KitKVCacheBlocks:
        return KitKVCacheBlocks(self.block_ids + other.block_ids)

    def new_empty(self) -> KitKVCacheBlocks:
        """An empty set of blocks."""
        return KitKVCacheBlocks()


_EMPTY = KitKVCacheBlocks()


@attrs.frozen(slots=True)
class KitBlockCopy:
    """One copy-on-write copy in vLLM's ``KVCacheBlockCopy`` shape (vLLM ids)."""

    src_block_id: int
    dst_block_id: int


class KitKVCacheManager:
    """The kit's block manager answering vLLM's scheduler calls.

    Reads from each vLLM request: ``request_id``, ``all_token_ids`` (only grows),
    ``prompt_token_ids``, ``num_tokens``, ``num_computed_tokens`` (owned by vLLM's
    scheduler), ``skip_reading_prefix_cache`` and ``cache_salt`` / ``lora_request`` (part
    of every prefix key). A mirror kit :class:`~deepinfer_kit.request.Request` per live
    request holds the kit's block table and block-key memo; :meth:`free` drops it.

    Publication (``publish``): vLLM caches a request's full blocks inside
    ``allocate_slots`` (``"at_allocation"``, the default, and vLLM's own contract: its
    runner writes every layer's KV for the whole batch before that layer's attention
    reads it). ``"after_step"`` follows the kit's rule instead: the blocks an allocation
    fills are published at the next :meth:`new_step_starts` (after the step that wrote
    them ran) or when the request is freed.

    Ids: the kit's block ``k`` is vLLM block ``k + 1``; block 0 is never handed out, so
    ``num_blocks`` counts vLLM's null block as vLLM does.

    Not covered (``ConfigError`` when asked for): more than one KV-cache group (hybrid,
    sliding window, Mamba), KV connectors (external tokens, delayed caching, reserved
    blocks), encoder tokens, the admission watermark, multimodal hashes, KV events
    (``take_events`` returns ``[]``), eagle's last-block dropping.

    Args:
        num_blocks: blocks in vLLM's pool (including its null block); ``>= 2``.
        block_size: tokens per block (``P``).
        max_model_len: tokens of one request at most; slots are capped there as vLLM does.
        enable_caching: prefix caching on or off.
        log_stats: keep counters for :meth:`make_prefix_cache_stats`.
        publish: ``"at_allocation"`` or ``"after_step"``.
        index: the kit's prefix index, ``"radix"`` or ``"hash"``.
        record_new_block_ids: keep newly allocated block ids for
            :meth:`take_new_block_ids` (vLLM's ``needs_kv_cache_zeroing``).

    Raises:
        ConfigError: an argument out of range.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        *,
        enable_caching: bool = True,
        log_stats: bool = False,
        publish: Publish = "at_allocation",
        index: Literal["radix", "hash"] = "radix",
        record_new_block_ids: bool = False,
    ) -> None:
        if num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2 (one is vLLM's null block), got {num_blocks}")
        if max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {max_model_len}")
        if publish not in ("at_allocation", "after_step"):
            raise ConfigError(f"publish must be 'at_allocation' or 'after_step', got {publish!r}")
        self.kit = BlockKVCacheManager.create(
            CacheConfig(block_size=block_size, num_blocks=num_blocks - 1, enable_prefix_caching=enable_caching),
            index=index,
        )
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.log_stats = log_stats
        self.publish: Publish = publish
        self.empty_kv_cache_blocks = _EMPTY
        self._mirrors: dict[str, Request] = {}
        self._pending: dict[str, int] = {}  # request id -> tokens to publish (after_step)
        self._copies: list[tuple[int, int]] = []
        self._record_new = record_new_block_ids
        self._new_ids: list[int] = []
        self.mamba_shared_prefix_checkpoint = False  # read by vLLM's scheduler
        self._stats_base = PrefixCacheStats()
        self._lookups = self._query_blocks = self._hit_blocks = 0

    @classmethod
    def from_vllm_config(
        cls, kv_cache_config: Any, max_model_len: int, *, strict_version: bool = True, **options: Any
    ) -> KitKVCacheManager:
        """Build from vLLM's ``KVCacheConfig`` (what vLLM's scheduler hands its manager),
        after checking the installed vLLM against ``TESTED_VLLM``; ``options`` as the
        constructor's.

        Raises:
            PeerVersionError: vLLM is missing or untested (with ``strict_version``).
            ConfigError: the config has more than one KV-cache group.
        """
        check_peer_version("vllm", TESTED_VLLM, strict=strict_version)
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ConfigError(f"kv_cache_config must have one KV-cache group, got {len(groups)}")
        block_size = int(groups[0].kv_cache_spec.block_size)
        return cls(int(kv_cache_config.num_blocks), block_size, max_model_len, **options)

    # ---------------------------------------------------------------- queries

    @property
    def usage(self) -> float:
        """Fraction of the usable pool held by requests (vLLM's ``usage``)."""
        return self.kit.usage

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can use: free plus evictable cached (vLLM's
        ``block_pool.get_num_free_blocks()``)."""
        return self.kit.num_free_blocks

    def get_blocks(self, request_id: str) -> KitKVCacheBlocks:
        """The request's blocks (empty for an unknown id)."""
        req = self._mirrors.get(request_id)
        return KitKVCacheBlocks(tuple(b + 1 for b in req.block_table)) if req else _EMPTY

    def get_block_ids(self, request_id: str) -> tuple[list[int]]:
        """The request's block ids, one group."""
        return self.get_blocks(request_id).get_block_ids()

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Always ``[0]`` (as vLLM 0.33, which removed cascade attention)."""
        return [0]

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix counters since the previous call (the kit's record, not vLLM's):
        lookups, blocks queried and hit by :meth:`get_computed_blocks`, blocks published
        and evicted by the kit's index; ``None`` without ``log_stats`` or caching."""
        stats = self.kit.stats
        if not self.log_stats or stats is None:
            return None
        now = PrefixCacheStats(
            self._lookups, self._query_blocks, self._hit_blocks, stats.inserted_blocks, stats.evicted_blocks
        )
        base = self._stats_base
        self._stats_base = now
        return PrefixCacheStats(
            now.queries - base.queries,
            now.query_blocks - base.query_blocks,
            now.hit_blocks - base.hit_blocks,
            now.inserted_blocks - base.inserted_blocks,
            now.evicted_blocks - base.evicted_blocks,
        )

    # ---------------------------------------------------------------- the calls

    def _mirror(self, request: Any) -> Request:
        rid: str = request.request_id
        req = self._mirrors.get(rid)
        tokens = request.all_token_ids
        if req is None:
            if getattr(request, "mm_features", None):
                raise ConfigError(f"request {rid!r} has multimodal inputs, which are not covered")
            req = Request(rid, list(request.prompt_token_ids), cache_context=_context(request))
            self._mirrors[rid] = req
        have = req.all_token_ids
        if len(tokens) > len(have):
            have.extend(tokens[len(have) :])
        return req

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[KitKVCacheBlocks, int, int]:
        """The cached full-block prefix of ``request``: ``(blocks, num_tokens, 0)``.

        At most ``request.num_tokens - 1`` tokens (and at most ``max_cache_hit_length``).
        Takes no reference and, as vLLM's lookup, refreshes no recency (a lookup whose
        allocation then fails leaves the eviction order as it was); counts a query in
        :meth:`make_prefix_cache_stats`. O(matched blocks + newly hashed blocks).
        """
        if not self.enable_caching or getattr(request, "skip_reading_prefix_cache", False):
            return _EMPTY, 0, 0
        req = self._mirror(request)
        if req.block_table:
            return _EMPTY, 0, 0  # a running request's prefix is its own
        index = self.kit.index
        assert index is not None
        P = self.kit.block_size
        tokens = req.all_token_ids
        limit = (len(tokens) - 1) // P
        if max_cache_hit_length is not None:
            limit = min(limit, max_cache_hit_length // P)
        if limit <= 0:
            return _EMPTY, 0, 0
        # vLLM's lookup changes no recency (only taking a block does): touch=False, and
        # the lookup is counted here. allocate_slots matches again (memoised keys).
        hits = index.match(tokens, context=req.cache_context, memo=state_of(req).keys, max_blocks=limit, touch=False)
        self._lookups += 1
        self._query_blocks += len(tokens) // P
        self._hit_blocks += len(hits)
        return KitKVCacheBlocks(tuple(b + 1 for b in hits)), len(hits) * P, 0

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KitKVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        **unused: Any,
    ) -> KitKVCacheBlocks | None:
        """Blocks for ``num_new_tokens`` (+ lookahead) more tokens of ``request``, taking
        its cached prefix (a :meth:`get_computed_blocks` result) first when it holds no
        blocks. Returns the newly allocated blocks (not the cached ones), or ``None`` —
        changing nothing — when the pool cannot hold them (vLLM's contract). With
        ``publish="at_allocation"`` the full blocks up to ``num_tokens`` are published.

        Raises:
            ConfigError: a connector, encoder or reservation argument (not covered), or
                ``num_new_tokens`` 0 with nothing to adopt.
        """
        if num_external_computed_tokens or delay_cache_blocks or num_encoder_tokens or reserved_blocks:
            raise ConfigError(
                "KV connectors, encoder tokens and reserved blocks are not covered by the "
                f"kit's manager (request {request.request_id!r})"
            )
        if num_new_tokens <= 0 and not num_new_computed_tokens:
            raise ConfigError(f"num_new_tokens must be > 0 with nothing to adopt, got {num_new_tokens}")
        req = self._mirror(request)
        computed = int(request.num_computed_tokens)
        cached = num_new_computed_tokens if not req.block_table else 0
        if num_new_computed_tokens and req.block_table:
            raise ConfigError(f"request {req.request_id!r} holds blocks; it cannot adopt a prefix")
        start = computed + cached
        n = min(start + num_new_tokens + num_lookahead_tokens, self.max_model_len) - start
        req.num_computed_tokens = computed
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len) - start
            if not self.kit.can_allocate(req, max(n, full), cached):
                return None
        if not self.kit.can_allocate(req, n, cached):
            return None
        before = len(req.block_table) + cached // self.kit.block_size
        self._copies.extend(self.kit.allocate(req, n, cached))
        new = KitKVCacheBlocks(tuple(b + 1 for b in req.block_table[before:]))
        if self._record_new:
            self._new_ids.extend(new.block_ids)
        upto = min(start + num_new_tokens, len(req.all_token_ids))
        if self.publish == "at_allocation":
            self.kit.cache_full_blocks(req, upto)
        else:
            self._pending[req.request_id] = upto
        return new

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Publish the request's full blocks among its first ``num_computed_tokens``."""
        req = self._mirrors.get(request.request_id)
        if req is not None:
            self.kit.cache_full_blocks(req, min(num_computed_tokens, len(req.all_token_ids)))

    def new_step_starts(self) -> None:
        """vLLM's scheduler calls this at the start of each ``schedule()``: with
        ``publish="after_step"`` the previous step's blocks are published now."""
        pending = self._pending
        for rid, upto in pending.items():
            self.kit.cache_full_blocks(self._mirrors[rid], upto)
        pending.clear()

    def free(self, request: Any) -> None:
        """Release every block of ``request`` (tail first, so its tail is evicted before
        its head) and forget its mirror; idempotent."""
        rid = request.request_id
        req = self._mirrors.pop(rid, None)
        if req is None:
            return
        upto = self._pending.pop(rid, None)
        if upto is not None:
            self.kit.cache_full_blocks(req, upto)
        self.kit.free(req)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block when no request holds one; False otherwise."""
        return self.kit.reset_prefix_cache()

    def take_events(self) -> list[Any]:
        """KV events are not produced: always ``[]``."""
        return []

    def take_kv_cache_block_copies(self) -> tuple[list[KitBlockCopy], list[int]]:
        """The copy-on-write copies (vLLM ids) the allocations since the last call need,
        as vLLM 0.33 returns them: ``(copies, retained)``; nothing is retained here (the
        kit's manager already holds the destination blocks)."""
        copies = [KitBlockCopy(s + 1, d + 1) for s, d in self._copies]
        self._copies = []
        return copies, []

    def take_new_block_ids(self) -> list[int]:
        """Blocks allocated since the last call, for the worker to zero, when built with
        ``record_new_block_ids`` (vLLM's ``needs_kv_cache_zeroing``); else ``[]``."""
        ids, self._new_ids = self._new_ids, []
        return ids

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Mamba boundary states: none here (full attention only)."""
        return {}

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None) -> None:
        """No-op: full attention skips no block (sliding window is not covered)."""

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        """No-op: :meth:`get_computed_blocks` counts each lookup itself."""

    def estimate_cached_tokens(self, request: Any) -> int:
        """Tokens of the request's table that are published (a multiple of ``P``)."""
        req = self._mirrors.get(request.request_id)
        st: Any = req.prefix_state if req is not None else None
        return int(st.num_published) * self.kit.block_size if st is not None else 0

    def check_integrity(self) -> None:
        """The kit's block accounting over the live mirrors (tests, debugging).

        Raises:
            InvariantError: a leak or a reference count that does not match.
        """
        if any(r.request_id not in self._mirrors for r in self._mirrors.values()):
            raise InvariantError("mirror table out of sync")
        self.kit.check_integrity(list(self._mirrors.values()))


def _context(request: Any) -> Hashable:
    """What makes equal tokens mean different KV for vLLM: the cache salt and the LoRA."""
    salt = getattr(request, "cache_salt", None)
    lora = getattr(request, "lora_request", None)
    lora_id = getattr(lora, "lora_int_id", None) if lora is not None else None
    return None if salt is None and lora_id is None else (salt, lora_id)

