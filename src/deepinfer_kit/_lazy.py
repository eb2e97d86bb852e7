"""Lazy package exports (PEP 562): a package lists ``name -> module`` and its module-level
``__getattr__`` calls :func:`lazy_attribute`, so importing the package imports none of them."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

__all__ = ["lazy_attribute"]


def lazy_attribute(package: str, table: Mapping[str, str], name: str) -> Any:
    """``name`` imported from its module in ``table``, on first read of ``package.name``.

    Raises:
        AttributeError: ``name`` is not in ``table`` (as for any missing module attribute).
    """
    module = table.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
