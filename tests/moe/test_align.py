"""align_block_size equals a Python loop over experts, over many generated routings."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_kit.errors import ConfigError
from deepinfer_kit.moe.align import align_block_size, schedule_size


def loop_align(ids: list[list[int]], num_experts: int, block_m: int) -> tuple[list[int], list[int], list[int]]:
    """The spec: per expert, its flat positions in order, padded to a multiple of ``block_m``.

    Returns ``(row_source, tile_expert, counts)`` padded to the sizes of schedule_size.
    """
    flat = [e for row in ids for e in row]
    n = len(flat)
    row_source: list[int] = []
    tile_expert: list[int] = []
    counts = [0] * num_experts
    for expert in range(num_experts):
        mine = [p for p, e in enumerate(flat) if e == expert]
        counts[expert] = len(mine)
        tiles = -(-len(mine) // block_m)
        row_source += mine + [n] * (tiles * block_m - len(mine))
        tile_expert += [expert] * tiles
    rows, tiles = schedule_size(n, num_experts, block_m)
    assert len(row_source) <= rows and len(tile_expert) <= tiles, "schedule_size is not an upper bound"
    return row_source + [n] * (rows - len(row_source)), tile_expert + [-1] * (tiles - len(tile_expert)), counts


def random_ids(rng: random.Random) -> tuple[list[list[int]], int, int]:
    """A routing of one of several shapes: distinct ids per row (what routers give), all on
    one expert, a few hot experts with the rest empty, or repeats within a row."""
    experts = rng.randint(1, 12)
    block_m = rng.choice([1, 2, 3, 4, 8, 16])
    tokens = rng.choice([0, 1, 2, rng.randint(3, 80)])
    kind = rng.choice(["distinct", "one", "hot", "repeats"])
    if kind == "one":
        hot = rng.randrange(experts)
        return [[hot] for _ in range(tokens)], experts, block_m
    top_k = rng.randint(1, min(experts, 4))
    if kind == "distinct":
        return [rng.sample(range(experts), top_k) for _ in range(tokens)], experts, block_m
    pool = rng.sample(range(experts), rng.randint(1, experts)) if kind == "hot" else list(range(experts))
    return [[rng.choice(pool) for _ in range(top_k)] for _ in range(tokens)], experts, block_m


@pytest.mark.parametrize("seed", range(300))
def test_align_equals_python_loop(seed: int) -> None:
    ids, experts, block_m = random_ids(random.Random(seed))
    top_k = len(ids[0]) if ids else 2
    tensor = torch.tensor(ids, dtype=torch.int64).reshape(len(ids), top_k)
    got = align_block_size(tensor, experts, block_m)
    row_source, tile_expert, counts = loop_align(ids, experts, block_m)
    assert got.row_source.dtype == torch.int64 and got.row_source.tolist() == row_source
    assert got.tile_expert.dtype == torch.int32 and got.tile_expert.tolist() == tile_expert
    assert got.expert_counts.tolist() == counts
    assert (got.block_m, got.num_copies) == (block_m, len(ids) * top_k)


@pytest.mark.parametrize(
    ("copies", "experts", "block_m", "rows"),
    [(0, 8, 16, 0), (1, 8, 16, 16), (8, 256, 16, 128), (2, 1, 4, 4), (100, 4, 32, 224), (5, 3, 1, 5)],
)
def test_schedule_size_depends_on_sizes_only(copies: int, experts: int, block_m: int, rows: int) -> None:
    assert schedule_size(copies, experts, block_m) == (rows, rows // block_m)


def test_worst_case_fills_every_tile() -> None:
    # Every expert one copy past a tile boundary: the bound is reached exactly.
    block_m, experts = 4, 5
    ids = [[e] for e in range(experts) for _ in range(block_m + 1)]
    got = align_block_size(torch.tensor(ids), experts, block_m)
    rows, tiles = schedule_size(len(ids), experts, block_m)
    assert got.row_source.shape == (rows,) and bool((got.tile_expert >= 0).all())
    assert tiles == 2 * experts


def test_bad_input_rejected() -> None:
    with pytest.raises(ConfigError, match=r"expert_ids must be a \[T, k\] integer tensor"):
        align_block_size(torch.zeros(3, dtype=torch.int64), 4, 16)
    with pytest.raises(ConfigError, match="expert_ids must be a"):
        align_block_size(torch.zeros(3, 2), 4, 16)
    with pytest.raises(ConfigError, match="block_m must be >= 1, got 0"):
        align_block_size(torch.zeros(3, 2, dtype=torch.int64), 4, 0)
    with pytest.raises(ConfigError, match="num_experts must be >= 1, got 0"):
        schedule_size(3, 0, 16)
