"""The conformance-suite framework: named contract checks run against a user's factory."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar, overload

import attrs

__all__ = ["ConformanceError", "Check", "Suite", "expect"]

F = TypeVar("F")


class ConformanceError(AssertionError):
    """An implementation broke its Protocol's contract (the message says which check)."""


def expect(condition: bool, message: str) -> None:
    """Raise :class:`ConformanceError` with ``message`` unless ``condition`` holds.

    Unlike ``assert`` it is not stripped by ``python -O``.
    """
    if not condition:
        raise ConformanceError(message)


@attrs.frozen(slots=True)
class Check(Generic[F]):
    """One contract check: ``fn(factory)`` raises when the implementation breaks it."""

    suite: str
    name: str
    fn: Callable[[F], None]

    @property
    def id(self) -> str:
        """``suite.name``, for test ids."""
        return f"{self.suite}.{self.name}"

    def __call__(self, factory: F) -> None:
        """Run the check against implementations built by ``factory``."""
        self.fn(factory)


class Suite(Sequence[Check[F]]):
    """The checks of one Protocol (a sequence of :class:`Check`), run against a factory.

    Use from your own pytest::

        @pytest.mark.parametrize("check", BLOCK_ALLOCATOR_SUITE, ids=BLOCK_ALLOCATOR_SUITE.ids)
        def test_my_allocator(check):
            check(lambda num_blocks, block_size: MyAllocator(num_blocks, block_size))

    or all at once: ``BLOCK_ALLOCATOR_SUITE.run(factory)``.
    """

    def __init__(self, name: str, factory_doc: str) -> None:
        self.name = name
        self.factory_doc = factory_doc
        self._checks: list[Check[F]] = []

    def check(self, fn: Callable[[F], None]) -> Callable[[F], None]:
        """Decorator: register ``fn`` as a check named after the function."""
        name = fn.__name__.removeprefix("check_")
        if any(c.name == name for c in self._checks):
            raise ValueError(f"duplicate check {name!r} in suite {self.name!r}")
        self._checks.append(Check(self.name, name, fn))
        return fn

    @property
    def checks(self) -> tuple[Check[F], ...]:
        """The registered checks, in registration order."""
        return tuple(self._checks)

    @property
    def ids(self) -> list[str]:
        """Check names, for ``pytest.mark.parametrize(ids=...)``."""
        return [c.name for c in self._checks]

    def __iter__(self) -> Iterator[Check[F]]:
        return iter(self._checks)

    @overload
    def __getitem__(self, index: int) -> Check[F]: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Check[F]]: ...

    def __getitem__(self, index: int | slice) -> Check[F] | Sequence[Check[F]]:
        return self._checks[index]

    def __len__(self) -> int:
        return len(self._checks)

    def run(self, factory: F) -> None:
        """Run every check; raise one :class:`ConformanceError` listing all failures."""
        failures: list[str] = []
        for check in self._checks:
            try:
                check(factory)
            except Exception as exc:  # noqa: BLE001 - every failure is reported together
                failures.append(f"{check.id}: {type(exc).__name__}: {exc}")
        if failures:
            raise ConformanceError(
                f"{len(failures)} of {len(self._checks)} {self.name} checks failed:\n  "
                + "\n  ".join(failures)
            )
