"""TokenSlots: each running sequence's newest sampled token, kept on the device.

Under overlap, round ``k + 1`` is laid out before round ``k`` has sampled. A sequence
whose next input is that token (a placeholder) reads it from its slot of a persistent
device tensor: round ``k`` scatters its sampled tokens into their sequences' slots after
sampling, and round ``k + 1`` gathers its placeholder inputs from them before its forward,
both on the device, in stream order, with no host synchronisation.

Leases (host bookkeeping, called from ``prepare`` and the engine's commit):

- :meth:`lease` gives a sequence its slot for a step, the same slot as long as the
  sequence keeps appearing in prepared steps, and records the step as its newest reader.
- :meth:`release_through` is called once a step is committed (its device work is done):
  it frees exactly the slots whose newest reader is that step or older. A slot read or
  written by a step still in flight is never free, so it can never be handed to another
  sequence; there is no ring that could wrap onto a live slot.

Followers (:class:`SlotFollower`, :attr:`TokenSlots.followers`) are per-sequence runner
state that lives exactly as long as the sequence's slot (the runner's draft KV under
overlapped speculation): each is told which sequences :meth:`release_through` freed, and
:meth:`check_all_free` checks them too.

A slot holds ``-1`` when its token was never sampled (the writing step failed, or its
row's logits were not finite): each step invalidates the slots it will write before its
forward and scatters ``-1`` for a non-finite row. A placeholder of a sequence that holds
no slot reads :attr:`invalid_slot`, which is always ``-1``.
"""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from deepinfer_kit._validators import require_ints_at_least
from deepinfer_kit.errors import InvariantError

#: A slot's value (and a sampled row's, in a step's copy back) when its token was never
#: sampled: the writing step failed, or the row's logits were not finite.
UNSAMPLED = -1
#: A sampled row's value in a step's copy back when its chunk continued from an
#: :data:`UNSAMPLED` token (the row itself is meaningless).
CONTINUED_UNSAMPLED = -2
#: The input token fed in place of an unsampled placeholder (never a negative id).
HOLE_FILL = 0
#: The error of a chunk that continued from an :data:`UNSAMPLED` token.
NEVER_SAMPLED = "the in-flight token this step continues from was never sampled"

__all__ = ["CONTINUED_UNSAMPLED", "HOLE_FILL", "NEVER_SAMPLED", "UNSAMPLED", "SlotFollower", "SlotRoutes", "TokenSlots"]


class SlotFollower(Protocol):
    """Runner state kept per sequence for as long as the sequence holds a token slot."""

    def release(self, seq_ids: list[str]) -> None:
        """The slots of ``seq_ids`` were freed: drop their state (now, or before the
        follower's next use; called on the thread that commits)."""
        ...

    def check_idle(self) -> None:
        """Raise :class:`InvariantError` unless no sequence state is held (called with
        nothing in flight)."""
        ...


