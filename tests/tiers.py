"""Which test tier a pytest run selects (imported by conftest.py and its test)."""

from __future__ import annotations

import re


def selects_cuda_tier(markexpr: str) -> bool:
    """True when a ``-m`` expression asks for the ``cuda`` tests (``cuda``, ``cuda and
    triton``), False when it excludes them (``not cuda``, the default) or names none."""
    return re.search(r"(?<!not )\bcuda\b", markexpr) is not None
