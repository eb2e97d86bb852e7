"""spec/: draft then verify; verify-length planning."""

from deepinfer_kit.spec.protocols import DraftVerifier, Drafter, VerifyPlanner
from deepinfer_kit.spec.records import DraftProposal, SpsCurve, VerifyResult

__all__ = ["Drafter", "VerifyPlanner", "DraftVerifier", "DraftProposal", "VerifyResult", "SpsCurve"]
