"""Records of the overlap package."""

from __future__ import annotations

import attrs

__all__ = ["PendingStep"]


@attrs.define(slots=True, eq=False)
class PendingStep:
    """A launched step that has not been waited for.

    Attributes:
        step_id: the plan's ``step_id``.
        handle: the executor's own completion handle (a future, an event); opaque.
    """

    step_id: int
    handle: object