class TokenSlots:
    """A device tensor of ``capacity`` token slots plus one that is always ``-1``.

    Args:
        capacity: sequences that may hold a slot at once. Under an executor of depth
            ``d`` the engine commits step ``j - d - 1`` before it prepares step ``j``, so
            ``(d + 1) * max_num_seqs`` slots always suffice.
        device: where the slots live (the model's device).

    Raises:
        ConfigError: ``capacity < 1``.
    """

    def __init__(self, capacity: int, device: torch.device | str) -> None:
        require_ints_at_least(1, capacity=capacity)
        self.capacity = capacity
        self.tokens = torch.full((capacity + 1,), UNSAMPLED, dtype=torch.int64, device=device)
        self._free = list(range(capacity - 1, -1, -1))  # a stack: the lowest slot first
        self._slot: dict[str, int] = {}  # sequence id -> its slot
        self._newest: dict[str, int] = {}  # sequence id -> newest step that references it
        self._expiring: dict[int, set[str]] = {}  # step id -> sequences whose newest it is
        self.followers: list[SlotFollower] = []

    @property
    def invalid_slot(self) -> int:
        """The index of the slot that is never written (reads as ``-1``)."""
        return self.capacity

    @property
    def num_free(self) -> int:
        """Slots not leased to any sequence."""
        return len(self._free)

    def slot_of(self, seq_id: str) -> int | None:
        """The slot ``seq_id`` holds, or ``None``. O(1), host only."""
        return self._slot.get(seq_id)

    def lease(self, seq_id: str, step_id: int) -> int:
        """The slot of ``seq_id`` for step ``step_id`` (a free one if it holds none);
        the slot stays leased at least until :meth:`release_through` reaches ``step_id``.

        Called by the runner's ``prepare``, in increasing step order. Host only, O(1).

        Raises:
            InvariantError: no slot is free (more sequences in flight than
                ``capacity``); nothing is leased then.
        """
        slot = self._slot.get(seq_id)
        if slot is None:
            if not self._free:
                raise InvariantError(
                    f"no free token slot for {seq_id}: all {self.capacity} are held by "
                    f"sequences of steps still in flight"
                )
            slot = self._free.pop()
            self._slot[seq_id] = slot
        else:
            old = self._newest[seq_id]
            if old == step_id:
                return slot
            self._expiring[old].discard(seq_id)
        self._newest[seq_id] = step_id
        self._expiring.setdefault(step_id, set()).add(seq_id)
        return slot

    def release_through(self, step_id: int) -> list[int]:
        """Free the slots whose newest reader is ``step_id`` or an older step; returns them.

        Called by the engine after committing step ``step_id`` (its device work has
        finished, and every later step that reads a slot has already leased it again).
        O(steps expired + slots freed).
        """
        freed: list[int] = []
        seqs: list[str] = []
        for step in sorted(s for s in self._expiring if s <= step_id):
            for seq_id in self._expiring.pop(step):
                del self._newest[seq_id]
                slot = self._slot.pop(seq_id)
                self._free.append(slot)
                freed.append(slot)
                seqs.append(seq_id)
        if seqs:
            for follower in self.followers:
                follower.release(seqs)
        return freed

    def check_all_free(self) -> None:
        """Raise :class:`InvariantError` unless no slot is leased and no follower holds
        state (the idle check)."""
        if len(self._free) != self.capacity:
            raise InvariantError(
                f"{self.capacity - len(self._free)} token slots still leased with no request "
                f"live: {sorted(self._slot)}"
            )
        for follower in self.followers:
            follower.check_idle()

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """``[H]`` int64 tokens of ``slots`` (``[H]`` int64 on the slots' device);
        ``-1`` where never sampled. Device op, no host sync."""
        return self.tokens.index_select(0, slots)

    def invalidate(self, slots: torch.Tensor) -> None:
        """Mark ``slots`` (``[W]`` int64, device) as not sampled yet: a step does this
        for the slots it writes, before its forward, so a failure leaves them ``-1``."""
        self.tokens.index_fill_(0, slots, UNSAMPLED)

    def scatter(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Write ``tokens`` (``[W]`` int64, ``-1`` for a non-finite row) into ``slots``
        (``[W]`` int64, distinct). Device op, no host sync."""
        self.tokens.index_copy_(0, slots, tokens)

    def resolve(self, routes: SlotRoutes, tail: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Before a step's forward: write its placeholder inputs from the slots into
        ``input_ids`` (``[T]`` int64, device; an unsampled token is fed as 0, never as
        ``-1``), then invalidate the slots the step will write. Returns the gathered
        ``[H]`` tokens (``-1``: never sampled) for :meth:`publish`.

        ``tail`` is ``routes.tail()`` on the device (``[3H + 2W]`` int64). Device ops only.
        """
        h, w = len(routes.hole_inputs), len(routes.write_slots)
        gathered = self.gather(tail[h : 2 * h])
        if h:
            input_ids.index_copy_(0, tail[:h], gathered.clamp_min(HOLE_FILL))
        if w:
            self.invalidate(tail[3 * h : 3 * h + w])
        return gathered

    def publish(
        self, routes: SlotRoutes, tail: torch.Tensor, gathered: torch.Tensor, flagged: torch.Tensor
    ) -> torch.Tensor:
        """After sampling: mark the rows that continued from an unsampled token (``-2``
        in the returned copy of ``flagged``, ``[N]`` int64 sampled tokens with ``-1`` for
        a non-finite row), then scatter each written row's token into its slot. Device
        ops only; the result rides on the step's one copy back."""
        h, w = len(routes.hole_inputs), len(routes.write_slots)
        if h:
            rows = tail[2 * h : 3 * h]
            flagged = flagged.index_copy(
                0, rows, torch.where(gathered < 0, CONTINUED_UNSAMPLED, flagged.index_select(0, rows))
            )
        if w:
            self.scatter(tail[3 * h : 3 * h + w], flagged.index_select(0, tail[3 * h + w :]))
        return flagged


@attrs.define(slots=True, eq=False)
class SlotRoutes:
    """What one step reads from and writes to the token slots (host lists, built by
    the runner's ``prepare``; they travel to the device as :meth:`tail`).

    Attributes:
        hole_inputs: ``[H]`` index in the step's ``input_ids`` of each placeholder.
        hole_slots: ``[H]`` the slot each placeholder reads (the step before wrote it).
        hole_rows: ``[H]`` the sampling row of each placeholder's chunk (a placeholder
            chunk draws exactly one row).
        write_slots: ``[W]`` slots this step writes, distinct.
        write_rows: ``[W]`` the sampling row whose token goes into each.
    """

    hole_inputs: list[int] = attrs.field(factory=list)
    hole_slots: list[int] = attrs.field(factory=list)
    hole_rows: list[int] = attrs.field(factory=list)
    write_slots: list[int] = attrs.field(factory=list)
    write_rows: list[int] = attrs.field(factory=list)

    def tail(self) -> list[int]:
        """``hole_inputs | hole_slots | hole_rows | write_slots | write_rows``."""
        return [*self.hole_inputs, *self.hole_slots, *self.hole_rows, *self.write_slots, *self.write_rows]
