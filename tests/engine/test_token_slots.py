"""TokenSlots: leases follow the steps that reference a slot, a live slot is never handed
to another sequence, and the device traffic (gather, invalidate, scatter) carries each
sequence's token from one step to the next."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_kit.engine.runner.token_slots import SlotRoutes, TokenSlots
from deepinfer_kit.errors import ConfigError, InvariantError


def test_a_sequence_keeps_its_slot_and_release_waits_for_its_newest_step() -> None:
    slots = TokenSlots(4, "cpu")
    a = slots.lease("a", 1)
    b = slots.lease("b", 1)
    assert slots.lease("a", 1) == a and b != a
    assert slots.lease("a", 2) == a  # step 2 reads what step 1 wrote
    assert slots.release_through(1) == [b]  # b's newest step was 1
    assert slots.slot_of("a") == a
    # A new sequence while a's step 2 is still in flight never gets a's slot.
    assert all(slots.lease(f"n{i}", 3) != a for i in range(3))
    assert slots.release_through(2) == [a] and slots.slot_of("a") is None
    slots.release_through(3)
    assert slots.num_free == slots.capacity


def test_no_free_slot_raises_and_leases_nothing() -> None:
    slots = TokenSlots(2, "cpu")
    slots.lease("a", 0)
    slots.lease("b", 0)
    with pytest.raises(InvariantError, match="no free token slot for c"):
        slots.lease("c", 0)
    assert slots.slot_of("c") is None and slots.num_free == 0
    with pytest.raises(ConfigError, match="capacity"):
        TokenSlots(0, "cpu")


@pytest.mark.parametrize("seed", range(6))
def test_random_steps_never_hand_a_live_slot_to_another_sequence(seed: int) -> None:
    """The depth-1 engine's order, with the worst timing: prepare(j) leases, then the
    device runs step j - 1 (reads what j - 2 wrote, writes its own), then commit(j - 1)
    releases. Sequences continue, stop and arrive at random, at most ``m`` per step; a
    shadow checks after every operation that no slot is held by two live sequences and
    that every placeholder reads exactly the token its own sequence was given."""
    rng = random.Random(seed)
    m = rng.randint(1, 6)
    slots = TokenSlots(2 * m, "cpu")
    steps: dict[int, dict[str, int]] = {}  # uncommitted step -> {sequence: slot}
    reads: dict[int, list[str]] = {}  # step -> sequences with a placeholder in it
    written: dict[str, int] = {}  # sequence -> token its last executed step wrote
    current: list[str] = []
    fresh = 0
    for j in range(300):
        keep = [s for s in current if rng.random() < 0.7]
        while len(keep) < m and rng.random() < 0.6:
            keep.append(f"s{fresh}")
            fresh += 1
        reads[j] = [s for s in keep if s in current]  # continuing: its token is in flight
        steps[j] = {s: slots.lease(s, j) for s in keep}
        live = [(s, slot) for held in steps.values() for s, slot in held.items()]
        owners: dict[int, str] = {}
        for s, slot in live:
            assert owners.setdefault(slot, s) == s, f"step {j}: slot {slot} held by {owners[slot]} and {s}"
        if j >= 1:  # the device runs step j - 1, then the engine commits it
            prev = steps[j - 1]
            for s in reads[j - 1]:
                got = int(slots.gather(torch.tensor([prev[s]]))[0])
                assert got == written[s], f"{s} read {got}, its own token was {written[s]}"
            index = torch.tensor(list(prev.values()), dtype=torch.int64)
            slots.invalidate(index)
            tokens = [rng.randrange(1000) for _ in prev]
            slots.scatter(index, torch.tensor(tokens, dtype=torch.int64))
            written.update(zip(prev, tokens))
            slots.release_through(j - 1)
            del steps[j - 1]
        current = keep
    slots.release_through(300)
    assert slots.num_free == slots.capacity


def test_resolve_feeds_the_slot_tokens_and_publish_flags_unsampled_rows() -> None:
    slots = TokenSlots(4, "cpu")
    slots.scatter(torch.tensor([0, 1]), torch.tensor([17, -1]))  # slot 1: a non-finite row
    routes = SlotRoutes(
        hole_inputs=[1, 3, 4], hole_slots=[0, 1, slots.invalid_slot], hole_rows=[0, 1, 2],
        write_slots=[0, 1, 2], write_rows=[0, 1, 2],
    )
    tail = torch.tensor(routes.tail())
    ids = torch.tensor([5, 0, 6, 0, 0])
    gathered = slots.resolve(routes, tail, ids)
    assert ids.tolist() == [5, 17, 6, 0, 0]  # an unsampled token is fed as 0, never -1
    assert slots.tokens[:3].tolist() == [-1, -1, -1]  # invalidated until the step samples
    flagged = slots.publish(routes, tail, gathered, torch.tensor([30, 31, -1]))
    assert flagged.tolist() == [30, -2, -2]
    assert slots.tokens[:3].tolist() == [30, -2, -2]
    assert int(slots.tokens[slots.invalid_slot]) == -1
