"""The kit's scheduler and block manager inside transformers' continuous batching.

Importing this package imports transformers. Use :func:`register` (or the
:func:`kit_scheduler` context manager) to add the kit's scheduler to transformers'
``SCHEDULER_MAPPING``, then pass ``ContinuousBatchingConfig(scheduler_type=name,
use_async_batching=False)`` to ``model.generate_batch``.
"""

from deepinfer_kit.adapters.transformers.blocks import ClaimedBlocks
from deepinfer_kit.adapters.transformers.register import (
    KitSchedulerFactory,
    kit_scheduler,
    register,
    unregister,
)
from deepinfer_kit.adapters.transformers.scheduler import (
    TESTED_TRANSFORMERS,
    KitScheduler,
)

__all__ = [
    "KitScheduler",
    "KitSchedulerFactory",
    "ClaimedBlocks",
    "register",
    "unregister",
    "kit_scheduler",
    "TESTED_TRANSFORMERS",
]
