"""Profile the real engine: time its rounds on this machine and fit a ProfiledCost.

The only sim module that runs a model (it imports the engine, hence torch, when called).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs

from deepinfer_kit.overlap.records import PendingStep
from deepinfer_kit.overlap.sync import SyncExecutor
from deepinfer_kit.sim.cost_profiled import ProfiledCost, fit_profiled_cost
from deepinfer_kit.sim.records import StepShape
from deepinfer_kit.sim.shape import shape_of
from deepinfer_kit.step import StepResult

if TYPE_CHECKING:
    from deepinfer_kit.engine.config import EngineConfig
    from deepinfer_kit.engine.trace import StepTrace
    from deepinfer_kit.overlap.protocols import OverlapExecutor

__all__ = ["ProfileSample", "TimingExecutor", "measure_rounds", "fit_samples", "profile_cost",
           "PROFILE_CONFIG"]


@attrs.frozen(slots=True)
class ProfileSample:
    """One measured round: its shape and the wall seconds its execution took."""

    shape: StepShape
    seconds: float


class TimingExecutor:
    """A synchronous executor that records how long each step's ``run`` took.

    Attributes:
        seconds: step id -> wall seconds of its execution (forward, sampling, copies).
    """

    def __init__(self) -> None:
        self._sync = SyncExecutor()
        self.seconds: dict[int, float] = {}

    @property
    def depth(self) -> int:
        """0: synchronous."""
        return 0

    def launch(self, step_id: int, run: Callable[[], StepResult]) -> PendingStep:
        """Run the step now, timing it; see :meth:`SyncExecutor.launch`."""
        t0 = time.perf_counter()
        pending = self._sync.launch(step_id, run)
        self.seconds[step_id] = time.perf_counter() - t0
        return pending

    def wait(self, pending: PendingStep) -> StepResult:
        """The step's result; re-raises its exception."""
        return self._sync.wait(pending)

    def close(self) -> None:
        """Nothing to release."""


#: The engine the default profile runs: the embedded tiny model on the CPU.
PROFILE_CONFIG: dict[str, object] = dict(
    model="tiny", device="cpu", block_size=16, num_blocks=512,
    max_num_batched_tokens=256, max_num_seqs=32,
)


def measure_rounds(
    config: EngineConfig,
    *,
    num_requests: int = 64,
    seed: int = 0,
    prompt_range: tuple[int, int] = (4, 400),
    output_range: tuple[int, int] = (2, 48),
    skip: int = 3,
) -> list[ProfileSample]:
    """Run a varied seeded workload on ``build_engine(config)`` and time every round's
    execution (the executor's ``run``: copy-on-write copies, forward, sampling).

    Requests arrive four at a time every third round, so the rounds range from
    prefill-heavy to decode-only at many batch sizes. The first ``skip`` rounds (cold
    caches, first kernel calls) are dropped. Builds and runs an engine: seconds of CPU.

    Raises:
        ConfigError: as ``build_engine``.
    """
    from deepinfer_kit.engine.build import build_engine
    from deepinfer_kit.components import Components
    from deepinfer_kit.sample.params import SamplingParams

    rng = random.Random(seed)
    timer = TimingExecutor()
    traces: list[StepTrace] = []
    engine = build_engine(config, components=Components(executor=timer), trace=traces.append)
    vocab = engine.vocab_size
    added = 0
    rounds = 0
    while added < num_requests or engine.has_unfinished_requests():
        if added < num_requests and rounds % 3 == 0:
            for _ in range(min(4, num_requests - added)):
                prompt = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_range))]
                params = SamplingParams(max_tokens=rng.randint(*output_range), ignore_eos=True)
                engine.add_request(None, prompt, params)
                added += 1
        engine.step()
        rounds += 1
    engine.flush()
    samples = []
    for t in traces[skip:]:
        seconds = timer.seconds.get(t.step_id, 0.0)
        if not t.chunks or seconds <= 0:
            continue
        rows = [(c.kind == "prefill", c.start, c.num_tokens, bool(c.sampled)) for c in t.chunks]
        samples.append(ProfileSample(shape_of(rows), seconds))
    return samples


def fit_samples(samples: Sequence[ProfileSample], source: str = "") -> ProfiledCost:
    """:func:`fit_profiled_cost` over measured samples.

    Raises:
        ConfigError: as :func:`fit_profiled_cost` (too few samples).
    """
    return fit_profiled_cost([s.shape for s in samples], [s.seconds for s in samples],
                             source=source)


def profile_cost(config: EngineConfig | None = None, *, num_requests: int = 64,
                 seed: int = 0) -> ProfiledCost:
    """Measure the engine ``config`` describes (default :data:`PROFILE_CONFIG`) and fit
    its cost model. Builds and runs an engine.

    Raises:
        ConfigError: as ``build_engine`` or the fit.
    """
    from deepinfer_kit.engine.config import EngineConfig

    config = config if config is not None else EngineConfig(**PROFILE_CONFIG)  # type: ignore[arg-type]
    samples = measure_rounds(config, num_requests=num_requests, seed=seed)
    return fit_samples(samples, source=f"profiled {config.model} on {config.device}")


if TYPE_CHECKING:
    _check: type[OverlapExecutor] = TimingExecutor
