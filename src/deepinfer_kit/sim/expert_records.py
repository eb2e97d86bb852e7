"""Records of the simulated MoE: the router's shape (ExpertRouting) and what a run measured
(ExpertReport). Torch-free, so the sim package stays host-only until experts take part."""

from __future__ import annotations

import attrs

from deepinfer_kit._validators import int_at_least
from deepinfer_kit.errors import ConfigError

__all__ = ["ExpertRouting", "ExpertReport"]


def _fraction(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{attribute.name} must be a number in [0, 1], got {value!r}")


def _non_negative(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0.0:
        raise ConfigError(f"{attribute.name} must be a number >= 0, got {value!r}")


@attrs.frozen(slots=True)
class ExpertRouting:
    """The simulated MoE model and its router (the dense cost model's shape has none).

    Attributes:
        num_layers: ``L`` MoE layers.
        num_experts, top_k: ``E`` routed experts, ``k`` picked per token.
        exponent: Zipf exponent of expert popularity.
        correlation: AR(1) correlation of the log-weights between drift steps.
        drift_every: routed steps between drift steps.
        moe_fraction: ``f``, the share of a perfectly balanced step's time spent in the
            routed experts (the part imbalance stretches).
        seed: the router's seed.
    """

    num_layers: int = attrs.field(default=28, validator=int_at_least(1))
    num_experts: int = attrs.field(default=64, validator=int_at_least(1))
    top_k: int = attrs.field(default=8, validator=int_at_least(1))
    exponent: float = attrs.field(default=1.0, validator=_non_negative)
    correlation: float = attrs.field(default=0.98, validator=_fraction)
    drift_every: int = attrs.field(default=32, validator=int_at_least(1))
    moe_fraction: float = attrs.field(default=0.5, validator=_fraction)
    seed: int = attrs.field(default=0, validator=int_at_least(0))

    def __attrs_post_init__(self) -> None:
        if self.top_k > self.num_experts:
            raise ConfigError(f"top_k must be <= num_experts={self.num_experts}, got {self.top_k}")


@attrs.frozen(slots=True)
class ExpertReport:
    """Expert balancedness of a run (balancedness = mean / max GPU load; 1 is perfect).

    Attributes:
        balance_mean, balance_min: over every (interval, layer), the placement in force
            judged on the counts routed during that interval (the last, partial one
            included).
        oracle_mean, oracle_min: the same for DeepSeek's hierarchical policy planned
            from those very counts (perfect foresight).
        step_balance_mean: mean over steps of the layer-mean per-step balancedness
            (what the cost model sees; small steps are noisy).
        slowdown_mean: mean over steps of the step-time factor applied.
        rebalances: plans applied; replicas_moved: slots that changed expert, summed.
    """

    balance_mean: float
    balance_min: float
    oracle_mean: float
    oracle_min: float
    step_balance_mean: float
    slowdown_mean: float
    rebalances: int
    replicas_moved: int

    def summary(self) -> dict[str, float | int]:
        """The fields as a flat row (keys prefixed ``moe_``)."""
        return {f"moe_{k}": v for k, v in attrs.asdict(self).items()}
