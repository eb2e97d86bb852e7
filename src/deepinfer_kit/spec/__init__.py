"""spec/: draft then verify; verify-length planning.

Names are resolved on first use (PEP 562), so the host-only records (``SpecConfig``,
``SpsCurve``) import without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepinfer_kit._lazy import lazy_attribute

if TYPE_CHECKING:  # the names mypy sees (``X as X``: re-exported)
    from deepinfer_kit.spec.drafters.ngram import NgramDrafter as NgramDrafter
    from deepinfer_kit.spec.planners import DSparkPlanner as DSparkPlanner
    from deepinfer_kit.spec.planners import FixedPlanner as FixedPlanner
    from deepinfer_kit.spec.planners import ThresholdPlanner as ThresholdPlanner
    from deepinfer_kit.spec.protocols import DraftVerifier as DraftVerifier
    from deepinfer_kit.spec.protocols import Drafter as Drafter
    from deepinfer_kit.spec.protocols import VerifyPlanner as VerifyPlanner
    from deepinfer_kit.spec.records import DraftProposal as DraftProposal
    from deepinfer_kit.spec.records import SpecConfig as SpecConfig
    from deepinfer_kit.spec.records import SpsCurve as SpsCurve
    from deepinfer_kit.spec.records import VerifyResult as VerifyResult
    from deepinfer_kit.spec.verify.greedy import GreedyVerifier as GreedyVerifier
    from deepinfer_kit.spec.verify.rejection import RejectionVerifier as RejectionVerifier

_LAZY = {
    "Drafter": "deepinfer_kit.spec.protocols",
    "VerifyPlanner": "deepinfer_kit.spec.protocols",
    "DraftVerifier": "deepinfer_kit.spec.protocols",
    "DraftProposal": "deepinfer_kit.spec.records",
    "VerifyResult": "deepinfer_kit.spec.records",
    "SpsCurve": "deepinfer_kit.spec.records",
    "SpecConfig": "deepinfer_kit.spec.records",
    "GreedyVerifier": "deepinfer_kit.spec.verify.greedy",
    "RejectionVerifier": "deepinfer_kit.spec.verify.rejection",
    "NgramDrafter": "deepinfer_kit.spec.drafters.ngram",
    "FixedPlanner": "deepinfer_kit.spec.planners",
    "ThresholdPlanner": "deepinfer_kit.spec.planners",
    "DSparkPlanner": "deepinfer_kit.spec.planners",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
