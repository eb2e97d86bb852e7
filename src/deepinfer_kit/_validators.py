"""attrs validators shared by the config records; each raises ConfigError naming the field."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

import attrs

from deepinfer_kit.errors import ConfigError

__all__ = ["config_from", "int_at_least", "one_of", "positive", "require_ints_at_least"]

C = TypeVar("C", bound=attrs.AttrsInstance)
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


def positive(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A validator accepting numbers ``> 0`` (NaN refused)."""
    if not value > 0:
        raise ConfigError(f"{attribute.name} must be > 0, got {value!r}")


def one_of(choices: Collection[str]) -> Validator:
    """A validator accepting one of ``choices``."""

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            raise ConfigError(
                f"{attribute.name} must be one of {sorted(choices)}, got {value!r}"
            )

    return check


def config_from(cls: type[C], value: object, name: str) -> C | None:
    """``value`` as the attrs config record ``cls``: itself, ``None``, or a plain dict
    whose keys are ``cls``'s fields (as vLLM takes ``speculative_config``). Called by the
    records' ``coerce``; mutates nothing.

    Raises:
        ConfigError: another type, an unknown key (``name`` and the known keys in the
            message), or a bad value (the record's own validators, naming the field).
    """
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        article = "an" if cls.__name__[0] in "AEIOU" else "a"
        raise ConfigError(
            f"{name} must be {article} {cls.__name__}, a dict or None, got {value!r}"
        )
    known = [field.name for field in attrs.fields(cls)]
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise ConfigError(f"{name} has unknown keys {unknown}; known: {known}")
    return cls(**value)
