"""ProcessRunner: the model runner in a worker process of its own, so the device step and
the host's scheduling each hold their own interpreter lock.

In one process, an overlapped engine's worker thread and its host thread take turns on
the GIL: on CPU, where the forward is Python dispatching small kernels, the two mostly
serialise (docs/overlap.md measures it). Here the :class:`ModelRunner` lives in a child
process (:mod:`deepinfer_kit.engine.remote.worker_main`) built from the same
:class:`EngineConfig`; the host sends it each plan (:class:`PlanEncoder`: a few
microseconds per decode chunk) and receives each :class:`StepResult`, over one socket.

- :meth:`ProcessRunner.prepare` sends the plan at once: the worker lays it out and runs
  it as soon as it has finished the step before, while the host goes on scheduling.
  :meth:`ProcessRunner.execute` only collects the reply (steps complete in send order).
  :class:`~deepinfer_kit.overlap.deferred.DeferredExecutor` is the executor that fits.
- Under overlap the worker's runner holds the token slots; the host's commits reach it as
  a "released through step k" stamp on the next message (:class:`RemoteSlots`), applied
  before that message's step is prepared — the order the in-process engine keeps.
- A step that raises in the worker fails that step on the host with the same exception;
  a worker that exits (crash, kill) makes every later call raise
  :class:`~deepinfer_kit.errors.EngineDeadError`, which the engine reports at once.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import attrs

from deepinfer_kit.cache.tiers.protocols import KVConnectorWorker
from deepinfer_kit.cache.tiers.shared_slab import SlabShard
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.engine.remote.plan_codec import PlanEncoder
from deepinfer_kit.errors import ConfigError, EngineDeadError, InvariantError
from deepinfer_kit.models.config import ModelConfig
from deepinfer_kit.components import Components
from deepinfer_kit.sched.records import SchedulePlan
from deepinfer_kit.step import StepResult

if TYPE_CHECKING:
    from deepinfer_kit.comm.protocols import Communicator
    from deepinfer_kit.eplb.records import BalancerState
    from deepinfer_kit.engine.protocols import SlotLeases, StepRunner
    from deepinfer_kit.engine.runner.speculative import ServingRunner

__all__ = ["WorkerSpec", "WorkerInfo", "WorkerPool", "SentStep", "ProcessRunner", "RemoteSlots"]

_BOOT = "import sys; from deepinfer_kit.engine.remote.worker_main import main; main(int(sys.argv[1]))"


@attrs.frozen(slots=True)
class WorkerSpec:
    """What a worker process builds its runner from (pickled to it).

    Attributes:
        config: the engine's config; the worker builds the device half of it
            (:func:`~deepinfer_kit.engine.runner.build.build_device`).
        depth: the host executor's depth (1: the runner gets token slots).
        components: the device components to use instead of the built-ins
            (:meth:`Components.device_side`; each a factory pickled by reference or an
            instance that pickles: ``check_crosses`` was run before the worker started).
        setup: called in the worker with its :class:`ModelRunner` once built (fault
            injection, instrumentation); must pickle by reference (a module-level callable
            or an instance of a module-level class), or ``None``.
        threads: the worker's torch intra-op threads (the host's count when started).
        rank, rendezvous: with more than one rank (``tensor_parallel * expert_parallel``),
            this worker's rank and the ``tcp://host:port`` every rank joins (gloo) before
            the model loads.
        wrap_comm: called in the worker with its tensor-parallel communicator, returns the
            one the model uses (fault injection in tests); must pickle by reference, or
            ``None``.
    """

    config: EngineConfig
    depth: int
    components: Components | None = None
    setup: Callable[[ServingRunner], object] | None = None
    threads: int = 1
    rank: int = 0
    rendezvous: str | None = None
    wrap_comm: Callable[[Communicator], Communicator] | None = None


@attrs.frozen(slots=True)
class WorkerInfo:
    """What the worker reports once its runner is built (the host sizes its scheduler and
    picks its tokenizer from it).

    Attributes:
        pid: the worker's process id.
        num_blocks: blocks in its KV pool.
        block_size: tokens per block.
        max_model_len: the engine's limit, as sized there.
        model: the model's config (vocabulary, EOS ids, checkpoint folder).
        balancer: the state of the worker's live expert balancer (``eplb``), or ``None``.
        kv_slab: the worker's host KV tier slab in shared memory (``kv_tiers``; its
            descriptor follows this reply, :attr:`ProcessRunner.kv_slab_fd`), or ``None``.
    """

    pid: int
    num_blocks: int
    block_size: int
    max_model_len: int
    model: ModelConfig
    balancer: BalancerState | None = None
    kv_slab: SlabShard | None = None


@attrs.frozen(slots=True)
class SentStep:
    """A plan sent to the worker: what :meth:`ProcessRunner.execute` collects."""

    step_id: int
    message: int


class RemoteSlots:
    """The host's handle on the worker runner's per-sequence state (:class:`SlotLeases`):
    its token slots under overlap and its drafter's sequences with speculation (a
    synchronous worker drafts too, without token slots)."""

    def __init__(self, runner: ProcessRunner) -> None:
        self._runner = runner

    def release_through(self, step_id: int) -> None:
        """Step ``step_id`` was committed: the worker frees the slots it expires before it
        prepares the next step it receives."""
        newest = self._runner.released
        self._runner.released = step_id if newest is None else max(newest, step_id)


class WorkerPool:
    """The pool geometry a worker reported (:attr:`info`): the ``StepRunner`` members
    shared by the host-side runners of worker processes."""

    info: WorkerInfo
    kv_transfer: KVConnectorWorker | None = None  # the KV tiers' device side, for transfers outside rounds

    @property
    def block_size(self) -> int:
        """Tokens per KV block of the worker's pool."""
        return self.info.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks in the worker's KV pool."""
        return self.info.num_blocks


