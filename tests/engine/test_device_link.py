"""The device link in one process: a prefill engine copies its prompt blocks into a decode
engine's landing slots (device to device, no file, no host copy); the decode engine's
tokens are one engine's, every full prompt block loaded; faults end in recompute."""

from __future__ import annotations

import random
from typing import Any

import pytest

from deepinfer_kit.components import Components
from deepinfer_kit.disagg import build_device_disaggregated
from deepinfer_kit.disagg.device_link import link_connector, link_loopback, link_receiver, link_to
from deepinfer_kit.engine.build import build_engine
from deepinfer_kit.engine.config import EngineConfig
from deepinfer_kit.errors import ConfigError
from deepinfer_kit.sample.params import SamplingParams

_RNG = random.Random(5)
_HEADS = [[_RNG.randrange(250) for _ in range(40)] for _ in range(4)]
_PROMPTS = [_HEADS[i % 4] + [_RNG.randrange(250) for _ in range(_RNG.randrange(1, 30))] for i in range(10)]
_CFG = EngineConfig(num_blocks=48, block_size=8, max_num_seqs=3, max_model_len=256)


def _params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=5, temperature=0.0) if i % 2 else SamplingParams(max_tokens=5, temperature=1.0,
                                                                                      seed=i)


def _reference() -> dict[str, list[int]]:
    engine = build_engine(_CFG)
    for i, p in enumerate(_PROMPTS):
        engine.add_request(str(i), p, _params(i))
    out = {o.request_id: list(o.outputs[0].token_ids) for o in engine.run()}
    engine.close()
    return out


