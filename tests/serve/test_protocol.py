"""The request bodies' sampling fields reach SamplingParams under vLLM's names and meanings."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")

from deepinfer_kit import SamplingParams  # noqa: E402
from deepinfer_kit.sample.params import RequestOutputKind  # noqa: E402
from deepinfer_kit.serve.protocol import BadRequest, parse_chat, parse_completion  # noqa: E402

FIELDS: dict[str, Any] = {
    "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "n": 2, "seed": 11,
    "presence_penalty": 0.25, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
    "ignore_eos": True, "min_tokens": 2, "stop_token_ids": [3, 4], "stop": ["\n\n"],
    "include_stop_str_in_output": True, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "truncate_prompt_tokens": -1,
}


def test_every_sampling_field_of_a_completion_body_reaches_sampling_params() -> None:
    parsed = parse_completion({"prompt": "x", "max_tokens": 9, "logprobs": 3, **FIELDS})
    assert parsed.params == SamplingParams(max_tokens=9, logprobs=3, output_kind=RequestOutputKind.FINAL_ONLY,
                                           **FIELDS)
    chat, _ = parse_chat({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9, "logprobs": True,
                          "top_logprobs": 2, "stream": True, **FIELDS})
    assert chat.params == SamplingParams(max_tokens=9, logprobs=2, output_kind=RequestOutputKind.DELTA, **FIELDS)


@pytest.mark.parametrize(("field", "value"), [("top_k", -2), ("truncate_prompt_tokens", 0),
                                              ("spaces_between_special_tokens", "no"), ("min_p", 2)])
def test_a_bad_sampling_field_is_a_bad_request_naming_it(field: str, value: Any) -> None:
    with pytest.raises(BadRequest) as err:
        parse_completion({"prompt": "x", field: value})
    assert err.value.param == field and field in str(err.value)


def test_logprobs_minus_one_lists_every_alternative() -> None:
    from deepinfer_kit.outputs import CompletionOutput, Logprob
    from deepinfer_kit.serve.protocol import chat_logprobs

    entry = {t: Logprob(logprob=-float(t), rank=t + 1, decoded_token=chr(97 + t)) for t in range(6)}
    c = CompletionOutput(index=0, text="a", token_ids=[0], cumulative_logprob=0.0, logprobs=[entry])
    got = chat_logprobs(c, -1)
    assert got is not None
    assert [t["token"] for t in got["content"][0]["top_logprobs"]] == list("abcdef")
    top2 = chat_logprobs(c, 2)
    assert top2 is not None and [t["token"] for t in top2["content"][0]["top_logprobs"]] == ["a", "b"]