class ProcessRunner(WorkerPool):
    """A :class:`ModelRunner` in a worker process: the host's side of it.

    Starts the worker (``python -c`` importing :mod:`deepinfer_kit.engine.remote.worker_main`,
    with this process's ``sys.path`` and environment, so nothing of the caller's
    ``__main__`` runs again) and waits until its runner is built.

    Args:
        spec: what the worker builds.
        start_timeout: seconds to wait for the worker's runner (a CUDA warm-up compiles
            kernels; a dead worker is noticed at once).

    Raises:
        ConfigError, CheckpointError: as ``build_engine`` (raised in the worker, re-raised
            here); a ``sampler`` or ``setup`` that does not pickle.
        EngineDeadError: the worker exited or did not report within ``start_timeout``.
    """

    def __init__(self, spec: WorkerSpec, *, start_timeout: float = 600.0, wait: bool = True) -> None:
        try:
            boot = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise ConfigError(
                f"a worker process needs sampler and setup that pickle by reference, got "
                f"components={spec.components!r}, setup={spec.setup!r}: {exc}"
            ) from exc
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env
            )
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._finalizer = weakref.finalize(self, _stop, self._conn, self._proc)
        self._dead: EngineDeadError | None = None
        self._results: dict[int, tuple[str, Any]] = {}
        self._encoder = PlanEncoder()
        self.released: int | None = None  # newest committed step, for the next message
        self.num_step_replies = 0  # steps the worker has answered (ran, or failed)
        self.kv_slab_fd: int | None = None  # the worker's host KV slab (shared memory), once ready
        self._send_raw(boot)
        # The worker's per-sequence state: its token slots under overlap, and a drafter's
        # sequences with speculation (the worker drafts), which the idle check must reach.
        keeps = spec.depth or spec.config.speculative is not None
        self.token_slots: RemoteSlots | None = RemoteSlots(self) if keeps else None
        self._start_timeout = start_timeout
        if wait:
            self.wait_ready()

    def wait_ready(self) -> WorkerInfo:
        """Wait until the worker's runner is built (the constructor does, unless
        ``wait=False``: workers that rendezvous with each other must all start first).

        Raises:
            ConfigError, CheckpointError, ...: what building raised in the worker.
            EngineDeadError: the worker exited or did not report in time.
        """
        info = self._handshake(self._start_timeout)
        self.info = info
        return info

    # ---- the StepRunner surface ----------------------------------------------------------

    def prepare(self, plan: SchedulePlan, *, record_expert_counts: bool = False) -> SentStep:
        """Send ``plan`` to the worker, which lays it out and runs it after the steps sent
        before it; returns at once. Carries the newest committed step for the worker's
        token slots and ``record_expert_counts``. With speculation the worker's runner
        drafts, as in-process.

        Raises:
            EngineDeadError: the worker is gone.
            pickle.PicklingError, TypeError: a plan field does not pickle (nothing sent).
        """
        message, data = self._encoder.encode(plan)
        self._send(("step", message, self.released, record_expert_counts, data))
        return SentStep(plan.step_id, message)

    def execute(self, step: SentStep) -> StepResult:
        """Block until the worker's reply to ``step`` arrives; return its result, or raise
        the exception its prepare or execute raised there.

        Raises:
            EngineDeadError: the worker is gone.
            Exception: whatever the step raised in the worker (its type when it pickles,
                else a RuntimeError naming it).
        """
        while step.message not in self._results:
            self._receive()
        kind, payload = self._results.pop(step.message)
        if kind != "ok":
            raise payload
        assert isinstance(payload, StepResult)
        return payload

    def check_idle(self) -> None:
        """Raise :class:`InvariantError` unless the worker's runner holds no per-sequence
        state (:meth:`ModelRunner.check_idle` there: a round trip, made only when the
        worker keeps such state — token slots or a drafter)."""
        if self.token_slots is None:
            return
        problem = self.request(("check", self.released))
        if problem is not None:
            raise InvariantError(str(problem))

    def close(self) -> None:
        """Stop the worker (it finishes the step it runs, if any). Idempotent; also run
        when the runner is garbage-collected and at interpreter exit."""
        self._finalizer()
        if self._dead is None:
            self._dead = EngineDeadError("the model worker process was closed")
        if self.kv_slab_fd is not None:  # never mapped: the build failed before the tiers
            os.close(self.kv_slab_fd)
            self.kv_slab_fd = None

    # ---- messages ----------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self._proc.pid

    @property
    def connection(self) -> Connection:
        """The socket to the worker: readable when a reply arrived or the worker exited
        (for ``multiprocessing.connection.wait`` over several workers)."""
        return self._conn

    def kill(self) -> None:
        """Kill the worker at once (its process group is broken: it cannot finish a
        step), then :meth:`close`, which reaps it. Idempotent."""
        if self._proc.poll() is None:
            self._proc.kill()
        self.close()

    def request(self, message: tuple[Any, ...]) -> Any:
        """Send a control message and return the worker's answer (replies to steps that
        arrive first are kept for :meth:`execute`).

        Raises:
            EngineDeadError: the worker is gone.
        """
        self._send(message)
        return self.answer()

    def send_control(self, message: tuple[Any, ...]) -> None:
        """Send a control message whose answer :meth:`answer` collects (for requests every
        rank of a group must receive before any can answer)."""
        self._send(message)

    def answer(self) -> Any:
        """The worker's answer to the last control message (step replies that arrive
        first are kept for :meth:`execute`).

        Raises:
            EngineDeadError: the worker is gone.
        """
        while True:
            kind, _, payload = self._receive()
            if kind == "answer":
                return payload

    def _send(self, message: tuple[Any, ...]) -> None:
        self._send_raw(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _send_raw(self, data: bytes) -> None:
        if self._dead is not None:
            raise self._dead
        try:
            self._conn.send_bytes(data)
        except OSError as exc:
            raise self._died(exc) from exc

    def _receive(self) -> tuple[str, int | None, Any]:
        """One reply; step replies are confirmed to the encoder (in order) and kept."""
        if self._dead is not None:
            raise self._dead
        try:
            kind, message, payload = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise self._died(exc) from exc
        if message is not None:
            if kind == "undecoded":
                self._encoder.reject(message)
            else:
                self._encoder.confirm(message)
                self.num_step_replies += 1
            self._results[message] = (kind, payload)
        return kind, message, payload

    def _handshake(self, timeout: float) -> WorkerInfo:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.05):
            code = self._proc.poll()
            if code is not None or time.monotonic() > deadline:
                raise self._died(None, code)
        kind, _, payload = self._receive()
        if kind == "failed":
            self.close()
            raise payload
        assert isinstance(payload, WorkerInfo)
        if payload.kv_slab is not None:
            self.kv_slab_fd = reduction.recv_handle(self._conn)
        return payload

    def _died(self, cause: BaseException | None, code: int | None = None) -> EngineDeadError:
        if code is None and cause is not None:  # its socket closed: it is exiting, if not gone
            try:
                code = self._proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                code = None
        state = f"exited with code {code}" if code is not None else "stopped answering"
        self._dead = EngineDeadError(f"the model worker process (pid {self._proc.pid}) {state}")
        self._dead.__cause__ = cause
        self._finalizer()
        return self._dead


def _stop(conn: Connection, proc: subprocess.Popen[bytes]) -> None:
    """Ask the worker to exit, then make sure it did."""
    try:
        conn.send_bytes(pickle.dumps(("close",)))
    except OSError:
        pass
    conn.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


if TYPE_CHECKING:
    _check: type[StepRunner] = ProcessRunner
    _slots: type[SlotLeases] = RemoteSlots