@pytest.mark.parametrize("sides", [
    pytest.param({}, id="plain"),
    pytest.param({"overlap": True}, id="overlap"),
    pytest.param({"max_num_batched_tokens": 24}, id="chunked-prefill"),  # prompts published across rounds
    pytest.param({"speculative": {"drafter": "ngram", "num_draft": 3}}, id="speculative"),
    pytest.param({"scheduler": "static"}, id="static"),
])
def test_a_device_linked_pair_gives_one_engines_tokens_loading_every_prompt_block(sides: dict[str, Any]) -> None:
    pair = build_device_disaggregated(_CFG, send_slots=32, landing_slots=128, prefill=sides, decode=sides)
    for i, p in enumerate(_PROMPTS):
        pair.add_request(str(i), p, _params(i))
    outputs = pair.run()
    assert {o.request_id: list(o.outputs[0].token_ids) for o in outputs} == _reference()
    sent, landed = link_connector(pair.prefill).stats, link_connector(pair.decode).stats
    full = sum((len(p) - 1) // 8 for p in _PROMPTS)
    assert pair.num_fallbacks == 0 and sent.refused == 0 and landed.late_reads == 0
    # every usable prompt block crosses, the prefill engine's own prefix hits too (the
    # decode side may not hold them); the decode side computes none of them
    assert sent.saved_host == full
    assert landed.host_hits > 0
    assert sum(o.num_cached_tokens for o in outputs) == 8 * full
    pair.prefill.check_idle()
    pair.decode.check_idle()
    pair.close()


def test_too_few_send_slots_send_less_and_the_decode_side_does_not_wait() -> None:
    pair = build_device_disaggregated(_CFG, send_slots=1, landing_slots=128, timeout_s=5.0)
    for i, p in enumerate(_PROMPTS):
        pair.add_request(str(i), p, _params(i))
    got = {o.request_id: list(o.outputs[0].token_ids) for o in pair.run()}
    assert got == _reference()
    assert link_connector(pair.prefill).stats.refused > 0
    assert link_connector(pair.decode).stats.late_reads == 0  # told only what was sent
    pair.prefill.check_idle()
    pair.decode.check_idle()
    pair.close()


def test_blocks_that_never_come_are_recomputed_after_the_timeout() -> None:
    key = b"t" * 32
    decode = build_engine(_CFG, components=Components(kv_connector=link_receiver(key, timeout_s=0.01)))
    for i, p in enumerate(_PROMPTS[:3]):
        decode.add_request(str(i), p, _params(i), kv={"load_remote": True, "remote_blocks": 2})
    got = {o.request_id: list(o.outputs[0].token_ids) for o in decode.run()}
    assert got == {k: v for k, v in _reference().items() if int(k) < 3}
    assert link_connector(decode).stats.late_reads == 6  # both told blocks of each request
    decode.check_idle()
    decode.close()


def test_a_loopback_link_is_a_device_tier_below_the_pool() -> None:
    small = EngineConfig(num_blocks=16, block_size=8, max_num_seqs=1, max_model_len=128)
    engine = build_engine(small, components=Components(kv_connector=link_loopback(b"l" * 32, landing_slots=64)))
    for i, p in enumerate(_PROMPTS):
        engine.add_request(str(i), p[:100], _params(i))
        engine.run()
    stats = link_connector(engine).stats
    assert stats.host_hits > 0 and stats.loaded_tokens == 8 * stats.host_hits
    engine.check_idle()
    engine.close()


def test_bad_link_arguments_are_refused_naming_the_field() -> None:
    decode = build_engine(_CFG, components=Components(kv_connector=link_receiver(b"a" * 32)))
    with pytest.raises(ConfigError, match="hash_key"):
        link_to(decode, b"b" * 32)
    plain = build_engine(_CFG)
    with pytest.raises(ConfigError, match="no device link"):
        link_to(plain, b"a" * 32)
    with pytest.raises(ConfigError, match="hash_key"):
        link_receiver(b"")
    from deepinfer_kit.disagg.device_link import link_sender

    for bad, match in ((lambda: link_receiver(b"a", landing_slots=0), "landing_slots"),
                       (lambda: link_receiver(b"a", timeout_s=float("nan")), "timeout_s"),
                       (lambda: link_sender(1, b"a", send_slots=True), "send_slots"),  # type: ignore[arg-type]
                       (lambda: link_sender(-1, b"a"), "peer"),
                       (lambda: link_sender(1, b"a", send_timeout_s=0), "send_timeout_s"),
                       (lambda: link_loopback(b"a", landing_slots=-2), "landing_slots")):
        with pytest.raises(ConfigError, match=match):
            bad()
    decode.close()
    plain.close()


def test_a_link_whose_sends_fail_leaves_the_decode_side_computing_without_waiting() -> None:
    from deepinfer_kit.disagg.engine import DisaggregatedEngine
    from deepinfer_kit.disagg.device_link import link_sender

    key = b"f" * 32
    decode = build_engine(_CFG, components=Components(kv_connector=link_receiver(key, timeout_s=5.0)))
    # no process group: every send raises, as over a channel whose peer died
    prefill = build_engine(_CFG, components=Components(kv_connector=link_sender(1, key, send_slots=32)))
    pair = DisaggregatedEngine(prefill, decode)
    for i, p in enumerate(_PROMPTS[:4]):
        pair.add_request(str(i), p, _params(i))
    got = {o.request_id: list(o.outputs[0].token_ids) for o in pair.run()}
    assert got == {k: v for k, v in _reference().items() if int(k) < 4}
    sent = link_connector(prefill).stats
    assert sent.saved_host == 0 and sent.failed_writes == sum((len(p) - 1) // 8 for p in _PROMPTS[:4])
    assert link_connector(decode).stats.late_reads == 0 and link_connector(decode).stats.host_hits == 0
    prefill.check_idle()
    decode.check_idle()
    pair.close()


def test_a_receiver_that_ends_stops_the_decode_side_waiting_for_blocks() -> None:
    from deepinfer_kit.disagg.device_link import receive_into

    decode = build_engine(_CFG, components=Components(kv_connector=link_receiver(b"r" * 32, timeout_s=300.0)))
    receiver = receive_into(decode, lambda *_: None, 0)  # no process group: its first receive fails
    receiver.join(60)
    landing = link_connector(decode).landing
    assert receiver.error is not None and landing is not None and landing.closed
    decode.add_request("0", _PROMPTS[0], _params(0), kv={"load_remote": True})
    got = {o.request_id: list(o.outputs[0].token_ids) for o in decode.run()}
    assert got == {"0": _reference()["0"]}
    assert landing.waits == 0  # told every block, none waited for: nothing more can land
    assert link_connector(decode).stats.late_reads == (len(_PROMPTS[0]) - 1) // 8
    decode.check_idle()
    decode.close()


def test_sends_still_queued_are_no_leak_and_go_at_the_push() -> None:
    from deepinfer_kit.disagg import push_kv_down

    decode = build_engine(_CFG, components=Components(kv_connector=link_receiver(b"q" * 32)))
    prefill = build_engine(_CFG, components=Components(kv_connector=link_to(decode, b"q" * 32, send_slots=32)))
    prefill.add_request("0", _PROMPTS[0], SamplingParams(max_tokens=1), kv={"save_prompt": True})
    prefill.run()
    link = link_connector(prefill)
    usable = (len(_PROMPTS[0]) - 1) // 8
    assert link.stats.saved_host == 0  # queued for the next round's plan
    prefill.check_idle()  # a queued send holds a send slot, no request's block
    push_kv_down(prefill)
    assert link.stats.saved_host == usable and link_connector(decode).landing.received == usable  # type: ignore[union-attr]
    prefill.check_idle()
    decode.check_idle()
    prefill.close()
    decode.close()


def test_blocks_told_of_on_another_link_are_not_waited_for() -> None:
    from deepinfer_kit.disagg.link_connector import link_id

    key = b"m" * 32
    decode = build_engine(_CFG, components=Components(kv_connector=link_receiver(key, timeout_s=300.0)))
    link = link_connector(decode)
    assert link.link_id == link_id(key) != link_id(b"n" * 32)
    decode.add_request("0", _PROMPTS[0], _params(0),
                       kv={"load_remote": True, "remote_blocks": 3, "remote_link": link_id(b"n" * 32)})
    got = {o.request_id: list(o.outputs[0].token_ids) for o in decode.run()}
    assert got == {"0": _reference()["0"]}
    assert link.foreign == 1 and link.landing.waits == 0 and link.stats.late_reads == 0  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="remote_link"):
        decode.add_request("1", _PROMPTS[1], _params(1), kv={"load_remote": True, "remote_link": "XYZ"})
    decode.check_idle()
    decode.close()


def test_blocks_that_landed_and_were_evicted_are_not_waited_for() -> None:
    """Landing slots far fewer than a prompt's blocks: the first blocks are evicted by the
    later ones before the decode request comes; it waits for none of them (they will not
    land again), computes them, and loads what is still there."""
    pair = build_device_disaggregated(_CFG, send_slots=32, landing_slots=3, timeout_s=3.0)
    for i, p in enumerate(_PROMPTS[:4]):
        pair.add_request(str(i), p, _params(i))
    got = {o.request_id: list(o.outputs[0].token_ids) for o in pair.run()}
    assert got == {k: v for k, v in _reference().items() if int(k) < 4}
    landing = link_connector(pair.decode).landing
    assert landing is not None and landing.evicted > 0 and landing.waits == 0
    pair.prefill.check_idle()
    pair.decode.check_idle()
    pair.close()


def test_two_prefill_engines_feed_one_decode_engine_each_on_its_own_link() -> None:
    from deepinfer_kit.disagg import push_kv_down

    key = b"s" * 32
    decode = build_engine(_CFG, components=Components(kv_connector=link_receiver(key, sources=2, timeout_s=300.0)))
    prefills = [build_engine(_CFG, components=Components(kv_connector=link_to(decode, key, send_slots=32, source=s)))
                for s in (0, 1)]
    ids = [link_connector(p).link_id for p in prefills]
    assert len(set(ids)) == 2 and set(ids) == set(link_connector(decode).accepts)
    with pytest.raises(ConfigError, match="source=2"):
        link_to(decode, key, source=2)
    want, got = _reference(), {}
    for i, prompt in enumerate(_PROMPTS[:4]):
        prefill = prefills[i % 2]
        prefill.add_request(str(i), prompt, SamplingParams(max_tokens=1), kv={"save_prompt": True})
        prefill.cache.watch_saves(str(i))  # type: ignore[attr-defined]
        prefill.run()
        push_kv_down(prefill)
        told = prefill.cache.settled_saves(str(i))  # type: ignore[attr-defined]
        decode.add_request(str(i), prompt, _params(i),
                           kv={"load_remote": True, "remote_blocks": told, "remote_link": ids[i % 2]})
        got.update({o.request_id: list(o.outputs[0].token_ids) for o in decode.run()})
    assert got == {k: v for k, v in want.items() if int(k) < 4}
    landing = link_connector(decode).landing
    assert landing is not None
    landing.close(1)  # the second prefill engine's link ends; the first still delivers
    assert not landing.closed
    decode.add_request("late", _PROMPTS[5], _params(5), kv={"load_remote": True, "remote_link": ids[1]})
    decode.run()
    assert landing.waits == 0  # nothing more comes on that link: no wait
    for engine in (*prefills, decode):
        engine.check_idle()
        engine.close()
