"""to_device / host_to_device: a host list or tensor on the device without the host
waiting for the device (pinned, non-blocking on CUDA), equal to ``torch.tensor(values,
device=...)`` / ``tensor.to(device)``; and the penalties, which use them, never make the
host wait."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kit._staging import host_to_device, to_device
from deepinfer_kit.sample.params import SamplingParams
from deepinfer_kit.sample.penalties import apply_penalties
from deepinfer_kit.sample.records import SamplingBatch


@pytest.mark.parametrize(("values", "dtype"), [
    ([3, 1, 2], torch.int64), ([0.25, 1.5], torch.float64), ([0.5], torch.float32), ([], torch.int64),
])
def test_the_reference_path_equals_torch_tensor(values: list[float], dtype: torch.dtype) -> None:
    got = to_device(values, dtype, torch.device("cpu"))
    want = torch.tensor(values, dtype=dtype)
    assert got.dtype == dtype and got.device.type == "cpu" and torch.equal(got, want)


@pytest.mark.cuda
def test_on_cuda_the_copy_never_synchronises_the_host() -> None:
    dev = torch.device("cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = to_device(list(range(1000)), torch.int64, dev)
        with pytest.raises(RuntimeError):  # what it replaces: a copy from pageable memory syncs
            torch.tensor([1, 2, 3], device=dev)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.tolist() == list(range(1000))


def test_a_host_tensor_off_cuda_is_moved_as_to_does() -> None:
    host = torch.arange(6, dtype=torch.float32).view(2, 3)
    got = host_to_device(host, torch.device("cpu"))
    assert got is host.to("cpu") and torch.equal(got, host)


def _penalised(device: torch.device) -> tuple[torch.Tensor, SamplingBatch]:
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2, min_tokens=4,
                             stop_token_ids=[5]),
              SamplingParams(temperature=0.0)]
    batch = SamplingBatch(params, [None, None], [0, 0], [[1, 2, 3], [4]], [[2, 2, 7], [1]], [0, 0])
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 16, generator=gen).to(device), batch


def test_penalties_through_the_staging_equal_the_plain_arithmetic() -> None:
    x, batch = _penalised(torch.device("cpu"))
    want = x.clone()
    # repetition (prompt + output), then frequency and presence (output), then the min_tokens mask
    for t in {1, 2, 3, 7}:
        want[0, t] = want[0, t] / 1.3 if want[0, t] > 0 else want[0, t] * 1.3
    for t, count in ((2, 2), (7, 1)):
        want[0, t] -= 0.2 * count + 0.4
    want[0, 0] = want[0, 5] = float("-inf")
    apply_penalties(x, batch)
    assert torch.allclose(x, want)


@pytest.mark.cuda
def test_on_cuda_the_penalties_never_synchronise_the_host() -> None:
    x, batch = _penalised(torch.device("cuda"))
    torch.cuda.set_sync_debug_mode("error")
    try:
        apply_penalties(x, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu, _ = _penalised(torch.device("cpu"))
    apply_penalties(cpu, batch)
    assert torch.allclose(x.cpu(), cpu)


@pytest.mark.cuda
def test_on_cuda_a_host_tensor_moves_without_a_sync() -> None:
    dev = torch.device("cuda")
    host = torch.arange(1000, dtype=torch.int64)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = host_to_device(host, dev)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.device.type == "cuda" and got.tolist() == list(range(1000))
