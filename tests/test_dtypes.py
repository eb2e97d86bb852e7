"""The dtype table: names, their torch dtypes, and errors naming the field and value."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kit._dtypes import DTYPE_NAMES, dtype_name, torch_dtype
from deepinfer_kit.errors import ConfigError


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_names_round_trip(name: str) -> None:
    dtype = torch_dtype(name)
    assert isinstance(dtype, torch.dtype) and str(dtype) == f"torch.{name}"
    assert dtype_name(dtype) == name


def test_unknown_name_names_field_and_value() -> None:
    with pytest.raises(ConfigError, match=r"kv_dtype must be one of .*got 'int8'"):
        torch_dtype("int8", field="kv_dtype")
    with pytest.raises(ConfigError, match=r"dtype must be one of .*got 'float'"):
        torch_dtype("float")  # a torch attribute, but not a supported name


def test_unsupported_torch_dtype_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"dtype must be one of .*torch\.int8"):
        dtype_name(torch.int8)
