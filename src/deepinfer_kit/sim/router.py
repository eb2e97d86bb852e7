"""SyntheticRouter: a simulated step's routed tokens as per-layer, per-expert counts, drawn
from drifting Zipf popularity (no per-token work).

Shape symbols: ``L`` MoE layers, ``E`` experts, ``k`` experts per token.
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer_kit._validators import require_ints_at_least
from deepinfer_kit.eplb.zipf import ZipfDrift
from deepinfer_kit.errors import ConfigError

__all__ = ["SyntheticRouter", "inclusion_probabilities"]


def inclusion_probabilities(p: np.ndarray, top_k: int) -> np.ndarray:
    """``[L, E]`` chance that a token picks each expert among its ``top_k``: ``min(1, c p)``
    with ``c`` per layer such that each row sums to ``top_k`` (an expert cannot be picked
    twice by one token, so a hot expert caps at 1 and its excess goes to the others).

    Args:
        p: ``[L, E]`` routing probabilities (rows sum to 1, all > 0).
        top_k: ``k`` in ``[1, E]``.

    Pure; at most ``k`` vectorised passes.
    """
    pi = p * top_k
    for _ in range(top_k):
        capped = pi >= 1.0
        if not (pi > 1.0).any():
            break
        free_mass = np.where(capped, 0.0, p).sum(axis=1, keepdims=True)
        left = top_k - capped.sum(axis=1, keepdims=True)
        pi = np.where(capped, 1.0, p * left / np.maximum(free_mass, 1e-300))
    out: np.ndarray = np.minimum(pi, 1.0)
    return out


class SyntheticRouter:
    """Routes each step's tokens to ``top_k`` of ``E`` experts in ``L`` layers.

    Popularity is a :class:`ZipfDrift` that takes one drift step every ``drift_every``
    routed steps. A step of ``n`` tokens gets, per layer, counts drawn multinomially
    (``n * top_k`` picks) from the inclusion probabilities
    (:func:`inclusion_probabilities`), with any expert over ``n`` capped at ``n`` and
    the excess re-drawn over the experts with room: every row sums to exactly
    ``n * top_k`` and no expert serves a token twice. Deterministic in ``seed``.

    Args:
        num_layers, num_experts, top_k: ``L``, ``E``, ``k`` (``1 <= k <= E``).
        exponent: Zipf exponent of the popularity; correlation: drift correlation ``c``.
        drift_every: routed steps between drift steps (the popularity's "window").
        seed: seeds both the drift and the per-step draws.

    Raises:
        ConfigError: a size below 1, ``top_k > num_experts``, or bad drift parameters.
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int, *, exponent: float = 1.0,
                 correlation: float = 0.98, drift_every: int = 32, seed: int = 0) -> None:
        require_ints_at_least(1, top_k=top_k, drift_every=drift_every)
        if top_k > num_experts:
            raise ConfigError(f"top_k must be <= num_experts={num_experts}, got {top_k}")
        self.top_k = top_k
        self.drift_every = drift_every
        self.popularity = ZipfDrift(num_layers, num_experts, exponent=exponent,
                                    correlation=correlation,
                                    generator=torch.Generator().manual_seed(seed))
        self._rng = np.random.default_rng(seed)
        self._pi = self._inclusion()
        self.num_steps = 0

    def _inclusion(self) -> np.ndarray:
        z = self.popularity.log_weights.numpy()
        w = np.exp(z - z.max(axis=1, keepdims=True))  # softmax, without torch's thread pool
        return inclusion_probabilities(w / w.sum(axis=1, keepdims=True), self.top_k)

    def route(self, num_tokens: int) -> np.ndarray:
        """``[L, E]`` int64 counts of one step of ``num_tokens`` tokens (each row sums to
        ``num_tokens * top_k``, every entry <= ``num_tokens``). Advances the step count
        and, every ``drift_every`` steps, the popularity. O(L * E) numpy work."""
        pi = self._pi
        counts = self._rng.multinomial(num_tokens * self.top_k, pi / self.top_k)
        excess = np.maximum(counts - num_tokens, 0).sum(axis=1)
        while excess.any():  # rare: only when a capped expert drew more than n
            np.minimum(counts, num_tokens, out=counts)
            room = (num_tokens - counts) * pi
            extra = self._rng.multinomial(excess, room / room.sum(axis=1, keepdims=True))
            counts += extra
            excess = np.maximum(counts - num_tokens, 0).sum(axis=1)
        self.num_steps += 1
        if self.num_steps % self.drift_every == 0:
            self.popularity.drift()
            self._pi = self._inclusion()
        return counts.astype(np.int64, copy=False)
