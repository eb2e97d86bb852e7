"""Registering the kit's scheduler in transformers' SCHEDULER_MAPPING."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from transformers.generation.continuous_batching import scheduler as _tf_scheduler

from deepinfer_kit.adapters.transformers.scheduler import Batching, KitScheduler
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sched.records import SchedulerConfig

__all__ = ["KitSchedulerFactory", "register", "unregister", "kit_scheduler"]


class KitSchedulerFactory:
    """What transformers finds in ``SCHEDULER_MAPPING``: builds a :class:`KitScheduler`
    with the kit options bound, and keeps the schedulers it built (``built``, newest
    last) so a caller can read their counters after ``generate_batch`` returns.

    Args: as :class:`KitScheduler` after its first three.
    """

    def __init__(
        self,
        *,
        config: SchedulerConfig | None = None,
        batching: Batching = "continuous",
        prefix_caching: bool = True,
        index: Literal["radix", "hash"] = "radix",
        strict_version: bool = True,
    ) -> None:
        self.config = config
        self.batching: Batching = batching
        self.prefix_caching = prefix_caching
        self.index: Literal["radix", "hash"] = index
        self.strict_version = strict_version
        self.built: list[KitScheduler] = []

    def __call__(self, cache: Any, safety_margin: float | None, max_requests_per_batch: int) -> KitScheduler:
        """Build a scheduler over ``cache`` (transformers' call). See :class:`KitScheduler`."""
        sched = KitScheduler(
            cache,
            safety_margin,
            max_requests_per_batch,
            config=self.config,
            batching=self.batching,
            prefix_caching=self.prefix_caching,
            index=self.index,
            strict_version=self.strict_version,
        )
        self.built.append(sched)
        return sched

    @property
    def last(self) -> KitScheduler:
        """The scheduler built most recently.

        Raises:
            ConfigError: none was built yet.
        """
        if not self.built:
            raise ConfigError("no scheduler was built yet: run generate_batch first")
        return self.built[-1]


def register(name: str = "kit", **options: Any) -> KitSchedulerFactory:
    """Add a :class:`KitSchedulerFactory` built with ``options`` to transformers'
    ``SCHEDULER_MAPPING`` under ``name`` (a process-wide table of the peer) and return it.

    Raises:
        ConfigError: ``name`` is one of transformers' own schedulers.
    """
    mapping: dict[str, Any] = _tf_scheduler.SCHEDULER_MAPPING
    existing = mapping.get(name)
    if existing is not None and not isinstance(existing, KitSchedulerFactory):
        raise ConfigError(f"name must not replace transformers' scheduler {name!r}")
    factory = KitSchedulerFactory(**options)
    mapping[name] = factory
    return factory


def unregister(name: str = "kit") -> None:
    """Remove a factory added by :func:`register` (no-op when absent)."""
    mapping: dict[str, Any] = _tf_scheduler.SCHEDULER_MAPPING
    if isinstance(mapping.get(name), KitSchedulerFactory):
        del mapping[name]


@contextmanager
def kit_scheduler(name: str = "kit", **options: Any) -> Iterator[KitSchedulerFactory]:
    """:func:`register` for the duration of a ``with`` block, then :func:`unregister`."""
    factory = register(name, **options)
    try:
        yield factory
    finally:
        unregister(name)
