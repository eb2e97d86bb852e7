"""The kit's KV cache manager behind vLLM v1's KVCacheManager interface, checked call by
call against vLLM's own class on one trace: same hits (the same blocks, through the id
map), same allocation failures, same free counts, the same cached-and-unreferenced blocks
after every step."""

from __future__ import annotations

import collections
import random
from typing import Any

import pytest

from deepinfer_kit.adapters.vllm import KitKVCacheManager
from deepinfer_kit.errors import ConfigError

pytestmark = pytest.mark.peers

P = 16


class _Req:
    """What the adapter reads of a vLLM request (the default tier needs no vLLM)."""

    def __init__(self, rid: str, prompt: list[int]) -> None:
        self.request_id = rid
        self.prompt_token_ids = prompt
        self.all_token_ids = list(prompt)
        self.num_computed_tokens = 0
        self.num_preemptions = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token_ids(self, token: int) -> None:
        self.all_token_ids.append(token)


def _zipf_trace(n: int, seed: int) -> list[tuple[list[int], int]]:
    """``n`` requests: a prompt (one of 40 shared prefixes of 2..8 blocks drawn with Zipf
    weights, then a private suffix of 1..40 tokens) and an output length of 1..24."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 50_000) for _ in range(P * rng.randrange(2, 9))] for _ in range(40)]
    weights = [1.0 / (i + 1) ** 1.1 for i in range(40)]
    out = []
    for _ in range(n):
        prefix = rng.choices(prefixes, weights)[0]
        suffix = [rng.randrange(1, 50_000) for _ in range(rng.randrange(1, 41))]
        out.append((prefix + suffix, rng.randrange(1, 25)))
    return out


class _Pair:
    """The two managers driven by one call sequence; asserts agreement at every call."""

    def __init__(self, kit: KitKVCacheManager, peer: Any, free_of: Any, cached_of: Any) -> None:
        self.kit, self.peer = kit, peer
        self.free_of, self.cached_of = free_of, cached_of
        self.ids: dict[int, int] = {}  # peer block id -> kit block id
        self.hits = self.failures = self.frees = 0

    def _pair(self, peer_blocks: Any, kit_blocks: Any) -> None:
        (p,), (k,) = peer_blocks.get_block_ids(), kit_blocks.get_block_ids()
        assert len(p) == len(k)
        self.ids.update(zip(p, k))

    def admit(self, req: Any) -> bool:
        pb, pn, _ = self.peer.get_computed_blocks(req)
        kb, kn, _ = self.kit.get_computed_blocks(req)
        assert kn == pn, f"{req.request_id}: kit hit {kn} tokens, vLLM {pn}"
        assert [self.ids[b] for b in pb.get_block_ids()[0]] == kb.get_block_ids()[0]
        self.hits += pn // P
        pnew = self.peer.allocate_slots(req, req.num_tokens - pn, pn, pb)
        knew = self.kit.allocate_slots(req, req.num_tokens - kn, kn, kb)
        return self._agree(req, pnew, knew)

    def grow(self, req: Any) -> bool:
        pnew = self.peer.allocate_slots(req, 1)
        knew = self.kit.allocate_slots(req, 1)
        return self._agree(req, pnew, knew)

    def _agree(self, req: Any, pnew: Any, knew: Any) -> bool:
        assert (pnew is None) == (knew is None), f"{req.request_id}: vLLM {pnew}, kit {knew}"
        if pnew is None:
            self.failures += 1
            return False
        self._pair(pnew, knew)
        return True

    def free(self, req: Any) -> None:
        self.peer.free(req)
        self.kit.free(req)
        self.frees += 1
        assert self.kit.num_free_blocks == self.free_of(self.peer)

    def check(self) -> None:
        assert self.kit.num_free_blocks == self.free_of(self.peer)
        assert {self.ids[b] for b in self.cached_of(self.peer)} == _kit_cached(self.kit)


def _kit_cached(kit: KitKVCacheManager) -> set[int]:
    """vLLM-style ids of the kit's cached blocks that no request holds."""
    index, alloc = kit.kit.index, kit.kit.allocator
    assert index is not None
    return {b + 1 for b in range(alloc.num_blocks) if index.contains(b) and alloc.ref_count(b) == 0}


def drive(pair: _Pair, trace: list[tuple[list[int], int]], make: Any, admit_per_step: int = 4) -> None:
    """A small engine loop: each step decodes every running request one token (a failed
    allocation preempts that request by recompute), admits up to ``admit_per_step``
    waiting ones in order, then finishes those that reached their output length."""
    rng = random.Random(7)
    waiting = collections.deque((make(f"r{i}", p), n) for i, (p, n) in enumerate(trace))
    running: list[tuple[Any, int]] = []
    while waiting or running:
        for m in (pair.kit, pair.peer):
            m.new_step_starts()
        still = []
        for req, n in running:
            req.append_output_token_ids(rng.randrange(1, 50_000))
            if pair.grow(req):
                req.num_computed_tokens = req.num_tokens - 1
                still.append((req, n))
            else:
                pair.free(req)
                req.num_computed_tokens = 0
                waiting.appendleft((req, n))
        running = still
        for _ in range(admit_per_step):
            if not waiting:
                break
            req, n = waiting[0]
            if not pair.admit(req):
                break
            waiting.popleft()
            req.num_computed_tokens = req.num_tokens
            running.append((req, n))
        done = [(r, n) for r, n in running if r.num_tokens - len(r.prompt_token_ids) >= n]
        for req, _ in done:
            pair.free(req)
        running = [x for x in running if x not in done]
        pair.check()


def test_adapter_contract_without_vllm() -> None:
    """The adapter alone on a short Zipf trace (a second kit manager stands in for vLLM,
    so this runs without it): hits happen, allocations fail under a small pool, nothing
    leaks, the idle check passes."""
    a = KitKVCacheManager(64, P, 1024, log_stats=True)
    b = KitKVCacheManager(64, P, 1024)
    pair = _Pair(a, b, lambda m: m.num_free_blocks, lambda m: _kit_cached(m))
    drive(pair, _zipf_trace(150, seed=3), _Req)
    a.check_integrity()
    assert pair.hits > 0 and pair.failures > 0
    stats = a.make_prefix_cache_stats()
    assert stats is not None and stats.hit_blocks == pair.hits
    assert a.usage == 0.0 and a.num_free_blocks == 63


def test_adapter_rejects_what_it_does_not_cover() -> None:
    kit = KitKVCacheManager(8, P, 128)
    with pytest.raises(ConfigError, match="KV connectors"):
        kit.allocate_slots(_Req("x", [1, 2, 3]), 3, num_external_computed_tokens=16)
    with pytest.raises(ConfigError, match="num_blocks must be >= 2"):
        KitKVCacheManager(1, P, 128)


def _vllm() -> Any:
    pytest.importorskip("vllm", reason="vLLM's host classes are not importable here (install vllm 0.33)")
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(P, sha256)

    def config(num_blocks: int) -> Any:
        spec = FullAttentionSpec(block_size=P, num_kv_heads=1, head_size=8, dtype=torch.float16)
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])

    def make(rid: str, prompt: list[int]) -> Any:
        return Request(rid, prompt, SamplingParams(max_tokens=32), None, block_hasher=hasher)

    return KVCacheManager, config, make


@pytest.mark.parametrize("num_blocks", [200, 1200])
def test_same_hits_failures_and_frees_as_vllm_on_a_1000_request_zipf_trace(num_blocks: int) -> None:
    KVCacheManager, config, make = _vllm()
    cfg = config(num_blocks)
    peer = KVCacheManager(cfg, max_model_len=1024, scheduler_block_size=P, hash_block_size=P, enable_caching=True)
    kit = KitKVCacheManager.from_vllm_config(cfg, 1024)

    def cached(m: Any) -> set[int]:
        return {b.block_id for b in m.block_pool.blocks if b.ref_cnt == 0 and b.block_hash is not None}

    pair = _Pair(kit, peer, lambda m: m.block_pool.get_num_free_blocks(), cached)
    drive(pair, _zipf_trace(1000, seed=11), make)
    kit.check_integrity()
    assert pair.hits > 1000  # the Zipf prefixes were reused
    if num_blocks == 200:
        assert pair.failures > 0  # the small pool refused allocations (and evicted)


def test_a_lookup_whose_allocation_fails_leaves_the_eviction_order_as_vllm_does() -> None:
    """A's and B's blocks are cached, A's least recently; C matches A's prefix but cannot
    be allocated; D then forces two evictions. vLLM's lookup refreshed nothing, so A's
    blocks go first — and so must the kit's (a lookup that touched would evict B's)."""
    KVCacheManager, config, make = _vllm()
    cfg = config(9)
    peer = KVCacheManager(cfg, max_model_len=1024, scheduler_block_size=P, hash_block_size=P, enable_caching=True)
    kit = KitKVCacheManager.from_vllm_config(cfg, 1024)

    def cached(m: Any) -> set[int]:
        return {b.block_id for b in m.block_pool.blocks if b.ref_cnt == 0 and b.block_hash is not None}

    pair = _Pair(kit, peer, lambda m: m.block_pool.get_num_free_blocks(), cached)
    rng = random.Random(5)
    a_prompt = [rng.randrange(1, 1000) for _ in range(2 * P + 1)]
    for rid, prompt in (("a", a_prompt), ("b", [rng.randrange(1, 1000) for _ in range(2 * P + 1)])):
        req = make(rid, prompt)
        assert pair.admit(req)
        req.num_computed_tokens = req.num_tokens
        pair.free(req)
    pair.check()
    assert not pair.admit(make("c", a_prompt[: 2 * P] + [7] * (10 * P)))  # hits A, cannot fit
    d = make("d", [rng.randrange(1000, 2000) for _ in range(6 * P)])
    assert pair.admit(d)  # takes the 4 free blocks and evicts 2 cached ones
    pair.check()
    assert len(cached(peer)) == 2


def test_the_scheduler_side_calls_answer_in_vllms_shapes() -> None:
    kit = KitKVCacheManager(16, P, 256, record_new_block_ids=True)
    req = _Req("x", list(range(1, 2 * P + 3)))
    blocks, n, _ = kit.get_computed_blocks(req)
    assert (blocks.get_block_ids(), n) == (([],), 0)
    new = kit.allocate_slots(req, req.num_tokens, n, blocks)
    assert new is not None and len(new.get_block_ids()[0]) == 3 and 0 not in new.get_block_ids()[0]
    assert kit.get_block_ids("x") == new.get_block_ids()
    assert kit.take_new_block_ids() == new.get_block_ids()[0] and kit.take_new_block_ids() == []
    assert kit.estimate_cached_tokens(req) == 2 * P  # two full blocks published at allocation
    assert kit.take_kv_cache_block_copies() == ([], [])
    assert kit.take_boundary_state_offloads() == {} and kit.take_events() == []
    assert kit.get_num_common_prefix_blocks("x") == [0]
    assert not kit.reset_prefix_cache()  # a block is held
    kit.free(req)
    kit.free(req)  # idempotent
    assert kit.reset_prefix_cache() and kit.num_free_blocks == 15
    kit.check_integrity()
