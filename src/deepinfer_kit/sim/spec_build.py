"""build_spec_simulator: a simulator speculating with a synthetic drafter whose drafts are
right or wrong as an acceptance model draws them."""

from __future__ import annotations

from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sim.acceptance import AcceptanceModel
from deepinfer_kit.sim.build import build_simulator
from deepinfer_kit.sim.cost_analytic import ModelShape
from deepinfer_kit.sim.protocols import CostModel
from deepinfer_kit.sim.simulator import Simulator
from deepinfer_kit.sim.spec_runner import SyntheticDrafter, speculate
from deepinfer_kit.spec.protocols import VerifyPlanner
from deepinfer_kit.spec.speculation import Speculation

__all__ = ["build_spec_simulator"]


def build_spec_simulator(
    config: EngineConfig,
    cost: CostModel,
    model: ModelShape,
    *,
    acceptance: AcceptanceModel,
    planner: VerifyPlanner,
    num_draft: int,
    seed: int = 0,
    lagged: bool = False,
) -> tuple[Simulator, Speculation]:
    """A simulator of ``config`` (see :func:`build_simulator`) with speculative decoding
    by a synthetic drafter: the real scheduler reserves room for ``num_draft`` drafts per
    decode chunk within its budget; as each round runs, the engine's ``RunnerDrafting``
    drafts them with a :class:`~deepinfer_kit.sim.spec_runner.SyntheticDrafter` (right or
    wrong as ``acceptance`` draws it), ``planner`` picks each ``ℓ_r``, and a
    ``SpecSimRunner`` verifies; ``lagged`` plans from each sequence's previous round's
    confidences (the asynchronous variant, see ``Speculation``). Returns the simulator
    and its speculation (for the drafted / planned counters).

    Raises:
        ConfigError: as :func:`build_simulator`, or ``num_draft`` < 1.
    """
    if num_draft < 1:
        raise ConfigError(f"num_draft must be >= 1, got {num_draft}")
    sim = build_simulator(config, cost, model, seed=seed)
    spec = Speculation(SyntheticDrafter(acceptance, sim.runner.tokens), planner, num_draft, lagged=lagged)
    speculate(sim, spec)
    return sim, spec
