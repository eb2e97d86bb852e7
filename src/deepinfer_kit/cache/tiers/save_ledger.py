"""SaveLedger: the host tier's saves from the moment they are queued to their report — so
that a save whose round failed before running it frees its slot, and a report never
confirms a save it was not about (no torch)."""

from __future__ import annotations

from deepinfer_kit.cache.tiers.records import TransferOutput

__all__ = ["SaveLedger"]


class SaveLedger:
    """Which host slot is being saved as which key, and in which round.

    A save is *queued* (:meth:`queue`), then *drained* into a round's plan
    (:meth:`drain`), then settled by the device side's report: saved, or failed. The device
    side reports every save it ran at the first report after running it (a failed round's
    saves that ran ride on the next report), so once a report (or an idle transfer's
    report, with nothing in flight) covers round ``k``, a save of round ``k`` or older that
    no report named never ran: :meth:`conclude` hands it back as failed. A slot stays out of
    reuse until its save is settled, so a report about a slot always names the save in it.
    Called on the scheduler's thread.
    """

    def __init__(self) -> None:
        self.queued: list[tuple[int, int]] = []  # (device block, host slot), for the next round
        self._keys: dict[int, bytes] = {}  # host slot -> key: a save queued or running
        self._round: dict[int, int] = {}  # host slot -> the round its save was drained into
        self._stale: set[int] = set()  # slots saving when the tiers were reset: dropped when done

    def queue(self, block: int, slot: int, key: bytes) -> None:
        """Save device ``block`` into host ``slot`` as ``key`` in the next round."""
        self._keys[slot] = key
        self.queued.append((block, slot))

    def drain(self, step_id: int) -> list[tuple[int, int]]:
        """The queued saves, now round ``step_id``'s."""
        saves, self.queued = self.queued, []
        for _, slot in saves:
            self._round[slot] = step_id
        return saves

    def saving(self, slot: int) -> bool:
        """True while ``slot``'s save is queued or running."""
        return slot in self._keys

    def keys(self) -> set[bytes]:
        """The keys being saved."""
        return set(self._keys.values())

    def mark_stale(self, slot: int) -> None:
        """``slot``'s save outlived a reset: drop the slot when it is settled."""
        self._stale.add(slot)

    def settle(self, output: TransferOutput) -> tuple[list[tuple[int, bytes, bool]], list[tuple[int, bytes]]]:
        """The saves ``output`` names: ``(slot, key, stale)`` saved, ``(slot, key)`` failed;
        each forgotten here. Slots it names that are not saving are skipped."""
        saved: list[tuple[int, bytes, bool]] = []
        failed: list[tuple[int, bytes]] = []
        for slot in output.saved:
            key = self._forget(slot)
            if key is not None:
                saved.append((slot, key, slot in self._stale))
                self._stale.discard(slot)
        for slot in output.failed_saves:
            key = self._forget(slot)
            self._stale.discard(slot)
            if key is not None:
                failed.append((slot, key))
        return saved, failed

    def conclude(self, step_id: int) -> list[tuple[int, bytes]]:
        """Saves drained into round ``step_id`` or before (every drained save when
        ``step_id < 0``: an idle transfer, nothing in flight) that no report named: they
        never ran. Returned as failed ``(slot, key)`` and forgotten."""
        lost = [s for s, r in self._round.items() if r <= step_id or step_id < 0]
        out: list[tuple[int, bytes]] = []
        for slot in lost:
            key = self._forget(slot)
            self._stale.discard(slot)
            if key is not None:
                out.append((slot, key))
        return out

    def _forget(self, slot: int) -> bytes | None:
        self._round.pop(slot, None)
        return self._keys.pop(slot, None)
