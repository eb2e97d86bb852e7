"""Probe: a worker_setup that skews an MoE model's routing and times its MoE layers per rank
(for benchmarks/bench_eplb_engine.py; importable in a spawned worker process)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepinfer_kit.engine.runner.balance import moe_layers
from deepinfer_kit.engine.runner.model_runner import ModelRunner
from deepinfer_kit.moe.ep_dispatcher import ExpertParallelDispatcher
from deepinfer_kit.moe.records import Routing

__all__ = ["Probe"]


class _TimedSelector:
    """Wraps a selector, adding its wall time to ``probe.times['select']``."""

    def __init__(self, inner: Any, probe: Probe) -> None:
        self.inner, self.probe, self.name = inner, probe, inner.name

    def select(self, *args: Any) -> Any:
        """The wrapped selector's ``select``, timed."""
        start = time.perf_counter()
        out = self.inner.select(*args)
        self.probe.times["select"] += time.perf_counter() - start
        return out


class Probe:
    """worker_setup: skew the routing and time the MoE layers of this rank (picklable).

    Args:
        out_dir: where each rank writes ``rank{r}.json`` (seconds in the MoE layers, the
            expert compute and the selector; forwards) after every forward.
        skew: share of tokens (chosen by position, alike on every rank and run) whose
            first expert becomes expert 0.
        threads: torch threads per rank (None leaves the default).

    Each rank also records ``copies``: the token copies its experts received, per MoE
    layer call, in call order (the same calls on every rank); and the seconds spent inside
    the MoE layers in ``all_gather`` and ``all_to_all_single`` (``torch.distributed``'s,
    wrapped in an expert-parallel rank's worker process; never in the engine's process).
    """

    def __init__(self, out_dir: str, skew: float, threads: int | None = None) -> None:
        self.out_dir, self.skew, self.threads = out_dir, skew, threads
        self.times: dict[str, float] = {"moe": 0.0, "experts": 0.0, "select": 0.0, "all_gather": 0.0,
                                        "all_to_all_single": 0.0}
        self.copies: list[int] = []
        self._inside = False
        self.forwards = 0

    def __call__(self, runner: ModelRunner) -> None:
        """Install the hooks on this worker's MoE layers."""
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        layers = moe_layers(runner.model)
        rank = 0
        for i, layer in enumerate(layers):
            layer.gate.register_forward_hook(self._skew)
            self._time(layer, "moe", last=i == len(layers) - 1)
            self._time(layer.experts, "experts", last=False)
            layer.register_forward_pre_hook(self._enter)
            layer.register_forward_hook(self._leave)
            layer.experts.register_forward_pre_hook(self._count)
            if isinstance(layer.dispatcher, ExpertParallelDispatcher):
                rank = layer.dispatcher.rank
                layer.dispatcher.selector = _TimedSelector(layer.dispatcher.selector, self)
        if any(isinstance(layer.dispatcher, ExpertParallelDispatcher) for layer in layers):
            for name in ("all_gather", "all_to_all_single"):  # this rank's own worker process
                setattr(dist, name, self._timed(name, getattr(dist, name)))
        self.path = Path(self.out_dir) / f"rank{rank}.json"

    def _skew(self, module: Any, args: Any, out: Routing) -> Routing:
        ids = out.expert_ids
        t = torch.arange(ids.shape[0], device=ids.device)
        hot = (t * 7919 % 100) < int(self.skew * 100)
        first, second = ids[:, 0], ids[:, 1]
        new_second = torch.where(hot & (second == 0), first, second)
        new_first = torch.where(hot, torch.zeros_like(first), first)
        return Routing(torch.stack([new_first, new_second, *ids[:, 2:].unbind(1)], 1), out.weights)

    def _timed(self, key: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = call(*args, **kwargs)
            if self._inside:  # a rebalance's weight moves are not the MoE step's
                self.times[key] += time.perf_counter() - start
            return out
        return timed

    def _enter(self, module: Any, args: Any) -> None:
        self._inside = True

    def _leave(self, module: Any, args: Any, out: Any) -> None:
        self._inside = False

    def _count(self, module: Any, args: Any) -> None:
        self.copies.append(int(args[0].shape[0]))

    def _time(self, module: torch.nn.Module, key: str, last: bool) -> None:
        start: list[float] = []

        def pre(mod: Any, args: Any) -> None:
            start.append(time.perf_counter())

        def post(mod: Any, args: Any, out: Any) -> None:
            self.times[key] += time.perf_counter() - start.pop()
            if last:
                self.forwards += 1
                self.path.write_text(json.dumps(self.times | {"forwards": self.forwards, "copies": self.copies}))

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
