"""The worker process of a :class:`~deepinfer_kit.engine.remote.process_runner.ProcessRunner`:
builds the runner from a :class:`WorkerSpec` (and, with KV tiers, its host slab in shared
memory, whose descriptor follows the ``"ready"`` reply on the socket), then prepares and
executes the plans it receives, in order, replying to each (on a single CUDA rank a step
already received is launched before the one before it is finished, see :func:`_loop`).

Messages in (pickled tuples): ``("step", message, released, record_expert_counts, plan
bytes)``, ``("check", released)``, ``("rebalance", released, after_step)``,
``("kv_transfer", released, transfer plan)``, ``("close",)``. Replies out: ``(kind, message, payload)`` with kind ``"ready"`` (a :class:`WorkerInfo`),
``"failed"`` (the build's exception), ``"ok"`` (a :class:`StepResult`), ``"error"`` (the
step's exception), ``"undecoded"`` (the plan's bytes could not be decoded) or
``"answer"`` (to ``check``: a problem or ``None``; to ``rebalance``: ``(record,
balancer state)`` or the exception it raised; to ``kv_transfer``: the KV tiers' report or
the exception).

The worker ignores SIGINT (the host's Ctrl-C is the host's to handle) and exits when the
host closes its end of the socket, whatever the reason.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from collections.abc import Callable
from functools import partial
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

import attrs
import torch

from deepinfer_kit.cache.tiers.records import TransferPlan
from deepinfer_kit.engine.remote.plan_codec import PlanDecoder
from deepinfer_kit.engine.remote.process_runner import WorkerInfo, WorkerSpec
from deepinfer_kit.engine.remote.rank_groups import RankMeter, worker_groups
from deepinfer_kit.engine.runner.speculative import ServingRunner
from deepinfer_kit.engine.runner.build import build_device
from deepinfer_kit.engine.runner.kv_tiers import attach_worker_slab
from deepinfer_kit.engine.runner.pool import engine_device
from deepinfer_kit.errors import InvariantError
from deepinfer_kit.step import StepResult

__all__ = ["main", "serve"]


def main(fd: int) -> None:
    """Entry point: serve the host at the other end of socket ``fd`` until it leaves."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        serve(conn)
    finally:
        conn.close()


def serve(conn: Connection) -> None:
    """Build the runner of the :class:`WorkerSpec` that arrives first, then answer
    messages until ``close`` or the host's end closes."""
    try:
        spec = pickle.loads(conn.recv_bytes())
    except EOFError:
        return
    assert isinstance(spec, WorkerSpec)
    try:
        torch.set_num_threads(spec.threads)
        groups = worker_groups(spec, engine_device(spec.config))  # None: a single rank
        parts = build_device(spec.config, depth=spec.depth, components=spec.components, groups=groups)
        slab = attach_worker_slab(spec.config, parts.runner, parts.loaded.config, groups)
        if spec.setup is not None:  # after the tiers: a setup may wrap their device side
            spec.setup(parts.runner)
    except Exception as exc:  # noqa: BLE001 - reported to the host, which raises it
        _reply(conn, "failed", None, exc)
        return
    state = parts.balancer.state() if parts.balancer is not None else None
    info = WorkerInfo(os.getpid(), parts.num_blocks, spec.config.block_size, parts.max_model_len,
                      parts.loaded.config, state, kv_slab=slab[0] if slab is not None else None)
    _reply(conn, "ready", None, info)
    if slab is not None:  # the host maps the same memory (it reads the descriptor next)
        reduction.send_handle(conn, slab[1], os.getppid())
        os.close(slab[1])
    _loop(conn, parts.runner, RankMeter(groups, parts) if groups is not None else None)


