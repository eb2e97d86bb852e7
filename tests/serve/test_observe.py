"""What an operator and a vLLM client read from the server: /metrics (parsed by
prometheus_client's own parser), /health, /version, /v1/models, /tokenize, /detokenize, the
access log, completion logprobs' text_offset, and body fields honoured rather than ignored."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
parser = pytest.importorskip("prometheus_client.parser")

from served_app import App  # noqa: E402

from deepinfer_kit import LLM, SamplingParams  # noqa: E402
from deepinfer_kit.serve.options import ServeOptions  # noqa: E402


@pytest.fixture(scope="module")
def app() -> Iterator[App]:
    a = App(ServeOptions())
    yield a
    a.stop()


def scrape(app: App) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    text = httpx.get(app.url + "/metrics").text
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def total(samples: dict[str, dict[Any, float]], name: str, **labels: str) -> float:
    return sum(v for k, v in samples.get(name, {}).items() if all((a, b) in k for a, b in labels.items()))


def test_metrics_parse_and_count_requests_tokens_and_engine_state(app: App) -> None:
    before = scrape(app)
    r = httpx.post(app.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 5, "ignore_eos": True,
                                                     "n": 2, "temperature": 0.5}, timeout=30)
    assert r.status_code == 200
    chunks = httpx.post(app.url + "/v1/completions", json={"prompt": "abcd", "max_tokens": 3,
                                                           "stream": True}, timeout=30).text
    assert chunks.endswith("data: [DONE]\n\n")
    app.wait_idle()
    after = scrape(app)
    grew = {name: total(after, name) - total(before, name) for name in (
        "deepinfer_generation_tokens_total", "deepinfer_prompt_tokens_total",
        "deepinfer_time_to_first_token_seconds_count", "deepinfer_e2e_request_latency_seconds_count",
        "deepinfer_request_success_total")}
    assert grew["deepinfer_generation_tokens_total"] == 10 + 3
    assert grew["deepinfer_prompt_tokens_total"] == 3 + 4
    assert grew["deepinfer_time_to_first_token_seconds_count"] == 2
    assert grew["deepinfer_e2e_request_latency_seconds_count"] == 2
    assert grew["deepinfer_request_success_total"] == 3  # two completions + one
    assert total(after, "deepinfer_request_success_total", finished_reason="length") >= 2
    assert total(after, "deepinfer_kv_blocks_total") == 256
    assert total(after, "deepinfer_num_requests_running") == 0
    assert total(after, "deepinfer_num_requests_waiting") == 0
    assert total(after, "deepinfer_engine_step_seconds_count") > total(before, "deepinfer_engine_step_seconds_count")
    assert total(after, "deepinfer_inter_token_latency_seconds_count") > 0
    assert 0.0 <= total(after, "deepinfer_prefix_cache_hit_rate") <= 1.0
    assert total(after, "deepinfer_http_requests_total", status="200") >= 2
    assert not [name for name in after if name.startswith("deepinfer_kv_tier")]  # no tiers: none shown


def test_health_version_and_models_say_what_vllm_clients_read(app: App) -> None:
    h = httpx.get(app.url + "/health")
    assert h.status_code == 200 and h.json()["engine"] == "alive" and h.json()["status"] == "ok"
    assert httpx.get(app.url + "/version").json()["version"]
    (model,) = httpx.get(app.url + "/v1/models").json()["data"]
    assert model["max_model_len"] == 256 and model["root"] == "tiny" and model["parent"] is None
    assert model["permission"][0]["object"] == "model_permission"


def test_tokenize_and_detokenize_round_trip(app: App) -> None:
    t = httpx.post(app.url + "/tokenize", json={"prompt": "héllo"}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 256
    assert httpx.post(app.url + "/detokenize", json={"tokens": t["tokens"]}).json()["prompt"] == "héllo"
    chat = httpx.post(app.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > len("hi")  # the template's text is in it
    r = httpx.post(app.url + "/detokenize", json={"tokens": [1, 10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_an_access_log_line_per_request_aborted_ones_included(app: App, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="deepinfer_kit.serve.access")
    httpx.post(app.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    httpx.post(app.url + "/v1/completions", content=b"x", headers={"content-type": "text/plain"})
    with httpx.Client(base_url=app.url, timeout=10) as http:
        with http.stream("POST", "/v1/completions", json={"prompt": "go", "max_tokens": 200,
                                                          "ignore_eos": True, "stream": True}) as r:
            next(r.iter_lines())
    deadline = time.monotonic() + 10
    while sum("aborted" in m for m in caplog.messages) < 1:
        assert time.monotonic() < deadline, caplog.messages
        time.sleep(0.01)
    lines = [m for m in caplog.messages if "/v1/completions" in m]
    assert any('"POST /v1/completions" 200' in m and "aborted" not in m for m in lines)
    assert any('"POST /v1/completions" 415' in m for m in lines)
    assert any('"POST /v1/completions" 200' in m and m.endswith("aborted") for m in lines)
    app.wait_idle()


def _check_offsets(tokens: list[str], offsets: list[int], start: int = 0) -> None:
    position = start
    for tok, off in zip(tokens, offsets, strict=True):
        assert off == position, (tokens, offsets)
        position += len(tok)


def test_text_offset_is_the_running_length_of_the_tokens_text(app: App) -> None:
    body = {"prompt": "Hello there", "max_tokens": 12, "logprobs": 1, "temperature": 0.8, "seed": 5,
            "ignore_eos": True, "allowed_token_ids": list(range(97, 123)) + [32]}  # printable tokens
    got = httpx.post(app.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    lp = got["logprobs"]
    assert "".join(lp["tokens"]) == got["text"] and len(set(lp["text_offset"])) > 1
    _check_offsets(lp["tokens"], lp["text_offset"])
    stream = httpx.post(app.url + "/v1/completions", json={**body, "stream": True}, timeout=30).text
    tokens: list[str] = []
    offsets: list[int] = []
    for event in stream.split("\n\n"):
        if event.startswith("data: {"):
            for c in json.loads(event[6:])["choices"]:
                tokens += c["logprobs"]["tokens"]
                offsets += c["logprobs"]["text_offset"]
    assert tokens == lp["tokens"]
    _check_offsets(tokens, offsets)  # continues across chunks, never restarts at 0
    with pytest.raises(AssertionError):
        _check_offsets(lp["tokens"], [0] * len(lp["tokens"]))  # constant offsets fail the check


def test_sampling_fields_in_the_body_are_honoured(app: App) -> None:
    ref = LLM("tiny", num_blocks=256, block_size=8, max_model_len=256, max_num_seqs=16)
    cases: list[tuple[dict[str, Any], SamplingParams]] = [
        ({"allowed_token_ids": [120]}, SamplingParams(allowed_token_ids=[120])),
        ({"allowed_token_ids": [97, 98], "temperature": 0.9, "seed": 3},
         SamplingParams(allowed_token_ids=[97, 98], temperature=0.9, seed=3)),
        ({"logit_bias": {"120": 100}}, SamplingParams(logit_bias={120: 100.0})),
        ({"bad_words": ["a"], "temperature": 0}, SamplingParams(bad_words=["a"], temperature=0)),
    ]
    for extra, params in cases:
        body = {"prompt": "abc", "max_tokens": 6, "ignore_eos": True, **extra}
        got = httpx.post(app.url + "/v1/completions", json=body, timeout=30).json()
        want = ref.generate("abc", SamplingParams(**{**_fields(params), "max_tokens": 6, "ignore_eos": True}))
        assert got["choices"][0]["text"] == want[0].outputs[0].text, extra
    only = httpx.post(app.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 5,
                                                         "allowed_token_ids": [120]}).json()
    assert only["choices"][0]["text"] == chr(120) * 5
    lp = httpx.post(app.url + "/v1/completions", json={"prompt": "abcd", "max_tokens": 1,
                                                       "prompt_logprobs": 1}).json()
    prompt_lp = lp["choices"][0]["prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == 4
    assert all(str(ord(ch)) in entry for ch, entry in zip("bcd", prompt_lp[1:]))
    ref.close()
    app.wait_idle()


def _fields(params: SamplingParams) -> dict[str, Any]:
    keys = ("allowed_token_ids", "logit_bias", "bad_words", "temperature", "seed")
    return {k: getattr(params, k) for k in keys}


def test_generation_config_defaults_fill_the_fields_a_body_leaves_unset() -> None:
    from served_app import CHATML
    from deepinfer_kit.serve.api import build_app
    from deepinfer_kit.serve.protocol import parse_completion

    parsed = parse_completion({"prompt": "x"}, defaults={"temperature": 0.6, "top_k": 20, "max_tokens": 40})
    assert (parsed.params.temperature, parsed.params.top_k, parsed.params.max_tokens) == (0.6, 20, 40)
    parsed = parse_completion({"prompt": "x", "temperature": 0.1, "max_tokens": 3}, defaults={"temperature": 0.6})
    assert (parsed.params.temperature, parsed.params.max_tokens) == (0.1, 3)
    assert callable(build_app) and CHATML


def test_stream_events_survive_line_splitting_on_unicode_separators() -> None:
    from deepinfer_kit.serve.api import _sse

    event = _sse({"text": "a\x85b\u2028c\u2029d\re"})
    lines = event.splitlines()  # how httpx's iter_lines splits
    assert lines[0].startswith("data: ") and json.loads(lines[0][6:])["text"] == "a\x85b\u2028c\u2029d\re"
