"""Which skips a CI run accepts: under ``CI=true`` a test that skips because something CI
installs is missing (a peer engine, a browser, a tool) fails instead, naming the reason.

CI has no GPU and no matplotlib; those skips stay skips. Everything else CI provides
(scripts/setup.sh installs the lock, vLLM's host classes and the other tested transformers;
.ci/run installs Chromium), so a skip there means the environment drifted.
"""

from __future__ import annotations

import os

#: Skip reasons (substrings) that CI accepts: what a GPU-less CI machine cannot have,
#: tests that only run where the optional feature is absent, and matplotlib (optional).
CI_ACCEPTED_SKIPS: tuple[str, ...] = (
    "needs a CUDA GPU",
    "CUDA present",
    "CUDA is available",
    "matplotlib is optional",
    "checks the message shown without matplotlib",
)


def strict_skips() -> bool:
    """True when skips of things CI installs must fail (``CI=true`` in the environment)."""
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def refused_skip(reason: str) -> str | None:
    """The failure message for a skip CI does not accept, or ``None`` when it does."""
    if any(accepted in reason for accepted in CI_ACCEPTED_SKIPS):
        return None
    return (f"skipped under CI=true, but CI installs what this test needs: {reason} "
            "(scripts/setup.sh and .ci/run install it; see tests/ci_skips.py)")
