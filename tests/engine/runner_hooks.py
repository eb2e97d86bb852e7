"""``worker_setup`` hooks for tests of the worker process: module-level classes, so they
pickle by reference and a worker can import them (it gets this process's ``sys.path``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


class MarkSteps:
    """Each execute sleeps ``seconds``, then writes ``<folder>/done-<step id>``."""

    def __init__(self, folder: str, seconds: float) -> None:
        self.folder, self.seconds = folder, seconds

    def __call__(self, runner: Any) -> None:
        inner = runner.execute

        def execute(step: Any) -> Any:
            result = inner(step)
            time.sleep(self.seconds)
            (Path(self.folder) / f"done-{step.plan.step_id}").write_text("")
            return result

        runner.execute = execute


class KeepSlots:
    """The worker's token slots are never released (a leak the idle check must see)."""

    def __call__(self, runner: Any) -> None:
        runner.token_slots.release_through = lambda step_id: []


class Explode:
    """Fails the build in the worker."""

    def __call__(self, runner: Any) -> None:
        raise RuntimeError("setup exploded")


class FailLoadsOnRank:
    """Every KV tier load on tensor-parallel rank ``rank`` fails (its shard of the block is
    never written; reported in ``failed_loads``); the other ranks load theirs."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self, runner: Any) -> None:
        import torch.distributed as dist

        from deepinfer_kit.testing.kv_connector import FlakyWorker

        plain = getattr(runner, "runner", runner)
        if dist.is_initialized() and dist.get_rank() == self.rank:
            plain.kv_transfer = FlakyWorker(plain.kv_transfer, fail_loads=True)
