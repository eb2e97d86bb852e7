"""StepFailures: the engine's count of failed steps in a row, and its death."""

from __future__ import annotations

from deepinfer_kit.errors import EngineDeadError

__all__ = ["StepFailures"]


class StepFailures:
    """Counts steps that failed in a row; past ``max_failed_steps`` the engine is dead.

    One bad request or failed step never stops the engine: a failure is counted and the
    round's requests end with ``error``. Only a run of ``max_failed_steps`` failures in a
    row (or a scheduler that cannot plan or fail a round, :meth:`die`) kills it; after
    that every call of the engine raises the same :class:`EngineDeadError`.

    Args:
        max_failed_steps: failed steps in a row after which the engine is dead (``>= 1``).
        strict: fail fast (``EngineConfig.strict_components``): the first failure kills
            the engine and :meth:`count` re-raises the failure itself, traceback and all.
    """

    __slots__ = ("max_failed_steps", "in_a_row", "dead", "strict")

    def __init__(self, max_failed_steps: int, *, strict: bool = False) -> None:
        self.max_failed_steps = max_failed_steps
        self.in_a_row = 0
        self.dead: EngineDeadError | None = None
        self.strict = strict

    def succeeded(self) -> None:
        """A step completed: the run of failures is over."""
        self.in_a_row = 0

    def count(self, exc: Exception) -> None:
        """A step failed with ``exc``.

        Raises:
            EngineDeadError: this was the ``max_failed_steps``-th failure in a row, or
                ``exc`` is itself an EngineDeadError (a component that can never run a
                step again, such as a model worker process that exited).
            Exception: ``exc`` itself under ``strict`` (the engine is dead from here).
        """
        if isinstance(exc, EngineDeadError):
            raise self.die("a component cannot go on", exc) from exc
        if self.strict:
            self.die("a component raised (strict_components)", exc)
            raise exc
        self.in_a_row += 1
        if self.in_a_row >= self.max_failed_steps:
            raise self.die(f"{self.in_a_row} steps in a row failed", exc) from exc

    def die(self, why: str, exc: BaseException) -> EngineDeadError:
        """Mark the engine dead (``exc`` is the cause) and return the error to raise."""
        self.dead = EngineDeadError(f"engine is dead: {why}: {exc!r}")
        self.dead.__cause__ = exc
        return self.dead

    def check_alive(self) -> None:
        """Raise the engine's :class:`EngineDeadError` if it is dead; else nothing."""
        if self.dead is not None:
            raise self.dead
