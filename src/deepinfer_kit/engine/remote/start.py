"""Starting an engine's device half in worker processes: one per rank (tensor- times
expert-parallel), each building :func:`~deepinfer_kit.engine.runner.build.build_device`
there, and the host's handles on them — the runner and, with EPLB, the balancer."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import torch

from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.remote.balancer import RemoteBalancer
from deepinfer_kit.engine.remote.process_group import ProcessGroupRunner
from deepinfer_kit.engine.remote.process_runner import ProcessRunner, WorkerSpec
from deepinfer_kit.engine.runner.pool import engine_device

if TYPE_CHECKING:
    from deepinfer_kit.comm.protocols import Communicator
    from deepinfer_kit.engine.runner.speculative import ServingRunner
    from deepinfer_kit.components import Components

__all__ = ["RemoteParts", "start_workers"]


@attrs.frozen(slots=True)
class RemoteParts:
    """The host's handles on the worker processes :func:`start_workers` started.

    Attributes:
        runner: the :class:`StepRunner` over them (its ``info``: the pool and model the
            workers reported).
        balancer: the live EPLB in the workers, driven from the host (``None`` without eplb).
    """

    runner: ProcessRunner | ProcessGroupRunner
    balancer: RemoteBalancer | None


def start_workers(config: EngineConfig, depth: int, components: Components | None,
                  setup: Callable[[ServingRunner], object] | None,
                  wrap_comm: Callable[[Communicator], Communicator] | None) -> RemoteParts:
    """Start one worker process per rank of ``config`` (``tensor_parallel *
    expert_parallel``; a :class:`ProcessGroupRunner` over several) and wait until each has
    built its device half. ``components`` (device kinds), ``setup`` and ``wrap_comm`` must
    pickle (by reference for functions); ``setup`` runs in each worker with its runner.

    Raises:
        ConfigError: an unknown device, or what building raised in a worker.
        EngineDeadError: a worker exited or did not report in time.
    """
    engine_device(config)  # fails here, before a process starts
    worker = WorkerSpec(config, depth, components, setup, torch.get_num_threads(), wrap_comm=wrap_comm)
    runner: ProcessRunner | ProcessGroupRunner = (
        ProcessGroupRunner(worker) if config.expert_parallel * config.tensor_parallel > 1
        else ProcessRunner(worker)
    )
    balancer = None
    if config.eplb is not None:
        state = runner.info.balancer
        assert state is not None  # the worker built one
        balancer = RemoteBalancer(runner, config.eplb, state)
    return RemoteParts(runner, balancer)
