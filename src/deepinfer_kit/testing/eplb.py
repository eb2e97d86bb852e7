"""Conformance suite for PlacementPolicy: a window of per-step counts ``[S, L, E]`` in, a
valid placement out; bad windows refused naming ``load``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_kit.eplb.protocols import PlacementPolicy
from deepinfer_kit.eplb.records import Placement, Topology
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["PlacementFactory", "PLACEMENT_POLICY_SUITE"]

PlacementFactory = Callable[[], PlacementPolicy]
"""``factory()`` -> a placement policy (a fresh one per call: stateful policies start anew)."""

PLACEMENT_POLICY_SUITE: Suite[PlacementFactory] = Suite("PlacementPolicy", "factory() -> PlacementPolicy")

_TOPOLOGY = Topology(num_physical_experts=12, num_gpus=4)
_STEP = torch.tensor([[90, 10, 10, 10, 5, 5, 5, 5], [1, 1, 1, 1, 1, 1, 1, 1]])  # [L=2, E=8]
# Five steps of two alternating hot sets, plus a quiet one: per-step structure a sum hides.
_WINDOW = torch.tensor([
    [[60, 2, 1, 1, 50, 1, 1, 1], [9, 9, 0, 0, 0, 0, 3, 3]],
    [[2, 60, 1, 1, 1, 50, 1, 1], [0, 0, 9, 9, 3, 3, 0, 0]],
    [[60, 2, 1, 1, 50, 1, 1, 1], [9, 9, 0, 0, 0, 0, 3, 3]],
    [[2, 60, 1, 1, 1, 50, 1, 1], [0, 0, 9, 9, 3, 3, 0, 0]],
    [[0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]],
])


def _valid(placement: Placement, layers: int, experts: int, topology: Topology) -> None:
    slots = topology.num_physical_experts
    phy2log, logcnt = placement.phy2log, placement.logcnt
    expect(tuple(phy2log.shape) == (layers, slots), f"phy2log shape {tuple(phy2log.shape)}, want {(layers, slots)}")
    expect(tuple(logcnt.shape) == (layers, experts), f"logcnt shape {tuple(logcnt.shape)}, want {(layers, experts)}")
    expect(bool((logcnt >= 1).all()), "every logical expert needs a replica")
    expect(bool((logcnt.sum(dim=1) == slots).all()), "replica counts must sum to P")
    for layer in range(layers):
        counted = torch.bincount(phy2log[layer], minlength=experts)
        expect(torch.equal(counted, logcnt[layer]), f"layer {layer}: logcnt disagrees with phy2log")
        for e in range(experts):
            real = placement.log2phy[layer, e, : int(logcnt[layer, e])]
            expect(bool((phy2log[layer, real] == e).all()), f"layer {layer}: log2phy of expert {e} disagrees")


def _refused(factory: PlacementFactory, load: object, needle: str) -> None:
    try:
        factory().place(load, _TOPOLOGY)  # type: ignore[arg-type]
    except ConfigError as err:
        expect("load" in str(err), f"the ConfigError must name the field 'load', got {err}")
        expect(needle in str(err), f"the ConfigError must say {needle!r}, got {err}")
        return
    except Exception as err:  # noqa: BLE001 - reported as the contract failure it is
        expect(False, f"a bad window must raise ConfigError, got {type(err).__name__}: {err}")
    expect(False, f"a bad window ({needle}) must raise ConfigError, got a placement")


@PLACEMENT_POLICY_SUITE.check
def check_every_expert_placed_and_slots_filled(factory: PlacementFactory) -> None:
    _valid(factory().place(_STEP[None], _TOPOLOGY), 2, 8, _TOPOLOGY)


@PLACEMENT_POLICY_SUITE.check
def check_multi_step_windows_are_accepted(factory: PlacementFactory) -> None:
    policy = factory()
    for window in (_WINDOW, _WINDOW[:2], _WINDOW.flip(0)):
        load = window.clone()
        _valid(policy.place(window, _TOPOLOGY), 2, 8, _TOPOLOGY)
        expect(torch.equal(window, load), "place must not mutate load")


@PLACEMENT_POLICY_SUITE.check
def check_steps_alike_plan_as_one_step_of_their_sum(factory: PlacementFactory) -> None:
    alike = factory().place(torch.stack([_STEP, _STEP]), _TOPOLOGY)
    summed = factory().place((2 * _STEP)[None], _TOPOLOGY)
    expect(torch.equal(alike.phy2log, summed.phy2log),
           "a window of two alike steps must plan as the one step of their sum (the [L, E] contract)")


@PLACEMENT_POLICY_SUITE.check
def check_numeric_dtypes_are_accepted(factory: PlacementFactory) -> None:
    for dtype in (torch.int32, torch.int64, torch.float32, torch.float64):
        _valid(factory().place(_WINDOW.to(dtype), _TOPOLOGY), 2, 8, _TOPOLOGY)


@PLACEMENT_POLICY_SUITE.check
def check_bad_windows_raise_config_error_naming_load(factory: PlacementFactory) -> None:
    _refused(factory, _STEP, "(2, 8)")  # the old [L, E] form
    _refused(factory, _WINDOW[None], str(tuple(_WINDOW[None].shape)))
    _refused(factory, _WINDOW[:0], "(0, 2, 8)")
    _refused(factory, torch.zeros(3, 2, 0, dtype=torch.int64), "(3, 2, 0)")
    _refused(factory, _WINDOW.bool(), "dtype")
    _refused(factory, -_WINDOW, ">= 0")
    _refused(factory, torch.full((2, 2, 8), float("nan")), "finite")
    _refused(factory, _WINDOW.tolist(), "list")
