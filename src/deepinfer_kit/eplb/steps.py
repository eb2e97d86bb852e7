"""The window a PlacementPolicy receives: per-step counts ``[S, L, E]``, validated, summed
or normalised per step.

Shape symbols: ``S`` steps of the window (oldest first), ``L`` layers, ``E`` logical
experts.
"""

from __future__ import annotations

import torch

from deepinfer_kit.errors import ConfigError

__all__ = ["check_steps", "window_sum", "step_shares"]


def check_steps(load: object, name: str = "load") -> torch.Tensor:
    """Validate a window of per-step counts and return it unchanged.

    Args:
        load: ``[S, L, E]`` counts per step, layer and logical expert, ``S, L, E >= 1``
            (CPU; any integer or floating dtype, not bool or complex).
        name: the argument's name in the error messages.

    Returns:
        ``load`` itself (not copied, not mutated).

    Raises:
        ConfigError: not a tensor, not 3-D, an empty dimension, a bool or complex dtype,
            a non-finite or negative entry (the message names ``name`` and the value).
    """
    if not isinstance(load, torch.Tensor):
        raise ConfigError(f"{name} must be a torch.Tensor of per-step counts [S, L, E], got {type(load).__name__}")
    if load.dim() != 3 or min(load.shape) < 1:
        raise ConfigError(
            f"{name} must be per-step counts [S, L, E] with S, L, E >= 1, got shape {tuple(load.shape)}"
        )
    if load.dtype == torch.bool or load.is_complex():
        raise ConfigError(f"{name} must have an integer or floating dtype, got {load.dtype}")
    if load.is_floating_point() and not bool(torch.isfinite(load).all()):
        raise ConfigError(f"{name} must be finite")
    if bool((load < 0).any()):
        raise ConfigError(f"{name} must be >= 0, got min {float(load.min())}")
    return load


def window_sum(load: object, name: str = "load") -> torch.Tensor:
    """``[L, E]`` the window's counts summed over its steps (dtype kept; a new tensor).

    What every policy that plans from the window's total sees. Raises ConfigError as
    :func:`check_steps`.
    """
    return check_steps(load, name).sum(dim=0)


def step_shares(load: torch.Tensor) -> torch.Tensor:
    """``[S, L, E]`` float64: each step's counts divided by that step's total in its layer
    (a step and layer with no tokens stays 0), so every step weighs alike whatever its
    batch size. Pure; ``load`` is assumed checked (:func:`check_steps`)."""
    w = load.double()
    return w / w.sum(dim=2, keepdim=True).clamp_min(1e-300)
