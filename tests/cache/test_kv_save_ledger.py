"""SaveLedger: saves from queued to reported; a save its round never ran is concluded
failed once a report covers that round, never one of a later round still in flight."""

from __future__ import annotations

from deepinfer_kit.cache.tiers.records import TransferOutput
from deepinfer_kit.cache.tiers.save_ledger import SaveLedger


def _ledger() -> SaveLedger:
    led = SaveLedger()
    led.queue(10, 0, b"a")
    led.queue(11, 1, b"b")
    assert led.drain(5) == [(10, 0), (11, 1)]  # round 5's
    led.queue(12, 2, b"c")
    assert led.drain(6) == [(12, 2)]  # round 6's, in flight when round 5 commits (overlap)
    return led


def test_a_report_settles_what_it_names() -> None:
    led = _ledger()
    saved, failed = led.settle(TransferOutput(saved=[0], failed_saves=[1]))
    assert saved == [(0, b"a", False)] and failed == [(1, b"b")]
    assert not led.saving(0) and not led.saving(1) and led.saving(2)
    assert led.settle(TransferOutput(saved=[0, 7])) == ([], [])  # nothing saving there: skipped


def test_saves_no_report_named_are_concluded_up_to_the_round() -> None:
    led = _ledger()
    led.settle(TransferOutput(saved=[0]))  # round 5 committed: slot 1's save never ran
    assert led.conclude(5) == [(1, b"b")]
    assert led.saving(2) and led.keys() == {b"c"}  # round 6's is still in flight
    assert led.conclude(6) == [(2, b"c")]
    assert led.keys() == set()


def test_an_idle_transfer_concludes_every_round() -> None:
    led = _ledger()
    led.queue(13, 3, b"d")  # queued, not drained: not concluded
    assert sorted(led.conclude(-1)) == [(0, b"a"), (1, b"b"), (2, b"c")]
    assert led.saving(3) and led.queued == [(13, 3)]


def test_a_stale_save_is_reported_stale_once() -> None:
    led = _ledger()
    led.mark_stale(0)
    assert led.settle(TransferOutput(saved=[0]))[0] == [(0, b"a", True)]
    led.queue(14, 0, b"e")
    led.drain(7)
    assert led.settle(TransferOutput(saved=[0]))[0] == [(0, b"e", False)]
