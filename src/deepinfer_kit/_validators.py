"""attrs validators shared by the config records; each raises ConfigError naming the field."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import attrs

from deepinfer_kit.errors import ConfigError

__all__ = ["int_at_least", "one_of", "require_ints_at_least"]

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def require_ints_at_least(minimum: int, **fields: Any) -> None:
    """Raise ConfigError naming the first field that is not an int (bools excluded)
    ``>= minimum``; for constructor arguments that are not attrs fields."""
    for name, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")


def int_at_least(minimum: int) -> Validator:
    """A validator accepting ints (not bools) ``>= minimum``."""

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        require_ints_at_least(minimum, **{attribute.name: value})

    return check


def one_of(choices: Collection[str]) -> Validator:
    """A validator accepting one of ``choices``."""

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            raise ConfigError(
                f"{attribute.name} must be one of {sorted(choices)}, got {value!r}"
            )

    return check
