"""to_device: a host list on the device without the host waiting for the device (pinned,
non-blocking on CUDA), equal to ``torch.tensor(values, device=...)``."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kit._staging import to_device


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
