"""ForecastPlacementPolicy: place from an exponentially weighted history of load windows."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer_kit.eplb.protocols import PlacementPolicy
from deepinfer_kit.eplb.records import Placement, Topology
from deepinfer_kit.eplb.steps import window_sum
from deepinfer_kit.errors import ConfigError

__all__ = ["ForecastPlacementPolicy"]


class ForecastPlacementPolicy:
    """Wraps a policy so it plans from ``forecast = decay * forecast + (1 - decay) * share``.

    Each window's total (the sum of its steps) is normalised to its per-layer share of the load before it enters the
    average (a busy window does not outweigh a quiet one), and the forecast is scaled back
    to the latest window's totals before it is handed to ``inner``.

    Args:
        inner: the policy that plans from the forecast.
        decay: weight of the history in ``[0, 1)``; 0 plans from the last window alone.

    Raises:
        ConfigError: ``decay`` outside ``[0, 1)``.
    """

    def __init__(self, inner: PlacementPolicy, decay: float = 0.5) -> None:
        if not 0.0 <= decay < 1.0:
            raise ConfigError(f"decay must be in [0, 1), got {decay}")
        self._inner = inner
        self._decay = decay
        self._share: torch.Tensor | None = None  # [L, E] float64

    @property
    def forecast(self) -> torch.Tensor | None:
        """``[L, E]`` float64 forecast share of each expert per layer, or None before any window."""
        return self._share

    def reset(self) -> None:
        """Forget the history (the next ``place`` starts from its window alone)."""
        self._share = None

    def place(self, load: torch.Tensor, topology: Topology) -> Placement:
        """Fold the window's total (``load``: ``[S, L, E]`` per-step counts, CPU) into the
        forecast, then plan from the forecast: ``inner`` sees a window of one step, the
        forecast scaled to this window's totals.

        Mutates the history; a window of a different ``[L, E]`` restarts it.

        Raises:
            ConfigError: as :meth:`PlacementPolicy.place`.
        """
        w = window_sum(load).double()
        total = w.sum(dim=1, keepdim=True)
        share = w / total.clamp_min(1e-300)
        if self._share is None or self._share.shape != share.shape:
            self._share = share
        else:
            self._share = self._decay * self._share + (1.0 - self._decay) * share
        scale = torch.where(total > 0, total, torch.ones_like(total))
        return self._inner.place((self._share * scale)[None], topology)


if TYPE_CHECKING:
    _check: type[PlacementPolicy] = ForecastPlacementPolicy
