"""EplbConfig: live expert rebalancing of an engine, validated where it is given."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from deepinfer_kit._validators import Validator, config_from, require_ints_at_least
from deepinfer_kit.eplb.records import Topology
from deepinfer_kit.errors import ConfigError

__all__ = ["EplbConfig", "POLICY_NAMES", "DISPATCH_NAMES"]

POLICY_NAMES = ("deepseek", "global", "refine", "forecast", "movement", "peak")
DISPATCH_NAMES = ("static", "even", "balanced")


def _at_least(minimum: int) -> Validator:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        require_ints_at_least(minimum, **{f"eplb.{attribute.name}": value})

    return check


def _check_policy(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in POLICY_NAMES:
        raise ConfigError(f"eplb.policy must be one of {list(POLICY_NAMES)}, got {value!r}")


def _check_dispatch(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in DISPATCH_NAMES:
        raise ConfigError(f"eplb.dispatch must be one of {list(DISPATCH_NAMES)}, got {value!r}")


def _check_groups(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        require_ints_at_least(1, **{"eplb.num_groups": value})


def _check_decay(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ConfigError(f"eplb.decay must be a number in [0, 1), got {value!r}")


@attrs.frozen(slots=True)
class EplbConfig:
    """Expert-parallel load balancing inside a running engine.

    Every MoE layer holds ``P = E + num_redundant`` physical expert slots, split evenly
    over ``num_gpus`` GPUs (virtual ones on a single device: they are the unit the
    policy balances and the trace draws). Each step's routed counts enter a sliding
    window of ``window`` steps on the device; every ``interval`` steps the engine plans a
    placement from the window's per-step counts and applies it between steps.

    Attributes:
        window: ``W``, steps of counts the plan looks at.
        interval: steps between rebalances.
        policy: ``"deepseek"`` (DeepSeek's hierarchical policy, global when the groups do
            not divide over the nodes), ``"global"``, ``"refine"`` (DeepSeek's packing plus
            swaps between the most and least loaded GPUs), ``"forecast"`` (refine over an
            exponentially weighted history of windows, weight ``decay``),
            ``"movement"`` (refine, relabelled to keep replicas in their slots) or
            ``"peak"`` (planned on the window's per-step peaks for the configured
            ``dispatch``, :class:`~deepinfer_kit.eplb.peak.PeakPlacementPolicy`; the other
            policies plan on the window's sum).
        num_redundant: extra slots per layer holding replicas of hot experts (``>= 0``).
        num_gpus, num_nodes: the topology the slots are split over (nodes divide GPUs).
        num_groups: expert groups for the hierarchical policy; ``None`` takes the
            router's ``n_group`` (1 for softmax routing).
        decay: history weight of ``"forecast"``, in ``[0, 1)``.
        dispatch: which replica serves each routed copy, decided per batch
            (:mod:`deepinfer_kit.moe.selectors`): ``"static"`` (a fixed spread by
            position), ``"even"`` (equal shares of each expert's copies) or
            ``"balanced"`` (the shares that minimise the busiest GPU's load).
    """

    window: int = attrs.field(default=32, validator=_at_least(1))
    interval: int = attrs.field(default=32, validator=_at_least(1))
    policy: str = attrs.field(default="deepseek", validator=_check_policy)
    num_redundant: int = attrs.field(default=0, validator=_at_least(0))
    num_gpus: int = attrs.field(default=1, validator=_at_least(1))
    num_nodes: int = attrs.field(default=1, validator=_at_least(1))
    num_groups: int | None = attrs.field(default=None, validator=_check_groups)
    decay: float = attrs.field(default=0.5, validator=_check_decay)
    dispatch: str = attrs.field(default="static", validator=_check_dispatch)

    @classmethod
    def coerce(cls, value: EplbConfig | Mapping[str, Any] | None) -> EplbConfig | None:
        """An :class:`EplbConfig` from itself, ``None``, or a dict with the same keys.

        Raises:
            ConfigError: another type, an unknown key, or a bad value (naming the field).
        """
        return config_from(cls, value, "eplb")

    def topology(self, num_experts: int, router_groups: int) -> Topology:
        """The :class:`Topology` of a layer with ``num_experts`` logical experts.

        Raises:
            ConfigError: the slots do not split evenly over the GPUs, the GPUs over the
                nodes, or the groups do not divide the experts (each message names the
                eplb field to change).
        """
        slots = num_experts + self.num_redundant
        groups = self.num_groups if self.num_groups is not None else router_groups
        if slots % self.num_gpus:
            raise ConfigError(
                f"eplb.num_redundant={self.num_redundant} gives {num_experts} experts + "
                f"{self.num_redundant} = {slots} slots, not divisible by eplb.num_gpus={self.num_gpus}"
            )
        if self.num_gpus % self.num_nodes:
            raise ConfigError(
                f"eplb.num_nodes must divide eplb.num_gpus={self.num_gpus}, got {self.num_nodes}"
            )
        if num_experts % groups:
            raise ConfigError(f"eplb.num_groups must divide the {num_experts} experts, got {groups}")
        return Topology(slots, num_groups=groups, num_nodes=self.num_nodes, num_gpus=self.num_gpus)