def _loop(conn: Connection, runner: ServingRunner, meter: RankMeter | None = None, *,
          pipeline: bool | None = None) -> None:
    """Answer the host's messages in order until ``close`` or its end closes.

    With ``pipeline`` (default: a single rank on CUDA, where a launch only queues
    kernels), a step's reply waits while a next step already received is launched: after
    launching step ``k`` the worker looks (``conn.poll(0)``, not waiting) for the next
    message; a step that may pipeline (:meth:`ModelRunner.pipelines`) is launched before
    ``k`` is finished and answered. Anything else, or nothing yet, finishes ``k`` first.
    Replies go out in the order the steps came; tokens do not depend on which happened.
    """
    if pipeline is None:
        pipeline = meter is None and runner.device.type == "cuda"
    decoder = PlanDecoder()
    slots = runner.token_slots
    held: _Held | None = None  # a launched step not yet finished and answered
    while True:
        if held is not None and not conn.poll(0):
            held = _answer(conn, held)  # nothing queued behind it: answer it now
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        kind = message[0]
        if kind != "step" and held is not None:
            held = _answer(conn, held)
        if kind == "close":
            return
        released = message[2] if kind == "step" else message[1]
        if released is not None and slots is not None:
            slots.release_through(released)
        if kind == "check":
            _reply(conn, "answer", None, _slots_problem(runner))
            continue
        if kind == "rebalance":
            _reply(conn, "answer", None, _rebalance(runner, message[2]))
            continue
        if kind == "kv_transfer":
            _reply(conn, "answer", None, _kv_transfer(runner, message[2]))
            continue
        _, number, _, record, data = message
        try:
            _, plan = decoder.decode(data)
        except Exception as exc:  # noqa: BLE001 - the host fails this step and resends
            held = _answer(conn, held)
            _reply(conn, "undecoded", number, exc)
            continue
        start = time.perf_counter()
        try:
            step: Any = runner.prepare(plan, record_expert_counts=record)
            if held is not None and not (pipeline and runner.pipelines(step)):
                held = _answer(conn, held)
            finish = partial(runner.finish, runner.launch(step)) if pipeline else _done(runner.execute(step))
        except Exception as exc:  # noqa: BLE001 - the step fails on the host, as in-process
            held = _answer(conn, held)
            _reply(conn, "error", number, exc)
            continue
        _answer(conn, held)  # the step before, after this one was launched
        held = _Held(number, finish, start, meter)
        if not pipeline:
            held = _answer(conn, held)


@attrs.define(slots=True, eq=False)
class _Held:
    """A step launched and not yet answered: its reply number, what finishes it, when it
    began and the rank's meter."""

    number: int
    finish: Callable[[], StepResult]
    start: float
    meter: RankMeter | None


def _done(result: StepResult) -> Callable[[], StepResult]:
    """The finish of a step already run to the end."""
    return lambda: result


def _answer(conn: Connection, held: _Held | None) -> _Held | None:
    """Finish ``held`` (if any) and send its reply; returns ``None``: nothing is held
    any more (assigned back by the caller)."""
    if held is None:
        return None
    try:
        result: Any = held.finish()
    except Exception as exc:  # noqa: BLE001 - the step fails on the host, as in-process
        _reply(conn, "error", held.number, exc)
        return None
    if held.meter is not None:  # a multi-rank model: this rank's time and bytes, for traces
        result = held.meter.stamp(result, time.perf_counter() - held.start)
    _reply(conn, "ok", held.number, result)
    return None


def _rebalance(runner: ServingRunner, after_step: int) -> object:
    """Every step sent before this request has run: rebalance now (the host decided, on
    its clock of committed rounds), stamped ``after_step``."""
    balancer = runner.balancer
    if balancer is None:
        return InvariantError("rebalance asked of a worker without eplb")
    try:
        record = balancer.rebalance(after_step=after_step)
    except Exception as exc:  # noqa: BLE001 - raised on the host
        return exc
    return record, balancer.state()


def _kv_transfer(runner: ServingRunner, plan: TransferPlan) -> object:
    """Run a KV tier transfer plan outside any round (every step sent before it has run):
    the device side's report, or the exception it raised."""
    plain: Any = getattr(runner, "runner", runner)
    worker = plain.kv_transfer
    if worker is None:
        return InvariantError("kv_transfer asked of a worker without kv_tiers")
    try:
        worker.start_save_kv(plan)
        worker.start_load_kv(plan)
        worker.wait_for_load()
        return worker.get_finished()
    except Exception as exc:  # noqa: BLE001 - raised on the host
        return exc


def _slots_problem(runner: ServingRunner) -> str | None:
    """The runner's idle check (:meth:`ModelRunner.check_idle`) as a message, or ``None``."""
    try:
        runner.check_idle()
    except InvariantError as exc:
        return str(exc)
    return None


def _reply(conn: Connection, kind: str, number: int | None, payload: object) -> None:
    """Send a reply; an exception that does not pickle goes as a RuntimeError naming it,
    a result that does not pickle as the error saying so."""
    if isinstance(payload, BaseException):
        payload = _portable(payload)
    try:
        data = pickle.dumps((kind, number, payload), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - the host must hear of every step
        data = pickle.dumps(("error", number, _portable(exc)), protocol=pickle.HIGHEST_PROTOCOL)
    conn.send_bytes(data)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` when it survives a pickle round trip, else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:  # noqa: BLE001 - any failure means it cannot travel
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc
