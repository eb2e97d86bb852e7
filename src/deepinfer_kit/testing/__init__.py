"""Conformance suites, one per Protocol, for any implementation (yours included).

Each suite is a :class:`Suite` of named checks taking a factory; run them from your own
pytest with ``pytest.mark.parametrize("check", SUITE, ids=SUITE.ids)`` or call
``SUITE.run(factory)``.

Suites are imported on first use (``from deepinfer_kit.testing import SAMPLER_SUITE`` loads
only the sampler's), so a third party checking one component pays for that one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepinfer_kit._lazy import lazy_attribute

from deepinfer_kit.testing.suite import Check, ConformanceError, Suite, expect

if TYPE_CHECKING:
    from deepinfer_kit.testing.batch_invariance import BATCH_INVARIANCE_SUITE
    from deepinfer_kit.testing.cache import (
        BLOCK_ALLOCATOR_SUITE, KV_CACHE_MANAGER_SUITE, PREFIX_INDEX_SUITE, kv_cache_manager_suite,
        prefix_index_suite,
    )
    from deepinfer_kit.testing.drafter import DRAFTER_SUITE
    from deepinfer_kit.testing.hybrid_cache import HYBRID_KV_CACHE_MANAGER_SUITE
    from deepinfer_kit.testing.kv_connector import KV_CONNECTOR_SUITE
    from deepinfer_kit.testing.eplb import PLACEMENT_POLICY_SUITE
    from deepinfer_kit.testing.eviction import EVICTION_POLICY_SUITE, LRU_POLICY_SUITE
    from deepinfer_kit.testing.moe import DISPATCHER_SUITE, ROUTER_SUITE
    from deepinfer_kit.testing.overlap import OVERLAP_EXECUTOR_SUITE
    from deepinfer_kit.testing.runner import STEP_RUNNER_SUITE
    from deepinfer_kit.testing.sample import SAMPLER_SUITE
    from deepinfer_kit.testing.sparse_mlp import SPARSE_MLP_SUITE
    from deepinfer_kit.testing.sched import SCHEDULER_SUITE
    from deepinfer_kit.testing.sched_policies import (
        ADMISSION_POLICY_SUITE, BATCHING_POLICY_SUITE, PREEMPTION_POLICY_SUITE,
    )
    from deepinfer_kit.testing.sched_stretch import DECODE_STRETCHES_SUITE
    from deepinfer_kit.testing.sim_cost import COST_MODEL_SUITE
    from deepinfer_kit.testing.replica_selector import REPLICA_SELECTOR_SUITE
    from deepinfer_kit.testing.spec import DRAFT_VERIFIER_SUITE, VERIFY_PLANNER_SUITE
    from deepinfer_kit.testing.spec_distribution import SPECULATIVE_DISTRIBUTION_SUITE
    from deepinfer_kit.testing.structured import GRAMMAR_BACKEND_SUITE

_LAZY = {
    "BATCH_INVARIANCE_SUITE": "deepinfer_kit.testing.batch_invariance",
    "BLOCK_ALLOCATOR_SUITE": "deepinfer_kit.testing.cache",
    "KV_CACHE_MANAGER_SUITE": "deepinfer_kit.testing.cache",
    "HYBRID_KV_CACHE_MANAGER_SUITE": "deepinfer_kit.testing.hybrid_cache",
    "KV_CONNECTOR_SUITE": "deepinfer_kit.testing.kv_connector",
    "PREFIX_INDEX_SUITE": "deepinfer_kit.testing.cache",
    "kv_cache_manager_suite": "deepinfer_kit.testing.cache",
    "prefix_index_suite": "deepinfer_kit.testing.cache",
    "DRAFTER_SUITE": "deepinfer_kit.testing.drafter",
    "PLACEMENT_POLICY_SUITE": "deepinfer_kit.testing.eplb",
    "EVICTION_POLICY_SUITE": "deepinfer_kit.testing.eviction",
    "LRU_POLICY_SUITE": "deepinfer_kit.testing.eviction",
    "DISPATCHER_SUITE": "deepinfer_kit.testing.moe",
    "ROUTER_SUITE": "deepinfer_kit.testing.moe",
    "OVERLAP_EXECUTOR_SUITE": "deepinfer_kit.testing.overlap",
    "STEP_RUNNER_SUITE": "deepinfer_kit.testing.runner",
    "SAMPLER_SUITE": "deepinfer_kit.testing.sample",
    "SPARSE_MLP_SUITE": "deepinfer_kit.testing.sparse_mlp",
    "SCHEDULER_SUITE": "deepinfer_kit.testing.sched",
    "ADMISSION_POLICY_SUITE": "deepinfer_kit.testing.sched_policies",
    "BATCHING_POLICY_SUITE": "deepinfer_kit.testing.sched_policies",
    "PREEMPTION_POLICY_SUITE": "deepinfer_kit.testing.sched_policies",
    "DECODE_STRETCHES_SUITE": "deepinfer_kit.testing.sched_stretch",
    "COST_MODEL_SUITE": "deepinfer_kit.testing.sim_cost",
    "REPLICA_SELECTOR_SUITE": "deepinfer_kit.testing.replica_selector",
    "DRAFT_VERIFIER_SUITE": "deepinfer_kit.testing.spec",
    "VERIFY_PLANNER_SUITE": "deepinfer_kit.testing.spec",
    "SPECULATIVE_DISTRIBUTION_SUITE": "deepinfer_kit.testing.spec_distribution",
    "GRAMMAR_BACKEND_SUITE": "deepinfer_kit.testing.structured",
}

__all__ = [
    "Suite",
    "Check",
    "ConformanceError",
    "expect",
    "BLOCK_ALLOCATOR_SUITE",
    "PREFIX_INDEX_SUITE",
    "KV_CACHE_MANAGER_SUITE",
    "HYBRID_KV_CACHE_MANAGER_SUITE",
    "KV_CONNECTOR_SUITE",
    "prefix_index_suite",
    "kv_cache_manager_suite",
    "EVICTION_POLICY_SUITE",
    "LRU_POLICY_SUITE",
    "SCHEDULER_SUITE",
    "ADMISSION_POLICY_SUITE",
    "PREEMPTION_POLICY_SUITE",
    "BATCHING_POLICY_SUITE",
    "DECODE_STRETCHES_SUITE",
    "COST_MODEL_SUITE",
    "SAMPLER_SUITE",
    "SPARSE_MLP_SUITE",
    "DRAFTER_SUITE",
    "VERIFY_PLANNER_SUITE",
    "DRAFT_VERIFIER_SUITE",
    "SPECULATIVE_DISTRIBUTION_SUITE",
    "REPLICA_SELECTOR_SUITE",
    "OVERLAP_EXECUTOR_SUITE",
    "STEP_RUNNER_SUITE",
    "ROUTER_SUITE",
    "DISPATCHER_SUITE",
    "PLACEMENT_POLICY_SUITE",
    "GRAMMAR_BACKEND_SUITE",
]


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, name)
