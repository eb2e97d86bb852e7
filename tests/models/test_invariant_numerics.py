"""The batch-invariant numerics (``models.invariant``): a row's product, activation and
expert output are bitwise the same at any row count, place and company; the mode refuses
a machine that fails the probe, and tensor parallelism."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.models import invariant
from deepinfer_kit.models.fused_ops import invariant_silu_and_mul, silu_and_mul
from deepinfer_kit.models.invariant import (
    INVARIANT, MIN_ROWS, PLAIN, invariant_linear, invariant_sigmoid, invariant_silu, select_numerics,
)
from deepinfer_kit.moe.ref_ops import routed_swiglu


def _row_everywhere(op, row: torch.Tensor, width: int) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """``op``'s result for ``row`` placed at several places of batches of 1 to 40 rows."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for rows in (1, 2, 3, 5, 7, 9, 11, 12, 16, 17, 31, 40):
        for place in {0, rows // 2, rows - 1}:
            x = torch.randn(rows, width, generator=gen)
            x[place] = row
            out.append(op(x)[place])
    return out


@pytest.mark.parametrize("shape", [(64, 192), (128, 256), (16, 64), (64, 1)])
def test_a_padded_product_gives_a_row_the_same_result_in_any_batch(shape: tuple[int, int]) -> None:
    k, n = shape
    w, b = torch.randn(n, k), torch.randn(n)
    row = torch.randn(k)
    results = _row_everywhere(lambda x: invariant_linear(x, w, b), row, k)
    assert all(torch.equal(r, results[0]) for r in results)
    torch.testing.assert_close(results[0], F.linear(row[None], w, b)[0])
    if n > 1:  # what the padding is for (a one-column product varies with 2+ threads)
        plain = _row_everywhere(lambda x: F.linear(x, w, b), row, k)
        assert not all(torch.equal(r, plain[0]) for r in plain)
    assert invariant_linear(torch.zeros(0, k), w).shape == (0, n)


def test_activations_give_an_element_the_same_value_at_any_tensor_size() -> None:
    values = torch.randn(10_007) * 4
    for op, ref in ((invariant_silu, F.silu), (invariant_sigmoid, torch.sigmoid)):
        whole = op(values)
        for size in (1, 5, 17, 31, 33, 100, 1001):
            assert torch.equal(op(values[:size].clone()), whole[:size])
        torch.testing.assert_close(whole, ref(values), rtol=1e-6, atol=1e-7)
    # torch's own silu rounds a vector loop's tail differently: the reason for the above
    assert any(not torch.equal(F.silu(values[:n].clone()), F.silu(values)[:n]) for n in range(1, 70))
    gate_up = torch.randn(5, 64)
    torch.testing.assert_close(invariant_silu_and_mul(gate_up), silu_and_mul(gate_up))


def test_routed_experts_give_a_token_the_same_output_however_many_share_its_experts() -> None:
    gen = torch.Generator().manual_seed(2)
    e, h, i, k = 4, 32, 48, 2
    gate_up, down = torch.randn(e, 2 * i, h, generator=gen), torch.randn(e, h, i, generator=gen)
    token = torch.randn(h, generator=gen)
    outs = []
    for rows in (1, 3, 6, 10, 13, 30):
        hidden = torch.randn(rows, h, generator=gen)
        ids = torch.randint(0, e, (rows, k), generator=gen)
        ids[:, 1] = (ids[:, 0] + 1) % e
        weights = torch.rand(rows, k, generator=gen)
        place = rows // 2
        hidden[place], ids[place], weights[place] = token, torch.tensor([2, 0]), torch.tensor([0.7, 0.3])
        outs.append(routed_swiglu(hidden, ids, weights, gate_up, down, INVARIANT)[0][place])
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_the_mode_is_refused_where_the_probe_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    assert select_numerics(False, "cpu") is PLAIN
    assert select_numerics(True, "cpu") is INVARIANT
    assert invariant.probe_row_invariance(torch.device("cpu")) is None
    monkeypatch.setitem(invariant._PROBED, "cpu", "row 8 of a [9, 16] x [16, 64] product differs")
    with pytest.raises(ConfigError, match="batch_invariant=True: row 8 of a"):
        select_numerics(True, "cpu")


def test_the_probe_catches_a_padding_too_small(monkeypatch: pytest.MonkeyPatch) -> None:
    # two rows: a product of 2-3 rows takes another kernel than one of 4 (and, with two or
    # more threads, 9-11 rows a remainder kernel: why MIN_ROWS is 16)
    monkeypatch.setattr(invariant, "MIN_ROWS", 2)
    failure = invariant._probe(torch.device("cpu"))
    assert failure is not None and "product differs" in failure, failure
    assert MIN_ROWS == 16
