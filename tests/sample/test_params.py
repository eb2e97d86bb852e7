"""SamplingParams: every bad value is a ConfigError naming the field and the value."""

from __future__ import annotations

import math
from typing import Any

import pytest

from deepinfer_kit import ConfigError, SamplingParams

BAD = [
    ({"temperature": -0.1}, "temperature must be >= 0, got -0.1"),
    ({"temperature": math.inf}, "temperature must be finite, got inf"),
    ({"temperature": math.nan}, "temperature must be finite, got nan"),
    ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
    ({"top_k": -2}, "top_k must be -1, 0 (disabled) or >= 1, got -2"),
    ({"top_k": 2.5}, "top_k must be an int, got 2.5"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"top_p": math.nan}, "top_p must be finite, got nan"),
    ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
    ({"min_p": 1.01}, "min_p must be in [0, 1], got 1.01"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
    ({"frequency_penalty": -3.0}, "frequency_penalty must be in [-2, 2], got -3.0"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
    ({"repetition_penalty": math.inf}, "repetition_penalty must be finite, got inf"),
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"max_tokens": True}, "max_tokens must be an int, got True"),
    ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be <= max_tokens (4), got 5"),
    ({"n": 0}, "n must be >= 1, got 0"),
    ({"seed": -1}, "seed must be in [0, 2**63), got -1"),
    ({"seed": 2**63}, f"seed must be in [0, 2**63), got {2**63}"),
    ({"seed": 1.0}, "seed must be an int, got 1.0"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids must hold token ids >= 0, got -2"),
    ({"stop_token_ids": "ab"}, "stop_token_ids must be a sequence of ints, got 'ab'"),
    ({"logprobs": -2}, "logprobs must be >= 0 or -1 (all), got -2"),
    ({"prompt_logprobs": -2}, "prompt_logprobs must be >= 0 or -1 (all), got -2"),
    ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1"),
    ({"stop": 5}, "stop must be a str or a list of str, got 5"),
    ({"stop": ["ok", ""]}, "stop must hold non-empty strings, got ''"),
    ({"stop": [b"x"]}, "stop must hold non-empty strings, got b'x'"),
    ({"stop": "x", "detokenize": False}, "stop strings need detokenize=True, got stop=['x']"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output must be a bool, got 'yes'"),
    ({"skip_special_tokens": None}, "skip_special_tokens must be a bool, got None"),
    ({"spaces_between_special_tokens": 0}, "spaces_between_special_tokens must be a bool, got 0"),
    ({"spaces_between_special_tokens": "no"}, "spaces_between_special_tokens must be a bool, got 'no'"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be >= 1 or -1 (max_model_len), got 0"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be >= 1 or -1 (max_model_len), got -2"),
    ({"truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens must be an int, got 1.5"),
    ({"output_kind": "delta"}, "output_kind must be a RequestOutputKind, got 'delta'"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD, ids=[m.split(" ")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_value_names_field_and_value(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


def test_defaults_and_disabled_values_are_accepted() -> None:
    p = SamplingParams(top_k=-1, top_p=1.0, min_p=0.0, seed=0, logprobs=0, stop_token_ids=[2, 3])
    assert p.stop_token_ids == (2, 3)
    assert not p.uses_top_k and not p.is_greedy and not p.has_penalties
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert SamplingParams(repetition_penalty=1.2).has_penalties


def test_vllm_shaped_values_are_accepted() -> None:
    with pytest.raises(ConfigError, match="n must be 1 when using greedy sampling"):
        SamplingParams(n=3, temperature=0.0)  # vLLM refuses n > 1 with greedy
    assert SamplingParams(n=3, top_k=1).n == 3  # vLLM's greedy check reads temperature only
    assert SamplingParams(temperature=0.001).temperature == 0.01  # vLLM raises it to 0.01
    assert SamplingParams(temperature=1e-30).temperature == 0.01
    assert SamplingParams(temperature=0.0).temperature == 0.0
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams().output_kind is None  # the caller's default (AsyncLLM: CUMULATIVE)
    p = SamplingParams(temperature=0.5, logit_bias={3: 1.0}, stop=["x"])
    q = p.clone()
    assert q == p and q.logit_bias is not p.logit_bias
    assert SamplingParams().skip_special_tokens and SamplingParams().detokenize


def test_params_are_frozen_and_hashable() -> None:
    p = SamplingParams(temperature=0.7)
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # type: ignore[misc]
    assert hash(p) == hash(SamplingParams(temperature=0.7))


def test_top_k_defaults_to_off_and_both_off_values_mean_off() -> None:
    assert SamplingParams().top_k == 0  # vLLM's default
    assert not SamplingParams(top_k=0).uses_top_k and not SamplingParams(top_k=-1).uses_top_k
    assert SamplingParams(top_k=2).uses_top_k
