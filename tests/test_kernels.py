"""resolve_impl: the one rule every component uses to pick a reference op or a Triton kernel."""

from __future__ import annotations

import pytest

from deepinfer_kit import ConfigError, DeviceUnavailableError
from deepinfer_kit._kernels import resolve_impl


def test_auto_picks_reference_off_cuda_and_ref_is_always_ref() -> None:
    assert resolve_impl("auto", on_cuda=False) == "ref"
    assert resolve_impl("ref", on_cuda=True) == "ref"


def test_triton_runs_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_impl("triton", on_cuda=False) == "triton"


def test_triton_without_cuda_or_interpreter_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(DeviceUnavailableError, match="sampler_impl='triton' needs CUDA or TRITON_INTERPRET=1"):
        resolve_impl("triton", on_cuda=False, field="sampler_impl")


def test_unknown_impl_names_field_and_value() -> None:
    with pytest.raises(ConfigError, match=r"impl must be one of \['auto', 'ref', 'triton'\], got 'cuda'"):
        resolve_impl("cuda", on_cuda=True)
