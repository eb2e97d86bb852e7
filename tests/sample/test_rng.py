"""The counter-based stream: an independent splitmix64, uniformity, distinct keys, and how
unseeded rows consume the generator."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer_kit.sample.rng import mix64, row_uniforms, seeded_uniform


def _mix64_numpy(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        out: np.ndarray = z ^ (z >> np.uint64(31))
        return out


def test_mix64_matches_an_independent_uint64_implementation() -> None:
    rng = np.random.default_rng(0)
    values = rng.integers(0, 2**63, size=500, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    expected = _mix64_numpy(values.copy())
    assert [mix64(int(v)) for v in values] == [int(e) for e in expected]


def test_mix64_is_a_bijection_on_a_sample() -> None:
    outs = {mix64(i) for i in range(100_000)}
    assert len(outs) == 100_000


@pytest.mark.parametrize("axis", ["seed", "position"])
def test_uniforms_are_uniform_and_distinct(axis: str) -> None:
    n = 100_000
    if axis == "seed":
        u = np.array([seeded_uniform(s, 3) for s in range(n)])
    else:
        u = np.array([seeded_uniform(12345, p) for p in range(n)])
    assert u.min() >= 0.0 and u.max() < 1.0
    assert len(set(u.tolist())) == n
    ks = np.max(np.abs(np.sort(u) - (np.arange(1, n + 1) / n)))
    assert ks < 1.63 / np.sqrt(n)  # Kolmogorov-Smirnov at the 1% level
    lag = np.corrcoef(u[:-1], u[1:])[0, 1]
    assert abs(lag) < 0.01


def test_row_uniforms_uses_the_generator_only_for_unseeded_rows() -> None:
    seeds: list[int | None] = [5, None, 7, None, None]
    positions = [0, 1, 2, 3, 4]
    gen = torch.Generator().manual_seed(42)
    out = row_uniforms(seeds, positions, gen, torch.device("cpu"))
    twin = torch.Generator().manual_seed(42)
    drawn = torch.rand(3, dtype=torch.float64, generator=twin)
    assert out[0].item() == seeded_uniform(5, 0) and out[2].item() == seeded_uniform(7, 2)
    assert torch.equal(out[[1, 3, 4]], drawn)
    assert torch.equal(gen.get_state(), twin.get_state())
    seeded_only = row_uniforms([1, 2], [0, 0], gen, torch.device("cpu"))
    assert torch.equal(gen.get_state(), twin.get_state())
    assert seeded_only.tolist() == [seeded_uniform(1, 0), seeded_uniform(2, 0)]
