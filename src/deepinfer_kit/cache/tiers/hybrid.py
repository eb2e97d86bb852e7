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

    - **A save** is queued only while every sliding group holds the block's window, exact
      (:attr:`TieredKVCacheManager.save_filter`, asked at publish and at eviction); the
      groups' blocks are taken then. A window evicted or remapped after that is still
      intact when the save runs: its blocks are written only by a later round, or by the
      same round's copies, loads and forward, which run after its saves. So no tier ever
      holds a block without its windows, and no slot a load may read is given up.
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
        self._windows_of: dict[int, list[int]] = {}  # full block -> its groups' blocks when its save was allowed
        self.refused_saves = 0
        """Blocks found without their whole exact window when a save was considered (at
        publish; at eviction under write-back): never saved from the device. A block a tier
        loaded outside every window counts too; its tier copy, complete, stays a use."""
        inner.plan_hook = self._complete_plan
        inner.save_filter = self._savable

    def drain_table_updates(self) -> list[TableUpdate]:
        """As :meth:`HybridKVCacheManager.drain_table_updates`; the mappings drained are
        remembered as fresh until the same round's transfers are drained (the loads of
        that round write them)."""
        out = super().drain_table_updates()
        self._fresh = {(g, full) for g, full, _ in out}
        return out

    def _savable(self, block: int) -> bool:
        """Whether ``block``'s save may be queued now: every sliding group holds its exact
        window (whose blocks are noted for the save). Counts a refusal."""
        window = [m.lookup(block) if m.cached(block) else None for _, m in self.group_maps()]
        if any(own is None for own in window):
            self.refused_saves += 1
            return False
        self._windows_of[block] = window  # type: ignore[assignment]  # checked above
        return True

    def _complete_plan(self, plan: TransferPlan) -> None:
        """Add each sliding group's blocks to ``plan`` (in place)."""
        fresh, self._fresh = self._fresh, set()  # a plan's loads come with its table updates, drained first
        groups = self.group_maps()
        windows = [self._windows_of.pop(block, None) for block, _ in plan.saves]
        if any(w is None for w in windows):
            raise InvariantError("a tier save was queued without its windows noted (save_filter not asked)")
        plan.save_groups = {g: [w[k] for w in windows] for k, (g, _) in enumerate(groups)}  # type: ignore[index]
        plan.load_groups = {g: [self._load_target(g, m.lookup(b), (g, b) in fresh) for _, b in plan.loads]
                            for g, m in groups}

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
