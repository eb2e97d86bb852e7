"""A spy on an engine's static decode path: the rounds it ran, for tests of that path."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from deepinfer_kit.engine.runner.static_decode import StaticDecode


@attrs.frozen
class StaticRound:
    """One round the static path ran: its ladder ``size`` and a copy of its row mask."""

    size: int
    mask: torch.Tensor | None  # the batch's real_rows, copied on its device (no host read)

    @property
    def real(self) -> int:
        """Real (unpadded) rows of the round: a host read, for after the run."""
        return self.size if self.mask is None else int(self.mask.sum())


def record_static_rounds(engine: Any) -> list[StaticRound]:
    """Wrap ``engine``'s static decode forward; the returned list receives each round it
    runs from now on. Reads nothing back while the engine runs."""
    static: StaticDecode | None = engine.runner.static
    assert static is not None, "the engine has no static decode path"
    rounds: list[StaticRound] = []
    forward = static.forward

    def spy(batch: Any, size: int) -> torch.Tensor:
        real = batch.real_rows
        rounds.append(StaticRound(size, None if real is None else real.clone()))
        return forward(batch, size)

    static.forward = spy  # type: ignore[method-assign]
    return rounds
