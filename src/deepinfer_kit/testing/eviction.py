"""Conformance suites for EvictionPolicy: the contract every policy keeps
(``EVICTION_POLICY_SUITE``) and least-recently-used order for LRU policies
(``LRU_POLICY_SUITE``, a differential check against a list model)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from deepinfer_kit.cache.protocols import EvictionPolicy
from deepinfer_kit.testing.suite import Suite, expect

__all__ = ["EvictionPolicyFactory", "EVICTION_POLICY_SUITE", "LRU_POLICY_SUITE", "LRUModel"]

EvictionPolicyFactory = Callable[[], EvictionPolicy]
"""``factory()`` -> a fresh policy tracking nothing."""

EVICTION_POLICY_SUITE: Suite[EvictionPolicyFactory] = Suite(
    "EvictionPolicy", "factory() -> EvictionPolicy"
)
LRU_POLICY_SUITE: Suite[EvictionPolicyFactory] = Suite(
    "LRUEvictionPolicy", "factory() -> EvictionPolicy in least-recently-used order"
)


class LRUModel:
    """The LRU order as a plain list, oldest first (O(n) per call; the oracle)."""

    def __init__(self) -> None:
        self.order: list[int] = []

    def __len__(self) -> int:
        return len(self.order)

    def push(self, blocks: Sequence[int]) -> None:
        self.order += [b for b in blocks if b not in self.order]

    def discard(self, blocks: Sequence[int]) -> None:
        gone = set(blocks)
        self.order = [b for b in self.order if b not in gone]

    def touch(self, blocks: Sequence[int]) -> None:
        hit = [b for b in dict.fromkeys(blocks) if b in self.order]
        self.discard(hit)
        self.order += hit

    def pop(self, n: int) -> list[int]:
        out, self.order = self.order[: max(n, 0)], self.order[max(n, 0) :]
        return out


def _random_ops(seed: int, steps: int, num_blocks: int) -> list[tuple[str, list[int] | int]]:
    """Random calls shaped like a prefix cache's: lists pushed, matches touched tail first
    and then (mostly) discarded head first by the allocation that takes them (all of
    them, or a head), victims popped, stray discards. Blocks may be untracked where the
    contract allows it; the check drops tracked ones from a push."""
    rng = random.Random(seed)
    ops: list[tuple[str, list[int] | int]] = []
    for _ in range(steps):
        r = rng.random()
        if r < 0.3:
            ops.append(("push", rng.sample(range(num_blocks), rng.randint(1, 12))))
        elif r < 0.6:
            hits = rng.sample(range(num_blocks), rng.randint(1, 8))
            ops.append(("touch", hits[::-1]))
            if rng.random() < 0.7:
                ops.append(("discard", hits if rng.random() < 0.7 else hits[: rng.randint(0, 8)]))
        elif r < 0.8:
            ops.append(("pop", rng.randint(0, 6)))
        else:
            ops.append(("discard", rng.sample(range(num_blocks), rng.randint(1, 4))))
    return ops


@EVICTION_POLICY_SUITE.check
def check_len_and_membership_follow_push_discard_pop(factory: EvictionPolicyFactory) -> None:
    p = factory()
    expect(len(p) == 0 and p.pop(3) == [], "a fresh policy tracks nothing")
    p.push([5, 6, 7])
    p.push([1])
    expect(len(p) == 4, f"4 blocks pushed, len {len(p)}")
    p.discard([6, 9])  # 9 is untracked: ignored
    expect(len(p) == 3, f"after discarding one, len {len(p)}")
    p.touch([7, 42])  # 42 is untracked: ignored
    expect(len(p) == 3, "touch must not change what is tracked")
    out = p.pop(10)
    expect(sorted(out) == [1, 5, 7], f"pop(10) must return every tracked block once, got {out}")
    expect(len(p) == 0 and p.pop(1) == [], "nothing tracked after popping all")


@EVICTION_POLICY_SUITE.check
def check_pop_returns_at_most_n_distinct_tracked_blocks(factory: EvictionPolicyFactory) -> None:
    p = factory()
    p.push(list(range(10)))
    seen: list[int] = []
    for n in (0, 3, 1, 4, 5):
        out = p.pop(n)
        expect(len(out) == min(n, 10 - len(seen)), f"pop({n}) returned {len(out)} blocks")
        seen += out
        expect(len(p) == 10 - len(seen), f"len {len(p)} after popping {len(seen)}")
    expect(sorted(seen) == list(range(10)), f"each block popped exactly once, got {seen}")
    expect(p.pop(-1) == [], "pop of a negative count returns nothing")


@EVICTION_POLICY_SUITE.check
def check_a_block_can_be_tracked_again_after_it_left(factory: EvictionPolicyFactory) -> None:
    p = factory()
    p.push([3, 4])
    p.discard([3])
    (first,) = p.pop(1)
    expect(first == 4, f"only 4 is tracked, popped {first}")
    p.push([3, 4])  # both return (a block reused after eviction, released again)
    expect(len(p) == 2 and sorted(p.pop(2)) == [3, 4], "re-pushed blocks are tracked again")


@EVICTION_POLICY_SUITE.check
def check_many_touches_without_pops_keep_len_right(factory: EvictionPolicyFactory) -> None:
    p = factory()
    p.push(list(range(50)))
    rng = random.Random(0)
    for _ in range(2000):  # no eviction pressure: a lazy structure must still stay exact
        p.touch(rng.sample(range(60), 5))
    expect(len(p) == 50, f"len {len(p)} after touches only")
    expect(sorted(p.pop(100)) == list(range(50)), "every block still popped once")


@LRU_POLICY_SUITE.check
def check_least_recently_pushed_or_touched_goes_first(factory: EvictionPolicyFactory) -> None:
    p = factory()
    p.push([1, 2, 3])  # first given is the first victim
    p.push([4, 5])
    p.touch([2, 1])  # 2 then 1 become the most recent
    expect(p.pop(5) == [3, 4, 5, 2, 1], "LRU order: untouched first, touched last in order")


@LRU_POLICY_SUITE.check
def check_a_touch_taken_by_a_discard_leaves_the_order_as_before(
    factory: EvictionPolicyFactory,
) -> None:
    p = factory()
    p.push([1, 2, 3, 4])
    p.touch([2, 1])
    p.discard([1])  # only part of the touched blocks is taken: 2 stays the most recent
    p.push([9])
    expect(p.pop(4) == [3, 4, 2, 9], "a partly taken touch still moves the rest")
    p.push([1, 2, 3])
    p.touch([3, 2])
    p.discard([2, 3])  # exactly the touched blocks, head first (an allocation's take)
    expect(p.pop(3) == [1], "a wholly taken touch leaves nothing behind")


@LRU_POLICY_SUITE.check
def check_order_equals_the_list_model_on_random_calls(factory: EvictionPolicyFactory) -> None:
    for seed in range(20):
        p, model = factory(), LRUModel()
        for step, (op, arg) in enumerate(_random_ops(seed, 400, 40)):
            if op == "pop":
                assert isinstance(arg, int)
                got, want = p.pop(arg), model.pop(arg)
                expect(got == want, f"seed {seed} step {step}: pop({arg}) gave {got}, LRU {want}")
            else:
                assert isinstance(arg, list)
                if op == "push":
                    arg = [b for b in arg if b not in model.order]  # push takes untracked only
                getattr(p, op)(arg)
                getattr(model, op)(arg)
            expect(len(p) == len(model), f"seed {seed} step {step}: len {len(p)}, LRU {len(model)}")
        expect(p.pop(10**6) == model.pop(10**6), f"seed {seed}: final order differs")
