"""Components: the one way a component of yours reaches the engine, the LLM front end and
the simulator — an instance, or a :class:`Factory` that builds it where it runs from what
its host knows (a :class:`BuildContext`). Strings in :class:`EngineConfig` (``prefix_index``,
``scheduler``, ``speculative.drafter``, ``eplb.policy`` ...) stay as shortcuts for the
built-in components; the builder resolves both in one place per side (``engine/host.py``
for the host's, ``engine/runner/build.py`` for the device's), and every reader (trace,
metrics, idle check, ``reset_prefix_cache``, viewer, speculation) sees the object built
there, never a second default beside it.

Host components live in the engine's process (and the simulator's); device components
live beside the model: in a worker process (``worker="process"``) or on each rank they
cross as a :class:`Factory` of a module-level callable, pickled by reference and called
there; an instance that cannot cross is refused when the engine is built, saying so.
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import attrs

from deepinfer_kit.errors import ConfigError

if TYPE_CHECKING:
    from deepinfer_kit.cache.protocols import BlockAllocator, EvictionPolicy, KVCacheManager, PrefixIndex
    from deepinfer_kit.cache.tiers.protocols import KVConnectorScheduler, KVConnectorWorker
    from deepinfer_kit.engine.config import EngineConfig
    from deepinfer_kit.eplb.protocols import PlacementPolicy
    from deepinfer_kit.models.protocols import CausalLM
    from deepinfer_kit.moe.config import MoEConfig
    from deepinfer_kit.moe.protocols import Dispatcher, ReplicaSelector, Router
    from deepinfer_kit.overlap.protocols import OverlapExecutor
    from deepinfer_kit.sample.protocols import Sampler
    from deepinfer_kit.sched.protocols import AdmissionPolicy, BatchingPolicy, PreemptionPolicy, Scheduler
    from deepinfer_kit.sched.records import SchedulerConfig
    from deepinfer_kit.sim.protocols import CostModel
    from deepinfer_kit.spec.protocols import Drafter, DraftVerifier, VerifyPlanner

__all__ = ["BuildContext", "Components", "Factory", "HOST_KINDS", "DEVICE_KINDS", "KINDS", "build",
           "parse_component"]

T = TypeVar("T")

HOST_KINDS: tuple[str, ...] = (
    "block_allocator", "eviction_policy", "prefix_index", "cache_manager", "admission_policy",
    "preemption_policy", "batching_policy", "scheduler", "executor", "cost_model",
)
"""Kinds built in the engine's (or the simulator's) process."""

DEVICE_KINDS: tuple[str, ...] = (
    "sampler", "draft_verifier", "drafter", "verify_planner", "router", "dispatcher",
    "replica_selector", "placement_policy", "kv_connector",
)
"""Kinds built beside the model (in each worker process or rank when there is one)."""

KINDS = HOST_KINDS + DEVICE_KINDS


@attrs.frozen(slots=True)
class BuildContext:
    """What a component's host knows when it builds it: handed to a :class:`Factory`.

    Every factory gets ``config``, ``clock`` and the pool's geometry; the fields a kind
    needs beyond those are set for it (``None`` otherwise):

    =====================  ====================================================
    kind                   also set
    =====================  ====================================================
    admission_policy,      ``cache``, ``scheduler_config``
    preemption_policy,
    batching_policy,
    scheduler
    sampler                ``device``, ``model``, ``vocab_size``
    draft_verifier         ``device``, ``model``, ``vocab_size``, ``sampler``
    drafter,               ``device``, ``model`` (the target), ``vocab_size``
    verify_planner
    router, dispatcher     ``device``, ``layer``, ``moe``; a router's ``base`` is the
                           built-in router that holds the checkpoint's gate weights
    replica_selector       ``device``, ``layer``
    placement_policy       ``device``
    kv_connector           ``device``, ``num_blocks``; ``base`` is the K/V its device
                           side copies from and to (``PagedKVCache``, or a
                           ``HybridKVCache``: plans then carry each sliding
                           group's blocks, ``TransferPlan.save_groups``)
    =====================  ====================================================

    Attributes:
        config: the engine's config.
        clock: the host's clock (``time.monotonic``, or the simulator's virtual clock):
            what a scheduler stamps request metrics with.
        block_size, num_blocks, max_model_len: the KV pool and length limit (``None``
            where not known yet, e.g. a device component built before the pool).
        cache: the engine's KV cache manager (the one the trace and idle check read).
        scheduler_config: the scheduler's limits, derived from ``config``.
        device: the model's torch device string.
        model: the target model (:class:`CausalLM`), on ``device``.
        vocab_size: the model's vocabulary.
        sampler: the sampler the engine built (a verifier drawing recovered tokens uses it).
        layer: the MoE layer's index (0-based, among all layers).
        moe: that layer's MoE config.
        base: what the component wraps or replaces in place (a router's built-in gate).
    """

    config: EngineConfig
    clock: Callable[[], float]
    block_size: int
    num_blocks: int | None = None
    max_model_len: int | None = None
    cache: KVCacheManager | None = None
    scheduler_config: SchedulerConfig | None = None
    device: str | None = None
    model: CausalLM | None = None
    vocab_size: int | None = None
    sampler: Sampler | None = None
    layer: int | None = None
    moe: MoEConfig | None = None
    base: Any = None


def _check_crosses(fn: Callable[..., Any]) -> None:
    qualname = getattr(fn, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise ConfigError(
            f"a Factory must wrap a module-level callable (it is pickled by reference to cross "
            f"into worker processes), got {qualname or fn!r}"
        )


@attrs.frozen(slots=True)
class Factory(Generic[T]):
    """A component built where it runs: ``fn(context)`` with a :class:`BuildContext`.

    ``fn`` is any callable in the engine's process; to cross into a worker process or a
    rank it must be module-level (pickled by reference), which the builder checks before
    any process starts. ``Factory.from_path("pkg.mod:make")`` imports it by name (the
    command line's ``--component kind=pkg.mod:make``).
    """

    fn: Callable[[BuildContext], T]

    def __call__(self, context: BuildContext) -> T:
        """Build the component (``fn(context)``)."""
        return self.fn(context)

    @classmethod
    def from_path(cls, path: str) -> Factory[Any]:
        """The factory named ``"package.module:callable"`` (dots after the colon reach
        an attribute: ``"pkg.mod:Class.make"``).

        Raises:
            ConfigError: not ``module:name``, the module does not import, or the name is
                missing or not callable (names the path).
        """
        module, sep, name = path.partition(":")
        if not sep or not module or not name:
            raise ConfigError(f"a component path must be 'package.module:callable', got {path!r}")
        try:
            obj: Any = importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"component path {path!r}: cannot import {module!r}: {exc}") from exc
        for part in name.split("."):
            if not hasattr(obj, part):
                raise ConfigError(f"component path {path!r}: {module!r} has no {name!r}")
            obj = getattr(obj, part)
        if not callable(obj):
            raise ConfigError(f"component path {path!r} is not callable")
        return cls(obj)

    def check_crosses(self, kind: str) -> None:
        """Raise ConfigError unless this factory pickles by reference (to a worker)."""
        _check_crosses(self.fn)
        try:
            pickle.dumps(self.fn)
        except Exception as exc:  # noqa: BLE001 - any pickling failure means it cannot cross
            raise ConfigError(f"components.{kind}: its factory does not pickle: {exc}") from exc


def _component_field() -> Any:
    return attrs.field(default=None)


@attrs.frozen(slots=True)
class Components:
    """Components of yours, each used instead of the built-in its config names.

    Each field takes an instance or a :class:`Factory`; ``None`` keeps the built-in.
    Host kinds (:data:`HOST_KINDS`) are built in the engine's process; device kinds
    (:data:`DEVICE_KINDS`) beside the model, so with ``worker="process"`` they must be
    factories of module-level callables (an instance is refused at build). Per-layer
    kinds (``router``, ``dispatcher``, ``replica_selector``) must be factories: one
    component per MoE layer. A component given together with the one that would contain
    it (``cache_manager`` with ``block_allocator``, ``prefix_index`` or
    ``eviction_policy``; ``prefix_index`` with ``eviction_policy``; ``scheduler`` with
    a policy) is a ConfigError: the container owns its parts.

    Attributes:
        block_allocator: the KV block pool (its ``num_blocks`` and ``block_size`` must be
            the engine's).
        eviction_policy: the prefix index's eviction order (LRU by default).
        prefix_index: the prefix index (``config.prefix_index`` names the built-ins).
        cache_manager: the whole KV cache manager the scheduler talks to.
        admission_policy, preemption_policy, batching_policy: the scheduler's policies.
        scheduler: the scheduler (a factory gets the engine's ``cache``, its
            ``scheduler_config`` and ``clock``).
        executor: the overlap executor.
        cost_model: the simulator's step pricing (``build_simulator`` only).
        sampler, draft_verifier, drafter, verify_planner: sampling and speculation
            (speculation still needs ``config.speculative`` for γ).
        router, dispatcher, replica_selector: per MoE layer.
        placement_policy: the EPLB policy of ``config.eplb``.
        kv_connector: a Factory of ``(KVConnectorScheduler, KVConnectorWorker)`` over the
            engine's pool (``BuildContext.base``): the KV tiers (or any transfer) in place of
            the built-ins ``config.kv_tiers`` names (docs/kv_connector.md).
    """

    block_allocator: BlockAllocator | Factory[BlockAllocator] | None = _component_field()
    eviction_policy: EvictionPolicy | Factory[EvictionPolicy] | None = _component_field()
    prefix_index: PrefixIndex | Factory[PrefixIndex] | None = _component_field()
    cache_manager: KVCacheManager | Factory[KVCacheManager] | None = _component_field()
    admission_policy: AdmissionPolicy | Factory[AdmissionPolicy] | None = _component_field()
    preemption_policy: PreemptionPolicy | Factory[PreemptionPolicy] | None = _component_field()
    batching_policy: BatchingPolicy | Factory[BatchingPolicy] | None = _component_field()
    scheduler: Scheduler | Factory[Scheduler] | None = _component_field()
    executor: OverlapExecutor | Factory[OverlapExecutor] | None = _component_field()
    cost_model: CostModel | Factory[CostModel] | None = _component_field()
    sampler: Sampler | Factory[Sampler] | None = _component_field()
    draft_verifier: DraftVerifier | Factory[DraftVerifier] | None = _component_field()
    drafter: Drafter | Factory[Drafter] | None = _component_field()
    verify_planner: VerifyPlanner | Factory[VerifyPlanner] | None = _component_field()
    router: Factory[Router] | None = _component_field()
    dispatcher: Factory[Dispatcher] | None = _component_field()
    replica_selector: Factory[ReplicaSelector] | None = _component_field()
    placement_policy: PlacementPolicy | Factory[PlacementPolicy] | None = _component_field()
    kv_connector: Factory[tuple[KVConnectorScheduler, KVConnectorWorker]] | None = _component_field()

    def __attrs_post_init__(self) -> None:
        for kind in ("router", "dispatcher", "replica_selector", "kv_connector"):
            value = getattr(self, kind)
            if value is not None and not isinstance(value, Factory):
                why = "over the engine's KV pool" if kind == "kv_connector" else "once per MoE layer"
                raise ConfigError(f"components.{kind} is built {why}: give a Factory, got {value!r}")
        owners = (("cache_manager", ("block_allocator", "prefix_index", "eviction_policy")),
                  ("prefix_index", ("eviction_policy",)),
                  ("scheduler", ("admission_policy", "preemption_policy", "batching_policy")))
        for owner, parts in owners:
            clash = [p for p in parts if getattr(self, owner) is not None and getattr(self, p) is not None]
            if clash:
                raise ConfigError(
                    f"components.{owner} owns its {', '.join(clash)}: give those to it, not beside it")

    def given(self) -> dict[str, Any]:
        """``{kind: component}`` of the kinds set (not ``None``)."""
        return {kind: getattr(self, kind) for kind in KINDS if getattr(self, kind) is not None}

    def device_side(self) -> Components:
        """These components with the host kinds cleared (what crosses to a worker)."""
        return attrs.evolve(self, **{kind: None for kind in HOST_KINDS})

    def check_crosses(self) -> None:
        """Raise ConfigError unless every device component set can cross into a worker
        process: a :class:`Factory` of a module-level callable, or an instance that pickles
        (the message says how to pass one that does not)."""
        for kind in DEVICE_KINDS:
            value = getattr(self, kind)
            if value is None:
                continue
            if isinstance(value, Factory):
                value.check_crosses(kind)
                continue
            try:
                pickle.dumps(value)
            except Exception as exc:  # noqa: BLE001 - any failure means it cannot cross
                raise ConfigError(
                    f"components.{kind}: {type(value).__name__} lives in the worker process, and this "
                    f"instance does not pickle ({exc}); pass Factory(make) with make a module-level "
                    f"callable taking the BuildContext, built in the worker"
                ) from exc


def build(value: T | Factory[T] | None, context: BuildContext) -> T | None:
    """The component ``value`` names: itself (an instance), ``value(context)`` (a
    :class:`Factory`), or ``None``. Raises what the factory raises."""
    if isinstance(value, Factory):
        built: T = value(context)
        return built
    return value


def parse_component(text: str) -> tuple[str, Factory[Any]]:
    """``"kind=package.module:callable"`` (the command line's ``--component``) as
    ``(kind, Factory)``.

    Raises:
        ConfigError: an unknown kind (names the known ones) or a bad path.
    """
    kind, sep, path = text.partition("=")
    kind = kind.strip().replace("-", "_")
    if not sep or kind not in KINDS:
        raise ConfigError(f"--component must be KIND=package.module:callable with KIND one of "
                          f"{list(KINDS)}, got {text!r}")
    return kind, Factory.from_path(path.strip())
