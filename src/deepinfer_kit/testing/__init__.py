"""Conformance suites, one per Protocol, for any implementation (yours included).

Each suite is a :class:`Suite` of named checks taking a factory; run them from your own
pytest with ``pytest.mark.parametrize("check", SUITE, ids=SUITE.ids)`` or call
``SUITE.run(factory)``.
"""

from deepinfer_kit.testing.cache import (
    BLOCK_ALLOCATOR_SUITE,
    KV_CACHE_MANAGER_SUITE,
    PREFIX_INDEX_SUITE,
    kv_cache_manager_suite,
    prefix_index_suite,
)
from deepinfer_kit.testing.drafter import DRAFTER_SUITE
from deepinfer_kit.testing.eplb import PLACEMENT_POLICY_SUITE
from deepinfer_kit.testing.eviction import EVICTION_POLICY_SUITE, LRU_POLICY_SUITE
from deepinfer_kit.testing.moe import DISPATCHER_SUITE, ROUTER_SUITE
from deepinfer_kit.testing.overlap import OVERLAP_EXECUTOR_SUITE
from deepinfer_kit.testing.runner import STEP_RUNNER_SUITE
from deepinfer_kit.testing.sample import SAMPLER_SUITE
from deepinfer_kit.testing.sparse_mlp import SPARSE_MLP_SUITE
from deepinfer_kit.testing.sched import SCHEDULER_SUITE
from deepinfer_kit.testing.sched_policies import (
    ADMISSION_POLICY_SUITE,
    BATCHING_POLICY_SUITE,
    PREEMPTION_POLICY_SUITE,
)
from deepinfer_kit.testing.sched_stretch import DECODE_STRETCHES_SUITE
from deepinfer_kit.testing.sim_cost import COST_MODEL_SUITE
from deepinfer_kit.testing.replica_selector import REPLICA_SELECTOR_SUITE
from deepinfer_kit.testing.spec import DRAFT_VERIFIER_SUITE, VERIFY_PLANNER_SUITE
from deepinfer_kit.testing.spec_distribution import SPECULATIVE_DISTRIBUTION_SUITE
from deepinfer_kit.testing.suite import Check, ConformanceError, Suite, expect

__all__ = [
    "Suite",
    "Check",
    "ConformanceError",
    "expect",
    "BLOCK_ALLOCATOR_SUITE",
    "PREFIX_INDEX_SUITE",
    "KV_CACHE_MANAGER_SUITE",
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
]
