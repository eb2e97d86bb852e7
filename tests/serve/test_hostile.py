"""The server against a hostile client: API keys, cross-site bodies, huge and deep bodies,
lone surrogates, huge fields echoed back, request chat templates, over-the-cap requests.
Every answer is a JSON 4xx naming the field (never a 500), and /health stays fast."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

from served_app import App  # noqa: E402

from deepinfer_kit.serve.options import ServeOptions  # noqa: E402

KEY = "s3cret-key"
OPTIONS = ServeOptions(api_key=KEY, max_body_bytes=1 << 20, max_n=8, max_prompts=4, max_stop=4,
                       max_stop_chars=64, chat_template_timeout_s=0.5)
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def app() -> Iterator[App]:
    a = App(OPTIONS)
    yield a
    a.stop()


def post(app: App, path: str, body: Any = None, *, raw: bytes | None = None,
         headers: dict[str, str] | None = None) -> Any:
    content = raw if raw is not None else json.dumps(body).encode()
    h = {"content-type": "application/json", **AUTH, **(headers or {})}
    return httpx.post(app.url + path, content=content, headers=h, timeout=30)


def error_of(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = r.json()["error"]
    assert error["code"] == status
    return error


def test_the_api_key_is_required_on_v1_and_health_stays_open(app: App) -> None:
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY},
                    {"authorization": f"Basic {KEY}"}):
        r = httpx.get(app.url + "/v1/models", headers=headers)
        assert error_of(r, 401)["type"] == "AuthenticationError"
        r = httpx.post(app.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
        error_of(r, 401)
        error_of(httpx.post(app.url + "/tokenize", json={"prompt": "x"}, headers=headers), 401)
    assert httpx.get(app.url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(app.url + "/health").status_code == 200
    assert httpx.get(app.url + "/version").status_code == 200


def test_the_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_API_KEY", "from-env")
    assert ServeOptions.from_env().api_key == "from-env"
    assert ServeOptions.from_env(api_key="given").api_key == "given"
    monkeypatch.setenv("DEEPINFER_API_KEY", "")
    assert ServeOptions.from_env().api_key is None


def test_a_text_plain_post_is_refused_unparsed(app: App) -> None:
    before = app.llm.engine.num_prompt_tokens
    body = json.dumps({"prompt": "cross-site", "max_tokens": 2}).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""):
        r = post(app, "/v1/completions", raw=body, headers={"content-type": ctype})
        assert error_of(r, 415)["param"] == "content-type"
    assert app.llm.engine.num_prompt_tokens == before  # nothing reached the engine
    ok = post(app, "/v1/completions", raw=body, headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_a_body_over_the_limit_is_413_declared_or_streamed(app: App) -> None:
    big = json.dumps({"prompt": "x" * (2 << 20)}).encode()
    assert error_of(post(app, "/v1/completions", raw=big), 413)["param"] == "body"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while reading
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    r = httpx.post(app.url + "/v1/completions", content=chunks(),
                   headers={"content-type": "application/json", **AUTH}, timeout=30)
    error_of(r, 413)


@pytest.mark.parametrize("depth", [100, 100_000])
def test_deep_nesting_is_a_400_naming_the_field(app: App, depth: int) -> None:
    raw = b'{"prompt": "x", "nested": ' + b"[" * depth + b"]" * depth + b"}"
    error = error_of(post(app, "/v1/completions", raw=raw), 400)
    assert "deeper than 64" in error["message"]
    assert error["param"] in ("nested", "body")  # past the parser's own limit: the body


def test_lone_surrogates_are_a_400_naming_the_field(app: App) -> None:
    r = post(app, "/v1/completions", raw=b'{"prompt": "a \\ud800 b", "max_tokens": 2}')
    assert error_of(r, 400)["param"] == "prompt"
    r = post(app, "/v1/chat/completions",
             raw=b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}')
    assert error_of(r, 400)["param"] == "messages"
    r = post(app, "/tokenize", raw=b'{"prompt": "\\ud83d"}')
    assert error_of(r, 400)["param"] == "prompt"


@pytest.mark.parametrize(("field", "value", "path"), [
    ("temperature", "h" * 1_000_000, "/v1/completions"),
    ("prompt", [{"x": "p" * 1_000_000}], "/v1/completions"),
    ("stop", [7] * 200_000, "/v1/completions"),
    ("model", "m" * 1_000_000, "/v1/completions"),
    ("messages", "c" * 1_000_000, "/v1/chat/completions"),
    ("logit_bias", {"k" * 500_000: 1}, "/v1/completions"),
])
def test_errors_echo_at_most_200_characters_of_a_value(app: App, field: str, value: Any, path: str) -> None:
    body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}], field: value}
    r = post(app, path, body)
    assert r.status_code in (400, 404), r.text[:300]
    assert len(r.content) < 1000
    assert r.json()["error"]["param"] == field


def test_request_chat_templates_are_refused_unless_trusted(app: App) -> None:
    costly = "{% for i in range(6000) %}{% for j in range(6000) %}{% endfor %}{% endfor %}"
    r = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                           "chat_template": costly, "max_tokens": 2})
    error = error_of(r, 400)
    assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]


def test_a_slow_template_times_out_off_the_event_loop_and_health_stays_fast() -> None:
    trusted = App(ServeOptions(trust_request_chat_template=True, chat_template_timeout_s=0.5,
                               max_concurrent_renders=1))
    release = threading.Event()
    render = trusted.llm.chat_renderer.render

    entered: list[int] = []

    def stuck(*args: Any, **kwargs: Any) -> Any:  # a template that runs until released
        entered.append(1)
        release.wait(30)
        return render(*args, **kwargs)

    trusted.llm.chat_renderer.render = stuck  # type: ignore[method-assign]
    answers: list[Any] = []
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    try:
        worker = threading.Thread(target=lambda: answers.append(
            httpx.post(trusted.url + "/v1/chat/completions", json=body, timeout=30)))
        worker.start()
        health = []
        while worker.is_alive():
            t0 = time.perf_counter()
            assert httpx.get(trusted.url + "/health", timeout=5).status_code == 200
            health.append(time.perf_counter() - t0)
        worker.join()
        error = error_of(answers[0], 400)
        assert error["param"] == "chat_template" and "longer than 0.5 s" in error["message"]
        assert health and max(health) < 5.0, health  # generous (a loaded machine): never blocked
        again = httpx.post(trusted.url + "/v1/chat/completions", json=body, timeout=30)
        assert error_of(again, 400)["param"] == "chat_template"
        assert len(entered) == 1  # the overrun thread still holds the only slot
    finally:
        release.set()
        trusted.llm.chat_renderer.render = render  # type: ignore[method-assign]
    r = httpx.post(trusted.url + "/v1/chat/completions", timeout=30, json={
        **body, "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})
    assert r.status_code == 200, r.text  # the slot came back; a trusted template renders
    trusted.stop()


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "n": 9, "temperature": 1.0}, "n"),
    ({"prompt": ["p"] * 1000}, "prompt"),
    ({"prompt": "x", "stop": [f"s{i}" for i in range(10_000)]}, "stop"),
    ({"prompt": "x", "stop": ["y" * 65]}, "stop"),
    ({"prompt": "x", "max_tokens": 1_000_000_000}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1e9}, "max_tokens"),
    ({"prompt": "x" * 200, "max_tokens": 256 - 200 + 1}, "max_tokens"),
    ({"prompt": "x", "structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": "a+"}, "structured_outputs"),
    ({"prompt": "x", "guided_json": {"type": "object"}}, "guided_json"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format"),
    ({"prompt": "x", "allowed_token_ids": [9999]}, "allowed_token_ids"),
    ({"prompt": "x", "logit_bias": {"9999": 1}}, "logit_bias"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "temperature": 0, "n": 2}, "n"),
    ({"prompt": [1, 2, 999_999]}, "prompt"),
])
def test_over_the_cap_and_refused_fields_are_400_with_param(app: App, body: dict[str, Any], param: str) -> None:
    error = error_of(post(app, "/v1/completions", body), 400)
    assert error["param"] == param, error


def test_engine_refusals_of_a_chat_name_messages(app: App) -> None:
    r = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]})
    error = error_of(r, 400)
    assert error["param"] == "messages" and "max_model_len" in error["message"]


def test_a_request_that_fits_the_context_exactly_is_served(app: App) -> None:
    r = post(app, "/v1/completions", {"prompt": "x" * 200, "max_tokens": 256 - 200, "ignore_eos": True,
                                      "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 256 - 200
    app.wait_idle()


def test_an_unexpected_failure_is_a_json_500_and_the_server_goes_on(app: App) -> None:
    check = app.llm.engine.check_request

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    app.llm.engine.check_request = broken  # type: ignore[method-assign]
    try:
        error = error_of(post(app, "/v1/completions", {"prompt": "x"}), 500)
        assert error["type"] == "InternalServerError" and "boom" not in error["message"]
    finally:
        app.llm.engine.check_request = check  # type: ignore[method-assign]
    assert post(app, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_small_request_is_answered_while_n_equals_max_num_seqs_runs() -> None:
    seats = 16
    fair = App(ServeOptions(), max_num_seqs=seats, num_blocks=1024)
    big_done = threading.Event()
    body = {"prompt": "a long answer", "n": seats, "max_tokens": 220, "ignore_eos": True,
            "temperature": 1.0, "stream": True}
    first_chunk = threading.Event()
    leave = threading.Event()

    def big() -> None:
        with httpx.Client(base_url=fair.url, timeout=120) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                        first_chunk.set()
                    if leave.is_set():
                        return  # disconnect: the big request is aborted
        big_done.set()

    worker = threading.Thread(target=big)
    worker.start()
    try:
        assert first_chunk.wait(60)  # the fork holds every seat now
        health: list[float] = []
        t0 = time.perf_counter()
        small = httpx.post(fair.url + "/v1/completions", timeout=60,
                           json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True, "temperature": 0})
        small_s = time.perf_counter() - t0
        big_still_running = not big_done.is_set()
        while not big_done.is_set() and len(health) < 20:
            t1 = time.perf_counter()
            assert httpx.get(fair.url + "/health", timeout=10).status_code == 200
            health.append(time.perf_counter() - t1)
        assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 4
        print(f"small request answered in {small_s:.3f} s while n={seats} ran; "
              f"/health max {max(health, default=0.0):.3f} s over {len(health)} calls")
        assert big_still_running  # answered before the big request ended: it did not wait for it
        assert max(health, default=0.0) < 5.0
    finally:
        leave.set()
        worker.join(120)
        fair.wait_idle()
        fair.stop()


def test_a_host_outside_the_allowed_list_is_refused() -> None:
    from deepinfer_kit.serve.options import host_allowed

    assert host_allowed({"host": "LocalHost:8000"}, ("localhost",))
    assert host_allowed({"host": "[::1]:80"}, ("::1",)) and host_allowed({}, ())
    assert not host_allowed({"host": "evil.example:8000"}, ("localhost", "127.0.0.1"))
    guarded = App(ServeOptions(allowed_hosts="127.0.0.1,localhost"))
    try:
        assert httpx.get(guarded.url + "/v1/models").status_code == 200  # Host: 127.0.0.1:port
        r = httpx.get(guarded.url + "/v1/models", headers={"host": "rebound.example"})
        assert error_of(r, 400)["param"] == "host"
    finally:
        guarded.stop()
