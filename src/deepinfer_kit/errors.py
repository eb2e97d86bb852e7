"""The exception tree: every error this library raises derives from DeepInferError."""

from __future__ import annotations

__all__ = [
    "DeepInferError",
    "ConfigError",
    "CheckpointError",
    "CapacityError",
    "OutOfBlocksError",
    "InvariantError",
    "DeviceUnavailableError",
    "GraphCaptureError",
    "EngineDeadError",
    "CollectiveError",
]


class DeepInferError(Exception):
    """Root of every exception raised by deepinfer_kit."""


class ConfigError(DeepInferError, ValueError):
    """Bad user input: a parameter, a config field, a prompt, a checkpoint.

    The message always names the field and the offending value, e.g.
    ``top_p must be in (0, 1], got 0.0``.
    """


class CheckpointError(ConfigError):
    """A checkpoint folder that cannot be loaded (names the file or tensor at fault)."""


class CapacityError(DeepInferError):
    """A resource (KV blocks, slots, sequence length) ran out."""


class OutOfBlocksError(CapacityError):
    """The block pool cannot satisfy an allocation; nothing was allocated."""


class InvariantError(DeepInferError, RuntimeError):
    """A caller broke a contract: double free, unknown block, releasing what was never held."""


class DeviceUnavailableError(DeepInferError, RuntimeError):
    """A kernel or device was asked for on a machine that does not have it."""


class GraphCaptureError(DeepInferError, RuntimeError):
    """A decode round could not be captured as a CUDA graph while the engine was built (the
    model synchronised with the host, used a foreign stream, or a kernel refused capture).
    The message names the batch size and the cause; ``EngineConfig(cuda_graphs=False)`` is
    the way to run every round eagerly."""


class EngineDeadError(DeepInferError, RuntimeError):
    """The engine cannot go on: a component failed in a way it cannot recover from (the
    scheduler raised, or steps kept failing). The cause is chained; every later call
    raises this error again rather than an unrelated one."""


class CollectiveError(EngineDeadError):
    """A collective (all-reduce, all-gather, broadcast, all-to-all) failed or timed out on
    this rank: a peer died, raised, or stalled past the timeout. The process group is
    broken, so this is an :class:`EngineDeadError`: no later step can run on it."""
