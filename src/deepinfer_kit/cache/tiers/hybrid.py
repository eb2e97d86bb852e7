"""TieredHybridKVCacheManager: the hybrid cache over KV tiers that keep every layer of a
block — the full-attention group's K/V and each sliding group's window of it — so a prefix
that comes back from a tier brings its windows and needs no recompute."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from deepinfer_kit.cache.hybrid_manager import HybridKVCacheManager, TableUpdate
from deepinfer_kit.cache.layer_groups import KVLayout
from deepinfer_kit.cache.tiers.manager import TieredKVCacheManager
from deepinfer_kit.cache.tiers.records import TransferPlan
from deepinfer_kit.errors import InvariantError

__all__ = ["TieredHybridKVCacheManager"]


class TieredHybridKVCacheManager(HybridKVCacheManager):
    """A :class:`HybridKVCacheManager` whose full group is a :class:`TieredKVCacheManager`
    and whose tiers keep each block's sliding windows too.

    A host slot (and a disk file) holds every layer of the model for one full-group block,
    in model order: the bytes an engine without layer groups keeps. Each round's plan
    (:attr:`TieredKVCacheManager.plan_hook`) gets, per sliding group, the group's block of
    each save and of each load (``TransferPlan.save_groups`` / ``load_groups``):

    - **A save** reads the window the group holds for the block. A block whose window is
      gone (evicted, or written by a bounded replay's inexact start) or mapped afresh
      this round (nothing written in it yet) is not saved: the save is taken off the plan
      and reported failed, so no tier ever holds a block without its windows.
    - **A load** writes each group's rows into the block the group mapped for the request's
      window (mapped this round, by the allocation that queued the load), and nothing
      where the block is outside the window.
    - **A prefix hit** reaching into the tiers keeps the windows of the blocks they load;
      only the device blocks' windows are checked (and shortened, or replayed) as without
      tiers.

    Args:
        inner: the full group's tiered manager (holding no blocks yet).
        layout, sliding_blocks, replay_limit: as :class:`HybridKVCacheManager`.

    Raises:
        ConfigError: as :class:`HybridKVCacheManager`.
    """

    _tier_windows = True

    def __init__(self, inner: TieredKVCacheManager, layout: KVLayout, sliding_blocks: int | Sequence[int], *,
                 replay_limit: int = 0) -> None:
        super().__init__(inner, layout, sliding_blocks, replay_limit=replay_limit)
        self._fresh: set[tuple[int, int]] = set()  # (group, full block) mapped by the plan being built
        self.dropped_saves = 0
        """Saves taken off a plan because a window of their block was not there to read."""
        inner.plan_hook = self._complete_plan

    def drain_table_updates(self) -> list[TableUpdate]:
        """As :meth:`HybridKVCacheManager.drain_table_updates`; the mappings drained are
        remembered as fresh until the same round's transfers are drained (their blocks are
        written by that round, after its saves)."""
        out = super().drain_table_updates()
        self._fresh = {(g, full) for g, full, _ in out}
        return out

    def _complete_plan(self, plan: TransferPlan) -> list[int]:
        """Add each sliding group's blocks to ``plan`` (in place); returns the host slots
        of the saves taken off it (a window not there to save)."""
        fresh, self._fresh = self._fresh, set()
        groups = self.group_maps()
        for g, m in groups:
            fresh |= {(g, full) for full in m.undrained()}
        kept: list[tuple[int, int]] = []
        dropped: list[int] = []
        owns: dict[int, list[int]] = {g: [] for g, _ in groups}
        for block, slot in plan.saves:
            window = [m.lookup(block) if m.cached(block) and (g, block) not in fresh else None for g, m in groups]
            if any(own is None for own in window):
                dropped.append(slot)
                continue
            kept.append((block, slot))
            for (g, _), own in zip(groups, window):
                owns[g].append(own)  # type: ignore[arg-type]  # checked above
        plan.saves = kept
        self.dropped_saves += len(dropped)
        plan.save_groups = owns
        plan.load_groups = {g: [self._load_target(g, m.lookup(b), (g, b) in fresh) for _, b in plan.loads]
                            for g, m in groups}
        return dropped

    @staticmethod
    def _load_target(group: int, own: int | None, fresh: bool) -> int:
        """The group's block a load writes (``-1``: none, outside every window).

        Raises:
            InvariantError: the block is mapped but not afresh this round (a window some
                sequence reads would be overwritten).
        """
        if own is None:
            return -1
        if not fresh:
            raise InvariantError(f"sliding group {group}: a tier load targets block {own}, which holds a "
                                 f"window from an earlier round")
        return own


if TYPE_CHECKING:
    from deepinfer_kit.cache.protocols import KVCacheManager

    _check: type[KVCacheManager] = TieredHybridKVCacheManager
