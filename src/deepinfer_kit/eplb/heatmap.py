"""Expert-load heatmaps per GPU: text for a terminal, and a PNG when matplotlib is installed.

Shape symbols: ``L`` MoE layers, ``G`` GPUs.
"""

from __future__ import annotations

import os

import torch

from deepinfer_kit.eplb.evaluate import balancedness
from deepinfer_kit.errors import ConfigError

__all__ = ["text_heatmap", "save_heatmaps", "SHADES"]

SHADES = " .:-=+*#%@"
"""Ten shades, lightest first: a cell's shade is its load over the largest cell's, in tenths."""


def text_heatmap(load: torch.Tensor, title: str, *, scale: float | None = None) -> str:
    """Rows of ``load`` (``[L, G]`` tokens per GPU) as shaded cells with each GPU's share
    of its layer in percent, then the layer's balancedness (mean / max).

    Args:
        load: ``[L, G]``, any numeric dtype, CPU.
        title: the first line.
        scale: the load drawn darkest (default: the largest cell), so two maps drawn on
            one scale compare by eye.

    Returns:
        ``L + 2`` lines of text. Mutates nothing.

    Raises:
        ConfigError: ``load`` is not 2-D.
    """
    if load.dim() != 2:
        raise ConfigError(f"load must be [L, G], got shape {tuple(load.shape)}")
    g = load.double()
    top = scale if scale is not None else float(g.max()) if g.numel() else 0.0
    share = g / g.sum(dim=1, keepdim=True).clamp_min(1e-300)
    bal = balancedness(g)
    lines = [title, "layer " + "".join(f"{f'gpu{i}':>8}" for i in range(g.shape[1])) + "   mean/max"]
    for layer in range(g.shape[0]):
        cells = []
        for gpu in range(g.shape[1]):
            level = min(int(float(g[layer, gpu]) / top * len(SHADES)), len(SHADES) - 1) if top > 0 else 0
            cells.append(f"{SHADES[level] * 2}{float(share[layer, gpu]) * 100:5.1f}%")
        lines.append(f"{layer:5d} " + "".join(cells) + f"   {float(bal[layer]):.3f}")
    return "\n".join(lines)


def save_heatmaps(before: torch.Tensor, after: torch.Tensor, path: str | os.PathLike[str], title: str) -> None:
    """Write ``before`` and ``after`` (``[L, G]`` each) side by side, on one colour scale,
    as a PNG at ``path``.

    Raises:
        ConfigError: matplotlib is not installed (it is optional), or the shapes differ.
    """
    if before.shape != after.shape or before.dim() != 2:
        raise ConfigError(f"before and after must be [L, G] of one shape, got {tuple(before.shape)} and {tuple(after.shape)}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("a PNG heatmap needs matplotlib (pip install matplotlib)") from exc
    top = float(torch.maximum(before.max(), after.max())) if before.numel() else 1.0
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.2 * before.shape[1], 1.5 + 0.4 * before.shape[0]))
    for ax, load, name in zip(axes, (before, after), ("before", "after")):
        image = ax.imshow(load.double().numpy(), cmap="viridis", vmin=0.0, vmax=top, aspect="auto")
        bal = float(balancedness(load).mean())
        ax.set_title(f"{name} (mean/max {bal:.3f})")
        ax.set_xlabel("GPU")
        ax.set_ylabel("MoE layer")
    fig.colorbar(image, ax=list(axes), label="tokens in window")
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
