"""ZipfDrift: per-layer Zipf expert popularity whose log-weights drift as an AR(1) process."""

from __future__ import annotations

import math

import torch

from deepinfer_kit._validators import require_ints_at_least
from deepinfer_kit.errors import ConfigError

__all__ = ["ZipfDrift"]


class ZipfDrift:
    """Drifting Zipf popularity of ``E`` experts in each of ``L`` layers (CPU, float64).

    Each layer starts from Zipf log-weights ``-exponent * log(rank)`` over a random
    permutation of its experts, centred. :meth:`drift` takes one AR(1) step of the
    log-weights, ``z' = c z + sqrt(1 - c^2) * std(z) * noise``, so consecutive states
    correlate ~``c``. Used by the EPLB trace generator and the simulator's router.

    Args:
        num_layers, num_experts: ``L``, ``E``.
        exponent: Zipf exponent (0: uniform popularity).
        correlation: ``c`` in [0, 1].
        generator: the torch generator every draw uses (mutated; seeds the state).

    Raises:
        ConfigError: a size below 1, ``correlation`` outside [0, 1] or ``exponent`` < 0.
    """

    def __init__(self, num_layers: int, num_experts: int, *, exponent: float,
                 correlation: float, generator: torch.Generator) -> None:
        require_ints_at_least(1, num_layers=num_layers, num_experts=num_experts)
        if not 0.0 <= correlation <= 1.0:
            raise ConfigError(f"correlation must be in [0, 1], got {correlation}")
        if not exponent >= 0.0:
            raise ConfigError(f"exponent must be >= 0, got {exponent}")
        self.correlation = correlation
        self._gen = generator
        ranks = torch.stack([torch.randperm(num_experts, generator=generator) for _ in range(num_layers)])
        z = -exponent * torch.log1p(ranks.double())
        self.log_weights = z - z.mean(dim=1, keepdim=True)
        """``[L, E]`` float64 current log-weights (centred at the start)."""
        self._spread = (self.log_weights.std(dim=1, keepdim=True).clamp_min(1e-12)
                        if num_experts > 1 else torch.ones(num_layers, 1, dtype=torch.float64))

    def probabilities(self) -> torch.Tensor:
        """``[L, E]`` float64 routing probabilities now (softmax of the log-weights). Pure."""
        return torch.softmax(self.log_weights, dim=1)

    def drift(self) -> None:
        """One AR(1) step of the log-weights; draws ``L * E`` normals from the generator."""
        noise = torch.randn(self.log_weights.shape, generator=self._gen, dtype=torch.float64)
        c = self.correlation
        self.log_weights = c * self.log_weights + math.sqrt(1.0 - c**2) * self._spread * noise
