"""The Triton MoE path reads nothing back from the device: equal to the reference layer,
no host-reading op on its way, and (on a GPU) no sync and a replayable CUDA graph."""

from __future__ import annotations

import pytest
import torch

from moe_layers import make_layer, no_host_reads

from deepinfer_kit.moe import MoELayer
from deepinfer_kit.moe.align import align_block_size

CASES = [(seed, shared, tokens) for seed in range(4) for shared in (False, True) for tokens in (0, 1, 7, 40)]


@pytest.mark.triton
@pytest.mark.parametrize(("seed", "shared", "tokens"), CASES)
def test_triton_layer_equals_ref_layer_fp32(seed: int, shared: bool, tokens: int) -> None:
    ref = make_layer(seed, shared=shared, impl="ref")
    tri = make_layer(seed, shared=shared, impl="triton")
    hidden = torch.randn(tokens, ref.config.hidden_size, generator=torch.Generator().manual_seed(seed + 100))
    want = ref(hidden)
    with no_host_reads():
        got = tri(hidden)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert tri.last_expert_counts is not None and ref.last_expert_counts is not None
    assert torch.equal(tri.last_expert_counts, ref.last_expert_counts)


@pytest.mark.triton
@pytest.mark.parametrize("shared", [False, True])
def test_triton_layer_bf16_within_stated_tolerance(shared: bool) -> None:
    ref = make_layer(5, shared=shared, impl="ref")
    tri = make_layer(5, shared=shared, impl="triton", dtype=torch.bfloat16)
    hidden = torch.randn(30, ref.config.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16()
    got = tri(hidden)
    assert got.dtype == torch.bfloat16
    # bf16 weights and activations against fp32 ones: about 3 significant digits
    torch.testing.assert_close(got.float(), ref(hidden.float()), rtol=3e-2, atol=3e-2)


def test_align_reads_nothing_back() -> None:
    ids = torch.randint(0, 6, (33, 2), generator=torch.Generator().manual_seed(0))
    with no_host_reads():
        schedule = align_block_size(ids, 6, 16)
    assert int(schedule.expert_counts.sum()) == 66


def test_guard_catches_host_reads() -> None:
    ids = torch.arange(6).view(3, 2)
    for read in (lambda: ids.tolist(), lambda: torch.bincount(ids.flatten()), lambda: ids[ids > 2],
                 lambda: bool(ids.any()), lambda: ids.flatten().repeat_interleave(ids.flatten())):  # fmt: skip
        with pytest.raises(AssertionError, match="host read"), no_host_reads():
            read()


def _cuda_pair(seed: int) -> tuple[MoELayer, MoELayer]:
    pytest.importorskip("triton")
    ref = make_layer(seed, shared=True, impl="ref")
    tri = MoELayer(ref.config, impl="triton", device="cuda")
    tri.load_state_dict(ref.state_dict())
    return ref, tri


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 64])
def test_forward_never_syncs_on_cuda(tokens: int) -> None:
    ref, tri = _cuda_pair(tokens)
    hidden = torch.randn(tokens, ref.config.hidden_size, generator=torch.Generator().manual_seed(tokens))
    on_device = hidden.cuda()
    with torch.no_grad():
        tri(on_device)  # compile the kernels first: compilation is not the forward
        torch.cuda.synchronize()
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = tri(on_device)
        finally:
            torch.cuda.set_sync_debug_mode(before)
        counts = tri.last_expert_counts
        assert counts is not None and counts.is_cuda
        torch.testing.assert_close(out.cpu(), ref(hidden), rtol=1e-4, atol=1e-4)
        assert ref.last_expert_counts is not None
        assert torch.equal(counts.cpu(), ref.last_expert_counts)


@pytest.mark.cuda
def test_forward_replays_as_a_cuda_graph() -> None:
    ref, tri = _cuda_pair(7)
    gen = torch.Generator().manual_seed(7)
    first, second = (torch.randn(24, ref.config.hidden_size, generator=gen) for _ in range(2))
    static_in = first.cuda()
    with torch.no_grad():
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                tri(static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = tri(static_in)
        static_counts = tri.last_expert_counts
        assert static_counts is not None
        static_in.copy_(second.cuda())
        graph.replay()
        torch.cuda.synchronize()
        replayed, replayed_counts = static_out.clone(), static_counts.clone()
        eager = tri(static_in)
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
        assert tri.last_expert_counts is not None and torch.equal(replayed_counts, tri.last_expert_counts)
        torch.testing.assert_close(replayed.cpu(), ref(second), rtol=1e-4, atol=1e-4)
        assert ref.last_expert_counts is not None
        assert torch.equal(replayed_counts.cpu(), ref.last_expert_counts)
        assert not torch.allclose(replayed.cpu(), ref(first), atol=1e-3), "the replay ignored the new input"
